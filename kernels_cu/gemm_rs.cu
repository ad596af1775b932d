// gemm_rs.cu — GEMM + ReduceScatter fused (Flux's RS half), and the comm-only reduce-scatter
// that the unfused baseline runs after cuBLAS. The protocol lives in include/cuflux/rs_hooks.cuh.
//
// Problem and shapes: on rank r, C_r = A_r [M, K_r] @ B_r (B_r [N, K_r] "nk" or [K_r, N] "kn"),
// bf16 or fp16 in, fp32 accumulation; rank o receives out_o [R, N] = sum_r C_r[o*R:(o+1)*R]
// (+ bias[N], once), R = M / W, in the input dtype or fp32. K_r % 8 == 0, N % 8 == 0.
//
// Push: each CTA's epilogue writes the rows of its tile that other ranks own into their memory
// (deterministic: a per-source slot, plain stores; atomic: red.add into one accumulator) and
// raises the tile's flag there (one fence, relaxed stores); the owner finishes its own tiles
// (visited last; its own partial goes through its own slot too) after waiting for every peer's
// flag of the tile (bounded, ld.acquire.sys), summing in fp32 and adding the bias. Remote
// buffers: the op's symmetric data[parity] and flags (rs_hooks.cuh). The call's epoch is read
// from device memory (state) and advanced by the last CTA to finish: capturable in a graph.
// Sync points: one per (tile, source) flag; nothing else, no grid-wide barrier.
//
// Entry points (grid: persistent, co-resident, see cuflux/ops/gemm_rs.py):
//   gemm_rs_sm90<T, kBM, kBN, kBTransposed, kAtomic>   Hopper core (sm_90a; empty below), 384
//                                                      threads, 4 stages, 1-CTA clusters
//   gemm_rs_sm80<T, kBTransposed, kAtomic>             portable core, 128x128x32, 256 threads
//   rs_tiles<T, OutT, kAtomic>                         comm-only: partial [M, N] in OutT
//                                                      (e.g. from cuBLAS) instead of a GEMM,
//                                                      128x128 tiles, 512 threads
//   rs_sum<T, OutT>                                    the chunked route's last step: the W
//                                                      received partials summed (no waits)
// The trailing arguments (from `out` on) are the same for the three (RsArgs below).
#include <cuflux/gemm_hooks.cuh>
#include <cuflux/gemm_sm80.cuh>
#include <cuflux/gemm_sm90.cuh>
#include <cuflux/rs_hooks.cuh>

using namespace cuflux;

// The trailing kernel arguments (own_lo / own_hi: the first and last tile rows holding rows of
// this rank, computed once on the host; data_off: data[0], data[1] parity_bytes further; state:
// u64 [2] of this rank, sync.cuh's device-counted epochs).
template <typename T>
struct RsArgs {
  void* out;
  int out_f32;
  const T* bias;
  const u64* bases;
  u64 data_off, parity_bytes, slot_bytes, flags_off;
  int flag_stride, rows_per_rank, world_size, rank, own_lo, own_hi, group_m;
  u64* state;
  u32* err;
  u32* err_claim;
  u64 timeout_ns;
  u32 op;
};

// The scheduler and epilogue of a core with kBM x kBN tiles. Every thread constructs them as
// the CTA starts, reading the call's epoch (call_epoch) before the CTA can count out.
template <typename T, int kBM, int kBN, bool kAtomic, class Sync>
struct RsHooks {
  rs::RsScheduler sched;
  rs::RsEpilogue<T, kBM, kBN, kAtomic, Sync> epi;

  __device__ RsHooks(int M, int N, const RsArgs<T>& a)
      : RsHooks(M, N, a, call_epoch(a.state)) {}
  __device__ RsHooks(int M, int N, const RsArgs<T>& a, u64 e)
      : sched{(M + kBM - 1) / kBM, (N + kBN - 1) / kBN, a.group_m,
              (a.own_hi + 1) % ((M + kBM - 1) / kBM), a.own_hi - a.own_lo + 1},
        epi{a.out, a.out_f32, a.bias, a.bases, a.data_off + (e & 1) * a.parity_bytes,
            a.slot_bytes, a.flags_off,
            a.flag_stride, M, N, (N + kBN - 1) / kBN, a.rows_per_rank, a.world_size, a.rank,
            e,
            WaitSite{a.err, a.err_claim, a.timeout_ns, a.op, static_cast<u32>(a.rank)},
            // one value for the whole CTA (every thread constructs the hooks, before the
            // core's warp roles): the epilogue's named barriers see all or none return
            a.world_size > 1 && __syncthreads_or(op_gave_up(a.err_claim)) != 0} {}
};

