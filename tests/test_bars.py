"""CPU tests of `python -m cuflux.bench bars` (cuflux.bench.bars): the issues' bars read from
small JSON files written here, in the fields the benchmarks write."""
import json
import pathlib
import subprocess
import sys

import pytest

import cuflux.bench.__main__ as cli
from cuflux.bench import bars

MACHINE, DATE = "h200x2", "2026-12-03"


def _write(d: pathlib.Path, op: str, world_size: int, rows: list, name: str | None = None,
           **extra) -> pathlib.Path:
    """A results file as common.write_results writes it (speed measured unless extra says)."""
    doc = {"op": op, "machine": MACHINE, "date": DATE, "command": f"python -m cuflux.bench {op}",
           "world_size": world_size, "rows": rows, "speed_measured": True,
           "ranks_share_gpu": False} | extra
    d.mkdir(parents=True, exist_ok=True)
    path = d / (name or f"{op}-{MACHINE}-W{world_size}-{DATE}.json")
    path.write_text(json.dumps(doc))
    return path


def _checks(tmp_path, op, world_size, rows, **extra) -> list[dict]:
    _write(tmp_path, op, world_size, rows, **extra)
    f, = bars.read_runs([tmp_path])
    return bars.check_file(f)


def _met(checks, bar: bars.Bar) -> dict:
    """{case: met} of one bar's checks."""
    got = [(c["case"], c["met"]) for c in checks if c["bar"] == bar.text]
    assert len(got) == len(dict(got)), got  # one check per case
    return dict(got)


def _why(checks, bar: bars.Bar, case: str = "") -> str:
    c, = [c for c in checks if c["bar"] == bar.text and c["case"] == case]
    return c.get("why")


# ---- issue 14 ---------------------------------------------------------------------------------
def test_gemm_user_loop_and_host_bars_at_w1(tmp_path):
    rows = [{"case": "t-ok", "table_shape": True, "user_loop_speedup": 0.96, "host_us": 9.0},
            {"case": "t-slow", "table_shape": True, "user_loop_speedup": 0.90, "host_us": 11.0},
            {"case": "t-none", "table_shape": True, "user_loop_speedup": None, "host_us": None},
            {"case": "decode", "decode_shape": True, "user_loop_speedup": 0.5, "host_us": 10.0},
            {"case": "core sweep", "user_loop_speedup": 0.5, "host_us": 99.0}]
    checks = _checks(tmp_path, "gemm", 1, rows)
    assert _met(checks, bars.GEMM_USER_LOOP) == {"t-ok": True, "t-slow": False, "t-none": None}
    assert _why(checks, bars.GEMM_USER_LOOP, "t-none") == "field user_loop_speedup absent"
    host = bars.host_bar(1)
    assert host.threshold == bars.HOST_US_W1 == 10.0 and "W = 1" in host.text
    assert _met(checks, host) == {"t-ok": True, "t-slow": False, "t-none": None, "decode": True}
    assert len(checks) == 7
    assert _why(checks, host, "t-slow") is None  # no floor in the file: nothing to show


def test_a_missed_host_bar_shows_the_host_s_floor(tmp_path):
    """A run that measured the host's floor (common.measure_host_floor) shows it beside each
    missed host bar (issue 14's and 17's), and nowhere else."""
    rows = [{"case": "fast", "table_shape": True, "user_loop_speedup": 0.5, "host_us": 9.0},
            {"case": "slow", "table_shape": True, "user_loop_speedup": 0.5, "host_us": 19.0}]
    floor = {"launch_us": 8.25, "copy_us": 7.75, "calls": 500}
    checks = _checks(tmp_path, "gemm", 1, rows, host_floor_us=floor)
    host = bars.host_bar(1)
    assert _met(checks, host) == {"fast": True, "slow": False}
    assert _why(checks, host, "slow") == ("this host: a bare kernel launch (ctypes) 8.2 us, a "
                                          "bare copy 7.8 us")  # a file of before the binding
    assert _why(checks, host, "fast") is None
    assert _why(checks, bars.GEMM_USER_LOOP, "slow") is None  # not a host bar
    checks = _checks(tmp_path, "gemm", 1, rows,
                     host_floor_us={**floor, "launch_binding": "cupy_backends launchKernel"})
    assert _why(checks, host, "slow") == ("this host: a bare kernel launch 8.2 us, a bare copy "
                                          "7.8 us")
    assert "bare kernel launch 8.2 us" in bars.verdict(
        next(c for c in checks if c["case"] == "slow" and c["bar"] == host.text))
    assert all(b.host for b in (bars.host_bar(2), bars.copy_host_bar(2), bars.A2A_HOST))


