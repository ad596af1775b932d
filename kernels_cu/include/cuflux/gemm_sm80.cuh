// cuflux/gemm_sm80.cuh — the portable GEMM core (sm_80 and later, the H200 included):
// mma.sync m16n8k16 (fp32 accumulators), cp.async 16-byte copies into a ring of kStages
// shared-memory stages, ldmatrix fragment loads, persistent grid, the hooks of gemm_hooks.cuh.
//
// Problem: C[M, N] = A[M, K] @ B, A row-major [M, K]; B [N, K] ("nk") or [K, N] ("kn");
// bf16 or fp16 in. Remainders: 16-byte chunks outside the matrix are zero-filled by cp.async
// (src-size 0), so K must be a multiple of 8 and N too for "kn" (checked in Python); the
// epilogue skips rows >= M and cols >= N.
//
// CTA: kWarpsM x kWarpsN warps, warp tile (kBM / kWarpsM) x (kBN / kWarpsN). Per tile: the
// prologue hook (thread 0) and a CTA barrier, kStages - 1 stages in flight, then per K step:
// wait for the oldest stage, barrier (everyone is done with the stage about to be refilled),
// issue the next copy, run the mma of the landed stage. Epilogue straight from registers.
//
// Shared memory rows are XOR-swizzled in 16-byte chunks so that the 8 row addresses of one
// ldmatrix (and the copies) hit 8 different bank groups: 4-chunk rows (k = 32) use
// chunk ^ ((row >> 1) & 3), rows of 8 or more chunks use chunk ^ (row & 7).
#pragma once
#include <cuflux/gemm_hooks.cuh>

