#!/usr/bin/env bash
# Capped GPU passes for short leases, one group per device call (each fits one 10-minute call;
# every step has a wall-clock cap so a slow step cannot eat the rest):
#   bash scripts/gpu_quick.sh runtime   # runtime + AllGather tests W=1,2,4,8, AllGather bench
#   bash scripts/gpu_quick.sh comm      # AllReduce(+RMSNorm), All2AllHeads: tests and benches
#   bash scripts/gpu_quick.sh gemm      # GEMM core tests and bench
#   bash scripts/gpu_quick.sh rs        # GemmReduceScatter: tests (most telling first) and bench
#   bash scripts/gpu_quick.sh ag        # AllGatherGemm: tests, the reshaped AllGather, bench
# scripts/gpu_check.sh is the full, uncapped run of everything.
set -uo pipefail
cd "$(dirname "$0")/.."
GROUP="${1:?usage: gpu_quick.sh runtime|comm|gemm|rs|ag}"
OUT="${OUT:-$(pwd)/out}"; mkdir -p "$OUT"
export PYTHONPATH="$(pwd)" PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
export CUFLUX_CACHE_DIR="${CUFLUX_CACHE_DIR:-/tmp/cuflux-cache}"
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
T="$OUT/tests.log"; B="$OUT/bench.log"; LOG=$B
step() { local cap=$1; shift; echo "=== [$cap s] $*" | tee -a "$LOG"; timeout "$cap" "$@" >>"$LOG" 2>&1; echo "=== rc=$?" | tee -a "$LOG"; }
warm() { step "$1" python -c "import cupy, cuflux, sys; from cuflux import kernels; [kernels.load(f) for f in sys.argv[1:]]" "${@:2}"; }
bench() { step "$1" "${MPI[@]}" -np "$2" python -m cuflux.bench "$3" --quick --outdir "$OUT"; }
tests() { local ws=$1 cap=$2; shift 2; LOG=$T; CUFLUX_TEST_WORLD_SIZES=$ws step "$cap" python -m pytest -q -rf --durations=5 "$@"; LOG=$B; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >>"$B"
case "$GROUP" in
  runtime)
    warm 30 signal.cu
    tests 1,2,4,8 420 tests/test_gpu_runtime.py
    for W in 1 2 8; do bench 40 "$W" allgather; done ;;
  comm)
    warm 60 signal.cu allreduce.cu all2all.cu
    bench 45 1 allreduce; bench 45 1 all2all
    tests 1,2,4,8 220 tests/test_allreduce.py
    tests 1,2,4,8 200 tests/test_all2all.py ;;
  gemm)
    warm 90 gemm.cu
    tests 1,2,4 300 tests/test_gemm.py
    step 150 "${MPI[@]}" -np 1 python -m cuflux.bench gemm --iters 20 --outdir "$OUT" ;;
  rs)  # most telling first: bit-exact routing names the first wrong element
    warm 150 gemm.cu gemm_rs.cu
    tests 1,2 90 -x tests/test_gemm_rs.py -k "exact_routing or reduce_scatter_only"
    tests 2 60 tests/test_gemm_rs.py -k "timeout or bad_input"
    tests 2,4 150 tests/test_gemm_rs.py -k "(float_sweep and sm90) or back_to_back"
    bench 90 1 gemm_rs ;;
  ag)
    warm 150 signal.cu gemm.cu ag_gemm.cu
    tests 2 120 -x tests/test_ag_gemm.py -k "late_peer or (matches and sm90) or timeout"
    tests 2 60 tests/test_gpu_runtime.py -k allgather
    tests 1,2 120 tests/test_ag_gemm.py -k "back_to_back or every or bad_input"
    bench 90 1 ag_gemm ;;
  *) echo "unknown group $GROUP"; exit 2 ;;
esac
grep -E "^=== |passed|failed|FAILED|Error" "$T" 2>/dev/null | tail -40
tail -60 "$B"
