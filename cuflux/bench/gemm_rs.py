"""GEMM + ReduceScatter benchmark: the fused op against the GEMM alone and the unfused baselines,
bf16 in and out, rows of a per rank [M, K / W] (a row-parallel layer), b as a Linear weight
[n, K / W] ("nk"; the full run adds "kn").

Per case (times in ms, CUDA events, median; with W > 1 the slowest rank's):
  cuflux_ms        the fused op, reduce="deterministic" (the default)
  atomic_ms        the fused op, reduce="atomic" (absent over PCIe)
  chunked_ms       W > 1: the op built route="chunked" (cuBLAS in owner chunks, peer chunks
                   moved by copy engines while the next computes); chunked_to_cublas =
                   chunked_ms / cublas_ms (issue 15's bar: <= 1.03), chunked_speedup_nccl =
                   nccl_ms / chunked_ms; chunked_fold: whether it folds the sum into its own
                   GEMMs (W = 2, small k: gemm_rs.fold_route); at W = 2 chunked_other_ms (and
                   _to_cublas, _fold): the same route with the other choice (fold=not
                   chunked_fold), so that one run measures both sides of the threshold
  gemm_ms          the GEMM alone on the same core and tile configuration ([M, n] written
                   locally): exposed_comm_ms = cuflux_ms - gemm_ms, ratio_to_gemm =
                   cuflux_ms / gemm_ms; at W = 1, where the op itself runs the plain GEMM,
                   ratio_to_gemm = fused_kernel_ms / gemm_ms (the bar: <= 1.02)
  baseline_ms      cuBLAS (cupy.matmul) then the project's comm-only reduce-scatter
                   (GemmReduceScatter.reduce_scatter, same buffers and order), one after the
                   other; speedup = baseline_ms / cuflux_ms
  cublas_ms, rs_ms the two halves of the baseline alone
  nccl_ms          cuBLAS then NCCL reduce-scatter (every rank on its own GPU, W = 1 included)
  ideal_ms         distinct GPUs only: max(cublas_ms, comm_ms), comm_ms = the W - 1 partials a
                   rank sends (M / W x n bf16 each) at the measured peer copy rate (peer_gbps,
                   common.sends_ms): the op if every byte were hidden behind cuBLAS;
                   fused_to_ideal = cuflux_ms / ideal_ms, chunked_to_ideal = chunked_ms /
                   ideal_ms (comm_ms, peer_gbps in the JSON)
  fused_kernel_ms  W = 1: the fused kernel itself (an op built with w1="fused"; the default
                   w1="gemm" runs the plain GEMM there), i.e. what the RS epilogue costs
                   without any peer
The JSON's knobs record the op's w1 and route per timed column (knobs.op_args).
Shapes: Flux's 4096 x 12288 x 49152 (K split over the ranks), Llama-70B row-parallel layers
(8192 x 8192 x 8192 and 8192 x 8192 x 28672), and n <= 4096 cases. Inputs rotate through sets
larger than three times the L2. With ranks sharing one GPU, times measure time-slicing, not
links (the table says so). Every time is a median over interleaved rounds
(common.time_interleaved), so clock drift does not read as a difference between two timings.

Regimes (cuflux.bench.__main__.REGIMES_DOC): every *_ms above is GPU-queued (interleaved rounds
of calls queued back to back, GPU time per call). Beside them, for the fused op and for the
baseline (cuBLAS + cuflux reduce_scatter; NCCL's, prefix nccl_, on distinct GPUs):
  user_loop_ms / baseline_user_loop_ms   back-to-back calls from Python, nothing held, wall
                                         time per call; user_loop_speedup = baseline / cuflux
  host_us / baseline_host_us             host time per call alone
  graph_ms / baseline_graph_ms           a graph of N calls replayed; graph_speedup
With ranks sharing one GPU the ops run for correctness only ("speed_measured": false) and the
table prints the times under "time-slicing, not speed".
"""
from __future__ import annotations

import math

from cuflux import knobs
from cuflux.bench.__main__ import (REGIME_COLS, add_note, add_speedups, bench_extra,
                                   measure_regimes, print_bench_table, regime_calls,
                                   speed_header, speed_measured)
from cuflux.bench.common import (nccl_comm, peer_copy_gbps, ranks_share_gpu, sends_ms,
                                 time_interleaved, write_results)

