"""Entry point of the ranks under tests/mpi.py.

One-shot: `python -m tests.rank_main <module:function> <json kwargs> <outdir>` calls
function(world, **kwargs) once and writes the outcome (ok, result or traceback) to
outdir/rank<r>.json.

Pool: `python -m tests.rank_main --pool` keeps the W ranks (their CUDA contexts and loaded
modules) alive across tests: rank 0 reads one JSON command per line from stdin, every rank runs
it with a fresh World, writes its outcome, and after a barrier rank 0 prints the done line. A
rank whose case fails exits at once without MPI_Finalize, which ends the whole pool (a failed
rank must not leave its peers hanging); tests/mpi.py then starts a new one.
"""
import importlib
import json
import os
import sys
import time
import traceback

DONE = "CUFLUX-POOL-DONE"


def run_case(target: str, kwargs: dict) -> dict:
    try:
        import cuflux

        module, func = target.split(":")
        fn = getattr(importlib.import_module(module), func)
        world = cuflux.init()
        return {"ok": True, "result": fn(world, **kwargs)}
    except BaseException:
        return {"ok": False, "traceback": traceback.format_exc()}


def write_outcome(outdir: str, rank: int, outcome: dict) -> None:
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    sys.stdout.flush()
    if not outcome["ok"]:
        os._exit(1)  # no MPI_Finalize: a failed rank must not hang waiting for the others


def idle_bcast(comm, obj):
    """bcast from rank 0 that sleeps while idle: a blocking MPI bcast spins a core per rank,
    and idle pools of several sizes wait side by side."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)
    return comm.bcast(obj, root=0)


def pool() -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    while True:
        line = sys.stdin.readline() if rank == 0 else None
        cmd = idle_bcast(comm, json.loads(line) if line and line.strip() else None)
        if cmd is None:
            return 0
        # The parent's CUFLUX_* settings at the time of the test (monkeypatched ones too).
        for k in [k for k in os.environ if k.startswith("CUFLUX_")]:
            del os.environ[k]
        os.environ.update(cmd["env"])
        outcome = run_case(cmd["target"], cmd["kwargs"])
        try:
            import cupy

            cupy.cuda.Device().synchronize()
            cupy.get_default_memory_pool().free_all_blocks()
        except Exception:
            pass
        write_outcome(cmd["outdir"], rank, outcome)
        comm.Barrier()
        if rank == 0:
            print(f"{DONE} {cmd['id']}", flush=True)


def main() -> int:
    if sys.argv[1] == "--pool":
        return pool()
    target, kwargs, outdir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    from mpi4py import MPI

    write_outcome(outdir, MPI.COMM_WORLD.Get_rank(), run_case(target, kwargs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
