"""GEMM benchmark: cuflux.gemm (each Hopper configuration, and the portable core) against
cupy.matmul (cuBLAS) in the same run, bf16 in / bf16 out, both B layouts.

Inputs are random (never zeros) and rotate through enough (A, B) sets that one pass is more
than three times the L2, so neither side is timed out of cache. Times are CUDA-event medians.
Only rank 0 measures (ranks sharing a GPU would time each other); the others wait, so the
figures are speeds at any W ("speed_measured": true).

Which column is which regime (cuflux.bench.__main__.REGIMES_DOC):
  cuflux_ms, baseline_ms, speedup   GPU-queued: interleaved rounds of calls queued back to
                                    back, GPU time per call (CUDA events, median)
  user_loop_ms, baseline_user_loop_ms, user_loop_speedup   back-to-back calls from Python,
                                    nothing held, wall time per call
  host_us, baseline_host_us         host time per call alone
  graph_ms, baseline_graph_ms, graph_speedup   one CUDA graph of N calls replayed
The configuration rows (BAR_SHAPES, EXTRA_SHAPES) time the best Hopper configuration forced
(impl="sm90", config=...; "sm80" elsewhere). The "auto" rows time cuflux.gemm as users call it
(impl="auto", which may route to cuBLAS; `plan` = cuflux.ops.gemm.plan(M, N, K, ...)) against
cupy.matmul called the same way (a @ b for "kn", a @ b.T for "nk"): issue 14's decode shapes
(DECODE_M x DECODE_NK, both layouts) and its table shapes (TABLE_SHAPES), where the bar is
user_loop_speedup >= 0.95 (`meets_bar`).
"""
from __future__ import annotations

import math

from cuflux import knobs
from cuflux.bench.__main__ import (REGIME_COLS, add_note, add_speedups, bench_extra,
                                   measure_regimes, no_baseline_regimes, on_stream,
                                   print_bench_table, regime_calls, speed_header)
from cuflux.bench.common import (print_table, ranks_share_gpu, time_interleaved, time_ms,
                                 write_results)

# The bar shapes (M, N, K); 4096x6144x12288 and 4096x12288x6144 are Flux's AG and RS
# GEMMs at W = 8.
BAR_SHAPES = [(8192, 8192, 8192), (4096, 8192, 3584), (16384, 8192, 1024), (4096, 6144, 12288),
              (4096, 12288, 6144)]
# L2 group heights of the tile order tried on the two best configurations of each case
# (8 is the default; 1 is row-major).
GROUP_M_SWEEP = (1, 2, 4, 8, 16)
EXTRA_SHAPES = [(4096, 4096, 4096), (2048, 2048, 2048), (8, 4096, 4096), (777, 1536, 2048)]
# Issue 14: decode shapes, M x (N, K), both layouts, cuflux.gemm(impl="auto") vs cupy.matmul.
DECODE_M = (1, 16, 128, 512, 2048)
DECODE_NK = ((8192, 8192), (28672, 8192), (8192, 28672))
QUICK_DECODE_M = (1, 128, 2048)  # --quick: these M on the first (N, K)
# Issue 14's table: (M, N, K, layouts); the bar is the user-loop ratio >= USER_LOOP_BAR.
TABLE_SHAPES = [(128, 8192, 8192, ("nk",)), (512, 8192, 8192, ("nk", "kn")),
                (2048, 8192, 8192, ("nk", "kn")), (4096, 8192, 3584, ("nk", "kn")),
                (16384, 8192, 1024, ("nk", "kn")), (4096, 12288, 6144, ("nk", "kn"))]
USER_LOOP_BAR = 0.95


