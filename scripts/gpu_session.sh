#!/usr/bin/env bash
# One device call of this session's checks: the host-path probe, the tests touched by the host
# path / graph work (W = 1, 2 sharing the GPU unless CUFLUX_TEST_WORLD_SIZES says otherwise), then
# quick benches. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(pwd)/out}"; mkdir -p "$OUT"
export PYTHONPATH="$(pwd)" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export CUFLUX_CACHE_DIR="${CUFLUX_CACHE_DIR:-/tmp/cuflux-cache}"
mkdir -p "$CUFLUX_CACHE_DIR"; chmod 700 "$CUFLUX_CACHE_DIR"
[ -d .cubins ] && cp -n .cubins/* "$CUFLUX_CACHE_DIR"/ 2>/dev/null
L="$OUT/log.txt"
step() { local cap=$1; shift; echo "=== [$cap s] $*" >>"$L"; local t0=$SECONDS
         timeout "$cap" "$@" >>"$L" 2>&1; echo "=== rc=$? in $((SECONDS - t0)) s" >>"$L"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv >>"$L"
step 240 python -c "from cuflux import kernels; [kernels.load(f) for f in kernels.families()]"
for s in ${CUFLUX_SESSION_STEPS:-probe tests benches}; do
  case $s in
    probe) step 120 python scripts/probe_host.py ;;
    tests) export CUFLUX_TEST_WORLD_SIZES=${CUFLUX_TEST_WORLD_SIZES:-1,2}
           CUFLUX_TEST_WORLD_SIZES=1,2,4,8 step ${CUFLUX_TEST_CAP_S:-300} python -m pytest -q -rf \
             --durations=5 tests/test_graphs.py tests/test_base.py ;
           step ${CUFLUX_TEST_CAP_S:-300} python -m pytest -q -rf --durations=5 tests/test_reliability.py \
             tests/test_gemm.py -k "cublas or graph or auto or matches_float64 or tuner or reliab or sub or abort or device or watchdog" ;
           step ${CUFLUX_TEST_CAP_S:-300} python -m pytest -q -rf --durations=5 tests/test_allreduce.py \
             tests/test_all2all.py tests/test_gpu_runtime.py ;
           step ${CUFLUX_TEST_CAP_S:-300} python -m pytest -q -rf --durations=5 tests/test_gemm_rs.py \
             tests/test_ag_gemm.py -k "exact_routing or timeout or bad_input or matches" ;;
    benches) for b in ${CUFLUX_SESSION_BENCHES:-gemm allreduce all2all}; do
               step 150 python -m cuflux.bench $b --quick --outdir "$OUT"; done ;;
  esac
done
grep -E "^=== |passed|failed|FAILED|Error|us$" "$L" | tail -80
