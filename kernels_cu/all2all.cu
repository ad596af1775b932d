// all2all.cu — All2All of attention heads for Ulysses sequence parallelism (push, CUDA IPC).
//
// Problem. W ranks; rank r holds x_r [B, T_r, H, D] (token counts T_r may differ, may be 0);
// hpr = H / W heads per rank, S = sum(T), P_r = sum(T[:r]).
//   scatter: rank t receives heads [t*hpr, (t+1)*hpr) of every rank's tokens:
//            y_t [B, S, hpr, D], rank r's tokens at token offset P_r.
//   gather:  the inverse: y_t [B, S, hpr, D] on every t -> x_r [B, T_r, H, D], rank t's rows
//            landing in heads [t*hpr, (t+1)*hpr).
// A "row" is the hpr*D elements of one token and one head group: contiguous on both sides
// (row_bytes = hpr * D * itemsize), so a row is the unit of work. Optional fp32 scales (per token,
// or per token and head) are rows too (1 or hpr floats) and move the same way.
//
// Push model, two kernels per call on the caller's stream (one at W = 1):
//   a2a_push<V, gather>: the first L blocks copy this rank's own rows (a local copy at HBM
//     speed), the other R * (W - 1) serve the peers, R each, block L + i going to peer
//     (me + 1 + i % (W - 1)) % W (rank-offset order: the senders do not all hit one peer at
//     once). L is small (cuflux/ops/all2all.py deal_blocks): the link, not HBM, bounds the call,
//     so most blocks push. The blocks of one target cover its rows in a strided loop, V-byte
//     vectors (16, 8, 4, 2 or 1: the widest that row_bytes and the pointers allow),
//     kUnroll rows in flight per thread, any row width (a row wider than the block is looped).
//     Rows for t == me go straight to the caller's output (one pass over the data at W = 1);
//     rows for a peer go into the peer's receive slot through its IPC pointer, already in the
//     output's layout. Then each block raises its flag in the target's memory.
//   a2a_recv<V, gather> (W > 1): an assignment per (peer p, worker j) that dealt rows to us,
//     R per peer, over a grid of at most this rank's SMs. For each, the block waits (bounded,
//     acquire) for the flag of p's block j alone, checks the call hash p stored beside it,
//     then copies the rows that block pushed from our slot into the output (unless the caller
//     asked for a view of the slot): the same rows, the same split among workers (copy_rows:
//     independent of the vector width), recomputed from p's side (its RowMap with target =
//     us), so a chunk leaves the slot as soon as its own flag lands. Its waits are only on
//     flags the peers' a2a_push raises, and a2a_push never waits: on distinct GPUs, or ranks
//     time-slicing one, nothing can deadlock; ranks sharing a GPU concurrently (MPS) keep
//     SMs free for each other's a2a_push by the grid cap. The last block to finish completes
//     the call's epoch (sync.cuh count_out).
//   a2a_copy_w1 (W = 1, 16-byte aligned): input and output have the same layout: one pass, one
//     16-byte vector a thread, launched with programmatic dependent launch (below).
// Remote buffers: the peers' receive slots and flags are written; nothing remote is ever read.
// Reads are local only: x or y of the caller through the read-only path, our own slot (which
// peers write while a2a_recv runs) through coherent loads.
//
// Symmetric layout (built by cuflux/ops/all2all.py:build_layout, regions 128-byte aligned):
//   data0, data1    u8  [slot_bytes]          receive slots, batch*max_tokens*H*D*itemsize bytes
//   scale0, scale1  f32 [batch*max_tokens*H]  receive slots of the scales
//   flags           u32 [2][W][R][kFlagWords] flags[e % 2][p][j], 128 bytes each: words 0-1 = the
//                   u64 epoch of the call whose rows block j of sender p has written here, word
//                   2 = that call's hash; R = blocks each sender deals to each peer. 64-bit:
//                   the epoch lives on the device (nothing could re-arm under a replayed
//                   graph), and a slot of a block
//                   a small grid does not reach must never compare as reached, however long.
// Sync points. Double buffering instead of a start barrier: call e uses slot and flags e % 2.
//   The epoch lives in device memory (state = [calls completed, blocks finished], completed by
//   a2a_recv), so calls captured in a CUDA graph replay with fresh epochs.
//   Sender p writes our slot e % 2 only in call e, after its call e-1 has finished; that needed our
//   call e-1 flags, which our a2a_push(e-1) raised after everything earlier on our stream, our
//   a2a_recv of call e-2 (the last reader of slot e % 2) included. The op keeps all its calls in
//   one stream order (cuflux/ops/all2all.py joins streams when the caller changes stream).
//   End barrier: the epoch flags (block: data stores -> __syncthreads -> release; waiter: acquire).
#include <cuflux/sync.cuh>
#include <cuflux/vec.cuh>

