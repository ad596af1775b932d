#!/usr/bin/env bash
# The one command for the GPU machine: every GPU test for W = 1, 2, 4, 8 (ranks sharing the
# GPU), then the quick benchmarks. Logs (and benchmark JSON) go under $OUT when it is set.
#   bash scripts/gpu_check.sh [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(pwd)/out}"
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
export CUFLUX_TEST_WORLD_SIZES="${CUFLUX_TEST_WORLD_SIZES:-1,2,4,8}"
export CUFLUX_CACHE_DIR="${CUFLUX_CACHE_DIR:-/tmp/cuflux-cache}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
KEXPR="${1:-}"
python -m pytest -q -x --durations=12 ${KEXPR:+-k "$KEXPR"} tests 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
for W in 1 2 4 8; do
  for op in ${CUFLUX_BENCH_OPS:-allgather}; do
    "${MPI[@]}" -np "$W" python -m cuflux.bench "$op" --quick --outdir "$OUT" 2>&1 \
      | tee -a "$OUT/bench.log"
  done
done
exit "$rc"
