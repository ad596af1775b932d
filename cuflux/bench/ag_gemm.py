"""AllGather + GEMM benchmark: `mpirun -np W python -m cuflux.bench ag_gemm [--quick]`.

Per shape and mode, on every rank at once (the slowest rank's median is reported):
  fused         AllGatherGemm(a_shard, b)                     (cuflux_ms)
  gemm_only     cuflux.gemm on the gathered A, same core and configuration as the fused kernel
                (exposed_comm_ms = fused - gemm_only; the W = 1 bar: fused <= 1.02 x gemm_only)
  cublas        cupy.matmul on the gathered A (the yardstick of the GEMM itself)
  allgather     cuflux.AllGather alone, same mode (the communication to hide;
                overlap = 1 - exposed / allgather)
  unfused       cuflux.AllGather then cuBLAS, one after the other on one stream (the baseline)
  nccl          NCCL all-gather then cuBLAS, when every rank has its own GPU (NCCL refuses two
                ranks on one GPU); then the baseline
  ideal         distinct GPUs only: max(cublas, comm), comm = this rank's shard to its W - 1 peers
                at the measured peer copy rate (peer_gbps; common.sends_ms);
                ideal_speedup = baseline / ideal, of_ideal = ideal / fused = speedup /
                ideal_speedup (issue 15's bar: >= 0.97)
Shapes: Flux's 4096 x 49152/W x 12288, Llama-70B column-parallel layers (M = 8192, K = 8192,
N = 10240/W and 57344/W), and this-rank N <= 4096 (4096 and 1024 at M = K = 8192); then a
sweep of chunk_rows on the Flux shape. Every operand set is larger than the 50 MB L2 (A
gathered >= 100 MB), so inputs are not rotated. Random normal bf16 data. The times of one case
are medians over interleaved rounds (common.time_interleaved).

With ranks sharing one GPU the times say nothing about links (every copy crosses the same HBM
and the ranks' GEMMs time-share the SMs): the figures that count are W = 1 (the bar) and runs
with one GPU per rank. Then the JSON says "speed_measured": false and the table prints the
times under "time-slicing, not speed".

Regimes (cuflux.bench.__main__.REGIMES_DOC): every *_ms above is GPU-queued (interleaved rounds
of calls queued back to back, GPU time per call). Beside them, for the fused op and for the
row's baseline (NCCL all-gather + cuBLAS on distinct GPUs, else cuflux.AllGather + cuBLAS; in
the chunk_rows sweep, cuflux.gemm on the gathered A):
  user_loop_ms / baseline_user_loop_ms   back-to-back calls from Python, nothing held, wall
                                         time per call; user_loop_speedup = baseline / cuflux
  host_us / baseline_host_us             host time per call alone
  graph_ms / baseline_graph_ms           a graph of N calls replayed (None at W > 1 where
                                         AllGather / AllGatherGemm refuse capture)
"""
from __future__ import annotations

from cuflux.bench.__main__ import (REGIME_COLS, add_note, add_speedups, bench_extra,
                                   measure_regimes, on_stream, print_bench_table, regime_calls,
                                   speed_header, speed_measured)
from cuflux.bench.common import (nccl_comm, peer_copy_gbps, ranks_share_gpu, sends_ms,
                                 time_interleaved, time_ms, write_results)

# (name, M, N, K, N is split over the ranks)
SHAPES = [("flux", 4096, 49152, 12288, True), ("llama70b-qkv", 8192, 10240, 8192, True),
          ("llama70b-mlp", 8192, 57344, 8192, True), ("n4096", 8192, 4096, 8192, False),
          ("n1024", 8192, 1024, 8192, False)]
QUICK = ("flux", "llama70b-qkv", "n4096")
CHUNK_SWEEP = (None, 64, 128, 256, 512, 1024, 2048)
BAR = 1.02


