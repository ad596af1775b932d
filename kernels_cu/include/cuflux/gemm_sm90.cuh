// cuflux/gemm_sm90.cuh — the Hopper GEMM core (sm_90a): TMA loads completing on mbarriers,
// a ring of kStages shared-memory stages, wgmma from two consumer warpgroups, one producer warp,
// a persistent grid, optional 2-CTA clusters sharing B through TMA multicast. The hooks
// (scheduler, prologue, epilogue) are in gemm_hooks.cuh.
//
// Problem: C[M, N] = A[M, K] @ B, A row-major [M, K] (K-major), B either [N, K] ("nk", a Linear
// weight, K-major) or [K, N] ("kn", N-major: wgmma reads it transposed). bf16 or fp16 in, fp32
// accumulation. Remainders in M, N and K come free: TMA fills out-of-range elements with zeros
// (and still counts their bytes on the mbarrier), the epilogue skips rows >= M and cols >= N.
//
// CTA = 3 warpgroups. WG0 (producer, 40 registers): thread 0 walks the tiles and, per 64-wide
// K step, waits until the stage is empty, arms full[stage] with the stage's byte count and issues
// the TMA copies. WG1, WG2 (consumers, 232 registers): wait full[stage], issue 4 wgmma (k16)
// per m64 block over their half of the tile rows, keep one wgmma group in flight, release the
// previous stage (arrive on empty[stage], on both CTAs of a cluster), and after the last K step
// run the epilogue straight from registers while the producer already fills the next tile.
//
// Shared memory, per stage (1024-byte aligned: the 128B swizzle pattern is a function of the
// address bits, TMA writes it and wgmma reads it with the same rule):
//   A  [kBM rows][64 k] 128 bytes a row, swizzled in 8-row atoms of 1024 bytes
//   B  "nk": [kBN rows][64 k], same form as A
//      "kn": kBN / 64 boxes of [64 k rows][64 n], 8192 bytes apart
// then, with the TMA-store epilogue (kEpiTma), kEpiBufs staging buffers per consumer warpgroup
// of [kWgRows rows][64 outputs] (2-byte outputs, 128 bytes a row, 128B-swizzled like the
// operands), then full[kStages], empty[kStages] (8-byte mbarriers).
//
// Epilogues: from registers through the hook's writer (any destination, any dtype), or, for a
// local 2-byte output (sm90::TmaStoreEpilogue), each consumer warpgroup converts its rows 64
// columns at a time into a staging buffer and one thread hands it to a TMA store; the
// warpgroup goes on to the next tile while the copy engine writes (it waits only before it
// reuses a buffer the engine is still reading). TMA clips rows >= M and columns >= N.
//
// Ping-pong (kPingpong, opt-in): the two consumer warpgroups work on DIFFERENT tiles, each
// a whole kBM x kBN tile (kBM rows per warpgroup, accumulator <= 128 registers a thread), and
// take turns: tile j of the CTA's sequence (the scheduler's order, unchanged) belongs to
// warpgroup j % 2, so while one runs its epilogue the other runs its main loop. The producer
// is the same ring walk: it fills tile j's stages, then tile j + 1's, in consumption order; a
// stage has one reader (empty counts 1 per CTA), and each warpgroup skips the k_tiles ring
// slots of the other's tiles. An ordering barrier (named barriers 4 + wg) lets warpgroup w
// start tile j only after the other issued all of tile j - 1; that keeps the two main loops
// from competing for the tensor cores AND is what makes the skip safe: a parity wait only
// tells the awaited phase from the one just before it, so a warpgroup may wait on a stage's
// full barrier only once that stage's previous use (the other's tile) has completed.
// Epilogues must not synchronise the two warpgroups (rs_hooks' barrier 6 would deadlock).
//
// Clusters (kClusterM = 2): the two CTAs take vertically adjacent tiles of the same tile
// column; each loads its own A and half of B, multicast to both. A stage is refilled only when
// the consumers of both CTAs released it (empty counts 2 x 2 arrivals), and neither CTA leaves
// before the other is done with its shared memory (cluster barrier at exit).
//
// Waits: the mbarrier waits are pipeline waits inside one CTA (or cluster); each completes as
// soon as this CTA's own producer or consumers move, and they never wait on another rank. The
// only wait on other ranks is the prologue hook's, which is bounded (gemm_hooks.cuh).
#pragma once
#include <cuflux/sync.cuh>

