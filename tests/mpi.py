"""The one multi-rank test helper: launch `mpiexec -n W` under a deadline, collect every rank.

Each rank runs `python -m tests.rank_main <module:function> <json kwargs> <outdir>`, which calls
function(world, **kwargs) and writes its outcome (ok, result or traceback) to outdir/rank<r>.json.
`run_ranks` kills the whole launch at the deadline and fails with every rank's traceback.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_available() -> bool:
    try:
        from cupy.cuda import runtime

        return runtime.getDeviceCount() > 0
    except Exception:
        return False


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


def run_ranks(world_size: int, target: str, timeout_s: float = 180, **kwargs) -> list:
    """Run tests.<target> on `world_size` ranks; return each rank's result, or fail."""
    outdir = tempfile.mkdtemp(prefix="cuflux-ranks-")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("CUDA_MODULE_LOADING", "EAGER")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    cmd = mpiexec() + ["-n", str(world_size), sys.executable, "-m", "tests.rank_main", target,
                       json.dumps(kwargs), outdir]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    outcomes = {}
    for r in range(world_size):
        path = os.path.join(outdir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                outcomes[r] = json.load(f)
    shutil.rmtree(outdir, ignore_errors=True)
    failed = [r for r in range(world_size) if not outcomes.get(r, {}).get("ok")]
    if timed_out or failed or proc.returncode != 0:
        lines = [f"{target} on W={world_size}: "
                 + ("TIMED OUT after %.0f s; " % timeout_s if timed_out else "")
                 + f"exit code {proc.returncode}; failed ranks {failed}"]
        for r in range(world_size):
            o = outcomes.get(r)
            lines.append(f"--- rank {r}: " + ("no outcome written" if o is None else
                                              ("ok" if o["ok"] else o["traceback"])))
        lines.append("--- mpiexec output (tail):\n" + output[-4000:])
        raise AssertionError("\n".join(lines))
    return [outcomes[r].get("result") for r in range(world_size)]