def auto_cases(quick: bool) -> list[dict]:
    """The "auto" rows: {"M", "N", "K", "layout", "decode", "table"} once per (M, N, K, layout),
    decode shapes first, then the table shapes not already among them. --quick: M in
    QUICK_DECODE_M on the first (N, K), both layouts, and the table shapes in "nk" only."""
    out: dict[tuple, dict] = {}
    nks = DECODE_NK[:1] if quick else DECODE_NK
    for N, K in nks:
        for M in (QUICK_DECODE_M if quick else DECODE_M):
            for layout in ("kn", "nk"):
                out[(M, N, K, layout)] = {"M": M, "N": N, "K": K, "layout": layout,
                                          "decode": True, "table": False}
    for M, N, K, layouts in TABLE_SHAPES:
        for layout in (layouts[:1] if quick else layouts):
            case = out.setdefault((M, N, K, layout), {"M": M, "N": N, "K": K, "layout": layout,
                                                      "decode": False, "table": False})
            case["table"] = True
    return list(out.values())


def bench_configs(known, environ=None) -> list[str]:
    """The Hopper configurations to time, in the order of `known`: those named in
    CUFLUX_GEMM_BENCH_CONFIGS (cuflux.knobs), else every one. An unknown name raises."""
    only = knobs.gemm_bench_configs(environ)
    if only is None:
        return list(known)
    unknown = [n for n in only if n not in known]
    if unknown:
        raise ValueError(f"{knobs.GEMM_BENCH_CONFIGS.name}: unknown GEMM configuration "
                         f"{', '.join(unknown)}; known: {', '.join(known)}")
    return [c for c in known if c in only]


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


