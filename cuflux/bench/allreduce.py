"""AllReduce + residual + RMSNorm benchmark: fused vs unfused, HBM fraction at W = 1,
one-shot vs two-shot (the crossover), NCCL when every rank has its own GPU.

Per (hidden, T), bfloat16, output="replicated":
  cuflux_ms    the fused op (AllReduceRMSNorm, algo "auto")
  baseline_ms  unfused: cuflux.AllReduce, then rmsnorm_residual (the same row kernel alone)
  one_shot_ms / two_shot_ms   the fused op forced to each algorithm (W > 1): the crossover
               (one-shot through an op built algo="one_shot": an "auto" op's stage holds
               one-shot calls only up to its crossover)
  peer_gbps, fraction_of_link   distinct GPUs only: bytes that leave each GPU in the auto
               call's algorithm over its time, against the measured one-way peer copy rate
               (common.peer_copy_gbps; ~395 GB/s between the two H200s). Issue 16's bar at
               T = 8192: >= 0.85.
  nccl_ms      NCCL all-reduce + rmsnorm_residual (every rank on its own GPU, W = 1 included)
  gbps, fraction_of_hbm       W = 1 only: bytes the fused kernel must move (x, residual read
               and written, out, weight) over time, against the measured device-to-device copy
               rate (read + write; 4.26 TB/s on the H200 here). Bar: >= 0.85.
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

from cuflux.bench.__main__ import (REGIME_COLS, add_note, add_speedups, bench_extra,
                                   measure_regimes, on_stream, print_bench_table, regime_calls,
                                   speed_header, speed_measured)
from cuflux.bench.common import (copy_bandwidth_gbps, peer_copy_gbps, ranks_share_gpu, time_ms,
                                 write_results)

L2_BYTES = 60 << 20


def _nccl(world):
    """An NCCL communicator over the world's ranks, or None when NCCL cannot be used."""
    try:
        from cupy.cuda import nccl

        ok = bool(nccl.available)
    except Exception:
        ok = False
    if not all(world.allgather(ok)):  # decided together: nobody waits in bcast alone
        if world.rank == 0:
            print("NCCL baseline unavailable in this CuPy build")
        return None
    uid = nccl.get_unique_id() if world.rank == 0 else None
    uid = world.comm.bcast(uid, root=0)
    return nccl, nccl.NcclCommunicator(world.size, uid, world.rank)


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


