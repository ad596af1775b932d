"""cuflux.knobs: every CUFLUX_* variable in one module, read at call time (CPU only, never skipped).

The last tests hold the line: no module of the package names a CUFLUX_* variable except
knobs.py, and docs/knobs.md documents every knob.
"""
import ast
import json
import math
import pathlib

import pytest

from cuflux import knobs

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cuflux"

# Files that still name CUFLUX_* variables themselves, with the names: they were being edited
# by others when knobs.py landed (issue 18) and move to cuflux.knobs next. Remove a file's
# entry when it no longer names them (the test below fails until the entry is removed, so this
# list only shrinks). No other file may join it.
EXPECTED_TO_MOVE: dict[str, set] = {}  # every read goes through cuflux/knobs.py


@pytest.fixture
def clean(monkeypatch):
    for name in knobs.KNOBS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---- defaults -----------------------------------------------------------------------------------
def test_defaults(clean):
    clean.setenv("XDG_CACHE_HOME", "/xdg")
    assert knobs.cache_dir() == "/xdg/cuflux"
    assert knobs.host_timeout_s() == 120.0
    assert knobs.numa_size() == 0
    assert knobs.node_size() is None
    assert knobs.gemm_tune() is True
    assert knobs.gemm_tune_budget_s() == 2.0
    assert knobs.gemm_bench_configs() is None


def test_cache_dir_falls_back_to_home_then_takes_the_variable():
    assert knobs.cache_dir({"HOME": "/h"}) == "/h/.cache/cuflux"
    assert knobs.cache_dir({"HOME": "/h", "XDG_CACHE_HOME": "/x"}) == "/x/cuflux"
    assert knobs.cache_dir({"HOME": "/h", "CUFLUX_CACHE_DIR": "/c"}) == "/c"
    assert knobs.cache_dir({"HOME": "/h", "CUFLUX_CACHE_DIR": ""}) == "/h/.cache/cuflux"


def test_empty_means_the_default():
    env = {name: "" for name in knobs.KNOBS}
    env["HOME"] = "/h"
    assert knobs.describe(env) == knobs.describe({"HOME": "/h"})


def test_values_are_parsed():
    assert knobs.host_timeout_s({"CUFLUX_HOST_TIMEOUT_S": "7.5"}) == 7.5
    assert knobs.numa_size({"CUFLUX_NUMA_SIZE": "4"}) == 4
    assert knobs.node_size({"CUFLUX_NODE_SIZE": "2"}) == 2
    for text, on in [("0", False), ("1", True), ("off", False), ("TRUE", True), (" no ", False)]:
        assert knobs.gemm_tune({"CUFLUX_GEMM_TUNE": text}) is on, text
    assert knobs.gemm_tune_budget_s({"CUFLUX_GEMM_TUNE_BUDGET_S": "0"}) == 0.0
    assert knobs.gemm_tune_budget_s({"CUFLUX_GEMM_TUNE_BUDGET_S": "5"}) == 5.0
    assert knobs.gemm_bench_configs({"CUFLUX_GEMM_BENCH_CONFIGS": " a , b"}) == ("a", "b")


# ---- validation ---------------------------------------------------------------------------------
BAD = [("CUFLUX_GEMM_TUNE_BUDGET_S", "-1"), ("CUFLUX_GEMM_TUNE_BUDGET_S", "abc"),
       ("CUFLUX_GEMM_TUNE_BUDGET_S", "inf"), ("CUFLUX_GEMM_TUNE_BUDGET_S", "nan"),
       ("CUFLUX_HOST_TIMEOUT_S", "0"), ("CUFLUX_HOST_TIMEOUT_S", "nan"),
       ("CUFLUX_HOST_TIMEOUT_S", "-3"), ("CUFLUX_NUMA_SIZE", "-1"), ("CUFLUX_NUMA_SIZE", "2.5"),
       ("CUFLUX_NUMA_SIZE", "two"), ("CUFLUX_NODE_SIZE", "0"), ("CUFLUX_NODE_SIZE", "1.5"),
       ("CUFLUX_GEMM_TUNE", "maybe"), ("CUFLUX_GEMM_TUNE", "2"),
       ("CUFLUX_GEMM_BENCH_CONFIGS", "a,,b"), ("CUFLUX_GEMM_BENCH_CONFIGS", ",")]


@pytest.mark.parametrize("name,text", BAD)
def test_a_bad_value_raises_naming_the_variable_the_rule_and_the_value(name, text):
    knob = knobs.KNOBS[name]
    with pytest.raises(ValueError) as e:
        knob.get({name: text})
    msg = str(e.value)
    assert name in msg and knob.kind in msg and repr(text) in msg, msg
    with pytest.raises(ValueError, match=name):
        knobs.describe({name: text})


def test_read_at_call_time_not_at_import(clean, tmp_path):
    clean.setenv("CUFLUX_GEMM_TUNE_BUDGET_S", "3")
    assert knobs.gemm_tune_budget_s() == 3.0
    clean.setenv("CUFLUX_GEMM_TUNE_BUDGET_S", "abc")
    with pytest.raises(ValueError, match="CUFLUX_GEMM_TUNE_BUDGET_S"):
        knobs.gemm_tune_budget_s()
    from cuflux import kernels

    clean.setenv("CUFLUX_CACHE_DIR", str(tmp_path / "c1"))
    assert kernels.cache_dir() == tmp_path / "c1"
    clean.setenv("CUFLUX_CACHE_DIR", str(tmp_path / "c2"))
    assert kernels.cache_dir() == tmp_path / "c2"


