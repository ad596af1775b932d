// cuflux/sync.cuh — memory-ordered flag operations and bounded waits.
//
// Rules every kernel follows (DESIGN.md section 3):
//   writer: data stores, then st_release_sys(flag, epoch)  -> the data is visible before the flag;
//   reader: wait_flag_acquire(flag, epoch, ...) then reads  -> reads see what the writer stored.
// Flags are epoch counters (call i writes i; AllReduce's START slots i * 8 + chunk + 1, still
// growing call to call: a timeout's record then shows those values, not the epoch) and are
// compared with wrap-around arithmetic, so
// nothing resets them between calls. Two widths: 32-bit flags for ops whose host counts the
// calls (CommOp re-arms them every 2^30 calls, long before a stale slot could compare as
// reached at 2^31), 64-bit flags for ops whose epoch lives in device memory (AllReduce,
// All2AllHeads, GemmReduceScatter: a replayed CUDA graph calls them without the host, so
// nothing could re-arm; 2^63 calls never come). A rank waits only on flags in its own memory; peers write
// them remotely through IPC pointers (no peer atomics: they fail over PCIe).
//
// Every wait is bounded by a wall-clock budget read from %globaltimer (nanoseconds; unlike
// clock64 it keeps counting while another process holds the GPU). On expiry the first waiter
// records (op, rank, peer, observed, expected) in the op's error record, which lives in pinned
// host memory so the host reads it without synchronising, and returns false. No trap: a trap
// poisons the CUDA context and the process could do nothing afterwards.
#pragma once
// No <cstdint>: NVRTC has no standard library headers without CCCL on its include path.