namespace cuflux {
namespace sm80 {

template <typename T_, int kBM_, int kBN_, int kBK_, int kStages_, int kWarpsM_, int kWarpsN_,
          bool kBTransposed_>
struct Config {
  using T = T_;
  static constexpr int kBM = kBM_, kBN = kBN_, kBK = kBK_, kStages = kStages_;
  static constexpr int kWarpsM = kWarpsM_, kWarpsN = kWarpsN_;
  static constexpr bool kBTransposed = kBTransposed_;  // B given as [K, N] ("kn")
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kWarpM = kBM / kWarpsM, kWarpN = kBN / kWarpsN;
  static constexpr int kMi = kWarpM / 16, kNi = kWarpN / 8;
  static constexpr int kAChunks = kBK / 8;                         // chunks per A row
  static constexpr int kBChunks = kBTransposed ? kBN / 8 : kBK / 8;  // chunks per B row
  static constexpr int kBRows = kBTransposed ? kBK : kBN;
  static constexpr int kAElems = kBM * kBK, kBElems = kBN * kBK;
  static constexpr int kSmemBytes = kStages * (kAElems + kBElems) * 2;
  static_assert(kNi % 2 == 0, "B fragments are loaded two n8 blocks at a time");
  static_assert(kBK % 16 == 0 && kAChunks >= 4, "k step");
};

// The portable core's one tile, used by every kernel built on it (gemm.cu, gemm_rs.cu,
// ag_gemm.cu: the same bits for the same tile): 128 x 128 x 32, 4 stages, 8 warps of 64 x 32,
// 256 threads, 2 CTAs per SM (64 KiB of shared memory each). Mirrored by cuflux/gemm_core.py
// SM80 (tests/test_gemm.py reads these numbers and compares).
constexpr int kTileM = 128, kTileN = 128, kTileK = 32, kTileStages = 4;
constexpr int kTileWarpsM = 2, kTileWarpsN = 4, kTileCtasPerSm = 2;
constexpr int kTileThreads = 32 * kTileWarpsM * kTileWarpsN;
template <typename T, bool kBTransposed>
using TileConfig =
    Config<T, kTileM, kTileN, kTileK, kTileStages, kTileWarpsM, kTileWarpsN, kBTransposed>;

template <int kChunks> __device__ __forceinline__ int swizzle(int row, int chunk) {
  if constexpr (kChunks >= 8) return chunk ^ (row & 7);
  else return chunk ^ ((row >> 1) & 3);
}
// Element offset of chunk `chunk` of row `row` in a [rows][kChunks * 8] swizzled tile.
template <int kChunks> __device__ __forceinline__ int tile_offset(int row, int chunk) {
  return (row * kChunks + swizzle<kChunks>(row, chunk)) * 8;
}

__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (IsHalf<T>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7},"
        " {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7},"
        " {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Copies of one K step (k0) of tile (m0, n0) into stage buffers a_s, b_s (shared addresses).
template <class Cfg>
__device__ __forceinline__ void load_stage(const typename Cfg::T* a, const typename Cfg::T* b,
                                           int M, int N, int K, int m0, int n0, int k0, u32 a_s,
                                           u32 b_s) {
  for (int i = threadIdx.x; i < Cfg::kBM * Cfg::kAChunks; i += Cfg::kThreads) {
    const int row = i / Cfg::kAChunks, ch = i % Cfg::kAChunks;
    const int gm = m0 + row, gk = k0 + ch * 8;
    const bool ok = gm < M && gk < K;
    cp_async_16(a_s + 2 * tile_offset<Cfg::kAChunks>(row, ch),
                ok ? a + static_cast<long long>(gm) * K + gk : a, ok);
  }
  for (int i = threadIdx.x; i < Cfg::kBRows * Cfg::kBChunks; i += Cfg::kThreads) {
    const int row = i / Cfg::kBChunks, ch = i % Cfg::kBChunks;
    bool ok;
    long long off;
    if constexpr (Cfg::kBTransposed) {  // rows are k, chunks run along n
      const int gk = k0 + row, gn = n0 + ch * 8;
      ok = gk < K && gn < N;
      off = static_cast<long long>(gk) * N + gn;
    } else {  // rows are n, chunks run along k
      const int gn = n0 + row, gk = k0 + ch * 8;
      ok = gn < N && gk < K;
      off = static_cast<long long>(gn) * K + gk;
    }
    cp_async_16(b_s + 2 * tile_offset<Cfg::kBChunks>(row, ch), ok ? b + off : b, ok);
  }
}

// The mma of one landed stage.
template <class Cfg>
__device__ __forceinline__ void mma_stage(float (&acc)[Cfg::kMi][Cfg::kNi][4], u32 a_s, u32 b_s,
                                          int warp_m, int warp_n, int lane) {
#pragma unroll
  for (int kk = 0; kk < Cfg::kBK / 16; ++kk) {
    u32 fa[Cfg::kMi][4];
    u32 fb[Cfg::kNi][2];
#pragma unroll
    for (int mi = 0; mi < Cfg::kMi; ++mi) {  // matrices: rows 0-7|8-15 x k 0-7|8-15
      const int row = warp_m * Cfg::kWarpM + mi * 16 + (lane % 16);
      ldmatrix_x4(fa[mi], a_s + 2 * tile_offset<Cfg::kAChunks>(row, kk * 2 + lane / 16));
    }
#pragma unroll
    for (int ni = 0; ni < Cfg::kNi; ni += 2) {  // two n8 blocks: b0, b1 of each
      u32 r[4];
      if constexpr (Cfg::kBTransposed) {
        const int krow = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
        const int nch = (warp_n * Cfg::kWarpN) / 8 + ni + lane / 16;
        ldmatrix_x4_trans(r, b_s + 2 * tile_offset<Cfg::kBChunks>(krow, nch));
      } else {
        const int nrow = warp_n * Cfg::kWarpN + ni * 8 + (lane % 8) + 8 * (lane / 16);
        ldmatrix_x4(r, b_s + 2 * tile_offset<Cfg::kBChunks>(nrow, kk * 2 + (lane / 8) % 2));
      }
      fb[ni][0] = r[0];
      fb[ni][1] = r[1];
      fb[ni + 1][0] = r[2];
      fb[ni + 1][1] = r[3];
    }
#pragma unroll
    for (int mi = 0; mi < Cfg::kMi; ++mi)
#pragma unroll
      for (int ni = 0; ni < Cfg::kNi; ++ni)
        mma_16816<typename Cfg::T>(acc[mi][ni], fa[mi], fb[ni][0], fb[ni][1]);
  }
}

// ---- the core --------------------------------------------------------------------------------------
// Call from a __global__ function launched with Cfg::kThreads threads and Cfg::kSmemBytes of
// dynamic shared memory; any grid size (persistent: CTAs loop over the scheduler's slots).
template <class Cfg, class Sched, class Pro, class Epi>
__device__ __forceinline__ void gemm_tiles(const typename Cfg::T* a, const typename Cfg::T* b,
                                           int M, int N, int K, const Sched& sched,
                                           const Pro& pro, const Epi& epi) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const u32 smem = static_cast<u32>(__cvta_generic_to_shared(smem_raw));
  constexpr u32 kStageBytes = (Cfg::kAElems + Cfg::kBElems) * 2;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;
  const int k_tiles = (K + Cfg::kBK - 1) / Cfg::kBK;
  const int slots = sched.num_slots();

