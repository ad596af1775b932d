"""python -m cuflux.bench <op>|all [--quick] [--iters N] [--outdir DIR] [--plot]
(under mpiexec -n W for W ranks).
python -m cuflux.bench bars DIR [DIR...] [--outdir OUT]: the open issues' bars checked against
a run's JSON files (cuflux.bench.bars; no GPU needed).

The JSON results go to --outdir, by default ./cuflux-results/ under the working directory
(never inside the installed package). The project's own runs keep their record in the
repository with an explicit `--outdir scripts/results`. `--plot` then draws
<outdir>/<op>-speedup.png from the files this run wrote (cuflux.bench.plot; needs matplotlib).

This module also holds the pieces every benchmark shares beyond cuflux.bench.common: the
three user regimes of an op and its baselines (measure_regimes), the shared-GPU rule (no speed
is measured while ranks time-slice one GPU), and the knobs record written into each JSON.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pathlib
import sys

OPS = {"allgather": "cuflux.bench.allgather", "allreduce": "cuflux.bench.allreduce",
       "all2all": "cuflux.bench.all2all", "gemm": "cuflux.bench.gemm",
       "ag_gemm": "cuflux.bench.ag_gemm", "gemm_rs": "cuflux.bench.gemm_rs",
       "across": "cuflux.bench.across", "torch": "cuflux.bench.torch_calls"}
DEFAULT_OUTDIR = "cuflux-results"  # under the working directory

# ---- regimes ----------------------------------------------------------------------------------
REGIMES = ("user_loop_ms", "host_us", "graph_ms")
# Printed under "time-slicing, not speed" when ranks share a GPU.
REGIME_COLS = ["user_loop_ms", "baseline_user_loop_ms", "user_loop_speedup", "host_us",
               "baseline_host_us", "graph_ms", "baseline_graph_ms", "graph_speedup"]
REGIMES_DOC = """Regimes (columns):
  cuflux_ms / baseline_ms / speedup   GPU-queued: calls queued behind a hold (or interleaved
                                      rounds), GPU time per call (CUDA events)
  user_loop_ms, baseline_user_loop_ms back-to-back calls from Python, nothing held, wall time
                                      per call (what a decode step sees); user_loop_speedup =
                                      baseline_user_loop_ms / user_loop_ms
  host_us, baseline_host_us           host time per call alone (issued while the GPU is held)
  graph_ms, baseline_graph_ms         one CUDA graph of N calls replayed, GPU time per call
                                      (None where the op refuses capture); graph_speedup
An op and its baselines run their user regimes in interleaved rounds (REGIME_ROUNDS, the order
rotated), each figure the median over the rounds. With W > 1 every figure is the slowest
rank's."""


def regime_calls(ms, quick: bool = False, speed: bool = True) -> int:
    """Calls per timed loop of a regime, from the GPU-queued time of one call (ms, the slowest
    rank's, so every rank picks the same number): 10 above 1 ms, else 50 (--quick, or above
    0.1 ms) or 100. With ranks sharing a GPU (speed=False) only a few calls: correctness."""
    if not speed:
        return 4
    if ms is None or ms > 1.0:
        return 10
    return 50 if quick or ms > 0.1 else 100


def host_loop_calls(calls: int) -> int:
    """Calls of a regime's host_us loop: at least common.HOST_CALLS wherever speed is measured
    (regime_calls chose 10 or more), whatever a call's GPU time: the loop is issued behind a
    hold, so its length costs only the GPU's drain after it (200 calls of a 7 ms GEMM: 1.4 s),
    while 50 calls of ~10 us of host time put the figure 50 % apart between neighbouring rows
    (allreduce bench 2026-12-02) and the 10 of a call over 1 ms read 16-19 us where the same
    call path took 8-10 (gemm and gemm_rs benches, 2026-12-02h). Else `calls` (ranks sharing
    a GPU: correctness only). A function of the agreed `calls`, so every rank runs as many."""
    from cuflux.bench.common import HOST_CALLS

    return max(calls, HOST_CALLS) if calls >= 10 else calls


def slowest(values):
    """The max over ranks of one figure, None where any rank has None."""
    values = list(values)
    return None if any(v is None for v in values) else max(values)


REGIME_ROUNDS = 3  # rounds of interleaved regimes when an op is measured beside its baselines


