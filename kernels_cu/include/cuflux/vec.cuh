// cuflux/vec.cuh — 16-byte (and narrower) vector loads and stores, and element conversions.
//
// Copies move raw bits in units of kVecBytes (16, 8, 4 or 2 bytes); arithmetic converts each
// element to float. Loads from the local GPU may use the read-only path (ld.global.nc); loads
// from a peer's memory must not (the non-coherent cache can serve stale data written by a peer).
#pragma once
// No <cstdint>: NVRTC has no standard library headers without CCCL on its include path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cuflux {

template <int kBytes> struct RawVec;
template <> struct RawVec<16> { uint4 v; };
template <> struct RawVec<8> { uint2 v; };
template <> struct RawVec<4> { unsigned int v; };
template <> struct RawVec<2> { unsigned short v; };
template <> struct RawVec<1> { unsigned char v; };

// Local, read-only: non-coherent cached load.
template <int kBytes> __device__ __forceinline__ RawVec<kBytes> ld_nc(const void* p) {
  RawVec<kBytes> r;
  if constexpr (kBytes == 16) {
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.v.x), "=r"(r.v.y), "=r"(r.v.z), "=r"(r.v.w) : "l"(p));
  } else if constexpr (kBytes == 8) {
    asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.v.x), "=r"(r.v.y) : "l"(p));
  } else if constexpr (kBytes == 4) {
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r.v) : "l"(p));
  } else {
    r.v = *reinterpret_cast<const decltype(r.v)*>(p);
  }
  return r;
}

// Any memory (a peer's included): plain coherent load (after an acquire on the flag that
// published it, this sees the peer's data).
template <int kBytes> __device__ __forceinline__ RawVec<kBytes> ld_plain(const void* p) {
  RawVec<kBytes> r;
  r.v = *reinterpret_cast<const decltype(r.v)*>(p);
  return r;
}

// Store that does not allocate in L1 (streaming data written once, often to a peer).
template <int kBytes> __device__ __forceinline__ void st_na(void* p, const RawVec<kBytes>& r) {
  if constexpr (kBytes == 16) {
    asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};"
                 ::"l"(p), "r"(r.v.x), "r"(r.v.y), "r"(r.v.z), "r"(r.v.w) : "memory");
  } else if constexpr (kBytes == 8) {
    asm volatile("st.global.L1::no_allocate.v2.u32 [%0], {%1,%2};"
                 ::"l"(p), "r"(r.v.x), "r"(r.v.y) : "memory");
  } else if constexpr (kBytes == 4) {
    asm volatile("st.global.L1::no_allocate.u32 [%0], %1;" ::"l"(p), "r"(r.v) : "memory");
  } else {
    *reinterpret_cast<decltype(r.v)*>(p) = r.v;
  }
}

// ---- element <-> float -------------------------------------------------------------------------
template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// A vector of kN elements of T viewed as raw bytes, for element-wise float math.
template <typename T, int kN> struct alignas(sizeof(T) * kN) Pack {
  T e[kN];
};

}  // namespace cuflux