# ---- describe -----------------------------------------------------------------------------------
def test_describe_lists_every_knob_json_able():
    env = {"HOME": "/h", "CUFLUX_GEMM_TUNE": "0", "CUFLUX_GEMM_BENCH_CONFIGS": "x,y",
           "CUFLUX_TEST_POOL": "1", "OTHER": "z"}
    d = knobs.describe(env)
    assert list(d) == list(knobs.KNOBS)
    assert d == {"CUFLUX_CACHE_DIR": "/h/.cache/cuflux", "CUFLUX_HOST_TIMEOUT_S": 120.0,
                 "CUFLUX_NUMA_SIZE": 0, "CUFLUX_NODE_SIZE": None, "CUFLUX_GEMM_TUNE": False,
                 "CUFLUX_GEMM_TUNE_BUDGET_S": 2.0, "CUFLUX_GEMM_CUBLASLT": True,
                 "CUFLUX_GEMM_ALGO_TUNE": True, "CUFLUX_GRAPH_REPLAY": True,
                 "CUFLUX_GEMM_BENCH_CONFIGS": ["x", "y"]}
    assert json.loads(json.dumps(d)) == d


def test_benchmark_json_records_the_knob_values(tmp_path):
    from cuflux.bench import __main__ as cli

    args = cli.parse_args(["gemm"], cwd=str(tmp_path))
    k = cli.knobs(args, {"HOME": "/h", "CUFLUX_NUMA_SIZE": "2"})
    assert k["values"]["CUFLUX_NUMA_SIZE"] == 2 and set(k["values"]) == set(knobs.KNOBS)
    assert k["env"] == {"CUFLUX_NUMA_SIZE": "2"}


def test_benchmark_refuses_a_bad_knob_before_it_runs(clean):
    from cuflux.bench import __main__ as cli

    clean.setenv("CUFLUX_GEMM_TUNE", "sometimes")
    with pytest.raises(ValueError, match="CUFLUX_GEMM_TUNE"):
        cli.main(["gemm"])


def test_gemm_bench_configs_are_checked_against_the_known_ones():
    from cuflux.bench.gemm import bench_configs

    known = ("c1", "c2", "c3")
    assert bench_configs(known, {}) == ["c1", "c2", "c3"]
    assert bench_configs(known, {"CUFLUX_GEMM_BENCH_CONFIGS": "c3,c1"}) == ["c1", "c3"]
    with pytest.raises(ValueError, match="CUFLUX_GEMM_BENCH_CONFIGS.*c9.*known: c1, c2, c3"):
        bench_configs(known, {"CUFLUX_GEMM_BENCH_CONFIGS": "c1,c9"})


# ---- agreement with the modules that still read their variables themselves ----------------------
def test_host_timeout_agrees_with_world(clean):
    """world.default_timeout_s becomes knobs.host_timeout_s: same default, same values, same
    refusals."""
    from cuflux import world

    assert knobs.HOST_TIMEOUT_S.name == world.TIMEOUT_ENV
    assert knobs.host_timeout_s() == world.DEFAULT_TIMEOUT_S == world.default_timeout_s()
    for text in ("7.5", "1e-3", "nan", "inf", "0", "-1", "abc"):
        clean.setenv(world.TIMEOUT_ENV, text)
        try:
            want = world.default_timeout_s()
        except ValueError:
            with pytest.raises(ValueError, match=world.TIMEOUT_ENV):
                knobs.host_timeout_s()
        else:
            assert knobs.host_timeout_s() == want and math.isfinite(want)


# ---- one module reads them all ------------------------------------------------------------------
def _named_variables(path: pathlib.Path) -> set[str]:
    """CUFLUX_* names written as whole string literals in a module's code (an environment
    read or write, or a constant that one uses); docstrings and messages that mention a name
    inside longer text do not count."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and knobs_name(node.value)):
            found.add(node.value)
    return found


def knobs_name(text: str) -> bool:
    import re

    return re.fullmatch(r"CUFLUX_[A-Z0-9_]+", text) is not None


def test_no_module_but_knobs_names_a_cuflux_variable():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "cuflux/knobs.py":
            continue
        names = _named_variables(path)
        if names:
            found[rel] = names
    new = {f: sorted(n - EXPECTED_TO_MOVE.get(f, set())) for f, n in found.items()
           if n - EXPECTED_TO_MOVE.get(f, set())}
    assert not new, (f"read these through cuflux.knobs (add the variable there if it is new): "
                     f"{new}")
    moved = {f: sorted(n - found.get(f, set())) for f, n in EXPECTED_TO_MOVE.items()
             if n - found.get(f, set())}
    assert not moved, (f"these no longer name their variables: remove them from "
                       f"EXPECTED_TO_MOVE in {pathlib.Path(__file__).name}: {moved}")
    unknown = set().union(*EXPECTED_TO_MOVE.values()) - set(knobs.KNOBS)
    assert not unknown, f"read but not a knob: {sorted(unknown)}"


def test_docs_list_every_knob_with_its_default():
    text = (ROOT / "docs" / "knobs.md").read_text()
    for name, knob in knobs.KNOBS.items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}`")), None)
        assert row is not None, f"docs/knobs.md has no row for {name}"
        assert knob.default_doc in row, f"docs/knobs.md: {name}'s row lacks its default"
