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
// Push model, up to three kernels per call on the caller's stream:
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
//   a2a_wait (one block, W > 1): bounded acquire-waits on the flags of every peer block dealt to
//     this rank, and checks the call hash each sender stored beside its flag.
//   a2a_copy_out<V> (W > 1, unless the caller asked for a view of the slot): copies the peers'
//     rows from our slot into the output. It has no waits (it runs after a2a_wait on the stream),
//     so no grid size can deadlock against peers that share the GPU.
//   a2a_copy_w1 (W = 1, 16-byte aligned): input and output have the same layout: one pass, one
//     16-byte vector a thread, launched with programmatic dependent launch (below).
// Remote buffers: the peers' receive slots and flags are written; nothing remote is ever read.
// Reads are local only (x or y of the caller, our own slot) and use the read-only path.
//
// Symmetric layout (built by cuflux/ops/all2all.py:build_layout, regions 128-byte aligned):
//   data0, data1    u8  [slot_bytes]          receive slots, batch*max_tokens*H*D*itemsize bytes
//   scale0, scale1  f32 [batch*max_tokens*H]  receive slots of the scales
//   flags           u32 [2][W][R][kFlagWords] flags[e % 2][p][j], 128 bytes each: words 0-1 = the
//                   u64 epoch of the call whose rows block j of sender p has written here, word
//                   2 = that call's hash; R = blocks each sender deals to each peer. 64-bit: the epoch lives on the
//                   device (nothing could re-arm under a replayed graph), and a slot of a block
//                   a small grid does not reach must never compare as reached, however long.
// Sync points. Double buffering instead of a start barrier: call e uses slot and flags e % 2.
//   The epoch lives in device memory (state[0], completed by a2a_wait), so calls captured in a
//   CUDA graph replay with fresh epochs.
//   Sender p writes our slot e % 2 only in call e, after its call e-1 has finished; that needed our
//   call e-1 flags, which our a2a_push(e-1) raised after everything earlier on our stream, our
//   copy-out of call e-2 (the last reader of slot e % 2) included. The op keeps all its calls in
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

// Copy-out: the rows of our slot that came from peers, at the same place in slot and output:
// r -> outer o = r / n_keep, k = r % n_keep, inner i = k < skip_at ? k : k + skip_len (our own
// rows, written straight to the output by a2a_push, are skipped), row o*(n_keep+skip_len) + i.
//   scatter: n_keep = S - T_me, skip_at = P_me, skip_len = T_me  (outer = batch, inner = token)
//   gather:  n_keep = W - 1,    skip_at = me,   skip_len = 1 (outer = batch*token, inner = rank)
struct SkipMap {
  u32 n_keep, skip_at, skip_len;
  __device__ __forceinline__ void operator()(u32 r, u64& src, u64& dst) const {
    const u32 o = r / n_keep, k = r - o * n_keep;
    const u32 i = k < skip_at ? k : k + skip_len;
    src = dst = static_cast<u64>(o) * (n_keep + skip_len) + i;
  }
};

// This block's share (worker of num_workers) of num_rows rows of row_bytes bytes. Rows narrower
// than the block are packed several to a pass; wider ones are looped over by the whole block.
template <int kVec, class Map>
__device__ __forceinline__ void copy_rows(const u8* __restrict__ src, u8* dst, u64 row_bytes,
                                          u32 num_rows, const Map& map, u32 worker,
                                          u32 num_workers) {
  const u32 vecs_per_row = static_cast<u32>(row_bytes / kVec);
  if (num_rows == 0 || vecs_per_row == 0) return;
  const u32 threads_per_row = min(blockDim.x, vecs_per_row);
  const u32 rows_per_pass = blockDim.x / threads_per_row;
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
        if (k < n) v[k] = ld_nc<kVec>(src + src_off[k] + col);
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
// Nothing writes state before a2a_wait, which runs after this kernel on the stream.
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

// One block. flags0 / flags1: our flags of parity 0 / 1, [W][R][kFlagWords]; this call's are
// parity e % 2, e = state[0] + 1. Waits for the R blocks each peer dealt to us; on timeout or a
// hash mismatch records who and stops waiting (the host raises). Last, it completes the call's
// epoch (state[0] = e): a2a_copy_out, after it on the stream, reads the parity from there.
extern "C" __global__ void a2a_wait(const u32* flags0, const u32* flags1, u64* state, u32 me,
                                    u32 world, u32 remote_blocks, u32 call_hash, u32* err,
                                    u32* err_claim,
                                    u64 timeout_ns, u32 op) {
  __shared__ u64 s_epoch;
  __shared__ volatile int s_failed;
  if (threadIdx.x == 0) {
    s_epoch = call_epoch(state);
    s_failed = 0;
  }
  __syncthreads();
  const u64 epoch = s_epoch;
  const u32* flags = (epoch & 1u) ? flags1 : flags0;
  const WaitSite site{err, err_claim, timeout_ns, op, me};
  const u32 R = remote_blocks;
  for (u32 i = threadIdx.x; i < world * R && !s_failed; i += blockDim.x) {
    const u32 p = i / R, j = i % R;
    if (p == me) continue;
    const u32* flag = flags + (static_cast<u64>(p) * R + j) * kFlagWords;
    if (!wait_flag_acquire(reinterpret_cast<const u64*>(flag), epoch, site, p, i)) {
      s_failed = 1;
      break;
    }
    const u32 hash = ld_relaxed_sys(flag + kHashWord);  // after the acquire: the sender's hash of call e
    if (hash != call_hash) {
      record_error(site, kStatusMismatch, p, hash, call_hash, i);
      s_failed = 1;
      break;
    }
  }
  // Every thread has read the epoch (above); a failed call completes too: the op is failed for
  // good and the host refuses further calls.
  __syncthreads();
  if (threadIdx.x == 0) state[0] = epoch;
}

// Copy the peers' rows (and scale rows) from our slot into the output; see SkipMap. The call's
// slot is parity state[0] % 2 (a2a_wait, ahead on the stream, completed the call's epoch).
template <int kVec>
__global__ void __launch_bounds__(kMaxThreads) a2a_copy_out(
    const u8* slot0, const u8* slot1, u8* out, u64 row_bytes, const u8* slot_scale0,
    const u8* slot_scale1, u8* out_scale, u64 scale_row_bytes, const u64* state, u32 num_rows,
    u32 n_keep, u32 skip_at, u32 skip_len) {
  const bool odd = *reinterpret_cast<const volatile u64*>(state) & 1u;
  const u8* __restrict__ slot = odd ? slot1 : slot0;
  const u8* __restrict__ slot_scale = odd ? slot_scale1 : slot_scale0;
  const SkipMap map{n_keep, skip_at, skip_len};
  copy_rows<kVec>(slot, out, row_bytes, num_rows, map, blockIdx.x, gridDim.x);
  if (scale_row_bytes != 0)
    copy_rows<4>(slot_scale, out_scale, scale_row_bytes, num_rows, map, blockIdx.x, gridDim.x);
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