def _auto_row(G, case, l2, bf16, iters, quick, stream) -> dict:
    """One "auto" row: cuflux.gemm(impl="auto") vs cupy.matmul, GPU-queued and the three user
    regimes of each."""
    import cupy

    M, N, K, layout = case["M"], case["N"], case["K"], case["layout"]
    sets = _inputs(M, N, K, layout, l2, bf16)
    c = cupy.empty((M, N), dtype=bf16)

    def cublas(a, b):
        cupy.matmul(a, b if layout == "kn" else b.T, out=c)

    def ours(a, b):
        G.gemm(a, b, out=c, b_layout=layout)

    fns = {"cublas": _rotating(cublas, sets), "auto": _rotating(ours, sets)}
    # warm-up first: the tuner measures a new shape class on its first call, outside capture
    t = time_interleaved(fns, rounds=4, iters=max(2, iters // 4), warmup=3)
    ms, base_ms = t["auto"], t["cublas"]
    flop = 2.0 * M * N * K
    row = {"case": f"{M}x{N}x{K} {layout} auto", "plan": G.plan(M, N, K, "bfloat16", layout),
           "config": "auto", "cuflux_ms": ms, "baseline": "cupy.matmul (cuBLAS)",
           "baseline_ms": base_ms, "speedup": base_ms / ms, "tflops": flop / ms / 1e9,
           "cublas_tflops": flop / base_ms / 1e9, "decode_shape": case["decode"],
           "table_shape": case["table"]}
    notes = []
    calls = regime_calls(max(ms, base_ms), quick)
    row.update(measure_regimes([("", on_stream(fns["auto"], stream), "cuflux.gemm"),
                                ("baseline_", on_stream(fns["cublas"], stream), "cupy.matmul")],
                               stream, calls=calls, notes=notes))
    add_speedups(row)
    row["meets_bar"] = (row["user_loop_speedup"] is not None
                        and row["user_loop_speedup"] >= USER_LOOP_BAR)
    return add_note(row, *notes)


def run(world, args):
    import cupy

    import cuflux.ops.gemm as G
    from cuflux import gemm_core, kernels
    from cuflux.arrays import dtype_info

    wanted = bench_configs(G.SM90_CONFIGS)  # every rank: a bad name fails them all at once
    me = world.rank
    shared_gpu = ranks_share_gpu(world)  # collective: every rank calls it
    rows, auto_rows = [], []
    if me == 0:
        rstream = cupy.cuda.Stream(non_blocking=True)  # regimes: a capturable stream
        dev = cupy.cuda.Device()
        hopper = kernels.device_arch(dev.id) == "sm_90a"
        l2 = dev.attributes["L2CacheSize"]
        bf16 = dtype_info("bfloat16").storage
        kernels.load("gemm.cu")
        shapes = BAR_SHAPES + ([] if args.quick else EXTRA_SHAPES)
        configs = wanted if hopper else []
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
                notes = []
                calls = regime_calls(max(ms, base_ms), args.quick)
                ours = _rotating(lambda a, b: G.gemm(a, b, out=c, b_layout=layout,
                                                     impl="sm90" if best else "sm80",
                                                     config=best), sets)
                row.update(measure_regimes(
                    [("", on_stream(ours, rstream), f"cuflux.gemm {best or 'sm80'}"),
                     ("baseline_", on_stream(_rotating(cublas, sets), rstream), "cupy.matmul")],
                    rstream, calls=calls, notes=notes))
                add_note(add_speedups(row), *notes)
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
                ms = time_ms(_rotating(lambda a, b, cap=cap: gemm_core.launch_sm90(
                    cfg, a, b, None, c, dt, dt, M, N, K, "nk", cupy.cuda.get_current_stream(),
                    grid_cap=cap), sets), warmup=5, iters=iters)
                row = {"case": f"{M}x{N}x{K} nk {cfg.name} grid<={cap}", "cuflux_ms": ms,
                       "config": cfg.name, "baseline": "none", "baseline_ms": None,
                       "speedup": None, "tflops": 2.0 * M * N * K / ms / 1e9}
                notes = []
                row.update(measure_regimes(on_stream(_rotating(
                    lambda a, b, cap=cap: gemm_core.launch_sm90(
                        cfg, a, b, None, c, dt, dt, M, N, K, "nk",
                        cupy.cuda.get_current_stream(), grid_cap=cap), sets), rstream),
                    rstream, calls=regime_calls(ms, args.quick), notes=notes,
                    what="sm90 grid cap"))
                rows.append(add_note(add_speedups(no_baseline_regimes(
                    row, "grid-cap sweep: no baseline")), *notes))
        for case in auto_cases(args.quick):
            auto_rows.append(_auto_row(G, case, l2, bf16, iters, args.quick, rstream))
            cupy.get_default_memory_pool().free_all_blocks()  # the case's inputs are gone
    world.barrier()
    if me != 0:
        return None
    print(speed_header("gemm", world.size, shared_gpu, one_rank_times=True))
    print("resident CTAs assumed for 2-CTA clusters (cuOccupancyMaxActiveClusters x 2):",
          gemm_core.cluster_resident_ctas(2))
    cols = ["case", "config", "cuflux_ms", "baseline_ms", "speedup", "tflops",
            "cublas_tflops", "block_speedup", "block_cublas_tflops", "gapped_speedup",
            "gapped_cublas_tflops",
            "sm80_ratio", "best_group_m", "best_group_m_ratio"] + list(G.SM90_CONFIGS)
    print("cuflux.gemm vs cupy.matmul (cuBLAS), bf16 -> bf16; speedup = cuBLAS ms / cuflux "
          "ms (best Hopper config); per-config columns: the same ratio per configuration")
    print_table(rows, cols)
    print("\nthe same rows in the user regimes (back-to-back Python loop, host time, CUDA graph):")
    print_bench_table(rows, ["case", "config"] + REGIME_COLS, REGIME_COLS, True)
    print(f"\ncuflux.gemm(impl='auto') vs cupy.matmul called the same way; bar: "
          f"user_loop_speedup >= {USER_LOOP_BAR} on the table shapes")
    print_bench_table(auto_rows, ["case", "plan", "cuflux_ms", "baseline_ms", "speedup"]
                      + REGIME_COLS + ["meets_bar"], REGIME_COLS, True)
    bar_rows = [r for r in auto_rows if r["table_shape"]]
    missed = [r["case"] for r in bar_rows if not r["meets_bar"]]
    print(f"table-shape bar (user loop >= {USER_LOOP_BAR}x cupy.matmul): "
          f"{len(bar_rows) - len(missed)}/{len(bar_rows)} met"
          + (f"; missed: {', '.join(missed)}" if missed else ""))
    path = write_results("gemm", world.size, rows + auto_rows, outdir=args.outdir,
                         extra=bench_extra(args, True, ranks_share_gpu=shared_gpu,
                                           user_loop_bar=USER_LOOP_BAR,
                                           cluster2_resident_ctas=(
                                               gemm_core.cluster_resident_ctas(2))))
    print("wrote", path)
    return path
