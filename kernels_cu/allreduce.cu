// allreduce.cu — AllReduce, and AllReduce + residual add + RMSNorm fused, over P2P pushes.
//
// Problem. Every rank holds x [rows, cols] of partial sums (a row-parallel GEMM's output).
//   kPlain (AllReduce):  out[t] = sum_r x_r[t]. The flat array is viewed as rows of `cols`
//                        elements; the last row may be short (num_elems bounds every access).
//   norm modes:          h = sum_r x_r[t] + residual[t]; residual[t] <- h;
//                        out[t] = h * rsqrt(mean(h^2) + eps) * weight      (fp32 inside)
//     kReplicated        out [T, H] and residual [T, H] for every row, on every rank (vLLM TP);
//     kShardedResidual   out [T, H] for every row; residual [T, H] read and written only on this
//                        rank's slice rows (TokenWeave);
//     kSequenceParallel  out and residual [n_slice, H]: this rank's slice only (Megatron SP).
//   The two halves of a two-shot kPlain call, for an op that works on the reduced slice in
//   between (AllReduceAcrossNodes: a rail all-reduce across nodes, cuflux/ops/across.py):
//     kReduceScatter     tmp_out holds this rank's slice of the sum (out is not written);
//     kAllGather         out [T] = every rank's tmp_out slice, this rank's included (x unused).
//   The second half runs with the first's epoch (no count of its own), so a call of the op is
//   one epoch whether it runs whole or in halves.
// Token slices: rank r owns rows [r*base + min(r, rem), that + base + (r < rem)), base = T / W,
// rem = T % W (cuflux/ops/allreduce.py token_slice is the same formula).
// Sums run in fp32 in rank order 0..W-1 on every rank, and a row is normalised by one block of
// a fixed shape, so every rank gets bit-identical results and runs repeat exactly.
//
// Push model. Data crosses the link only as posted stores into the receiver's symmetric memory
// (a load from a peer waits a whole round trip, so pulling needs far more bytes in flight to
// fill the link: issue 16 measured a 32-block pull at ~90 GB/s of ~395); every load is local.
// Each block pushes the rows the same block of each peer will reduce into that peer's stage
// slot for this rank, then releases its START flag there. No peer atomics (they fail over
// PCIe) and no CAS round trips.
//
// Symmetric buffer of one op (byte offsets come from the Python Layout, 128-byte aligned):
//   stage[2][W-1][slot]   what peers pushed, by call parity (epoch & 1), then by sender: slot
//                         j of rank q holds sender (q + 1 + j) % W's rows. One-shot rows sit
//                         at their global offset in the slot, two-shot rows at their offset
//                         within the receiver's slice (slot: cuflux/ops/allreduce.py stage_slot)
//   tmp_out[max_elems]    two-shot: finished rows of every rank's slice, pushed by their owner
//   tmp_res[max_elems]    two-shot replicated: new residual rows, the same way
//   start[max_blocks][stride], mid[max_blocks][stride]   u64 epochs; slot [b][p] lives in the
//                         memory of the rank that waits and is written by rank p's block b.
//                         64-bit: a block slot the grid does not reach goes unwritten for as
//                         long as calls stay small, and must never compare as reached. start
//                         holds e * kChunkSlots + chunk + 1 (pipelined START, below), mid e.
//
// One-shot (small T). Block b of a G-block grid owns rows t = b (mod G) of all T rows.
//   push those rows to every peer -> START barrier -> reduce them from x and our slots,
//   normalise, write out/residual locally.                                  (1 barrier)
// Two-shot. Block b owns rows (t - slice_start) = b (mod G) of this rank's slice, and pushes,
//   to every peer q, the rows of q's slice that q's block b will reduce.
//   push -> START barrier -> reduce own slice rows, write out/residual locally and push them
//   into every peer's tmp_out/tmp_res -> MID barrier -> copy the rows = b of every peer's
//   slice from our own tmp into out/residual.
//   kSequenceParallel stops before MID (no all-gather).                    (2 barriers)
// START is pipelined: a block splits its rows into up to kChunkSlots chunks (the same split of
// every slice on every rank), pushes chunk c and releases START with e * kChunkSlots + c + 1,
// then waits for that value minus one from every peer (their chunk c - 1) and reduces chunk
// c - 1 while chunk c's stores drain. START(e) below is the first of these waits.
//
// Why these barriers suffice (calls of one op are stream-ordered on every rank):
//   * START(e, c) releases the rows of chunk c this block pushed into the peer's stage in call
//     e (and, its values only growing, every chunk before); MID(e) the rows it pushed into the
//     peer's tmp. The values of call e exceed every value of call e-1 (at most e*kChunkSlots).
//   * A block passing any barrier of call e has heard from every peer's kernel e, so every
//     peer's kernel e-1 is complete. Hence, in call e: pushing into a peer's stage[e & 1] is
//     safe (its last reader, the peer's kernel e-2, is complete because this rank's kernel e-1
//     met every peer) and pushing into its tmp after START(e) is safe (its reader was the
//     peer's kernel e-1). No end barrier.
//   * Halves: the same with "kernel e" read as "the first half of call e". The first half
//     pushes no tmp; it leaves this rank's share of the sum in its own tmp_out (the slice's
//     rows, which no peer writes), where its stream may rewrite it in place; the second half
//     pushes that slice into every peer's tmp_out, raises MID(e), and copies every slice, its
//     own included, from its own tmp_out into out.
// Epochs live in device memory (state[0] = calls completed; the last block to finish bumps
// it), so calls can be captured in a CUDA graph and replayed. Every wait is bounded
// (cuflux/sync.cuh); on timeout the block records who it waited for and skips to the end.
// World size is a run-time value. W = 1 needs no staging and no flag: the op then launches
// rmsnorm_local_reg / rmsnorm_local (end of file: one pass over x, residual and weight), also
// used alone as the norm kernel of the unfused baseline.
#include <cuflux/reduce.cuh>
#include <cuflux/sync.cuh>
#include <cuflux/vec.cuh>

