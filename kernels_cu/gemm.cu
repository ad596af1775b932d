// gemm.cu — plain GEMM entry points: C[M, N] = A[M, K] @ B (+ bias[N]), the two GEMM cores
// (include/cuflux/gemm_sm90.cuh, gemm_sm80.cuh) instantiated with no-op hooks, plus one
// instantiation of each core with the fused ops' hooks, which the tests drive on one rank.
//
// Shapes: A [M, K] row-major; B [N, K] ("nk", kBTransposed = false) or [K, N] ("kn", true);
// bias [N] in the input dtype or null; C [M, N] row-major with ldc elements between rows, in
// bf16 / fp16 / fp32 (out_kind, gemm_hooks.cuh). Any M, N, K with K % 8 == 0 and N % 8 == 0
// (16-byte rows for TMA and cp.async; checked in cuflux/ops/gemm.py).
//
// Push/pull, remote buffers, sync points: the plain GEMM touches only local memory and has no
// cross-rank sync point. The hook kernels (gemm_hooks_*) wait (bounded) on chunk flags in this
// rank's memory before loading A rows, reduce tiles into the owners' buffers through IPC base
// pointers (push) and raise per-tile flags there with st.release.sys.
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
// expressions (cuflux/ops/gemm.py) stay as they were.
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
// 128 x 128 x 32 tiles, 4 stages, 8 warps of 64 x 32; grid: persistent (2 CTAs per SM fit).
template <typename T, bool kBTransposed>
using Sm80Cfg = sm80::Config<T, 128, 128, 32, 4, 2, 4, kBTransposed>;

template <typename T, bool kBTransposed>
__global__ void __launch_bounds__(256, 2)
    gemm_sm80(const T* a, const T* b, int M, int N, int K, void* out, long long ldc, int out_kind,
              const T* bias, int group_m) {
  using Cfg = Sm80Cfg<T, kBTransposed>;
  const int tiles_m = (M + Cfg::kBM - 1) / Cfg::kBM;
  const gemm::GroupedScheduler sched{tiles_m, (N + Cfg::kBN - 1) / Cfg::kBN, tiles_m, group_m, {}};
  const gemm::StoreEpilogue<T> epi{out, ldc, out_kind, bias};
  sm80::gemm_tiles<Cfg>(a, b, M, N, K, sched, gemm::NoWait{}, epi);
}

// ---- the fused ops' hooks, exercised ------------------------------------------------------------------
// Tiles visited M-chunk by M-chunk in chunk_order (chunk_tiles_m tile rows each); before a tile's
// A rows are loaded, wait for flags[c * 32] >= epoch of every chunk c of rows_per_chunk rows
// they come from; the tile is added (atomics) into row r % rows_per_rank of rank
// r / rows_per_rank's output (dst_bases[owner] + dst_offset, ldc), then flag
// tm * tiles_n + tn (32 words apart) at flag_bases[owner] + flag_offset is set to epoch.
struct HookArgs {
  const int* chunk_order;
  int chunk_tiles_m;
  const u32* chunk_flags;
  int rows_per_chunk, chunks_per_rank;
  u32 epoch;
  u32* err;
  u32* err_claim;
  u64 timeout_ns;
  u32 op, rank;
  const u64* dst_bases;
  u64 dst_offset;
  const u64* flag_bases;
  u64 flag_offset;
  int rows_per_rank;
  long long ldc;
};

// The three hooks of the fused ops, configured from HookArgs for a core with kBM x kBN tiles.
template <typename T, int kBM, int kBN>
struct FusedHooks {
  gemm::ChunkedScheduler<gemm::ListedChunks> sched;
  gemm::ChunkFlagWait pro;
  gemm::ScatterEpilogue<T, true> epi;

  __device__ FusedHooks(const HookArgs& h, int M, int N)
      : sched{(M + kBM - 1) / kBM, (N + kBN - 1) / kBN, h.chunk_tiles_m, 1, {h.chunk_order}},
        pro{h.chunk_flags, 32, h.rows_per_chunk, h.chunks_per_rank, h.epoch,
            WaitSite{h.err, h.err_claim, h.timeout_ns, h.op, h.rank}},
        epi{h.dst_bases, h.dst_offset, h.flag_bases, h.flag_offset, 32, (N + kBN - 1) / kBN,
            h.rows_per_rank, h.ldc, h.epoch} {}
};

template <typename T>
__global__ void __launch_bounds__(384, 1) CUFLUX_CLUSTER_DIMS(1)
    gemm_hooks_sm90(const __grid_constant__ sm90::TmaDesc tma_a,
                    const __grid_constant__ sm90::TmaDesc tma_b, int M, int N, int K,
                    const int* chunk_order, int chunk_tiles_m, const u32* chunk_flags,
                    int rows_per_chunk, int chunks_per_rank, u32 epoch, u32* err, u32* err_claim,
                    u64 timeout_ns, u32 op, u32 rank, const u64* dst_bases, u64 dst_offset,
                    const u64* flag_bases, u64 flag_offset, int rows_per_rank, long long ldc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = sm90::Config<T, 128, 256, 4, 1, false>;
  const HookArgs h{chunk_order, chunk_tiles_m, chunk_flags, rows_per_chunk, chunks_per_rank,
                   epoch, err, err_claim, timeout_ns, op, rank, dst_bases, dst_offset,
                   flag_bases, flag_offset, rows_per_rank, ldc};
  const FusedHooks<T, Cfg::kBM, Cfg::kBN> hooks(h, M, N);
  sm90::gemm_tiles<Cfg>(&tma_a, &tma_b, M, N, K, hooks.sched, hooks.pro, hooks.epi);
#endif
}

template <typename T>
__global__ void __launch_bounds__(256, 2)
    gemm_hooks_sm80(const T* a, const T* b, int M, int N, int K, const int* chunk_order,
                    int chunk_tiles_m, const u32* chunk_flags, int rows_per_chunk,
                    int chunks_per_rank, u32 epoch, u32* err, u32* err_claim, u64 timeout_ns,
                    u32 op, u32 rank, const u64* dst_bases, u64 dst_offset,
                    const u64* flag_bases, u64 flag_offset, int rows_per_rank, long long ldc) {
  using Cfg = Sm80Cfg<T, false>;
  const HookArgs h{chunk_order, chunk_tiles_m, chunk_flags, rows_per_chunk, chunks_per_rank,
                   epoch, err, err_claim, timeout_ns, op, rank, dst_bases, dst_offset,
                   flag_bases, flag_offset, rows_per_rank, ldc};
  const FusedHooks<T, Cfg::kBM, Cfg::kBN> hooks(h, M, N);
  sm80::gemm_tiles<Cfg>(a, b, M, N, K, hooks.sched, hooks.pro, hooks.epi);
}
