// ag_gemm.cu — AllGather + GEMM: C[M, N] = gather_ranks(A_shard) @ B (+ bias), where the gather
// runs on copy engines driven from the host (cuflux/ops/allgather.py) and this kernel consumes
// the gathered rows tile by tile as they land.
//
// Shapes: A gathered [M = W * rows_per_rank, K] row-major, rank p's shard at rows
// [p * rows_per_rank, (p + 1) * rows_per_rank); B [N, K] ("nk", kBTransposed = false) or [K, N]
// ("kn", true), N = this rank's columns; bias [N] in the input dtype or null; C [M, N]
// row-major (ldc = N) in bf16 / fp16 / fp32 (out_kind). K % 8 == 0, N % 8 == 0 (checked in
// cuflux/ops/ag_gemm.py).
//
// Push / pull, remote buffers: the kernel itself reads and writes only this rank's memory. The
// gathered A is local: in pull mode an array this rank's copy streams fill from the peers'
// staging slots, in push mode this rank's symmetric data region that the peers' copy streams
// fill. Nothing remote is touched from the device.
//
// Sync points: one per tile, in the prologue hook (include/cuflux/ag_hooks.cuh): before the
// first TMA / cp.async load of a tile's A rows, one thread waits (bounded, ld.acquire.sys) for
// the flags of every chunk those rows come from; the flags are raised by cuStreamWriteValue32
// after each chunk's copy. On the Hopper core the producer thread waits, then fences the async
// proxy (the TMA loads that follow see what the acquire made visible), and the consumers read
// only stages those loads filled; on the portable core thread 0 waits and a CTA barrier orders
// everyone's loads after it. CTAs never wait for each other, so a grid of any size makes
// progress (the waits depend only on copies queued from the host).
//
// Tile order: persistent CTAs walk "blocks" of block_tiles tile rows in the order block_order
// gives (cuflux/ops/ag_gemm.py visit_order: by the expected arrival of the block's last chunk,
// own shard first, then the peers stage by stage of the transfer order, chunk-major), L2-grouped
// by group_m inside a block. With W = 1 the host passes epoch 0: every wait passes at once.
// With one block of all tile rows the order is exactly the plain GEMM's (kernels_cu/gemm.cu).
//
// The Hopper kernels compile to empty bodies below sm_90a (they are only launched on sm_90a).
#include <cuflux/ag_hooks.cuh>
#include <cuflux/gemm_hooks.cuh>
#include <cuflux/gemm_sm80.cuh>
#include <cuflux/gemm_sm90.cuh>

using namespace cuflux;

// The scheduler and prologue of one call, from the kernel arguments.
struct AgHooks {
  gemm::ChunkedScheduler<gemm::ListedChunks> sched;
  ag::GatheredChunkWait pro;

  __device__ AgHooks(int tiles_m, int tiles_n, const int* block_order, int block_tiles,
                     int group_m, const u32* flags, int max_chunks, int rows_per_rank,
                     int chunk_rows, u32 epoch, u32* err, u32* err_claim, u64 timeout_ns, u32 op,
                     u32 rank)
      : sched{tiles_m, tiles_n, block_tiles, group_m, {block_order}},
        pro{flags, max_chunks, rows_per_rank, chunk_rows, epoch,
            WaitSite{err, err_claim, timeout_ns, op, rank}} {}
};

// ---- Hopper ---------------------------------------------------------------------------------------
// Launch: 384 threads, Config::kSmemBytes of dynamic shared memory, a persistent grid of at most
// one CTA per SM. tma_a: box {64, kBM} over the gathered A; tma_b: "nk" box {64, kBN} over
// B [N, K], "kn" box {64, 64} over B [K, N]; tma_c (kEpiTma, 2-byte outputs): box {64, kBM / 2}
// over C, else not read.
template <typename T, int kBM, int kBN, int kStages, bool kBTransposed, bool kEpiTma>
__global__ void __launch_bounds__(384, 1) CUFLUX_CLUSTER_DIMS(1)
    ag_gemm_sm90(const __grid_constant__ sm90::TmaDesc tma_a,
                 const __grid_constant__ sm90::TmaDesc tma_b,
                 const __grid_constant__ sm90::TmaDesc tma_c, int M, int N, int K, void* out,
                 long long ldc, int out_kind, const T* bias, const int* block_order,
                 int block_tiles, int group_m, const u32* flags, int max_chunks,
                 int rows_per_rank, int chunk_rows, u32 epoch, u32* err, u32* err_claim,
                 u64 timeout_ns, u32 op, u32 rank) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = sm90::Config<T, kBM, kBN, kStages, 1, kBTransposed, kEpiTma>;
  const AgHooks h((M + kBM - 1) / kBM, (N + kBN - 1) / kBN, block_order, block_tiles, group_m,
                  flags, max_chunks, rows_per_rank, chunk_rows, epoch, err, err_claim,
                  timeout_ns, op, rank);
  if constexpr (kEpiTma) {
    const sm90::TmaStoreEpilogue<T> epi{{out, ldc, out_kind, bias}, &tma_c};
    sm90::gemm_tiles<Cfg>(&tma_a, &tma_b, M, N, K, h.sched, h.pro, epi);
  } else {
    const gemm::StoreEpilogue<T> epi{out, ldc, out_kind, bias};
    sm90::gemm_tiles<Cfg>(&tma_a, &tma_b, M, N, K, h.sched, h.pro, epi);
  }
#endif
}

// ---- portable ---------------------------------------------------------------------------------------
// The core's one tile (sm80::TileConfig, as gemm.cu's portable kernel), so that both produce the
// same bits for the same tile: 128 x 128 x 32 tiles, 4 stages, 8 warps; 256 threads, 2 CTAs per SM.
template <typename T, bool kBTransposed>
__global__ void __launch_bounds__(sm80::kTileThreads, sm80::kTileCtasPerSm)
    ag_gemm_sm80(const T* a, const T* b, int M, int N, int K, void* out, long long ldc,
                 int out_kind, const T* bias, const int* block_order, int block_tiles,
                 int group_m, const u32* flags, int max_chunks, int rows_per_rank,
                 int chunk_rows, u32 epoch, u32* err, u32* err_claim, u64 timeout_ns, u32 op,
                 u32 rank) {
  using Cfg = sm80::TileConfig<T, kBTransposed>;
  const AgHooks h((M + Cfg::kBM - 1) / Cfg::kBM, (N + Cfg::kBN - 1) / Cfg::kBN, block_order,
                  block_tiles, group_m, flags, max_chunks, rows_per_rank, chunk_rows, epoch, err,
                  err_claim, timeout_ns, op, rank);
  const gemm::StoreEpilogue<T> epi{out, ldc, out_kind, bias};
  sm80::gemm_tiles<Cfg>(a, b, M, N, K, h.sched, h.pro, epi);
}
