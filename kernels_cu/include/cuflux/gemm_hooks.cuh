// cuflux/gemm_hooks.cuh — the three compile-time hooks shared by both GEMM cores
// (gemm_sm90.cuh: TMA + wgmma; gemm_sm80.cuh: cp.async + mma.sync).
//
// C[M, N] = A[M, K] @ B (+ bias) is cut into BM x BN output tiles. A persistent CTA (or, on the
// Hopper core, a cluster of kClusterM CTAs stacked along M) walks "slots" s = id, id + grid,
// id + 2 * grid, ...; at any moment the grid works on a contiguous window of the visit order,
// which is what the hooks below shape:
//
//   scheduler  slot -> tile (tm, tn), or "skip"            (row-major, L2-grouped, rank-offset,
//                                                            caller-given order of M-chunks)
//   prologue   wait_rows(row_begin, row_end) -> bool        before the first A load of a tile
//              (one thread; a bounded wait on the flags of the M-chunks the rows come from)
//   epilogue   with_writer(m0, n0, body): for the tile whose first element is (m0, n0),
//              body(writer) (the epilogue may call it more than once: it only reads the
//              accumulators), writer.put2(row, col, v0, v1) for two adjacent columns (row < M,
//              col + 1 < N checked by the core), then, when
//              kSignalsTiles, tile_done(tm, tn, row_begin, row_end) by one thread after every
//              writer thread of the tile has stored (a named barrier) -> raise per-tile flags.
//              kTmaStore: the Hopper core may instead stage the tile in shared memory and write
//              it with TMA stores (sm90::TmaStoreEpilogue; local outputs only).
//
// Failure policy: a prologue wait that times out records the error (sync.cuh) and returns
// false; the core goes on with whatever data is there, so every CTA still reaches the end of
// the kernel (nothing waits forever, no trap) and the host raises CommTimeoutError. Later waits
// of the same op see op_failed() and return at once.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuflux/sync.cuh>
#include <cuflux/vec.cuh>

namespace cuflux {
namespace gemm {

// ---- tile schedulers ---------------------------------------------------------------------------
// M is cut into chunks of chunk_tiles_m tile rows (one chunk = all of M for a plain GEMM). Chunks
// are visited in the order given by an Order functor; inside a chunk, tiles go in L2-friendly
// groups of group_m tile rows, walking down a group's rows before moving to the next column, so
// a wave of CTAs shares a few A row-panels and a few B column-panels.
// The last chunk may be shorter than chunk_tiles_m: its missing slots are skipped (tile() returns
// false), which keeps slot -> tile a closed formula for every chunk order.

// Position r of a walk over `rows` tile rows in L2 groups of group_m rows (down a group's rows,
// then its next column; the last group may be shorter): the tile row within the walk and the
// tile column. Every tile scheduler walks its tiles this way.
__device__ __forceinline__ void grouped_tile(int r, int rows, int tiles_n, int group_m,
                                             int& row, int& tn) {
  const int group_tiles = group_m * tiles_n;
  const int group = r / group_tiles;
  const int first = group * group_m;
  const int in_group_rows = min(group_m, rows - first);
  const int in_group = r - group * group_tiles;
  row = first + in_group % in_group_rows;
  tn = in_group / in_group_rows;
}

struct NaturalChunks {  // chunk i is visited i-th
  __device__ __forceinline__ int chunk(int i) const { return i; }
};
struct RankOffsetChunks {  // rank r starts at chunk r: at any moment ranks work on different
  int rank, num_chunks;    // chunks (GEMM+ReduceScatter writes to different owners)
  __device__ __forceinline__ int chunk(int i) const { return (i + rank) % num_chunks; }
};
struct ListedChunks {  // caller-given visit order (AllGather+GEMM: order of arrival)
  const int* order;    // device array [num_chunks], a permutation of 0..num_chunks-1
  __device__ __forceinline__ int chunk(int i) const { return order[i]; }
};

template <class Order>
struct ChunkedScheduler {
  int tiles_m, tiles_n;  // tile rows (in units of the core's M step) and tile columns
  int chunk_tiles_m;     // tile rows per chunk (>= 1)
  int group_m;           // tile rows per L2 group (>= 1)
  Order order;