def test_gemm_at_w2_has_no_user_loop_bar_and_the_w2_host_bar(tmp_path):
    # gemm at W = 2 times rank 0 alone: speed measured although the ranks share a GPU
    rows = [{"case": "a", "table_shape": True, "user_loop_speedup": 0.5, "host_us": 12.0},
            {"case": "b", "decode_shape": True, "host_us": 16.0},
            {"case": "old", "table_shape": True}]  # no host_us: no host check
    checks = _checks(tmp_path, "gemm", 2, rows, ranks_share_gpu=True)
    assert _met(checks, bars.GEMM_USER_LOOP) == {}
    assert bars.host_bar(2).threshold == bars.HOST_US_W2 == bars.host_bar(4).threshold == 15.0
    assert _met(checks, bars.host_bar(2)) == {"a": True, "b": False}


def test_copy_ops_host_per_copy_and_against_their_gpu_time(tmp_path):
    # W = 4: three copies, 15 us; the host time never above the GPU time
    rows = [{"case": "ok", "host_us": 14.0, "cuflux_ms": 0.05},
            {"case": "slow host", "host_us": 16.0, "cuflux_ms": 1.0},
            {"case": "tiny", "host_us": 14.0, "cuflux_ms": 0.01},
            {"case": "no gpu time", "host_us": 4.0},
            {"case": "old"}]
    checks = _checks(tmp_path / "ag", "allgather", 4, rows)
    bar = bars.copy_host_bar(4)
    assert bar.threshold == 15.0
    assert _met(checks, bar) == {"ok": True, "slow host": False, "tiny": True, "no gpu time": True}
    assert _met(checks, bars.COPY_HOST_OF_GPU) == {"ok": True, "slow host": True, "tiny": False,
                                                   "no gpu time": None}
    tiny, = [c for c in checks if c["bar"] == bars.COPY_HOST_OF_GPU.text and c["case"] == "tiny"]
    assert abs(tiny["value"] - 1.4) < 1e-12  # 14 us against 10 us of GPU time
    # one local copy at W = 1, one per peer at W = 2
    assert bars.copy_host_bar(1).threshold == bars.copy_host_bar(2).threshold == 5.0


# ---- issue 15 ---------------------------------------------------------------------------------
def test_gemm_rs_bars_on_two_gpus(tmp_path):
    rows = [{"case": "ok", "cuflux_ms": 1.02, "cublas_ms": 1.0, "chunked_ms": 1.01,
             "chunked_to_cublas": 1.01, "nccl_ms": 1.1, "host_us": 14.0,
             "fused_to_ideal": 1.05, "chunked_to_ideal": 1.04},
            {"case": "slow", "cuflux_ms": 1.2, "cublas_ms": 1.0, "chunked_ms": 1.1,
             "chunked_to_cublas": 1.1, "nccl_ms": 1.15, "host_us": 16.0},
            {"case": "no nccl", "cuflux_ms": 1.0, "cublas_ms": 1.0}]
    checks = _checks(tmp_path, "gemm_rs", 2, rows)
    assert _met(checks, bars.RS_FUSED) == {"ok": True, "slow": False, "no nccl": True}
    assert _met(checks, bars.RS_CHUNKED) == {"ok": True, "slow": False}
    assert _met(checks, bars.RS_NCCL) == {"ok": True, "slow": False, "no nccl": None}
    assert _why(checks, bars.RS_NCCL, "no nccl") == "field nccl_ms absent"
    assert _met(checks, bars.RS_NCCL_CHUNKED) == {"ok": True, "slow": True}
    info = [(c["bar"], c["value"]) for c in checks if c.get("why") == bars.INFO]
    assert info == [("fused_to_ideal", 1.05), ("chunked_to_ideal", 1.04)]
    assert _met(checks, bars.host_bar(2)) == {"ok": True, "slow": False}
    assert bars.summary(checks) == {14: {"met": 1, "missed": 1, "not_measured": 0},
                                    15: {"met": 6, "missed": 3, "not_measured": 1}}


