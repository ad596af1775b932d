"""Which GEMM runs a shape: the tuner table, its keys, the untuned heuristic and `plan`.

On sm_90a the plain GEMM (cuflux.gemm, impl="auto") takes, per (GPU, dtype, B layout, shape
class), cuBLAS or the fastest of the Hopper configurations in TUNER_CANDIDATES: on the first
call of a class it times them all for a bounded budget on the caller's own operands and keeps
the fastest, with every time, in <kernel cache dir>/gemm_tuner.json (at most 512 entries,
shared by the processes of the machine). gemm takes our core only where it beat cuBLAS there by
CORE_MARGIN (`plan`); `fastest` is the entry's plain winner. Tuning can be switched off and its
budget set (cuflux/knobs.py: gemm_tune, gemm_tune_budget_s); then the heuristic decides. The
fused ops read the table (never tune): AllGatherGemm fuses where `fastest` is one of ours and
takes that Hopper configuration where its kernel has it.
"""
from __future__ import annotations

import json
import math
import threading
import time

from cuflux import kernels, knobs
from cuflux.arrays import dtype_info
from cuflux.gemm_core import IN_DTYPES, SM90_CONFIGS, SM90_DEFAULT, device_props

__all__ = ["CUBLAS", "TUNER_CANDIDATES", "CUBLAS_BELOW_M", "CORE_MARGIN", "TUNE_ROUNDS",
           "tuner_path",
           "load_tuner", "shape_class", "tune_key", "core_heuristic", "heuristic", "tuned_config",
           "preferred", "fastest", "plan", "choice", "algo_path", "recall_algo", "remember_algo"]

_OP = "cuflux.gemm"
CUBLAS = "cublas"  # the tuner's name for cuBLAS among the Hopper configurations
# The tuner's candidates: the 1-CTA cooperative tiles with both epilogues, one 2-CTA cluster (B
# multicast; at its 1-CTA twin's speed so far) and the ping-pong 128x128, which wins where tiles
# are few (2048^2, 8x4096x4096, 777x1536x2048). Every entry of SM90_CONFIGS stays callable
# through config=.
TUNER_CANDIDATES = ("256x128s4c1t", "128x256s4c1t", "256x128s4c1", "128x256s4c1", "128x256s4c2",
                    "128x128s6c1", "128x128s7c1p")
# Below this many rows a 128- or 256-row tile is mostly padding and the grid covers few SMs:
# cuBLAS (split-K, narrow tiles) is the untuned choice there. The tuner measures both.
CUBLAS_BELOW_M = 256
# gemm takes our core over cuBLAS only where the tuner timed it this much faster (0.10: 10 %).
# The tuner's timing (best call of a short burst) does not see what users get: in two H200
# runs of `python -m cuflux.bench gemm` (scripts/results/gemm-h200-W1-2026-12-01c/d.json) every
# shape where the tuner had picked our core past a 3 % margin at a GPU-queued ratio near 1
# (0.98-1.01x cuBLAS: M = 2048 x 28672 x 8192, 2048 x 8192 x 28672 nk, 4096x12288x6144 kn) ran
# at 0.86-0.95x cupy.matmul called back to back from Python, in both runs; where our core wins
# clearly (128x28672x8192 kn: 1.63x) it wins in every regime. A near-tie goes to the library
# gemm replaces (issue 14: never slower than it).
CORE_MARGIN = 0.10
TUNE_ROUNDS = 2  # rounds over the candidates (the order reversed in the second)

_TUNER_LOCK = threading.Lock()
_TUNER_MAX_ENTRIES = 512
_TUNER_TABLE: dict | None = None  # the file's contents, read once per process


def tuner_path():
    return kernels.cache_dir() / "gemm_tuner.json"


def shape_class(M: int, N: int, K: int) -> str:
    """The tuner's shape class: ceil(log2) of each dimension (at least 3), "MxNxK"."""
    return "x".join(str(max(3, math.ceil(math.log2(max(x, 1))))) for x in (M, N, K))


