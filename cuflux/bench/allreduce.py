"""AllReduce + residual + RMSNorm benchmark: fused vs unfused, HBM fraction at W = 1,
one-shot vs two-shot (the crossover), NCCL when every rank has its own GPU; then plain
AllReduce against NCCL's all-reduce.

Per output mode (replicated, sharded_residual, sequence_parallel), hidden (4096, 8192) and T
(TS_QUICK: issue 16's 1, 16, 128, 1024, 8192; TS_FULL adds points between), bfloat16; rows
"kind": "norm" with fields T, H, mode:
  cuflux_ms    the fused op (AllReduceRMSNorm, algo "auto")
  baseline_ms  unfused: cuflux.AllReduce, then rmsnorm_residual (the same row kernel alone)
  one_shot_ms / two_shot_ms   the fused op forced to each algorithm (W > 1): the crossover
               (one-shot through an op built algo="one_shot": an "auto" op's stage holds
               one-shot calls only up to its crossover)
  peer_gbps, fraction_of_link   distinct GPUs only: bytes that leave each GPU in the auto
               call's algorithm over its time, against the measured one-way peer copy rate
               (common.peer_copy_gbps; ~395 GB/s between the two H200s). Issue 16's bar at
               T = 8192: >= 0.85.
  nccl_ms      NCCL all-reduce + rmsnorm_residual (every rank on its own GPU, W = 1
               included; sequence_parallel: NCCL reduce-scatter where T splits evenly, then
               the norm of this rank's slice); speedup_nccl = nccl_ms / cuflux_ms, and
               graph_speedup_nccl, user_loop_speedup_nccl in those regimes
  gbps, fraction_of_hbm       W = 1 only: bytes the fused kernel must move (x, residual read
               and written, out, weight) over time, against the measured device-to-device copy
               rate (read + write; 4.26 TB/s on the H200 here). Bar: >= 0.85.
Plain AllReduce rows ("kind": "plain", field bytes: PLAIN_BYTES_QUICK / _FULL of x per rank):
cuflux_ms (auto), one_shot_ms / two_shot_ms (W > 1), baseline_ms a copy of x (the floor of a
call at W = 1), nccl_ms NCCL's all-reduce, busbw_gbps / nccl_busbw_gbps (bytes x 2 (W - 1) / W
over the time, as nccl-tests counts it; bytes / time at W = 1), busbw_to_nccl.
Device times: the calls are captured in a CUDA graph (as a serving engine runs them), the graph
is replayed and timed with CUDA events (median), divided by the calls in it; eager_ms is the
fused op called from Python (host-bound for small T). The row takes the slowest rank. Inputs
rotate over enough sets to exceed twice the L2 cache, so small cases are not served from L2.
With ranks sharing one GPU the ops run for correctness only: the JSON says
"speed_measured": false and the table prints the times under "time-slicing, not speed".

Regimes (cuflux.bench.__main__.REGIMES_DOC): cuflux_ms / baseline_ms / speedup above are the
GPU-queued figures (graph-replayed here, GPU time per call). Beside them, for the fused op and
for the unfused baseline (and NCCL + rmsnorm_residual, prefix nccl_, on distinct GPUs):
  user_loop_ms / baseline_user_loop_ms   back-to-back calls from Python, nothing held, wall
                                         time per call; user_loop_speedup = baseline / cuflux
  host_us / baseline_host_us             host time per call alone
  graph_ms / baseline_graph_ms           a graph of N calls replayed, GPU time per call
"""
from __future__ import annotations

import contextlib

from cuflux.bench import bars
from cuflux.bench.__main__ import (REGIME_COLS, add_note, add_speedups, bench_extra,
                                   measure_regimes, on_stream, print_bench_table, regime_calls,
                                   speed_header, speed_measured)
from cuflux.bench.common import (copy_bandwidth_gbps, nccl_comm, peer_copy_gbps,
                                 ranks_share_gpu, time_ms, write_results)

L2_BYTES = 60 << 20


def graph_ms(fn, calls: int, iters: int, stream) -> float:
    """Milliseconds per call of fn, `calls` calls captured in one CUDA graph and replayed."""
    with stream:
        fn()  # eager first: plans, lazy initialisation (NCCL) happen outside the capture
        stream.synchronize()
        stream.begin_capture()
        for _ in range(calls):
            fn()
        graph = stream.end_capture()
        ms = time_ms(lambda: graph.launch(stream=stream), warmup=3, iters=iters, stream=stream)
    return ms / calls