  __device__ __forceinline__ int num_chunks() const {
    return (tiles_m + chunk_tiles_m - 1) / chunk_tiles_m;
  }
  __device__ __forceinline__ int num_slots() const {
    return num_chunks() * chunk_tiles_m * tiles_n;
  }
  // Slot -> (tm, tn). False for the padding slots of a short last chunk.
  __device__ __forceinline__ bool tile(int slot, int& tm, int& tn) const {
    const int per_chunk = chunk_tiles_m * tiles_n;
    const int visit = slot / per_chunk;
    // grouped_tile's walk, written out: the GPU-tested SASS of gemm.cu and ag_gemm.cu came from
    // this form (calling grouped_tile recompiles them differently); fold it in with a GPU run.
    const int r = slot - visit * per_chunk;
    const int group_tiles = group_m * tiles_n;
    const int group = r / group_tiles;
    const int first = group * group_m;
    const int rows = min(group_m, chunk_tiles_m - first);
    const int in_group = r - group * group_tiles;
    tm = order.chunk(visit) * chunk_tiles_m + first + in_group % rows;
    tn = in_group / rows;
    return tm < tiles_m;
  }
};

using GroupedScheduler = ChunkedScheduler<NaturalChunks>;

// ---- prologues -----------------------------------------------------------------------------------
struct NoWait {
  static constexpr bool kWaits = false;
  __device__ __forceinline__ bool wait_rows(int, int) const { return true; }
};

// Rows [c * rows_per_chunk, (c + 1) * rows_per_chunk) of A are valid once flags[c * flag_stride]
// reached `epoch` (written remotely by whoever delivers the chunk: a peer kernel or the host's
// cuStreamWriteValue32 after a DMA copy). Chunk c comes from rank c / chunks_per_rank (reported on
// timeout). The flags live in this rank's memory.
struct ChunkFlagWait {
  static constexpr bool kWaits = true;
  const u32* flags;
  int flag_stride;      // words between consecutive chunk flags (32 = one 128-byte slot each)
  int rows_per_chunk;
  int chunks_per_rank;
  u32 epoch;
  WaitSite site;

  __device__ __forceinline__ bool wait_rows(int row_begin, int row_end) const {
    if (row_end <= row_begin) return true;
    bool ok = true;
    for (int c = row_begin / rows_per_chunk; c <= (row_end - 1) / rows_per_chunk; ++c)
      ok = wait_flag_acquire(flags + static_cast<u64>(c) * flag_stride, epoch, site,
                             static_cast<u32>(c / chunks_per_rank), static_cast<u32>(c)) && ok;
    return ok;
  }
};

// ---- element stores ------------------------------------------------------------------------------
template <typename T> struct Pair2;
template <> struct Pair2<float> {
  __device__ __forceinline__ static void store(float* p, float v0, float v1) {
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  }
  __device__ __forceinline__ static void reduce(float* p, float v0, float v1) {
    atomicAdd(p, v0);
    atomicAdd(p + 1, v1);
  }
};
template <> struct Pair2<__nv_bfloat16> {
  __device__ __forceinline__ static void store(__nv_bfloat16* p, float v0, float v1) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
  }
  __device__ __forceinline__ static void reduce(__nv_bfloat16* p, float v0, float v1) {
    atomicAdd(reinterpret_cast<__nv_bfloat162*>(p), __floats2bfloat162_rn(v0, v1));
  }
};
template <> struct Pair2<__half> {
  __device__ __forceinline__ static void store(__half* p, float v0, float v1) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(v0, v1);
  }
  __device__ __forceinline__ static void reduce(__half* p, float v0, float v1) {
    atomicAdd(reinterpret_cast<__half2*>(p), __floats2half2_rn(v0, v1));
  }
};

template <typename T> __device__ __forceinline__ float2 load2_float(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return __ldg(reinterpret_cast<const float2*>(p));
  } else {
    const unsigned int raw = __ldg(reinterpret_cast<const unsigned int*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
    return make_float2(to_float<T>(e[0]), to_float<T>(e[1]));
  }
}

