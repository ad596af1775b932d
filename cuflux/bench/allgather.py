"""AllGather benchmark: GB/s per rank against the measured device-to-device copy rate.

Each rank writes W shards into its output and reads them from W sources: 2 * W * shard bytes
of memory traffic per rank (counted like the copy ceiling, read + write). With ranks sharing
one GPU every byte crosses the same HBM, so the figure to compare with the ceiling is the sum
over ranks, W * 2 * W * shard bytes, over the slowest rank's time.
"""
from __future__ import annotations

from cuflux.bench.common import copy_bandwidth_gbps, print_table, time_ms, write_results


def run(world, args) -> None:
    import cupy

    import cuflux

    W, me = world.size, world.rank
    ceiling = copy_bandwidth_gbps() if me == 0 else None
    world.barrier()
    rows = []
    cols = 8192
    shard_rows_list = [1024, 8192] if args.quick else [128, 1024, 4096, 8192]
    for mode, wait in (("pull", "stream"), ("push", "stream"), ("pull", "kernel")):
        for shard_rows in shard_rows_list:
            with cuflux.AllGather(world, shard_rows, cols, "bfloat16", mode=mode,
                                  wait=wait) as ag:
                x = cupy.random.standard_normal((shard_rows, cols), dtype=cupy.float32).astype(
                    ag.dtype.storage)
                out = cupy.empty((W * shard_rows, cols), dtype=x.dtype)
                world.barrier()
                ms = time_ms(lambda: ag(x, out=out), warmup=5, iters=args.iters)
                ag.synchronize()
                shard_bytes = shard_rows * cols * 2
                # per rank: W shards land in its output (bytes written), read from W sources
                per_rank_gbps = 2 * W * shard_bytes / (ms * 1e-3) / 1e9
                all_ms = world.allgather(ms)
                if me == 0:
                    total_rw = 2 * W * W * shard_bytes / (max(all_ms) * 1e-3) / 1e9
                    rows.append({"case": f"{mode}/{wait}-wait shard {shard_rows}x{cols} bf16",
                                 "cuflux_ms": max(all_ms), "baseline": "d2d copy ceiling",
                                 "baseline_ms": 2 * W * W * shard_bytes / (ceiling * 1e9) * 1e3,
                                 "gbps_per_rank": per_rank_gbps,
                                 "gbps_total_rw": total_rw,
                                 "fraction_of_copy": total_rw / ceiling})
                    rows[-1]["speedup"] = rows[-1]["baseline_ms"] / rows[-1]["cuflux_ms"]
    if me == 0:
        print(f"AllGather, W={W}, device-to-device copy ceiling {ceiling:.0f} GB/s (read+write)")
        print_table(rows, ["case", "cuflux_ms", "gbps_per_rank", "gbps_total_rw",
                           "fraction_of_copy"])
        path = write_results("allgather", W, rows, {"copy_ceiling_gbps": ceiling},
                             outdir=args.outdir)
        print("wrote", path)
