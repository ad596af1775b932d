#!/usr/bin/env bash
# The session's last device call: what changed since the previous checks, capped per step.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(pwd)/out}"; mkdir -p "$OUT"; L="$OUT/final.txt"
export PYTHONPATH="$(pwd)" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUFLUX_TEST_WORLD_SIZES=1,2
export CUFLUX_CACHE_DIR=/tmp/cc; mkdir -p $CUFLUX_CACHE_DIR; chmod 700 $CUFLUX_CACHE_DIR
cp -n .cubins/* $CUFLUX_CACHE_DIR/ 2>/dev/null
MPI=(mpirun --allow-run-as-root --oversubscribe -np 2)
step() { local cap=$1; shift; echo "=== [$cap s] $*" >>"$L"; local t0=$SECONDS
         timeout "$cap" "$@" >>"$L" 2>&1; echo "=== rc=$? in $((SECONDS - t0)) s" >>"$L"; }
step 60 python -m pytest -q -rf -x tests/test_gemm.py -k "hooks or tuner or cublas or graph or auto"
step 80 python -m pytest -q -rf tests/test_gemm_rs.py tests/test_ag_gemm.py -k "exact_routing or timeout or bad_input or matches"
step 40 python -m pytest -q -rf tests/test_graphs.py -k "gemm_rs or refuse"
step 80 python -m pytest -q -rf tests/test_torch.py tests/test_all2all.py tests/test_gpu_runtime.py -k torch
step 30 "${MPI[@]}" python scripts/quickstart.py
step 40 "${MPI[@]}" python scripts/examples/mlp_tp_sp.py --tokens 1024 --hidden 1024 --ffn 4096 --iters 5
grep -E "^=== |passed|failed|FAILED|Error|speed" "$L" | tail -60
