"""Tests of All2AllHeads, one file for the op: GPU tests (marked gpu) run the rank bodies defined
beside them on W ranks sharing the GPU under mpiexec (skipped, "no CUDA device", without a GPU);
CPU tests (the kernels compile, argument checks with fake arrays and a fake world, the symmetric
layout, the NumPy reference against hand-worked cases, launch arguments against the kernel
signatures) run anywhere.

W comes from CUFLUX_TEST_WORLD_SIZES (default 1,2,4; the GPU machine runs 1,2,4,8). Each GPU test
draws a fresh seed. Every rank can rebuild every rank's input from (seed, rank, case, call), so
each rank checks its output against the NumPy reference of the whole exchange: a check proves who
sent what. Outputs are poisoned (all bits set) before a call, so an element that is not written
fails the check; random inputs never hold that bit pattern (fp8 bytes are drawn below 0xFF).
"""
import time

import numpy as np
import pytest

from cuflux import kernels
from cuflux.arrays import dtype_info
from cuflux.errors import CommTimeoutError
from cuflux.ops import all2all as a2a
from cuflux.ops.all2all import (All2AllHeads, Spec, build_layout, call_hash, check_call,
                                check_op_args, check_tokens, io_shapes, reference_gather_heads,
                                reference_scatter_heads, scale_shapes, vec_bytes)
from tests.checks import poison_owned, poisoned, seeded_epoch_calls
from tests.fakes import FakeArray
from tests.mpi import fresh_seed, on_ranks, world_sizes

WS = world_sizes()
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")


def _data(shape, dtype_name, *key):
    rng = np.random.default_rng(list(key))
    info = dtype_info(dtype_name)
    if info.is_fp8:
        return rng.integers(0, 0xFF, shape, dtype=np.uint8)
    return rng.standard_normal(shape).astype(np.float32).astype(info.storage)


def _scales(shape, *key):
    return np.random.default_rng(list(key) + [7]).standard_normal(shape).astype(np.float32)


def _same_bits(got, want, what):
    import cupy

    got = cupy.asnumpy(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    g, w = np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)
    if not np.array_equal(g, w):
        bad = np.argwhere(g.reshape(want.shape + (-1,)) != w.reshape(want.shape + (-1,)))
        raise AssertionError(f"{what}: {len(bad)} bytes differ, first at {bad[0].tolist()}")


def _tokens(W, max_tokens, *key):
    """Uneven counts, rank 1 has none (when W > 1), the last rank has max_tokens."""
    rng = np.random.default_rng(list(key) + [3])
    t = [int(v) for v in rng.integers(1, max_tokens + 1, W)]
    if W > 1:
        t[1] = 0
    t[-1] = max_tokens
    return t


def _exchange(world, op, dtype, B, tokens, key, scale_mode=0, via="out"):
    """scatter (checked), gather back (round trip bitwise), gather of fresh y (checked)."""
    import cupy

    W, me = world.size, world.rank
    H, D, hpr = op.spec.num_heads, op.spec.head_dim, op.spec.heads_per_rank
    S, storage = sum(tokens), op.spec.dtype.storage
    xs = [_data((B, tokens[r], H, D), dtype, *key, r, 0) for r in range(W)]
    scales = None
    if scale_mode:
        scales = [_scales((B, tokens[r]) + ((H,) if scale_mode == 2 else ()), *key, r, 0)
                  for r in range(W)]
    want = reference_scatter_heads(xs, tokens, W, scales)
    want_y, want_ys = (want, None) if scales is None else want
    x = cupy.asarray(xs[me])
    sc = None if scales is None else cupy.asarray(scales[me])
    kw = {}
    if via == "out":
        kw["out"] = poisoned((B, S, hpr, D), storage)
        if scale_mode:
            kw["out_scale"] = poisoned(want_ys[me].shape, np.float32)
    res = op.scatter_heads(x, tokens, sc, view=(via == "view"), **kw)
    y, y_scale = (res, None) if sc is None else res
    if via == "out":
        assert y is kw["out"]
    op.synchronize()
    what = f"rank {me} {dtype} B={B} D={D} tokens={tokens} scales={scale_mode} via={via}"
    _same_bits(y, want_y[me], "scatter " + what)
    if sc is not None:
        _same_bits(y_scale, want_ys[me], "scatter scales " + what)
    y, y_scale = y.copy(), None if y_scale is None else y_scale.copy()  # views die at next call
    back = op.gather_heads(y, tokens, y_scale)
    x2, x2_scale = (back, None) if sc is None else back
    op.synchronize()
    _same_bits(x2, xs[me], "round trip " + what)
    if sc is not None:
        want_back = scales[me] if scale_mode == 2 else np.repeat(scales[me][:, :, None], W, 2)
        _same_bits(x2_scale, want_back, "round trip scales " + what)
    # gather of fresh data that no scatter produced
    ys = [_data((B, S, hpr, D), dtype, *key, r, 1) for r in range(W)]
    yscales = None
    if scale_mode:
        yscales = [_scales((B, S) + ((hpr,) if scale_mode == 2 else ()), *key, r, 1)
                   for r in range(W)]
    want = reference_gather_heads(ys, tokens, W, yscales)
    want_x, want_xs = (want, None) if yscales is None else want
    kw = {}
    if via == "out":
        kw["out"] = poisoned((B, tokens[me], H, D), storage)
        if scale_mode:
            kw["out_scale"] = poisoned(want_xs[me].shape, np.float32)
    res = op.gather_heads(cupy.asarray(ys[me]), tokens,
                          None if yscales is None else cupy.asarray(yscales[me]),
                          view=(via == "view"), **kw)
    x3, x3_scale = (res, None) if yscales is None else res
    op.synchronize()
    _same_bits(x3, want_x[me], "gather " + what)
    if yscales is not None:
        _same_bits(x3_scale, want_xs[me], "gather scales " + what)


@on_ranks
def exact(world, seed, dtypes=DTYPES, head_dims=(64, 80, 128, 67)):
    """Both directions against the reference: every dtype, head_dim 64, 80, 128 and an odd one,
    B = 1 and 3, uneven tokens with a rank that has none, fp8 with both kinds of scales."""
    W = world.size
    n = 0
    for i, dtype in enumerate(dtypes):
        for j, D in enumerate(head_dims):
            H = W * (1 + (i + j) % 3)  # 1, 2 or 3 heads per rank
            max_tokens = 37
            with All2AllHeads(world, max_tokens, H, D, dtype, batch=3, num_sms=8,
                              timeout_s=60) as op:
                for B in (1, 3):
                    key = (seed, i, j, B)
                    tokens = _tokens(W, max_tokens, *key)
                    fp8 = dtype.startswith("float8")
                    scale_mode = (1 + (j + B) % 2) if fp8 else 0
                    _exchange(world, op, dtype, B, tokens, key, scale_mode,
                              via=("out", "owned", "view")[(i + j + B) % 3])
                    n += 1
    return n


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_exact_every_dtype_and_head_dim(W):
    n = exact.run(W, timeout_s=400, seed=fresh_seed())
    assert n == [40] * W


