"""Probe: GPU memory cuflux.gemm's cuBLAS route keeps for a caller that keeps many streams alive
and calls on each in turn (40 streams x 3 rounds, 128 x 8192 x 8192 fp16, impl="cublas"), with
the cuBLAS workspaces bounded (gemm_core.WORKSPACES_KEPT, the default 8) and, for comparison,
as they were before (one 32 MiB workspace per stream for the process: the bound set past reach).
Each result is compared with cupy.matmul.
  PYTHONPATH=. python scripts/probe_workspaces.py [KEPT]
"""
import sys
import time


def main(kept: int) -> None:
    import cupy as cp
    import numpy as np

    import cuflux
    from cuflux import gemm_core

    gemm_core.WORKSPACES_KEPT = kept
    pool = cp.get_default_memory_pool()
    M = 128
    a = cp.random.standard_normal((M, 8192), dtype=cp.float32).astype(cp.float16)
    w = cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.float16)
    out = cp.empty((M, 8192), cp.float16)
    ref = cp.matmul(a, w.T).astype(cp.float32)
    cuflux.gemm(a, w, b_layout="nk", out=out, impl="cublas")
    cp.cuda.Device().synchronize()
    base, t0 = pool.used_bytes(), time.perf_counter()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(40)]  # alive together
    worst = 0.0
    for _ in range(3):
        for s in streams:
            out.fill(np.nan)
            cuflux.gemm(a, w, b_layout="nk", out=out, impl="cublas", stream=s)
            s.synchronize()
            worst = max(worst, float(cp.abs(out.astype(cp.float32) - ref).max()))
    print(f"WORKSPACES_KEPT={kept}: 40 live streams x 3 rounds: pool used "
          f"+{(pool.used_bytes() - base) / 2**20:.0f} MiB, workspaces kept "
          f"{len(gemm_core._cublas().spaces.arrays)}, max |out - cupy.matmul| {worst}, "
          f"{time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
