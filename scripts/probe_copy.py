"""Probe: can an SM copy kernel beat cudaMemcpyAsync on a 64 MiB device-to-device copy (the
All2AllHeads W = 1 bar case)? Times, in interleaved rounds, cudaMemcpyAsync and copy kernels
(16-byte vectors, U loads in flight per thread, grid-stride or one pass, with and without
streaming cache hints). Prints GB/s (read + write) per variant and its ratio to the memcpy.
  PYTHONPATH=. python scripts/probe_copy.py [MiB]
"""
import sys

import cupy

from cuflux.bench.common import copy_bandwidth_gbps, time_interleaved

SRC = r"""
template <int U, bool kHint>
__global__ void __launch_bounds__(512) copy16(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                              long long n_vec) {
  const long long stride = (long long)gridDim.x * blockDim.x * U;
  for (long long i = (long long)blockIdx.x * blockDim.x * U + threadIdx.x; i < n_vec; i += stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long j = i + (long long)u * blockDim.x;
      if (j < n_vec) {
        if (kHint) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                                : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(src + j));
        else v[u] = __ldg(src + j);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long j = i + (long long)u * blockDim.x;
      if (j < n_vec) {
        if (kHint) asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(dst + j),
                                "r"(v[u].x), "r"(v[u].y), "r"(v[u].z), "r"(v[u].w) : "memory");
        else dst[j] = v[u];
      }
    }
  }
}
"""


def main():
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    nbytes = mib << 20
    names = [f"copy16<{u}, {h}>" for u in (1, 2, 4, 8) for h in ("false", "true")]
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    src = cupy.random.randint(0, 255, nbytes, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    n_vec = nbytes // 16
    s = cupy.cuda.get_current_stream()
    fns = {"memcpy": lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                                           3, s.ptr)}
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    for u in (1, 2, 4, 8):
        for h in ("false", "true"):
            k = mod.get_function(f"copy16<{u}, {h}>")
            for threads in (256, 512):
                for per_sm in (2, 4, 8, 0):  # 0: one pass (a thread copies U vectors once)
                    grid = (n_vec + threads * u - 1) // (threads * u) if per_sm == 0 else sms * per_sm
                    fns[f"u{u} {'hint' if h == 'true' else 'ldg'} t{threads} "
                        f"{'onepass' if per_sm == 0 else f'{per_sm}/SM'}"] = (
                        lambda k=k, grid=grid, threads=threads: k(
                            (grid,), (threads,), (src, dst, cupy.int64(n_vec))))
    ref = None
    for name, fn in fns.items():  # every variant copies correctly
        dst.fill(0)
        fn()
        if not bool((dst == src).all()):
            print("WRONG", name)
    t = time_interleaved(fns, rounds=7, iters=20, warmup=3)
    ceiling = copy_bandwidth_gbps()
    base = t["memcpy"]
    print(f"{mib} MiB, copy ceiling {ceiling:.0f} GB/s")
    for name, ms in sorted(t.items(), key=lambda kv: kv[1]):
        gbps = 2 * nbytes / (ms * 1e-3) / 1e9
        print(f"{name:32s} {ms * 1e3:8.2f} us {gbps:7.0f} GB/s {gbps / ceiling:6.3f} of ceiling "
              f"{base / ms:6.3f} x memcpy")


if __name__ == "__main__":
    main()
