"""Probe: what a call costs the host when the caller's arrays are torch tensors (one rank,
W = 1, the GPU held so no call waits for it): each op called as cuflux.torch calls it (owned
outputs, torch's current stream) and with out=, beside torch's own equivalent, then the pieces
a torch call pays that a CuPy call does not (DLPack both ways, torch's current stream, torch's
allocator, a key read from torch tensors). Also All2AllHeads with fp8 and scales (CuPy).
  PYTHONPATH=. python scripts/probe_torch_path.py
"""


def main():
    import cupy
    import torch

    import cuflux
    from cuflux import arrays
    from cuflux.bench.common import held_host_us, measure_host_floor

    world = cuflux.init()
    cupy.cuda.Device(world.device).use()
    torch.cuda.set_device(world.device)
    dev = torch.device("cuda", world.device)
    ts = torch.cuda.Stream(device=dev)
    cs = arrays.external_stream(ts.cuda_stream, world.device)

    def row(label, us):
        print(f"{label:66s} {us:8.2f} us", flush=True)

    def us(fn, hold=True, calls=500):
        return held_host_us(fn, cs if hold else None, calls)

    floor = measure_host_floor()
    row(f"floor: bare cuLaunchKernel ({floor['launch_binding']})", floor["launch_us"])
    row("floor: bare cudaMemcpyAsync 8 B (CuPy runtime)", floor["copy_us"])

    with torch.cuda.stream(ts):
        # ---- pieces ------------------------------------------------------------------------
        H = 4096
        x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
        row("torch.cuda.current_stream(dev).cuda_stream", us(
            lambda: torch.cuda.current_stream(dev).cuda_stream, hold=False))
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            row("torch._C._cuda_getCurrentRawStream(index)", us(lambda: raw(world.device),
                                                                   hold=False))
        row("arrays.stream_of(None, x) (torch)", us(lambda: arrays.stream_of(None, x),
                                                     hold=False))
        row("cupy.from_dlpack(x)", us(lambda: cupy.from_dlpack(x), hold=False))
        row("arrays.as_cupy(x)", us(lambda: arrays.as_cupy(x), hold=False))
        cx = cupy.from_dlpack(x)
        row("torch.from_dlpack(cupy array)", us(lambda: torch.from_dlpack(cx), hold=False))
        row("torch.from_dlpack(cupy array.__dlpack__(stream=-1))", us(
            lambda: torch.from_dlpack(cx.__dlpack__(stream=-1)), hold=False))
        row("arrays._to_torch(cupy array, x)", us(lambda: arrays._to_torch(cx, x), hold=False))
        row("arrays.torch_empty((1, H), bf16 storage, None, x)", us(
            lambda: arrays.torch_empty((1, H), cx.dtype, None, x), hold=False))
        row("x.new_empty((1, H))", us(lambda: x.new_empty((1, H)), hold=False))
        from cuflux.ops.base import CallMemo
        m = CallMemo(world.device)
        row("CallMemo.owns(x, x, x) (torch)", us(lambda: m.owns(x, x, x), hold=False))
        row("CallMemo.key((x, x, x, x)) (torch)", us(lambda: m.key((x, x, x, x)), hold=False))
        row("torch.empty((1, H), bf16, device)", us(
            lambda: torch.empty((1, H), dtype=torch.bfloat16, device=dev), hold=False))
        row("torch.empty_like(x)", us(lambda: torch.empty_like(x), hold=False))
        row("key fields of a tensor (data_ptr, shape, dtype, is_contiguous)", us(
            lambda: (x.data_ptr(), x.shape, x.dtype, x.is_contiguous()), hold=False))
        row("x.device.index", us(lambda: x.device.index, hold=False))
        row("x.get_device()", us(lambda: x.get_device(), hold=False))
        row("x.stride()", us(lambda: x.stride(), hold=False))
        row("type(x) is torch.Tensor", us(lambda: type(x) is torch.Tensor, hold=False))
        row("arrays.is_torch(x)", us(lambda: arrays.is_torch(x), hold=False))
        row("sys.getrefcount on a tensor and its storage-less fields", us(
            lambda: __import__("sys").getrefcount(x), hold=False))

        # ---- AllReduceRMSNorm T = 1 ----------------------------------------------------------
        norm = cuflux.AllReduceRMSNorm(world, 64, H, "bfloat16")
        res = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
        w = torch.randn(H, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        row("norm torch: owned output (torch's current stream)", us(lambda: norm(x, res, w)))
        row("norm torch: out=", us(lambda: norm(x, res, w, out=out)))
        cxx, cres, cw, cout = (cupy.from_dlpack(t) for t in (x, res, w, out))
        row("norm cupy: owned output (stream=)", us(lambda: norm(cxx, cres, cw, stream=cs)))
        row("norm cupy: out= (stream=)", us(lambda: norm(cxx, cres, cw, out=cout, stream=cs)))

        def torch_norm():
            h = x + res
            return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype) * w
        row("torch: add + rmsnorm in eager ops (what a torch user had)", us(torch_norm))
        if hasattr(torch.nn.functional, "rms_norm"):
            row("torch: x + res, then F.rms_norm", us(
                lambda: torch.nn.functional.rms_norm(x + res, (H,), w, 1e-6)))
        norm.close()

        # ---- AllReduce 4 KiB -----------------------------------------------------------------
        ar = cuflux.AllReduce(world, 1 << 20, "bfloat16")
        xa = torch.randn(2048, device=dev, dtype=torch.bfloat16)
        row("allreduce torch 4 KiB: owned output", us(lambda: ar(xa)))
        oa = torch.empty_like(xa)
        row("allreduce torch 4 KiB: out=", us(lambda: ar(xa, out=oa)))
        row("torch: xa.clone() (a copy, for scale)", us(lambda: xa.clone()))
        ar.close()

        # ---- gemm 128 x 8192 x 8192 nk -------------------------------------------------------
        M, N, K = 128, 8192, 8192
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        cuflux.gemm(a, b, b_layout="nk")
        row("gemm torch 128x8192x8192 nk: owned output", us(
            lambda: cuflux.gemm(a, b, b_layout="nk")))
        row("gemm torch: out=", us(lambda: cuflux.gemm(a, b, out=c, b_layout="nk")))
        row("torch: F.linear(a, b)", us(lambda: torch.nn.functional.linear(a, b)))
        row("torch: torch.matmul(a, b.T, out=c)", us(lambda: torch.matmul(a, b.T, out=c)))

        # ---- All2AllHeads T = 1024, 32 x 128 bf16 --------------------------------------------
        T, NH, D = 1024, 32, 128
        op = cuflux.All2AllHeads(world, T, NH, D, "bfloat16")
        xs = torch.randn(1, T, NH, D, device=dev, dtype=torch.bfloat16)
        ys = torch.empty_like(xs)
        row("a2a torch: owned output", us(lambda: op.scatter_heads(xs, (T,))))
        row("a2a torch: out=", us(lambda: op.scatter_heads(xs, (T,), out=ys)))
        op.close()

    # ---- All2AllHeads fp8 + per-token scales, CuPy, T = 8192 ---------------------------------
    T = 8192
    op = cuflux.All2AllHeads(world, T, NH, D, "float8_e4m3fn")
    with cs:
        xq = cupy.zeros((1, T, NH, D), dtype=cupy.uint8)
        sc = cupy.ones((1, T), dtype=cupy.float32)
        yq, ysc = cupy.empty_like(xq), cupy.empty_like(sc)
    for mode in ("pdl", "memcpy"):
        op.w1 = mode
        row(f"a2a fp8+scales ({mode}): owned outputs", us(
            lambda: op.scatter_heads(xq, (T,), sc, stream=cs)))
        row(f"a2a fp8+scales ({mode}): out=, out_scale=", us(
            lambda: op.scatter_heads(xq, (T,), sc, out=yq, out_scale=ysc, stream=cs)))
    op.w1 = "pdl"
    memo = op._memo
    key = memo.key((xq, sc, yq, ysc), (False, (T,), op.w1, False, 0))
    run = memo.get(key)
    print("a2a fp8 out= bound:", type(run).__name__ if run is not None else None,
          "| launches:", None if run is None else [type(x).__name__ for x in run.launches],
          "| memo entries:", len(memo.entries), "seen:", len(memo.seen))
    if run is not None:
        row("a2a fp8: its replay alone", us(lambda: op._replay(run, False, cs)))
    row("a2a fp8: memo key (four arrays)", us(
        lambda: memo.key((xq, sc, yq, ysc), (False, (T,), op.w1, False, 0)), hold=False))
    row("a2a fp8: _owned_outputs", us(
        lambda: op._owned_outputs(False, xq, (T,), sc, cs), hold=False))
    op.close()
    print("probe rc=0")


if __name__ == "__main__":
    main()