  for (int slot = blockIdx.x; slot < slots; slot += gridDim.x) {
    int tm, tn;
    if (!sched.tile(slot, tm, tn)) continue;
    const int m0 = tm * Cfg::kBM, n0 = tn * Cfg::kBN;
    if constexpr (Pro::kWaits) {
      if (threadIdx.x == 0) pro.wait_rows(min(m0, M), min(m0 + Cfg::kBM, M));
      __syncthreads();  // thread 0's acquire, then everyone's loads (CTA-scope ordering)
    }
    float acc[Cfg::kMi][Cfg::kNi][4];
#pragma unroll
    for (int mi = 0; mi < Cfg::kMi; ++mi)
#pragma unroll
      for (int ni = 0; ni < Cfg::kNi; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
      if (s < k_tiles)
        load_stage<Cfg>(a, b, M, N, K, m0, n0, s * Cfg::kBK, smem + s * kStageBytes,
                        smem + s * kStageBytes + Cfg::kAElems * 2);
      cp_async_commit();  // empty groups keep the group count uniform
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<Cfg::kStages - 2>();  // stage kt landed (this thread's copies)
      __syncthreads();  // everyone's copies landed; everyone is done with stage kt - 1
      const int next = kt + Cfg::kStages - 1;
      if (next < k_tiles) {
        const u32 s = smem + (next % Cfg::kStages) * kStageBytes;
        load_stage<Cfg>(a, b, M, N, K, m0, n0, next * Cfg::kBK, s, s + Cfg::kAElems * 2);
      }
      cp_async_commit();
      const u32 s = smem + (kt % Cfg::kStages) * kStageBytes;
      mma_stage<Cfg>(acc, s, s + Cfg::kAElems * 2, warp_m, warp_n, lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's copies overwrite stages still being read

    const int row0 = m0 + warp_m * Cfg::kWarpM + lane / 4;
    const int col0 = n0 + warp_n * Cfg::kWarpN + (lane % 4) * 2;
    epi.with_writer(m0, n0, [&](const auto& w) {
#pragma unroll
      for (int mi = 0; mi < Cfg::kMi; ++mi) {
        const int r = row0 + mi * 16;
#pragma unroll
        for (int ni = 0; ni < Cfg::kNi; ++ni) {
          const int c = col0 + ni * 8;
          if (c < N) {
            if (r < M) w.put2(r, c, acc[mi][ni][0], acc[mi][ni][1]);
            if (r + 8 < M) w.put2(r + 8, c, acc[mi][ni][2], acc[mi][ni][3]);
          }
        }
      }
    });
    if constexpr (Epi::kSignalsTiles) {
      __syncthreads();  // every thread stored its part of the tile
      if (threadIdx.x == 0) epi.tile_done(tm, tn, min(m0, M), min(m0 + Cfg::kBM, M));
    }
  }
}

}  // namespace sm80
}  // namespace cuflux
