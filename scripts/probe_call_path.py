"""Probe: where one op call's host time goes, piece by piece (one rank, W = 1, the GPU held so
no call waits for it): each op's whole call, then each step of its call path timed alone with
the same arguments, beside this host's floor (a bare launch, a bare copy). The pieces that do
not enqueue anything are timed without a hold.
  PYTHONPATH=. python scripts/probe_call_path.py
"""


def per_call_us(fn, calls=500, hold=None):
    """Wall time per call of `calls` back-to-back calls; `hold`: a stream held busy first
    (pieces that enqueue work): bench.common.held_host_us."""
    from cuflux.bench.common import held_host_us

    return held_host_us(fn, hold, calls)


def main():
    import cupy
    import numpy as np

    import cuflux
    from cuflux import arrays, kernels
    from cuflux.bench.common import measure_host_floor
    from cuflux.ops import all2all as A
    from cuflux.ops import allreduce as R
    from cuflux.ops.base import check_no_alias

    world = cuflux.init()
    cupy.cuda.Device(world.device).use()
    s = cupy.cuda.Stream(non_blocking=True)

    def row(label, us):
        print(f"{label:64s} {us:8.2f} us", flush=True)

    floor = measure_host_floor()
    row(f"floor: bare cuLaunchKernel ({floor['launch_binding']}, block built once)",
        floor["launch_us"])
    row("floor: bare cudaMemcpyAsync 8 B (CuPy runtime)", floor["copy_us"])

    # ---- AllReduceRMSNorm, T = 1, H = 4096, bf16, out= and stream= given ----------------------
    H = 4096
    with s:
        x = cupy.ones((1, H), dtype=cupy.float16).view(cupy.uint16).view(cupy.float16)
    norm = cuflux.AllReduceRMSNorm(world, 64, H, "float16")
    with s:
        res, w, out = cupy.ones_like(x), cupy.ones((H,), cupy.float16), cupy.empty_like(x)
    row("norm: whole call (out=, stream=)", per_call_us(
        lambda: norm(x, res, w, out=out, stream=s), hold=s))
    with s:
        row("norm: whole call (out=, current stream)", per_call_us(
            lambda: norm(x, res, w, out=out), hold=s))
    row("norm: whole call, owned output (stream=)", per_call_us(
        lambda: norm(x, res, w, stream=s), hold=s))
    mine = norm(x, res, w, stream=s)
    print("norm: owned call bound:", type(norm._memo.get(norm._memo.key(
        (x, res, w, mine), None))).__name__, "| outputs kept:",
        sum(len(v) for v in norm._memo.outputs.values()))
    del mine
    row("norm: memo.output (a dropped output back)", per_call_us(
        lambda: norm._memo.output((1, H), x.dtype, s)))
    row("norm: cupy.empty of the output (stream's arena)", per_call_us(
        lambda: arrays.empty_on((1, H), x.dtype, s)))
    full = type(norm)._call.__wrapped__  # the full path: checks, plan, prepared launch
    row("norm: the full path (_call without on_op_device, no memo)", per_call_us(
        lambda: full(norm, x, res, w, out, s, None, None), hold=s))
    row("norm: memo key (four arrays)", per_call_us(
        lambda: norm._memo.key((x, res, w, out), None)))
    def loop_key(arrays, extra=None):  # the same key by a Python loop (the first version)
        k = [extra]
        for arr in arrays:
            d = arr.data
            k += (d.ptr, d.device_id, arr.shape, arr.strides, arr.dtype)
        return tuple(k)
    row("norm: the key with strides, not the contiguity flag",
        per_call_us(lambda: loop_key((x, res, w, out))))
    replay = norm._memo.get(norm._memo.key((x, res, w, out), None))
    row(f"norm: its replay alone (memo hit: {type(replay).__name__})", per_call_us(
        lambda: replay(s.ptr), hold=s))
    from cuflux.launch import GraphReplay
    plan = norm._plan(x.size, H, "auto", True)
    bound = plan[1].bind(x.data.ptr, out.data.ptr, res.data.ptr, w.data.ptr)
    as_graph = GraphReplay((bound,), op="p", what="probe")
    row("norm: its launch bound (launch.Bound) alone", per_call_us(lambda: bound(s.ptr), hold=s))
    row("norm: the same as a graph (launch.GraphReplay) alone", per_call_us(
        lambda: as_graph(s.ptr), hold=s))
    row("norm: _check_open", per_call_us(norm._check_open))
    row("norm: check_norm_call", per_call_us(
        lambda: R.check_norm_call(norm, x, res, w, out, None)))
    row("norm: as_cupy x", per_call_us(lambda: arrays.as_cupy(x, "x", "p")))
    row("norm: check_array x (shape, dtype, device)", per_call_us(
        lambda: arrays.check_array(x, name="x", op="p", shape=(1, H), dtype=norm.dtype,
                                   device=world.device)))
    row("norm: stream_of(s, x)", per_call_us(lambda: arrays.stream_of(s, x)))
    row("norm: check_no_alias(out, x, residual, weight)", per_call_us(
        lambda: check_no_alias("p", out, x=x, residual=res, weight=w)))
    row("norm: aligned test (4 pointers)", per_call_us(
        lambda: not (x.data.ptr | out.data.ptr | res.data.ptr | w.data.ptr) & 15))
    row("norm: _plan (cached)", per_call_us(lambda: norm._plan(x.size, H, "auto", True)))
    plan = norm._plan(x.size, H, "auto", True)
    row("norm: reading the four pointers", per_call_us(
        lambda: (x.data.ptr, out.data.ptr, res.data.ptr, w.data.ptr)))
    ptrs = (x.data.ptr, out.data.ptr, res.data.ptr, w.data.ptr)
    row("norm: _launch (its prepared launch, pointers read)", per_call_us(
        lambda: norm._launch(plan, s, *ptrs), hold=s))
    p = plan[0]
    fn = norm.module[p.kernel]
    args = (x, out, res, w, np.int32(p.rows), np.int32(p.cols), norm._eps)
    row("norm: kernels.launch of the same arguments", per_call_us(
        lambda: kernels.launch(fn, p.grid, p.block, args, s, op="p", name="k",
                               shared_mem=p.shared_mem), hold=s))
    row("norm: to_caller", per_call_us(lambda: arrays.to_caller(out, x, out)))
    norm.close()

    # ---- AllReduce, 4 KiB, out= and stream= given (W = 1: a copy) -----------------------------
    ar = cuflux.AllReduce(world, 1 << 20, "float16")
    with s:
        xa, oa = cupy.ones(2048, cupy.float16), cupy.empty(2048, cupy.float16)
    row("allreduce 4 KiB: whole call (out=, stream=)", per_call_us(
        lambda: ar(xa, out=oa, stream=s), hold=s))
    row("allreduce 4 KiB: whole call, owned output (stream=)", per_call_us(
        lambda: ar(xa, stream=s), hold=s))
    from cupy.cuda import runtime
    row("allreduce 4 KiB: its memcpyAsync alone", per_call_us(
        lambda: runtime.memcpyAsync(oa.data.ptr, xa.data.ptr, xa.nbytes,
                                    runtime.memcpyDeviceToDevice, s.ptr), hold=s))
    ar.close()

    # ---- All2AllHeads W = 1, T = 1024, 32 x 128 bf16, out= and stream= given ------------------
    T, NH, D = 1024, 32, 128
    op = cuflux.All2AllHeads(world, T, NH, D, "bfloat16")
    tokens = (T,)
    with s:
        xs = cupy.ones((1, T, NH, D), dtype=cupy.uint16).view(op.spec.dtype.storage)
        ys = cupy.empty_like(xs)
    for mode in ("memcpy", "pdl"):
        op.w1 = mode
        row(f"a2a ({mode}): whole call (out=, stream=)", per_call_us(
            lambda: op.scatter_heads(xs, tokens, out=ys, stream=s), hold=s))
    op.w1 = "memcpy"
    row("a2a: whole call, owned output (stream=)", per_call_us(
        lambda: op.scatter_heads(xs, tokens, stream=s), hold=s))
    row("a2a: whole call, view=True (stream=)", per_call_us(
        lambda: op.scatter_heads(xs, tokens, view=True, stream=s), hold=s))
    row("a2a: _raise_if_failed", per_call_us(op._raise_if_failed))
    row("a2a: _plan (cached)", per_call_us(lambda: op._plan(tokens)))
    row("a2a: check_call", per_call_us(lambda: A.check_call(op.spec, False, xs, tokens)))
    row("a2a: io_shapes", per_call_us(lambda: A.io_shapes(op.spec, False, 1, tokens)))
    row("a2a: _call_hash (cached)", per_call_us(lambda: op._call_hash((False, tokens, 1, 0))))
    row("a2a: _output (given)", per_call_us(
        lambda: op._output(ys, "out", (1, T, NH, D), op.spec.dtype, s)))
    row("a2a: _slot_view", per_call_us(lambda: op._slot_view("data0", (1, T, NH, D),
                                                             op.spec.dtype.storage)))
    row("a2a: cupy.empty of the output", per_call_us(
        lambda: cupy.empty((1, T, NH, D), dtype=op.spec.dtype.storage)))
    plan = op._plan(tokens)
    row("a2a: _launch (memcpy)", per_call_us(
        lambda: op._launch(False, xs, None, ys, None, plan, 1, 0, 0, 0, False, s), hold=s))
    row("a2a: its memcpyAsync alone", per_call_us(
        lambda: runtime.memcpyAsync(ys.data.ptr, xs.data.ptr, xs.nbytes, 0, s.ptr), hold=s))
    op.close()

    # ---- cuflux.gemm 128 x 8192 x 8192 nk against cupy.matmul ----------------------------------
    M, N, K = 128, 8192, 8192
    with s:
        a = cupy.ones((M, K), cupy.float16).view(cupy.uint16).view(cupy.float16)
        b = cupy.ones((N, K), cupy.float16)
        c = cupy.empty((M, N), cupy.float16)
    cuflux.gemm(a, b, out=c, b_layout="nk", stream=s)
    s.synchronize()
    row("gemm 128x8192x8192 nk: whole call (out=, stream=)", per_call_us(
        lambda: cuflux.gemm(a, b, out=c, b_layout="nk", stream=s), hold=s))
    with s:
        row("cupy.matmul of the same (out=, current stream)", per_call_us(
            lambda: cupy.matmul(a, b.T, out=c), hold=s))
    row("gemm 128x8192x8192 nk: whole call, owned output (stream=)", per_call_us(
        lambda: cuflux.gemm(a, b, b_layout="nk", stream=s), hold=s))
    with s:
        row("cupy.matmul of the same (owned output, current stream)", per_call_us(
            lambda: cupy.matmul(a, b.T), hold=s))
    from cuflux.ops import gemm as G
    memo = G._memo()
    gkey = memo.key((a, b, c), (None, "nk", "auto", None, 8))
    row("gemm: memo key (three arrays)", per_call_us(
        lambda: memo.key((a, b, c), (None, "nk", "auto", None, 8))))
    replay = memo.get(gkey)
    print("gemm: its replay:", type(replay).__name__)
    if replay is not None:
        row("gemm: its replay alone (memo hit)", per_call_us(lambda: replay(s.ptr), hold=s))
    row("gemm: _check_args", per_call_us(
        lambda: G._check_args(a, b, None, c, None, "nk", "auto")))
    from cuflux import gemm_core
    dt = arrays.dtype_info("float16")
    row("gemm: launch_cublaslt alone", per_call_us(
        lambda: gemm_core.launch_cublaslt(a, b, None, c, dt, dt, M, N, K, "nk", s), hold=s))
    row("gemm: launch_cublas (the route's entry) alone", per_call_us(
        lambda: gemm_core.launch_cublas(a, b, None, c, dt, dt, M, N, K, "nk", s), hold=s))
    # the rest of gemm()'s body on this route (every row here is its own block: the host's
    # speed drifts between blocks, so compare sizes, not sums; the benchmark's interleaved
    # host_us put the whole call 1-7 us over cupy.matmul's on 2026-12-02)
    from cuflux import knobs
    from cuflux.gemm_tuner import choice
    from cuflux.launch import capturing
    row("gemm: stream_of + capturing(s)", per_call_us(
        lambda: capturing(arrays.stream_of(s, a))))
    row("gemm: device_props()", per_call_us(gemm_core.device_props))
    row("gemm: knobs.gemm_tune() + knobs.gemm_cublaslt()", per_call_us(
        lambda: (knobs.gemm_tune(), knobs.gemm_cublaslt())))
    row("gemm: choice (remembered)", per_call_us(
        lambda: choice(dt, "nk", M, N, K, None, s, False)))
    print("plan of gemm:", G.plan(M, N, K, "float16", "nk"))


if __name__ == "__main__":
    main()
