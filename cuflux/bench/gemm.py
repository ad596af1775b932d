"""GEMM benchmark: cuflux.gemm (each Hopper configuration, and the portable core) against
cupy.matmul (cuBLAS) in the same run, bf16 in / bf16 out, both B layouts.

Inputs are random (never zeros) and rotate through enough (A, B) sets that one pass is more
than three times the L2, so neither side is timed out of cache. Times are CUDA-event medians.
Only rank 0 measures (ranks sharing a GPU would time each other); the others wait.
"""
from __future__ import annotations

import math
import os

from cuflux.bench.common import print_table, time_interleaved, time_ms, write_results

# The bar shapes (M, N, K); 4096x6144x12288 and 4096x12288x6144 are Flux's AG and RS
# GEMMs at W = 8.
BAR_SHAPES = [(8192, 8192, 8192), (4096, 8192, 3584), (16384, 8192, 1024), (4096, 6144, 12288),
              (4096, 12288, 6144)]
# L2 group heights of the tile order tried on the two best configurations of each case
# (8 is the default; 1 is row-major).
GROUP_M_SWEEP = (1, 2, 4, 8, 16)
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

                # cuBLAS and every configuration timed in interleaved rounds: clocks and
                # power drift over a run (a GEMM timed in two blocks differed by up to 14 %).
                fns = {"cublas": _rotating(cublas, sets)}
                for name in configs:
                    fns[name] = _rotating(lambda a, b, name=name: G.gemm(
                        a, b, out=c, b_layout=layout, impl="sm90", config=name), sets)
                t = time_interleaved(fns, rounds=5, iters=max(2, iters // 4), warmup=3)
                base_ms = t.pop("cublas")
                per_cfg = dict(t)
                # The tile order's L2 group height, for the two best configurations, against
                # cuBLAS again (interleaved among themselves).
                by_gm = {}
                if per_cfg:
                    top = sorted(per_cfg, key=per_cfg.get)[:2]
                    fns = {"cublas": _rotating(cublas, sets)}
                    for name in top:
                        for gm in GROUP_M_SWEEP:
                            fns[(name, gm)] = _rotating(lambda a, b, name=name, gm=gm: G.gemm(
                                a, b, out=c, b_layout=layout, impl="sm90", config=name,
                                group_m=gm), sets)
                    t = time_interleaved(fns, rounds=5, iters=max(2, iters // 4), warmup=2)
                    gm_base = t.pop("cublas")
                    by_gm = {f"{name}/g{gm}": gm_base / v for (name, gm), v in t.items()}
                sm80_ms = time_ms(_rotating(lambda a, b: G.gemm(
                    a, b, out=c, b_layout=layout, impl="sm80"), sets), warmup=3,
                    iters=max(5, iters // 2))
                best = min(per_cfg, key=per_cfg.get) if per_cfg else None
                ms = per_cfg[best] if best else sm80_ms
                # Cross-check with the earlier method: cuBLAS, then the best configuration,
                # each in one block of back-to-back calls (an earlier device call measured
                # cuBLAS ~15 % faster that way than interleaved; docs/gemm_notes.md, v5).
                block = {}
                if best:
                    # and interleaved with a host wait after each block (the method before)
                    gapped = time_interleaved({"cublas": fns["cublas"], "best": _rotating(
                        lambda a, b: G.gemm(a, b, out=c, b_layout=layout, impl="sm90",
                                            config=best), sets)},
                        rounds=5, iters=max(2, iters // 4), warmup=2, gaps=True)
                    block["cublas"] = time_ms(_rotating(cublas, sets), warmup=5, iters=iters)
                    block["best"] = time_ms(_rotating(lambda a, b: G.gemm(
                        a, b, out=c, b_layout=layout, impl="sm90", config=best), sets),
                        warmup=5, iters=iters)
                row = {"case": f"{M}x{N}x{K} {layout}", "cuflux_ms": ms,
                       "config": best or "sm80", "baseline": "cupy.matmul (cuBLAS)",
                       "baseline_ms": base_ms, "speedup": base_ms / ms,
                       "tflops": flop / ms / 1e9, "cublas_tflops": flop / base_ms / 1e9,
                       "sm80_ms": sm80_ms, "sm80_ratio": base_ms / sm80_ms,
                       "configs_ms": per_cfg, "group_m_ratio": by_gm}
                if block:
                    row["block_speedup"] = block["cublas"] / block["best"]
                    row["block_cublas_tflops"] = flop / block["cublas"] / 1e9
                    row["gapped_speedup"] = gapped["cublas"] / gapped["best"]
                    row["gapped_cublas_tflops"] = flop / gapped["cublas"] / 1e9
                if by_gm:
                    g = max(by_gm, key=by_gm.get)
                    row["best_group_m"], row["best_group_m_ratio"] = g, by_gm[g]
                for name, t in per_cfg.items():
                    row[name] = base_ms / t
                rows.append(row)
                del sets, c
                cupy.get_default_memory_pool().free_all_blocks()
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
                "cublas_tflops", "block_speedup", "block_cublas_tflops", "gapped_speedup",
                "gapped_cublas_tflops",
                "sm80_ratio", "best_group_m", "best_group_m_ratio"] + list(G.SM90_CONFIGS)
        print("cuflux.gemm vs cupy.matmul (cuBLAS), bf16 -> bf16; speedup = cuBLAS ms / cuflux "
              "ms (best Hopper config); per-config columns: the same ratio per configuration")
        print_table(rows, cols)
        path = write_results("gemm", world.size, rows, outdir=args.outdir,
                             extra={"cluster2_resident_ctas": sorted(set(
                                 v * 2 for v in G._CLUSTERS.values()))})
        print("wrote", path)
