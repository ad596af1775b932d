#!/usr/bin/env bash
# Ranks on distinct GPUs (a multi-GPU lease, e.g. nvidia-h200-x2): the benchmarks' NCCL
# baselines and link fractions, then the GPU tests at W = number of GPUs, most telling first.
# Every step capped; logs and JSON under $OUT/multi.
#   bash scripts/gpu_multi.sh            # W = GPU count
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(pwd)/out}"; L="$OUT/multi"; mkdir -p "$L"
export PYTHONPATH="$(pwd)" PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0
export CUFLUX_CACHE_DIR="${CUFLUX_CACHE_DIR:-/tmp/cuflux-cache}"
mkdir -p "$CUFLUX_CACHE_DIR"; [ -d .cubins ] && cp -n .cubins/* "$CUFLUX_CACHE_DIR"/ 2>/dev/null
W=$(nvidia-smi -L | wc -l)
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$W")
step() { local log=$1 cap=$2; shift 2; echo "=== [$cap s] $*" >>"$L/$log"; local t0=$SECONDS
         timeout "$cap" "$@" >>"$L/$log" 2>&1; echo "=== rc=$? in $((SECONDS - t0)) s" >>"$L/$log"; }
nvidia-smi topo -m >"$L/topo.txt" 2>&1
step bench.log 60 "${MPI[@]}" python -m cuflux.bench all2all --quick --outdir "$L"
step bench.log 60 "${MPI[@]}" python -m cuflux.bench allreduce --quick --outdir "$L"
export CUFLUX_TEST_WORLD_SIZES=$W
step tests.log 90 python -m pytest -q -rf tests/test_all2all.py tests/test_allreduce.py
step bench.log 90 "${MPI[@]}" python -m cuflux.bench gemm_rs --quick --outdir "$L"
step bench.log 90 "${MPI[@]}" python -m cuflux.bench ag_gemm --quick --outdir "$L"
step bench.log 60 "${MPI[@]}" python -m cuflux.bench allgather --quick --outdir "$L"
step tests.log 120 python -m pytest -q -rf tests/test_gpu_runtime.py tests/test_gemm_rs.py tests/test_ag_gemm.py
grep -E "^=== |passed|failed" "$L/tests.log"; grep -vE "^\s*$" "$L/bench.log" | cut -c1-220 | tail -80
