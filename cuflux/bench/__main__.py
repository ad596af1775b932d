"""python -m cuflux.bench <op> [--quick] [--iters N] [--outdir DIR]   (under mpiexec -n W)."""
from __future__ import annotations

import argparse
import importlib
import sys

OPS = {"allgather": "cuflux.bench.allgather", "allreduce": "cuflux.bench.allreduce",
       "all2all": "cuflux.bench.all2all", "gemm": "cuflux.bench.gemm",
       "ag_gemm": "cuflux.bench.ag_gemm", "gemm_rs": "cuflux.bench.gemm_rs"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cuflux.bench")
    p.add_argument("op", choices=sorted(OPS) + ["all"])
    p.add_argument("--quick", action="store_true", help="fewer cases")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--outdir", default=None, help="where the JSON goes (scripts/results/)")
    args = p.parse_args(argv)
    import cuflux

    if cuflux.device_count() == 0:
        print("cuflux.bench: no CUDA device on this machine; nothing to measure.")
        return 0
    world = cuflux.init()
    for op in (sorted(OPS) if args.op == "all" else [args.op]):
        importlib.import_module(OPS[op]).run(world, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