// ---- Hopper ------------------------------------------------------------------------------------
// tma_a: box {64, kBM} over A [M, K]; tma_b: "nk" box {64, kBN} over B [N, K], "kn" box {64, 64}
// over B [K, N] (128-byte swizzle, zero fill). Dynamic shared memory: Config::kSmemBytes.
template <typename T, int kBM, int kBN, bool kBTransposed, bool kAtomic>
__global__ void __launch_bounds__(384, 1) CUFLUX_CLUSTER_DIMS(1)
    gemm_rs_sm90(const __grid_constant__ sm90::TmaDesc tma_a,
                 const __grid_constant__ sm90::TmaDesc tma_b, int M, int N, int K,
                 void* out, int out_f32, const T* bias, const u64* bases, u64 data_off,
                 u64 parity_bytes, u64 slot_bytes, u64 flags_off, int flag_stride,
                 int rows_per_rank, int world_size, int rank, int own_lo, int own_hi,
                 int group_m, u64* state, u32* err, u32* err_claim, u64 timeout_ns, u32 op) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = sm90::Config<T, kBM, kBN, 4, 1, kBTransposed>;
  const RsArgs<T> args{out, out_f32, bias, bases, data_off, parity_bytes, slot_bytes,
                       flags_off, flag_stride, rows_per_rank, world_size, rank, own_lo, own_hi,
                       group_m, state, err, err_claim, timeout_ns, op};
  const RsHooks<T, kBM, kBN, kAtomic, rs::ConsumerSync> h(M, N, args);
  sm90::gemm_tiles<Cfg>(&tma_a, &tma_b, M, N, K, h.sched, gemm::NoWait{}, h.epi);
  count_out(state, h.epi.epoch);  // every thread returns from the core: all 384 meet here
#endif
}

// ---- portable ----------------------------------------------------------------------------------
// The core's one tile (sm80::TileConfig, as gemm.cu's gemm_sm80): 128 x 128 x 32, 4 stages,
// 8 warps. Dynamic shared memory: 64 KiB.
template <typename T, bool kBTransposed, bool kAtomic>
__global__ void __launch_bounds__(sm80::kTileThreads, sm80::kTileCtasPerSm)
    gemm_rs_sm80(const T* a, const T* b, int M, int N, int K, void* out, int out_f32,
                 const T* bias, const u64* bases, u64 data_off, u64 parity_bytes,
                 u64 slot_bytes, u64 flags_off, int flag_stride, int rows_per_rank,
                 int world_size, int rank, int own_lo, int own_hi, int group_m, u64* state,
                 u32* err, u32* err_claim, u64 timeout_ns, u32 op) {
  using Cfg = sm80::TileConfig<T, kBTransposed>;
  const RsArgs<T> args{out, out_f32, bias, bases, data_off, parity_bytes, slot_bytes,
                       flags_off, flag_stride, rows_per_rank, world_size, rank, own_lo, own_hi,
                       group_m, state, err, err_claim, timeout_ns, op};
  const RsHooks<T, Cfg::kBM, Cfg::kBN, kAtomic, rs::CtaSync> h(M, N, args);
  sm80::gemm_tiles<Cfg>(a, b, M, N, K, h.sched, gemm::NoWait{}, h.epi);
  count_out(state, h.epi.epoch);
}