@on_ranks
def features(world, seed):
    """Rows wider than a block, misaligned input (narrow vectors), the default grid, views,
    caller streams, torch tensors through DLPack."""
    import cupy

    W, me = world.size, world.rank
    # hpr * D * 2 bytes = 40 * 128 * 2 = 10 KiB per row: wider than a 512-thread block's 8 KiB
    with All2AllHeads(world, 9, 40 * W, 128, "bfloat16", timeout_s=60) as op:
        for k, tokens in enumerate(([9] * W, _tokens(W, 9, seed, 50))):
            _exchange(world, op, "bfloat16", 1, tokens, (seed, 50, k), via="out")
        op.w1 = "kernel"  # at W = 1 run the general kernel instead of the plain copy
        _exchange(world, op, "bfloat16", 1, _tokens(W, 9, seed, 52), (seed, 52), via="owned")
        op.w1 = "memcpy"  # at W = 1 cudaMemcpyAsync instead of the PDL copy kernel
        _exchange(world, op, "bfloat16", 1, _tokens(W, 9, seed, 53), (seed, 53), via="owned")
        op.w1 = "pdl"
        # misaligned x: a contiguous view 2 bytes past a 256-byte boundary -> 2-byte vectors
        tokens = _tokens(W, 9, seed, 51)
        xs = [_data((1, tokens[r], 40 * W, 128), "bfloat16", seed, 51, r) for r in range(W)]
        s = cupy.cuda.Stream(non_blocking=True)
        with s:  # inputs made on the stream that uses them
            big = cupy.empty(xs[me].size + 1, dtype=xs[me].dtype)
            x = big[1:].reshape(xs[me].shape)
            x[...] = cupy.asarray(xs[me])
        assert x.data.ptr % 16 == 2 and x.flags.c_contiguous
        y = op.scatter_heads(x, tokens, stream=s)
        op.synchronize(stream=s)
        _same_bits(y, reference_scatter_heads(xs, tokens, W)[me], f"misaligned rank {me}")
    # default grid (every SM), odd head_dim in fp8 (1-byte vectors), view then copy on the stream
    with All2AllHeads(world, 33, 3 * W, 67, "float8_e5m2", batch=2, timeout_s=60) as op:
        for k in range(3):
            tokens = _tokens(W, 33, seed, 60, k)
            xs = [_data((2, tokens[r], 3 * W, 67), "float8_e5m2", seed, 60, k, r)
                  for r in range(W)]
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                v = op.scatter_heads(cupy.asarray(xs[me]), tokens, view=True, stream=s)
                kept = v.copy()  # enqueued before the next call: the view is still valid
            op.synchronize()
            _same_bits(kept, reference_scatter_heads(xs, tokens, W)[me], f"view rank {me} {k}")
        # one token list again and again: the views of the two slots are kept and handed out
        # again (each call's data exact); one whose shape the caller set is made anew
        tokens = _tokens(W, 33, seed, 61)
        views = []
        for k in range(5):
            xs = [_data((2, tokens[r], 3 * W, 67), "float8_e5m2", seed, 61, k, r)
                  for r in range(W)]
            with s:
                v = op.scatter_heads(cupy.asarray(xs[me]), tokens, view=True, stream=s)
                kept = v.copy()
            op.synchronize()
            want = reference_scatter_heads(xs, tokens, W)[me]
            _same_bits(kept, want, f"kept view rank {me} {k}")
            assert v.shape == want.shape
            if k in (2, 3):  # the same slot (parity) as two calls before: the kept view
                assert v is views[k - 2], f"view {k} not kept"
            if k == 4:  # its kept view's shape was set by the caller: made anew
                assert v is not views[2]
            views.append(v)
            if k == 2:
                v.shape = (v.size,)  # the caller's own business: the next same-parity call
                # must not hand this array out with that shape
    return _torch(world, seed)


def _torch(world, seed):
    try:
        import torch
    except ImportError:
        return "torch missing"
    W, me = world.size, world.rank
    dev = f"cuda:{world.device}"
    tokens = _tokens(W, 16, seed, 70)
    xs = [_data((1, tokens[r], 2 * W, 64), "bfloat16", seed, 70, r) for r in range(W)]
    with All2AllHeads(world, 16, 2 * W, 64, torch.bfloat16, timeout_s=60) as op:
        x = torch.from_numpy(xs[me].view(np.int16)).view(torch.bfloat16).to(dev)
        ts = torch.cuda.Stream(device=dev)
        ts.wait_stream(torch.cuda.current_stream())  # x was made on the current stream
        with torch.cuda.stream(ts):
            y = op.scatter_heads(x, tokens, stream=ts.cuda_stream)
        op.synchronize(stream=ts.cuda_stream)
        assert isinstance(y, torch.Tensor), f"torch in, {type(y).__name__} out"
        import cupy

        _same_bits(cupy.from_dlpack(y), reference_scatter_heads(xs, tokens, W)[me],
                   f"torch rank {me}")
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_wide_rows_misaligned_views_streams_torch(W):
    res = features.run(W, timeout_s=300, seed=fresh_seed())
    assert all(r in (True, "torch missing") for r in res)


@on_ranks
def one_rank_misaligned(world, seed):
    """Only rank 0's input sits 2 bytes past an aligned address (2-byte vectors there, 16-byte
    ones on the other ranks), with 256-byte rows, narrower than a block: every receive block
    must still copy exactly the rows its peer's push worker wrote (copy_rows splits rows the
    same at every vector width). Scatter, then gather back, each exact."""
    import cupy

    W, me = world.size, world.rank
    H, D = 2 * W, 64  # hpr * D * 2 bytes = 256-byte rows

    def placed(host):  # rank 0: a contiguous copy 2 bytes past a 16-byte boundary
        if me != 0:
            return cupy.asarray(host)
        big = cupy.empty(host.size + 1, dtype=host.dtype)
        arr = big[1:].reshape(host.shape)
        arr[...] = cupy.asarray(host)
        assert arr.data.ptr % 16 == 2
        return arr

    with All2AllHeads(world, 40, H, D, "bfloat16", timeout_s=60) as op:
        for k in range(2):
            tokens = _tokens(W, 40, seed, 80, k)
            xs = [_data((1, tokens[r], H, D), "bfloat16", seed, 80, k, r) for r in range(W)]
            ys = reference_scatter_heads(xs, tokens, W)
            s = cupy.cuda.Stream(non_blocking=True)
            with s:  # inputs made on the stream that uses them
                x, y_in = placed(xs[me]), placed(ys[me])
            y = op.scatter_heads(x, tokens, stream=s)
            back = op.gather_heads(y_in, tokens, stream=s)
            op.synchronize(stream=s)
            _same_bits(y, ys[me], f"scatter, rank {me} of {W}, rank 0 misaligned, call {k}")
            _same_bits(back, xs[me], f"gather, rank {me} of {W}, rank 0 misaligned, call {k}")
    return True


