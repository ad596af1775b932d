"""GEMM benchmark: cuflux.gemm (each Hopper configuration, and the portable core) against
cupy.matmul (cuBLAS) in the same run, bf16 in / bf16 out, both B layouts.

Inputs are random (never zeros) and rotate through enough (A, B) sets that one pass is more
than three times the L2, so neither side is timed out of cache. Times are CUDA-event medians.
Only rank 0 measures (ranks sharing a GPU would time each other); the others wait.
"""
from __future__ import annotations

import math
import os

from cuflux.bench.common import print_table, time_ms, write_results

# The bar shapes (M, N, K); 4096x6144x12288 and 4096x12288x6144 are Flux's AG and RS
# GEMMs at W = 8.
BAR_SHAPES = [(8192, 8192, 8192), (4096, 8192, 3584), (16384, 8192, 1024), (4096, 6144, 12288),
              (4096, 12288, 6144)]
EXTRA_SHAPES = [(4096, 4096, 4096), (2048, 2048, 2048), (8, 4096, 4096), (777, 1536, 2048)]


def _inputs(M, N, K, layout, l2_bytes, dtype):
    import cupy

    per_set = 2 * (M * K + K * N)
    sets = max(2, math.ceil(3 * l2_bytes / per_set))
    rs = cupy.random.RandomState(1234)
    out = []
    for _ in range(sets):
        a = rs.standard_normal((M, K), dtype=cupy.float32).astype(dtype)
        shape = (K, N) if layout == "kn" else (N, K)
        b = rs.standard_normal(shape, dtype=cupy.float32).astype(dtype)
        out.append((a, b))
    return out


def _rotating(fn, sets):
    state = {"i": 0}

    def call():
        a, b = sets[state["i"] % len(sets)]
        state["i"] += 1
        fn(a, b)

    return call


def run(world, args) -> None:
    import cupy

    import cuflux.ops.gemm as G
    from cuflux import kernels
    from cuflux.arrays import dtype_info

    me = world.rank
    rows = []
    if me == 0:
        dev = cupy.cuda.Device()
        hopper = kernels.device_arch(dev.id) == "sm_90a"
        l2 = dev.attributes["L2CacheSize"]
        bf16 = dtype_info("bfloat16").storage
        kernels.load("gemm.cu")
        shapes = BAR_SHAPES + ([] if args.quick else EXTRA_SHAPES)
        only = os.environ.get("CUFLUX_GEMM_BENCH_CONFIGS")  # e.g. "128x256s4c1,256x128s4c1"
        configs = [c for c in G.SM90_CONFIGS if not only or c in only.split(",")] if hopper else []
        iters = args.iters
        for (M, N, K) in shapes:
            flop = 2.0 * M * N * K
            for layout in ("kn", "nk"):
                sets = _inputs(M, N, K, layout, l2, bf16)
                c = cupy.empty((M, N), dtype=bf16)

                def cublas(a, b, layout=layout, c=c):
                    cupy.matmul(a, b if layout == "kn" else b.T, out=c)

                base_ms = time_ms(_rotating(cublas, sets), warmup=5, iters=iters)
                per_cfg = {}
                for name in configs:
                    fn = _rotating(lambda a, b, name=name: G.gemm(
                        a, b, out=c, b_layout=layout, impl="sm90", config=name), sets)
                    per_cfg[name] = time_ms(fn, warmup=5, iters=iters)
                sm80_ms = time_ms(_rotating(lambda a, b: G.gemm(
                    a, b, out=c, b_layout=layout, impl="sm80"), sets), warmup=3,
                    iters=max(5, iters // 2))
                best = min(per_cfg, key=per_cfg.get) if per_cfg else None
                ms = per_cfg[best] if best else sm80_ms
                row = {"case": f"{M}x{N}x{K} {layout}", "cuflux_ms": ms,
                       "config": best or "sm80", "baseline": "cupy.matmul (cuBLAS)",
                       "baseline_ms": base_ms, "speedup": base_ms / ms,
                       "tflops": flop / ms / 1e9, "cublas_tflops": flop / base_ms / 1e9,
                       "sm80_ms": sm80_ms, "sm80_ratio": base_ms / sm80_ms,
                       "configs_ms": per_cfg}
                for name, t in per_cfg.items():
                    row[name] = base_ms / t
                rows.append(row)
                del sets, c
                cupy.get_default_memory_pool().free_all_blocks()
        if hopper and not args.quick:  # the L2-grouped tile order against plain row-major
            M, N, K = 8192, 8192, 8192
            sets = _inputs(M, N, K, "nk", l2, bf16)
            c = cupy.empty((M, N), dtype=bf16)
            for gm in (1, 4, 8, 16, 32):
                ms = time_ms(_rotating(lambda a, b, gm=gm: G.gemm(
                    a, b, out=c, b_layout="nk", impl="sm90", config=G.SM90_DEFAULT,
                    group_m=gm), sets), warmup=5, iters=iters)
                rows.append({"case": f"{M}x{N}x{K} nk group_m={gm}", "cuflux_ms": ms,
                             "config": G.SM90_DEFAULT, "baseline": "none", "baseline_ms": None,
                             "speedup": None, "tflops": 2.0 * M * N * K / ms / 1e9})
        if hopper and not args.quick:  # 2-CTA clusters: is the persistent grid too large?
            M, N, K = 8192, 8192, 8192
            sets = _inputs(M, N, K, "nk", l2, bf16)
            c = cupy.empty((M, N), dtype=bf16)
            cfg = G.SM90_CONFIGS["128x256s4c2"]
            dt = dtype_info("bfloat16")
            for cap in (132, 128, 120, 112, 96, 66):
                ms = time_ms(_rotating(lambda a, b, cap=cap: G._launch_sm90(
                    cfg, a, b, None, c, dt, dt, M, N, K, "nk", cupy.cuda.get_current_stream(),
                    grid_cap=cap), sets), warmup=5, iters=iters)
                rows.append({"case": f"{M}x{N}x{K} nk {cfg.name} grid<={cap}", "cuflux_ms": ms,
                             "config": cfg.name, "baseline": "none", "baseline_ms": None,
                             "speedup": None, "tflops": 2.0 * M * N * K / ms / 1e9})
    world.barrier()
    if me == 0:
        print("resident CTAs assumed for 2-CTA clusters (cuOccupancyMaxActiveClusters x 2):",
              sorted(set(v * 2 for v in G._CLUSTERS.values())))
        cols = ["case", "config", "cuflux_ms", "baseline_ms", "speedup", "tflops",
                "cublas_tflops", "sm80_ratio"] + list(G.SM90_CONFIGS)
        print("cuflux.gemm vs cupy.matmul (cuBLAS), bf16 -> bf16; speedup = cuBLAS ms / cuflux "
              "ms (best Hopper config); per-config columns: the same ratio per configuration")
        print_table(rows, cols)
        path = write_results("gemm", world.size, rows, outdir=args.outdir,
                             extra={"cluster2_resident_ctas": sorted(set(
                                 v * 2 for v in G._CLUSTERS.values()))})
        print("wrote", path)