def test_issue_15_bars_are_not_measured_at_w1(tmp_path):
    rows = [{"case": "a", "cuflux_ms": 1.5, "cublas_ms": 1.0, "host_us": 9.0}]
    checks = _checks(tmp_path, "gemm_rs", 1, rows)
    not_here = [c for c in checks if c["issue"] == 15]
    assert {c["bar"] for c in not_here} == {b.text for b in (
        bars.RS_FUSED, bars.RS_CHUNKED, bars.RS_NCCL, bars.RS_NCCL_CHUNKED)}
    assert all(c["met"] is None and c["case"] == "" and "W = 1" in c["why"] for c in not_here)
    assert _met(checks, bars.host_bar(1)) == {"a": True}  # issue 14 holds at any W


def test_ag_gemm_of_ideal_on_the_default_pull_rows(tmp_path):
    rows = [{"case": "flux pull", "mode": "pull", "of_ideal": 0.98},
            {"case": "qkv pull", "mode": "pull", "of_ideal": 0.90},
            {"case": "o pull", "mode": "pull"},
            {"case": "flux push", "mode": "push", "of_ideal": 0.5},
            {"case": "flux pull chunk_rows=128", "mode": "pull", "of_ideal": 0.5}]
    checks = _checks(tmp_path, "ag_gemm", 2, rows, distinct_gpus=True)
    assert _met(checks, bars.AG_OF_IDEAL) == {"flux pull": True, "qkv pull": False,
                                              "o pull": None}
    assert _why(checks, bars.AG_OF_IDEAL, "o pull") == "field of_ideal absent"
    # ranks on one GPU (distinct_gpus False) although the flag says measured: not measured
    checks = _checks(tmp_path / "one", "ag_gemm", 2, rows, distinct_gpus=False)
    assert _met(checks, bars.AG_OF_IDEAL) == {"": None}


# ---- issue 16 ---------------------------------------------------------------------------------
def _norm_row(T, H, mode="replicated", speedup=1.3, link=0.9):
    return {"case": f"norm T={T} H={H} {mode}", "kind": "norm", "T": T, "H": H, "mode": mode,
            "cuflux_ms": 1.0, "nccl_ms": speedup, "graph_ms": 1.0, "nccl_graph_ms": speedup,
            "user_loop_ms": 1.0, "nccl_user_loop_ms": speedup, "fraction_of_link": link,
            "host_us": 12.0}


def _plain_row(num_bytes, busbw_of_nccl=1.0, graph_speedup=2.0):
    return {"case": f"plain {num_bytes}B", "kind": "plain", "bytes": num_bytes,
            "busbw_gbps": 300.0 * busbw_of_nccl, "nccl_busbw_gbps": 300.0, "graph_ms": 0.01,
            "nccl_graph_ms": 0.01 * graph_speedup, "host_us": 8.0}


def _norm_sweep(**kw):
    return [_norm_row(T, H, mode, **kw) for mode in bars.NORM_MODES for T in bars.NORM_TOKENS
            for H in bars.NORM_HIDDEN]


def test_allreduce_bars_all_met(tmp_path):
    rows = _norm_sweep() + [_plain_row(64 << 10), _plain_row(256 << 10), _plain_row(8 << 20)]
    checks = _checks(tmp_path, "allreduce", 2, rows)
    s = bars.summary(checks)
    # 30 norm rows (3 modes) x 3 regimes + 6 link rows (T = 8192) + 1 large + 2 small plain
    assert s[16] == {"met": 30 * 3 + 6 + 3, "missed": 0, "not_measured": 0}
    assert s[14] == {"met": 33, "missed": 0, "not_measured": 0}
    assert set(_met(checks, bars.NORM_LINK)) == {f"norm T=8192 H={h} {m}"
                                                 for h in bars.NORM_HIDDEN for m in bars.NORM_MODES}