test_one_rank_misaligned_with_narrow_rows = one_rank_misaligned.test(
    expect=True, sizes=[w for w in WS if w > 1], timeout_s=240, seed=fresh_seed)


@on_ranks
def errors(world, seed):
    """Bad input raises before any launch and writes nothing to any peer."""
    import cupy

    W, me = world.size, world.rank
    expect = []

    def raises(exc, match, fn, *a, **k):
        try:
            fn(*a, **k)
        except exc as e:
            assert match in str(e), f"{match!r} not in {e!r}"
            expect.append(match)
            return
        raise AssertionError(f"no {exc.__name__} ({match})")

    if W > 1:
        raises(ValueError, "divisible", All2AllHeads, world, 8, W + 1, 64, "bfloat16")
    raises(ValueError, "max_tokens_per_rank", All2AllHeads, world, 0, W, 64, "bfloat16")
    raises(TypeError, "not supported", All2AllHeads, world, 8, W, 64, "int8")
    op = All2AllHeads(world, 8, 2 * W, 64, "bfloat16", batch=2, num_sms=4, timeout_s=30)
    tokens = [8 - (r % 3) for r in range(W)]
    T, S = tokens[me], sum(tokens)
    x = cupy.zeros((1, T, 2 * W, 64), dtype=op.spec.dtype.storage)
    raises(ValueError, "one entry per rank", op.scatter_heads, x, tokens + [1])
    raises(ValueError, "must be in [0", op.scatter_heads, x, [-1] + tokens[1:])
    raises(ValueError, "must be in [0", op.scatter_heads, x, [9] + tokens[1:])
    raises(TypeError, "sequence", op.scatter_heads, x, [1.5] * W)
    raises(ValueError, "must have shape", op.scatter_heads, x[:, :T - 1], tokens)
    raises(ValueError, "batch", op.scatter_heads, cupy.zeros((3, T, 2 * W, 64), x.dtype), tokens)
    raises(TypeError, "must be bfloat16", op.scatter_heads, x.astype(cupy.float32), tokens)
    wide = cupy.zeros((1, T, 2 * W, 128), dtype=x.dtype)
    raises(ValueError, "C-contiguous", op.scatter_heads, wide[..., ::2], tokens)
    raises(ValueError, "scale must have shape", op.scatter_heads, x, tokens,
           cupy.zeros((1, T + 1), cupy.float32))
    raises(TypeError, "scale must be float32", op.scatter_heads, x, tokens,
           cupy.zeros((1, T), cupy.float16))
    raises(ValueError, "out must have shape", op.scatter_heads, x, tokens,
           out=cupy.zeros((1, S + 1, 2, 64), x.dtype))
    raises(ValueError, "not both", op.scatter_heads, x, tokens, view=True,
           out=cupy.zeros((1, S, 2, 64), x.dtype))
    if W > 1:  # at W = 1 a gather input has the scatter input's shape
        raises(ValueError, "must have shape", op.gather_heads, x, tokens)
    if W > 1:
        # Each rank's own input matches its own list, but the lists differ (and are new to
        # every rank): caught by the check across ranks, on every rank.
        mine = list(tokens)
        mine[0] = (tokens[0] + me + 1) % 9
        xm = cupy.zeros((1, mine[me], 2 * W, 64), dtype=x.dtype)
        raises(ValueError, "differs between ranks", op.scatter_heads, xm, mine)
    cupy.cuda.Device().synchronize()
    world.barrier()
    assert op.epoch == 0, "a rejected call advanced the epoch"
    flags = cupy.asnumpy(op.buf.local("flags"))
    assert not flags.any(), "a rejected call wrote a flag"
    for region in ("data0", "data1"):
        assert not cupy.asnumpy(op.buf.local(region)).any(), "a rejected call wrote data"
    # The op still works after all that.
    _exchange(world, op, "bfloat16", 2, tokens, (seed, 80), via="out")
    op.close()
    op.close()  # idempotent
    raises(Exception, "closed", op.scatter_heads, x, tokens)
    return len(expect)


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_bad_input_raises_before_launch(W):
    res = errors.run(W, timeout_s=300, seed=fresh_seed())
    assert len(set(res)) == 1 and res[0] >= 14


@on_ranks
def back_to_back(world, seed, calls=1000):
    """Many calls with changing token counts, no host sync between them, two streams taking
    turns, every third call a view copied on its stream; every result checked at the end."""
    import cupy

    W, me = world.size, world.rank
    H, D, max_tokens = 2 * W, 64, 16
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    kept, plan, inputs = [], [], []
    with All2AllHeads(world, max_tokens, H, D, "bfloat16", num_sms=4, timeout_s=60) as op:
        for i in range(calls):
            tokens = [(i * 7 + r * 5) % (max_tokens + 1) for r in range(W)]
            s = streams[i % 2]
            with s:  # made on the stream that reads it; kept alive until the end
                x = cupy.asarray(_data((1, tokens[me], H, D), "bfloat16", seed, i, me))
            inputs.append(x)
            gather = i % 4 == 3
            if gather:  # gather of the scatter two calls back: the round trip
                y = op.gather_heads(kept[i - 2], plan[i - 2], stream=s)
            elif i % 3 == 2:
                with s:
                    y = op.scatter_heads(x, tokens, view=True, stream=s).copy()
            else:
                y = op.scatter_heads(x, tokens, stream=s)
            kept.append(y)
            plan.append(tokens if not gather else plan[i - 2])
        op.synchronize(stream=streams[0])
        op.synchronize(stream=streams[1])
    for i, (y, tokens) in enumerate(zip(kept, plan)):
        if i % 4 == 3:  # round trip of call i-2
            want = _data((1, tokens[me], H, D), "bfloat16", seed, i - 2, me)
        else:
            xs = [_data((1, tokens[r], H, D), "bfloat16", seed, i, r) for r in range(W)]
            want = reference_scatter_heads(xs, tokens, W)[me]
        _same_bits(y, want, f"call {i} rank {me} tokens {tokens}")
    return calls


test_back_to_back_1000_calls = back_to_back.test(expect=1000, timeout_s=600, seed=fresh_seed)