def core_heuristic(M: int, N: int, K: int) -> str:
    """Our Hopper core's configuration without tuning, from the H200 measurements in
    docs/gemm_notes.md (v5: the TMA-store epilogue wins at every K)."""
    if N <= 128:
        return "128x128s6c1"
    return SM90_DEFAULT


def heuristic(M: int, N: int, K: int) -> str:
    """gemm's choice without tuning: cuBLAS for small M, else core_heuristic."""
    return CUBLAS if M < CUBLAS_BELOW_M else core_heuristic(M, N, K)


def _read_table(path) -> dict:
    """A table file's contents, {} where it is missing or unreadable (tuning starts over)."""
    try:
        table = json.loads(path.read_text())
    except Exception:
        return {}
    return table if isinstance(table, dict) else {}


def load_tuner() -> dict:
    """The tuner table (in memory after the first read)."""
    global _TUNER_TABLE
    if _TUNER_TABLE is None:
        _TUNER_TABLE = _read_table(tuner_path())
    return _TUNER_TABLE


def _valid(name) -> bool:
    return name == CUBLAS or name in SM90_CONFIGS


def tuned_config(key: str, run_candidate, stream, tune: bool = True) -> str | None:
    """The cached choice for `key`, or (tune) time the candidates (bounded) and remember the
    winner. run_candidate(name) enqueues one call of candidate `name` on `stream`."""
    entry = load_tuner().get(key)
    if entry is not None and _valid(entry.get("config")):
        return entry["config"]
    if not tune:
        return None
    import cupy

    budget_s = knobs.gemm_tune_budget_s()
    t_end = time.monotonic() + budget_s
    times = {}
    names = (CUBLAS,) + TUNER_CANDIDATES
    # TUNE_ROUNDS rounds, the order reversed every other round, each candidate's best call: the
    # GPU's clock climbs through the first round, and the candidate timed first (cuBLAS) must
    # not read slower for it.
    for rnd in range(TUNE_ROUNDS):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            if time.monotonic() > t_end:
                break
            if rnd == 0:
                run_candidate(name)  # warm-up (first launch of the kernel)
            ev = [cupy.cuda.Event() for _ in range(4)]
            ev[0].record(stream)
            for i in range(1, 4):
                run_candidate(name)
                ev[i].record(stream)
            ev[3].synchronize()
            best = min(cupy.cuda.get_elapsed_time(ev[i - 1], ev[i]) for i in range(1, 4))
            times[name] = min(times.get(name, best), best)
    if not times:
        return None
    best = min(times, key=times.get)
    _store(load_tuner(), tuner_path(), key,
           {"config": best, "ms": times, "when": time.strftime("%Y-%m-%d")})
    return best


def _store(table: dict, path, key: str, entry: dict) -> None:
    """table[key] = entry, merged with what other processes wrote to `path` since this one read
    it, the oldest entries dropped past _TUNER_MAX_ENTRIES, written atomically."""
    with _TUNER_LOCK:
        table.update(_read_table(path))
        table.pop(key, None)
        table[key] = entry
        while len(table) > _TUNER_MAX_ENTRIES:
            table.pop(next(iter(table)))
        kernels.write_atomically(path, json.dumps(table, indent=0).encode())


# ---- cublasLt's algorithm per exact shape (gemm_core.ALGO_CANDIDATES says why) ----------------
_ALGO_TABLE: dict | None = None  # algo_path()'s contents, read once per process


def algo_path():
    """The cublasLt algorithm table: a file of its own, so that exact shapes (many where M
    varies) never push the shape classes' entries out of gemm_tuner.json."""
    return kernels.cache_dir() / "cublaslt_algos.json"


def _algo_table() -> dict:
    global _ALGO_TABLE
    if _ALGO_TABLE is None:
        _ALGO_TABLE = _read_table(algo_path())
    return _ALGO_TABLE


