// allreduce.cu — AllReduce, and AllReduce + residual add + RMSNorm fused, over P2P loads/stores.
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
// Pull model. Peers can only reach symmetric memory, so each block first copies its share of
// x into this rank's stage; afterwards every rank only LOADS peers' data and stores into its
// own memory. The only remote stores are epoch flags (release), so no peer atomics (they fail
// over PCIe) and no CAS round trips.
//
// Symmetric buffer of one op (byte offsets come from the Python Layout, 128-byte aligned):
//   stage[2][max_elems]   this rank's x, double-buffered by call parity (epoch & 1)
//   tmp_out[max_elems]    two-shot: finished rows of this rank's slice, for peers to pull
//   tmp_res[max_elems]    two-shot replicated: new residual rows of this rank's slice
//   start[max_blocks][stride], mid[max_blocks][stride]   u64 epochs; slot [b][p] lives in the
//                         memory of the rank that waits and is written by rank p's block b.
//                         64-bit: a block slot the grid does not reach goes unwritten for as
//                         long as calls stay small, and must never compare as reached.
//
// One-shot (small T). Block b of a G-block grid owns rows t = b (mod G) of all T rows.
//   stage own rows -> START barrier -> pull those rows from every rank's stage, reduce,
//   normalise, write out/residual locally.                                  (1 barrier)
// Two-shot. Block b owns rows (t - slice_start) = b (mod G) of this rank's slice, and stages,
//   for every rank q, the rows of q's slice that q's block b will reduce.
//   stage -> START barrier -> reduce own slice rows, write out/residual locally and into
//   tmp_out/tmp_res -> MID barrier -> pull the rows = b of every peer's slice from its tmp.
//   kSequenceParallel stops before MID (no all-gather).                    (2 barriers)
//
// Why these barriers suffice (calls of one op are stream-ordered on every rank):
//   * START(e) releases this block's stage rows of call e; MID(e) releases its tmp rows.
//   * A block passing any barrier of call e has heard from every peer's kernel e, so every
//     peer's kernel e-1 is complete. Hence, in call e: writing stage[e & 1] is safe (its last
//     readers were in call e-2, complete because this rank's kernel e-1 met every peer) and
//     writing tmp after START(e) is safe (its readers were in call e-1). No end barrier.
//   * Halves: the same with "kernel e" read as "the first half of call e". A peer's first half
//     of call e is queued after its second half of e-1, so once this rank's first half passed
//     START(e), nothing reads its tmp until the peers pass MID(e), which this rank raises in
//     its second half: between the halves its stream may rewrite its slice of tmp in place.
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
constexpr int kLoadBatch = 8;  // rank loads of one vector issued before any is added (W > 1)
constexpr int kCopyBatch = 4;  // vectors per thread in flight in row copies

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

// Copy the rows t = s.start + b + i*G (i >= 0, t < s.stop) from src to dst (both indexed by
// global row), kCopyBatch vectors per thread in flight. kSrcLocal: src is this rank's
// read-only input (non-coherent path); else a peer's memory (coherent loads).
template <typename T, int kBytes, bool kSrcLocal>
__device__ __forceinline__ void copy_rows(T* dst, const T* src, Slice s, int cols,
                                          long long num_elems) {
  constexpr int kElems = kBytes / sizeof(T);
  const int first = s.start + blockIdx.x;
  if (first >= s.stop) return;
  // 32-bit indices: the op keeps max_elems < 2^31 (cuflux/ops/allreduce.py).
  const int num_rows = (s.stop - first + gridDim.x - 1) / gridDim.x;
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
      if (off[k] >= 0) st_na<kBytes>(dst + off[k], buf[k]);
  }
}

