"""CPU tests of the benchmark helpers (a fake CuPy stands in for the device)."""
import json
import pathlib
import sys
import types

import pytest

import cuflux.bench.__main__ as cli
from cuflux.bench.common import time_interleaved


class _Clock:
    """Fake device clock: each call of a timed fn advances it by that fn's cost (ms)."""
    now = 0.0


class _Event:
    def record(self, stream=None):
        self.t = _Clock.now

    def synchronize(self):
        pass


class _Stream:
    def synchronize(self):
        pass


def _fake_cupy(monkeypatch):
    cuda = types.SimpleNamespace(Event=_Event, get_current_stream=_Stream,
                                 get_elapsed_time=lambda a, b: b.t - a.t)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))


def test_time_interleaved_rotates_and_takes_each_fns_own_median(monkeypatch):
    _fake_cupy(monkeypatch)
    order, cost = [], {"a": 1.0, "b": 2.0, "c": 3.0}
    drift = {"d": 0.0}

    def make(name):
        def fn():
            order.append(name)
            _Clock.now += cost[name] + drift["d"]  # a slow drift, as clocks warm up
        return fn

    blocks = []
    got = time_interleaved({n: make(n) for n in cost}, rounds=4, iters=3, warmup=2,
                           before=lambda: blocks.append(len(order)),
                           after=lambda: drift.__setitem__("d", drift["d"] + 0.01))
    # warm-up: every fn twice; then 4 rounds x 3 fns, each a block of 3 calls
    assert order[:6] == ["a", "a", "b", "b", "c", "c"]
    timed = order[6:]
    assert len(timed) == 4 * 3 * 3 and len(blocks) == 12
    firsts = [timed[i] for i in range(0, len(timed), 9)]
    assert firsts == ["a", "b", "c", "a"]  # each round starts one fn later
    for name, c in cost.items():
        assert c <= got[name] < c + 0.12, (name, got[name])
    assert got["a"] < got["b"] < got["c"]


def test_all2all_back_to_back_alternates_the_op_and_its_twin(monkeypatch):
    from cuflux.bench.all2all import _back_to_back_ms

    _fake_cupy(monkeypatch)
    order = []
    # every timed block starts behind a hold of the stream (the host queues the block first)
    monkeypatch.setattr("cuflux.bench.all2all.hold_stream",
                        lambda stream, us: order.append(("hold", us >= 100)))

    def make(name, cost):
        def fn(i):
            order.append(name)
            _Clock.now += cost
        return fn

    ms, host_us, twin_ms = _back_to_back_ms(make("op", 2.0), _Stream(), calls=4, reps=3,
                                            warmup=1, twin=make("copy", 1.5))
    hold = ("hold", True)
    assert order == ["op", "copy"] + ([hold] + ["op"] * 4 + [hold] + ["copy"] * 4) * 3
    assert abs(ms - 2.0) < 1e-9 and abs(twin_ms - 1.5) < 1e-9 and host_us >= 0
    order.clear()
    assert _back_to_back_ms(make("op", 1.0), _Stream(), calls=2, reps=2, warmup=0)[2] is None
    assert order == [hold] + ["op"] * 2 + [hold] + ["op"] * 2


def test_ranks_share_gpu_ignores_the_self_link_and_agrees_across_ranks():
    from cuflux.bench.common import ranks_share_gpu
    from cuflux.topology import PeerLink, Topology

    def world(rank, size, same_gpu_peers, others_say=()):
        links = tuple(PeerLink(p, True, p == rank or p in same_gpu_peers, True,
                               "self" if p == rank else "nvlink") for p in range(size))
        return types.SimpleNamespace(
            rank=rank, size=size, topology=Topology(rank, links),
            allgather=lambda mine: [mine, *others_say])

    # the self link always says same_gpu: distinct GPUs must still read as not shared
    assert ranks_share_gpu(world(0, 2, (), others_say=(False,))) is False
    assert ranks_share_gpu(world(0, 2, (1,), others_say=(True,))) is True
    # one rank seeing a shared GPU decides for all (NCCL set up everywhere or nowhere)
    assert ranks_share_gpu(world(0, 3, (), others_say=(False, True))) is True
    assert ranks_share_gpu(world(0, 1, ())) is False