namespace cuflux {

using u32 = unsigned int;
using u64 = unsigned long long;
using u16 = unsigned short;
using u8 = unsigned char;

// ---- ordered loads and stores, order and scope in the name ---------------------------------
// One set per flag width: u32 (host-counted epochs), u64 (device-counted epochs). REG is the
// asm operand constraint of the width ("r" 32-bit, "l" 64-bit register).
#define CUFLUX_SYS_ACCESS(T, PTX, REG)                                                           \
  __device__ __forceinline__ T ld_acquire_sys(const T* p) {                                      \
    T v;                                                                                           \
    asm volatile("ld.acquire.sys.global." PTX " %0, [%1];" : "=" REG(v) : "l"(p) : "memory");    \
    return v;                                                                                      \
  }                                                                                                \
  __device__ __forceinline__ T ld_relaxed_sys(const T* p) {                                      \
    T v;                                                                                           \
    asm volatile("ld.relaxed.sys.global." PTX " %0, [%1];" : "=" REG(v) : "l"(p) : "memory");    \
    return v;                                                                                      \
  }                                                                                                \
  __device__ __forceinline__ void st_release_sys(T* p, T v) {                                    \
    asm volatile("st.release.sys.global." PTX " [%0], %1;" ::"l"(p), REG(v) : "memory");         \
  }                                                                                                \
  __device__ __forceinline__ void st_relaxed_sys(T* p, T v) {                                    \
    asm volatile("st.relaxed.sys.global." PTX " [%0], %1;" ::"l"(p), REG(v) : "memory");         \
  }
CUFLUX_SYS_ACCESS(u32, "u32", "r")
CUFLUX_SYS_ACCESS(u64, "u64", "l")
#undef CUFLUX_SYS_ACCESS
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// "Reached" means the signed distance is not negative (wrap-around safe within half the range).
__device__ __forceinline__ bool epoch_reached(u32 observed, u32 expected) {
  return static_cast<int>(observed - expected) >= 0;
}
__device__ __forceinline__ bool epoch_reached(u64 observed, u64 expected) {
  return static_cast<long long>(observed - expected) >= 0;
}

// ---- error record -----------------------------------------------------------------------------
// One per op and rank, in pinned host memory, mirrored by cuflux/errors.py (ErrorRecord).
// Words: [0] status (0 ok, 1 timeout, 2 aborted by host), [1] op code, [2] rank, [3] peer,
// [4] observed, [5] expected, [6] flag index, [7] abort request (host writes 1 to release
// every waiter, e.g. when it tears an op down after a failure), [8..9] device pointer of this
// rank's failure-board word, [10..11] device pointer of the W board words' device pointers,
// [12] W (0: no board). The board (cuflux/errors.py FailureBoard) is host memory shared by the
// op's ranks: the first waiter to fail writes 1 + its rank into every rank's word, so queued and
// running work of the op on every rank gives up at its next check instead of waiting out its
// own timeout, and every rank's host raises (#19 item 1).
// The claim word (device memory, one per record) makes sure only the first waiter writes, and
// once set says that a wait of the op on this rank gave up (op_gave_up below).
// 3 is All2AllHeads' kStatusMismatch; kStatusPeerFailed: this rank's wait gave up because another
// rank failed the op and told it (the record's peer: whom it was waiting for).
enum : u32 { kStatusOk = 0, kStatusTimeout = 1, kStatusAborted = 2, kStatusPeerFailed = 4 };
enum : int { kErrStatus = 0, kErrOp, kErrRank, kErrPeer, kErrObserved, kErrExpected, kErrIndex,
             kErrAbort, kErrBoardLo, kErrBoardHi, kErrPeersLo, kErrPeersHi, kErrWorld, kErrWords };

struct WaitSite {
  u32* err;         // error record (pinned host memory, kErrWords words)
  u32* err_claim;   // device word: 0 until a waiter claims the record
  u64 timeout_ns;   // budget for one wait
  u32 op;           // op code (cuflux/errors.py OP_CODES)
  u32 rank;         // this rank
};

__device__ __forceinline__ void record_error(const WaitSite& s, u32 status, u32 peer, u32 observed,
                                             u32 expected, u32 index) {
  if (atomicCAS(s.err_claim, 0u, 1u) == 0u) {
    volatile u32* e = s.err;
    if (e[kErrStatus] != 0u) return;  // the host (a host exchange, the watchdog) recorded first
    e[kErrOp] = s.op; e[kErrRank] = s.rank; e[kErrPeer] = peer;
    e[kErrObserved] = observed; e[kErrExpected] = expected; e[kErrIndex] = index;
    __threadfence_system();
    e[kErrStatus] = status;
    __threadfence_system();
    // Tell every rank (this one included); a word already written keeps the first teller. A
    // wait that gave up because it was told tells nobody: the teller wrote every word.
    const u32 world = status == kStatusPeerFailed ? 0u : e[kErrWorld];
    const u64* table = reinterpret_cast<const u64*>(
        (static_cast<u64>(e[kErrPeersHi]) << 32) | e[kErrPeersLo]);
    for (u32 p = 0; p < world && table != nullptr; ++p) {
      volatile u32* word = reinterpret_cast<volatile u32*>(table[p]);
      if (*word == 0u) *word = s.rank + 1u;
    }
    __threadfence_system();
  }
}

// True once the host asked to abort, another waiter of this op already failed, or another rank
// failed the op and told this one (its board word). Host-mapped reads: called off the fast path.
__device__ __forceinline__ bool op_failed(const WaitSite& s) {
  volatile const u32* e = s.err;
  if (e[kErrAbort] != 0u || e[kErrStatus] != 0u) return true;
  const u64 board = (static_cast<u64>(e[kErrBoardHi]) << 32) | e[kErrBoardLo];
  return board != 0u && *reinterpret_cast<volatile const u32*>(board) != 0u;
}

// True once a wait of this op on this rank gave up (timed out, was told by a rank that failed
// the op, or saw the host's abort request): every give-up sets the record's claim word, device
// memory, so a kernel reads it at its start for the price of one cached load. (The host's
// abort itself writes no claim: a call whose previous call met every peer may still store.) A call queued behind a call
// whose waits gave up must not store into shared or remote buffers: the double-buffering that
// makes those stores safe assumes the call before met every peer, and a late peer may still be
// reading the buffer of two calls ago (#19 item 1).
__device__ __forceinline__ bool op_gave_up(const u32* err_claim) {
  return *reinterpret_cast<volatile const u32*>(err_claim) != 0u;
}

// Spin (one thread) until *flag has reached `expected`, with acquire semantics at system scope.
// Returns false on timeout or abort, after recording who waited for whom (the error record keeps
// the low 32 bits of a 64-bit epoch).
template <typename E>
__device__ __forceinline__ bool wait_epoch_acquire(const E* flag, E expected, const WaitSite& s,
                                                   u32 peer, u32 index) {
  E v = ld_acquire_sys(flag);
  if (epoch_reached(v, expected)) return true;
  const u64 start = globaltimer_ns();
  for (u32 iter = 1;; ++iter) {
    v = ld_acquire_sys(flag);
    if (epoch_reached(v, expected)) return true;
    if ((iter & 255u) == 0u) {
      if (op_failed(s)) {  // someone already reported, here or on a rank that told us: leave
        // Record whom this wait was for, unless the host aborted (or ours already recorded:
        // the record keeps its first writer).
        if (s.err[kErrAbort] == 0u)
          record_error(s, kStatusPeerFailed, peer, static_cast<u32>(v), static_cast<u32>(expected),
                       index);
        else
          atomicCAS(s.err_claim, 0u, 1u);  // the host's abort: nothing to record; it gave up
        return false;
      }
      if (globaltimer_ns() - start > s.timeout_ns) {
        record_error(s, kStatusTimeout, peer, static_cast<u32>(v), static_cast<u32>(expected),
                     index);
        return false;
      }
      __nanosleep(128);  // ranks may time-share one GPU: let the writer's context run
    }
  }
}
__device__ __forceinline__ bool wait_flag_acquire(const u32* flag, u32 expected, const WaitSite& s,
                                                  u32 peer, u32 index) {
  return wait_epoch_acquire<u32>(flag, expected, s, peer, index);
}
__device__ __forceinline__ bool wait_flag_acquire(const u64* flag, u64 expected, const WaitSite& s,
                                                  u32 peer, u32 index) {
  return wait_epoch_acquire<u64>(flag, expected, s, peer, index);
}

// ---- device-counted epochs (AllReduce, All2AllHeads, GemmReduceScatter) ----------------------
// state: u64 [2] of the op on this rank, [calls completed, CTAs finished this call]. The calls'
// stream orders each kernel after the one before, so the counts need no other synchronisation.
// This call's epoch: the count of the op's calls completed (stored by the previous kernel) + 1.
__device__ __forceinline__ u64 call_epoch(const u64* state) {
  return *reinterpret_cast<const volatile u64*>(state) + 1;
}
// Every CTA, failed or not, counts itself out once all its threads are done (each read the
// epoch as the CTA started); the last one stores the new count, so no CTA of this call can see
// it. The fences make the count a release / acquire chain: every CTA's reads of state[0]
// happen before the last CTA's store, by the memory model and not only in practice. Called by
// every thread of the CTA.
__device__ __forceinline__ void count_out(u64* state, u64 epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(state + 1, 1ull) == gridDim.x - 1) {
      __threadfence();
      state[1] = 0;
      state[0] = epoch;
    }
  }
}

