"""Entry point of the ranks under tests/mpi.py.

One-shot: `python -m tests.rank_main <module:function> <json kwargs> <outdir>` calls
function(world, **kwargs) once and writes the outcome (ok, result or traceback) to
outdir/rank<r>.json.

Pool: `python -m tests.rank_main --pool DIR` keeps the W ranks (their CUDA contexts and loaded
modules) alive across tests: rank 0 waits for DIR/cmd<n>.json (n = 0, 1, ...; files, not stdin,
which MPICH's launcher does not always pass on), every rank runs it with a fresh World, writes
its outcome, and after a collective rank 0 prints the done line. A
rank whose case fails exits at once without MPI_Finalize, which ends the whole pool (a failed
rank must not leave its peers hanging); tests/mpi.py then starts a new one.
"""
import importlib
import itertools
import json
import os
import sys
import time
import traceback

DONE = "CUFLUX-POOL-DONE"


def run_case(target: str, kwargs: dict) -> dict:
    """The outcome of one test body on this rank; "device": the rank's GPU (None: no World)."""
    device = None
    try:
        import cuflux

        module, func = target.split(":")
        fn = getattr(importlib.import_module(module), func)
        world = cuflux.init()
        device = world.device
        with world.device_context():  # the World never moves the current device itself
            return {"ok": True, "result": fn(world, **kwargs), "device": device}
    except BaseException:
        return {"ok": False, "traceback": traceback.format_exc(), "device": device}


def write_outcome(outdir: str, rank: int, outcome: dict) -> None:
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    sys.stdout.flush()
    if not outcome["ok"]:
        os._exit(1)  # no MPI_Finalize: a failed rank must not hang waiting for the others


def next_command(folder: str, n: int) -> dict:
    """Rank 0: wait (sleeping) for command n, which the parent writes and renames into place."""
    path = os.path.join(folder, f"cmd{n}.json")
    while not os.path.exists(path):
        time.sleep(0.002)
    with open(path) as f:
        return json.load(f)


def idle_bcast(comm, obj_fn):
    """bcast from rank 0 that sleeps while idle (a blocking MPI bcast spins a core per rank)."""
    obj = obj_fn() if comm.Get_rank() == 0 else None
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)
    return comm.bcast(obj, root=0)


def pool(folder: str) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    for n in itertools.count():
        cmd = idle_bcast(comm, lambda: next_command(folder, n))
        if cmd.get("quit"):
            return 0
        # The parent's CUFLUX_* settings at the time of the test (monkeypatched ones too).
        for k in [k for k in os.environ if k.startswith("CUFLUX_")]:
            del os.environ[k]
        os.environ.update(cmd["env"])
        outcome = run_case(cmd["target"], cmd["kwargs"])
        free = 1.0
        try:
            import cupy

            # on the rank's own GPU (the test ran there; the current device outside its World
            # is GPU 0 for every rank): its work done, its cached blocks freed, its memory read
            dev = outcome.get("device")
            with cupy.cuda.Device(0 if dev is None else dev):
                cupy.cuda.Device().synchronize()
                cupy.get_default_memory_pool().free_all_blocks()
                cupy.get_default_pinned_memory_pool().free_all_blocks()
                free_b, total_b = cupy.cuda.runtime.memGetInfo()
            free = free_b / total_b
        except Exception:
            pass
        write_outcome(cmd["outdir"], rank, outcome)
        free = comm.allreduce(free, op=MPI.MIN)
        if rank == 0:
            # The parent ends the pool when the device runs low (ranks sharing one GPU).
            print(f"{DONE} {cmd['id']} {free:.3f}", flush=True)


def main() -> int:
    if sys.argv[1] == "--pool":
        return pool(sys.argv[2])
    target, kwargs, outdir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    from mpi4py import MPI

    write_outcome(outdir, MPI.COMM_WORLD.Get_rank(), run_case(target, kwargs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
