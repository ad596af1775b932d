// cuflux/reduce.cuh — warp and block sum reductions in fp32.
// The summation order is fixed by lane and warp index, so every rank running the same
// block shape on the same data gets bit-identical results.
#pragma once

namespace cuflux {

__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds >= 32 floats of
// shared memory. Contains __syncthreads: every thread of the block must call it.
__device__ __forceinline__ float block_reduce_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
  v = warp_reduce_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.0f;
  return warp_reduce_sum(v);
}

}  // namespace cuflux