def cases(world_size: int, quick: bool) -> list[tuple[str, int, int, int]]:
    """(name, M, n, k) per shape: M a multiple of W, n this rank's columns (a multiple of 8)."""
    out = []
    for name, M, N, K, split in SHAPES:
        if quick and name not in QUICK:
            continue
        n = max(8, (N // world_size) // 8 * 8) if split else N
        out.append((name, M // world_size * world_size, n, K))
    return out


def _slowest(world, ms: float) -> float:
    return max(world.allgather(ms))


def run(world, args):
    import cupy

    import cuflux
    import cuflux.ops.gemm as G
    from cuflux.arrays import dtype_info
    from cuflux.ops.ag_gemm import AllGatherGemm

    W, me = world.size, world.rank
    shared_gpu = ranks_share_gpu(world)
    distinct = not shared_gpu
    measured = speed_measured(W, shared_gpu)
    iters = args.iters if measured else min(args.iters, 5)  # shared GPU: correctness only
    rstream = cupy.cuda.Stream(non_blocking=True)  # the regimes' stream (capturable)
    lib, comm = nccl_comm(world, shared_gpu) or (None, None)  # None on every rank or on none
    link = peer_copy_gbps(world) if W > 1 and distinct else None
    stream = cupy.cuda.get_current_stream()
    layouts = ("nk",) if args.quick else ("nk", "kn")
    modes = ("pull",) if W == 1 else ("pull", "push")  # W = 1: no gather, one path
    rows_out = []

    def timed(fn):
        world.barrier()
        ms = time_ms(fn, warmup=5, iters=iters)
        stream.synchronize()
        return _slowest(world, ms)

    def regimes_of(row, ours, base, ms, *ops):
        """The three user regimes of the fused op (ours) and the row's baseline (base)."""
        notes = []
        calls = regime_calls(ms, args.quick, measured)
        row.update(measure_regimes(
            [("", on_stream(ours, rstream), "fused"),
             ("baseline_", on_stream(base, rstream), row["baseline"])], rstream, calls=calls,
            world=world, notes=notes, after=lambda: [o.synchronize() for o in ops]))
        return add_note(add_speedups(row), *notes)

    def timed_all(fns, *ops):
        """Slowest rank's median of each fn, timed in interleaved rounds (clock drift between
        two blocks of timing must not read as fused vs GEMM-only)."""
        def raise_pending():
            for o in ops:
                o.synchronize()

        multi = world.size > 1  # W = 1: no barrier, no host wait between blocks (gapless)
        rounds = 5 if multi else 2 * len(fns)  # W = 1: every fn at every rotation position twice
        ms = time_interleaved(fns, rounds=rounds, iters=max(2, iters // 5) if multi
                              else max(5, iters // rounds), warmup=3, stream=stream,
                              before=world.barrier if multi else None,
                              after=raise_pending if multi else None)
        raise_pending()
        return {key: _slowest(world, v) for key, v in ms.items()}

    for name, M, n, k in cases(W, args.quick):
        rows = M // W
        for layout in layouts:
            rs = cupy.random.RandomState(1000 + me)
            bf16 = dtype_info("bfloat16").storage
            a = rs.standard_normal((rows, k), dtype=cupy.float32).astype(bf16)
            b = rs.standard_normal((k, n) if layout == "kn" else (n, k),
                                   dtype=cupy.float32).astype(bf16)
            bmat = b if layout == "kn" else b.T
            out = cupy.empty((M, n), dtype=bf16)
            full = cupy.empty((M, k), dtype=bf16)
            full[...] = rs.standard_normal((M, k), dtype=cupy.float32).astype(bf16)
            # The plain GEMM's tuner picks its configuration for this shape first; the fused op
            # reads that choice (it never tunes itself) and gemm_only runs the same one.
            G.gemm(full, b, out=out, b_layout=layout)
            cupy.matmul(full, bmat, out=out)  # cuBLAS initialised before any stream waits
            stream.synchronize()
            flop = 2.0 * M * n * k
            for mode in modes:
                # route="fused": the fused kernel itself (auto would follow the GEMM tuner,
                # which may have measured cuBLAS faster: then the unfused route)
                with AllGatherGemm(world, M, n, k, "bfloat16", b_layout=layout, mode=mode,
                                   route="fused") as op, \
                        cuflux.AllGather(world, rows, k, "bfloat16", mode=mode) as ag:
                    _, gathered = op(a, b, out=out, return_gathered=True)
                    op.synchronize()
                    plan = op.plan_for(rows)
                    cfg = plan.config if plan.impl == "sm90" else None
                    def unfused():
                        ag(a, out=full)
                        cupy.matmul(full, bmat, out=out)

                    fns = {"fused": lambda: op(a, b, out=out),
                           "gemm_only": lambda: G.gemm(gathered, b, out=out, b_layout=layout,
                                                       impl=plan.impl, config=cfg),
                           "cublas": lambda: cupy.matmul(gathered, bmat, out=out),
                           "alone": lambda: ag(a, out=full), "unfused": unfused}
                    if comm is not None:
                        def nccl_unfused():
                            # the bytes of the shard; on the current stream (the regimes
                            # run on their own, capturable, stream)
                            comm.allGather(a.data.ptr, full.data.ptr, rows * k * 2,
                                           lib.NCCL_UINT8, cupy.cuda.get_current_stream().ptr)
                            cupy.matmul(full, bmat, out=out)

                        fns["nccl"] = nccl_unfused
                    t = timed_all(fns, op, ag)
                    fused, gemm_only, cublas = t["fused"], t["gemm_only"], t["cublas"]
                    alone, unfused_ms, nccl_ms = t["alone"], t["unfused"], t.get("nccl")
                    base = nccl_ms if nccl_ms is not None else unfused_ms
                    exposed = fused - gemm_only
                    rows_out.append({
                        "case": f"{name} {M}x{n}x{k} {layout} {mode}", "cuflux_ms": fused,
                        "baseline": ("NCCL all-gather + cuBLAS" if nccl_ms is not None
                                     else "cuflux.AllGather + cuBLAS"),
                        "baseline_ms": base, "speedup": base / fused,
                        "gemm_only_ms": gemm_only, "fused_over_gemm_only": fused / gemm_only,
                        "exposed_comm_ms": exposed, "allgather_ms": alone,
                        "overlap": 1.0 - exposed / alone if alone > 0 else None,
                        "cublas_ms": cublas, "unfused_cuflux_ms": unfused_ms,
                        "unfused_nccl_ms": nccl_ms, "tflops": flop / fused / 1e9,
                        "impl": plan.impl, "config": plan.config, "chunk_rows": op.chunk_rows,
                        "mode": mode, "layout": layout})
                    if link:
                        ideal = max(cublas, sends_ms(rows * k * 2, W, link))
                        rows_out[-1].update(peer_gbps=link, ideal_ms=ideal,
                                            ideal_speedup=base / ideal, of_ideal=ideal / fused)
                    regimes_of(rows_out[-1], fns["fused"],
                               fns["nccl"] if nccl_ms is not None else unfused,
                               max(fused, base), op, ag)
                    gathered = None  # freed before the next mode
            a = b = bmat = out = full = None  # freed before the next shape
            cupy.get_default_memory_pool().free_all_blocks()

    # chunk_rows sweep on the Flux shape (the first case), both modes (W > 1: at W = 1 nothing
    # is chunked).
    name, M, n, k = cases(W, True)[0]
    rows = M // W
    rs = cupy.random.RandomState(2000 + me)
    bf16 = dtype_info("bfloat16").storage
    a = rs.standard_normal((rows, k), dtype=cupy.float32).astype(bf16)
    b = rs.standard_normal((n, k), dtype=cupy.float32).astype(bf16)
    out = cupy.empty((M, n), dtype=bf16)
    sweep = [c for c in CHUNK_SWEEP if c is None or c < rows] if W > 1 else []
    if args.quick:
        sweep = [c for c in sweep if c in (None, 128, 512)]
    for mode in modes:
        for chunk in sweep:
            with AllGatherGemm(world, M, n, k, "bfloat16", b_layout="nk", mode=mode,
                               chunk_rows=chunk, route="fused") as op:
                _, gathered = op(a, b, out=out, return_gathered=True)
                op.synchronize()
                plan = op.plan_for(rows)
                fused = timed(lambda: op(a, b, out=out))
                op.synchronize()
                def gemm_alone():
                    G.gemm(gathered, b, out=out, b_layout="nk", impl=plan.impl,
                           config=plan.config if plan.impl == "sm90" else None)

                gemm_only = timed(gemm_alone)
                rows_out.append({
                    "case": f"{name} {M}x{n}x{k} nk {mode} chunk_rows={op.chunk_rows}"
                            + (" (default)" if chunk is None else ""),
                    "cuflux_ms": fused, "baseline": "cuflux.gemm on the gathered A",
                    "baseline_ms": gemm_only, "speedup": gemm_only / fused,
                    "gemm_only_ms": gemm_only, "fused_over_gemm_only": fused / gemm_only,
                    "exposed_comm_ms": fused - gemm_only, "tflops": 2.0 * M * n * k / fused / 1e9,
                    "impl": plan.impl, "config": plan.config, "chunk_rows": op.chunk_rows,
                    "mode": mode, "layout": "nk"})
                regimes_of(rows_out[-1], lambda: op(a, b, out=out), gemm_alone,
                           max(fused, gemm_only), op)
                gathered = None

    if me != 0:
        return None
    print(speed_header("ag_gemm", W, shared_gpu))
    where = "distinct GPUs" if distinct else "one shared GPU (link figures meaningless)"
    print(f"AllGather + GEMM, W={W}, bf16, ranks on {where}; speedup = baseline_ms / "
          f"cuflux_ms")
    cols = ["case", "config", "chunk_rows", "cuflux_ms", "gemm_only_ms",
            "fused_over_gemm_only", "exposed_comm_ms", "allgather_ms", "overlap", "cublas_ms",
            "baseline_ms", "speedup", "tflops"] + REGIME_COLS
    cols += ["ideal_ms", "ideal_speedup", "of_ideal"] if link is not None else []
    print_bench_table(rows_out, cols, set(cols) - {"case", "config", "chunk_rows"}, measured)
    if W == 1:
        worst = max(r["fused_over_gemm_only"] for r in rows_out)
        print(f"W = 1 bar (fused <= {BAR} x GEMM-only): worst {worst:.4f} -> "
              f"{'met' if worst <= BAR else 'MISSED'}")
    path = write_results("ag_gemm", W, rows_out, bench_extra(
        args, measured, distinct_gpus=distinct, ranks_share_gpu=shared_gpu, bar=BAR),
        outdir=args.outdir)
    print("wrote", path)
    return path
