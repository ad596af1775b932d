"""All2AllHeads benchmark: achieved GB/s against the measured device-to-device copy rate, and
against NCCL all-to-all (plus the two permute copies it needs) when ranks have GPUs of their own.

Bytes counted per rank and call: the input read plus the output written (2 x B*T_r*H*D*itemsize),
whatever the op moves internally. At W = 1 the op is one pass over the data, so its rate compares
directly with a device-to-device copy (read + write).

Two timings per case:
  cuflux_ms  back-to-back calls between two CUDA events, divided by the number of calls: the
             GPU-side cost when the host keeps ahead (how the op runs inside a model step);
  single_ms  one call between events after an idle GPU (common.time_ms): includes the host's
             launch overhead (validation, 1-3 kernel launches).
queued_host_us is the host's time per call in that back-to-back loop: near cuflux_ms the host, not
the GPU, sets the pace. At W = 1 with out=, copy_ms is a bare cudaMemcpyAsync of the same bytes
through the same buffers, timed in alternation with the op (ratio_to_copy = copy_ms / cuflux_ms).
Inputs rotate over buffers larger than the L2 cache, filled with random data.

Rows carry their case as fields (direction, B, T, H, D, dtype, scales, mode) for
`python -m cuflux.bench bars`. On distinct GPUs every row also has link_gbps_per_gpu (the bytes
leaving each GPU, sent_bytes_per_gpu: (W - 1) / W of the input, plus the scales its peers
receive, over cuflux_ms) and fraction_of_link (against the measured one-way peer copy rate,
common.peer_copy_gbps). Every rank on its own GPU (W = 1 included), owned scatter is timed again
against NCCL all-to-all + the two permute copies ("vs_nccl": true) at T = 1024 and at each case.

Regimes (cuflux.bench.__main__.REGIMES_DOC): cuflux_ms / baseline_ms / speedup are GPU-queued
(calls queued behind a hold, GPU time per call; queued_host_us is that loop's host time).
Beside them, for the op (and for the NCCL baseline, every rank on its own GPU, baseline_*):
  user_loop_ms   back-to-back calls from Python, nothing held, wall time per call
  host_us        host time per call alone (the regime's own measurement, same name)
  graph_ms       a graph of N calls replayed, GPU time per call
Rows whose baseline is the copy ceiling (computed, not a call) have no baseline regimes.
With ranks sharing one GPU the ops run for correctness only ("speed_measured": false).
"""
from __future__ import annotations

import numpy as np

from cuflux.bench.bars import A2A_LOOP_TOKENS
from cuflux.bench.__main__ import (REGIME_COLS, add_note, add_speedups, bench_extra,
                                   measure_regimes, no_baseline_regimes, print_bench_table,
                                   on_stream, regime_calls, speed_header, speed_measured)
from cuflux.bench.common import (copy_bandwidth_gbps, hold_stream, nccl_comm,
                                 peer_copy_gbps, ranks_share_gpu, time_ms, write_results)

L2_BYTES = 60 << 20


def _back_to_back_ms(call, stream, calls: int, reps: int = 5, warmup: int = 3, twin=None):
    """(GPU ms per call, host us per call, twin's GPU ms per call or None).

    Each block of calls is queued behind a hold (hold_stream) of about twice the host's time
    to issue it, so the GPU ms is the rate of calls already queued, as in a model whose GPU runs
    behind its host; host us tells whether the host keeps up (it does while host us per call is
    below the GPU's time per call; the rows say so in "host_bound"). `twin` (another call(i))
    is timed in alternation with `call`, rep by rep, so clock drift during the run cannot pass
    for a difference between the two."""
    import time

    import cupy

    hold_us = {}  # per fn: the GPU waits this long before each block (host time to issue it)

    def block(fn):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        hold_stream(stream, hold_us[fn])
        a.record(stream)
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        host_us = (time.perf_counter() - t0) * 1e6 / calls
        b.record(stream)
        b.synchronize()
        return cupy.cuda.get_elapsed_time(a, b) / calls, host_us

    for fn in (call,) if twin is None else (call, twin):
        t0 = time.perf_counter()
        for i in range(warmup):
            fn(i)
        stream.synchronize()
        hold_us[fn] = 2 * calls * (time.perf_counter() - t0) * 1e6 / max(warmup, 1) + 100
    times, host, twins = [], [], []
    for _ in range(reps):
        ms, us = block(call)
        times.append(ms)
        host.append(us)
        if twin is not None:
            twins.append(block(twin)[0])
    return (float(np.median(times)), float(np.median(host)),
            float(np.median(twins)) if twins else None)


