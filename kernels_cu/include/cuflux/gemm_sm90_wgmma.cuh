// cuflux/gemm_sm90_wgmma.cuh — the wgmma.mma_async instructions the Hopper GEMM core issues
// (sm_90a only): m64nNk16, fp32 accumulators in registers, A and B from shared memory through
// matrix descriptors, B K-major (kTransB = 0) or MN-major (kTransB = 1).
//
// Accumulator layout (PTX ISA, "wgmma D fragment"): thread t of the warpgroup, warp w = t / 32,
// lane l: d[4j + 0..1] = C[16w + l/4][8j + 2(l%4) + 0..1], d[4j + 2..3] = the same columns of
// row 16w + l/4 + 8.
//
// Inline PTX needs literal operand lists: they are spelled out once, as macros, and one macro
// makes each (N, dtype) specialisation (operand i is d[i]).
#pragma once
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuflux/sync.cuh>

namespace cuflux {
namespace sm90 {

template <int kN, typename T> struct Wgmma;

// Operand lists: %0..%(N/2 - 1) are the accumulators d[0..N/2 - 1] ("+f"), then desc_a, desc_b,
// the accumulate flag (a predicate) and kTransB.
#define CUFLUX_WGMMA_R0_47 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
#define CUFLUX_WGMMA_R64 CUFLUX_WGMMA_R0_47 \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUFLUX_WGMMA_R128 CUFLUX_WGMMA_R0_47 \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define CUFLUX_WGMMA_D8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
  "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define CUFLUX_WGMMA_D64 \
  CUFLUX_WGMMA_D8(0), CUFLUX_WGMMA_D8(8), CUFLUX_WGMMA_D8(16), CUFLUX_WGMMA_D8(24), \
  CUFLUX_WGMMA_D8(32), CUFLUX_WGMMA_D8(40), CUFLUX_WGMMA_D8(48), CUFLUX_WGMMA_D8(56)
#define CUFLUX_WGMMA_D128 \
  CUFLUX_WGMMA_D64, CUFLUX_WGMMA_D8(64), CUFLUX_WGMMA_D8(72), CUFLUX_WGMMA_D8(80), \
  CUFLUX_WGMMA_D8(88), CUFLUX_WGMMA_D8(96), CUFLUX_WGMMA_D8(104), CUFLUX_WGMMA_D8(112), \
  CUFLUX_WGMMA_D8(120)

// One specialisation: N, element type, its PTX name, the accumulator register list, the operand
// numbers of the predicate source, the two descriptors and kTransB, then the "+f" operands.
#define CUFLUX_WGMMA(N, T, PTX_T, REGS, PRED, DESCS, TRANS, ...)                                   \
  template <> struct Wgmma<N, T> {                                                                 \
    template <int kTransB>                                                                         \
    __device__ __forceinline__ static void mma(float (&d)[N / 2], u64 desc_a, u64 desc_b,          \
                                               int accumulate) {                                   \
      asm volatile(                                                                                \
          "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                        \
          "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " {" REGS              \
          "}, " DESCS ", p, 1, 1, 0, " TRANS ";\n}\n"                                              \
          : __VA_ARGS__                                                                            \
          : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB));                              \
    }                                                                                              \
  };

CUFLUX_WGMMA(256, __nv_bfloat16, "bf16", CUFLUX_WGMMA_R128, "%130", "%128, %129", "%131",
             CUFLUX_WGMMA_D128)
CUFLUX_WGMMA(256, __half, "f16", CUFLUX_WGMMA_R128, "%130", "%128, %129", "%131",
             CUFLUX_WGMMA_D128)
CUFLUX_WGMMA(128, __nv_bfloat16, "bf16", CUFLUX_WGMMA_R64, "%66", "%64, %65", "%67",
             CUFLUX_WGMMA_D64)
CUFLUX_WGMMA(128, __half, "f16", CUFLUX_WGMMA_R64, "%66", "%64, %65", "%67", CUFLUX_WGMMA_D64)

#undef CUFLUX_WGMMA
#undef CUFLUX_WGMMA_D128
#undef CUFLUX_WGMMA_D64
#undef CUFLUX_WGMMA_D8
#undef CUFLUX_WGMMA_R128
#undef CUFLUX_WGMMA_R64
#undef CUFLUX_WGMMA_R0_47

}  // namespace sm90
}  // namespace cuflux
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