def test_allreduce_bars_missed_and_missing_rows(tmp_path):
    rows = [r for r in _norm_sweep() if (r["T"], r["H"]) != (16, 8192)]
    rows[0] = _norm_row(1, 4096, speedup=1.1)  # NCCL + norm only 1.1x: missed
    rows = [r for r in rows if r["case"] != "norm T=8192 H=4096 sequence_parallel"]
    rows.append(_norm_row(8192, 4096, mode="sequence_parallel", speedup=0.9, link=0.8))
    rows.append(_plain_row(16 << 20, busbw_of_nccl=0.9))  # no plain row <= 256 KiB
    checks = _checks(tmp_path, "allreduce", 2, rows)
    queued = _met(checks, bars.NORM_QUEUED)
    assert queued["norm T=16 H=8192 replicated"] is False
    assert _why(checks, bars.NORM_QUEUED, "norm T=16 H=8192 replicated") == bars.NOT_IN_RUN
    assert queued["norm T=1 H=4096 replicated"] is False
    assert queued["norm T=1024 H=4096 replicated"] is True
    assert _met(checks, bars.NORM_LOOP)["norm T=1 H=4096 replicated"] is True  # 1.1 >= 1.0
    assert _met(checks, bars.NORM_LINK)["norm T=8192 H=4096 sequence_parallel"] is False
    assert _met(checks, bars.PLAIN_BUSBW) == {"plain 16777216B": False}
    assert _met(checks, bars.PLAIN_GRAPH) == {"plain <= 256 KiB": False}
    # 27 rows x 3 regimes + 6 link rows + 3 absent rows (T = 16, H = 8192, each mode) + 2
    # plain classes; missed: the absent rows, T = 1 GPU-queued and graph, the slow
    # sequence_parallel row's three regimes and link, both plain classes
    assert bars.summary(checks)[16] == {"met": 81, "missed": 11, "not_measured": 0}


def test_allreduce_without_the_new_rows_misses_every_required_row(tmp_path):
    checks = _checks(tmp_path, "allreduce", 2, [{"case": "old 8 MiB", "cuflux_ms": 1.0}])
    assert bars.summary(checks) == {16: {"met": 0, "missed": 32, "not_measured": 0}}
    assert all(c["why"] == bars.NOT_IN_RUN for c in checks)


# ---- issue 17 ---------------------------------------------------------------------------------
def _a2a_row(case, T, direction="scatter", dtype="bfloat16", scales=False, **kw):
    return {"case": case, "T": T, "direction": direction, "dtype": dtype, "scales": scales,
            "mode": "owned"} | kw


def test_all2all_bars(tmp_path):
    rows = [_a2a_row("bf16 scatter 8k", 8192, fraction_of_link=0.9, host_us=12.0),
            _a2a_row("bf16 gather 16k", 16384, "gather", fraction_of_link=0.8, host_us=16.0),
            _a2a_row("fp8 scales 8k", 8192, dtype="float8_e4m3fn", scales=True,
                     fraction_of_link=0.86),
            _a2a_row("bf16 scatter 8k sms=8", 8192, fraction_of_link=0.1),
            _a2a_row("bf16 scatter 8k kernel=pull", 8192, kernel="pull", fraction_of_link=0.1),
            _a2a_row("bf16 scatter 4k", 4096, fraction_of_link=0.1),
            _a2a_row("decode fast", 1024, vs_nccl=True, user_loop_speedup=2.5),
            _a2a_row("decode slow", 1024, "gather", vs_nccl=True, user_loop_speedup=1.5),
            _a2a_row("decode not vs nccl", 1024, user_loop_speedup=0.1)]
    checks = _checks(tmp_path, "all2all", 2, rows)
    assert _met(checks, bars.A2A_LINK) == {"bf16 scatter 8k": True, "bf16 gather 16k": False,
                                           "fp8 scales 8k": True}
    assert _met(checks, bars.A2A_LOOP) == {"decode fast": True, "decode slow": False}
    # the same host times, issue 14 at W = 2 and issue 17: both 15 us
    assert _met(checks, bars.A2A_HOST) == {"bf16 scatter 8k": True, "bf16 gather 16k": False}
    assert _met(checks, bars.host_bar(2)) == _met(checks, bars.A2A_HOST)
    assert bars.summary(checks)[17] == {"met": 4, "missed": 3, "not_measured": 0}