namespace cuflux {
namespace a2a {

constexpr u32 kFlagWords = 32;      // one 128-byte flag slot per (sender, block)
constexpr u32 kHashWord = 2;        // after the u64 epoch
constexpr u32 kStatusMismatch = 3;  // error record status: a peer's call had other arguments
constexpr int kUnroll = 4;          // rows in flight per thread: enough bytes in flight for HBM
constexpr int kMaxThreads = 1024;

// Push: row r -> b = r / n_tok, tok = r % n_tok; source row b*src_b + tok*src_tok + src_col,
// destination row b*dst_b + tok*dst_tok + dst_col (in units of rows).
struct RowMap {
  u32 n_tok;
  u64 src_b, src_tok, src_col, dst_b, dst_tok, dst_col;
  __device__ __forceinline__ void operator()(u32 r, u64& src, u64& dst) const {
    const u32 b = r / n_tok, tok = r - b * n_tok;
    src = b * src_b + tok * src_tok + src_col;
    dst = b * dst_b + tok * dst_tok + dst_col;
  }
};

// This block's share (worker of num_workers) of num_rows rows of row_bytes bytes. Rows narrower
// than the block are packed several to a pass; wider ones are looped over by the whole block.
// Which worker takes which row depends only on row_bytes and the block size, never on kVec:
// a2a_recv on one rank must take exactly the rows a2a_push's worker took on another, and each
// rank picks its vector width from its own pointers (the split counts 16-byte pieces; a
// narrower kVec loops over more columns).
// kSrcWritten: src is written during the kernel's lifetime (a peer pushes into our slot while
// a2a_recv runs): coherent loads, after the acquire of the flag that published it; otherwise
// (the caller's input) the read-only path. A non-coherent load could be served a line that
// another block of this SM cached before the peer's rows in it landed (rows narrower than a
// line belong to several workers). (src is not __restrict__: that would let the compiler turn
// the coherent loads into read-only ones.)
template <int kVec, bool kSrcWritten = false, class Map>
__device__ __forceinline__ void copy_rows(const u8* src, u8* dst, u64 row_bytes,
                                          u32 num_rows, const Map& map, u32 worker,
                                          u32 num_workers) {
  const u32 vecs_per_row = static_cast<u32>(row_bytes / kVec);
  if (num_rows == 0 || vecs_per_row == 0) return;
  const u32 pieces = static_cast<u32>((row_bytes + 15) / 16);  // the split's unit, any kVec
  const u32 rows_per_pass = blockDim.x / min(blockDim.x, pieces);
  const u32 threads_per_row = blockDim.x / rows_per_pass;
  const u32 sub = threadIdx.x / threads_per_row, col0 = threadIdx.x % threads_per_row;
  if (sub >= rows_per_pass) return;  // the few threads that do not fill a whole row
  const u32 row_step = num_workers * rows_per_pass;
  for (u32 r0 = worker * rows_per_pass + sub; r0 < num_rows; r0 += kUnroll * row_step) {
    u64 src_off[kUnroll], dst_off[kUnroll];
    const u32 n = min(static_cast<u32>(kUnroll), (num_rows - r0 + row_step - 1) / row_step);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (k < n) {
        map(r0 + k * row_step, src_off[k], dst_off[k]);
        src_off[k] *= row_bytes;
        dst_off[k] *= row_bytes;
      }
    }
    for (u32 c = col0; c < vecs_per_row; c += threads_per_row) {
      const u64 col = static_cast<u64>(c) * kVec;
      RawVec<kVec> v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)  // all loads first: kUnroll requests in flight
        if (k < n) {
          if constexpr (kSrcWritten)
            v[k] = ld_plain<kVec>(src + src_off[k] + col);
          else
            v[k] = ld_nc<kVec>(src + src_off[k] + col);
        }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)
        if (k < n) st_na<kVec>(dst + dst_off[k] + col, v[k]);
    }
  }
}

}  // namespace a2a
}  // namespace cuflux

using namespace cuflux;
using namespace cuflux::a2a;

