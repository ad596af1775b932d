"""AllGather benchmark: GB/s per rank against the measured device-to-device copy rate.

Each rank writes W shards into its output and reads them from W sources: 2 * W * shard bytes
of memory traffic per rank (counted like the copy ceiling, read + write). With ranks sharing
one GPU every byte crosses the same HBM, so the figure to compare with the ceiling is the sum
over ranks, W * 2 * W * shard bytes, over the slowest rank's time.

Regimes (cuflux.bench.__main__.REGIMES_DOC): cuflux_ms is GPU-queued (calls enqueued back to
back between CUDA events, GPU time per call, the slowest rank's median); baseline_ms is not a
call but the copy ceiling's time for the same bytes. Beside them, for the op:
  user_loop_ms   back-to-back calls from Python, nothing held, wall time per call
  host_us        host time per call alone
  graph_ms       a graph of N calls replayed (None at W > 1 on the copy path, which refuses
                 capture there; the "sm" rows, path="sm", are captured)
The baseline's regime columns are None (a ceiling has no host path; "notes" says so).
With ranks sharing one GPU the ops run for correctness only ("speed_measured": false).
"""
from __future__ import annotations

from cuflux.bench.__main__ import (REGIME_COLS, add_note, add_speedups, bench_extra,
                                   measure_regimes, no_baseline_regimes, on_stream,
                                   print_bench_table, regime_calls, speed_header, speed_measured)
from cuflux.bench.common import copy_bandwidth_gbps, ranks_share_gpu, time_ms, write_results


def run(world, args):
    import cupy

    import cuflux

    W, me = world.size, world.rank
    shared_gpu = ranks_share_gpu(world)
    measured = speed_measured(W, shared_gpu)
    stream = cupy.cuda.Stream(non_blocking=True)
    iters = args.iters if measured else min(args.iters, 5)  # shared GPU: correctness only
    ceiling = copy_bandwidth_gbps() if me == 0 else None
    world.barrier()
    rows = []
    cols = 8192
    shard_rows_list = [1024, 8192] if args.quick else [128, 1024, 4096, 8192]
    for mode, wait, path in (("pull", "stream", "copy"), ("push", "stream", "copy"),
                             ("pull", "kernel", "copy"), ("pull", "stream", "sm")):
        for shard_rows in shard_rows_list:
            with cuflux.AllGather(world, shard_rows, cols, "bfloat16", mode=mode, wait=wait,
                                  path=path) as ag:
                x = cupy.random.standard_normal((shard_rows, cols), dtype=cupy.float32).astype(
                    ag.dtype.storage)
                out = cupy.empty((W * shard_rows, cols), dtype=x.dtype)
                world.barrier()
                ms = time_ms(lambda: ag(x, out=out), warmup=5, iters=iters)
                ag.synchronize()
                shard_bytes = shard_rows * cols * 2
                # per rank: W shards land in its output (bytes written), read from W sources
                per_rank_gbps = 2 * W * shard_bytes / (ms * 1e-3) / 1e9
                all_ms = world.allgather(ms)
                notes = []
                reg = measure_regimes(on_stream(lambda: ag(x, out=out), stream), stream,
                                      calls=regime_calls(max(all_ms), args.quick, measured),
                                      world=world, notes=notes, what="AllGather")
                ag.synchronize()
                if me == 0:
                    total_rw = 2 * W * W * shard_bytes / (max(all_ms) * 1e-3) / 1e9
                    how = "sm path" if path == "sm" else f"{mode}/{wait}-wait"
                    rows.append({"case": f"{how} shard {shard_rows}x{cols} bf16",
                                 "cuflux_ms": max(all_ms), "baseline": "d2d copy ceiling",
                                 "baseline_ms": 2 * W * W * shard_bytes / (ceiling * 1e9) * 1e3,
                                 "gbps_per_rank": per_rank_gbps,
                                 "gbps_total_rw": total_rw,
                                 "fraction_of_copy": total_rw / ceiling})
                    rows[-1]["speedup"] = rows[-1]["baseline_ms"] / rows[-1]["cuflux_ms"]
                    rows[-1].update(reg)
                    no_baseline_regimes(rows[-1], "baseline is the copy ceiling (computed, "
                                                  "not a call): no baseline regimes")
                    add_note(add_speedups(rows[-1]), *notes)
    if me != 0:
        return None
    print(speed_header("allgather", W, shared_gpu))
    print(f"AllGather, W={W}, device-to-device copy ceiling {ceiling:.0f} GB/s (read+write)")
    table = ["case", "cuflux_ms", "gbps_per_rank", "gbps_total_rw", "fraction_of_copy",
             "user_loop_ms", "host_us", "graph_ms"]
    print_bench_table(rows, table, set(table[1:]) | set(REGIME_COLS), measured)
    path = write_results("allgather", W, rows, bench_extra(
        args, measured, copy_ceiling_gbps=ceiling, ranks_share_gpu=shared_gpu),
        outdir=args.outdir)
    print("wrote", path)
    return path