def test_all2all_required_rows_missing(tmp_path):
    rows = [_a2a_row("bf16 scatter 8k", 8192, fraction_of_link=0.9),
            _a2a_row("fp8 no scales", 8192, dtype="float8_e5m2", fraction_of_link=0.9)]
    checks = _checks(tmp_path, "all2all", 2, rows)
    missing = {c["case"] for c in checks if c.get("why") == bars.NOT_IN_RUN}
    assert missing == {"bfloat16 gather, T >= 8192", "float8 with scales, T >= 8192",
                       "vs NCCL, T = 1024"}
    assert bars.summary(checks)[17] == {"met": 2, "missed": 3, "not_measured": 0}


# ---- issue 20 and the shared-GPU rule ---------------------------------------------------------
def test_across_correctness_counts_on_a_shared_gpu_and_speed_does_not(tmp_path):
    rows = [{"case": "AllReduce", "correct": True, "speedup": 1.3},
            {"case": "AllGather", "correct": False, "speedup": 0.8},
            {"case": "All2AllHeads", "correct": None}]
    checks = _checks(tmp_path / "gpus", "across", 2, rows)
    assert _met(checks, bars.ACROSS_CORRECT) == {"AllReduce": True, "AllGather": False,
                                                 "All2AllHeads": None}
    assert [c["value"] for c in checks if c.get("why") == bars.INFO] == [1.3, 0.8]
    assert bars.summary(checks) == {20: {"met": 1, "missed": 1, "not_measured": 1}}
    shared = _checks(tmp_path / "shared", "across", 2, rows, speed_measured=False,
                     ranks_share_gpu=True)
    assert _met(shared, bars.ACROSS_CORRECT) == _met(checks, bars.ACROSS_CORRECT)
    assert not [c for c in shared if c.get("why") == bars.INFO]  # time-slicing is no speed-up


def test_a_shared_gpu_file_gives_one_not_measured_record_per_bar(tmp_path):
    rows = [_a2a_row("bf16 scatter 8k", 8192, fraction_of_link=0.1, host_us=99.0)] * 3
    checks = _checks(tmp_path, "all2all", 2, rows, speed_measured=False, ranks_share_gpu=True)
    assert [c["bar"] for c in checks] == [b.text for b in bars.op_bars("all2all", 2)]
    assert all(c["met"] is None and c["case"] == "" and "share one GPU" in c["why"]
               for c in checks)
    assert bars.summary(checks) == {14: {"met": 0, "missed": 0, "not_measured": 1},
                                    17: {"met": 0, "missed": 0, "not_measured": 3}}


def test_older_files_without_speed_measured():
    def f(**doc):
        return bars.RunFile(pathlib.Path("x.json"), {"op": "allreduce", "rows": []} | doc)

    assert f(world_size=1).speed_measured
    assert f(world_size=1, ranks_share_gpu=False).speed_measured
    assert not f(world_size=1, ranks_share_gpu=True).speed_measured
    assert not f(world_size=2).speed_measured
    assert not f(world_size=2, ranks_share_gpu=False).speed_measured
    assert f(world_size=2, speed_measured=True).speed_measured
    old = f(world_size=2)
    assert "older file" in bars.not_measured(bars.host_bar(2), old)
    assert bars.not_measured(bars.ACROSS_CORRECT, old) is None


# ---- command line -----------------------------------------------------------------------------
def test_cli_prints_the_table_and_writes_its_json(tmp_path, capsys, monkeypatch):
    import cuflux

    def no_gpu(*a, **k):
        raise AssertionError("bars must not touch CUDA or the World")

    monkeypatch.setattr(cuflux, "init", no_gpu, raising=False)
    monkeypatch.setattr(cuflux, "device_count", no_gpu, raising=False)
    run = tmp_path / "run"
    _write(run, "gemm_rs", 2, [{"case": "a", "cuflux_ms": 1.1, "cublas_ms": 1.0,
                                "nccl_ms": 1.2, "host_us": 9.0}])
    _write(run, "across", 2, [{"case": "b", "correct": True}])
    (run / "knobs.json").write_text(json.dumps({"rows": []}))  # no "op": skipped
    (run / "list.json").write_text("[1, 2]")
    (run / "probe.json").write_text(json.dumps({"op": "probe", "rows": []}))
    out = tmp_path / "out"
    assert cli.main(["bars", str(run), "--outdir", str(out)]) == 0  # missed bars: still 0
    printed = capsys.readouterr().out
    assert "MISSED" in printed and "issue 15: 1 met, 1 missed, 0 not measured here" in printed
    assert "issue 20: 1 met, 0 missed, 0 not measured here" in printed
    assert printed.index("issue  ") < printed.index("issue 14:")  # the table, then the summary
    doc = json.loads((out / f"bars-{MACHINE}-W2-{DATE}.json").read_text())
    assert doc["date"] == DATE and doc["command"].startswith("python -m cuflux.bench bars")
    assert [pathlib.Path(p).name for p in doc["files"]] == [
        f"across-{MACHINE}-W2-{DATE}.json", f"gemm_rs-{MACHINE}-W2-{DATE}.json"]
    assert doc["summary"] == {"14": {"met": 1, "missed": 0, "not_measured": 0},
                              "15": {"met": 1, "missed": 1, "not_measured": 0},
                              "20": {"met": 1, "missed": 0, "not_measured": 0}}
    assert [c["issue"] for c in doc["checks"]] == [14, 15, 15, 20]
    assert {k for c in doc["checks"] for k in c} >= {"issue", "bar", "file", "case", "value",
                                                     "threshold", "met"}


