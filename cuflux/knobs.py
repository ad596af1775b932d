"""Every CUFLUX_* environment variable cuflux reads, in one place (docs/knobs.md lists them).

Each knob has a name, a default, a type with its check, and a one-line meaning. Values are
read from the environment each time they are asked for, never frozen at import: a test or a
launcher may set a variable after cuflux is imported and the next read sees it. An unset or
empty variable means the default. A value that fails its check raises ValueError naming the
variable, what it must be and what it was.

    from cuflux import knobs
    knobs.gemm_tune()            # False under CUFLUX_GEMM_TUNE=0
    knobs.describe()             # {name: current value} of every knob, for benchmark JSON

The tests' own variables (CUFLUX_TEST_*) and the project scripts' (scripts/*.sh) are not
cuflux's knobs: they stay with the tests and scripts that read them.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Mapping

__all__ = ["Knob", "KNOBS", "CACHE_DIR", "HOST_TIMEOUT_S", "NUMA_SIZE", "NODE_SIZE", "GEMM_TUNE",
           "GEMM_TUNE_BUDGET_S", "GEMM_CUBLASLT", "GEMM_ALGO_TUNE", "GRAPH_REPLAY",
           "GEMM_BENCH_CONFIGS", "cache_dir", "host_timeout_s", "numa_size", "node_size",
           "gemm_tune", "gemm_tune_budget_s", "gemm_cublaslt", "gemm_algo_tune",
           "graph_replay", "gemm_bench_configs", "describe"]


@dataclasses.dataclass(frozen=True)
class Knob:
    """One environment variable: `get()` reads and checks its current value.

    kind: what a value must be, as error messages and docs say it ("a directory", ...).
    default: the value when unset or empty, or a function of the environment giving it.
    default_doc: the default as the docs write it.
    parse: text -> value; raises ValueError (any message) when the text is not a `kind`.
    """

    name: str
    kind: str
    default: Any
    default_doc: str
    doc: str
    used_by: str
    parse: Callable[[str], Any]

    def get(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        text = env.get(self.name)
        if not text:  # unset or empty (gemm reads GEMM_TUNE per call: keep this path short)
            default = self.default
            return default(env) if callable(default) else default
        try:
            return self.parse(text)
        except ValueError:
            raise ValueError(f"{self.name} must be {self.kind}, got {text!r}") from None


# ---- parsers: text -> value, ValueError when the text is not one ----------------------------
def _path(text: str) -> str:
    return text


def _seconds(minimum: float, inclusive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        v = float(text)
        if not math.isfinite(v) or v < minimum or (v == minimum and not inclusive):
            raise ValueError(text)
        return v
    return parse


def _count(text: str) -> int:
    v = int(text.strip())
    if v < 0:
        raise ValueError(text)
    return v


def _positive(text: str) -> int:
    v = int(text.strip())
    if v < 1:
        raise ValueError(text)
    return v


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _switch(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(text)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise ValueError(text)
    return names


def _default_cache_dir(env: Mapping[str, str]) -> str:
    # $XDG_CACHE_HOME/cuflux, else ~/.cache/cuflux ($HOME of `env`, else the user's home)
    base = env.get("XDG_CACHE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cuflux")


# ---- the knobs --------------------------------------------------------------------------------
CACHE_DIR = Knob(
    "CUFLUX_CACHE_DIR", "a directory", _default_cache_dir,
    "$XDG_CACHE_HOME/cuflux, else ~/.cache/cuflux",
    "Kernel cache (cubins, the GEMM tuner's table): yours (or root's) and writable by its "
    "owner alone; cuflux creates it 0700.",
    "kernels.cache_dir, gemm_tuner.tuner_path, python -m cuflux.compile --cache-dir",
    _path)
HOST_TIMEOUT_S = Knob(
    "CUFLUX_HOST_TIMEOUT_S", "a finite number of seconds > 0", 120.0, "120",
    "Bound of every host collective of a World (set-up, barriers, close) unless "
    "World(timeout_s=...) says otherwise.",
    "world.default_timeout_s", _seconds(0.0, inclusive=False))
NUMA_SIZE = Knob(
    "CUFLUX_NUMA_SIZE", "an integer >= 0", 0, "0",
    "Ranks per NUMA domain (0: one domain); below the world size a PCIe world takes the "
    "2-D ring transfer order.",
    "World.topology (topology.Topology.numa_size)", _count)
NODE_SIZE = Knob(
    "CUFLUX_NODE_SIZE", "an integer >= 1", None, "unset: every host's P2P group is one node",
    "Ranks per node: splits each group of ranks that reach each other by P2P into nodes of "
    "that many consecutive ranks, so one host emulates several nodes (issue 20); "
    "World(node_size=...) says otherwise.",
    "World.nodes (nodes.node_layout)", _positive)
GEMM_TUNE = Knob(
    "CUFLUX_GEMM_TUNE", "one of 1/0, true/false, yes/no, on/off", True, "1",
    "Tune the Hopper GEMM's configuration per shape class on first use (0: the fixed "
    "heuristic, no timing).",
    "gemm_tuner (gemm, plan); bench gemm_rs sets 0 unless given", _switch)
GEMM_TUNE_BUDGET_S = Knob(
    "CUFLUX_GEMM_TUNE_BUDGET_S", "a finite number of seconds >= 0", 2.0, "2",
    "Wall-clock bound of one tuning run of the GEMM (one shape class, once per machine).",
    "gemm_tuner.tuned_config", _seconds(0.0, inclusive=True))
GEMM_CUBLASLT = Knob(
    "CUFLUX_GEMM_CUBLASLT", "one of 1/0, true/false, yes/no, on/off", True, "1",
    "gemm's cuBLAS route through cublasLtMatmul with a plan cached per shape (less host time a "
    "call than cublasGemmEx, which picks its kernel on every call); 0: cublasGemmEx.",
    "gemm_core.launch_cublas", _switch)
GEMM_ALGO_TUNE = Knob(
    "CUFLUX_GEMM_ALGO_TUNE", "one of 1/0, true/false, yes/no, on/off", True, "1",
    "gemm's cublasLt route times its heuristic's first candidate algorithms at a shape's first "
    "call (GEMMs of 2^36 flop and more) and keeps the fastest, per exact shape, in "
    "<cache dir>/cublaslt_algos.json; 0: the heuristic's first.",
    "gemm_core.launch_cublaslt", _switch)
GRAPH_REPLAY = Knob(
    "CUFLUX_GRAPH_REPLAY", "one of 1/0, true/false, yes/no, on/off", True, "1",
    "A call an op has seen before (ops.base.CallMemo) replays what it launched as a CUDA graph, "
    "captured at its first repeat: one cudaGraphLaunch (~3 us of host time) where the launches "
    "cost ~4-5 us each, and cublasLtMatmul 10-15; 0: the repeat makes the launches themselves.",
    "launch.graph_replay, gemm_core.launch_cublaslt (read when a call is bound)", _switch)
GEMM_BENCH_CONFIGS = Knob(
    "CUFLUX_GEMM_BENCH_CONFIGS", "comma-separated GEMM configuration names", None,
    "unset: every configuration",
    "Which Hopper GEMM configurations `python -m cuflux.bench gemm` times "
    "(e.g. 128x256s4c1,256x128s4c1); names from cuflux.ops.gemm.SM90_CONFIGS.",
    "bench/gemm.py", _names)

KNOBS: dict[str, Knob] = {k.name: k for k in (CACHE_DIR, HOST_TIMEOUT_S, NUMA_SIZE, NODE_SIZE,
                                              GEMM_TUNE, GEMM_TUNE_BUDGET_S, GEMM_CUBLASLT,
                                              GEMM_ALGO_TUNE, GRAPH_REPLAY,
                                              GEMM_BENCH_CONFIGS)}


# ---- read at call time ------------------------------------------------------------------------
def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """The kernel cache directory's path (not created or checked: kernels.cache_dir does)."""
    return CACHE_DIR.get(environ)


