"""The one multi-rank test helper: launch `mpiexec -n W` under a deadline, collect every rank.

Each rank calls function(world, **kwargs) from tests/rank_main.py and writes its outcome (ok,
result or traceback) to outdir/rank<r>.json. By default the W ranks stay alive between tests (a
pool per W, so contexts and loaded kernels are paid once per W rather than once per test);
CUFLUX_TEST_POOL=0 launches `mpiexec -n W` afresh for every test. Either way `run_ranks` kills
the launch at the deadline and fails with every rank's traceback; a failed case ends its pool
and the next test starts a new one.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import functools
import itertools
import queue
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_available() -> bool:
    try:
        from cupy.cuda import runtime

        return runtime.getDeviceCount() > 0
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def hopper() -> bool:
    """A GPU with the Hopper core's instructions (sm_90a) is present."""
    if not gpu_available():
        return False
    from cuflux import kernels

    return kernels.device_arch() == "sm_90a"


def core_impls() -> list[str]:
    """The GEMM cores this machine runs: the portable one everywhere, Hopper's where present."""
    return ["sm90", "sm80"] if hopper() else ["sm80"]


def fresh_seed() -> int:
    """A new random seed per test run (the failing case's message prints it)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def world_sizes() -> list[int]:
    """W values for GPU tests: CUFLUX_TEST_WORLD_SIZES="1,2,4,8" (default 1,2,4)."""
    return [int(w) for w in os.environ.get("CUFLUX_TEST_WORLD_SIZES", "1,2,4").split(",") if w]


@functools.lru_cache(maxsize=None)
def mpiexec() -> list[str]:
    """mpiexec matching mpi4py (the one beside this Python first), with Open MPI's flags for
    running as root and with more ranks than cores (ranks sharing one GPU)."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = here if os.path.exists(here) else shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise RuntimeError("no mpiexec found: install the 'mpi' extra (mpich) or an MPI")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "openrte" in text or "prrte" in text:
        return [exe, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    return [exe]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("CUDA_MODULE_LOADING", "EAGER")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    return env


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Pool:
    """W ranks of tests.rank_main --pool under one mpiexec; stdout read by a thread."""

    _ids = itertools.count()

    def __init__(self, world_size: int):
        self.folder = tempfile.mkdtemp(prefix="cuflux-pool-")  # commands, as files
        self.sent = 0
        cmd = mpiexec() + ["-n", str(world_size), sys.executable, "-m", "tests.rank_main",
                           "--pool", self.folder]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.free_fraction = 1.0  # smallest free share of device memory after the last case
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of output: the pool has exited

    def _send(self, command: dict) -> None:
        path = os.path.join(self.folder, f"cmd{self.sent}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(command, f)
        os.replace(path + ".tmp", path)  # rank 0 never sees half a command
        self.sent += 1

    def run(self, target: str, kwargs: dict, outdir: str, timeout_s: float):
        """(output, timed_out, exit code or None while the pool lives on)."""
        cid = next(self._ids)
        env = {k: v for k, v in os.environ.items() if k.startswith("CUFLUX_")}
        self._send({"id": cid, "target": target, "kwargs": kwargs, "outdir": outdir,
                    "env": env})
        out, deadline = [], time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                _kill(self.proc)
                self.proc.wait()
                return "".join(out), True, self.proc.returncode
            if line is None:
                return "".join(out), False, self.proc.wait()
            if line.startswith(f"CUFLUX-POOL-DONE {cid} "):
                self.free_fraction = float(line.split()[2])
                return "".join(out), False, None
            out.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"quit": True})
                self.proc.wait(timeout=30)
            except Exception:
                _kill(self.proc)
        shutil.rmtree(self.folder, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}
POOL_MIN_FREE = 0.5  # a pool whose device has less free memory than this is replaced


def _pool(world_size: int) -> _Pool:
    """The live pool of this size; pools of other sizes are ended first, so one GPU holds at
    most one pool's contexts (several pools side by side ran the H200 out of memory)."""
    for other in [w for w in _POOLS if w != world_size]:
        _POOLS.pop(other).close()
    p = _POOLS.get(world_size)
    if p is not None and p.free_fraction < POOL_MIN_FREE:
        p.close()  # long-lived ranks hold caches (cuBLAS, CuPy): start afresh
        p = None
    if p is None or p.proc.poll() is not None:
        p = _POOLS[world_size] = _Pool(world_size)
    return p