def measure_regimes(variants, stream, *, calls: int, world=None, graph: bool = True,
                    prefix: str = "", notes: list | None = None, what: str = "",
                    after=None) -> dict:
    """common.regimes of an op and its baselines on every rank of `world` (None: this rank
    alone), as {prefix + "user_loop_ms", prefix + "host_us", prefix + "graph_ms"} per variant,
    each the slowest rank's.

    `variants`: one callable (its columns named with `prefix`, `what` in notes), or a list of
    (prefix, fn, what); a None fn is left out. Several variants are measured in REGIME_ROUNDS
    rounded up to a multiple of the variant count interleaved rounds,
    each variant's regimes once a round in an order rotated round to round, and each figure is
    the median over the rounds: the GPU's clock
    drifts between blocks of timing (a cuBLAS call timed in the block after its rival's read
    up to 17 % slower on the H200), and that drift must not read as one variant against
    another. `after()` runs after each variant's block (an op's synchronize, a pending check).

    Each fn enqueues one call on `stream` (wrap it in `with stream:` where the op uses the
    current stream; the legacy default stream cannot be captured). A capture refused by the op
    (CaptureError) gives graph_ms None; any other failure of the capture is caught, noted in
    `notes` with its reason, and the two other regimes are measured again without a graph
    (the failure is assumed to be the same on every rank: it comes from the same code). A
    variant without a graph in its first round is not captured again."""
    import statistics

    from cuflux.bench.common import regimes

    if callable(variants):
        variants = [(prefix, variants, what)]
    variants = [(p, fn, w or p.rstrip("_") or "cuflux") for p, fn, w in variants
                if fn is not None]
    # A multiple of the variant count: each variant as often in each position of the rotated
    # order (two variants over three rounds put one first twice, and its median in that spot).
    n = len(variants)
    rounds = -(-REGIME_ROUNDS // n) * n if n > 1 else 1
    barrier = world.barrier if world is not None and world.size > 1 else None
    host_calls = host_loop_calls(calls)
    runs: dict[str, list[dict]] = {p: [] for p, _, _ in variants}
    for r in range(rounds):
        for i in range(len(variants)):
            p, fn, label = variants[(i + r) % len(variants)]
            capture = graph and not (runs[p] and runs[p][0]["graph_ms"] is None)
            try:
                got = regimes(fn, stream, calls=calls, graph=capture, barrier=barrier,
                              host_calls=host_calls)
                if capture and got["graph_ms"] is None and notes is not None:
                    notes.append(f"{label}: capture refused (CaptureError), no graph_ms")
            except Exception as e:  # noqa: BLE001 (the reason is recorded)
                if not capture:
                    raise
                if notes is not None:
                    notes.append(f"{label}: graph capture failed: {type(e).__name__}: {e}")
                stream.synchronize()
                got = regimes(fn, stream, calls=calls, graph=False, barrier=barrier,
                              host_calls=host_calls)
            runs[p].append(got)
            if after is not None:
                after()
    mine = {p: tuple(None if any(x[k] is None for x in rs) else statistics.median(x[k] for x in rs)
                     for k in REGIMES) for p, rs in runs.items()}
    every = [mine]
    if world is not None and world.size > 1:
        every = world.allgather(mine)
    return {p + k: slowest(m[p][i] for m in every)
            for p in mine for i, k in enumerate(REGIMES)}


def on_stream(fn, stream):
    """fn() with `stream` as CuPy's current stream (ops that take no stream argument). The
    user regimes (common.regimes) make `stream` current once around each loop and call fn
    itself, as a user sets a stream once and then calls ops: a `with stream:` per call
    (~1 us of CuPy's) is the benchmark's cost, not the op's host time."""
    def call():
        with stream:
            fn()
    call.inner, call.stream = fn, stream
    return call


def add_speedups(row: dict, base: str = "baseline_", suffix: str = "") -> dict:
    """user_loop_speedup and graph_speedup (+ suffix): the baseline's figure (prefix `base`)
    over cuflux's, where both exist."""
    for regime, key in (("user_loop_ms", "user_loop_speedup"), ("graph_ms", "graph_speedup")):
        ours, theirs = row.get(regime), row.get(base + regime)
        row[key + suffix] = theirs / ours if ours and theirs else None
    return row


def no_baseline_regimes(row: dict, reason: str) -> dict:
    """Baseline regime columns None, with the reason in the row's notes."""
    for k in REGIMES:
        row.setdefault("baseline_" + k, None)
    add_note(row, reason)
    return row


def add_note(row: dict, *notes: str) -> dict:
    notes = [n for n in notes if n]
    if notes:
        row.setdefault("notes", []).extend(notes)
    return row


# ---- shared GPU: no speed measured ------------------------------------------------------------
def speed_measured(world_size: int, shared_gpu: bool, one_rank_times: bool = False) -> bool:
    """False when ranks time-slice one GPU: their times measure the slicing, not the op
    (issue 22.10). A bench where one rank times its work alone (`one_rank_times`) still
    measures speed."""
    return one_rank_times or not (world_size > 1 and shared_gpu)


def speed_header(op: str, world_size: int, shared_gpu: bool, one_rank_times: bool = False) -> str:
    """The line printed before a bench's table saying whether its times are speeds."""
    where = ("ranks share one GPU" if world_size > 1 and shared_gpu
             else "one rank per GPU" if world_size > 1 else "one rank")
    if speed_measured(world_size, shared_gpu, one_rank_times):
        extra = " (rank 0 times alone; the others wait)" if one_rank_times and world_size > 1 \
            else ""
        return f"{op}: W={world_size}, {where}: speed measured{extra}"
    return (f"{op}: W={world_size}, {where}: NO SPEED MEASURED. The ops ran for correctness; "
            f"any time below measures {world_size} processes time-slicing one GPU, not "
            f"cuflux. Run one rank per GPU to measure speed.")


def table_parts(cols: list[str], speed_cols, measured: bool) -> list[tuple[str | None, list]]:
    """[(heading, columns)]: the table as one part when speed is measured; else the columns
    that are not speeds, then the speed columns under "time-slicing, not speed"."""
    speed_cols = set(speed_cols)
    if measured:
        return [(None, cols)]
    first = [c for c in cols if c not in speed_cols]
    rest = ["case"] + [c for c in cols if c in speed_cols]
    return [(None, first), ("time-slicing, not speed (ranks share one GPU):", rest)]


def print_bench_table(rows: list[dict], cols: list[str], speed_cols, measured: bool) -> None:
    from cuflux.bench.common import print_table

    for heading, part in table_parts(cols, speed_cols, measured):
        if heading:
            print(heading)
        print_table(rows, part)


# ---- knobs ------------------------------------------------------------------------------------
def knobs(args, environ=None) -> dict:
    """What a run was asked for: its command-line arguments, every CUFLUX_* variable set (the
    tests' and scripts' included), and the value of every cuflux knob, defaults included
    (cuflux.knobs.describe)."""
    from cuflux import knobs as K

    environ = os.environ if environ is None else environ
    cli = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
    return {"args": cli,
            "env": {k: environ[k] for k in sorted(environ) if k.startswith("CUFLUX_")},
            "values": K.describe(environ)}


def bench_extra(args, measured: bool, **more) -> dict:
    """The JSON's run-wide keys: knobs, speed_measured, and a bench's own."""
    return {"knobs": knobs(args), "speed_measured": measured, **more}


# ---- command line -----------------------------------------------------------------------------
def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuflux.bench",
                                epilog=REGIMES_DOC, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("op", choices=sorted(OPS) + ["all"])
    p.add_argument("--quick", action="store_true", help="fewer cases")
    p.add_argument("--iters", type=positive_int, default=50,
                   help="timed calls per GPU-queued measurement (> 0)")
    p.add_argument("--outdir", default=None,
                   help=f"where the JSON goes (default: ./{DEFAULT_OUTDIR}/; the project's own "
                        f"runs: scripts/results)")
    p.add_argument("--plot", action="store_true",
                   help="draw <outdir>/<op>-speedup.png from the JSON written (needs matplotlib)")
    return p


def parse_args(argv=None, cwd=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    if args.outdir is None:
        args.outdir = str(pathlib.Path(cwd or os.getcwd()) / DEFAULT_OUTDIR)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bars"]:  # reads JSON only: before any knob, CUDA or World
        from cuflux.bench import bars

        return bars.main(argv[1:])
    args = parse_args(argv)
    from cuflux import knobs as K

    K.describe()  # a knob that fails its check stops the run now, not when its JSON is written
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("cuflux.bench: --plot draws with matplotlib, which is not installed: "
              "pip install \"cuflux[plot]\" (or pip install matplotlib)", file=sys.stderr)
        return 2
    import cuflux

    if cuflux.device_count() == 0:
        print("cuflux.bench: no CUDA device on this machine; nothing to measure.")
        return 0
    world = cuflux.init()
    if world.device is not None:
        # This rank's GPU (cuflux never moves the caller's current device): the benchmarks'
        # arrays, streams and NCCL communicators are made on the current one, and at W = 2 on
        # two GPUs rank 1 would otherwise make them all on GPU 0.
        import cupy

        cupy.cuda.Device(world.device).use()
        from cuflux.bench.common import measure_host_floor

        measure_host_floor()  # this host's floor of a launch and a copy, beside the host bars
    written = []
    for op in (sorted(OPS) if args.op == "all" else [args.op]):
        path = importlib.import_module(OPS[op]).run(world, args)
        if path is not None:
            written.append(path)
    if args.plot and world.rank == 0 and written:
        from cuflux.bench.plot import plot_results

        for png in plot_results(written, args.outdir):
            print("drew", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