def test_cli_defaults_to_the_first_dir_and_joins_several_runs(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "allgather", 1, [{"case": "x", "host_us": 3.0, "cuflux_ms": 0.1}])
    _write(b, "allgather", 2, [{"case": "y", "host_us": 3.0, "cuflux_ms": 0.1}],
           name="allgather-h200-W2-2026-12-01.json", machine="h200", date="2026-12-01")
    assert cli.main(["bars", str(a), str(b)]) == 0
    written, = a.glob("bars-*.json")
    assert written.name == f"bars-h200+{MACHINE}-W1+2-2026-12-01+{DATE}.json"
    assert json.loads(written.read_text())["summary"] == {
        "14": {"met": 4, "missed": 0, "not_measured": 0}}


def test_cli_without_results_exits_2(tmp_path, capsys):
    (tmp_path / "other.json").write_text(json.dumps({"name": "not a run"}))
    assert cli.main(["bars", str(tmp_path), str(tmp_path / "absent")]) == 2
    assert "no JSON of a known op" in capsys.readouterr().out
    assert not list(tmp_path.glob("bars-*.json"))


def test_bars_runs_without_cuda_or_mpi(tmp_path):
    """`python -m cuflux.bench bars` in a fresh process loads neither CuPy nor MPI."""
    _write(tmp_path, "allgather", 1, [{"case": "x", "host_us": 3.0, "cuflux_ms": 0.1}])
    code = ("import sys, cuflux.bench.__main__ as m; rc = m.main(['bars', sys.argv[1]]); "
            "print(rc, 'cupy' in sys.modules, 'mpi4py.MPI' in sys.modules)")
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=pathlib.Path(__file__).parents[1])
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines()[-1] == "0 False False"


def test_expected_benchmark_without_json_is_missed(tmp_path, capsys):
    """--expect: an op the run meant to benchmark but wrote no JSON of is a missed check under
    its issue; with no JSON at all each expected op is named and the exit status is 2; an
    unknown op is refused."""
    rows = [{"case": "AllGather", "correct": True}]
    _checks(tmp_path, "across", 2, rows)  # writes the across file
    assert bars.main([str(tmp_path), "--expect", "across,allreduce,gemm_rs"]) == 0
    saved = json.loads(next(tmp_path.glob("bars-*.json")).read_text())
    missing = {(c["issue"], c["case"]) for c in saved["checks"] if c["met"] is False}
    assert missing == {(16, "allreduce"), (15, "gemm_rs")}
    assert saved["summary"]["16"] == {"met": 0, "missed": 1, "not_measured": 0}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert bars.main([str(empty), "--expect", "all2all"]) == 2
    assert "issue 17: MISSED: the all2all benchmark wrote its JSON" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bars.main([str(empty), "--expect", "nope"])


def test_all2all_copy_reference_row_is_not_held_to_host_bars(tmp_path):
    rows = [_a2a_row("op", 8192, host_us=12.0),
            {"case": "cudaMemcpyAsync of the same bytes", "host_us": 40.0, "cuflux_ms": 0.03}]
    checks = _checks(tmp_path, "all2all", 1, rows)
    assert _met(checks, bars.host_bar(1)) == {"op": False}