// src: x [B, T_me, H, D] (scatter) or y [B, S, hpr, D] (gather), local. src_scale: its scales
// ([B, T_me] or [B, T_me, H]; [B, S] or [B, S, hpr]) or null. local_dst / local_dst_scale: where
// this rank's own rows go (the output, or our slot for a view). bases: the W base pointers of the
// symmetric buffer; data_off / scale_off / flags_off: byte offsets of the slots and flags of
// parity 0 and 1. state[0]: the epoch of the last call completed on this rank (device memory, so
// a captured CUDA graph replays with fresh epochs); this call is e = state[0] + 1, parity e % 2.
// Nothing writes state before a2a_recv, which runs after this kernel on the stream.
// prefix: W+1 token prefix sums (device). scale_cols: floats per scale row (0: no scales);
// scale_per_head: scatter's source scales are [B, T_me, H] (else [B, T_me]).
template <int kVec, bool kGather>
__global__ void __launch_bounds__(kMaxThreads) a2a_push(
    const u8* __restrict__ src, const u8* __restrict__ src_scale, u8* local_dst,
    u8* local_dst_scale, const u64* __restrict__ bases, u64 data_off0, u64 data_off1,
    u64 scale_off0, u64 scale_off1, u64 flags_off0, u64 flags_off1, const u64* state,
    const int* __restrict__ prefix, u32 me, u32 world, u32 batch, u64 row_bytes, u32 scale_cols,
    u32 scale_per_head, u32 call_hash, u32 local_blocks, u32 remote_blocks,
    const u32* err_claim) {
  // A wait of this op gave up in an earlier call (sync.cuh op_gave_up): a peer may still read
  // the slot this call would write (its call of two before). Nothing is written; the host raises.
  // Both loads are issued before either is used: the check adds no round trip.
  const bool gave_up = world > 1 && op_gave_up(err_claim);
  const u64 epoch = call_epoch(state);
  if (gave_up) return;
  // The deal (the header): blocks [0, L) on our own rows, then R blocks per peer.
  const bool local = blockIdx.x < local_blocks;
  const u32 i = blockIdx.x - local_blocks;
  const u32 t = local ? me : (me + 1 + i % (world - 1)) % world;
  const u32 worker = local ? blockIdx.x : i / (world - 1);
  const u32 num_workers = local ? local_blocks : remote_blocks;
  const bool odd = epoch & 1u;
  const u64 data_off = odd ? data_off1 : data_off0, scale_off = odd ? scale_off1 : scale_off0;
  const u64 flags_off = odd ? flags_off1 : flags_off0;
  const u64 S = static_cast<u32>(prefix[world]);
  RowMap map;
  if (kGather) {  // y_me rows (b, P_t + tok) -> x_t rows (b, tok), head group me
    const u32 n_tok = prefix[t + 1] - prefix[t];
    map = {n_tok, S, 1, static_cast<u64>(prefix[t]), static_cast<u64>(n_tok) * world, world, me};
  } else {  // x_me rows (b, tok), head group t -> y_t rows (b, P_me + tok)
    const u32 n_tok = prefix[me + 1] - prefix[me];
    map = {n_tok, static_cast<u64>(n_tok) * world, world, t, S, 1, static_cast<u64>(prefix[me])};
  }
  const u32 num_rows = batch * map.n_tok;
  u8* dst = t == me ? local_dst : reinterpret_cast<u8*>(bases[t] + data_off);
  copy_rows<kVec>(src, dst, row_bytes, num_rows, map, worker, num_workers);
  if (scale_cols != 0) {
    RowMap smap = map;
    if (!kGather && !scale_per_head) {  // one scale per token, the same for every head group
      smap.src_b = map.n_tok;
      smap.src_tok = 1;
      smap.src_col = 0;
    }
    u8* sdst = t == me ? local_dst_scale : reinterpret_cast<u8*>(bases[t] + scale_off);
    copy_rows<4>(src_scale, sdst, 4ull * scale_cols, num_rows, smap, worker, num_workers);
  }
  if (t == me) return;  // own rows are ordered before their readers by the stream
  // Every thread's stores happen before the barrier; thread 0's release (after a system fence)
  // then makes them visible to the target before it can observe the flag.
  __syncthreads();
  if (threadIdx.x == 0) {
    u32* flag = reinterpret_cast<u32*>(bases[t] + flags_off) +
                (static_cast<u64>(me) * remote_blocks + worker) * kFlagWords;
    fence_acq_rel_sys();
    st_relaxed_sys(flag + kHashWord, call_hash);
    st_release_sys(reinterpret_cast<u64*>(flag), epoch);
  }
}