# ---- command line, knobs, regimes, shared-GPU rule (cuflux.bench.__main__) -------------------
@pytest.mark.parametrize("bad", ["-5", "0", "x", "2.5"])
def test_iters_must_be_a_positive_int(bad, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["gemm", "--iters", bad])
    assert "positive integer" in capsys.readouterr().err
    assert cli.parse_args(["gemm", "--iters", "3"]).iters == 3


def test_default_outdir_is_under_the_working_directory(tmp_path, monkeypatch):
    args = cli.parse_args(["allreduce"], cwd=str(tmp_path))
    assert pathlib.Path(args.outdir) == tmp_path / "cuflux-results"
    monkeypatch.chdir(tmp_path)
    assert pathlib.Path(cli.parse_args(["gemm"]).outdir) == tmp_path / "cuflux-results"
    # the project's own runs name their folder
    assert cli.parse_args(["gemm", "--outdir", "scripts/results"]).outdir == "scripts/results"
    assert "site-packages" not in args.outdir


def test_knobs_record_the_cli_and_every_cuflux_variable(tmp_path):
    args = cli.parse_args(["all2all", "--quick", "--iters", "7"], cwd=str(tmp_path))
    env = {"CUFLUX_GEMM_TUNE": "0", "CUFLUX_CACHE_DIR": "/x", "HOME": "/h", "CUDA_X": "1"}
    k = cli.knobs(args, env)
    assert k["args"] == {"op": "all2all", "quick": True, "iters": 7, "plot": False,
                         "outdir": str(tmp_path / "cuflux-results")}
    assert k["env"] == {"CUFLUX_CACHE_DIR": "/x", "CUFLUX_GEMM_TUNE": "0"}
    json.dumps(k)  # JSON-able
    extra = cli.bench_extra(args, False, bar=1.02)
    assert extra["speed_measured"] is False and extra["bar"] == 1.02 and "knobs" in extra


def test_write_results_keeps_the_knobs(tmp_path):
    from cuflux.bench.common import write_results

    args = cli.parse_args(["gemm", "--outdir", str(tmp_path)])
    path = write_results("gemm", 1, [{"case": "1x8192x8192 kn auto"}],
                         extra=cli.bench_extra(args, True), outdir=args.outdir)
    doc = json.loads(pathlib.Path(path).read_text())
    assert pathlib.Path(path).parent == tmp_path
    assert doc["knobs"]["args"]["op"] == "gemm" and doc["speed_measured"] is True


def test_write_results_carries_the_host_floor_once_measured(tmp_path, monkeypatch):
    from cuflux.bench import common

    monkeypatch.setattr(common, "HOST_FLOOR", {})
    doc = json.loads(common.write_results("gemm", 1, [], outdir=str(tmp_path)).read_text())
    assert "host_floor_us" not in doc  # not measured (a run without a GPU): no key
    common.HOST_FLOOR.update(launch_us=8.5, copy_us=7.9, calls=500)
    doc = json.loads(common.write_results("gemm", 1, [], outdir=str(tmp_path)).read_text())
    assert doc["host_floor_us"] == {"launch_us": 8.5, "copy_us": 7.9, "calls": 500}


def test_gemm_decode_and_table_cases():
    from cuflux.bench import gemm

    full = gemm.auto_cases(quick=False)
    keys = [(c["M"], c["N"], c["K"], c["layout"]) for c in full]
    assert len(keys) == len(set(keys))
    for M in (1, 16, 128, 512, 2048):
        for N, K in ((8192, 8192), (28672, 8192), (8192, 28672)):
            for layout in ("kn", "nk"):
                assert (M, N, K, layout) in keys
    table = {(c["M"], c["N"], c["K"], c["layout"]) for c in full if c["table"]}
    for shape in ((128, 8192, 8192), (512, 8192, 8192), (2048, 8192, 8192), (4096, 8192, 3584),
                  (16384, 8192, 1024), (4096, 12288, 6144)):
        assert shape + ("nk",) in table
    assert len(full) == 30 + 6  # decode, then the table shapes beyond them in both layouts

    quick = gemm.auto_cases(quick=True)
    qkeys = {(c["M"], c["N"], c["K"], c["layout"]) for c in quick}
    assert qkeys < set(keys)
    assert {(M, 8192, 8192, lay) for M in (1, 128, 2048) for lay in ("kn", "nk")} <= qkeys
    assert all((c["N"], c["K"]) == (8192, 8192) for c in quick if c["decode"])
    assert {c["M"] for c in quick if c["decode"]} == {1, 128, 2048}
    assert sum(c["table"] for c in quick) == 6 and len(quick) <= 12


