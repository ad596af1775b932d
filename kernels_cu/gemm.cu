// gemm.cu — plain GEMM entry points: C[M, N] = A[M, K] @ B (+ bias[N]), the two GEMM cores
// (include/cuflux/gemm_sm90.cuh, gemm_sm80.cuh) instantiated with no-op hooks. (The cores with
// the fused ops' hooks, driven by the tests on one rank, are in tests/kernels_cu/gemm_hooks.cu.)
//
// Shapes: A [M, K] row-major; B [N, K] ("nk", kBTransposed = false) or [K, N] ("kn", true);
// bias [N] in the input dtype or null; C [M, N] row-major with ldc elements between rows, in
// bf16 / fp16 / fp32 (out_kind, gemm_hooks.cuh). Any M, N, K with K % 8 == 0 and N % 8 == 0
// (16-byte rows for TMA and cp.async; checked in cuflux/ops/gemm.py).
//
// Push/pull, remote buffers, sync points: the plain GEMM touches only local memory and has no
// cross-rank sync point.
//
// The Hopper kernels compile to empty bodies below sm_90a (they are only launched on sm_90a).
#include <cuflux/gemm_hooks.cuh>
#include <cuflux/gemm_sm80.cuh>
#include <cuflux/gemm_sm90.cuh>

using namespace cuflux;

// ---- Hopper ---------------------------------------------------------------------------------------
// Grid: persistent, a multiple of kClusterM, no more CTAs than fit at once (one per SM).
// group_m: tile rows (in units of kClusterM tiles) per L2 group. kEpiTma: bf16 / fp16 outputs
// leave through shared memory and TMA stores, described by tma_c (C [M, N], box
// {64, kBM / 2}, 128B swizzle); otherwise (and for fp32 outputs) from registers, and tma_c is
// not read. kPingpong: the two consumer warpgroups take alternate tiles, each a whole tile
// (gemm_sm90.cuh); register epilogue only. Defaulted: the other configurations' name
// expressions (cuflux/gemm_core.py) stay as they were.
template <typename T, int kBM, int kBN, int kStages, int kClusterM, bool kBTransposed,
          bool kEpiTma, bool kPingpong = false>
__global__ void __launch_bounds__(384, 1) CUFLUX_CLUSTER_DIMS(kClusterM)
    gemm_sm90(const __grid_constant__ sm90::TmaDesc tma_a,
              const __grid_constant__ sm90::TmaDesc tma_b,
              const __grid_constant__ sm90::TmaDesc tma_c, int M, int N, int K, void* out,
              long long ldc, int out_kind, const T* bias, int group_m) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = sm90::Config<T, kBM, kBN, kStages, kClusterM, kBTransposed, kEpiTma, kPingpong>;
  const int tiles_m = (M + kBM - 1) / kBM;
  const int rows = (tiles_m + kClusterM - 1) / kClusterM;
  const gemm::GroupedScheduler sched{rows, (N + kBN - 1) / kBN, rows, group_m, {}};
  if constexpr (kEpiTma) {
    const sm90::TmaStoreEpilogue<T> epi{{out, ldc, out_kind, bias}, &tma_c};
    sm90::gemm_tiles<Cfg>(&tma_a, &tma_b, M, N, K, sched, gemm::NoWait{}, epi);
  } else {
    const gemm::StoreEpilogue<T> epi{out, ldc, out_kind, bias};
    sm90::gemm_tiles<Cfg>(&tma_a, &tma_b, M, N, K, sched, gemm::NoWait{}, epi);
  }
#endif
}

// ---- portable ---------------------------------------------------------------------------------------
// The core's one tile (sm80::TileConfig, gemm_sm80.cuh); grid: persistent (2 CTAs per SM fit).
template <typename T, bool kBTransposed>
__global__ void __launch_bounds__(sm80::kTileThreads, sm80::kTileCtasPerSm)
    gemm_sm80(const T* a, const T* b, int M, int N, int K, void* out, long long ldc, int out_kind,
              const T* bias, int group_m) {
  using Cfg = sm80::TileConfig<T, kBTransposed>;
  const int tiles_m = (M + Cfg::kBM - 1) / Cfg::kBM;
  const gemm::GroupedScheduler sched{tiles_m, (N + Cfg::kBN - 1) / Cfg::kBN, tiles_m, group_m, {}};
  const gemm::StoreEpilogue<T> epi{out, ldc, out_kind, bias};
  sm80::gemm_tiles<Cfg>(a, b, M, N, K, sched, gemm::NoWait{}, epi);
}