L2_BYTES = 60 << 20
SHAPES = [  # (name, M, n, K over all ranks)
    ("flux-rs", 4096, 12288, 49152),
    ("llama70b-attn-out", 8192, 8192, 8192),
    ("llama70b-mlp-down", 8192, 8192, 28672),
    ("n4096", 8192, 4096, 14336),
    ("n2048", 4096, 2048, 8192),
]
QUICK = ("flux-rs", "llama70b-mlp-down", "n4096")
BAR = 1.02


def cases(world_size: int, quick: bool) -> list[tuple[str, int, int, int]]:
    """(name, M, n, K) per shape for W ranks: M rounded down to a multiple of W (the op needs
    it), K to a multiple of 8 W (each rank's k = K / W moves in 16-byte rows)."""
    W = world_size
    return [(name, M // W * W, n, K // (8 * W) * 8 * W) for name, M, n, K in SHAPES
            if not quick or name in QUICK]


def op_args(world_size: int, rows) -> dict:
    """The op's constructor knobs per timed column (the JSON's knobs.op_args): w1, what
    GemmReduceScatter runs at W = 1 (ignored at W > 1), and route (every shape here has
    M >= UNFUSED_BELOW_M: "auto" runs the fused kernel). The chunked columns' fold differs by
    row: chunked_fold and chunked_other_fold say it."""
    args = {"cuflux_ms": {"w1": "gemm", "route": "auto"}}
    if any("chunked_ms" in r for r in rows):
        args["chunked_ms"] = {"route": "chunked"}
    if any("chunked_other_ms" in r for r in rows):  # its fold: each row's chunked_other_fold
        args["chunked_other_ms"] = {"route": "chunked"}
    if world_size == 1 and any("fused_kernel_ms" in r for r in rows):
        args["fused_kernel_ms"] = {"w1": "fused"}
    return args


def _case(world, name, M, n, K, layout, nccl, iters, stream, configs, quick=False,
          measured=True, link_gbps=None, both_folds=False):
    import cupy

    import cuflux.ops.gemm as G
    from cuflux.arrays import dtype_info
    from cuflux.ops.gemm_rs import GemmReduceScatter

    W, me = world.size, world.rank
    k = K // W
    bf16 = dtype_info("bfloat16").storage
    per_set = 2 * (M * k + k * n)
    count = max(2, math.ceil(3 * L2_BYTES / per_set))
    rs = cupy.random.RandomState(1234 + me)
    sets = [(rs.standard_normal((M, k), dtype=cupy.float32).astype(bf16),
             rs.standard_normal((k, n) if layout == "kn" else (n, k),
                                dtype=cupy.float32).astype(bf16)) for _ in range(count)]
    c_full = cupy.empty((M, n), dtype=bf16)
    out = cupy.empty((M // W, n), dtype=bf16)
    pcie = any(link.link == "pcie" for link in world.topology.links)
    modes = ["deterministic"] + ([] if any(world.allgather(pcie)) else ["atomic"])
    ops = {mode: GemmReduceScatter(world, M, n, k, "bfloat16", b_layout=layout, reduce=mode)
           for mode in modes}
    det = ops["deterministic"]
    others = [c for c in configs if c != det.config] if det.impl == "sm90" else []
    extra = {c: GemmReduceScatter(world, M, n, k, "bfloat16", b_layout=layout, config=c)
             for c in others}
    # W = 1: the same op run through the fused kernel instead of the plain GEMM
    fused = (GemmReduceScatter(world, M, n, k, "bfloat16", b_layout=layout, w1="fused")
             if W == 1 and det.impl == "sm90" else None)
    if W > 1:
        extra["chunked"] = GemmReduceScatter(world, M, n, k, "bfloat16", b_layout=layout,
                                             route="chunked")
        # both sides of fold_route's threshold, measured (both_folds: run decided it together)
        if both_folds:
            extra["chunked_other"] = GemmReduceScatter(
                world, M, n, k, "bfloat16", b_layout=layout, route="chunked",
                fold=not extra["chunked"].fold)
    state = {"i": 0}

    def pick():
        state["i"] += 1
        return sets[state["i"] % count]

    def matmul(a, b):
        cupy.matmul(a, b if layout == "kn" else b.T, out=c_full)

    def unfused():
        matmul(*pick())
        det.reduce_scatter(c_full, out=out, stream=stream)

    timed = {
        "cuflux_ms": lambda: det(*pick(), out=out, stream=stream),
        # the same core and tile as the fused kernel (at W = 1 the op itself runs the plain
        # GEMM with the tuner's / heuristic's choice: that is cuflux_ms there)
        "gemm_ms": lambda: G.gemm(*pick(), out=c_full, b_layout=layout, impl=det.impl,
                                  stream=stream,
                                  config=det.config if det.impl == "sm90" else None),
        "baseline_ms": unfused,
        "cublas_ms": lambda: matmul(*pick()),
        "rs_ms": lambda: det.reduce_scatter(c_full, out=out, stream=stream),
    }
    if "atomic" in ops:
        timed["atomic_ms"] = lambda: ops["atomic"](*pick(), out=out, stream=stream)
    for c, op in extra.items():
        timed[f"{c}_ms" if c.startswith("chunked") else f"cuflux_{c}_ms"] = \
            lambda op=op: op(*pick(), out=out, stream=stream)
    if nccl is not None:
        lib, comm = nccl

        def with_nccl():
            matmul(*pick())
            comm.reduceScatter(c_full.data.ptr, out.data.ptr, (M // W) * n, lib.NCCL_BFLOAT16,
                               lib.NCCL_SUM, stream.ptr)
        timed["nccl_ms"] = with_nccl
    if fused is not None:
        timed["fused_kernel_ms"] = lambda: fused(*pick(), out=out, stream=stream)
    row = {"case": f"{name} {M}x{n}x{K} (k={k}/rank) {layout}",
           "baseline": "cuBLAS + cuflux reduce_scatter (deterministic)",
           "config": det.config if det.impl == "sm90" else "sm80"}
    if "chunked" in extra:
        row["chunked_fold"] = extra["chunked"].fold
    if "chunked_other" in extra:
        row["chunked_other_fold"] = extra["chunked_other"].fold
    def raise_pending():
        for op in list(ops.values()) + list(extra.values()):
            op.synchronize(stream)

    try:
        # W = 1: no barrier, no host wait between blocks (gapless interleaving), and as many
        # rounds as it takes every fn to hold every position in the rotation twice (the bar's
        # 2 % is near the drift between positions)
        rounds = 5 if W > 1 else 2 * len(timed)
        per_key = time_interleaved(timed, rounds=rounds,
                                   iters=max(2, iters // 5) if W > 1 else max(5, 5 * iters // rounds),
                                   warmup=3, stream=stream,
                                   before=world.barrier if W > 1 else None,
                                   after=raise_pending if W > 1 else None)
        raise_pending()
        for key in timed:
            row[key] = max(world.allgather(per_key[key]))
        notes = []
        calls = regime_calls(max(row["cuflux_ms"], row["baseline_ms"]), quick, measured)
        row.update(measure_regimes(
            [(prefix, timed.get(key), what) for prefix, key, what in (
                ("", "cuflux_ms", "GemmReduceScatter"),
                ("baseline_", "baseline_ms", "cuBLAS + reduce_scatter"),
                ("chunked_", "chunked_ms", "GemmReduceScatter route=chunked"),
                ("nccl_", "nccl_ms", "cuBLAS + NCCL reduce-scatter"))],
            stream, calls=calls, world=world, notes=notes, after=raise_pending))
        add_note(row, *notes)
    finally:
        for op in list(ops.values()) + list(extra.values()) + ([fused] if fused else []):
            op.close()
    row["speedup"] = row["baseline_ms"] / row["cuflux_ms"]
    add_speedups(row)
    row["exposed_comm_ms"] = row["cuflux_ms"] - row["gemm_ms"]
    fused = row.get("fused_kernel_ms", row["cuflux_ms"])  # W = 1: judge the fused kernel
    row["ratio_to_gemm"] = fused / row["gemm_ms"]
    row["tflops"] = 2.0 * M * n * k / row["cuflux_ms"] / 1e9
    if "atomic_ms" in row:
        row["atomic_wins"] = row["atomic_ms"] < row["cuflux_ms"]
    if "chunked_other_ms" in row:
        row["chunked_other_to_cublas"] = row["chunked_other_ms"] / row["cublas_ms"]
    if "chunked_ms" in row:
        row["chunked_to_cublas"] = row["chunked_ms"] / row["cublas_ms"]
        if "nccl_ms" in row:
            row["chunked_speedup_nccl"] = row["nccl_ms"] / row["chunked_ms"]
    if link_gbps:
        row["peer_gbps"] = link_gbps
        row["comm_ms"] = sends_ms((M // W) * n * 2, W, link_gbps)
        row["ideal_ms"] = max(row["cublas_ms"], row["comm_ms"])
        row["fused_to_ideal"] = row["cuflux_ms"] / row["ideal_ms"]
        if "chunked_ms" in row:
            row["chunked_to_ideal"] = row["chunked_ms"] / row["ideal_ms"]
    return row


def run(world, args):
    import os

    import cupy

    from cuflux.ops.gemm_rs import SM90_RS_CONFIGS

    # the same fixed configuration on both sides, unless the caller set CUFLUX_GEMM_TUNE
    os.environ.setdefault(knobs.GEMM_TUNE.name, "0")
    W, me = world.size, world.rank
    # Decided together: a rank that alone set up NCCL (or skipped it) would hang the others.
    shared_gpu = ranks_share_gpu(world)
    measured = speed_measured(W, shared_gpu)
    nccl = nccl_comm(world, shared_gpu)
    # route="chunked" with and without the fold (W = 2, the cublasLt route on every rank:
    # decided together, the op is collective)
    both_folds = W == 2 and all(world.allgather(knobs.gemm_cublaslt()))
    link = peer_copy_gbps(world) if W > 1 and not shared_gpu else None
    iters = min(args.iters, 5) if W > 1 and shared_gpu else args.iters
    stream = cupy.cuda.Stream(non_blocking=True)
    shapes = cases(W, args.quick)
    layouts = ["nk"] if args.quick else ["nk", "kn"]
    configs = () if args.quick else SM90_RS_CONFIGS
    rows = []
    with stream:
        for name, M, n, K in shapes:
            for layout in layouts:
                rows.append(_case(world, name, M, n, K, layout, nccl, iters, stream, configs,
                                  quick=args.quick, measured=measured, link_gbps=link,
                                  both_folds=both_folds))
                cupy.get_default_memory_pool().free_all_blocks()  # the case's inputs are gone
    if me != 0:
        return None
    print(speed_header("gemm_rs", W, shared_gpu))
    print(f"GEMM + ReduceScatter, W={W}, bf16, ranks "
          f"{'share one GPU (times measure time-slicing)' if shared_gpu else 'on own GPUs'}")
    cols = ["case", "config", "cuflux_ms", "gemm_ms", "exposed_comm_ms", "ratio_to_gemm",
            "atomic_ms", "baseline_ms", "speedup", "cublas_ms", "rs_ms", "tflops"]
    cols += ["nccl_ms"] if nccl is not None else []
    cols += ["chunked_ms", "chunked_to_cublas", "chunked_fold"] if W > 1 else []
    cols += (["chunked_other_ms", "chunked_other_to_cublas", "chunked_other_fold"]
             if any("chunked_other_ms" in r for r in rows) else [])
    cols += ["chunked_speedup_nccl"] if nccl is not None else []
    cols += ["ideal_ms", "fused_to_ideal", "chunked_to_ideal"] if link is not None else []
    cols += ["fused_kernel_ms"] if W == 1 else []
    cols += [f"cuflux_{c}_ms" for c in configs]
    cols += REGIME_COLS
    cols += ["chunked_user_loop_ms", "chunked_host_us"] if W > 1 else []
    cols += ["nccl_user_loop_ms", "nccl_host_us", "nccl_graph_ms"] if nccl is not None else []
    print_bench_table(rows, cols, set(cols) - {"case", "config", "chunked_fold",
                                               "chunked_other_fold"}, measured)
    if W == 1:
        worst = max(r["ratio_to_gemm"] for r in rows)
        print(f"W = 1 bar (fused kernel <= {BAR} x GEMM-only): worst {worst:.4f} -> "
              + ("met" if worst <= BAR else "missed"))
    extra = bench_extra(args, measured, ranks_share_gpu=shared_gpu, bar=BAR,
                        timing="interleaved rounds", gemm_tune=knobs.gemm_tune())
    extra["knobs"]["op_args"] = op_args(W, rows)
    path = write_results("gemm_rs", W, rows, extra, outdir=args.outdir)
    print("wrote", path)
    return path
