#!/usr/bin/env bash
# The project's one GPU runner (the lent machines): capped groups of GPU tests, then their
# benchmarks with the GPU to themselves, logs and JSON under $OUT (packed in $OUT/logs.tgz).
#   bash scripts/gpu.sh GROUP...           tests of the groups one after the other, then benches
#   bash scripts/gpu.sh all [-k EXPR]      every GPU test at W = 1, 2, 4, 8, then quick benches
#   bash scripts/gpu.sh multi              ranks on distinct GPUs (W = GPU count): the comm
#                                          benches with their NCCL baselines, their tests at W
#   bash scripts/gpu.sh multi-gemm         the same for gemm_rs, ag_gemm, across (second call)
#   bash scripts/gpu.sh multi-tests        the other GPU tests at W = GPU count (third call)
# Every run ends with `python -m cuflux.bench bars` on the JSON it wrote (the issues' bars).
#   bash scripts/gpu.sh pytest NAME WS CAP ARGS...   one capped pytest run (log tests-NAME.log)
# Groups (tests; the benches of the groups named run after all tests):
#   runtime   World, nodes, rails, symmetric memory, AllGather, watchdog, reliability | allgather
#   nodes     the cross-node ops and rails alone (also in runtime): issue 20, emulated nodes
#   gather    AllGather alone, both paths (also in runtime): ~240 s at W = 1..8, the sm path's
#             spinning kernels advancing only as ranks time-slice the GPU
#   comm      AllReduce(+RMSNorm), All2AllHeads                          | allreduce, all2all W=1
#   a2a       All2AllHeads alone
#   gemm      cuflux.gemm (both cores, cuBLAS route, tuner, graphs)     | gemm W=1
#   rs / rs2  GemmReduceScatter: most telling first / the rest           | gemm_rs W=1
#   ag / ag2  AllGatherGemm: most telling first / the rest               | ag_gemm W=1
#   graphs    CUDA-graph capture of every op, and the op base (CommOp)
#   fail      a late rank told through the failure board; calls queued behind a failed wait;
#             device epochs past 2^31 (W = 2, 4)
#   campaign  scripts/campaign.py: 10,000 checked calls per op at W = 2 and 4; kill -9 at W = 2
#   sanitize  compute-sanitizer memcheck / racecheck / synccheck, every op, W = 1 and 2
#   torch     cuflux.torch layers, torch in / torch out, torch calls replayed, init over gloo
#             (examples: a group of its own)                             | torch W=1
#   examples  every scripts/examples/ script at W = 2 (mpirun)
#   torchrun  the same under torchrun (torch.distributed.run --nproc-per-node 2)
#   probe     the host-path probes (scripts/probe_host.py, scripts/probe_launch.py)
#   quick     the README quick start at W = 2 (scripts/quickstart.py)
#   multi2    W = 2 benches with ranks sharing the GPU (the paths run; no speed measured)
#   across    the cross-node ops at W = 2 as two emulated nodes, ranks sharing the GPU (the
#             paths run; no speed measured; `multi` measures them on distinct GPUs)
# Environment: CUFLUX_BENCH_GROUPS="rs ag" benches only those ("none": no benches);
# CUFLUX_TEST_BUDGET_S (default 360) bounds the tests of all groups together;
# CUFLUX_TEST_WORLD_SIZES (default 1,2,4,8) the world sizes of the tests;
# CUFLUX_MULTI_W (default: the GPU count) the multi arms' W: a rehearsal of them on one GPU
# (ranks share it: the scripts and paths run, no speed is measured, no NCCL baseline);
# CUFLUX_SANITIZE_TOOLS / _WS / _CAP_S (default "memcheck racecheck synccheck", "1 2", 120) what
# the sanitize group runs: which tools, at which world sizes, for how many seconds each.
# A cubin cache compiled elsewhere with the same NVRTC (bash scripts/precompile.sh) can be
# carried in .cubins/; cubins compiled here come back in $OUT/logs.tgz under cubins/.
# Everything comes back in $OUT/logs.tgz alone (the device tool returns at most 8 files):
# give each run of this script in one call its own OUT ($OUT/a, $OUT/b, ...);
# CUFLUX_KEEP_LOGS=1 keeps the loose logs beside the archive.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n "2,/^set -uo/{/^#/p}" "$0"; exit 2; }
OUT="${OUT:-$(pwd)/out}"; L="$OUT/logs"; mkdir -p "$L"; B="$L/bench.log"
export PYTHONPATH="$(pwd)" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# NCCL's own warnings in the logs: a NcclError of CuPy's says only "run with NCCL_DEBUG=INFO",
# and the first NCCL run between GPUs should not need a second device call to be read.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export CUFLUX_CACHE_DIR="${CUFLUX_CACHE_DIR:-/tmp/cuflux-cache}"
export CUFLUX_TEST_WORLD_SIZES="${CUFLUX_TEST_WORLD_SIZES:-1,2,4,8}"
export CUFLUX_FAIL_LOG="$L/failures.log"  # tests/mpi.py writes each failure there at once
mkdir -p "$CUFLUX_CACHE_DIR"; chmod 700 "$CUFLUX_CACHE_DIR"
[ -d .cubins ] && cp -n .cubins/* "$CUFLUX_CACHE_DIR"/ 2>/dev/null
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
# Ranks left by an earlier step or call (a warm machine is reused) hold GPU memory: sweep them.
# Only processes whose command starts with python: the device tool's own shell carries the
# whole command line of the call, and a call that names a script here was killed with it.
sweep() { pkill -9 -f "^([^ ]*/)?python[0-9.]* .*(tests.rank_main|cuflux.bench|cuflux-campaign-rank|\
scripts/(examples/)?[a-z_]+\.py)" 2>/dev/null; }
step() { local log=$1 cap=$2; shift 2; echo "=== [$cap s] $*" >>"$log"; local t0=$SECONDS
         timeout -k 10 "$cap" "$@" >>"$log" 2>&1; echo "=== rc=$? in $((SECONDS - t0)) s" >>"$log"
         sweep; }