# Issue 16's token counts (all in --quick: the bars' own, bench.bars); the full run adds the
# points between.
TS_QUICK = bars.NORM_TOKENS
TS_FULL = (1, 16, 128, 512, 1024, 2048, 4096, 8192)
# Plain AllReduce sizes (bytes of x per rank): issue 16's bars are about small calls (<= 256
# KiB, latency) and large ones (>= 8 MiB, bus bandwidth); the full run adds the crossover region.
PLAIN_BYTES_QUICK = (4 << 10, 64 << 10, bars.PLAIN_SMALL_BYTES, bars.PLAIN_LARGE_BYTES,
                     64 << 20)
PLAIN_BYTES_FULL = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20,
                    32 << 20, 64 << 20, 256 << 20)


def _rotating_sets(make, set_bytes: int):
    """(pick, nsets): enough input sets (at most 16) to exceed twice the L2 cache, and a pick()
    that returns the next one, so small calls are not served from L2 (the sets live as long
    as pick)."""
    nsets = max(1, min(16, -(-2 * L2_BYTES // set_bytes)))
    sets = [make() for _ in range(nsets)]
    it = [0]

    def pick():
        it[0] = (it[0] + 1) % nsets
        return sets[it[0]]
    return pick, nsets


def _time_row(world, row, timed, regime_variants, ops, stream, iters, nsets, shared_gpu, args,
              measured):
    """Graph-replayed ms per call of every fn in `timed` (the slowest rank's; a graph of as
    many calls as input sets, a few where ranks share a GPU) into row, then the user regimes
    of regime_variants (measure_regimes) and the speed-ups."""
    calls = min(nsets, 2) if world.size > 1 and shared_gpu else max(nsets, 4)

    def settle():
        for op in ops:
            op.synchronize(stream)

    for key, fn in timed.items():
        world.barrier()
        ms = graph_ms(fn, calls, iters, stream)
        settle()
        row[key] = max(world.allgather(ms))
    notes = []
    rcalls = regime_calls(max(row["cuflux_ms"], row["baseline_ms"]), args.quick, measured)
    row.update(measure_regimes(regime_variants, stream, calls=rcalls, world=world, notes=notes,
                               after=settle))
    add_note(add_speedups(row), *notes)
    row["speedup"] = row["baseline_ms"] / row["cuflux_ms"]
    if "nccl_ms" in row:
        row["speedup_nccl"] = row["nccl_ms"] / row["cuflux_ms"]
        add_speedups(row, "nccl_", "_nccl")


def _norm_rows(world, args, output, H, Ts, nccl, link, ceiling, stream, iters, measured,
               shared_gpu):
    """Rows of AllReduceRMSNorm(output=...) at hidden H, every T in Ts."""
    import cupy

    from cuflux.ops.allreduce import (AllReduce, AllReduceRMSNorm, _two_shot_only, choose_algo,
                                      rmsnorm_residual, token_slice)

    W, me = world.size, world.rank
    dtype, max_t = "bfloat16", max(Ts)
    one_shot_ok = not _two_shot_only(output)
    rows = []
    with AllReduceRMSNorm(world, max_t, H, dtype, output=output) as norm, \
            AllReduce(world, max_t * H, dtype) as arop, \
            (AllReduceRMSNorm(world, max_t, H, dtype, algo="one_shot") if one_shot_ok
             else contextlib.nullcontext()) as one:
        ops = [op for op in (norm, one, arop) if op is not None]
        st = norm.dtype.storage
        weight = cupy.random.standard_normal(H, dtype=cupy.float32).astype(st)
        for T in Ts:
            lo, hi = token_slice(T, W, me)
            n_rows = norm.out_rows(T)  # rows of out and residual this rank holds

            # NCCL's reduce-scatter takes one count: sequence_parallel's baseline reduces
            # T padded to a multiple of W (the op's x is the first T rows of the same
            # memory; with uneven slices at W > 2 its rows are not token_slice's, its cost
            # is the same)
            T_pad = -(-T // W) * W

            def make():  # one input set; the views are made here once, not in the
                # timed calls (a CuPy slice costs the host ~1-2 us, which is not the op's)
                def rand(shape):
                    return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(st)
                x, y = rand((T_pad, H)), rand((T_pad, H))  # x padded, y: the unfused sum
                return {"x_pad": x, "x": x[:T], "res": rand((n_rows, H)),
                        "out": rand((n_rows, H)), "y_pad": y, "y": y[:T],
                        # the sum's rows this rank normalises: cuflux's unfused pair
                        # (its AllReduce gives every row), NCCL's reduce-scatter (its
                        # share lands first)
                        "y_mine": y[lo:hi] if output == "sequence_parallel" else y[:T],
                        "y_share": y[:n_rows]}

            # sets sized from T alone: every rank rotates as many sets, so every rank
            # captures as many calls (n_rows differs between ranks)
            pick, nsets = _rotating_sets(make, 4 * T * H * st.itemsize)

            def fused(algo=None):
                v = pick()
                (one if algo == "one_shot" else norm)(v["x"], v["res"], weight, out=v["out"],
                                                      algo=algo)

            def unfused():
                v = pick()
                arop(v["x"], out=v["y"])
                rmsnorm_residual(v["y_mine"], v["res"], weight, eps=norm.eps, out=v["out"])

            def with_nccl():
                # sequence_parallel: NCCL's reduce-scatter of the padded rows, then the
                # norm of this rank's; the other outputs: its all-reduce, then the norm
                v = pick()
                lib, comm = nccl
                if output == "sequence_parallel":
                    comm.reduceScatter(v["x_pad"].data.ptr, v["y_pad"].data.ptr,
                                       (T_pad // W) * H, lib.NCCL_BFLOAT16, lib.NCCL_SUM,
                                       stream.ptr)
                    rows = v["y_share"]
                else:
                    comm.allReduce(v["x"].data.ptr, v["y"].data.ptr, T * H,
                                   lib.NCCL_BFLOAT16, lib.NCCL_SUM, stream.ptr)
                    rows = v["y"]
                rmsnorm_residual(rows, v["res"], weight, eps=norm.eps, out=v["out"])

            timed = {"cuflux_ms": fused, "baseline_ms": unfused}
            if W > 1:
                if one_shot_ok:
                    timed["one_shot_ms"] = lambda: fused("one_shot")
                timed["two_shot_ms"] = lambda: fused("two_shot")
            if nccl is not None:
                timed["nccl_ms"] = with_nccl
            row = {"case": f"T={T} H={H} bf16 {output}", "kind": "norm", "T": T, "H": H,
                   "mode": output, "baseline": "AllReduce + rmsnorm_residual",
                   "auto_algo": choose_algo(T * H * st.itemsize, W, output)}
            _time_row(world, row, timed,
                      [("", on_stream(fused, stream), "AllReduceRMSNorm"),
                       ("baseline_", on_stream(unfused, stream),
                        "AllReduce + rmsnorm_residual"),
                       ("nccl_", on_stream(with_nccl, stream) if nccl is not None else None,
                        "NCCL + rmsnorm_residual")],
                      ops, stream, iters, nsets, shared_gpu, args, measured)
            world.barrier()
            with stream:
                ms = time_ms(fused, warmup=3, iters=iters, stream=stream)
            norm.synchronize(stream)
            row["eager_ms"] = max(world.allgather(ms))
            x_bytes = T * H * st.itemsize
            if link is not None and me == 0:
                if row["auto_algo"] == "one_shot":
                    out_bytes = (W - 1) * x_bytes
                else:  # the scatter, then the gathered tensors (out, and the residual
                    # when replicated) to every peer
                    gathered = {"replicated": 2, "sharded_residual": 1,
                                "sequence_parallel": 0}[output]
                    out_bytes = (W - 1) / W * x_bytes * (1 + gathered)
                row["peer_gbps"] = out_bytes / (row["cuflux_ms"] * 1e-3) / 1e9
                row["fraction_of_link"] = row["peer_gbps"] / link
            if W == 1 and me == 0:
                moved = (4 * T * H + H) * st.itemsize
                row["gbps"] = moved / (row["cuflux_ms"] * 1e-3) / 1e9
                row["fraction_of_hbm"] = row["gbps"] / ceiling
            rows.append(row)
            pick = None  # its sets freed before the next T's
    return rows


def _plain_rows(world, args, sizes, nccl, stream, iters, measured, shared_gpu):
    """Rows of plain AllReduce (x of each size in bytes, bf16) against NCCL's all-reduce, with
    bus bandwidth as nccl-tests counts it: bytes * 2 (W - 1) / W over the time (the link
    traffic of a ring; algorithm bandwidth, bytes / time, at W = 1)."""
    import cupy

    from cuflux.ops.allreduce import AllReduce, choose_algo

    W = world.size
    max_elems = max(sizes) // 2
    rows = []
    with AllReduce(world, max_elems, "bfloat16") as arop, \
            AllReduce(world, max_elems, "bfloat16", algo="one_shot") as one:
        st = arop.dtype.storage
        for nbytes in sizes:
            n = nbytes // 2

            def make():
                return (cupy.random.standard_normal(n, dtype=cupy.float32).astype(st),
                        cupy.empty(n, dtype=st), cupy.empty(n, dtype=st))

            pick, nsets = _rotating_sets(make, 3 * nbytes)

            def ours(algo=None):
                x, out, _ = pick()
                (one if algo == "one_shot" else arop)(x, out=out, algo=algo)

            def copy_baseline():  # one pass over x and out: the floor of any W = 1 call
                x, out, _ = pick()
                out[...] = x

            def with_nccl():
                x, _, y = pick()
                lib, comm = nccl
                comm.allReduce(x.data.ptr, y.data.ptr, n, lib.NCCL_BFLOAT16, lib.NCCL_SUM,
                               stream.ptr)

            timed = {"cuflux_ms": ours, "baseline_ms": copy_baseline}
            if W > 1:
                timed["one_shot_ms"] = lambda: ours("one_shot")
                timed["two_shot_ms"] = lambda: ours("two_shot")
            if nccl is not None:
                timed["nccl_ms"] = with_nccl
            row = {"case": f"AllReduce {nbytes} B bf16", "kind": "plain", "bytes": nbytes,
                   "baseline": "a copy of x (cupy)", "auto_algo": choose_algo(nbytes, W, "plain")}
            _time_row(world, row, timed,
                      [("", on_stream(ours, stream), "AllReduce"),
                       ("baseline_", on_stream(copy_baseline, stream), "copy"),
                       ("nccl_", on_stream(with_nccl, stream) if nccl is not None else None,
                        "NCCL all-reduce")],
                      (arop, one), stream, iters, nsets, shared_gpu, args, measured)
            bus = 2 * (W - 1) / W if W > 1 else 1.0
            for ms, gbps in (("cuflux_ms", "busbw_gbps"), ("nccl_ms", "nccl_busbw_gbps")):
                if row.get(ms):
                    row[gbps] = nbytes * bus / (row[ms] * 1e-3) / 1e9
            if row.get("nccl_busbw_gbps"):
                row["busbw_to_nccl"] = row["busbw_gbps"] / row["nccl_busbw_gbps"]
            rows.append(row)
            pick = None  # its sets freed before the next size's
    return rows


def run(world, args):
    import cupy

    from cuflux.ops.allreduce import OUTPUTS

    W, me = world.size, world.rank
    shared_gpu = ranks_share_gpu(world)
    measured = speed_measured(W, shared_gpu)
    ceiling = copy_bandwidth_gbps() if me == 0 else None
    nccl = nccl_comm(world, shared_gpu)
    link = peer_copy_gbps(world) if W > 1 and not shared_gpu else None
    world.barrier()
    Ts = TS_QUICK if args.quick else TS_FULL
    stream = cupy.cuda.Stream(non_blocking=True)
    iters = min(args.iters, 5) if W > 1 and shared_gpu else args.iters
    rows = []
    for output in OUTPUTS:
        for H in bars.NORM_HIDDEN:
            rows += _norm_rows(world, args, output, H, Ts, nccl, link, ceiling, stream, iters,
                               measured, shared_gpu)
    rows += _plain_rows(world, args, PLAIN_BYTES_QUICK if args.quick else PLAIN_BYTES_FULL,
                        nccl, stream, iters, measured, shared_gpu)
    if me != 0:
        return None
    print(speed_header("allreduce", W, shared_gpu))
    print(f"AllReduce+RMSNorm, W={W}, ranks {'share one GPU' if shared_gpu else 'on own GPUs'}"
          f", copy ceiling {ceiling:.0f} GB/s (read+write)")
    norm_rows = [r for r in rows if r["kind"] == "norm"]
    plain_rows = [r for r in rows if r["kind"] == "plain"]
    cols = ["case", "auto_algo", "cuflux_ms", "baseline_ms", "speedup", "eager_ms"]
    cols += ["one_shot_ms", "two_shot_ms"] if W > 1 else ["gbps", "fraction_of_hbm"]
    nccl_cols = ["nccl_ms", "speedup_nccl", "graph_speedup_nccl", "user_loop_speedup_nccl"]
    cols += nccl_cols if nccl is not None else []
    cols += ["peer_gbps", "fraction_of_link"] if link is not None else []
    cols += REGIME_COLS
    cols += ["nccl_user_loop_ms", "nccl_host_us", "nccl_graph_ms"] if nccl is not None else []
    speed_cols = set(cols) - {"case", "auto_algo"}
    print_bench_table(norm_rows, cols, speed_cols, measured)
    print(f"\nAllReduce, W={W}: busbw = bytes x 2(W-1)/W / time (bytes / time at W = 1); "
          "baseline: a copy of x")
    pcols = ["case", "auto_algo", "cuflux_ms", "baseline_ms"]
    pcols += ["one_shot_ms", "two_shot_ms"] if W > 1 else []
    pcols += ["busbw_gbps"]
    pcols += (["nccl_ms", "nccl_busbw_gbps", "busbw_to_nccl", "speedup_nccl",
               "graph_speedup_nccl", "user_loop_speedup_nccl"] if nccl is not None else [])
    pcols += REGIME_COLS
    print_bench_table(plain_rows, pcols, set(pcols) - {"case", "auto_algo"}, measured)
    path = write_results("allreduce", W, rows, bench_extra(
        args, measured, copy_ceiling_gbps=ceiling, ranks_share_gpu=shared_gpu,
        link_gbps_one_way=link),
        outdir=args.outdir)
    print("wrote", path)
    return path