// Assignment i of (W - 1) * R: peer p = (me - 1 - i % (W - 1)) mod W, its worker j = i / (W - 1)
// (the peer that dealt to us in its first remote block comes first); block b takes the
// assignments b, b + G, ... of a grid of G <= (W - 1) * R blocks (cuflux/ops/all2all.py caps G
// at the SMs this rank may take: under MPS, ranks' waiting grids must leave room for the
// peers' a2a_push). flags0 / flags1: our flags of parity 0 / 1, [W][R][kFlagWords]; slot0 /
// slot1 (scale0 / scale1): our receive slots; out / out_scale: the caller's output, or null
// (copy == 0: a view of the slot was asked for, the block only waits). The call is
// e = state[0] + 1, parity e % 2. On a timeout or a hash mismatch the block records who (the
// host raises) and copies nothing more; every block counts out either way, so a failed call
// completes too (the op is failed for good).
template <int kVec, bool kGather>
__global__ void __launch_bounds__(kMaxThreads) a2a_recv(
    const u32* flags0, const u32* flags1, const u8* slot0, const u8* slot1,
    const u8* slot_scale0, const u8* slot_scale1, u8* out, u8* out_scale, u64* state,
    const int* __restrict__ prefix, u32 me, u32 world, u32 batch, u64 row_bytes,
    u32 scale_cols, u32 copy, u32 remote_blocks, u32 call_hash, u32* err, u32* err_claim,
    u64 timeout_ns, u32 op) {
  __shared__ int s_ok;
  const u64 epoch = call_epoch(state);
  const bool odd = epoch & 1u;
  const u32 assignments = (world - 1) * remote_blocks;
  bool ok = true;  // the same in every thread (from s_ok)
  for (u32 i = blockIdx.x; i < assignments && ok; i += gridDim.x) {
    const u32 k = i % (world - 1), j = i / (world - 1);
    const u32 p = (me + world - 1 - k) % world;
    const u32 index = p * remote_blocks + j;  // the flag's, as the error record names it
    if (threadIdx.x == 0) {
      const WaitSite site{err, err_claim, timeout_ns, op, me};
      const u32* flag = (odd ? flags1 : flags0) + static_cast<u64>(index) * kFlagWords;
      bool got = wait_flag_acquire(reinterpret_cast<const u64*>(flag), epoch, site, p, index);
      if (got) {
        const u32 hash = ld_relaxed_sys(flag + kHashWord);  // after the acquire: p's call e hash
        if (hash != call_hash) {
          record_error(site, kStatusMismatch, p, hash, call_hash, index);
          got = false;
        }
      }
      s_ok = got;
    }
    __syncthreads();  // thread 0's acquire precedes every thread's loads of the slot
    ok = s_ok;
    if (ok && copy) {
      // p's RowMap for target me (a2a_push), read on the destination side only: the rows sit
      // in our slot exactly where they go in the output.
      RowMap map;
      if constexpr (kGather) {  // p's y rows (b, P_me + tok) -> our x rows (b, tok), group p
        const u32 n_tok = prefix[me + 1] - prefix[me];
        const u64 wt = static_cast<u64>(n_tok) * world;
        map = {n_tok, wt, world, p, wt, world, p};
      } else {  // p's x rows (b, tok), head group me -> our y rows (b, P_p + tok)
        const u32 n_tok = prefix[p + 1] - prefix[p];
        const u64 S = static_cast<u32>(prefix[world]), at = static_cast<u64>(prefix[p]);
        map = {n_tok, S, 1, at, S, 1, at};
      }
      const u32 num_rows = batch * map.n_tok;
      copy_rows<kVec, true>(odd ? slot1 : slot0, out, row_bytes, num_rows, map, j, remote_blocks);
      if (scale_cols != 0)
        copy_rows<4, true>(odd ? slot_scale1 : slot_scale0, out_scale, 4ull * scale_cols,
                           num_rows, map, j, remote_blocks);
    }
    __syncthreads();  // s_ok is rewritten by the next assignment's wait
  }
  count_out(state, epoch);  // sync.cuh: the last block completes the call's epoch
}

// W = 1: the whole call is one copy of n_vec 16-byte vectors (input and output have the same
// layout). Launched with programmatic stream serialisation (cuflux/kernels.py, pdl=True): its
// CTAs may be resident before the kernel ahead of it on the stream ends; griddepcontrol.wait
// holds them until that kernel has completed and its writes are visible. Back to back this
// hides the gap between kernels that cudaMemcpyAsync pays: 0.95 of the 2 GiB copy rate at
// 64 MiB against 0.89 (scripts/probe_pdl.py, scripts/results/probe_pdl-h200-2026-11-29.txt).
// Loads stay plain (not ld.global.nc): the kernel ahead may still be writing src when this
// grid starts, and .nc needs data read-only for the grid's whole lifetime.
extern "C" __global__ void __launch_bounds__(256) a2a_copy_w1(const uint4* src, uint4* dst,
                                                             u64 n_vec) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n_vec) dst[i] = src[i];
}