TEST_END=$((SECONDS + ${CUFLUX_TEST_BUDGET_S:-360}))
tests() { local g=$1 ws=$2 cap=$3; shift 3; cap=$(( cap < TEST_END - SECONDS ? cap : TEST_END - SECONDS ))
          [ "$cap" -gt 5 ] || { echo "=== skipped (test budget spent): $*" >>"$L/tests-$g.log"; return; }
          CUFLUX_TEST_WORLD_SIZES=$ws step "$L/tests-$g.log" "$cap" python -m pytest -q -rf -m gpu \
            --durations=5 "$@"; }
bench() { step "$B" "$1" "${MPI[@]}" -np "$2" python -m cuflux.bench "$3" --quick --outdir "$L" "${@:4}"; }
WS=$CUFLUX_TEST_WORLD_SIZES
multi_w() { echo "${CUFLUX_MULTI_W:-$(nvidia-smi -L | wc -l)}"; }  # the multi arms' W

tests_runtime() { tests runtime "$WS" 400 tests/test_runtime.py tests/test_allgather.py \
                   tests/test_reliability.py tests/test_nodes.py tests/test_rail.py; }
tests_nodes() { tests nodes "$WS" 300 tests/test_nodes.py tests/test_rail.py; }
tests_gather() { tests gather "$WS" 300 tests/test_allgather.py; }
tests_a2a() { tests comm "$WS" 200 tests/test_all2all.py; }
tests_comm() { tests comm "$WS" 220 tests/test_allreduce.py; tests_a2a; }
tests_gemm() { tests gemm 1,2,4 300 tests/test_gemm.py; }
tests_rs() {  # most telling first: bit-exact routing names the first wrong element
  tests rs 1,2 90 -x tests/test_gemm_rs.py -k "exact_routing or reduce_scatter_only"
  tests rs 2 60 tests/test_gemm_rs.py -k "timeout or bad_input"; }
tests_rs2() { tests rs "$WS" 300 tests/test_gemm_rs.py -k "float_sweep or back_to_back or exact_routing"; }
tests_ag() { tests ag 2 120 -x tests/test_ag_gemm.py -k "late_peer or (matches and sm90) or timeout"; }
tests_ag2() { tests ag "$WS" 300 tests/test_ag_gemm.py -k "not late_peer"; }
tests_fail() {  # #19: a late rank is told (failure board); calls queued behind a failed wait
  # store nothing (guards: AllGather); device epochs past 2^31 and 2^32 (GemmReduceScatter too)
  tests fail 2,4 200 tests/test_reliability.py tests/test_allreduce.py tests/test_all2all.py \
    tests/test_gemm_rs.py -k "told or epochs_past or queued"; }