def _inputs(shape, dtype_name, count, storage):
    import cupy

    if dtype_name.startswith("float8"):
        return [cupy.random.randint(0, 255, shape, dtype=cupy.uint8) for _ in range(count)]
    return [cupy.random.standard_normal(shape, dtype=cupy.float32).astype(storage)
            for _ in range(count)]


def _case(world, args, B, T_total, H, D, dtype, mode, direction, num_sms=None, scales=False,
          kernel=False, pdl=True, measured=True):
    """Time one configuration on every rank; return rank 0's row (None elsewhere)."""
    import cupy

    from cuflux.ops.all2all import All2AllHeads

    W, me = world.size, world.rank
    T = T_total // W
    tokens = (T,) * W
    S = T * W
    s = cupy.cuda.Stream(non_blocking=True)
    with All2AllHeads(world, T, H, D, dtype, batch=B, num_sms=num_sms) as op, s:
        info = op.spec.dtype
        in_shape = (B, S, H // W, D) if direction == "gather" else (B, T, H, D)
        in_bytes = int(np.prod(in_shape)) * info.itemsize
        count = max(2, -(-4 * L2_BYTES // max(in_bytes, 1)))
        xs = _inputs(in_shape, dtype, count, info.storage)
        sc = None
        if scales:
            sc_shape = (B, S) if direction == "gather" else (B, T)
            sc = [cupy.random.random(sc_shape, dtype=cupy.float32) for _ in range(count)]
        out_shape = (B, T, H, D) if direction == "gather" else (B, S, H // W, D)
        outs = [cupy.empty(out_shape, dtype=info.storage) for _ in range(count)] \
            if mode == "out" else None
        fn = op.gather_heads if direction == "gather" else op.scatter_heads
        op.w1 = "kernel" if kernel else ("pdl" if pdl else "memcpy")  # the W = 1 path

        def call(i):
            k = i % count
            fn(xs[k], tokens, None if sc is None else sc[k],
               out=None if outs is None else outs[k], view=(mode == "view"), stream=s)

        def bare_copy(i):  # the same bytes through the same buffers, no op around it
            k = i % count
            cupy.cuda.runtime.memcpyAsync(outs[k].data.ptr, xs[k].data.ptr, in_bytes, 4, s.ptr)

        twin = bare_copy if W == 1 and mode == "out" and not kernel and not scales else None
        world.barrier()
        ms, host_us, copy_ms = _back_to_back_ms(call, s, calls=max(10, args.iters // 2),
                                                twin=twin)
        world.barrier()
        single = time_ms(lambda: call(0), warmup=3, iters=max(10, args.iters // 2), stream=s)
        op.synchronize()
        all_ms, all_single = world.allgather(ms), world.allgather(single)
        notes, count_calls = [], [0]

        def next_call():
            count_calls[0] += 1
            call(count_calls[0])

        # host_us of the regime replaces the GPU-queued loop's own (the same measure, alone)
        reg = measure_regimes(next_call, s, calls=regime_calls(max(all_ms), args.quick,
                                                               measured),
                              world=world, notes=notes, what="All2AllHeads")
        op.synchronize()
    if me != 0:
        return None
    moved = 2 * in_bytes  # read + written per rank (input and output have the same size)
    # bytes leaving each GPU a call: (W - 1) / W of the input (the other ranks' heads or
    # tokens), and with scales those of the tokens each peer receives
    sent = in_bytes * (W - 1) // W + (0 if sc is None else
                                      (W - 1) * sc[0].nbytes // (W if direction == "gather"
                                                                 else 1))
    return {"direction": direction, "B": B, "T": T_total, "H": H, "D": D, "dtype": dtype,
            "scales": scales, "mode": mode, "sent_bytes_per_gpu": sent,
            "case": f"{direction} B={B} T={T_total} H={H} D={D} {dtype}"
                    + (" +scales" if scales else "") + f" {mode}"
                    + (f" sms={num_sms}" if num_sms else "") + (" kernel" if kernel else "")
                    + ("" if pdl or W > 1 else " memcpy"),
            "cuflux_ms": max(all_ms), "single_ms": max(all_single),
            "host_bound": host_us > 1e3 * max(all_ms),
            "copy_ms": copy_ms, "ratio_to_copy": None if copy_ms is None else copy_ms / max(all_ms),
            "gbps_per_rank": moved / (max(all_ms) * 1e-3) / 1e9,
            "gbps_all_ranks": W * moved / (max(all_ms) * 1e-3) / 1e9,
            "queued_host_us": host_us, **reg, "notes": notes}


def _copy_row(args, B, T, H, D):
    """A plain device-to-device copy of the same bytes, timed the same way (W = 1 reference)."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        shape, nbytes = (B, T, H, D), B * T * H * D * 2
        count = max(2, -(-4 * L2_BYTES // nbytes))
        xs = [cupy.random.randint(0, 1 << 15, shape, dtype=cupy.uint16) for _ in range(count)]
        outs = [cupy.empty_like(xs[0]) for _ in range(count)]
    def copy(i):
        cupy.cuda.runtime.memcpyAsync(outs[i % count].data.ptr, xs[i % count].data.ptr, nbytes,
                                      4, s.ptr)

    ms, host_us, _ = _back_to_back_ms(copy, s, calls=max(10, args.iters // 2))
    notes, n = [], [0]

    def next_copy():
        n[0] += 1
        copy(n[0])

    reg = measure_regimes(next_copy, s, calls=regime_calls(ms, args.quick), notes=notes,
                          what="cudaMemcpyAsync")
    return {"case": f"cudaMemcpyAsync of the same bytes B={B} T={T} H={H} D={D} bf16",
            "cuflux_ms": ms, "queued_host_us": host_us, **reg, "notes": notes,
            "host_bound": host_us > 1e3 * ms,
            "gbps_per_rank": 2 * nbytes / (ms * 1e-3) / 1e9,
            "gbps_all_ranks": 2 * nbytes / (ms * 1e-3) / 1e9}


def _nccl_row(world, args, nccl, B, T_total, H, D):
    """NCCL all-to-all of the head groups plus the two permute copies (bf16 moved as uint16);
    nccl: (cupy.cuda.nccl, the communicator) of common.nccl_comm."""
    import cupy

    nccl, comm = nccl
    W, me = world.size, world.rank
    T, hpr = T_total // W, H // W
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.random.randint(0, 1 << 15, (B, T, H, D), dtype=cupy.uint16)
        send = cupy.empty((W, B, T, hpr, D), dtype=cupy.uint16)
        recv = cupy.empty_like(send)
        y = cupy.empty((B, W * T, hpr, D), dtype=cupy.uint16)
    chunk = B * T * hpr * D * 2

    def permuted_all_to_all():  # on the current stream (s: on_stream)
        send[...] = x.reshape(B, T, W, hpr, D).transpose(2, 0, 1, 3, 4)
        nccl.groupStart()
        for p in range(W):
            comm.send(send[p].data.ptr, chunk, nccl.NCCL_UINT8, p, s.ptr)
            comm.recv(recv[p].data.ptr, chunk, nccl.NCCL_UINT8, p, s.ptr)
        nccl.groupEnd()
        y.reshape(B, W, T, hpr, D)[...] = recv.transpose(1, 0, 2, 3, 4)

    call = on_stream(permuted_all_to_all, s)

    world.barrier()
    ms, _, _ = _back_to_back_ms(lambda _i: call(), s, calls=max(10, args.iters // 2))
    notes = []
    reg = measure_regimes(call, s, calls=regime_calls(max(world.allgather(ms)), args.quick),
                          world=world, prefix="baseline_", notes=notes,
                          what="NCCL all-to-all + permutes")
    ok = bool(cupy.all(y.reshape(B, W, T, hpr, D)[:, me] == x[:, :, me * hpr:(me + 1) * hpr]))
    return max(world.allgather(ms)), all(world.allgather(ok)), reg, notes


def run(world, args):
    W, me = world.size, world.rank
    shared_gpu = ranks_share_gpu(world)
    distinct = W > 1 and not shared_gpu
    measured = speed_measured(W, shared_gpu)
    ceiling = copy_bandwidth_gbps() if me == 0 else None
    world.barrier()
    rows = []
    bar = (1, 8192, 32, 128, "bfloat16")
    cases = [bar] if args.quick else [bar, (1, 32768, 32, 128, "bfloat16"),
                                      (2, 4096, 64, 80, "bfloat16")]
    for B, T, H, D, dt in cases:
        for direction in ("scatter", "gather"):
            for mode in ("owned", "out", "view"):
                rows.append(_case(world, args, B, T, H, D, dt, mode, direction,
                                  measured=measured))
    for direction in ("scatter", "gather"):
        rows.append(_case(world, args, 1, 8192, 32, 128, "float8_e4m3fn", "owned", direction,
                          scales=True, measured=measured))
    # The default num_sms (every SM) comes from this sweep (at W = 1: of the kernel).
    for sms in ((33, 66, 132, 264) if W == 1 else (33, 132)):
        rows.append(_case(world, args, *bar, "owned", "scatter", num_sms=sms, kernel=True,
                          measured=measured))
    if W == 1:
        rows.append(_copy_row(args, *bar[:4]))
        for direction in ("scatter", "gather"):  # the op's copy through cudaMemcpyAsync
            for mode in ("owned", "out"):
                rows.append(_case(world, args, *bar, mode, direction, pdl=False))
    extra = {"copy_ceiling_gbps": ceiling}
    if distinct:
        extra["link_gbps_one_way"] = peer_copy_gbps(world)
    nccl = nccl_comm(world, shared_gpu)  # W = 1 too: NCCL's one-rank all-to-all
    if nccl is not None:
        # beside the cases, T = 1024: a Ulysses layer of a short sequence (issue 17's
        # user-loop bar against NCCL is at that size)
        for B, T, H, D, _ in [(1, A2A_LOOP_TOKENS, 32, 128, "bfloat16")] + cases:
            nccl_ms, ok, nccl_reg, nccl_notes = _nccl_row(world, args, nccl, B, T, H, D)
            ours = _case(world, args, B, T, H, D, "bfloat16", "owned", "scatter")
            if me == 0:
                ours.update({"baseline": "nccl all-to-all + 2 permutes", "baseline_ms": nccl_ms,
                             "speedup": nccl_ms / ours["cuflux_ms"], "nccl_correct": ok,
                             "vs_nccl": True, **nccl_reg})
                add_note(ours, *nccl_notes)
                rows.append(ours)
    if me != 0:
        return None
    for r in rows:
        if distinct:  # every row's rate over the link, against the measured peer copy rate
            r["link_gbps_per_gpu"] = r["sent_bytes_per_gpu"] / (r["cuflux_ms"] * 1e-3) / 1e9
            if extra.get("link_gbps_one_way"):  # None: the link could not be timed
                r["fraction_of_link"] = r["link_gbps_per_gpu"] / extra["link_gbps_one_way"]
        r.setdefault("baseline", "d2d copy ceiling")
        if r["baseline"] == "d2d copy ceiling":
            # the copy moving the same bytes at the ceiling; with ranks sharing one GPU every
            # rank's bytes cross the same memory, so all ranks' bytes are compared
            moved = r["gbps_all_ranks"] * r["cuflux_ms"] * 1e-3 * 1e9
            r["baseline_ms"] = moved / (ceiling * 1e9) * 1e3
            r["speedup"] = r["baseline_ms"] / r["cuflux_ms"]
            r["fraction_of_copy"] = r["gbps_all_ranks"] / ceiling
            no_baseline_regimes(r, "baseline is the copy ceiling (computed, not a call): no "
                                   "baseline regimes")
        add_speedups(r)
        if not r.get("notes"):
            r.pop("notes", None)
    print(speed_header("all2all", W, shared_gpu))
    print(f"All2AllHeads, W={W}, device-to-device copy ceiling {ceiling:.0f} GB/s (read+write)"
          + (", ranks share one GPU" if W > 1 and not distinct else ""))
    cols = ["case", "cuflux_ms", "single_ms", "queued_host_us", "host_bound", "copy_ms",
            "ratio_to_copy", "gbps_per_rank", "gbps_all_ranks", "fraction_of_copy",
            "baseline_ms", "speedup"] + REGIME_COLS
    cols += ["link_gbps_per_gpu", "fraction_of_link"] if distinct else []
    print_bench_table(rows, cols, set(cols) - {"case"}, measured)
    path = write_results("all2all", W, rows, bench_extra(args, measured, **extra,
                                                         ranks_share_gpu=shared_gpu),
                         outdir=args.outdir)
    print("wrote", path)
    return path