// Block b of every rank meets block b of every other rank at epoch e. The release makes every
// store this block issued before the barrier (stage or tmp rows) visible to a peer that
// acquires the flag; the acquire makes every peer's such stores visible to this block's
// loads after it. `which` (0 START, 1 MID) only labels a timeout. Flags: u64 [gridDim.x][stride]
// at byte offset flags_off of every rank's symmetric buffer (s_base: the ranks' bases).
// block_release and block_wait are its two halves, for a block that releases a slot several
// times a call (allreduce.cu's chunks: increasing values, compared as epochs).
__device__ __forceinline__ void block_release(const u64* s_base, u64 flags_off, int stride,
                                              int world_size, int me, u64 value) {
  __syncthreads();  // the whole block's stores precede the releases below
  const int b = blockIdx.x;
  for (int p = threadIdx.x; p < world_size; p += blockDim.x) {
    if (p == me) continue;
    u64* slot = reinterpret_cast<u64*>(s_base[p] + flags_off) + static_cast<u64>(b) * stride + me;
    st_release_sys(slot, value);
  }
}

__device__ __forceinline__ bool block_wait(const u64* s_base, u64 flags_off, int stride,
                                           int world_size, int me, u64 value,
                                           const WaitSite& site, int which, int* s_failed) {
  const int b = blockIdx.x;
  int failed = 0;
  for (int p = threadIdx.x; p < world_size; p += blockDim.x) {
    if (p == me) continue;
    const u64* slot =
        reinterpret_cast<const u64*>(s_base[me] + flags_off) + static_cast<u64>(b) * stride + p;
    const u32 index = static_cast<u32>((which * gridDim.x + b) * world_size + p);
    if (!wait_flag_acquire(slot, value, site, p, index)) failed = 1;
  }
  // The acquires precede every thread's loads after the barrier. The verdict comes out of the
  // barrier itself, the same in every thread: read from shared memory, a thread could see a
  // later wait's failure (a block that waits again with no barrier between, allreduce.cu's
  // last chunk) and leave the block's barriers out of step.
  if (__syncthreads_or(failed)) {
    if (threadIdx.x == 0) *s_failed = 1;
    return false;
  }
  return true;
}

__device__ __forceinline__ bool block_barrier(const u64* s_base, u64 flags_off, int stride,
                                              int world_size, int me, u64 e, const WaitSite& site,
                                              int which, int* s_failed) {
  block_release(s_base, flags_off, stride, world_size, me, e);
  return block_wait(s_base, flags_off, stride, world_size, me, e, site, which, s_failed);
}

}  // namespace cuflux
