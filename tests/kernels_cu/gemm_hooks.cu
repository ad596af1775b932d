// gemm_hooks.cu (tests only: registered by tests/kernels_cu/__init__.py, never shipped) — the
// two GEMM cores (include/cuflux/gemm_sm90.cuh, gemm_sm80.cuh) instantiated with the fused ops'
// hooks (gemm_hooks.cuh: the AllGather+GEMM prologue, the GEMM+ReduceScatter epilogue), which
// tests/test_gemm.py drives on W ranks without the ops around them.
//
// Shapes: A [M, K] row-major, B [N, K] ("nk"), bf16; each rank's C [M, N] tile by tile is
// added into the owners' outputs [rows_per_rank, N] (bf16, ldc elements between rows).
//
// Push: tiles are visited M-chunk by M-chunk in chunk_order (chunk_tiles_m tile rows each);
// before a tile's A rows are loaded, wait (bounded, ld.acquire.sys) for flags[c * 32] >= epoch
// of every chunk c of rows_per_chunk rows they come from (this rank's memory); the tile is
// added (atomics) into row r % rows_per_rank of rank r / rows_per_rank's output
// (dst_bases[owner] + dst_offset, ldc) through IPC base pointers, then flag
// tm * tiles_n + tn (32 words apart) at flag_bases[owner] + flag_offset is set to epoch
// (st.release.sys). Sync points: the chunk flags (prologue) and the tile flags (epilogue).
//
// The Hopper kernel compiles to an empty body below sm_90a (it is only launched on sm_90a).
#include <cuflux/gemm_hooks.cuh>
#include <cuflux/gemm_sm80.cuh>
#include <cuflux/gemm_sm90.cuh>

using namespace cuflux;

// The kernels' hook arguments (see the header above).
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
__global__ void __launch_bounds__(sm80::kTileThreads, sm80::kTileCtasPerSm)
    gemm_hooks_sm80(const T* a, const T* b, int M, int N, int K, const int* chunk_order,
                    int chunk_tiles_m, const u32* chunk_flags, int rows_per_chunk,
                    int chunks_per_rank, u32 epoch, u32* err, u32* err_claim, u64 timeout_ns,
                    u32 op, u32 rank, const u64* dst_bases, u64 dst_offset,
                    const u64* flag_bases, u64 flag_offset, int rows_per_rank, long long ldc) {
  using Cfg = sm80::TileConfig<T, false>;
  const HookArgs h{chunk_order, chunk_tiles_m, chunk_flags, rows_per_chunk, chunks_per_rank,
                   epoch, err, err_claim, timeout_ns, op, rank, dst_bases, dst_offset,
                   flag_bases, flag_offset, rows_per_rank, ldc};
  const FusedHooks<T, Cfg::kBM, Cfg::kBN> hooks(h, M, N);
  sm80::gemm_tiles<Cfg>(a, b, M, N, K, hooks.sched, hooks.pro, hooks.epi);
}
