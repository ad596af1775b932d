// cuflux/ag_hooks.cuh — the prologue hook of AllGather + GEMM (kernels_cu/ag_gemm.cu): before a
// tile's A rows are loaded, wait (bounded, acquire) until every gathered chunk they come from
// has landed in this rank's gathered buffer.
//
// Gathered A [W * rows_per_rank, K]: rank p's shard is rows [p * rows_per_rank, (p + 1) *
// rows_per_rank), split into chunks of chunk_rows rows (the last one shorter). Chunk c of rank
// p has landed once flags[p * max_chunks + c] reached `epoch` (cuflux/ops/allgather.py, region
// "chunk" [W, max_chunks] of this rank's symmetric buffer). Whoever delivers the chunk raises
// the flag after the copy, on the copy's stream (cuStreamWriteValue32, which orders the copied
// bytes before the flag): in pull mode this rank's own copy streams, in push mode the sender's,
// remotely. The flags always live in this rank's memory, so the wait is a local poll.
//
// A tile's rows may straddle two ranks' shards and several chunks (rows_per_rank and chunk_rows
// need not be multiples of the tile): every chunk overlapping [row_begin, row_end) is waited on.
// On timeout the first waiter records (op, rank, peer = source rank, flag index) in the op's
// error record and every later wait of the op returns at once (sync.cuh, op_failed).
#pragma once
#include <cuflux/sync.cuh>

namespace cuflux {
namespace ag {

struct GatheredChunkWait {
  static constexpr bool kWaits = true;
  const u32* flags;   // this rank's chunk flags, [W][max_chunks]
  int max_chunks;     // words between two ranks' flag rows
  int rows_per_rank;  // rows of each shard in this call (>= 1)
  int chunk_rows;     // rows per chunk (>= 1)
  u32 epoch;          // this call's epoch
  WaitSite site;

  // One thread. True when every chunk covering the rows has landed.
  __device__ __forceinline__ bool wait_rows(int row_begin, int row_end) const {
    if (row_end <= row_begin) return true;
    bool ok = true;
    const int first_src = row_begin / rows_per_rank, last_src = (row_end - 1) / rows_per_rank;
    for (int src = first_src; src <= last_src; ++src) {
      const int base = src * rows_per_rank;  // shard-local rows [lo, hi) of this source
      const int lo = max(row_begin, base) - base;
      const int hi = min(row_end, base + rows_per_rank) - base;
      for (int c = lo / chunk_rows; c <= (hi - 1) / chunk_rows; ++c) {
        const u32 index = static_cast<u32>(src) * static_cast<u32>(max_chunks) + c;
        ok = wait_flag_acquire(flags + index, epoch, site, static_cast<u32>(src), index) && ok;
      }
    }
    return ok;
  }
};

}  // namespace ag
}  // namespace cuflux