@on_ranks
def memo_replays(world, seed, calls=18):
    """Calls with out= (and out_scale= with scales) whose arrays repeat, fresh values written
    in place, replay their bound launches from the second repeat on (base.CallMemo): scatter
    and gather, bf16 and fp8 with per-head scales, two streams taking turns (the op keeps its
    calls in one stream order), each call checked bitwise with outputs poisoned first; at
    W = 1 each w1 path. Then view=True calls (a key per slot parity). A dtype view of the
    same input is refused before any launch."""
    import cupy

    W, me = world.size, world.rank
    H, D, max_tokens = 2 * W, 64, 16
    tokens = _tokens(W, max_tokens, seed)
    S, hpr = sum(tokens), H // W
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    checked = 0
    for dtype, per_head in (("bfloat16", False), ("float8_e4m3fn", True)):
        with All2AllHeads(world, max_tokens, H, D, dtype, num_sms=4, timeout_s=60) as op:
            st = op.spec.dtype.storage
            x, y = cupy.empty((1, tokens[me], H, D), st), cupy.empty((1, S, hpr, D), st)
            xs_, ys_ = (cupy.empty((1, tokens[me], H), np.float32),
                        cupy.empty((1, S, hpr), np.float32)) if per_head else (None, None)
            for i in range(calls):
                if W == 1:  # each path three times each way: seen, bound, replayed
                    op.w1 = ("pdl", "memcpy", "kernel")[(i // 6) % 3]
                gather = i % 2 == 1
                src = y if gather else x
                src_sc = ys_ if gather else xs_
                out = x if gather else y
                out_sc = xs_ if gather else ys_
                shape = tuple(src.shape)
                data = [_data((1, S, hpr, D) if gather else (1, tokens[r], H, D), dtype, seed,
                              i, r) for r in range(W)]
                scales = ([_scales((1, S, hpr) if gather else (1, tokens[r], H), seed, i, r)
                           for r in range(W)] if per_head else None)
                src[...] = cupy.asarray(data[me]).reshape(shape)
                if per_head:
                    src_sc[...] = cupy.asarray(scales[me])
                cupy.cuda.runtime.memset(out.data.ptr, 0xFF, out.nbytes)
                if per_head:
                    cupy.cuda.runtime.memset(out_sc.data.ptr, 0xFF, out_sc.nbytes)
                cupy.cuda.Device().synchronize()
                s = streams[(i // 2) % 2]
                call = op.gather_heads if gather else op.scatter_heads
                res = call(src, tokens, src_sc, out=out, out_scale=out_sc, stream=s)
                assert (res is out) if not per_head else (res[0] is out and res[1] is out_sc)
                op.synchronize(stream=s)
                ref = (reference_gather_heads if gather else reference_scatter_heads)(
                    data, tokens, W, scales)
                want, want_sc = ref if per_head else (ref, None)
                _same_bits(out, want[me], f"call {i} {dtype} rank {me}")
                if per_head:
                    _same_bits(out_sc, want_sc[me], f"call {i} {dtype} scales rank {me}")
                checked += 1
            for i in range(calls, calls + 6):  # view=True: a key per slot parity
                data = [_data((1, tokens[r], H, D), dtype, seed, i, r) for r in range(W)]
                scales = ([_scales((1, tokens[r], H), seed, i, r) for r in range(W)]
                          if per_head else None)
                x[...] = cupy.asarray(data[me])
                if per_head:
                    xs_[...] = cupy.asarray(scales[me])
                cupy.cuda.Device().synchronize()
                res = op.scatter_heads(x, tokens, xs_, view=True, stream=streams[0])
                op.synchronize(stream=streams[0])
                got, got_sc = res if per_head else (res, None)
                want = reference_scatter_heads(data, tokens, W, scales)
                _same_bits(got, (want[0] if per_head else want)[me], f"view call {i} {dtype}")
                if per_head:
                    _same_bits(got_sc, want[1][me], f"view call {i} {dtype} scales")
                checked += 1
            assert any(isinstance(e, a2a._Replay) and e.views is not None
                       for e in op._memo.entries.values())
            assert any(isinstance(e, a2a._Replay) for e in op._memo.entries.values())
            with pytest.raises((TypeError, ValueError), match="All2AllHeads"):
                op.scatter_heads(x.view(np.uint8) if st != np.uint8 else x.view(np.int8),
                                 tokens, xs_, out=y, out_scale=ys_)
    return checked


test_repeated_calls_replay_their_launches_and_stay_exact = memo_replays.test(
    expect=48, seed=fresh_seed, timeout_s=300)


@on_ranks
def owned_outputs(world, seed, calls=24):
    """Calls that leave out (and out_scale) to the op, outputs dropped as a loop drops them:
    made before the memo key (CallMemo.output hands dropped ones back), so the calls
    are bound and replayed; each is exact bit for bit (every output it may get poisoned
    first), tokens_per_rank passed as NumPy integers keys as the ints it equals, and an
    output still held is never handed out again. W = 1 runs each of its copy paths."""
    import cupy

    W, me = world.size, world.rank
    H, D, max_tokens = 2 * W, 64, 24
    tokens = _tokens(W, max_tokens, seed)
    S, hpr = sum(tokens), H // W
    checked = 0
    for dtype, per_head in (("bfloat16", False), ("float8_e4m3fn", True)):
        with All2AllHeads(world, max_tokens, H, D, dtype, num_sms=4, timeout_s=60) as op:
            st = op.spec.dtype.storage
            srcs = {g: (cupy.empty((1, S, hpr, D) if g else (1, tokens[me], H, D), st),
                        cupy.empty((1, S, hpr) if g else (1, tokens[me], H), np.float32)
                        if per_head else None) for g in (False, True)}
            for i in range(calls):
                if W == 1:
                    op.w1 = ("pdl", "memcpy", "kernel")[(i // 8) % 3]
                gather = i % 2 == 1
                in_shape = (1, S, hpr, D) if gather else (1, tokens[me], H, D)
                sc_in = (1, S, hpr) if gather else (1, tokens[me], H)
                data = [_data((1, S, hpr, D) if gather else (1, tokens[r], H, D), dtype, seed,
                              i, r) for r in range(W)]
                scales = ([_scales((1, S, hpr) if gather else (1, tokens[r], H), seed, i, r)
                           for r in range(W)] if per_head else None)
                src, src_sc = srcs[gather]  # inputs in place: only the outputs move
                src[...] = cupy.asarray(data[me]).reshape(in_shape)
                if per_head:
                    src_sc[...] = cupy.asarray(scales[me]).reshape(sc_in)
                ref = (reference_gather_heads if gather else reference_scatter_heads)(
                    data, tokens, W, scales)
                want, want_sc = ref if per_head else (ref, None)
                poison_owned(op._memo, want[me].shape, st)
                if per_head:
                    poison_owned(op._memo, want_sc[me].shape, np.float32)
                call = op.gather_heads if gather else op.scatter_heads
                listed = [np.int64(t) for t in tokens] if i % 4 == 2 else tokens
                res = call(src, listed, src_sc)
                got, got_sc = res if per_head else (res, None)
                if i == calls - 3:  # held: the same call again gets another output
                    again = call(src, listed, src_sc)
                    again_out = again[0] if per_head else again
                    # (a rank without tokens gets empty outputs: no memory, pointer 0)
                    assert again_out is not got and (got.size == 0
                                                     or again_out.data.ptr != got.data.ptr)
                    op.synchronize()
                    _same_bits(again_out, want[me], f"held call {i} {dtype} rank {me}")
                    del again, again_out
                op.synchronize()
                _same_bits(got, want[me], f"owned call {i} {dtype} rank {me}")
                if per_head:
                    _same_bits(got_sc, want_sc[me], f"owned call {i} {dtype} scales")
                checked += 1
                del res, got, got_sc
            assert any(isinstance(e, a2a._Replay) and e.views is None
                       for e in op._memo.entries.values())
    return checked


test_calls_that_leave_out_to_the_op_replay_too = owned_outputs.test(
    expect=48, seed=fresh_seed, timeout_s=300)


@on_ranks
def epochs_past_32_bits(world, seed):
    """The device epoch (and the host's parity count) seeded past 2^31 and just below 2^32
    (#19 item 6), the flags fresh (0): with 32-bit flags a slot still 0 compares as reached past
    2^31, so a rank would copy its slot out before a late peer pushed. The last rank comes late
    to every call (tests/checks.py seeded_epoch_calls); every result is checked bit for bit."""
    import cupy

    W, me = world.size, world.rank
    H, D, max_tokens = 2 * W, 64, 16
    done = 0
    with All2AllHeads(world, max_tokens, H, D, "bfloat16", num_sms=4, timeout_s=60) as op:
        for epoch0, i in seeded_epoch_calls(world, op, 4):
            tokens = [(i * 5 + r * 3) % max_tokens + 1 for r in range(W)]
            xs = [_data((1, tokens[r], H, D), "bfloat16", seed, epoch0, i, r) for r in range(W)]
            y = op.scatter_heads(cupy.asarray(xs[me]), tokens, view=bool(i % 2))
            op.synchronize()
            _same_bits(y, reference_scatter_heads(xs, tokens, W)[me],
                       f"rank {me} epoch {epoch0 + i + 1} tokens {tokens}")
            done += 1
    return done


test_epochs_past_32_bits_never_pass_an_unwritten_flag = epochs_past_32_bits.test(
    expect=8, sizes=[w for w in WS if w > 1], timeout_s=300, seed=fresh_seed)


@on_ranks
def timeout(world, seed, timeout_s=2.0):
    """The last rank skips a call: the others raise CommTimeoutError naming op, rank and peer
    within timeout + 1 s, whether the call's arguments were checked before (the device wait
    times out) or are new (the check across ranks times out); afterwards the op closes and a new
    op works."""
    import cupy

    W, me = world.size, world.rank
    late = W - 1
    x = cupy.ones((1, 16, 2 * W, 64), dtype=cupy.float16)
    waited = {}
    for case in ("device", "host"):
        op = All2AllHeads(world, 16, 2 * W, 64, "float16", timeout_s=timeout_s)
        tokens = [16] * W
        op.scatter_heads(x, tokens)  # every rank: the arguments are now agreed
        op.synchronize()
        if case == "host":
            tokens = [16] * (W - 1) + [15]  # new to every rank: checked across ranks again
        if me != late:
            xs = cupy.ones((1, tokens[me], 2 * W, 64), dtype=cupy.float16)
            t0 = time.perf_counter()
            try:
                op.scatter_heads(xs, tokens)
                op.synchronize()
                raise AssertionError(f"{case}: no CommTimeoutError although rank {late} never sent")
            except CommTimeoutError as e:
                waited[case] = time.perf_counter() - t0
                assert (e.op, e.rank, e.peer) == ("All2AllHeads", me, late), f"{case}: {e}"
                assert "All2AllHeads" in str(e) and f"rank {late}" in str(e), str(e)
                assert waited[case] < timeout_s + 1.0, (case, waited[case])
            try:
                op.scatter_heads(xs, tokens)
                raise AssertionError(f"{case}: a failed op ran again")
            except CommTimeoutError:
                pass
        world.barrier()
        op.close()
    with All2AllHeads(world, 16, 2 * W, 64, "float16", timeout_s=30) as op2:
        _exchange(world, op2, "float16", 1, _tokens(W, 16, seed, 90), (seed, 90))
    return waited or None


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_timeout_names_peer_then_usable(W):
    waited = timeout.run(W, timeout_s=300, seed=fresh_seed())
    assert waited[-1] is None  # the rank that skipped
    assert all(set(w) == {"device", "host"} and max(w.values()) < 3.0 for w in waited[:-1])


# ---- CPU tests: no GPU, no ranks ----------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernels_compile(arch):
    cubin, lowered = kernels.compile_source("all2all.cu", a2a.FAMILY.names, arch)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(a2a.FAMILY.names)
    assert "a2a_push<16, true>" in lowered and "a2a_recv<1, false>" in lowered


class FakeWorld:
    def __init__(self, size, rank=0):
        self.size, self.rank, self.device = size, rank, None
        self.checked = []

    def check_same(self, value, what):
        self.checked.append(value)

    def allgather(self, obj):
        return [obj] * self.size

    def alloc_layout(self, layout):
        raise AssertionError("bad arguments must be refused before any allocation")


def _spec(W=4, rank=1, dtype="bfloat16", H=8, D=64, batch=2, max_tokens=16):
    return Spec(W, rank, 0, max_tokens, H, D, dtype_info(dtype), batch)


@pytest.mark.parametrize("args,match", [
    ((4, 16, 6, 64, 1, None, 1.0), "divisible by the world size 4"),
    ((4, 0, 8, 64, 1, None, 1.0), "max_tokens_per_rank must be an integer >= 1"),
    ((4, 16, 8, 0, 1, None, 1.0), "head_dim"),
    ((4, 16, 8, 64, 0, None, 1.0), "batch"),
    ((4, 16, 8, 64, 1, 0, 1.0), "num_sms"),
    ((4, 16, 8, 64, 1, None, 0.0), "timeout_s"),
    ((4, 16, 8.0, 64, 1, None, 1.0), "num_heads"),
    ((2, 2**30, 4, 64, 2, None, 1.0), "2**31 rows"),
])
def test_op_arguments_refused(args, match):
    with pytest.raises(ValueError, match=match.replace("*", r"\*")):
        check_op_args(*args)


def test_constructor_refuses_before_allocating():
    with pytest.raises(ValueError, match="All2AllHeads: num_heads must be divisible"):
        All2AllHeads(FakeWorld(4), 16, 6, 64, "bfloat16")
    with pytest.raises(TypeError, match="All2AllHeads: dtype 'int8' is not supported"):
        All2AllHeads(FakeWorld(2), 16, 4, 64, "int8")
    with pytest.raises(ValueError, match="timeout_s"):
        All2AllHeads(FakeWorld(2), 16, 4, 64, "bfloat16", timeout_s=-1)


def test_tokens_checked():
    assert check_tokens([3, 0, np.int64(5)], 3, 5) == (3, 0, 5)
    with pytest.raises(ValueError, match="one entry per rank \\(3\\), got 2"):
        check_tokens([1, 2], 3, 5)
    msg = r"tokens_per_rank\[1\] must be in \[0, max_tokens_per_rank=5\], got -1"
    with pytest.raises(ValueError, match=msg):
        check_tokens([1, -1, 2], 3, 5)
    with pytest.raises(ValueError, match=r"tokens_per_rank\[2\] .* got 6"):
        check_tokens([1, 1, 6], 3, 5)
    with pytest.raises(TypeError, match="sequence of 3 integers"):
        check_tokens([1, 2.5, 3], 3, 5)
    with pytest.raises(TypeError, match="sequence of 3 integers"):
        check_tokens(7, 3, 5)


def test_shapes_of_both_directions():
    spec = _spec()  # W=4, rank 1, H=8 (2 per rank), D=64
    tokens = (5, 0, 7, 16)
    assert io_shapes(spec, False, 2, tokens) == ((2, 0, 8, 64), (2, 28, 2, 64))
    assert io_shapes(spec, True, 2, tokens) == ((2, 28, 2, 64), (2, 0, 8, 64))
    assert scale_shapes(spec, False, 2, tokens, False) == ((2, 0), (2, 28))
    assert scale_shapes(spec, False, 2, tokens, True) == ((2, 0, 8), (2, 28, 2))
    assert scale_shapes(spec, True, 2, tokens, False) == ((2, 28), (2, 0, 4))
    assert scale_shapes(spec, True, 2, tokens, True) == ((2, 28, 2), (2, 0, 8))


def test_call_arguments_checked():
    spec = _spec(rank=2)
    tokens = (5, 0, 7, 16)
    bf16 = dtype_info("bfloat16").storage
    x = FakeArray((2, 7, 8, 64), bf16)
    assert check_call(spec, False, x, tokens) == (2, 0)
    assert check_call(spec, False, FakeArray((1, 7, 8, 64), bf16), tokens) == (1, 0)
    assert check_call(spec, False, x, tokens, FakeArray((2, 7), np.float32)) == (2, 1)
    assert check_call(spec, False, x, tokens, FakeArray((2, 7, 8), np.float32)) == (2, 2)
    assert check_call(spec, True, FakeArray((2, 28, 2, 64), bf16), tokens,
                      FakeArray((2, 28, 2), np.float32)) == (2, 2)
    bad = [
        (FakeArray((2, 6, 8, 64), bf16), None, ValueError,
         r"x must have shape \[B, tokens_per_rank\[rank\], H, D\] = \(2, 7, 8, 64\) on rank 2, "
         r"got \(2, 6, 8, 64\)"),
        (FakeArray((3, 7, 8, 64), bf16), None, ValueError,
         "batch 3; this op was built for batch 1 to 2"),
        (FakeArray((2, 7, 8, 64), np.float16), None, TypeError, "x must be bfloat16, got float16"),
        (FakeArray((2, 7, 8, 64), bf16, contiguous=False), None, ValueError, "C-contiguous"),
        (FakeArray((2, 7, 8, 64), bf16, device=1), None, ValueError,
         "x is on device 1, this rank uses device 0"),
        (FakeArray((7, 8, 64), bf16), None, ValueError, "4 dimensions"),
        (x, FakeArray((2, 8), np.float32), ValueError,
         r"scale must have shape \(2, 7\) \(per token\) or \(2, 7, 8\) \(per token and head\)"),
        (x, FakeArray((2, 7), np.float16), TypeError, "scale must be float32"),
        (x, FakeArray((2, 7), np.float32, device=3), ValueError, "scale is on device 3"),
    ]
    for arr, scale, exc, match in bad:
        with pytest.raises(exc, match=match):
            check_call(spec, False, arr, tokens, scale)
    with pytest.raises(ValueError, match=r"y must have shape \[B, sum\(tokens\), H/W, D\]"):
        check_call(spec, True, x, tokens)


def test_fp8_is_uint8_storage():
    spec = _spec(dtype="float8_e4m3fn")
    x = FakeArray((1, 0, 8, 64), np.uint8)
    assert check_call(spec, False, x, (5, 0, 7, 16)) == (1, 0)
    with pytest.raises(TypeError, match=r"float8_e4m3fn \(stored as uint8\)"):
        check_call(spec, False, FakeArray((1, 0, 8, 64), np.int8), (5, 0, 7, 16))


def test_vector_width_follows_rows_and_pointers():
    assert vec_bytes(8192, 0, 256) == 16
    assert vec_bytes(2 * 67, 256, 512) == 2      # odd head_dim in bf16
    assert vec_bytes(67, 256, 512) == 1          # odd head_dim in fp8
    assert vec_bytes(2 * 80, 258, 512) == 2      # x two bytes past an aligned address
    assert vec_bytes(4 * 3 * 64, 8, 512) == 8


@pytest.mark.parametrize("W", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("num_blocks", [8, 9, 66, 264, 265])
def test_the_deal_keeps_most_blocks_on_the_peers(W, num_blocks):
    from cuflux.ops.all2all import LOCAL_SHARE, deal_blocks

    num_blocks = max(num_blocks, W)  # the op's floor: every target gets a block
    grid, local, remote = deal_blocks(num_blocks, W)
    assert local >= 1 and grid == local + remote * (W - 1) <= num_blocks
    if W == 1:
        assert remote == 0 and grid == num_blocks
        return
    assert remote >= 1 and grid > num_blocks - (W - 1)  # at most W - 2 blocks left idle
    assert local <= max(1, num_blocks // (LOCAL_SHARE * W))
    if num_blocks >= 2 * LOCAL_SHARE * W:
        assert remote >= 2 * local  # a peer gets more blocks than our own rows do
    # Each sender's block -> target map (the .cu): every peer gets exactly `remote` workers.
    for me in range(W):
        seen = {}
        for b in range(grid):
            t = me if b < local else (me + 1 + (b - local) % (W - 1)) % W
            worker = b if b < local else (b - local) // (W - 1)
            seen.setdefault(t, set()).add(worker)
        assert seen[me] == set(range(local))
        assert all(seen[t] == set(range(remote)) for t in range(W) if t != me)


def test_layout_matches_the_kernel_header():
    spec = _spec(W=4, dtype="float16", H=8, D=67, batch=3, max_tokens=5)
    lay = build_layout(spec, blocks_per_target=33)
    regs = lay.regions
    assert [r for r in regs] == ["data0", "data1", "scale0", "scale1", "flags"]
    assert all(r.offset % 128 == 0 for r in regs.values())
    assert regs["data0"].num_bytes == 3 * 5 * 8 * 67 * 2 == spec.slot_bytes
    assert regs["scale1"].num_bytes == 3 * 5 * 8 * 4
    assert regs["flags"].shape == (2, 4, 33, 32) and regs["flags"].num_bytes == 2 * 4 * 33 * 128


def test_call_hash_is_stable_and_distinguishes_calls():
    k = (False, (3, 0, 5), 1, 0)
    assert call_hash(k) == call_hash((False, (3, 0, 5), 1, 0))
    others = [(True, (3, 0, 5), 1, 0), (False, (3, 5, 0), 1, 0), (False, (3, 0, 5), 2, 0),
              (False, (3, 0, 5), 1, 1)]
    assert len({call_hash(k)} | {call_hash(o) for o in others}) == 5
    assert 0 <= call_hash(k) < 2**32


def test_reference_by_hand():
    # W=2, H=2 (one head per rank), D=1, tokens [1, 2]: values name (rank, token, head).
    x0 = np.array([[[[0.0], [1.0]]]])                       # rank 0: token 0, heads 0/1
    x1 = np.array([[[[10.0], [11.0]], [[20.0], [21.0]]]])   # rank 1: tokens 0 and 1
    y0, y1 = reference_scatter_heads([x0, x1], [1, 2], 2)
    assert y0[0, :, 0, 0].tolist() == [0.0, 10.0, 20.0]     # head 0 of every token, in rank order
    assert y1[0, :, 0, 0].tolist() == [1.0, 11.0, 21.0]
    b0, b1 = reference_gather_heads([y0, y1], [1, 2], 2)
    assert np.array_equal(b0, x0) and np.array_equal(b1, x1)
    # scales: per token [B, T_r] -> [B, S] on every rank, back as [B, T_r, W]
    (_, _), (s0, s1) = reference_scatter_heads([x0, x1], [1, 2], 2,
                                               [np.array([[5.0]]), np.array([[6.0, 7.0]])])
    assert s0.tolist() == s1.tolist() == [[5.0, 6.0, 7.0]]
    _, (g0, g1) = reference_gather_heads([y0, y1], [1, 2], 2, [s0, s1 + 100])
    assert g0.tolist() == [[[5.0, 105.0]]] and g1.tolist() == [[[6.0, 106.0], [7.0, 107.0]]]


@pytest.mark.parametrize("W,tokens", [(1, [5]), (3, [4, 0, 7]), (4, [0, 0, 3, 1]), (8, [2] * 8)])
def test_reference_round_trip(W, tokens):
    rng = np.random.default_rng(W)
    B, H, D = 3, 2 * W, 5
    xs = [rng.standard_normal((B, t, H, D)) for t in tokens]
    scales = [rng.standard_normal((B, t, H)) for t in tokens]
    ys, y_scales = reference_scatter_heads(xs, tokens, W, scales)
    S = sum(tokens)
    for t, y in enumerate(ys):
        assert y.shape == (B, S, 2, D)
        off = 0
        for r, T in enumerate(tokens):  # rank r's tokens at offset sum(T[:r]), heads of rank t
            assert np.array_equal(y[:, off:off + T], xs[r][:, :, 2 * t:2 * t + 2])
            assert np.array_equal(y_scales[t][:, off:off + T], scales[r][:, :, 2 * t:2 * t + 2])
            off += T
    back, back_scales = reference_gather_heads(ys, tokens, W, y_scales)
    for r in range(W):
        assert np.array_equal(back[r], xs[r]) and np.array_equal(back_scales[r], scales[r])


# ---- launch arguments against the kernel signatures (a wrong order would corrupt peers) -------
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_launch_arguments_match_kernel_signatures(monkeypatch, gather, mode):
    from types import SimpleNamespace

    import cuflux.ops.all2all as A
    from tests.kernel_args import DeviceArray, check_args
    from tests.kernel_args import names as names_of

    captured, calls = [], []

    def prepare(fn, grid, block, args, varying, *, name, first=0, **kw):
        captured.append((name, args))
        slots = args[first:first + varying]
        assert all(isinstance(v, np.uint64) and v == 0 for v in slots), (name, slots)
        return lambda stream, *ptrs: calls.append((name, first, ptrs))

    monkeypatch.setattr(A.kernels, "prepare", prepare)
    W, me = 4, 1
    op = object.__new__(A.All2AllHeads)
    op.spec = A.Spec(W, me, 0, 16, 8, 64, dtype_info("bfloat16"), 2)
    op._row_bytes, op.num_blocks, op.w1 = op.spec.row_bytes, 264, "pdl"
    op.grid, op.local_blocks, op.blocks_per_target = A.deal_blocks(264, W)
    op.recv_grid = 132
    op.buf = SimpleNamespace(ptrs_dev=DeviceArray())
    u = np.uint64
    op._push_slots = tuple(u(i) for i in range(6))
    op._wait_flags = (u(1 << 30), u(2 << 30))
    op._copy_slots = ((u(3 << 30), u(4 << 30)), (u(5 << 30), u(6 << 30)))
    op.state = DeviceArray()
    op.err_args = (u(1 << 40), DeviceArray(), u(10**9), np.uint32(2))
    op.err = SimpleNamespace(claim=op.err_args[1])
    op._push = {(v, g): f"push{v}{g}" for v in A._VEC_BYTES for g in (False, True)}
    op._recv = {(v, g): f"recv{v}{g}" for v in A._VEC_BYTES for g in (False, True)}
    tokens = (16, 5, 0, 9)
    plan = A._Plan(tokens, np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32))
    plan.prefix_dev = DeviceArray()
    def arr(ptr):
        a = DeviceArray()
        a.data = SimpleNamespace(ptr=ptr)
        return a

    x, sc, y, ysc = arr(1 << 20), arr(2 << 20), arr(3 << 20), arr(4 << 20)
    op._launch(gather, x, sc if mode else None, y, ysc if mode else None, plan, 2, mode,
               12345, 0, False, None)
    names = [n for n, _ in captured]
    assert names == ["a2a_push", "a2a_recv"]
    for (name, args), kernel in zip(captured, ("a2a_push", "a2a_recv")):
        check_args("all2all.cu", kernel, args)
    # the call's pointers into the prepared slots: input, scales, output, output scales; the
    # receive kernel's output pair after its fixed flags and slots
    nsc = (2 << 20) if mode else 0
    nysc = (4 << 20) if mode else 0
    assert calls == [("a2a_push", 0, (1 << 20, nsc, 3 << 20, nysc)),
                     ("a2a_recv", len(op._wait_flags) + 4, (3 << 20, nysc))]
    first = len(op._wait_flags) + 4
    assert names_of("all2all.cu", "a2a_recv")[first:first + 2] == ["out", "out_scale"]
    assert names_of("all2all.cu", "a2a_push")[:4] == ["src", "src_scale", "local_dst",
                                                     "local_dst_scale"]
    calls.clear()
    op._launch(gather, x, sc if mode else None, y, ysc if mode else None, plan, 2, mode,
               12345, 0, False, None)
    assert len(captured) == 2 and len(calls) == 2  # kept on the plan: nothing prepared again
    captured.clear()  # a view: a2a_recv only waits (null outputs, copy = 0)
    calls.clear()
    op._launch(gather, x, sc if mode else None, y, ysc if mode else None, plan, 2, mode,
               12345, 0, True, None)
    assert [n for n, _ in captured] == ["a2a_push", "a2a_recv"]
    check_args("all2all.cu", "a2a_recv", captured[-1][1])
    assert calls[-1] == ("a2a_recv", len(op._wait_flags) + 4, (0, 0))


def _row_map(gather, prefix, W, sender, target, B):
    """a2a_push's RowMap of `sender` for `target` (kernels_cu/all2all.cu), restated: the
    (src row, dst row) of each of its B * n_tok rows."""
    S = int(prefix[W])
    if gather:
        n_tok = int(prefix[target + 1] - prefix[target])
        m = (n_tok, S, 1, int(prefix[target]), n_tok * W, W, sender)
    else:
        n_tok = int(prefix[sender + 1] - prefix[sender])
        m = (n_tok, n_tok * W, W, target, S, 1, int(prefix[sender]))
    n, sb, st, sc, db, dt_, dc = m
    return [(b * sb + t * st + sc, b * db + t * dt_ + dc) for b in range(B) for t in range(n)]


def _recv_rows(gather, prefix, W, me, p, B):
    """a2a_recv's rows for peer p on rank me: the destination rows of its map (restated)."""
    S = int(prefix[W])
    if gather:
        n_tok = int(prefix[me + 1] - prefix[me])
        return [b * n_tok * W + t * W + p for b in range(B) for t in range(n_tok)]
    n_tok = int(prefix[p + 1] - prefix[p])
    return [b * S + int(prefix[p]) + t for b in range(B) for t in range(n_tok)]


def _copy_rows_model(row_bytes, vec, num_rows, worker, num_workers, threads=512, unroll=4):
    """kernels_cu/all2all.cu copy_rows restated: {row: set of byte offsets} this worker moves."""
    vecs_per_row = row_bytes // vec
    pieces = -(-row_bytes // 16)
    rows_per_pass = threads // min(threads, pieces)
    threads_per_row = threads // rows_per_pass
    row_step = num_workers * rows_per_pass
    got = {}
    for t in range(threads):
        sub, col0 = divmod(t, threads_per_row)
        if sub >= rows_per_pass:
            continue
        for r0 in range(worker * rows_per_pass + sub, num_rows, unroll * row_step):
            for k in range(unroll):
                r = r0 + k * row_step
                if r < num_rows:
                    for c in range(col0, vecs_per_row, threads_per_row):
                        cols = got.setdefault(r, [])
                        cols += range(c * vec, (c + 1) * vec)
    return got


@pytest.mark.parametrize("row_bytes", [4, 12, 67, 256, 1000, 8192, 10240, 40000])
def test_copy_rows_splits_rows_the_same_at_every_vector_width(row_bytes):
    """Which worker takes which row must not depend on the vector width: a2a_recv on one rank
    takes the rows a2a_push's worker took on another, and each rank picks its width from its
    own pointers. Every byte of every row is moved once, by one worker."""
    num_rows, R = 37, 5
    split = None
    for vec in [v for v in (16, 8, 4, 2, 1) if row_bytes % v == 0]:
        owners, moved = {}, {}
        for w in range(R):
            for r, cols in _copy_rows_model(row_bytes, vec, num_rows, w, R).items():
                assert r not in owners, (vec, r)
                owners[r] = w
                moved[r] = sorted(cols)
        assert sorted(owners) == list(range(num_rows))
        assert all(moved[r] == list(range(row_bytes)) for r in moved), vec
        split = split or owners
        assert owners == split, f"vec {vec} splits the rows differently"


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("tokens", [(3,), (4, 0), (2, 5, 1), (0, 0, 7, 1),
                                    (1, 1, 1, 1, 9, 0, 2, 3)])
def test_each_recv_block_copies_what_its_peer_pushed(gather, tokens):
    """a2a_recv's block for peer p recomputes p's RowMap for this rank from the destination side:
    its rows are the ones p pushed (the same order, so the same split among workers), and with
    this rank's own rows (pushed straight to the output) they cover the output once."""
    W, B = len(tokens), 2
    prefix = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    S = int(prefix[W])
    for me in range(W):
        covered = [d for _, d in _row_map(gather, prefix, W, me, me, B)]
        for p in range(W):
            if p == me:
                continue
            pushed = [d for _, d in _row_map(gather, prefix, W, p, me, B)]
            assert _recv_rows(gather, prefix, W, me, p, B) == pushed
            covered += pushed
        rows = B * int(tokens[me]) * W if gather else B * S  # x_me [B, T_me, W groups] / y_me
        assert sorted(covered) == list(range(rows)), (me, gather)


def test_a_full_plan_cache_keeps_what_captured_graphs_hold(monkeypatch):
    """Emptying the token-list cache synchronizes the device and frees prefix arrays: never
    during a capture on the call's stream; otherwise a full cache drops every list but those
    a captured call used (a graph holds their prefix arrays), with the memo's bound calls
    and the checked keys, and fills to CACHE_MAX beside the captured ones before the next
    emptying (an op captured once no longer grows without bound)."""
    import collections
    from types import SimpleNamespace

    import cupy

    import cuflux.ops.all2all as A

    W = 2
    op = object.__new__(A.All2AllHeads)
    op.spec = A.Spec(W, 0, 0, 4096, 8, 64, dtype_info("bfloat16"), 1)
    done = []
    monkeypatch.setattr(cupy.cuda, "Device",
                        lambda d: SimpleNamespace(synchronize=lambda: done.append("sync")))
    op._memo = SimpleNamespace(clear=lambda: done.append("memo"))
    op._hashes, op._plans_captured = {"a key": 1}, 0

    def full(captured=()):
        op._plans = collections.OrderedDict()
        for i in range(A.CACHE_MAX):
            plan = op._plans[(i, 0)] = A._Plan((i, 0), np.array([0, i, i]))
            plan.captured = i in captured

    capturing = {"yes": True, "no": False}
    monkeypatch.setattr(A, "_capturing", lambda s: capturing[s])
    full()
    plan = op._plan((3, 4), "yes")
    assert not done and len(op._plans) == A.CACHE_MAX + 1 and plan.tokens == (3, 4)
    full(captured={1, 5})
    op._plan((5, 6), "no")
    assert done == ["sync", "memo"] and op._hashes == {}
    assert list(op._plans) == [(1, 0), (5, 0), (5, 6)] and op._plans_captured == 2
    for i in range(A.CACHE_MAX - 1):
        op._plan((100 + i % 1000, i // 1000), "no")
    assert len(done) == 2 and len(op._plans) == A.CACHE_MAX + 2
    op._plan((7, 8), "no")
    assert len(done) == 4 and list(op._plans) == [(1, 0), (5, 0), (7, 8)]


def test_memo_keys_tokens_as_the_ints_the_full_path_takes():
    """The call memo keys tokens_per_rank as ints (operator.index, as check_tokens): NumPy
    integers key as the ints they equal; floats, strings and arrays get no key (the full
    path then raises, or takes them as it always did)."""
    assert a2a._tokens_key([1, 2]) == (1, 2) and a2a._tokens_key((np.int64(3), 0)) == (3, 0)
    assert all(type(t) is int for t in a2a._tokens_key([np.int32(5), np.uint8(1)]))
    for bad in ([1.0, 2], (2, 0.5), "ab", np.array([1, 2]), None):
        assert a2a._tokens_key(bad) is None, bad