namespace cuflux {
namespace ar {

enum : int { kPlain = 0, kReplicated = 1, kShardedResidual = 2, kSequenceParallel = 3,
             kReduceScatter = 4, kAllGather = 5 };
// Modes that add a residual and normalise (the others only sum).
constexpr bool is_norm(int mode) { return mode >= kReplicated && mode <= kSequenceParallel; }
// Rank loads of one vector issued before any is added (W > 1). They are local since the push:
// 4 in flight suffice, and 8 made every 16-byte kernel spill under the 64-register cap of
// 1024-thread blocks (ptxas -v).
constexpr int kLoadBatch = 4;
constexpr int kCopyBatch = 4;  // vectors per thread in flight in row copies
// A call's rows, per block, go in up to kChunkSlots chunks of at least kRowsPerChunk rows: the
// block pushes chunk c, releases START with value e * kChunkSlots + c + 1, then waits for the
// peers' chunk c - 1 and reduces it while chunk c's stores drain (the push and the reduction
// overlap instead of running one after the other).
constexpr int kChunkSlots = 8;
constexpr int kRowsPerChunk = 4;
constexpr int kAllIters = 0x7fffffff;  // an iteration range with no upper end

struct Slice {
  int start, stop;
};
__device__ __forceinline__ Slice token_slice(int rows, int world_size, int r) {
  const int base = rows / world_size, rem = rows % world_size;
  const int start = r * base + min(r, rem);
  return {start, start + base + (r < rem ? 1 : 0)};
}

template <typename T, int kBytes>
__device__ __forceinline__ void add_to(float (&acc)[kBytes / sizeof(T)], const RawVec<kBytes>& r) {
  const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
  for (int j = 0; j < int(kBytes / sizeof(T)); ++j) acc[j] += to_float<T>(e[j]);
}

// h = 0 + a + b in fp32, in that order (the W = 1 norm's residual sum, bit-identical each time
// it is recomputed).
template <typename T, int kBytes>
__device__ __forceinline__ void sum_of(float (&h)[kBytes / sizeof(T)], const RawVec<kBytes>& a,
                                       const RawVec<kBytes>& b) {
#pragma unroll
  for (int j = 0; j < int(kBytes / sizeof(T)); ++j) h[j] = 0.0f;
  add_to<T, kBytes>(h, a);
  add_to<T, kBytes>(h, b);
}

template <typename T, int kBytes>
__device__ __forceinline__ RawVec<kBytes> pack_from(const float (&v)[kBytes / sizeof(T)]) {
  RawVec<kBytes> r;
  T* e = reinterpret_cast<T*>(&r);
#pragma unroll
  for (int j = 0; j < int(kBytes / sizeof(T)); ++j) e[j] = from_float<T>(v[j]);
  return r;
}

// Copy the rows t = s.start + b + i*G (it0 <= i < it1, t < s.stop) from src (indexed by
// global row) to dst (indexed by global row, less dst_shift elements: a stage slot of slice
// rows), kCopyBatch vectors per thread in flight. kSrcLocal: src is the caller's read-only
// input (non-coherent path); else memory written during the kernel (coherent loads).
template <typename T, int kBytes, bool kSrcLocal>
__device__ __forceinline__ void copy_rows(T* dst, const T* src, Slice s, int cols,
                                          long long num_elems, long long dst_shift = 0,
                                          int it0 = 0, int it1 = kAllIters) {
  constexpr int kElems = kBytes / sizeof(T);
  const int first = s.start + blockIdx.x + it0 * static_cast<int>(gridDim.x);
  if (first >= s.stop || it1 <= it0) return;
  // 32-bit indices: the op keeps max_elems < 2^31 (cuflux/ops/allreduce.py).
  const int num_rows = min((s.stop - first + static_cast<int>(gridDim.x) - 1) /
                               static_cast<int>(gridDim.x), it1 - it0);
  const int vecs_per_row = cols / kElems;
  const int total = num_rows * vecs_per_row;
  for (int i0 = threadIdx.x; i0 < total; i0 += blockDim.x * kCopyBatch) {
    RawVec<kBytes> buf[kCopyBatch];
    long long off[kCopyBatch];
#pragma unroll
    for (int k = 0; k < kCopyBatch; ++k) {
      const int i = i0 + k * blockDim.x;
      const int r = i / vecs_per_row;
      off[k] = static_cast<long long>(first + r * gridDim.x) * cols +
               static_cast<long long>(i - r * vecs_per_row) * kElems;
      if (i < total && off[k] < num_elems)
        buf[k] = kSrcLocal ? ld_nc<kBytes>(src + off[k]) : ld_plain<kBytes>(src + off[k]);
      else
        off[k] = -1;
    }
#pragma unroll
    for (int k = 0; k < kCopyBatch; ++k)
      if (off[k] >= 0) st_na<kBytes>(dst + (off[k] - dst_shift), buf[k]);
  }
}

// Store v at element off of region region_off in every peer's symmetric memory (from rank
// me + 1 on: the peers are not all hit at once).
template <typename T, int kVecBytes>
__device__ __forceinline__ void push_to_peers(const u64* s_base, u64 region_off, long long off,
                                              const RawVec<kVecBytes>& v, int W, int me) {
  for (int i = 1; i < W; ++i)
    st_na<kVecBytes>(reinterpret_cast<T*>(s_base[(me + i) % W] + region_off) + off, v);
}

// Phase 1 for the rows t = s.start + blockIdx.x + i*gridDim.x (it0 <= i < it1) of slice s:
// sum rank 0..W-1's row (this rank's from x, peer p's from the byte address s_src[p] +
// element offset * size, our own stage slot for p), then either store the sum (kPlain) or add
// the residual, store it back, and normalise with one block reduction per row. publish: also
// push finished rows into every peer's tmp_out (and the new residual into its tmp_res) for the
// two-shot all-gather. kBatch: rank loads in flight per vector; 1 for the local kernel
// (W = 1), which keeps it at few registers, hence full occupancy.
template <typename T, int kVecBytes, int kMode, int kBatch>
__device__ __forceinline__ void reduce_rows(
    const T* __restrict__ x, T* __restrict__ out, T* __restrict__ residual,
    const T* __restrict__ weight, const u64* s_src, const u64* s_base, u64 tmp_out_off,
    u64 tmp_res_off, bool publish, Slice s, int cols, long long num_elems, int W, int me,
    float eps, float* s_h, float* s_scratch, int it0 = 0, int it1 = kAllIters) {
  constexpr int kElems = kVecBytes / sizeof(T);
  constexpr bool kNorm = is_norm(kMode);
  const int G = static_cast<int>(gridDim.x);
  for (int i = it0, t = s.start + blockIdx.x + it0 * G; i < it1 && t < s.stop; ++i, t += G) {
    const long long row = static_cast<long long>(t) * cols;
    const int nvec = static_cast<int>(min(static_cast<long long>(cols), num_elems - row) / kElems);
    // Sequence-parallel outputs hold only this rank's slice.
    const long long local_row =
        kMode == kSequenceParallel ? row - static_cast<long long>(s.start) * cols : row;
    float ss = 0.0f;
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      const long long off = row + static_cast<long long>(v) * kElems;
      float acc[kElems];
#pragma unroll
      for (int j = 0; j < kElems; ++j) acc[j] = 0.0f;
      for (int p0 = 0; p0 < W; p0 += kBatch) {  // rank order 0..W-1 on every rank
        RawVec<kVecBytes> raw[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int p = p0 + k;
          if (p < W)
            raw[k] = p == me ? ld_nc<kVecBytes>(x + off)
                             : ld_plain<kVecBytes>(reinterpret_cast<const T*>(
                                   s_src[p] + static_cast<u64>(off) * sizeof(T)));
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          if (p0 + k < W) add_to<T, kVecBytes>(acc, raw[k]);
      }
      if constexpr (kNorm) {
        const long long loff = local_row + static_cast<long long>(v) * kElems;
        add_to<T, kVecBytes>(acc, ld_plain<kVecBytes>(residual + loff));
        const RawVec<kVecBytes> h = pack_from<T, kVecBytes>(acc);
        st_na<kVecBytes>(residual + loff, h);
        if (kMode == kReplicated && publish)
          push_to_peers<T, kVecBytes>(s_base, tmp_res_off, off, h, W, me);
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          ss += acc[j] * acc[j];
          s_h[j * nvec + v] = acc[j];  // conflict-free: consecutive threads, consecutive words
        }
      } else {
        const RawVec<kVecBytes> y = pack_from<T, kVecBytes>(acc);
        st_na<kVecBytes>(out + off, y);
        if (publish) push_to_peers<T, kVecBytes>(s_base, tmp_out_off, off, y, W, me);
      }
    }
    if constexpr (kNorm) {
      // h stays in fp32 (shared memory) between the two passes; only residual is rounded.
      const float rstd = rsqrtf(block_reduce_sum(ss, s_scratch) / static_cast<float>(cols) + eps);
      for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
        const RawVec<kVecBytes> w = ld_nc<kVecBytes>(weight + static_cast<long long>(v) * kElems);
        const T* we = reinterpret_cast<const T*>(&w);
        float y[kElems];
#pragma unroll
        for (int j = 0; j < kElems; ++j) y[j] = s_h[j * nvec + v] * rstd * to_float<T>(we[j]);
        const RawVec<kVecBytes> packed = pack_from<T, kVecBytes>(y);
        st_na<kVecBytes>(out + local_row + static_cast<long long>(v) * kElems, packed);
        if (publish)
          push_to_peers<T, kVecBytes>(s_base, tmp_out_off, row + static_cast<long long>(v) * kElems,
                                      packed, W, me);
      }
      __syncthreads();  // s_h is rewritten by the next row
    }
  }
}

}  // namespace ar
}  // namespace cuflux