def close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def kill_pools() -> None:
    """No goodbye: every pool's process group killed at once (pytest itself is being ended)."""
    while _POOLS:
        _kill(_POOLS.popitem()[1].proc)


def _run_once(world_size: int, target: str, kwargs: dict, outdir: str, timeout_s: float):
    cmd = mpiexec() + ["-n", str(world_size), sys.executable, "-m", "tests.rank_main", target,
                       json.dumps(kwargs), outdir]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return output, False, proc.returncode
    except subprocess.TimeoutExpired:
        _kill(proc)
        output, _ = proc.communicate()
        return output, True, proc.returncode


def on_ranks(fn):
    """Decorator of a rank body fn(world, **kwargs) that sits in a test module beside the test
    asserting on it: `fn.run(W, timeout_s=180, **kwargs)` runs it on W ranks (each rank imports
    the module by name, tests/rank_main.py) and returns every rank's result, or fails with every
    rank's traceback; `test_x = fn.test(expect=..., sizes=...)` is the whole test where all it
    asserts is what every rank returned. The body itself stays a plain function (fn(world) on
    one rank works)."""
    target = f"{fn.__module__}:{fn.__name__}"

    def run(world_size: int, timeout_s: float = 180, **kwargs) -> list:
        return run_ranks(world_size, target, timeout_s, **kwargs)

    _unset = object()

    def test(expect=_unset, sizes=None, timeout_s: float = 180, **kwargs):
        """The GPU test of this body, bound to a test_* name of the module (pytest collects it
        by that name): for each W of `sizes` (default: every tested W) the body runs on W ranks
        and, where `expect` is given, every rank must have returned it. Arguments that are
        callables (seed=fresh_seed) are called for each run."""
        import pytest

        @pytest.mark.gpu
        @pytest.mark.parametrize("W", world_sizes() if sizes is None else list(sizes))
        def check(W):
            # A callable argument (seed=fresh_seed) is drawn anew for every run.
            got = run(W, timeout_s, **{k: v() if callable(v) else v for k, v in kwargs.items()})
            assert expect is _unset or got == [expect] * W, \
                f"{target} on W={W}: the ranks returned {got}, each should return {expect!r}"

        check.__doc__ = fn.__doc__
        return check

    fn.run, fn.test, fn.target = run, test, target
    return fn


def run_ranks(world_size: int, target: str, timeout_s: float = 180, **kwargs) -> list:
    """Run tests.<target> on `world_size` ranks; return each rank's result, or fail."""
    outdir = tempfile.mkdtemp(prefix="cuflux-ranks-")
    if os.environ.get("CUFLUX_TEST_POOL", "1") == "1":
        output, timed_out, code = _pool(world_size).run(target, kwargs, outdir, timeout_s)
    else:
        output, timed_out, code = _run_once(world_size, target, kwargs, outdir, timeout_s)
    outcomes = {}
    for r in range(world_size):
        path = os.path.join(outdir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                outcomes[r] = json.load(f)
    shutil.rmtree(outdir, ignore_errors=True)
    failed = [r for r in range(world_size) if not outcomes.get(r, {}).get("ok")]
    if timed_out or failed or code:
        lines = [f"{target} on W={world_size}: "
                 + ("TIMED OUT after %.0f s; " % timeout_s if timed_out else "")
                 + f"exit code {code}; failed ranks {failed}"]
        for r in range(world_size):
            o = outcomes.get(r)
            lines.append(f"--- rank {r}: " + ("no outcome written" if o is None else
                                              ("ok" if o["ok"] else o["traceback"])))
        lines.append("--- mpiexec output (tail):\n" + output[-4000:])
        message = "\n".join(lines)
        if os.environ.get("CUFLUX_FAIL_LOG"):  # seen at once, even if the run is cut short
            with open(os.environ["CUFLUX_FAIL_LOG"], "a") as f:
                f.write(f"##### {time.strftime('%H:%M:%S')} {message}\n")
        raise AssertionError(message)
    return [outcomes[r].get("result") for r in range(world_size)]