// Phase 1 for the rows t = s.start + blockIdx.x + i*gridDim.x of slice s: sum rank 0..W-1's
// row (this rank's from x, peers' from their stage at byte offset stage_now), then either
// store the sum (kPlain) or add the residual, store it back, and normalise with one block
// reduction per row. publish: also store finished rows into tmp_out (and the new residual into
// tmp_res) of this rank's symmetric memory for the two-shot all-gather.
// kBatch: rank loads in flight per vector; 1 for the local kernel (W = 1), which keeps it at
// few registers, hence full occupancy.
template <typename T, int kVecBytes, int kMode, int kBatch>
__device__ __forceinline__ void reduce_rows(
    const T* __restrict__ x, T* __restrict__ out, T* __restrict__ residual,
    const T* __restrict__ weight, const u64* s_base, u64 stage_now, T* tmp_out, T* tmp_res,
    bool publish, Slice s, int cols, long long num_elems, int W, int me, float eps, float* s_h,
    float* s_scratch) {
  constexpr int kElems = kVecBytes / sizeof(T);
  constexpr bool kNorm = is_norm(kMode);
  for (int t = s.start + blockIdx.x; t < s.stop; t += gridDim.x) {
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
                             : ld_plain<kVecBytes>(reinterpret_cast<const T*>(s_base[p] + stage_now) + off);
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
        if (kMode == kReplicated && publish) st_na<kVecBytes>(tmp_res + off, h);
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          ss += acc[j] * acc[j];
          s_h[j * nvec + v] = acc[j];  // conflict-free: consecutive threads, consecutive words
        }
      } else {
        const RawVec<kVecBytes> y = pack_from<T, kVecBytes>(acc);
        st_na<kVecBytes>(out + off, y);
        if (publish) st_na<kVecBytes>(tmp_out + off, y);
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
        if (publish) st_na<kVecBytes>(tmp_out + row + static_cast<long long>(v) * kElems, packed);
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
// padded), then world_size u64 base pointers.
template <typename T, int kVecBytes, int kMode, bool kTwoShot>
__global__ void __launch_bounds__(1024) allreduce_rmsnorm(
    const T* __restrict__ x, T* __restrict__ out, T* __restrict__ residual,
    const T* __restrict__ weight, const u64* __restrict__ bases, u64 stage_off,
    u64 stage_parity_bytes, u64 tmp_out_off, u64 tmp_res_off, u64 start_off, u64 mid_off,
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
  __shared__ float s_scratch[32];
  __shared__ u64 s_epoch;
  __shared__ int s_failed;

  const int W = world_size, me = rank;
  if (threadIdx.x == 0) {
    // A wait of this op gave up in an earlier call (sync.cuh op_gave_up): a late peer may
    // still read our stage of two calls ago, so this call stages nothing (the host raises).
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
  const bool publish = kTwoShot && kMode != kSequenceParallel && kMode != kReduceScatter && W > 1;

  bool ok = s_failed == 0;
  if (!kHalf2 && W > 1 && ok) {
    // Phase 0: publish x. Stage the rows that block b of each rank will reduce.
    T* my_stage = reinterpret_cast<T*>(s_base[me] + stage_now);
    if (kTwoShot) {
      for (int q = 0; q < W; ++q)
        copy_rows<T, kVecBytes, true>(my_stage, x, token_slice(rows, W, q), cols, num_elems);
    } else {
      copy_rows<T, kVecBytes, true>(my_stage, x, all, cols, num_elems);
    }
    ok = block_barrier(s_base, start_off, flag_stride, W, me, e, site, 0, &s_failed);
  }
  if (!kHalf2 && ok) {  // kReduceScatter: the op passes this rank's tmp_out as out
    reduce_rows<T, kVecBytes, kMode, kLoadBatch>(
        x, out, residual, weight, s_base, stage_now, reinterpret_cast<T*>(s_base[me] + tmp_out_off),
        reinterpret_cast<T*>(s_base[me] + tmp_res_off), publish, mine, cols, num_elems, W, me, eps,
        s_h, s_scratch);
  }
  // Phase 2 (two-shot all-gather): pull the finished rows of every peer's slice (kAllGather:
  // this rank's too, rewritten in tmp_out after the first half). A peer's MID(e) of kAllGather
  // comes after its first half and whatever its stream ran in between.
  if (ok && (publish || kHalf2)) {
    ok = block_barrier(s_base, mid_off, flag_stride, W, me, e, site, 1, &s_failed);
    if (ok) {
      for (int i = kHalf2 ? 0 : 1; i < W; ++i) {  // from rank+1: peers are not all hit at once
        const int q = (me + i) % W;
        const Slice sq = token_slice(rows, W, q);
        copy_rows<T, kVecBytes, false>(out, reinterpret_cast<const T*>(s_base[q] + tmp_out_off),
                                       sq, cols, num_elems);
        if (kMode == kReplicated)
          copy_rows<T, kVecBytes, false>(
              residual, reinterpret_cast<const T*>(s_base[q] + tmp_res_off), sq, cols, num_elems);
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
  reduce_rows<T, kVecBytes, kReplicated, 1>(x, out, residual, weight, nullptr, 0, nullptr, nullptr,
                                            false, Slice{0, rows}, cols,
                                            static_cast<long long>(rows) * cols, 1, 0, eps,
                                            reinterpret_cast<float*>(smem4), s_scratch);
}
