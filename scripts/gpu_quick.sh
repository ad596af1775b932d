#!/usr/bin/env bash
# A capped GPU pass for short leases (each step has a wall-clock cap so one slow step cannot
# eat the rest): warm the kernel cache, W=1 benchmarks (the figures the bars name), then the
# op tests for W = 1, 2, 4, 8 sharing the GPU. scripts/gpu_check.sh is the full, uncapped one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(pwd)/out}"; mkdir -p "$OUT"
export PYTHONPATH="$(pwd)" PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0
export CUFLUX_CACHE_DIR="${CUFLUX_CACHE_DIR:-/tmp/cuflux-cache}"
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
T="$OUT/tests.log"; B="$OUT/bench.log"
step() { local cap=$1; shift; echo "=== [$cap s] $*" | tee -a "$LOG"; timeout "$cap" "$@" >>"$LOG" 2>&1; echo "=== rc=$?" | tee -a "$LOG"; }
LOG=$B
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >>"$B"
step 60 python -c "import cupy, cuflux; from cuflux import kernels; [kernels.load(f) for f in ('signal.cu','allreduce.cu','all2all.cu','gemm.cu','ag_gemm.cu')]"
for op in allgather allreduce all2all; do step 45 "${MPI[@]}" -np 1 python -m cuflux.bench $op --quick --outdir "$OUT"; done
LOG=$T
CUFLUX_TEST_WORLD_SIZES=1,2,4,8 step 120 python -m pytest -q -rf --durations=5 tests/test_allreduce.py
CUFLUX_TEST_WORLD_SIZES=1,2,4,8 step 120 python -m pytest -q -rf --durations=5 tests/test_all2all.py
CUFLUX_TEST_WORLD_SIZES=8 step 40 python -m pytest -q -rf tests/test_gpu_runtime.py -k "exact or symmetric or flags"
CUFLUX_TEST_WORLD_SIZES=2 step 30 python -m pytest -q -rf tests/test_gpu_runtime.py -k "timeout"
CUFLUX_TEST_WORLD_SIZES=1,2 step 40 python -m pytest -q -rf tests/test_gemm.py -k "every_hopper_config or hooks or bounded"
CUFLUX_TEST_WORLD_SIZES=1,2,4,8 step 300 python -m pytest -q -rf --durations=5 tests/test_ag_gemm.py
LOG=$B
step 120 "${MPI[@]}" -np 1 python -m cuflux.bench ag_gemm --quick --outdir "$OUT"
step 45 "${MPI[@]}" -np 1 python -m cuflux.bench gemm --quick --iters 20 --outdir "$OUT"
grep -E "^=== |passed|failed|FAILED|Error" "$T" | tail -40
tail -60 "$B"
