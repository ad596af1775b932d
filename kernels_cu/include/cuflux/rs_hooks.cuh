// cuflux/rs_hooks.cuh — the GEMM core hooks of GEMM + ReduceScatter (kernels_cu/gemm_rs.cu):
// a rank-offset tile scheduler and an epilogue that sends each output tile to the rank owning
// its rows and, on that owner, reduces the W partials of the tile.
//
// Problem: rank r holds a partial C_r [M, N] (its GEMM with its slice of K); rank o must end
// with out_o = sum_r C_r[o * R : (o + 1) * R] (+ bias), R = M / W rows per rank.
//
// Push, one tile at a time. For a tile of rows [m0, m0 + kBM) (which may cover several owners
// when R is not a multiple of kBM), in the epilogue of the CTA that computed it:
//   A. every element goes to the memory of the rank o owning its row (this rank included):
//      deterministic mode stores it into o's slot for this source rank,
//      data[o][me][row - o * R][col]; atomic mode adds it (red.add, bf16x2 / f16x2 / f32) into
//      o's acc[row - o * R][col]. Then (barrier over the epilogue threads) one thread raises,
//      after one fence.acq_rel.sys, with relaxed system-scope stores, this tile's flag for
//      source `me` in the memory of every other owner the tile touches;
//   B. if the tile holds rows of this rank, the same thread waits (bounded, acquire) for the
//      tile's flags of every peer, a barrier releases the others, and all epilogue threads
//      finish this rank's rows of the tile in 16-byte vectors: deterministic: the W slots
//      summed in fp32 in rank order 0..W-1 (bit-identical run to run); atomic: the
//      accumulator, which is then reset to 0; plus bias (added once, here, by the owner);
//      stored into this rank's output.
// The signalling thread is the first epilogue thread; the core hands the epilogue the tile's
// first element (m0, n0). At W = 1 there is nobody to send to or wait for: each element goes
// straight to the output as B would finish it (no slot round trip, no barrier). Keeping this
// rank's partial in registers at W > 1 too (skipping its slot) was written and compiled, not
// kept: it reads the peers' slots one element pair at a time in the core's fragment order
// (dependent loads; B's 16-byte vectors keep 4 rows in flight) and the kernels grew 6x.
//
// Remote buffers (one symmetric allocation per op, offsets from the Python Layout):
//   data   deterministic [2][W][R_max][N], atomic [2][R_max][N], output dtype; the first index
//          is the call's parity (epoch & 1): call e+2 can only start writing a buffer once
//          every owner finished call e (each rank's call e+1 waited for every rank's tiles,
//          so every rank had finished call e), hence no "buffer free" flag is needed.
//   flags  u64 [tiles][flag_stride]: word p of tile t = epoch of call in which source rank p
//          delivered its part of tile t (tile index tm * tiles_n + tn); lives in the owner's
//          memory, written only by p.
// Epochs live in device memory, as AllReduce's do: state[0] = calls of the op completed on
// this rank; every thread reads it (+ 1: this call's epoch) as its CTA starts, and the last CTA
// to finish (state[1] counts them out) stores the new count. A call's epoch and parity are
// thus no launch arguments, so calls can be captured in a CUDA graph and replayed; 64-bit
// epochs never wrap, so the flags are never re-armed.
//
// Tile order (RsScheduler): rank me visits tile rows starting after its own rows and wrapping
// around (owner me+1 first, then me+2, ...: at any moment the ranks write into different
// owners), its own tile rows last, in the same L2 groups as the others (a group's rows column
// by column; row by row, at W = 1 the whole kernel would stream B from DRAM). Own tiles are the
// only ones that wait, a tile's part is always delivered before its wait, so every rank
// delivers all of its peers' tiles without waiting; and because every rank walks a tile row
// shared with a neighbour in increasing tn, no cycle of waits can form (tests/test_gemm_rs.py
// simulates the protocol on many shapes and grids). The grid must be co-resident (persistent
// CTAs never wait for a CTA that is not running), which the Python side ensures.
#pragma once
#include <cuflux/gemm_hooks.cuh>
#include <cuflux/sync.cuh>

namespace cuflux {
namespace rs {

// ---- scheduler ---------------------------------------------------------------------------------
// Slot -> tile. Peers' tile rows (positions 0 .. tiles_m - num_own - 1, tile row = position +
// rot mod tiles_m) in L2 groups of group_m rows (walk down a group's rows, then the next
// column), then the num_own own tile rows grouped the same way. cuflux/ops/gemm_rs.py
// tile_order() mirrors this for the CPU tests.
struct RsScheduler {
  int tiles_m, tiles_n;
  int group_m;  // >= 1
  int rot;      // first tile row visited: the one after this rank's own rows
  int num_own;  // tile rows holding rows of this rank (>= 1)

