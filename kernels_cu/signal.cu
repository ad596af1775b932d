// signal.cu — stream-side bounded waits for the host-driven DMA paths (AllGather, AG+GEMM).
//
// The host path orders work with cudaMemcpyAsync + cuStreamWriteValue32. Where a stream must
// wait for flags it launches cuflux_wait_flags (one small block) instead of cuStreamWaitValue32:
// a stream wait can block forever, this kernel gives up after the op's timeout and records who
// it waited for (cuflux/sync.cuh). Flags live in the waiter's own memory; writers signal
// remotely.
//
// Flags form num_groups groups of per_group words, group g starting at g * group_stride_words;
// group g is written by rank first_peer + g (reported on timeout).
#include <cuflux/sync.cuh>

using namespace cuflux;

extern "C" __global__ void cuflux_wait_flags(const u32* flags, u32 num_groups, u32 per_group,
                                             u32 group_stride_words, u32 first_peer, u32 expected,
                                             u32* err, u32* err_claim, u64 timeout_ns, u32 op,
                                             u32 rank) {
  const WaitSite site{err, err_claim, timeout_ns, op, rank};
  const u32 num_flags = num_groups * per_group;
  for (u32 i = threadIdx.x; i < num_flags; i += blockDim.x) {
    const u32 g = i / per_group, j = i % per_group;
    if (!wait_flag_acquire(flags + static_cast<u64>(g) * group_stride_words + j, expected, site,
                           first_peer + g, i))
      return;
  }
}