// ---- comm-only reduce-scatter ------------------------------------------------------------------
// partial [M, N] (this rank's C, already computed, e.g. by cuBLAS) in OutT = the output dtype;
// the same tile order, epilogue, buffers and flags as the fused kernels, the tile read from
// memory instead of computed. 512 threads; thread t holds element pairs i = t + 512 j of a
// 128 x 128 tile: row i / 64, columns 2 (i % 64) + {0, 1} (a warp reads 64 consecutive columns
// of one row). Grid: persistent, at most one CTA per SM (co-resident).
template <typename T, typename OutT, bool kAtomic>
__global__ void __launch_bounds__(512, 1)
    rs_tiles(const OutT* partial, int M, int N, void* out, int out_f32, const T* bias,
             const u64* bases, u64 data_off, u64 parity_bytes, u64 slot_bytes, u64 flags_off,
             int flag_stride, int rows_per_rank, int world_size, int rank, int own_lo,
             int own_hi, int group_m, u64* state, u32* err, u32* err_claim, u64 timeout_ns,
             u32 op) {
  constexpr int kBM = 128, kBN = 128, kThreads = 512, kPairs = kBM * kBN / 2 / kThreads;
  const RsArgs<T> args{out, out_f32, bias, bases, data_off, parity_bytes, slot_bytes,
                       flags_off, flag_stride, rows_per_rank, world_size, rank, own_lo, own_hi,
                       group_m, state, err, err_claim, timeout_ns, op};
  const RsHooks<T, kBM, kBN, kAtomic, rs::CtaSync> h(M, N, args);
  const int slots = h.sched.num_slots();
  for (int slot = blockIdx.x; slot < slots; slot += gridDim.x) {
    int tm, tn;
    h.sched.tile(slot, tm, tn);
    const int m0 = tm * kBM, n0 = tn * kBN;
    float2 v[kPairs];
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int i = static_cast<int>(threadIdx.x) + kThreads * j;
      const int r = m0 + i / (kBN / 2), c = n0 + 2 * (i % (kBN / 2));
      v[j] = r < M && c < N ? gemm::load2_float(partial + static_cast<long long>(r) * N + c)
                            : make_float2(0.0f, 0.0f);
    }
    auto body = [&](const auto& w) {
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        const int i = static_cast<int>(threadIdx.x) + kThreads * j;
        const int r = m0 + i / (kBN / 2), c = n0 + 2 * (i % (kBN / 2));
        if (r < M && c < N) w.put2(r, c, v[j].x, v[j].y);  // N even: c + 1 < N too
      }
    };
    h.epi.template run<OutT>(m0, n0, body);
  }
  count_out(state, h.epi.epoch);
}

// ---- the chunked route's reduction -------------------------------------------------------------
// route="chunked" (cuflux/ops/gemm_rs.py ChunkedRs): cuBLAS computes each owner's rows as a
// chunk, copy engines deliver the peers' chunks into this rank's data region (rank p's partial
// of our rows at p * elems), and the call's stream has waited for all of them before this
// kernel runs. out [R, N] = the W partials summed in fp32 in rank order 0..W-1, then + bias:
// the fused kernels' arithmetic (RsEpilogue::finish), bit-identical run to run. elems = R * N
// (the rows summed), slot_elems: from one rank's partial to the next (R * N for a whole call,
// more for a part of the rows); N % 8 == 0, every pointer 16-byte aligned, so a 16-byte vector
// never crosses a row.
template <typename T, typename OutT>
__global__ void __launch_bounds__(256)
    rs_sum(const OutT* data, long long elems, long long slot_elems, int world_size, int N,
           const T* bias, OutT* out) {
  constexpr int kElems = 16 / sizeof(OutT);
  constexpr int kBiasBytes = kElems * sizeof(T);
  const long long vecs = elems / kElems;
  for (long long v = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; v < vecs;
       v += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i = v * kElems;
    float acc[kElems];
#pragma unroll
    for (int j = 0; j < kElems; ++j) acc[j] = 0.0f;
    for (int p = 0; p < world_size; ++p)  // rank order: bit-identical sums
      rs::add_vec<OutT, 16>(acc, ld_plain<16>(data + p * slot_elems + i));
    float b[kElems];
#pragma unroll
    for (int j = 0; j < kElems; ++j) b[j] = 0.0f;
    if (bias != nullptr) rs::add_vec<T, kBiasBytes>(b, ld_nc<kBiasBytes>(bias + i % N));
    RawVec<16> packed;
    OutT* pe = reinterpret_cast<OutT*>(&packed);
#pragma unroll
    for (int j = 0; j < kElems; ++j) pe[j] = from_float<OutT>(acc[j] + b[j]);
    st_na<16>(out + i, packed);
  }
}
