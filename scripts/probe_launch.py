"""Probe: what one kernel launch costs the host, by kernel and by path, with the GPU held busy
(host time alone). An empty kernel and the op's own kernels, through cuflux.launch, bare
ctypes with a prebuilt argument block, and CuPy; then the op call for comparison.
  PYTHONPATH=. python scripts/probe_launch.py
"""
import time

import numpy as np


def host_us(fn, stream, calls=2000):
    from cuflux.bench.common import hold_stream

    for _ in range(50):
        fn()
    stream.synchronize()
    hold_stream(stream, 20000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    stream.synchronize()
    return us


def main():
    import os

    import cupy

    import cuflux
    from cuflux import launch as L

    print("CUDA_MODULE_LOADING =", os.environ.get("CUDA_MODULE_LOADING"))
    world = cuflux.init()
    s = cupy.cuda.Stream(non_blocking=True)

    def row(label, us):  # one line a measurement, printed as it comes
        print(f"{label:64s} {us:8.2f} us", flush=True)

    mod = cupy.RawModule(code=r'''
    extern "C" __global__ void k7(unsigned long long a, unsigned long long b,
        unsigned long long c, unsigned long long d, int e, int f, float g) {}''')
    k7 = mod.get_function("k7")
    H = 4096
    with s:
        x = cupy.ones((1, H), dtype=cupy.float16)
        res, wt, out = cupy.ones_like(x), cupy.ones((H,), cupy.float16), cupy.empty_like(x)
    args7 = (x, out, res, wt, np.int32(1), np.int32(H), np.float32(1e-6))
    row("empty kernel, cuflux.launch", host_us(
        lambda: L.kernel(k7, 1, 128, args7, s, op="p", name="k7"), s))
    row("empty kernel, CuPy", host_us(lambda: k7((1,), (128,), args7, stream=s), s))
    arn = cuflux.AllReduceRMSNorm(world, 64, H, "float16")
    plan, fn, shape = arn._plan(H, H, "auto", True)
    print("op kernel:", plan.kernel, "grid", plan.grid, "block", plan.block, "smem",
          plan.shared_mem)
    row("rmsnorm kernel, cuflux.launch", host_us(
        lambda: L.kernel(fn, plan.grid, plan.block, args7, s, op="p", name="rms"), s))
    row("rmsnorm kernel, CuPy", host_us(lambda: fn((plan.grid,), (plan.block,), args7,
                                                   stream=s), s))
    p = L._packer(args7)
    vals = [a.data.ptr if hasattr(a, "data") and not isinstance(a, np.generic) else a
            for a in args7]
    p.struct.pack_into(p.buf, 0, *vals)
    lib, fptr, sptr = L.driver_lib(), fn.kernel.ptr, s.ptr
    row("rmsnorm kernel, bare ctypes, block prebuilt", host_us(
        lambda: lib.cuLaunchKernel(fptr, plan.grid, 1, 1, plan.block, 1, 1, 0, sptr, p.params,
                                   None), s))
    e7 = k7.kernel.ptr
    row("empty kernel, bare ctypes, block prebuilt", host_us(
        lambda: lib.cuLaunchKernel(e7, 1, 1, 1, 128, 1, 1, 0, sptr, p.params, None), s))
    row("op call out=, stream=s", host_us(lambda: arn(x, res, wt, out=out, stream=s), s))
    with s:
        row("op call, current stream s", host_us(lambda: arn(x, res, wt), s))
    row("cupy.empty", host_us(lambda: cupy.empty((1, H), cupy.float16), s))
    # gemm: the cuBLAS route and the tuned choice, host time
    a = cupy.ones((128, 8192), cupy.float16)
    w = cupy.ones((8192, 8192), cupy.float16)
    c = cupy.empty((128, 8192), cupy.float16)
    cuflux.gemm(a, w, b_layout="nk", out=c, stream=s)
    row("gemm 128x8192x8192 nk out= (host)", host_us(
        lambda: cuflux.gemm(a, w, b_layout="nk", out=c, stream=s), s, 500))
    with s:
        row("cupy.matmul 128x8192x8192 nk (host)", host_us(lambda: cupy.matmul(a, w.T), s, 500))


if __name__ == "__main__":
    main()
