// allgather.cu — AllGather over SM copies (P2P loads), its epoch on the device: the path of
// AllGather and AllGatherGemm built with path="sm", which a CUDA graph can capture and replay.
// The default path, copy engines driven from the host, has no kernel (cuflux/ops/allgather.py).
//
// Problem. x [rows, row_bytes] on every rank -> out [W * rows, row_bytes], rank p's rows at
// p * rows. The kernel moves bytes: any dtype, any row width.
//
// Symmetric buffer of one op (byte offsets from the Python Layout, 128-byte aligned):
//   stage[2][max_rows * row_bytes]  this rank's x, double-buffered by call parity (epoch & 1)
//   start[max_blocks][stride]       u64 epochs; slot [b][p] lives in the memory of the rank
//                                   that waits and is written by rank p's block b
// A call's bytes are nbytes = rows * row_bytes. Block b of a G-block grid owns the bytes
// [b * span, (b + 1) * span) (cuflux/ops/allgather.py sm_plan: from nbytes alone, span a
// multiple of 16), the same on every rank whatever its alignment; it copies them in vectors of
// kVecBytes (16 where this rank's pointers and nbytes are 16-byte aligned, else 1).
//
// Call e (state[0] + 1, read as the CTA starts): block b copies its vectors of x into
// stage[e & 1] and into out (this rank's rows), meets block b of every peer (START barrier,
// sync.cuh block_barrier), then loads its vectors of every peer's stage[e & 1] into out.
// Why one barrier suffices (calls of one op are stream-ordered on every rank): a block past
// START(e) has heard from every peer's kernel e, so every peer's kernel e-1 is complete. Hence
// writing stage[e & 1] in call e is safe: its last readers were in call e-2, complete because
// this rank's kernel e-1 met every peer. Block b reads only what the peers' block b staged
// before their release. No end barrier, nothing remote is stored but the flags.
// Epoch on the device (sync.cuh call_epoch / count_out): no host counter to bake into a graph.
// Every wait is bounded; on timeout the block records who it waited for and skips the rest. A
// rank whose op already gave up (op_gave_up) stages nothing: a late peer may still be reading
// the stage of two calls ago.
#include <cuflux/sync.cuh>
#include <cuflux/vec.cuh>

using namespace cuflux;

constexpr int kCopyBatch = 4;  // vectors per thread in flight

// dst[i] = src[i] for the bytes i in [lo, hi), by the whole block in vectors of kVecBytes (lo
// and hi multiples of it), kCopyBatch loads per thread issued before any store. kSrcLocal: src
// is this rank's read-only input (non-coherent path); else a peer's stage (coherent loads).
template <int kVecBytes, bool kSrcLocal>
__device__ __forceinline__ void copy_span(unsigned char* dst, const unsigned char* src,
                                          long long lo, long long hi) {
  const long long end = hi / kVecBytes;
  for (long long v0 = lo / kVecBytes + threadIdx.x; v0 < end;
       v0 += static_cast<long long>(blockDim.x) * kCopyBatch) {
    RawVec<kVecBytes> buf[kCopyBatch];
#pragma unroll
    for (int k = 0; k < kCopyBatch; ++k) {
      const long long v = v0 + static_cast<long long>(k) * blockDim.x;
      if (v < end)
        buf[k] = kSrcLocal ? ld_nc<kVecBytes>(src + v * kVecBytes)
                           : ld_plain<kVecBytes>(src + v * kVecBytes);
    }
#pragma unroll
    for (int k = 0; k < kCopyBatch; ++k) {
      const long long v = v0 + static_cast<long long>(k) * blockDim.x;
      if (v < end) st_na<kVecBytes>(dst + v * kVecBytes, buf[k]);
    }
  }
}

// grid: G blocks, the same on every rank (<= the op's max_blocks, so that spinning blocks stay
// co-resident when ranks share a GPU); block: any multiple of 32 up to 1024.
template <int kVecBytes>
__global__ void __launch_bounds__(1024) allgather_sm(
    const unsigned char* __restrict__ x, unsigned char* __restrict__ out,
    const u64* __restrict__ bases, u64 stage_off, u64 stage_parity_bytes, u64 start_off,
    int flag_stride, u64* state, long long nbytes, long long span, int world_size, int rank,
    u32* err,
    u32* err_claim, u64 timeout_ns, u32 op) {
  extern __shared__ u64 s_base[];  // world_size peers' bases
  __shared__ u64 s_epoch;
  __shared__ int s_failed;
  const int W = world_size, me = rank;
  if (threadIdx.x == 0) {
    const bool gave_up = op_gave_up(err_claim);  // in flight with the epoch's load
    s_epoch = call_epoch(state);
    s_failed = gave_up ? 1 : 0;
  }
  for (int p = threadIdx.x; p < W; p += blockDim.x) s_base[p] = bases[p];
  __syncthreads();
  const u64 e = s_epoch;
  const WaitSite site{err, err_claim, timeout_ns, op, static_cast<u32>(me)};
  const u64 stage_now = stage_off + (e & 1u) * stage_parity_bytes;
  const long long lo = min(nbytes, blockIdx.x * span), hi = min(nbytes, lo + span);
  bool ok = s_failed == 0;
  if (ok) {
    unsigned char* my_stage = reinterpret_cast<unsigned char*>(s_base[me] + stage_now);
    copy_span<kVecBytes, true>(my_stage, x, lo, hi);
    copy_span<kVecBytes, true>(out + me * nbytes, x, lo, hi);
    ok = block_barrier(s_base, start_off, flag_stride, W, me, e, site, 0, &s_failed);
  }
  if (ok) {
    for (int i = 1; i < W; ++i) {  // from rank+1: the peers are not all read at once
      const int q = (me + i) % W;
      copy_span<kVecBytes, false>(out + q * nbytes,
                                  reinterpret_cast<const unsigned char*>(s_base[q] + stage_now),
                                  lo, hi);
    }
  }
  count_out(state, e);  // sync.cuh: the last block advances the epoch
}