def recall_algo(key: str) -> int | None:
    """The index (among the heuristic's candidates) remembered for `key`, or None."""
    entry = _algo_table().get(key)
    index = entry.get("algo") if isinstance(entry, dict) else None
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def remember_algo(key: str, index: int, ms: list) -> None:
    """Keep `index` for `key`, with every candidate's time (None: not timed)."""
    _store(_algo_table(), algo_path(), key,
           {"algo": index, "ms": ms, "when": time.strftime("%Y-%m-%d")})


def tune_key(dt, b_layout: str, M: int, N: int, K: int) -> str:
    """The tuner table's key of a shape class on the current device."""
    return f"{device_props()[3]}|{dt.name}|{b_layout}|{shape_class(M, N, K)}"


def preferred(key: str, winner: str) -> str:
    """gemm's pick from the tuner's `winner` for `key`: cuBLAS unless the winner is one of our
    configurations and the entry's times show it beat cuBLAS by CORE_MARGIN (an entry without
    a cuBLAS time, its budget spent first, keeps the winner)."""
    if winner == CUBLAS:
        return winner
    ms = load_tuner().get(key, {}).get("ms") or {}
    t_cublas, t_core = ms.get(CUBLAS), ms.get(winner)
    if (isinstance(t_cublas, (int, float)) and isinstance(t_core, (int, float))
            and t_cublas <= t_core * (1.0 + CORE_MARGIN)):
        return CUBLAS
    return winner


def fastest(M: int, N: int, K: int, dtype="bfloat16", b_layout: str = "kn") -> str:
    """The tuner's plain winner for this shape on the current device (no margin): "cublas" or
    a Hopper configuration where it has measured the shape class, else the untuned heuristic
    ("sm80" off sm_90a). AllGatherGemm's auto route fuses where this is one of ours."""
    dt = dtype_info(dtype, IN_DTYPES, _OP)
    if device_props()[1] != "sm_90a":
        return CUBLAS if M < CUBLAS_BELOW_M else "sm80"
    chosen = None
    if knobs.gemm_tune():
        chosen = tuned_config(tune_key(dt, b_layout, M, N, K), None, None, tune=False)
    return chosen or heuristic(M, N, K)


def plan(M: int, N: int, K: int, dtype="bfloat16", b_layout: str = "kn") -> str:
    """What `gemm(impl="auto")` runs for this shape on the current device, without running
    anything: "cublas", a Hopper configuration name (SM90_CONFIGS), or "sm80" (the portable
    core, on GPUs without the Hopper path). Where the tuner has measured this shape class, its
    winner when that is cuBLAS or beat cuBLAS by CORE_MARGIN (preferred), else cuBLAS; where
    it has not, the untuned heuristic."""
    chosen = fastest(M, N, K, dtype, b_layout)
    if chosen in (CUBLAS, "sm80") or not knobs.gemm_tune():
        return chosen
    dt = dtype_info(dtype, IN_DTYPES, _OP)
    return preferred(tune_key(dt, b_layout, M, N, K), chosen)


_CHOICES: dict = {}  # (dtype, layout, M, N, K) -> (tuner table it came from, choice)


def choice(dt, b_layout, M, N, K, run, s, under_capture) -> str:
    """What auto runs for this exact shape on sm_90a: remembered per shape while the tuner
    table it came from is the current one (tests and other processes may replace the table).
    run(name): one call of candidate `name` on stream s, for timing (never under capture)."""
    key = (dt.name, b_layout, M, N, K)
    hit = _CHOICES.get(key)
    tuning = knobs.gemm_tune()
    if hit is not None and hit[0] is (_TUNER_TABLE if tuning else None):
        return hit[1]
    config = None
    if tuning:
        table_key = tune_key(dt, b_layout, M, N, K)
        config = tuned_config(table_key, run, s, tune=not under_capture)
        if config is not None:
            config = preferred(table_key, config)
    decided = config is not None or not tuning
    config = config or heuristic(M, N, K)
    if decided and len(_CHOICES) < 4096:
        _CHOICES[key] = (_TUNER_TABLE if tuning else None, config)
    return config