// ---- epilogues -----------------------------------------------------------------------------------
enum : int { kOutBF16 = 0, kOutF16 = 1, kOutF32 = 2 };

// Plain GEMM: C[row, col] = acc (+ bias[col]) in the output dtype picked at run time (the
// dispatch happens once per tile, not per store).
template <typename BiasT>
struct StoreEpilogue {
  static constexpr bool kSignalsTiles = false;
  static constexpr bool kTmaStore = false;
  void* out;
  long long ldc;          // elements between rows of C
  int out_kind;           // kOutBF16 / kOutF16 / kOutF32
  const BiasT* bias;      // [N] or nullptr

  template <typename OutT> struct Writer {
    OutT* out;
    long long ldc;
    const BiasT* bias;
    __device__ __forceinline__ void put2(int row, int col, float v0, float v1) const {
      if (bias != nullptr) {
        const float2 b = load2_float(bias + col);
        v0 += b.x;
        v1 += b.y;
      }
      Pair2<OutT>::store(out + static_cast<long long>(row) * ldc + col, v0, v1);
    }
  };
  template <class Body> __device__ __forceinline__ void with_writer(int, int, Body&& body) const {
    if (out_kind == kOutF32) {
      body(Writer<float>{static_cast<float*>(out), ldc, bias});
    } else if (out_kind == kOutF16) {
      body(Writer<__half>{static_cast<__half*>(out), ldc, bias});
    } else {
      body(Writer<__nv_bfloat16>{static_cast<__nv_bfloat16*>(out), ldc, bias});
    }
  }
  __device__ __forceinline__ void tile_done(int, int, int, int) const {}
};

// Scatter to owners (GEMM+ReduceScatter): row r belongs to rank r / rows_per_rank and lands at
// row r % rows_per_rank of that rank's buffer, reached through its IPC base pointer
// (dst_bases[owner] + dst_offset bytes; the owner itself included). kReduce adds into the
// destination with atomics (several ranks reduce into one owner), else it stores. After the tile,
// one thread raises flag (tile_index) on every owner the tile touched, with release semantics,
// so the owner's acquire on the flag makes the tile's data visible.
template <typename OutT, bool kReduce>
struct ScatterEpilogue {
  static constexpr bool kSignalsTiles = true;
  static constexpr bool kTmaStore = false;
  const u64* dst_bases;   // device [W]: base pointers of the symmetric buffer on every rank
  u64 dst_offset;         // byte offset of the output region inside the buffer
  const u64* flag_bases;  // device [W]: base pointers of the flag region on every rank
  u64 flag_offset;        // byte offset of flag 0 inside it
  int flag_stride;        // words between consecutive tile flags
  int tiles_n;            // tile index = tm * tiles_n + tn
  int rows_per_rank;
  long long ldc;
  u32 epoch;

  struct Writer {
    const ScatterEpilogue* e;
    __device__ __forceinline__ void put2(int row, int col, float v0, float v1) const {
      const int owner = row / e->rows_per_rank;
      const int local_row = row - owner * e->rows_per_rank;
      OutT* base = reinterpret_cast<OutT*>(e->dst_bases[owner] + e->dst_offset);
      OutT* p = base + static_cast<long long>(local_row) * e->ldc + col;
      if constexpr (kReduce) Pair2<OutT>::reduce(p, v0, v1);
      else Pair2<OutT>::store(p, v0, v1);
    }
  };
  template <class Body> __device__ __forceinline__ void with_writer(int, int, Body&& body) const {
    body(Writer{this});
  }
  // Called by one thread after a barrier over every thread that wrote the tile.
  __device__ __forceinline__ void tile_done(int tm, int tn, int row_begin, int row_end) const {
    if (row_end <= row_begin) return;
    fence_acq_rel_sys();  // the other writer threads' stores (ordered by the barrier) go first
    const u64 index = static_cast<u64>(tm) * tiles_n + tn;
    for (int owner = row_begin / rows_per_rank; owner <= (row_end - 1) / rows_per_rank; ++owner) {
      u32* flag = reinterpret_cast<u32*>(flag_bases[owner] + flag_offset) + index * flag_stride;
      st_release_sys(flag, epoch);
    }
  }
};

}  // namespace gemm
}  // namespace cuflux