  __device__ __forceinline__ int num_slots() const { return tiles_m * tiles_n; }
  __device__ __forceinline__ bool tile(int slot, int& tm, int& tn) const {
    const int peer_rows = tiles_m - num_own;
    const int peer_slots = peer_rows * tiles_n;
    int pos;
    if (slot < peer_slots) {
      gemm::grouped_tile(slot, peer_rows, tiles_n, group_m, pos, tn);
    } else {  // own tile rows, grouped the same way (each tile row still walked in tn order)
      gemm::grouped_tile(slot - peer_slots, num_own, tiles_n, group_m, pos, tn);
      pos += peer_rows;
    }
    tm = pos + rot;
    if (tm >= tiles_m) tm -= tiles_m;
    return true;
  }
};


// ---- the threads that run the epilogue ----------------------------------------------------------
struct CtaSync {  // the portable core and the comm-only kernel: the whole CTA
  __device__ __forceinline__ static int thread() { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ static int count() { return static_cast<int>(blockDim.x); }
  __device__ __forceinline__ static void sync() { __syncthreads(); }
};
// The Hopper core: its two consumer warpgroups, threads 128..383 (the producer warpgroup does
// not run the epilogue). Not .aligned: the thread that waited arrives after a divergent spin.
// Barrier 6 is used by no core.
struct ConsumerSync {
  __device__ __forceinline__ static int thread() { return static_cast<int>(threadIdx.x) - 128; }
  __device__ __forceinline__ static int count() { return 256; }
  __device__ __forceinline__ static void sync() {
    asm volatile("barrier.sync 6, 256;" ::: "memory");
  }
};

// ---- vector reductions into an owner's accumulator ---------------------------------------------
// red.add of two adjacent elements, relaxed, at system scope (the ranks adding into one
// accumulator may sit on different GPUs). The atomic-mode data path; ordering comes from the
// tile flag's release that follows. sm_90: one bf16x2 / f16x2 / f32x2 reduction; below, f16x2
// and scalar f32 reductions, and a compare-and-swap loop for bf16x2 (no bf16 red before sm_90).
template <typename T> struct Red2;
template <> struct Red2<float> {
  __device__ __forceinline__ static void add(float* p, float v0, float v1) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.sys.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v0), "f"(v1)
                 : "memory");
#else
    asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(p), "f"(v0) : "memory");
    asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(p + 1), "f"(v1) : "memory");
#endif
  }
};
template <> struct Red2<__half> {
  __device__ __forceinline__ static void add(__half* p, float v0, float v1) {
    const __half2 h = __floats2half2_rn(v0, v1);
    asm volatile("red.relaxed.sys.global.add.noftz.f16x2 [%0], %1;"
                 ::"l"(p), "r"(*reinterpret_cast<const u32*>(&h)) : "memory");
  }
};
template <> struct Red2<__nv_bfloat16> {
  __device__ __forceinline__ static void add(__nv_bfloat16* p, float v0, float v1) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(v0, v1);
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.sys.global.add.noftz.bf16x2 [%0], %1;"
                 ::"l"(p), "r"(*reinterpret_cast<const u32*>(&b)) : "memory");
#else
    u32* word = reinterpret_cast<u32*>(p);
    u32 seen = *reinterpret_cast<volatile u32*>(word), assumed;
    do {
      assumed = seen;
      const __nv_bfloat162 sum = __hadd2(*reinterpret_cast<const __nv_bfloat162*>(&assumed), b);
      seen = atomicCAS_system(word, assumed, *reinterpret_cast<const u32*>(&sum));
    } while (seen != assumed);
#endif
  }
};

template <typename T, int kBytes>
__device__ __forceinline__ void add_vec(float (&acc)[kBytes / sizeof(T)], const RawVec<kBytes>& r) {
  const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
  for (int j = 0; j < int(kBytes / sizeof(T)); ++j) acc[j] += to_float<T>(e[j]);
}

// ---- epilogue ----------------------------------------------------------------------------------
// BiasT: the input dtype (bias [N] is in it, 16-byte aligned). Output dtype chosen at run time:
// BiasT, or float when out_f32 (the comm-only kernel calls run<OutT>() directly). kBM x kBN:
// the core's tile. Sync: the threads that run the epilogue.
template <typename BiasT, int kBM, int kBN, bool kAtomic, class Sync>
struct RsEpilogue {
  static constexpr bool kSignalsTiles = false;  // signals and waits happen inside with_writer
  static constexpr bool kTmaStore = false;
  void* out;               // this rank's output [R, N] (local, 16-byte aligned)
  int out_f32;             // output (and data) dtype: float, else BiasT
  const BiasT* bias;       // [N] or nullptr
  const u64* bases;        // device [W]: base of the op's symmetric buffer on every rank
  u64 data_off;            // byte offset of data[parity] (parity: epoch & 1)
  u64 slot_bytes;          // deterministic: bytes between the slots of two source ranks
  u64 flags_off;           // byte offset of the flag region
  int flag_stride;         // words per tile in the flag region (>= W)
  int M, N, tiles_n;
  int rows_per_rank;       // R
  int world_size, rank;
  u64 epoch;               // this call's (state[0] + 1, read as the CTA started)
  WaitSite site;
  // A wait of this op on this rank gave up in an earlier call (sync.cuh op_gave_up), read once
  // at the kernel's start and agreed across the CTA (gemm_rs.cu RsHooks): no tile is sent (an
  // owner may still read data[parity] of two calls ago) and none finished; the host raises.
  bool gave_up;