def test_shared_gpu_measures_no_speed():
    assert cli.speed_measured(1, False) and cli.speed_measured(1, True)  # W = 1: one rank
    assert cli.speed_measured(2, False)
    assert not cli.speed_measured(2, True)
    assert cli.speed_measured(2, True, one_rank_times=True)  # gemm: rank 0 alone
    h = cli.speed_header("allgather", 2, True)
    assert "NO SPEED MEASURED" in h and "share one GPU" in h and "time-slicing" in h
    assert "speed measured" in cli.speed_header("allgather", 2, False)
    assert "NO SPEED" not in cli.speed_header("gemm", 2, True, one_rank_times=True)

    cols = ["case", "config", "cuflux_ms", "speedup", "user_loop_ms"]
    assert cli.table_parts(cols, {"cuflux_ms", "speedup", "user_loop_ms"}, True) == [(None, cols)]
    parts = cli.table_parts(cols, {"cuflux_ms", "speedup", "user_loop_ms"}, False)
    assert parts[0] == (None, ["case", "config"])
    assert parts[1][0].startswith("time-slicing, not speed")
    assert parts[1][1] == ["case", "cuflux_ms", "speedup", "user_loop_ms"]


def test_host_loops_of_small_calls_are_long_and_a_function_of_the_agreed_calls():
    """host_us loops: at least HOST_CALLS calls wherever speed is measured, slow calls
    included (a noisy figure otherwise: the loop runs behind a hold, so its length costs only
    the GPU's drain), as few as the user loop where ranks share a GPU; a function of `calls`
    alone, which every rank agrees on (the slowest rank's ms)."""
    from cuflux.bench.common import HOST_CALLS

    assert HOST_CALLS >= 200
    for ms in (0.001, 0.05, 0.5, 3.0, None):
        assert cli.host_loop_calls(cli.regime_calls(ms)) == HOST_CALLS
        assert cli.host_loop_calls(cli.regime_calls(ms, quick=True)) == HOST_CALLS
    assert cli.host_loop_calls(cli.regime_calls(0.01, speed=False)) == \
        cli.regime_calls(0.01, speed=False) < 10


def test_regime_calls_are_modest_and_agree_on_the_slow_cases():
    assert cli.regime_calls(0.01) == 100 and cli.regime_calls(0.01, quick=True) == 50
    assert cli.regime_calls(0.5) == 50 and cli.regime_calls(3.0) == 10
    assert cli.regime_calls(None) == 10 and cli.regime_calls(0.01, speed=False) < 10


def test_user_regimes_make_the_stream_current_once_a_loop(monkeypatch):
    """common.regimes calls an on_stream(f, stream) callable's f with `stream` made current
    once around each timed loop (as a user sets a stream once): the per-call `with stream:`
    is the benchmark's host time, not the op's. Any other callable is called as it is."""
    from cuflux.bench import common

    _fake_cupy(monkeypatch)
    monkeypatch.setattr(common, "hold_stream", lambda stream, us: None)

    class Current(_Stream):
        entered = depth = 0

        def __enter__(self):
            self.entered += 1
            self.depth += 1

        def __exit__(self, *exc):
            self.depth -= 1

    stream, seen = Current(), []
    f = lambda: seen.append(stream.depth)  # noqa: E731
    r = common.regimes(cli.on_stream(f, stream), stream, calls=3, graph=False, warmup=2,
                       host_calls=5)
    # every call with the stream current: 2 warm-up, 3 user loop, 5 host loop
    assert seen == [1] * (2 + 3 + 5)
    assert stream.entered == 2 + 1 + 1  # once a warm-up call, once a timed loop
    assert r["graph_ms"] is None and r["user_loop_ms"] > 0 and r["host_us"] > 0
    seen.clear()
    common.regimes(f, stream, calls=3, graph=False, warmup=2)
    assert seen == [0] * 8 and stream.entered == 4  # a plain callable: nothing entered;
    # the host loop as long as the user loop by default


