"""Entry point of one rank under tests/mpi.py: call module:function(world, **kwargs)."""
import importlib
import json
import os
import sys
import traceback


def main() -> int:
    target, kwargs, outdir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    outcome = {"ok": False}
    try:
        import cuflux

        module, func = target.split(":")
        fn = getattr(importlib.import_module(module), func)
        world = cuflux.init()
        outcome = {"ok": True, "result": fn(world, **kwargs)}
    except BaseException:
        outcome = {"ok": False, "traceback": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    sys.stdout.flush()
    if not outcome["ok"]:
        # Exit without MPI_Finalize: a failed rank must not hang waiting for the others.
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