using namespace cuflux;
using namespace cuflux::ar;

// The collective. grid: G blocks, the same on every rank (W > 1: <= the op's max_blocks so
// that spinning blocks stay co-resident when ranks share a GPU; two-shot: <= ceil(T / W)).
// block: <= 1024 threads. Dynamic shared memory: [norm modes] cols floats of h (16-byte
// padded), then world_size u64 base pointers, then world_size u64 source addresses (s_src).
// stage_parity_bytes = (W - 1) * slot_bytes: one parity of the stage.
template <typename T, int kVecBytes, int kMode, bool kTwoShot>
__global__ void __launch_bounds__(1024) allreduce_rmsnorm(
    const T* __restrict__ x, T* __restrict__ out, T* __restrict__ residual,
    const T* __restrict__ weight, const u64* __restrict__ bases, u64 stage_off,
    u64 stage_parity_bytes, u64 slot_bytes, u64 tmp_out_off, u64 tmp_res_off, u64 start_off,
    u64 mid_off,
    int flag_stride, u64* state, int rows, int cols, long long num_elems, int world_size,
    int rank, float eps, u32* err, u32* err_claim, u64 timeout_ns, u32 op) {
  constexpr bool kNorm = is_norm(kMode);
  constexpr bool kHalf2 = kMode == kAllGather;  // no x, no reduction: the epoch's second half
  static_assert(kTwoShot || kMode == kPlain || kMode == kReplicated,
                "sharded residual, sequence parallel and the halves need the two-shot slice "
                "owner");
  extern __shared__ float4 smem4[];
  float* s_h = reinterpret_cast<float*>(smem4);  // [kElems][cols / kElems] (norm modes)
  u64* s_base = reinterpret_cast<u64*>(smem4 + (kNorm ? (cols + 3) / 4 : 0));
  u64* s_src = s_base + world_size;  // where peer p's rows of this call are, in our stage
  __shared__ float s_scratch[32];
  __shared__ u64 s_epoch;
  __shared__ int s_failed;

  const int W = world_size, me = rank;
  if (threadIdx.x == 0) {
    // A wait of this op gave up in an earlier call (sync.cuh op_gave_up): a late peer may
    // still read its stage of two calls ago, so this call pushes nothing (the host raises).
    const bool gave_up = W > 1 && op_gave_up(err_claim);  // in flight with the epoch's load
    s_epoch = call_epoch(state) - (kHalf2 ? 1 : 0);  // the first half counted the call
    s_failed = gave_up ? 1 : 0;
  }
  for (int p = threadIdx.x; p < W; p += blockDim.x) s_base[p] = bases[p];
  __syncthreads();
  const u64 e = s_epoch;
  const WaitSite site{err, err_claim, timeout_ns, op, static_cast<u32>(me)};
  const Slice all{0, rows};
  const Slice mine = kTwoShot ? token_slice(rows, W, me) : all;
  const u64 stage_now = stage_off + (e & 1u) * stage_parity_bytes;
  // Our stage slot for sender p is j = (p - me - 1) mod W; two-shot rows sit at their offset
  // within our slice, hence the shift (u64 arithmetic: the sum lands inside the slot).
  for (int p = threadIdx.x; p < W; p += blockDim.x)
    s_src[p] = s_base[me] + stage_now + static_cast<u64>((p - me - 1 + W) % W) * slot_bytes -
               static_cast<u64>(mine.start) * cols * sizeof(T);
  __syncthreads();
  const bool publish = kTwoShot && kMode != kSequenceParallel && kMode != kReduceScatter && W > 1;

  bool ok = s_failed == 0;  // the same in every thread (s_failed, after a __syncthreads)
  if (!kHalf2) {
    // Phases 0 and 1, pipelined by chunks of this block's rows. Block b's rows of a slice are
    // the iterations i of t = slice start + b + i*G; chunk c is i in [c*ipc, (c+1)*ipc), the
    // same split of every slice on every rank (n_iter is a function of rows, W and G).
    const int slice_rows = kTwoShot ? (rows + W - 1) / W : rows;
    const int n_iter = (slice_rows + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
    const int ipc0 = (n_iter + kChunkSlots - 1) / kChunkSlots;  // at most kChunkSlots chunks
    const int ipc = max(kRowsPerChunk, ipc0);  // of at least kRowsPerChunk iterations
    const int chunks = max(1, (n_iter + ipc - 1) / ipc);  // no empty trailing chunk
    const u64 v0 = e * kChunkSlots;  // START values of call e: v0 + 1 .. v0 + chunks
    // Push chunk c, then wait for and reduce chunk c - 1, then release chunk c: the release's
    // system fence (warp 0 holds the releasing threads) then finds chunk c's stores drained by
    // the reduction instead of stalling the block on them. Deadlock-free: chunk 0 is released
    // before any wait, and the wait for chunk c - 1 needs only the peers' release of it.
    for (int c = 0; c <= chunks && ok; ++c) {
      if (c < chunks && W > 1) {
        // Phase 0, chunk c: push to each peer q the rows q's block b will reduce (one-shot:
        // this block's rows of all; two-shot: this block's rows of q's slice), into q's slot
        // for this rank.
        for (int i = 1; i < W; ++i) {
          const int q = (me + i) % W;
          const Slice sq = kTwoShot ? token_slice(rows, W, q) : all;
          T* slot = reinterpret_cast<T*>(s_base[q] + stage_now +
                                         static_cast<u64>((me - q - 1 + W) % W) * slot_bytes);
          copy_rows<T, kVecBytes, true>(slot, x, sq, cols, num_elems,
                                        static_cast<long long>(sq.start) * cols, c * ipc,
                                        (c + 1) * ipc);
        }
      }
      if (c >= 1) {
        // Phase 1, chunk c - 1 (kReduceScatter: the op passes this rank's tmp_out as out).
        if (W > 1) ok = block_wait(s_base, start_off, flag_stride, W, me, v0 + c, site, 0,
                                   &s_failed);
        if (ok)
          reduce_rows<T, kVecBytes, kMode, kLoadBatch>(
              x, out, residual, weight, s_src, s_base, tmp_out_off, tmp_res_off, publish, mine,
              cols, num_elems, W, me, eps, s_h, s_scratch, (c - 1) * ipc, c * ipc);
      }
      if (c < chunks && W > 1 && ok)
        block_release(s_base, start_off, flag_stride, W, me, v0 + c + 1);
    }
  }
  // Phase 2 (two-shot all-gather). kAllGather first pushes this rank's share (its slice of its
  // own tmp_out, rewritten between the halves) into every peer's tmp_out; the full call pushed
  // its rows in phase 1. After MID(e) every peer's finished rows of its slice are in our own
  // tmp_out (tmp_res): copy them out (kAllGather: our own slice too).
  if (ok && (publish || kHalf2)) {
    const T* my_tmp = reinterpret_cast<const T*>(s_base[me] + tmp_out_off);
    if (kHalf2) {
      for (int i = 1; i < W; ++i)
        copy_rows<T, kVecBytes, false>(reinterpret_cast<T*>(s_base[(me + i) % W] + tmp_out_off),
                                       my_tmp, mine, cols, num_elems);
    }
    ok = block_barrier(s_base, mid_off, flag_stride, W, me, e, site, 1, &s_failed);
    if (ok) {
      for (int i = kHalf2 ? 0 : 1; i < W; ++i) {
        const Slice sq = token_slice(rows, W, (me + i) % W);
        copy_rows<T, kVecBytes, false>(out, my_tmp, sq, cols, num_elems);
        if (kMode == kReplicated)
          copy_rows<T, kVecBytes, false>(
              residual, reinterpret_cast<const T*>(s_base[me] + tmp_res_off), sq, cols, num_elems);
      }
    }
  }

  if (!kHalf2) count_out(state, e);  // sync.cuh: the last block advances the epoch
}

// W = 1 (and the unfused baseline's norm): residual <- x + residual; out = RMSNorm(residual) *
// weight. No peers, no flags: one pass over x, residual and weight, rows strided over a grid
// that fills the GPU. Two forms of the same arithmetic (sum 0 + x + residual in fp32):
//   rmsnorm_local_reg  each thread keeps its kVecs vectors of x, residual and weight in
//                      registers, all loaded at once: bandwidth-bound rows.
//                      Needs cols / elems_per_vec <= kVecs * 256 (256-thread blocks leave
//                      room for the registers).
//   rmsnorm_local      any width: h goes through shared memory (cols floats, 16-byte padded).
template <typename T, int kVecBytes, int kVecs>
__global__ void __launch_bounds__(256) rmsnorm_local_reg(const T* __restrict__ x,
                                                          T* __restrict__ out,
                                                          T* __restrict__ residual,
                                                          const T* __restrict__ weight, int rows,
                                                          int cols, float eps) {
  constexpr int kElems = kVecBytes / sizeof(T);
  __shared__ float s_scratch[32];
  const int nvec = cols / kElems;
  for (int t = blockIdx.x; t < rows; t += gridDim.x) {
    const long long row = static_cast<long long>(t) * cols;
    RawVec<kVecBytes> xv[kVecs], rv[kVecs], wv[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (const int v = threadIdx.x + i * blockDim.x; v < nvec) {
        const long long off = static_cast<long long>(v) * kElems;
        xv[i] = ld_nc<kVecBytes>(x + row + off);
        rv[i] = ld_plain<kVecBytes>(residual + row + off);
        wv[i] = ld_nc<kVecBytes>(weight + off);
      }
    }
    // h = 0 + x + residual is recomputed in the second pass (bit-identical, cheaper than
    // holding kVecs * kElems floats across the block reduction).
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (const int v = threadIdx.x + i * blockDim.x; v < nvec) {
        float h[kElems];
        sum_of<T, kVecBytes>(h, xv[i], rv[i]);
        st_na<kVecBytes>(residual + row + static_cast<long long>(v) * kElems,
                         pack_from<T, kVecBytes>(h));
#pragma unroll
        for (int j = 0; j < kElems; ++j) ss += h[j] * h[j];
      }
    }
    const float rstd = rsqrtf(block_reduce_sum(ss, s_scratch) / static_cast<float>(cols) + eps);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (const int v = threadIdx.x + i * blockDim.x; v < nvec) {
        float h[kElems];
        sum_of<T, kVecBytes>(h, xv[i], rv[i]);
        const T* we = reinterpret_cast<const T*>(&wv[i]);
#pragma unroll
        for (int j = 0; j < kElems; ++j) h[j] = h[j] * rstd * to_float<T>(we[j]);
        st_na<kVecBytes>(out + row + static_cast<long long>(v) * kElems, pack_from<T, kVecBytes>(h));
      }
    }
  }
}

template <typename T, int kVecBytes>
__global__ void __launch_bounds__(1024) rmsnorm_local(const T* __restrict__ x, T* __restrict__ out,
                                                      T* __restrict__ residual,
                                                      const T* __restrict__ weight, int rows,
                                                      int cols, float eps) {
  extern __shared__ float4 smem4[];
  __shared__ float s_scratch[32];
  reduce_rows<T, kVecBytes, kReplicated, 1>(x, out, residual, weight, nullptr, nullptr, 0, 0,
                                            false, Slice{0, rows}, cols,
                                            static_cast<long long>(rows) * cols, 1, 0, eps,
                                            reinterpret_cast<float*>(smem4), s_scratch);
}