tests_campaign() {  # #19's campaigns (README figures): kill -9 W = 2, soak W = 2 and 4. A whole
  # device call: six ops x 10,000 calls with ranks time-sharing one GPU take minutes a W
  # (AllReduce alone: 33 s at W = 2, 97 s at W = 4 on the H200)
  step "$L/campaign.log" 100 python scripts/campaign.py kill --world 2 --outdir "$L"
  step "$L/campaign.log" 240 "${MPI[@]}" -np 2 python scripts/campaign.py soak --outdir "$L"
  step "$L/campaign.log" 240 "${MPI[@]}" -np 4 python scripts/campaign.py soak --calls 3000 \
    --outdir "$L"; }
tests_sanitize() {  # compute-sanitizer on small calls of every op (CUFLUX_SANITIZE_TOOLS, _WS,
  # _CAP_S: which tools, world sizes, seconds a run; default all three, W = 1 and 2, 120 s)
  for tool in ${CUFLUX_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    for W in ${CUFLUX_SANITIZE_WS:-1 2}; do
      # API errors are not reported: cuda-bindings resolves every driver entry point at its
      # first call, and each one this driver lacks is a cuGetProcAddress INVALID_VALUE (34 on
      # driver 580); cuflux checks every driver call it makes and raises on a failure itself.
      step "$L/sanitize.log" "${CUFLUX_SANITIZE_CAP_S:-120}" "${MPI[@]}" -np $W compute-sanitizer \
        --tool $tool --report-api-errors no --error-exitcode 9 python scripts/campaign.py small
    done; done; }
tests_graphs() { tests graphs "$WS" 300 tests/test_graphs.py tests/test_base.py; }
tests_torch() { tests torch 1,2,4 180 tests/test_torch.py tests/test_all2all.py \
                 tests/test_allgather.py -k torch; }
examples() {  # every example under the launcher "$@" (ranks may share the GPU: correctness)
  step "$L/examples.log" 90 "$@" scripts/examples/mlp_tp_sp.py \
    --tokens 1024 --hidden 1024 --ffn 4096 --iters 5
  for x in attention_tp_sp ulysses_long train_step; do
    step "$L/examples.log" 90 "$@" "scripts/examples/$x.py"; done; }
tests_examples() { examples "${MPI[@]}" -np 2 python; }
tests_torchrun() { examples python -m torch.distributed.run --standalone --nproc-per-node 2; }
tests_probe() { step "$L/probe.log" 120 python scripts/probe_host.py
                step "$L/probe.log" 120 python scripts/probe_launch.py; }
tests_quick() { step "$L/quick.log" 60 "${MPI[@]}" -np 2 python scripts/quickstart.py; }
tests_multi2() { :; }
tests_across() { :; }
bench_runtime() { for W in 1 2 8; do bench 40 "$W" allgather; done; }
bench_comm() { bench 45 1 allreduce; bench 45 1 all2all; }
bench_a2a() { bench 45 1 all2all; }
bench_torch() { bench 120 1 torch; }  # torch callers' host path (python -m cuflux.bench torch)
bench_gemm() { step "$B" 150 "${MPI[@]}" -np 1 python -m cuflux.bench gemm --iters 20 --outdir "$L"; }
# W = 1 fused-vs-GEMM-only bars: 3-4x the default iterations (50 left a 2-3 % spread between runs)
bench_rs() { bench 150 1 gemm_rs --iters 150; }
bench_ag() { bench 120 1 ag_gemm --iters 200; }
bench_across() { CUFLUX_NODE_SIZE=1 bench 150 2 across; }
bench_multi2() { bench 150 2 ag_gemm; bench 120 2 gemm_rs; bench 120 2 allreduce; bench 90 2 all2all; }

finish() {
  # the issues' bars on the JSON this run wrote (cuflux/bench/bars.py); its own JSON beside
  # them. EXPECT (the multi arms): the benches the run meant to write, each one missing a miss.
  if ls "$L"/*.json >/dev/null 2>&1 || [ -n "${EXPECT:-}" ]; then
    python -m cuflux.bench bars "$L" --expect "${EXPECT:-}" >"$L/bars.log" 2>&1; fi
  mkdir -p "$L/cubins"; for f in "$CUFLUX_CACHE_DIR"/*; do
    [ -e ".cubins/$(basename "$f")" ] || cp "$f" "$L/cubins/" 2>/dev/null; done
  tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$L/cubins"
  for f in "$L"/tests-*.log "$L"/failures.log "$L"/probe.log "$L"/quick.log "$L"/examples.log \
           "$L"/campaign.log "$L"/sanitize.log; do
    [ -e "$f" ] || continue; echo "##### $f"
    grep -E "^=== |passed|failed|FAILED|Error| us$|^soak |^small |\"ok\"|ERROR SUMMARY" "$f" | tail -30; done
  [ -e "$B" ] && { echo "##### bench"; grep -vE "^\s*$" "$B" | cut -c1-220 | tail -70; }
  [ -e "$L/bars.log" ] && { echo "##### bars"; grep -E "^issue|MISSED|Error" "$L/bars.log" \
    | cut -c1-220 | tail -40; grep -E "^bars" "$L/bars.log"; }
  # The device tool returns at most 8 files from $OUT: keep the archive alone (every log and
  # JSON is in it; `tar -xzf logs.tgz` here), so several runs of this script fit in one call.
  [ "${CUFLUX_KEEP_LOGS:-0}" = 1 ] || rm -rf "$L"
}

sweep
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv >>"$B" 2>&1
python -c "from cuda.bindings import nvrtc; print('NVRTC', nvrtc.nvrtcVersion()[1:])" >>"$B" 2>&1
# One compile of everything missing from the cache, before ranks wait on each other for it.
step "$B" 240 python -c "from cuflux import kernels; [kernels.load(f) for f in kernels.families()]"

case $1 in
  all)
    shift
    step "$L/tests-all.log" 3000 python -m pytest -q -rf -m gpu --durations=12 "$@" tests
    for W in 1 2 4 8; do bench 60 "$W" allgather; done
    bench_comm; finish ;;
  multi)  # one device call (< 10 minutes): the collectives' benchmarks, ranks on distinct
    # GPUs (issues 14, 16, 17), their tests and the cross-node ones at that W; the GEMM
    # benchmarks: multi-gemm
    W=$(multi_w); EXPECT=all2all,allreduce,allgather
    nvidia-smi topo -m >"$L/topo.txt" 2>&1
    bench 90 "$W" all2all; bench 180 "$W" allreduce; bench 60 "$W" allgather
    # test_nodes: every op across emulated nodes (node size 1: the NCCL rail between the
    # GPUs, issue 20), exact against its reference
    CUFLUX_TEST_WORLD_SIZES=$W step "$L/tests-multi.log" 200 python -m pytest -q -rf -m gpu \
      tests/test_all2all.py tests/test_allreduce.py tests/test_nodes.py
    finish ;;
  multi-gemm)  # a second device call: the GEMM benchmarks (issues 14, 15) and the cross-node
    # ops with each GPU a node (issue 20), ranks on distinct GPUs
    W=$(multi_w); EXPECT=gemm_rs,ag_gemm
    bench 150 "$W" gemm_rs; bench 150 "$W" ag_gemm
    if [ "$W" -gt 1 ]; then  # one rank is one node: nothing crosses (the bench says so)
      EXPECT=$EXPECT,across
      CUFLUX_NODE_SIZE=1 bench 150 "$W" across  # issue 20: each GPU a node, NCCL between
    fi
    finish ;;
  pytest)  # one capped pytest run of chosen tests: pytest NAME WS CAP PYTEST-ARGS...
    TEST_END=$((SECONDS + $4)); tests "$2" "$3" "$4" "${@:5}"; finish ;;
  multi-tests)  # a third device call: every GPU test at W = GPU count, a rank per GPU
    W=$(multi_w)
    CUFLUX_TEST_WORLD_SIZES=$W step "$L/tests-multi.log" 540 python -m pytest -q -rf -m gpu \
      tests/test_runtime.py tests/test_allgather.py tests/test_reliability.py tests/test_graphs.py \
      tests/test_base.py tests/test_gemm_rs.py tests/test_ag_gemm.py tests/test_torch.py \
      tests/test_rail.py
    finish ;;
  *)
    for g in "$@"; do
      declare -F "tests_$g" >/dev/null || { echo "unknown group $g"; exit 2; }
      "tests_$g"
    done
    for g in ${CUFLUX_BENCH_GROUPS:-$@}; do declare -F "bench_$g" >/dev/null && "bench_$g"; done
    finish ;;
esac