def host_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds that bound a World's host collectives by default."""
    return HOST_TIMEOUT_S.get(environ)


def numa_size(environ: Mapping[str, str] | None = None) -> int:
    """Ranks per NUMA domain (0: one domain)."""
    return NUMA_SIZE.get(environ)


def node_size(environ: Mapping[str, str] | None = None) -> int | None:
    """Ranks per node, or None: every group of ranks that reach each other by P2P is a node."""
    return NODE_SIZE.get(environ)


def gemm_tune(environ: Mapping[str, str] | None = None) -> bool:
    """Whether gemm(impl="auto") tunes (and uses the tuner's table)."""
    return GEMM_TUNE.get(environ)


def gemm_tune_budget_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds one tuning run may take."""
    return GEMM_TUNE_BUDGET_S.get(environ)


def gemm_cublaslt(environ: Mapping[str, str] | None = None) -> bool:
    """Whether gemm's cuBLAS route calls cublasLtMatmul (a cached plan) instead of GemmEx."""
    return GEMM_CUBLASLT.get(environ)


def gemm_algo_tune(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the cublasLt route times its candidate algorithms at a shape's first call."""
    return GEMM_ALGO_TUNE.get(environ)


def graph_replay(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a repeated call replays what it launched as a CUDA graph."""
    return GRAPH_REPLAY.get(environ)


def gemm_bench_configs(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The GEMM configurations the gemm benchmark times, or None for every one."""
    return GEMM_BENCH_CONFIGS.get(environ)


def describe(environ: Mapping[str, str] | None = None) -> dict:
    """{name: current value} of every knob, defaults included, JSON-able (tuples as lists).
    Raises ValueError on the first value that fails its check."""
    out = {}
    for name, knob in KNOBS.items():
        v = knob.get(environ)
        out[name] = list(v) if isinstance(v, tuple) else v
    return out