  // Phase A: every element goes to its owner (this rank included): the owner's slot for this
  // source, or added into the owner's accumulator.
  template <typename OutT> struct Send {
    const RsEpilogue* e;
    // Owner cache (registers after inlining): rows [lo, hi) go to dst + (row - lo) * N + col.
    // Refilled only when a row leaves the cached owner's range (once per tile per thread, plus
    // once per owner boundary the thread's rows cross), so the division by rows_per_rank and
    // the bases[o] load leave the per-pair path.
    mutable int lo = 1, hi = 0;
    mutable OutT* dst = nullptr;
    __device__ __forceinline__ void put2(int row, int col, float v0, float v1) const {
      if (row < lo || row >= hi) {
        const int o = row / e->rows_per_rank;
        lo = o * e->rows_per_rank;
        hi = lo + e->rows_per_rank;
        char* base = reinterpret_cast<char*>(e->bases[o] + e->data_off);
        if constexpr (!kAtomic) base += e->rank * e->slot_bytes;
        dst = reinterpret_cast<OutT*>(base);
      }
      OutT* p = dst + static_cast<long long>(row - lo) * e->N + col;
      if constexpr (kAtomic) {
        Red2<OutT>::add(p, v0, v1);
      } else {
        gemm::Pair2<OutT>::store(p, v0, v1);
      }
    }
  };

  // W = 1: no peer to send to or wait for: every element goes straight to the output, as
  // phase B would finish it (the partial rounded to the output dtype as a slot holds it, + bias
  // in fp32), without the round trip through the slot.
  template <typename OutT> struct Direct {
    const RsEpilogue* e;
    __device__ __forceinline__ void put2(int row, int col, float v0, float v1) const {
      float s0 = to_float<OutT>(from_float<OutT>(v0)), s1 = to_float<OutT>(from_float<OutT>(v1));
      if (e->bias != nullptr) {
        const float2 b = gemm::load2_float(e->bias + col);
        s0 += b.x;
        s1 += b.y;
      }
      gemm::Pair2<OutT>::store(static_cast<OutT*>(e->out) + static_cast<long long>(row) * e->N + col,
                               s0, s1);
    }
  };

  // One thread, after phase A of tile (tm, tn): release the tile to the other owners it
  // touches; if it holds rows of this rank, wait for every peer's part of it.
  __device__ __forceinline__ void signal_and_wait(int tm, int tn) const {
    const int row_begin = tm * kBM, row_end = min(row_begin + kBM, M);
    const u64 tile = static_cast<u64>(tm) * tiles_n + tn;
    const int o_lo = row_begin / rows_per_rank, o_hi = (row_end - 1) / rows_per_rank;
    // One system-scope fence orders the other threads' phase-A stores (ordered before this
    // thread by the barrier; the fence is cumulative) before every flag below, which can then
    // be relaxed stores (st.release would fence again per owner). A deterministic tile of this
    // rank's rows alone signals nobody and is read back only by this CTA, which the barrier
    // after the wait orders: no fence (a MEMBAR.SYS) for it. Atomic mode keeps the fence: its
    // own red.adds are system-scope and peers add into the same accumulator.
    if (kAtomic || o_lo != rank || o_hi != rank) fence_acq_rel_sys();
    for (int o = o_lo; o <= o_hi; ++o) {
      if (o == rank) continue;
      u64* flag = reinterpret_cast<u64*>(bases[o] + flags_off) + tile * flag_stride + rank;
      st_relaxed_sys(flag, epoch);
    }
    if (o_lo <= rank && rank <= o_hi) {
      const u64* flags = reinterpret_cast<const u64*>(bases[rank] + flags_off) + tile * flag_stride;
      for (int p = 0; p < world_size; ++p)
        if (p != rank) wait_flag_acquire(flags + p, epoch, site, p, static_cast<u32>(tile));
      // On failure the error is recorded and the tile is finished with whatever is there; the
      // host raises CommTimeoutError (no trap: every CTA reaches the end of the kernel).
    }
  }

