"""Probe: where the host time of one op call goes, and what each launch mechanism costs.

Prints (one rank, W = 1) the wall time per call of back-to-back calls with the GPU held busy
(so it is the host's time alone), for: CuPy primitives the ops use on every call (allocation,
attribute reads), kernel launches by CuPy, by cuda-bindings and by ctypes, cuBLAS through CuPy
and through cublasGemmEx directly, and the ops themselves; then cProfile's top functions for
each op.
  PYTHONPATH=. python scripts/probe_host.py
"""
import cProfile
import ctypes
import io
import os
import pstats
import struct
import time

import numpy as np


def per_call_us(fn, calls=2000):
    """No hold (bench.common.held_host_us with no stream): the held rows hold first."""
    from cuflux.bench.common import held_host_us

    return held_host_us(fn, None, calls)


def _on(stream, fn):
    with stream:
        return fn()


def main():
    import cupy

    import cuflux
    from cuflux import kernels
    from cuflux.bench.common import hold_stream

    world = cuflux.init()
    s = cupy.cuda.Stream(non_blocking=True)
    def row(label, us):
        print(f"{label:60s} {us:8.2f} us", flush=True)

    with s:
        x = cupy.zeros((1, 4096), dtype=cupy.float16)
        row("cupy.empty((1, 4096))", per_call_us(lambda: cupy.empty((1, 4096), cupy.float16)))
        row("x.device.id", per_call_us(lambda: x.device.id))
        row("x.flags.c_contiguous", per_call_us(lambda: x.flags.c_contiguous))
        row("x.data.ptr", per_call_us(lambda: x.data.ptr))
        row("x.dtype == float16", per_call_us(lambda: x.dtype == np.float16))
        row("get_current_stream()", per_call_us(cupy.cuda.get_current_stream))
        row("runtime.getDevice()", per_call_us(cupy.cuda.runtime.getDevice))
        row("cupy.cuda.Device().id", per_call_us(lambda: cupy.cuda.Device().id))
        row("streamIsCapturing", per_call_us(lambda: cupy.cuda.runtime.streamIsCapturing(s.ptr)))
        row("Device().attributes", per_call_us(lambda: cupy.cuda.Device().attributes, 20))
        row("getDeviceProperties", per_call_us(
            lambda: cupy.cuda.runtime.getDeviceProperties(0), 20))

        src = r'''
        extern "C" __global__ void k1(unsigned long long a) {}
        extern "C" __global__ void k24(unsigned long long a0, unsigned long long a1,
          unsigned long long a2, unsigned long long a3, unsigned long long a4,
          unsigned long long a5, unsigned long long a6, unsigned long long a7, int a8, int a9,
          int a10, int a11, int a12, int a13, int a14, int a15, float a16, unsigned a17,
          unsigned a18, unsigned a19, unsigned long long a20, unsigned long long a21,
          unsigned long long a22, unsigned long long a23) {}
        '''
        mod = cupy.RawModule(code=src)
        k1, k24 = mod.get_function("k1"), mod.get_function("k24")
        args24 = tuple([np.uint64(0)] * 8 + [np.int32(1)] * 8 + [np.float32(1.0)]
                       + [np.uint32(1)] * 3 + [np.uint64(0)] * 4)
        row("CuPy launch, 1 arg", per_call_us(lambda: k1((1,), (32,), (np.uint64(0),), stream=s)))
        row("CuPy launch, 24 args", per_call_us(lambda: k24((1,), (32,), args24, stream=s)))
        row("kernels.launch (today), 24 args", per_call_us(
            lambda: kernels.launch(k24, (1,), (32,), args24, s, op="p", name="k24")))
        from cuda.bindings import driver as cu

        f24 = cu.CUfunction(k24.kernel.ptr)
        types24 = tuple([ctypes.c_uint64] * 8 + [ctypes.c_int] * 8 + [ctypes.c_float]
                        + [ctypes.c_uint] * 3 + [ctypes.c_uint64] * 4)
        vals24 = tuple([0] * 8 + [1] * 8 + [1.0] + [1] * 3 + [0] * 4)
        hs = cu.CUstream(s.ptr)
        row("cuda-bindings cuLaunchKernel, 24 args", per_call_us(
            lambda: cu.cuLaunchKernel(f24, 1, 1, 1, 32, 1, 1, 0, hs, (vals24, types24), 0)))
        lib = ctypes.CDLL("libcuda.so.1")
        launch = lib.cuLaunchKernel
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        launch.restype = ctypes.c_int
        fmt = struct.Struct("=8Q8if3I4Q")
        buf = ctypes.create_string_buffer(fmt.size)
        base = ctypes.addressof(buf)
        offs, o = [], 0
        for c in "QQQQQQQQiiiiiiiifIIIQQQQ":
            offs.append(o)
            o += struct.calcsize("=" + c)
        params = (ctypes.c_void_p * 24)(*[base + q for q in offs])
        fptr = k24.kernel.ptr

        def ct():
            fmt.pack_into(buf, 0, *vals24)
            launch(fptr, 1, 1, 1, 32, 1, 1, 0, s.ptr, params, None)
        row("ctypes cuLaunchKernel + struct.pack_into, 24 args", per_call_us(ct))

        def ct_np():
            fmt.pack_into(buf, 0, *args24)
            launch(fptr, 1, 1, 1, 32, 1, 1, 0, s.ptr, params, None)
        row("ctypes cuLaunchKernel, numpy scalars, 24 args", per_call_us(ct_np))
        row("tuple(type(a) for a in args) 24", per_call_us(lambda: tuple(map(type, args24))))
        s.synchronize()

        # cuBLAS
        for M, N, K in ((128, 8192, 8192), (1, 8192, 8192)):
            a = cupy.ones((M, K), dtype=cupy.float16)
            w = cupy.ones((N, K), dtype=cupy.float16)
            row(f"cupy.matmul(a, w.T) {M}x{N}x{K} (host)", per_call_us(
                lambda: cupy.matmul(a, w.T), 200))
            from cupy.cuda import cublas
            from cupy.cuda import device as cdev

            c = cupy.empty((M, N), dtype=cupy.float16)
            one = np.ones(1, np.float32)
            zero = np.zeros(1, np.float32)

            def gemm_ex():
                h = cdev.get_cublas_handle()
                cublas.setStream(h, s.ptr)
                cublas.gemmEx(h, 1, 0, N, M, K, one.ctypes.data, w.data.ptr, 2, K, a.data.ptr,
                              2, K, zero.ctypes.data, c.data.ptr, 2, N, 68, -1)
            row(f"cublas.gemmEx direct {M}x{N}x{K} (host)", per_call_us(gemm_ex, 200))
            s.synchronize()
            ref = (a.astype(cupy.float32) @ w.astype(cupy.float32).T)
            gemm_ex()
            s.synchronize()
            row(f"cublas.gemmEx max err {M}", float(abs(c.astype(cupy.float32) - ref).max()))

    # The ops, back to back, then cProfile.
    prof_out = io.StringIO()
    a = cupy.random.standard_normal((128, 8192), dtype=cupy.float32).astype(cupy.float16)
    w = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32).astype(cupy.float16)
    cuflux.gemm(a, w, b_layout="nk")
    cupy.cuda.runtime.deviceSynchronize()

    def user_loop(fn, calls=200):
        for _ in range(5):
            fn()
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        cupy.cuda.runtime.deviceSynchronize()
        return (time.perf_counter() - t0) / calls * 1e6

    ops = {}
    ops["gemm 128x8192x8192 nk"] = lambda: cuflux.gemm(a, w, b_layout="nk")
    ops["cupy.matmul 128x8192x8192 nk"] = lambda: cupy.matmul(a, w.T)
    H = 4096
    arn = cuflux.AllReduceRMSNorm(world, 8192, H, "bfloat16")
    bf = arn.dtype.storage
    xs = cupy.ones((1, H), dtype=bf)
    res = cupy.ones((1, H), dtype=bf)
    wt = cupy.ones((H,), dtype=bf)
    ops["AllReduceRMSNorm T=1"] = lambda: arn(xs, res, wt)
    outn = cupy.empty((1, H), dtype=bf)
    ops["AllReduceRMSNorm T=1 out="] = lambda: arn(xs, res, wt, out=outn)
    ar = cuflux.AllReduce(world, 1 << 20, "bfloat16")
    ops["AllReduce 4096"] = lambda: ar(xs)
    # W = 1 AllReduce is one cudaMemcpyAsync: the op's own share of its host time, against the
    # bare copy and NCCL's one-rank all-reduce (the benchmark's user loop: 14 us vs 8.6 us)
    ys = cupy.empty_like(xs)
    ops["AllReduce 4096 out="] = lambda: ar(xs, out=ys)
    ops["AllReduce 4096 out= stream=s"] = lambda: ar(xs, out=ys, stream=s)
    ops["cudaMemcpyAsync 8 KiB only"] = lambda: cupy.cuda.runtime.memcpyAsync(
        ys.data.ptr, xs.data.ptr, xs.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)
    from cupy.cuda import nccl
    if nccl.available:
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        ops["NCCL allReduce 4096, one rank"] = lambda: comm.allReduce(
            xs.data.ptr, ys.data.ptr, xs.size, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM, s.ptr)
    a2a = cuflux.All2AllHeads(world, 1024, 32, 128, "bfloat16")
    xa = cupy.ones((1, 1024, 32, 128), dtype=bf)
    outa = cupy.empty_like(xa)
    ops["All2AllHeads T=1024 out="] = lambda: a2a.scatter_heads(xa, (1024,), out=outa)
    ops["All2AllHeads T=1024"] = lambda: a2a.scatter_heads(xa, (1024,))
    ops["AllReduceRMSNorm T=1 out= stream=s"] = lambda: arn(xs, res, wt, out=outn, stream=s)
    from cuflux.ops.allreduce import check_norm_call
    ops["check_norm_call only"] = lambda: check_norm_call(arn, xs, res, wt, outn, None)
    plan = arn._plan(xs.size, H, "auto", True)
    ptrs = (xs.data.ptr, outn.data.ptr, res.data.ptr, wt.data.ptr)
    ops["AllReduceRMSNorm _launch only, stream=s"] = lambda: arn._launch(plan, s, *ptrs)
    ops["AllReduceRMSNorm _launch only, default stream"] = lambda: arn._launch(
        plan, cupy.cuda.get_current_stream(), *ptrs)
    ops["gemm 128x8192x8192 nk out= stream=s"] = lambda: cuflux.gemm(
        a, w, b_layout="nk", out=gout, stream=s)
    gout = cupy.empty((128, 8192), dtype=cupy.float16)
    ops["cupy.matmul 128x8192x8192 nk, stream s"] = lambda: _on(s, lambda: cupy.matmul(a, w.T))
    for label, fn in ops.items():
        row(f"user loop: {label}", user_loop(fn))
    # The loop above took gemm's default cuBLAS route (cublasLt); the same calls through
    # cublasGemmEx, beside it. The caller's own setting of the knob is put back.
    saved = os.environ.get("CUFLUX_GEMM_CUBLASLT")
    os.environ["CUFLUX_GEMM_CUBLASLT"] = "0"
    for label in [k for k in ops if k.startswith("gemm")]:
        row(f"user loop: {label} (cublasGemmEx)", user_loop(ops[label]))
    if saved is None:
        del os.environ["CUFLUX_GEMM_CUBLASLT"]
    else:
        os.environ["CUFLUX_GEMM_CUBLASLT"] = saved
    for label, fn in ops.items():
        if "only" in label or "gemm" in label:
            continue
        s.synchronize()
        hold_stream(cupy.cuda.get_current_stream(), 20000)
        hold_stream(s, 20000)
        row(f"host only (GPU held): {label}", per_call_us(fn, 200))
        cupy.cuda.runtime.deviceSynchronize()
    for label, fn in ops.items():
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            fn()
        pr.disable()
        cupy.cuda.runtime.deviceSynchronize()
        st = pstats.Stats(pr, stream=prof_out).sort_stats("tottime")
        prof_out.write(f"\n==== {label} (200 calls) ====\n")
        st.print_stats(14)
    print(prof_out.getvalue())


if __name__ == "__main__":
    main()