// __cluster_dims__ exists from sm_90 on; below sm_90a the Hopper kernels are empty stubs anyway.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUFLUX_CLUSTER_DIMS(n) __cluster_dims__(n, 1, 1)
#else
#define CUFLUX_CLUSTER_DIMS(n)
#endif
// An instruction without operands that orders memory (a fence, a cluster barrier, a group commit
// or wait), as an inline device function.
#define CUFLUX_ASM_FN(name, ptx) \
  __device__ __forceinline__ void name() { asm volatile(ptx ::: "memory"); }

namespace cuflux {
namespace sm90 {

// A CUtensorMap encoded on the host (cuTensorMapEncodeTiled), passed by value as a
// __grid_constant__ kernel parameter. NVRTC has no <cuda.h>: same size and alignment.
struct alignas(64) TmaDesc {
  u64 words[16];
};

}  // namespace sm90
}  // namespace cuflux

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include <cuflux/gemm_hooks.cuh>
#include <cuflux/gemm_sm90_wgmma.cuh>

namespace cuflux {
namespace sm90 {

template <typename T_, int kBM_, int kBN_, int kStages_, int kClusterM_, bool kBTransposed_,
          bool kEpiTma_ = false, bool kPingpong_ = false>
struct Config {
  using T = T_;
  static constexpr int kBM = kBM_, kBN = kBN_, kBK = 64, kStages = kStages_;
  static constexpr int kClusterM = kClusterM_;
  static constexpr bool kBTransposed = kBTransposed_;  // B given as [K, N] ("kn")
  static constexpr int kConsumers = 2;
  static constexpr bool kPingpong = kPingpong_;  // consumers on alternate tiles (see top)
  static constexpr int kStageReaders = kPingpong ? 1 : kConsumers;  // warpgroups per stage use
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // rows of the tile per consumer warpgroup (ping-pong: the whole tile)
  static constexpr int kWgRows = kPingpong ? kBM : kBM / kConsumers;
  static constexpr int kMmaM = kWgRows / 64;        // m64 blocks per consumer warpgroup
  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr bool kEpiTma = kEpiTma_;          // staging buffers for TMA stores
  static constexpr int kEpiSubBytes = kWgRows * 128;  // [kWgRows][64] 2-byte outputs
  static constexpr int kEpiBufs = kWgRows == 64 ? 2 : 1;
  static constexpr int kEpiBytes = kEpiTma ? kConsumers * kEpiBufs * kEpiSubBytes : 0;
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  static constexpr int kSmemBytes =
      kStages * kStageBytes + kEpiBytes + kBarrierBytes + 1024;  // + alignment slack
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  static_assert(kBM == 128 || kBM == 256, "tile rows: 128 or 256");
  static_assert(kBN == 128 || kBN == 256, "tile columns: 128 or 256");
  static_assert(kClusterM == 1 || kClusterM == 2, "cluster of 1 or 2 CTAs along M");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one SM");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "registers");
  static_assert(!kPingpong || kMmaM * kBN / 2 <= 128,
                "ping-pong: one warpgroup's accumulator must fit in 128 registers a thread");
  static_assert(!kPingpong || !kEpiTma, "ping-pong: register epilogue only (no staging yet)");
};

// ---- PTX wrappers, order and scope in the names --------------------------------------------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// One arrival plus the number of bytes the copies of this phase will deliver.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Pipeline wait (try_wait suspends in hardware for a while before it returns false).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void mbar_arrive_local(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrive on the barrier at the same offset in CTA `cta` of this cluster (a consumer freeing a
// stage that the peer's producer multicasts into). Default semantics, no .release.cluster:
// ptxas has no cluster-scope fence on sm_90 and lowers that to MEMBAR.ALL.GPU + ERRBAR per
// arrive, twice per k-step in the main loop, which ran the 2-CTA configurations at half
// speed. The stage was read only by wgmma, already complete at wgmma.wait_group.
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n"
      ::"r"(bar), "r"(cta) : "memory");
}
__device__ __forceinline__ u32 cluster_cta_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ u32 cluster_id_x() {
  u32 r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ u32 num_clusters_x() {
  u32 r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}
// Every thread of the cluster (not .aligned: the producer warp arrives diverged).
CUFLUX_ASM_FN(cluster_sync_acq_rel,
              "barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;")
CUFLUX_ASM_FN(fence_mbarrier_init_release_cluster, "fence.mbarrier_init.release.cluster;")
// Generic-proxy acquires (a flag) before async-proxy reads (TMA) of the data it published.
CUFLUX_ASM_FN(fence_proxy_async_global, "fence.proxy.async.global;")
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Counts this warp's threads toward `threads` on barrier `id` without waiting (the other side
// of a bar.sync: a signal from one warpgroup to another).
__device__ __forceinline__ void named_barrier_arrive(u32 id, u32 threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void prefetch_tensormap(const TmaDesc* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}
// 2-D tile copy global -> shared, completing `bar`'s transaction count; coordinates are
// (inner, outer) in elements and may lie partly outside the tensor (zero fill).
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
// The same copy delivered to the same offset (data and barrier) in every CTA of `mask`.
__device__ __forceinline__ void tma_load_2d_multicast(u32 dst, const TmaDesc* map, u32 bar, int c0,
                                                      int c1, u16 mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}
// Shared -> global tile copy (coordinates as for loads; out-of-range parts are not written),
// tracked by this thread's bulk async-groups.
__device__ __forceinline__ void tma_store_2d(const TmaDesc* map, u32 src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
               ::"l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(src) : "memory");
}
CUFLUX_ASM_FN(bulk_commit_group, "cp.async.bulk.commit_group;")
// Until at most kPending of this thread's bulk groups still read their shared memory.
template <int kPending> __device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
CUFLUX_ASM_FN(bulk_wait_group_all, "cp.async.bulk.wait_group 0;")
// Generic-proxy shared-memory writes before async-proxy (TMA) reads of them.
CUFLUX_ASM_FN(fence_proxy_async_shared_cta, "fence.proxy.async.shared::cta;")
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ u32 pack2(float v0, float v1, bool f16) {
  if (f16) {
    const __half2 h = __floats2half2_rn(v0, v1);
    return *reinterpret_cast<const u32*>(&h);
  }
  const __nv_bfloat162 b = __floats2bfloat162_rn(v0, v1);
  return *reinterpret_cast<const u32*>(&b);
}

CUFLUX_ASM_FN(wgmma_fence, "wgmma.fence.sync.aligned;")
CUFLUX_ASM_FN(wgmma_commit, "wgmma.commit_group.sync.aligned;")
template <int kPending> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads of the accumulators above the wgmma wait.
template <int kN> __device__ __forceinline__ void fence_registers(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kRegs> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle. K-major operand: 8-row groups of
// 128-byte rows, SBO = 1024 between groups (LBO unused); stepping k16 within the swizzled row
// adds 32 bytes to the start address. MN-major operand: LBO = bytes between 64-element MN
// blocks, SBO = bytes between 8-row K groups (1024).
__device__ __forceinline__ u64 make_desc(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
  return static_cast<u64>((addr & 0x3FFFFu) >> 4) | (static_cast<u64>(lbo_bytes >> 4) << 16) |
         (static_cast<u64>(sbo_bytes >> 4) << 32) | (1ull << 62);
}

// ---- producer ------------------------------------------------------------------------------------
template <class Cfg, class Sched, class Pro>
__device__ __forceinline__ void produce(const TmaDesc* tma_a, const TmaDesc* tma_b, u32 smem,
                                        u32 full, u32 empty, int M, int k_tiles,
                                        const Sched& sched, const Pro& pro, u32 crank,
                                        int cluster, int num_clusters) {
  int stage = 0;
  u32 phase = 0;
  const int slots = sched.num_slots();
  for (int slot = cluster; slot < slots; slot += num_clusters) {
    int tm, tn;
    if (!sched.tile(slot, tm, tn)) continue;
    const int m0 = (tm * Cfg::kClusterM + static_cast<int>(crank)) * Cfg::kBM;
    const int n0 = tn * Cfg::kBN;
    if constexpr (Pro::kWaits) {
      pro.wait_rows(min(m0, M), min(m0 + Cfg::kBM, M));  // failure: recorded, carry on
      fence_proxy_async_global();
    }
    for (int kb = 0; kb < k_tiles; ++kb) {
      const u32 full_bar = full + 8 * stage;
      mbar_wait(empty + 8 * stage, phase ^ 1);  // a fresh barrier passes parity 1 at once
      mbar_arrive_expect_tx(full_bar, Cfg::kStageBytes);
      const u32 a_dst = smem + stage * Cfg::kStageBytes;
      const u32 b_dst = a_dst + Cfg::kABytes;
      const int k0 = kb * Cfg::kBK;
      tma_load_2d(a_dst, tma_a, full_bar, k0, m0);
      if constexpr (!Cfg::kBTransposed) {  // box {64 k, kBN / kClusterM n}
        constexpr int kRows = Cfg::kBN / Cfg::kClusterM;
        const int part = static_cast<int>(crank);
        if constexpr (Cfg::kClusterM == 1)
          tma_load_2d(b_dst, tma_b, full_bar, k0, n0);
        else
          tma_load_2d_multicast(b_dst + part * kRows * 128, tma_b, full_bar, k0,
                                n0 + part * kRows, static_cast<u16>((1 << Cfg::kClusterM) - 1));
      } else {  // boxes {64 n, 64 k}
        constexpr int kBoxes = Cfg::kBN / 64 / Cfg::kClusterM;
#pragma unroll
        for (int j = 0; j < kBoxes; ++j) {
          const int box = static_cast<int>(crank) * kBoxes + j;
          if constexpr (Cfg::kClusterM == 1)
            tma_load_2d(b_dst + box * 8192, tma_b, full_bar, n0 + box * 64, k0);
          else
            tma_load_2d_multicast(b_dst + box * 8192, tma_b, full_bar, n0 + box * 64, k0,
                                  static_cast<u16>((1 << Cfg::kClusterM) - 1));
        }
      }
      if (++stage == Cfg::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
}

// ---- epilogues ---------------------------------------------------------------------------------------
// The plain GEMM's epilogue with TMA stores for bf16 / fp16 outputs (fp32 outputs take the
// register path of the base class). map_c: C [M, N] in the output dtype, box {64, kWgRows},
// 128-byte swizzle.
template <typename BiasT>
struct TmaStoreEpilogue : gemm::StoreEpilogue<BiasT> {
  static constexpr bool kTmaStore = true;
  const TmaDesc* map_c;
};

// One consumer warpgroup's rows of the tile, 64 columns at a time, through its staging buffers.
// buf_turn: the warpgroup's next buffer (the same in all its threads).
template <class Cfg, class Epi>
__device__ __forceinline__ void store_tile_tma(const float (&acc)[Cfg::kMmaM][Cfg::kBN / 2],
                                               const Epi& epi, u32 bufs, int wg, int t, int m0,
                                               int n0, int N, int& buf_turn) {
  const int warp = t / 32, lane = t % 32;
  const bool f16 = epi.out_kind == gemm::kOutF16;
#pragma unroll
  for (int q = 0; q < Cfg::kBN / 64; ++q) {
    const u32 buf = bufs + buf_turn * Cfg::kEpiSubBytes;
    if (t == 0) bulk_wait_group_read<Cfg::kEpiBufs - 1>();  // the engine is done with `buf`
    named_barrier_sync(2 + wg, 128);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {  // 16-byte chunk jj of each 128-byte row
      const int j = q * 8 + jj;
      const int col = n0 + j * 8 + (lane % 4) * 2;
      float2 bias = make_float2(0.0f, 0.0f);
      if (epi.bias != nullptr && col < N) bias = gemm::load2_float(epi.bias + col);
#pragma unroll
      for (int mi = 0; mi < Cfg::kMmaM; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = mi * 64 + warp * 16 + lane / 4 + 8 * h;  // r % 8 == lane / 4
          st_shared_u32(buf + r * 128 + ((jj ^ (lane / 4)) * 16) + (lane % 4) * 4,
                        pack2(acc[mi][4 * j + 2 * h] + bias.x,
                              acc[mi][4 * j + 2 * h + 1] + bias.y, f16));
        }
      }
    }
    fence_proxy_async_shared_cta();
    named_barrier_sync(2 + wg, 128);  // the whole buffer is written
    if (t == 0) {
      tma_store_2d(epi.map_c, buf, n0 + q * 64, m0 + wg * Cfg::kWgRows);
      bulk_commit_group();
    }
    buf_turn = buf_turn + 1 == Cfg::kEpiBufs ? 0 : buf_turn + 1;
  }
}

// ---- consumers -----------------------------------------------------------------------------------
// Ping-pong turn barriers: warpgroup wg waits on kOrderBar + wg, the other arrives on it.
constexpr u32 kOrderBar = 4;

template <class Cfg>
__device__ __forceinline__ void release_stage(u32 empty_bar) {
  if constexpr (Cfg::kClusterM == 1) {
    mbar_arrive_local(empty_bar);
  } else {
#pragma unroll
    for (int cta = 0; cta < Cfg::kClusterM; ++cta) mbar_arrive_cluster(empty_bar, cta);
  }
}

template <class Cfg, class Sched, class Epi>
__device__ __forceinline__ void consume(u32 smem, u32 epi_smem, u32 full, u32 empty, int M, int N,
                                        int k_tiles, const Sched& sched, const Epi& epi,
                                        u32 crank, int cluster, int num_clusters) {
  using T = typename Cfg::T;
  constexpr int kAcc = Cfg::kBN / 2;
  const int wg = static_cast<int>(threadIdx.x) / 128 - 1;
  const int t = static_cast<int>(threadIdx.x) % 128;
  const bool leader = t == 0;
  float acc[Cfg::kMmaM][kAcc];
#pragma unroll
  for (int mi = 0; mi < Cfg::kMmaM; ++mi)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[mi][i] = 0.0f;
  int stage = 0, buf_turn = 0;
  u32 phase = 0;
  int seq = 0;  // ping-pong: tiles of the CTA's sequence met so far, both warpgroups'
  const int slots = sched.num_slots();
  for (int slot = cluster; slot < slots; slot += num_clusters) {
    int tm, tn;
    if (!sched.tile(slot, tm, tn)) continue;
    if constexpr (Cfg::kPingpong) {
      if ((seq++ & 1) != wg) {  // the other warpgroup's tile: skip its k_tiles ring slots
        stage += k_tiles;
        phase ^= static_cast<u32>(stage / Cfg::kStages) & 1u;
        stage %= Cfg::kStages;
        continue;
      }
      // Wait until the other warpgroup has issued tile seq - 2 (our predecessor): every use
      // of a stage before ours then completed, so our parity waits below are unambiguous.
      if (seq > 1) named_barrier_sync(kOrderBar + wg, 256);
    }
    const int m_blk = tm * Cfg::kClusterM + static_cast<int>(crank);
    const int m0 = m_blk * Cfg::kBM, n0 = tn * Cfg::kBN;
    int prev = 0;
    for (int kb = 0; kb < k_tiles; ++kb) {
      mbar_wait(full + 8 * stage, phase);
      // this warpgroup's rows of the stage's A (ping-pong: all of them)
      const u32 a_base =
          smem + stage * Cfg::kStageBytes + (Cfg::kPingpong ? 0 : wg) * Cfg::kWgRows * 128;
      const u32 b_base = smem + stage * Cfg::kStageBytes + Cfg::kABytes;
#pragma unroll
      for (int mi = 0; mi < Cfg::kMmaM; ++mi) fence_registers(acc[mi]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Cfg::kBK / 16; ++kk) {
        const u64 desc_b = Cfg::kBTransposed ? make_desc(b_base + kk * 2048, 8192, 1024)
                                             : make_desc(b_base + kk * 32, 16, 1024);
#pragma unroll
        for (int mi = 0; mi < Cfg::kMmaM; ++mi) {
          const u64 desc_a = make_desc(a_base + mi * 64 * 128 + kk * 32, 16, 1024);
          Wgmma<Cfg::kBN, T>::template mma<Cfg::kBTransposed ? 1 : 0>(acc[mi], desc_a, desc_b,
                                                                       (kb | kk) != 0);
        }
      }
      wgmma_commit();
      if (kb > 0) {
        wgmma_wait<1>();  // the previous step's wgmma are done reading their stage
        if (leader) release_stage<Cfg>(empty + 8 * prev);
      }
      prev = stage;
      if (++stage == Cfg::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    // Ping-pong: every full wait of this tile returned and its wgmma are issued: the other
    // warpgroup's turn (its wgmma queue behind ours while we drain and run the epilogue).
    if constexpr (Cfg::kPingpong) named_barrier_arrive(kOrderBar + (1 - wg), 256);
    wgmma_wait<0>();
#pragma unroll
    for (int mi = 0; mi < Cfg::kMmaM; ++mi) fence_registers(acc[mi]);
    if (leader) release_stage<Cfg>(empty + 8 * prev);

    if constexpr (Epi::kTmaStore) {
      if (epi.out_kind != gemm::kOutF32) {
        store_tile_tma<Cfg>(acc, epi, epi_smem + wg * Cfg::kEpiBufs * Cfg::kEpiSubBytes, wg, t,
                            m0, n0, N, buf_turn);
        continue;
      }
    }
    // Epilogue from registers (see gemm_sm90_wgmma.cuh for the fragment layout).
    const int warp = t / 32, lane = t % 32;
    const int row0 = m0 + (Cfg::kPingpong ? 0 : wg) * Cfg::kWgRows + warp * 16 + lane / 4;
    const int col0 = n0 + (lane % 4) * 2;
    epi.with_writer(m0, n0, [&](const auto& w) {
#pragma unroll
      for (int mi = 0; mi < Cfg::kMmaM; ++mi) {
        const int r = row0 + mi * 64;
#pragma unroll
        for (int j = 0; j < Cfg::kBN / 8; ++j) {
          const int c = col0 + j * 8;
          if (c < N) {
            if (r < M) w.put2(r, c, acc[mi][4 * j], acc[mi][4 * j + 1]);
            if (r + 8 < M) w.put2(r + 8, c, acc[mi][4 * j + 2], acc[mi][4 * j + 3]);
          }
        }
      }
    });
    if constexpr (Epi::kSignalsTiles) {
      if constexpr (Cfg::kPingpong) named_barrier_sync(2 + wg, 128);  // the tile is ours alone
      else named_barrier_sync(1, 128 * Cfg::kConsumers);  // every consumer stored its part
      if ((Cfg::kPingpong || wg == 0) && leader)
        epi.tile_done(m_blk, tn, min(m0, M), min(m0 + Cfg::kBM, M));
    }
  }
  if constexpr (Cfg::kPingpong) {
    // The last tile's owner signalled a successor that does not exist: the other warpgroup
    // takes that arrival, so every bar.arrive meets its bar.sync and the barrier ends idle.
    if (seq > 0 && ((seq - 1) & 1) != wg) named_barrier_sync(kOrderBar + wg, 256);
  }
  if constexpr (Epi::kTmaStore) {
    if (leader) bulk_wait_group_all();  // staging buffers stay valid until the engine is done
  }
}

// ---- the core --------------------------------------------------------------------------------------
// Call from a __global__ function launched with Cfg::kThreads threads, Cfg::kSmemBytes of
// dynamic shared memory, __launch_bounds__(Cfg::kThreads, 1) and
// __cluster_dims__(Cfg::kClusterM, 1, 1); grid = a multiple of kClusterM, at most the clusters
// that fit at once (persistent: every CTA must be resident). tma_a: box {64, kBM} over A [M, K];
// tma_b: "nk" box {64, kBN / kClusterM} over B [N, K], "kn" box {64, 64} over B [K, N]; both
// with 128-byte swizzle and zero fill. sched counts tile rows in units of kClusterM tiles.
template <class Cfg, class Sched, class Pro, class Epi>
__device__ __forceinline__ void gemm_tiles(const TmaDesc* tma_a, const TmaDesc* tma_b, int M, int N,
                                           int K, const Sched& sched, const Pro& pro,
                                           const Epi& epi) {
  static_assert(!Epi::kTmaStore || Cfg::kEpiTma, "a TMA-store epilogue needs kEpiTma staging");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 smem = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const u32 epi_smem = smem + Cfg::kStages * Cfg::kStageBytes;  // 1024-aligned
  const u32 full = epi_smem + Cfg::kEpiBytes;
  const u32 empty = full + 8 * Cfg::kStages;
  const u32 crank = Cfg::kClusterM == 1 ? 0u : cluster_cta_rank();
  const int cluster = static_cast<int>(Cfg::kClusterM == 1 ? blockIdx.x : cluster_id_x());
  const int num_clusters = static_cast<int>(Cfg::kClusterM == 1 ? gridDim.x : num_clusters_x());
  const int k_tiles = (K + Cfg::kBK - 1) / Cfg::kBK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) {
      mbar_init(full + 8 * s, 1);  // the producer's arrive.expect_tx
      // one arrival per reading warpgroup per CTA
      mbar_init(empty + 8 * s, Cfg::kStageReaders * Cfg::kClusterM);
    }
    fence_mbarrier_init_release_cluster();
    prefetch_tensormap(tma_a);
    prefetch_tensormap(tma_b);
  }
  // Barriers initialised (and visible to the peer CTA) before anyone arrives on or copies to them.
  if constexpr (Cfg::kClusterM > 1) cluster_sync_acq_rel();
  else __syncthreads();

  if (threadIdx.x < 128) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0)
      produce<Cfg>(tma_a, tma_b, smem, full, empty, M, k_tiles, sched, pro, crank, cluster,
                   num_clusters);
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    consume<Cfg>(smem, epi_smem, full, empty, M, N, k_tiles, sched, epi, crank, cluster,
                 num_clusters);
  }
  // The peer CTA may still multicast into our stages or arrive on our barriers until it is done.
  if constexpr (Cfg::kClusterM > 1) cluster_sync_acq_rel();
}

}  // namespace sm90
}  // namespace cuflux
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