def test_held_host_us_holds_the_stream_before_its_timed_calls(monkeypatch):
    from cuflux.bench import common

    log = []

    class S:
        def synchronize(self):
            log.append("sync")

    monkeypatch.setattr(common, "hold_stream", lambda stream, us: log.append(("hold", us)))
    us = common.held_host_us(lambda: log.append("call"), S(), calls=3, warmup=2)
    assert log == ["call"] * 2 + ["sync", ("hold", common._HOLD_MAX_US)] + ["call"] * 3 + \
        ["sync"]
    assert us > 0
    log.clear()
    common.held_host_us(lambda: log.append("call"), None, calls=3, warmup=1)
    assert log == ["call"] * 4  # no stream: no hold, no synchronize


class _World:
    def __init__(self, others):
        self.size, self.rank, self.others, self.barriers = 1 + len(others), 0, others, 0

    def barrier(self):
        self.barriers += 1

    def allgather(self, mine):
        return [mine, *self.others]


def test_measure_regimes_takes_the_slowest_rank_and_notes_capture(monkeypatch):
    from cuflux.bench.common import HOST_CALLS

    got = []

    def fake(fn, stream, *, calls, graph, barrier, host_calls):
        got.append((calls, graph, barrier is not None))
        hosts.append(host_calls)
        return {"user_loop_ms": 1.0, "host_us": 5.0, "graph_ms": 0.5 if graph else None}

    hosts = []
    monkeypatch.setattr("cuflux.bench.common.regimes", fake)
    world = _World([{"baseline_": (2.0, 4.0, 0.7)}])
    notes = []
    r = cli.measure_regimes(lambda: None, _Stream(), calls=7, world=world, prefix="baseline_",
                            notes=notes)
    assert r == {"baseline_user_loop_ms": 2.0, "baseline_host_us": 5.0, "baseline_graph_ms": 0.7}
    assert got == [(7, True, True)] and notes == [] and hosts == [7]  # 7 < 10: no speed
    # the host loop's calls from the agreed calls alone (host_loop_calls), on every rank
    cli.measure_regimes(lambda: None, _Stream(), calls=50, world=world, prefix="baseline_")
    assert hosts == [7, cli.host_loop_calls(50)] and hosts[1] == HOST_CALLS
    # one rank without a graph: no graph figure for the row
    r = cli.measure_regimes(lambda: None, _Stream(), calls=7,
                            world=_World([{"": (2.0, 4.0, None)}]))
    assert r["graph_ms"] is None
    # W = 1 (world None): no barrier, no allgather
    got.clear()
    r = cli.measure_regimes(lambda: None, _Stream(), calls=3)
    assert got == [(3, True, False)] and r["user_loop_ms"] == 1.0


def test_measure_regimes_records_a_failed_capture_and_keeps_the_other_regimes(monkeypatch):
    def fake(fn, stream, *, calls, graph, barrier, host_calls):
        if graph:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported")
        return {"user_loop_ms": 1.0, "host_us": 5.0, "graph_ms": None}

    monkeypatch.setattr("cuflux.bench.common.regimes", fake)
    notes = []
    r = cli.measure_regimes(lambda: None, _Stream(), calls=3, prefix="nccl_", notes=notes,
                            what="NCCL")
    assert r == {"nccl_user_loop_ms": 1.0, "nccl_host_us": 5.0, "nccl_graph_ms": None}
    assert len(notes) == 1 and "NCCL" in notes[0] and "CaptureUnsupported" in notes[0]

    monkeypatch.setattr("cuflux.bench.common.regimes",
                        lambda fn, s, **kw: {"user_loop_ms": 1.0, "host_us": 2.0,
                                             "graph_ms": None})
    notes.clear()
    cli.measure_regimes(lambda: None, _Stream(), calls=3, notes=notes)
    assert notes and "CaptureError" in notes[0]