  // Phase B: this rank's rows of tile (tm, tn), 16-byte vectors: out = sum of the W slots in
  // rank order 0..W-1 (deterministic) or the accumulator (atomic, then reset to 0 for the call
  // after next), + bias, in fp32. Each epilogue thread keeps one 16-byte column of the tile and
  // walks its rows, kRows at a time: the bias is loaded once a tile, kRows loads (per rank) are
  // in flight before any is summed, and no index needs a division.
  template <typename OutT> __device__ __forceinline__ void finish(int tm, int tn) const {
    constexpr int kElems = 16 / sizeof(OutT);
    constexpr int kVpr = kBN / kElems;  // 16-byte vectors in a full tile row (<= 64 <= threads)
    constexpr int kRows = 4;
    const int me = rank, R = rows_per_rank;
    const int r_lo = max(tm * kBM, me * R), r_hi = min(min(tm * kBM + kBM, M), (me + 1) * R);
    if (r_lo >= r_hi) return;
    const int t = Sync::thread(), rows_per_pass = Sync::count() / kVpr;
    const int col = tn * kBN + (t % kVpr) * kElems;
    if (t >= rows_per_pass * kVpr || col >= N) return;  // past a short last tile column
    constexpr int kBiasBytes = kElems * sizeof(BiasT);
    float b[kElems];
#pragma unroll
    for (int j = 0; j < kElems; ++j) b[j] = 0.0f;
    if (bias != nullptr) add_vec<BiasT, kBiasBytes>(b, ld_nc<kBiasBytes>(bias + col));
    const char* local = reinterpret_cast<const char*>(bases[me] + data_off);
    for (int r0 = r_lo + t / kVpr; r0 < r_hi; r0 += kRows * rows_per_pass) {
      // element index of row u of this pass (past the end: the last row, loaded but unused);
      // recomputed where used rather than kept live across the rank loop
      const auto idx = [&](int u) {
        return static_cast<long long>(min(r0 + u * rows_per_pass, r_hi - 1) - me * R) * N + col;
      };
      float acc[kRows][kElems];
#pragma unroll
      for (int u = 0; u < kRows; ++u)
#pragma unroll
        for (int j = 0; j < kElems; ++j) acc[u][j] = 0.0f;
      if constexpr (kAtomic) {
        OutT* accum = reinterpret_cast<OutT*>(const_cast<char*>(local));
        RawVec<16> part[kRows];
#pragma unroll
        for (int u = 0; u < kRows; ++u) part[u] = ld_plain<16>(accum + idx(u));
        RawVec<16> zero;
        zero.v = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < kRows; ++u) {
          add_vec<OutT, 16>(acc[u], part[u]);
          if (r0 + u * rows_per_pass < r_hi) st_na<16>(accum + idx(u), zero);
        }
      } else {
        for (int p = 0; p < world_size; ++p) {  // rank order 0..W-1: bit-identical sums
          const OutT* slot = reinterpret_cast<const OutT*>(local + p * slot_bytes);
          RawVec<16> part[kRows];
#pragma unroll
          for (int u = 0; u < kRows; ++u) part[u] = ld_plain<16>(slot + idx(u));
#pragma unroll
          for (int u = 0; u < kRows; ++u) add_vec<OutT, 16>(acc[u], part[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        if (r0 + u * rows_per_pass >= r_hi) continue;
        RawVec<16> packed;
        OutT* pe = reinterpret_cast<OutT*>(&packed);
#pragma unroll  // + bias after the sum, as before (b is 0 + bias: the same fp32 value)
        for (int j = 0; j < kElems; ++j) pe[j] = from_float<OutT>(acc[u][j] + b[j]);
        st_na<16>(static_cast<OutT*>(out) + idx(u), packed);
      }
    }
  }

  // The tile whose first element is (m0, n0); body(writer) calls writer.put2 for each of its
  // elements the calling thread holds (run by every epilogue thread).
  template <typename OutT, class Body>
  __device__ __forceinline__ void run(int m0, int n0, Body& body) const {
    if (world_size == 1) {
      body(Direct<OutT>{this});
      return;
    }
    if (gave_up) return;  // the same on every thread of the CTA: no barrier is left unmet
    const int tm = m0 / kBM, tn = n0 / kBN;
    const bool mine = m0 < (rank + 1) * rows_per_rank && min(m0 + kBM, M) > rank * rows_per_rank;
    body(Send<OutT>{this});
    Sync::sync();  // every phase-A store precedes the releases (and this CTA's finish loads)
    if (Sync::thread() == 0) signal_and_wait(tm, tn);
    if (mine) {
      Sync::sync();  // the acquires precede the loads of finish()
      finish<OutT>(tm, tn);
    }
  }
  template <class Body> __device__ __forceinline__ void with_writer(int m0, int n0, Body&& body) const {
    if (out_f32) run<float>(m0, n0, body);
    else run<BiasT>(m0, n0, body);
  }
};

}  // namespace rs
}  // namespace cuflux
