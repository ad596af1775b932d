"""Probe: does programmatic dependent launch (PDL) close the gap between back-to-back 64 MiB
copies (the All2AllHeads W = 1 bar case: the op and a bare cudaMemcpyAsync both sit at 0.89-0.90
of the 2 GiB copy's rate, a few microseconds a call short)?

Variants, each timed as blocks of back-to-back calls between two events (no event between
calls: an event between two kernels would serialise them), blocks of the variants alternating:
  memcpy      cudaMemcpyAsync
  plain       one-pass copy kernel (16-byte vectors, 256 threads, one vector a thread: the
              probe_copy.py winner), cuLaunchKernelEx without attributes
  pdl-wait    the same kernel starting with griddepcontrol.wait, launched with
              programmatic stream serialisation (its CTAs may be scheduled before the previous
              kernel ends; the wait holds them until it has completed and flushed)
  pdl-early   pdl-wait plus griddepcontrol.launch_dependents at the start of every CTA (the
              next call's CTAs are scheduled as soon as every CTA of this one has started)
Every variant's copy is checked first.
  PYTHONPATH=. python scripts/probe_pdl.py [MiB]
"""
import ctypes
import sys
import time

import numpy as np

SRC = r"""
template <int kPdl>  // 0: plain, 1: wait, 2: wait + early trigger
__global__ void __launch_bounds__(256) copy16(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                              long long n_vec) {
  if (kPdl >= 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (kPdl >= 1) asm volatile("griddepcontrol.wait;" ::: "memory");
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_vec) dst[i] = __ldg(src + i);
}
"""


def main():
    import cupy
    from cuda.bindings import driver as cu

    from cuflux.bench.common import copy_bandwidth_gbps

    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    nbytes = mib << 20
    n_vec = nbytes // 16
    names = [f"copy16<{k}>" for k in range(3)]
    mod = cupy.RawModule(code=SRC, options=("-std=c++17", "-arch=sm_90a"), name_expressions=names)
    count = 4  # rotate over 4 x (src, dst) pairs: 512 MiB, far above the 60 MiB L2
    srcs = [cupy.random.randint(0, 255, nbytes, dtype=cupy.uint8) for _ in range(count)]
    dsts = [cupy.empty_like(srcs[0]) for _ in range(count)]
    s = cupy.cuda.Stream(non_blocking=True)
    threads = 256
    grid = (n_vec + threads - 1) // threads

    def config(pdl: bool):
        lc = cu.CUlaunchConfig()
        lc.gridDimX, lc.gridDimY, lc.gridDimZ = grid, 1, 1
        lc.blockDimX, lc.blockDimY, lc.blockDimZ = threads, 1, 1
        lc.sharedMemBytes = 0
        lc.hStream = cu.CUstream(s.ptr)
        if pdl:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            lc.attrs = [attr]
            lc.numAttrs = 1
        return lc

    def launcher(kind: int, pdl: bool):
        fn = cu.CUfunction(mod.get_function(names[kind]).kernel.ptr)
        lc = config(pdl)
        args = [((srcs[k].data.ptr, dsts[k].data.ptr, n_vec),
                 (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong)) for k in range(count)]

        def call(i):
            err, = cu.cuLaunchKernelEx(lc, fn, args[i % count], 0)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuLaunchKernelEx: {err}")
        return call

    fns = {
        "memcpy": lambda i: cupy.cuda.runtime.memcpyAsync(
            dsts[i % count].data.ptr, srcs[i % count].data.ptr, nbytes, 3, s.ptr),
        "plain": launcher(0, False),
        "pdl-wait": launcher(1, True),
        "pdl-early": launcher(2, True),
    }
    for name, fn in fns.items():
        for d in dsts:
            d.fill(0)
        for i in range(count):
            fn(i)
        s.synchronize()
        ok = all(bool((dsts[k] == srcs[k]).all()) for k in range(count))
        print(f"{name}: copy {'ok' if ok else 'WRONG'}")

    calls, reps = 64, 9
    times = {name: [] for name in fns}
    host_us = {name: [] for name in fns}
    for name, fn in fns.items():  # warm-up
        for i in range(8):
            fn(i)
    s.synchronize()
    for r in range(reps):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for name in order:
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(s)
            t0 = time.perf_counter()
            for i in range(calls):
                fns[name](i)
            host_us[name].append((time.perf_counter() - t0) * 1e6 / calls)
            b.record(s)
            b.synchronize()
            times[name].append(cupy.cuda.get_elapsed_time(a, b) / calls)
    ceiling = copy_bandwidth_gbps()
    base = float(np.median(times["memcpy"]))
    print(f"{mib} MiB, {calls} calls a block, {reps} blocks each, copy ceiling {ceiling:.0f} GB/s")
    for name in fns:
        ms = float(np.median(times[name]))
        gbps = 2 * nbytes / (ms * 1e-3) / 1e9
        print(f"{name:10s} {ms * 1e3:8.2f} us {gbps:7.0f} GB/s {gbps / ceiling:6.3f} of ceiling "
              f"{base / ms:6.3f} x memcpy  (blocks {min(times[name]) * 1e3:.2f}-"
              f"{max(times[name]) * 1e3:.2f} us; host {np.median(host_us[name]):.1f} us a call)")


if __name__ == "__main__":
    main()