def test_measure_regimes_interleaves_variants_and_takes_medians(monkeypatch):
    """An op and its baselines: rounds of one block each, the order rotated, as many rounds
    with each variant first (two variants: REGIME_ROUNDS = 3 rounded up to 4), each figure the
    median over the rounds (a block slowed by clock drift does not decide the ratio)."""
    order, afters = [], []
    times = {"ours": iter([1.0, 9.0, 1.2, 1.4]), "base": iter([2.0, 2.2, 2.1, 2.3])}

    def fake(fn, stream, *, calls, graph, barrier, host_calls):
        name = fn()
        order.append((name, graph))
        if name == "ours" and graph:
            raise RuntimeError("capture unsupported")
        return {"user_loop_ms": next(times[name]), "host_us": 5.0,
                "graph_ms": 0.5 if graph else None}

    monkeypatch.setattr("cuflux.bench.common.regimes", fake)
    notes = []
    world = _World([{"": (1.0, 6.0, None), "baseline_": (2.5, 4.0, 0.25)}])
    r = cli.measure_regimes([("", lambda: "ours", "ours"), ("baseline_", lambda: "base", "base"),
                             ("nccl_", None, "absent")], _Stream(), calls=4, world=world,
                            notes=notes, after=lambda: afters.append(1))
    # round 0: ours (capture fails once, then measured without), base; round 1 rotated, ...
    assert [n for n, _ in order] == ["ours", "ours", "base", "base", "ours", "ours", "base",
                                     "base", "ours"]
    assert ("ours", True) not in order[2:]  # a failed capture is not retried
    assert len(afters) == 8 and len(notes) == 1 and "ours" in notes[0]
    assert r == {"user_loop_ms": pytest.approx(1.3), "host_us": 6.0, "graph_ms": None,
                 "baseline_user_loop_ms": 2.5, "baseline_host_us": 5.0,
                 "baseline_graph_ms": 0.5}
    assert world.barriers == 0  # the barrier goes to common.regimes (faked here)


def test_speedups_and_baseline_notes():
    row = cli.add_speedups({"user_loop_ms": 2.0, "baseline_user_loop_ms": 1.0,
                            "graph_ms": None, "baseline_graph_ms": 0.5})
    assert row["user_loop_speedup"] == 0.5 and row["graph_speedup"] is None
    row = cli.no_baseline_regimes({"case": "x"}, "ceiling")
    assert row["baseline_host_us"] is None and row["notes"] == ["ceiling"]
    assert "notes" not in cli.add_note({}, "")


def test_main_plots_the_json_it_wrote(tmp_path, monkeypatch):
    import types

    import cuflux
    from cuflux.bench.common import write_results

    def run(world, args):
        return write_results("gemm", 1, [{"case": "8x8x8 kn", "speedup": 1.0}],
                             extra=cli.bench_extra(args, True), outdir=args.outdir)

    monkeypatch.setitem(sys.modules, "fake_bench_op", types.SimpleNamespace(run=run))
    monkeypatch.setitem(cli.OPS, "gemm", "fake_bench_op")
    monkeypatch.setattr(cuflux, "device_count", lambda: 1, raising=False)
    monkeypatch.setattr(cuflux, "init", lambda: types.SimpleNamespace(rank=0, size=1,
                                                                      device=None),
                        raising=False)
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())
    drawn = []
    monkeypatch.setattr("cuflux.bench.plot.plot_results",
                        lambda paths, outdir: drawn.append((list(paths), outdir)) or [])
    monkeypatch.chdir(tmp_path)
    assert cli.main(["gemm", "--plot"]) == 0
    (paths, outdir), = drawn
    assert pathlib.Path(outdir) == tmp_path / "cuflux-results"
    assert [pathlib.Path(p).parent for p in paths] == [tmp_path / "cuflux-results"]


def test_main_makes_the_rank_s_gpu_current_before_any_bench(monkeypatch):
    """cuflux never moves the caller's current device; the benchmarks make their arrays,
    streams and NCCL communicators on the current one, so main makes the rank's GPU current
    first (rank 1 of two on distinct GPUs would otherwise work on GPU 0)."""
    import types

    import cupy

    import cuflux

    order = []
    monkeypatch.setitem(sys.modules, "fake_bench_op",
                        types.SimpleNamespace(run=lambda world, args: order.append("run")))
    monkeypatch.setitem(cli.OPS, "gemm", "fake_bench_op")
    monkeypatch.setattr(cuflux, "device_count", lambda: 2, raising=False)
    monkeypatch.setattr(cuflux, "init", lambda: types.SimpleNamespace(rank=1, size=2,
                                                                      device=1), raising=False)
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: types.SimpleNamespace(
        use=lambda: order.append(("use", d))))
    from cuflux.bench import common

    monkeypatch.setattr(common, "measure_host_floor", lambda: order.append("floor"))
    assert cli.main(["gemm"]) == 0
    assert order == [("use", 1), "floor", "run"]  # the host's floor: on the rank's GPU too


def test_plot_without_matplotlib_fails_before_any_bench(monkeypatch, capsys):
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["gemm", "--plot"]) == 2
    assert "matplotlib" in capsys.readouterr().err