def run(world, args):
    import cupy

    from cuflux.ops.allreduce import (AllReduce, AllReduceRMSNorm, choose_algo,
                                      rmsnorm_residual)

    W, me = world.size, world.rank
    shared_gpu = ranks_share_gpu(world)
    measured = speed_measured(W, shared_gpu)
    ceiling = copy_bandwidth_gbps() if me == 0 else None
    # W = 1 too: NCCL's one-rank all-reduce is a copy, and the W = 1 run then exercises the
    # baseline's code that otherwise runs only where two GPUs are lent
    nccl = _nccl(world) if not shared_gpu else None
    link = peer_copy_gbps(world) if W > 1 and not shared_gpu else None
    world.barrier()
    Ts = [1, 128, 1024, 8192] if args.quick else [1, 16, 128, 512, 1024, 2048, 4096, 8192]
    rows = []
    dtype = "bfloat16"
    stream = cupy.cuda.Stream(non_blocking=True)
    iters = min(args.iters, 5) if W > 1 and shared_gpu else args.iters
    for H in (4096, 8192):
        max_t = max(Ts)
        with AllReduceRMSNorm(world, max_t, H, dtype) as norm, \
                AllReduceRMSNorm(world, max_t, H, dtype, algo="one_shot") as one, \
                AllReduce(world, max_t * H, dtype) as arop:
            st = norm.dtype.storage
            weight = cupy.random.standard_normal(H, dtype=cupy.float32).astype(st)
            for T in Ts:
                set_bytes = 4 * T * H * st.itemsize
                nsets = max(1, min(16, -(-2 * L2_BYTES // set_bytes)))
                sets = [tuple(cupy.random.standard_normal((T, H), dtype=cupy.float32).astype(st)
                              for _ in range(4)) for _ in range(nsets)]  # x, residual, out, y
                it = [0]

                def pick():
                    it[0] = (it[0] + 1) % nsets
                    return sets[it[0]]

                def fused(algo=None):
                    x, res, out, _ = pick()
                    (one if algo == "one_shot" else norm)(x, res, weight, out=out, algo=algo)

                def unfused():
                    x, res, out, y = pick()
                    arop(x, out=y)
                    rmsnorm_residual(y, res, weight, eps=norm.eps, out=out)

                def with_nccl():
                    x, res, out, y = pick()
                    lib, comm = nccl
                    comm.allReduce(x.data.ptr, y.data.ptr, x.size, lib.NCCL_BFLOAT16,
                                   lib.NCCL_SUM, stream.ptr)
                    rmsnorm_residual(y, res, weight, eps=norm.eps, out=out)

                timed = {"cuflux_ms": fused, "baseline_ms": unfused}
                if W > 1:
                    timed["one_shot_ms"] = lambda: fused("one_shot")
                    timed["two_shot_ms"] = lambda: fused("two_shot")
                if nccl is not None:
                    timed["nccl_ms"] = with_nccl
                row = {"case": f"T={T} H={H} bf16 replicated",
                       "baseline": "AllReduce + rmsnorm_residual",
                       "auto_algo": choose_algo(T * H * st.itemsize, W, "replicated")}
                calls = min(nsets, 2) if W > 1 and shared_gpu else max(nsets, 4)
                for key, fn in timed.items():
                    world.barrier()
                    ms = graph_ms(fn, calls, iters, stream)
                    for op in (norm, one, arop):
                        op.synchronize(stream)
                    row[key] = max(world.allgather(ms))
                world.barrier()
                with stream:
                    ms = time_ms(fused, warmup=3, iters=iters, stream=stream)
                norm.synchronize(stream)
                row["eager_ms"] = max(world.allgather(ms))
                row["speedup"] = row["baseline_ms"] / row["cuflux_ms"]
                notes = []
                rcalls = regime_calls(max(row["cuflux_ms"], row["baseline_ms"]), args.quick,
                                      measured)

                def settle():
                    for op in (norm, one, arop):
                        op.synchronize(stream)

                row.update(measure_regimes(
                    [("", on_stream(fused, stream), "AllReduceRMSNorm"),
                     ("baseline_", on_stream(unfused, stream), "AllReduce + rmsnorm_residual"),
                     ("nccl_", on_stream(with_nccl, stream) if nccl is not None else None,
                      "NCCL + rmsnorm_residual")],
                    stream, calls=rcalls, world=world, notes=notes, after=settle))
                add_note(add_speedups(row), *notes)
                if link is not None and me == 0:
                    x_bytes = T * H * st.itemsize
                    out_bytes = ((W - 1) * x_bytes if row["auto_algo"] == "one_shot" else
                                 (W - 1) / W * x_bytes * 3)  # scatter, then out and residual
                    row["peer_gbps"] = out_bytes / (row["cuflux_ms"] * 1e-3) / 1e9
                    row["fraction_of_link"] = row["peer_gbps"] / link
                if W == 1 and me == 0:
                    moved = (4 * T * H + H) * st.itemsize
                    row["gbps"] = moved / (row["cuflux_ms"] * 1e-3) / 1e9
                    row["fraction_of_hbm"] = row["gbps"] / ceiling
                rows.append(row)
                sets = None  # freed before the next T
    if me != 0:
        return None
    print(speed_header("allreduce", W, shared_gpu))
    print(f"AllReduce+RMSNorm, W={W}, ranks {'share one GPU' if shared_gpu else 'on own GPUs'}"
          f", copy ceiling {ceiling:.0f} GB/s (read+write)")
    cols = ["case", "auto_algo", "cuflux_ms", "baseline_ms", "speedup", "eager_ms"]
    cols += ["one_shot_ms", "two_shot_ms"] if W > 1 else ["gbps", "fraction_of_hbm"]
    cols += ["nccl_ms"] if nccl is not None else []
    cols += ["peer_gbps", "fraction_of_link"] if link is not None else []
    cols += REGIME_COLS
    cols += ["nccl_user_loop_ms", "nccl_host_us", "nccl_graph_ms"] if nccl is not None else []
    speed_cols = set(cols) - {"case", "auto_algo"}
    print_bench_table(rows, cols, speed_cols, measured)
    path = write_results("allreduce", W, rows, bench_extra(
        args, measured, copy_ceiling_gbps=ceiling, ranks_share_gpu=shared_gpu,
        link_gbps_one_way=link),
        outdir=args.outdir)
    print("wrote", path)
    return path
