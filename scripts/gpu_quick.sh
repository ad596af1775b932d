#!/usr/bin/env bash
# Capped GPU passes for short leases. Names one or more groups; the groups' tests run
# (each group's steps in order, its own log), then the groups' benchmarks run
# one after the other with the GPU to themselves, so figures never share the GPU with tests:
#   bash scripts/gpu_quick.sh runtime comm rs ag   # tests group by group, then benches alone
# Groups: runtime (runtime + AllGather), comm (AllReduce(+RMSNorm), All2AllHeads), gemm,
# rs (GemmReduceScatter), ag (AllGatherGemm). Every step has a wall-clock cap.
# Bench-only groups (name them in CUFLUX_BENCH_GROUPS): multi (W = 2 benches).
# a2a: the All2AllHeads tests alone. rs2 / ag2: the rest of the GemmReduceScatter / AllGatherGemm tests, all W (no benches).
# CUFLUX_BENCH_GROUPS="rs ag" benches only those groups ("none": no benches; default: the
# groups named).
# CUFLUX_TEST_BUDGET_S (default 360) bounds the test phase of all groups together.
# Concurrent groups time-slice the one GPU and multiply CUDA contexts (a 4-group run on the
# H200 ran out of memory creating contexts and every group ran past its cap): CUFLUX_PAR=1 only
# for small groups. Default is one group after the other.
# A cubin cache compiled elsewhere (same NVRTC major.minor) can be carried in .cubins/; new
# cubins compiled here come back in $OUT/logs.tgz under cubins/ for the next lease.
# scripts/gpu_check.sh is the full, uncapped run of everything.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: gpu_quick.sh GROUP...  (runtime comm gemm rs ag)"; exit 2; }
OUT="${OUT:-$(pwd)/out}"; mkdir -p "$OUT/logs"
export PYTHONPATH="$(pwd)" PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=32
export CUFLUX_CACHE_DIR="${CUFLUX_CACHE_DIR:-/tmp/cuflux-cache}"
mkdir -p "$CUFLUX_CACHE_DIR"; [ -d .cubins ] && cp -n .cubins/* "$CUFLUX_CACHE_DIR"/ 2>/dev/null
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
L="$OUT/logs"; B="$L/bench.log"
step() { local log=$1 cap=$2; shift 2; echo "=== [$cap s] $*" >>"$log"; local t0=$SECONDS
         timeout "$cap" "$@" >>"$log" 2>&1; echo "=== rc=$? in $((SECONDS - t0)) s" >>"$log"; }
tests() { local g=$1 ws=$2 cap=$3; shift 3; cap=$(( cap < TEST_END - SECONDS ? cap : TEST_END - SECONDS ))
          [ "$cap" -gt 5 ] || { echo "=== skipped (test budget spent): $*" >>"$L/tests-$g.log"; return; }
          CUFLUX_TEST_WORLD_SIZES=$ws step "$L/tests-$g.log" "$cap" python -m pytest -q -rf --durations=5 "$@"; }
bench() { step "$B" "$1" "${MPI[@]}" -np "$2" python -m cuflux.bench "$3" --quick --outdir "$L"; }
export CUFLUX_FAIL_LOG="$L/failures.log"  # tests/mpi.py writes each failure there at once

tests_runtime() { tests runtime 1,2,4,8 400 tests/test_gpu_runtime.py; }
tests_a2a() { tests comm 1,2,4,8 200 tests/test_all2all.py; }
tests_comm() { tests comm 1,2,4,8 220 tests/test_allreduce.py; tests_a2a; }
tests_gemm() { tests gemm 1,2,4 300 tests/test_gemm.py; }
tests_rs() {  # most telling first: bit-exact routing names the first wrong element
  tests rs 1,2 90 -x tests/test_gemm_rs.py -k "exact_routing or reduce_scatter_only"
  tests rs 2 60 tests/test_gemm_rs.py -k "timeout or bad_input"; }
tests_rs2() { tests rs 1,2,4,8 ${CUFLUX_RS2_CAP_S:-300} tests/test_gemm_rs.py -k "float_sweep or back_to_back or exact_routing"; }
tests_ag() { tests ag 2 120 -x tests/test_ag_gemm.py -k "late_peer or (matches and sm90) or timeout"; }
tests_ag2() { tests ag 1,2,4,8 300 tests/test_ag_gemm.py -k "not late_peer"; }
bench_runtime() { for W in 1 2 8; do bench 40 "$W" allgather; done; }
bench_comm() { bench 45 1 allreduce; bench 45 1 all2all; }
bench_gemm() { step "$B" 150 "${MPI[@]}" -np 1 python -m cuflux.bench gemm --iters 20 --outdir "$L"; }
# W = 1 fused-vs-GEMM-only bars: 3-4x the default iterations (50 left a 2-3 % spread between runs)
bench_rs() { step "$B" 150 "${MPI[@]}" -np 1 python -m cuflux.bench gemm_rs --quick --iters 150 --outdir "$L"; }
bench_none() { :; }
tests_none() { :; }  # benches only: CUFLUX_BENCH_GROUPS=multi gpu_quick.sh none
bench_ag() { step "$B" 120 "${MPI[@]}" -np 1 python -m cuflux.bench ag_gemm --quick --iters 200 --outdir "$L"; }
# W = 2 sharing the GPU: checks the multi-rank benchmark paths run (chunk_rows sweep, one-/two-shot
# columns); the figures measure time-slicing, not links.
bench_multi() { bench 150 2 ag_gemm; bench 120 2 gemm_rs; bench 60 2 allreduce; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >>"$B"
python -c "from cuda.bindings import nvrtc; print('NVRTC', nvrtc.nvrtcVersion()[1:])" >>"$B" 2>&1
step "$B" 240 python -c "from cuflux import kernels; [kernels.load(f) for f in kernels.families()]"
# (above: one compile of everything missing from the cache, before ranks race for it)
TEST_END=$((SECONDS + ${CUFLUX_TEST_BUDGET_S:-360}))  # tests of all groups end by then
for g in "$@"; do
  declare -F "tests_$g" >/dev/null || { echo "unknown group $g"; exit 2; }
  if [ "${CUFLUX_PAR:-0}" = 1 ]; then "tests_$g" & else "tests_$g"; fi
done
wait
for g in ${CUFLUX_BENCH_GROUPS:-$@}; do declare -F "bench_$g" >/dev/null && "bench_$g"; done
mkdir -p "$L/cubins"; for f in "$CUFLUX_CACHE_DIR"/*; do
  [ -e ".cubins/$(basename "$f")" ] || [[ "$f" == */load-* ]] || cp "$f" "$L/cubins/"; done
tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$L/cubins"
for f in "$L"/tests-*.log "$L/failures.log"; do [ -e "$f" ] || continue; echo "##### $f"; grep -E "^=== |passed|failed|FAILED|Error" "$f" | tail -25; done
echo "##### bench"; grep -vE "^\s*$" "$B" | tail -70
