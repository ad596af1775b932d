"""Tests of the PyTorch route (issue 21), GPU and CPU in one file. torch is optional: the tests
that need it are skipped, with the reason, where it is missing.

GPU tests (marked gpu; skipped, with the reason, without a GPU): cuflux.torch's layers forward
and backward against the unsharded torch layer in float64, torch in / torch out of the ops, and
cuflux.init on a torch.distributed gloo group. Each runs a rank body beside it (@on_ranks) on W
ranks that share the GPU under mpiexec (W from CUFLUX_TEST_WORLD_SIZES, default 1, 2, 4). Every
rank draws the full layer (weights, inputs, output gradients) from one seed, runs its shard
through cuflux.torch, and checks its share of the outputs and gradients against the unsharded
torch layer computed in float64 from the same (bf16-rounded) values, to bf16 / cuBLAS tolerance.
A body returns True, or "torch missing" where torch cannot be imported.

CPU tests: cuflux.torch's import refusal, the launcher's environment and its mismatch refusal
(pure functions), torch in / torch out helpers, the layers' argument checks, and cuflux.init over
a torch.distributed gloo group on two CPU processes (World's host collectives, op communicators,
a timeout naming the peer).
"""
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

import cuflux
from cuflux import world as world_mod
from cuflux.arrays import external_stream, framework_of, is_torch, to_caller
from cuflux.errors import CufluxError
from tests.mpi import fresh_seed, on_ranks, world_sizes

try:
    import torch
except ImportError:  # the tests that need it are skipped, with the reason
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed: pip install torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WS = world_sizes()


# ==== GPU tests: the rank bodies (@on_ranks), their helpers and the test that runs them ===========
def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None


def _close(got, want, what, rtol=2e-2, atol_frac=2e-2):
    """|got - want| <= atol + rtol |want|, atol a fraction of want's largest magnitude."""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)}, want {tuple(w.shape)}"
    atol = atol_frac * float(w.abs().max()) + 1e-12
    bad = (g - w).abs() > atol + rtol * w.abs()
    if bad.any() or not g.isfinite().all():
        i = tuple(int(v) for v in bad.nonzero()[0]) if bad.any() else ()
        raise AssertionError(f"{what}: {int(bad.sum())} of {g.numel()} off; first {i}: got "
                             f"{g[i].item() if i else g.flatten()[0]}, want "
                             f"{w[i].item() if i else w.flatten()[0]}")


def _device_and_side_stream(torch, world):
    """This rank's torch device and a side stream on it (the ops' calls made there test that
    they queue on torch's current stream, not the default one)."""
    dev = torch.device("cuda", world.device)
    return dev, torch.cuda.Stream(device=dev)


def _side_streams(torch, world):
    """This rank's torch device, a torch side stream on it, and the same stream as CuPy's
    (the CuPy twin calls of a test queue behind the torch calls)."""
    dev, side = _device_and_side_stream(torch, world)
    return dev, side, external_stream(side.cuda_stream, world.device)


def _bits(t):
    """A tensor's bytes: bit-for-bit comparisons, NaN patterns included."""
    return t.contiguous().view(_torch().uint8)


def _draw(torch, seed, *shape, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * scale


@on_ranks
def linear_layers(world, seed=0, tokens_per_rank=24, dtype="bfloat16"):
    """ColumnParallelLinear and RowParallelLinear, forward and backward, with bias."""
    torch = _torch()
    if torch is None:
        return "torch missing"
    from cuflux.torch import ColumnParallelLinear, RowParallelLinear, shard_rows

    W, me = world.size, world.rank
    dt = getattr(torch, dtype)
    dev = torch.device("cuda", world.device)
    T, d_in, d_out = tokens_per_rank * W, 64, 32 * W
    q = lambda a: a.to(dt).double()  # noqa: E731  (what the GPU sees, in float64)
    x = q(_draw(torch, seed, T, d_in))
    wc = q(_draw(torch, seed + 1, d_out, d_in, scale=d_in ** -0.5))
    bc = q(_draw(torch, seed + 2, d_out))
    gy = q(_draw(torch, seed + 3, T, d_out))
    rows, cols = shard_rows(T, W, me), shard_rows(d_out, W, me)

    with ColumnParallelLinear(world, d_in, d_out, max_tokens=T, bias=True, dtype=dt) as col:
        col.load_full(wc.to(dt).to(dev), bc.to(dt).to(dev))
        xs = x[rows].to(dt).to(dev).requires_grad_()
        y = col(xs)
        assert isinstance(y, torch.Tensor) and y.dtype == dt and y.shape == (T, d_out // W)
        _close(y, (x @ wc.T + bc)[:, cols], f"column forward rank {me}")
        y.backward(gy[:, cols].to(dt).to(dev))
        torch.cuda.synchronize(dev)
        _close(xs.grad, (gy @ wc)[rows], f"column grad x rank {me}")
        _close(col.weight.grad, gy[:, cols].T @ x, f"column grad weight rank {me}")
        _close(col.bias.grad, gy[:, cols].sum(0), f"column grad bias rank {me}")

    # Row-parallel: in = d_out (the column layer's width), out = d_in.
    z = q(_draw(torch, seed + 4, T, d_out))
    wr = q(_draw(torch, seed + 5, d_in, d_out, scale=d_out ** -0.5))
    br = q(_draw(torch, seed + 6, d_in))
    gz = q(_draw(torch, seed + 7, T, d_in))
    with RowParallelLinear(world, d_out, d_in, max_tokens=T, bias=True, dtype=dt) as row:
        row.load_full(wr.to(dt).to(dev), br.to(dt).to(dev))
        zs = z[:, cols].to(dt).to(dev).requires_grad_()
        y = row(zs)
        assert isinstance(y, torch.Tensor) and y.shape == (T // W, d_in)
        _close(y, (z @ wr.T + br)[rows], f"row forward rank {me}")
        y.backward(gz[rows].to(dt).to(dev))
        torch.cuda.synchronize(dev)
        _close(zs.grad, (gz @ wr)[:, cols], f"row grad x rank {me}")
        _close(row.weight.grad, gz.T @ z[:, cols], f"row grad weight rank {me}")
        _close(row.bias.grad, gz.sum(0), f"row grad bias rank {me}")
    return True


NORM_OUTPUTS = ("replicated", "sharded_residual", "sequence_parallel")


@on_ranks
def norm_layer(world, seed=10, H=256, token_counts=(12, 13)):
    """ParallelRMSNorm, every output mode, forward and backward against torch in float64: one
    layer per mode called at a token count the ranks split evenly and at one they do not
    (token_slice: slices differing by a row). sharded_residual: the residual rows a rank does
    not own are poisoned, to show the op neither reads nor writes them."""
    torch = _torch()
    if torch is None:
        return "torch missing"
    from cuflux.torch import ParallelRMSNorm

    for i, output in enumerate(NORM_OUTPUTS):
        with ParallelRMSNorm(world, H, max_tokens=max(token_counts), eps=1e-6,
                             dtype=torch.bfloat16, output=output) as norm:
            for j, T in enumerate(token_counts):  # the same layer again: its ops' next epoch
                _check_norm(torch, world, norm, seed + 1000 * (len(token_counts) * i + j), T)
    return True


def _check_norm(torch, world, norm, seed, T):
    from cuflux.ops.allreduce import token_slice

    W, me, H, output = world.size, world.rank, norm.hidden, norm.output
    dt, dev, eps = torch.bfloat16, torch.device("cuda", world.device), norm.eps
    q = lambda a: a.to(dt).double()  # noqa: E731
    xs = [q(_draw(torch, seed + r, T, H)) for r in range(W)]
    res, w = q(_draw(torch, seed + 100, T, H)), q(1 + 0.5 * _draw(torch, seed + 101, H))
    g_out, g_res = q(_draw(torch, seed + 102, T, H)), q(_draw(torch, seed + 103, T, H))
    # the unsharded layer, float64 autograd: loss = <out, g_out> + <h, g_res>
    xr = [x.clone().requires_grad_() for x in xs]
    rr, wr = res.clone().requires_grad_(), w.clone().requires_grad_()
    h = sum(xr) + rr
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * wr
    torch.autograd.backward((out, h), (g_out, g_res))
    h, out = h.detach(), out.detach()

    a, b = token_slice(T, W, me)
    mine = torch.zeros(T, dtype=torch.bool)
    mine[a:b] = True
    poison = 512.0 * (me + 1)  # exact in bf16
    if output == "replicated":   # everything for all T tokens, the same on every rank
        r_in, grads, want_out, want_res, want_gr = res, (g_out, g_res), out, h, rr.grad
    elif output == "sharded_residual":  # out replicated; the residual's other rows pass through
        r_in = torch.where(mine[:, None], res, torch.full_like(res, poison))
        grads, want_out, want_res = (g_out, g_res), out, h  # want_res: on the slice's rows
        want_gr = torch.where(mine[:, None], rr.grad, g_res)
    else:                        # sequence_parallel: this rank's slice of everything
        r_in, grads, want_out, want_res, want_gr = (
            res[a:b], (g_out[a:b], g_res[a:b]), out[a:b], h[a:b], rr.grad[a:b])
    what = f"norm {output} T={T} seed={seed} rank {me}"

    norm.weight.data.copy_(w.to(dt))
    norm.weight.grad = None
    x = xs[me].to(dt).to(dev).requires_grad_()
    r = r_in.to(dt).to(dev).requires_grad_()
    o, new_res = norm(x, r)
    assert isinstance(o, torch.Tensor) and isinstance(new_res, torch.Tensor)
    _close(o, want_out, f"{what}: out")
    if output == "sharded_residual":
        _close(new_res[a:b], want_res[a:b], f"{what}: residual")
        assert bool((new_res[~mine.to(dev)] == poison).all()), f"{what}: rows of others written"
    else:
        _close(new_res, want_res, f"{what}: residual")
    torch.autograd.backward((o, new_res), tuple(g.to(dt).to(dev) for g in grads))
    torch.cuda.synchronize(dev)
    _close(x.grad, xr[me].grad, f"{what}: grad x")  # the full grad of h, every rank
    _close(r.grad, want_gr, f"{what}: grad residual")
    _close(norm.weight.grad, wr.grad, f"{what}: grad weight")  # the full one, every rank


@on_ranks
def ulysses(world, seed=20, T_r=16, D=32, dtype="float32"):
    """UlyssesAttention (scaled_dot_product_attention, causal) forward and backward."""
    torch = _torch()
    if torch is None:
        return "torch missing"
    from cuflux.torch import UlyssesAttention, shard_rows

    W, me = world.size, world.rank
    dt, dev = getattr(torch, dtype), torch.device("cuda", world.device)
    H, T, B = 2 * W, T_r * W, 1
    q = lambda a: a.to(dt).double()  # noqa: E731
    qkv = [q(_draw(torch, seed + i, B, T, H, D)) for i in range(3)]
    g = q(_draw(torch, seed + 3, B, T, H, D))
    ref_in = [t.clone().requires_grad_() for t in qkv]
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in ref_in), is_causal=True).transpose(1, 2)
    ref.backward(g)
    rows = shard_rows(T, W, me)
    tol = dict(rtol=1e-3, atol_frac=1e-3) if dtype == "float32" else {}
    with UlyssesAttention(world, H, D, max_tokens_per_rank=T_r, batch=B, dtype=dt) as attn:
        mine = [t[:, rows].to(dt).to(dev).requires_grad_() for t in qkv]
        out = attn(*mine, is_causal=True)
        assert isinstance(out, torch.Tensor) and out.shape == (B, T_r, H, D)
        _close(out, ref.detach()[:, rows], f"ulysses out rank {me}", **tol)
        out.backward(g[:, rows].to(dt).to(dev))
        torch.cuda.synchronize(dev)
        for name, t, r in zip("qkv", mine, ref_in):
            _close(t.grad, r.grad[:, rows], f"ulysses grad {name} rank {me}", **tol)
    return True


@on_ranks
def torch_in_torch_out(world, seed=30):
    """AllReduce / AllReduceRMSNorm / All2AllHeads / AllGather: torch tensors in, torch tensors
    out, on torch's current stream (a side stream here) by default."""
    torch = _torch()
    if torch is None:
        return "torch missing"
    import cuflux

    W, me = world.size, world.rank
    dev, side = _device_and_side_stream(torch, world)
    with cuflux.AllReduce(world, 4096, "bfloat16") as ar, \
            cuflux.All2AllHeads(world, 16, 2 * W, 64, "bfloat16") as a2a, \
            cuflux.AllGather(world, 8, 64, "bfloat16") as ag:
        x = torch.full((64, 64), float(me + 1), dtype=torch.bfloat16, device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # torch's current stream: where the ops queue by default
            y = ar(x)
            given = torch.empty_like(x)
            y2 = ar(x, out=given)
            h = torch.full((1, 16, 2 * W, 64), float(me), dtype=torch.bfloat16, device=dev)
            heads = a2a.scatter_heads(h, (16,) * W)
            g = ag(x[:8])
        side.synchronize()
        assert isinstance(y, torch.Tensor) and y.device == dev and y.shape == x.shape
        assert y2 is given
        want = W * (W + 1) / 2
        assert bool((y == want).all()) and bool((y2 == want).all()), y
        assert isinstance(heads, torch.Tensor) and heads.shape == (1, 16 * W, 2, 64)
        for r in range(W):
            assert bool((heads[:, 16 * r:16 * (r + 1)] == r).all())
        assert isinstance(g, torch.Tensor) and g.shape == (8 * W, 64)
        for r in range(W):
            assert bool((g[8 * r:8 * (r + 1)] == r + 1).all())
        # CuPy in, CuPy out, unchanged
        import cupy

        with world.device_context():
            c = ar(cupy.from_dlpack(x[0, :16].contiguous()))
            assert isinstance(c, cupy.ndarray)
            cupy.cuda.Device().synchronize()
    return True


@on_ranks
def torch_route(world, seed=40):
    """cuflux.init on a torch.distributed gloo group (file:// store made by rank 0): a World
    without mpi4py's collectives, ops on it, torch in / torch out, an All2AllHeads argument
    check through the gloo group."""
    torch = _torch()
    if torch is None:
        return "torch missing"
    import torch.distributed as dist

    import cuflux

    W, me = world.size, world.rank
    path = world.allgather(tempfile.mktemp(prefix="cuflux-gloo-") if me == 0 else None)[0]
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=me, world_size=W)
    try:
        tw = cuflux.init(dist.group.WORLD, device=world.device, timeout_s=60)
        assert (tw.rank, tw.size, tw.device) == (me, W, world.device), tw
        dev = torch.device("cuda", tw.device)
        with cuflux.AllReduce(tw, 1024, "float32") as ar, \
                cuflux.All2AllHeads(tw, 8, 2 * W, 32, "float32") as a2a:
            x = torch.full((1024,), float(me + 1), device=dev)
            y = ar(x)
            torch.cuda.synchronize(dev)
            assert isinstance(y, torch.Tensor) and bool((y == W * (W + 1) / 2).all())
            for tokens in ((8,) * W, tuple(range(8, 8 - W, -1))):  # two new lists: checked
                xs = torch.full((1, tokens[me], 2 * W, 32), float(me), device=dev)
                out = a2a.scatter_heads(xs, tokens)
                back = a2a.gather_heads(out, tokens)
                torch.cuda.synchronize(dev)
                assert torch.equal(back, xs)
        tw.close()
    finally:
        dist.destroy_process_group()
        if me == 0 and os.path.exists(path):
            os.remove(path)
    return True


@on_ranks
def torch_calls_replay(world, seed=50, calls=12):
    """The memoized ops called from torch as cuflux.torch calls them (outputs left to the op,
    torch's current stream: a side stream) and with out=: each call bit for bit the CuPy
    call of the same op on the same data (itself checked against float64 in the op's own
    tests) on fresh data every call, outputs poisoned first (a block of torch's allocator
    filled and freed just before, which the call's own output then takes), torch in and
    torch out (out= returned as given, fp8 in fp8 out), most calls replayed (a memo entry
    keyed by torch tensors; the full path runs at most the first few), an output still held
    never written by the next call, and a tensor that requires grad refused after its
    twin's call was bound."""
    torch = _torch()
    if torch is None:
        return "torch missing"
    import cupy

    from cuflux.ops import gemm as gemm_mod

    W, me = world.size, world.rank
    dev, side, cs = _side_streams(torch, world)

    def draw(i, *shape, dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(seed * 100003 + i * 64 + me)
        t = torch.rand(*shape, generator=g) * 2 - 1
        if dtype in (torch.float8_e4m3fn,):
            return (t * 8).to(dtype).to(dev)
        return t.to(dtype).to(dev)

    def poison(shape, dtype):
        p = torch.empty(shape, dtype=dtype, device=dev)
        p.view(torch.uint8).fill_(0xFF)  # NaN in every float format here
        del p

    def same(got, want, what):
        assert isinstance(got, torch.Tensor) and got.device == dev, (what, type(got))
        want = want if isinstance(want, torch.Tensor) else torch.from_dlpack(want)
        assert got.shape == want.shape, (what, got.shape, want.shape)
        if want.dtype != got.dtype:  # fp8 from CuPy: its uint8 storage
            want = want.view(got.dtype)
        assert torch.equal(_bits(got), _bits(want)), f"{what} rank {me}"

    def cu(t):  # the same data as CuPy (fp8 as its uint8 storage)
        if t.dtype == torch.float8_e4m3fn:
            t = t.view(torch.uint8)
        return cupy.from_dlpack(t)

    def full_calls(op, name="_call", arg=0, gather=None):
        """Counts the op's full-path calls made with torch tensors (argument `arg`; with
        `gather`, only the calls of that direction: argument 0 of All2AllHeads._run)."""
        count = [0]
        inner = getattr(op, name)

        def counted(*a, **k):
            count[0] += isinstance(a[arg], torch.Tensor) and (gather is None or a[0] == gather)
            return inner(*a, **k)
        setattr(op, name, counted)
        return count

    def torch_keyed(memo):
        return sum(any(isinstance(e, torch.dtype) for e in k) for k in memo.entries)

    H, T, D = 256, 12, 64
    tokens = tuple(T + (r % 3) for r in range(W))
    with torch.cuda.stream(side), \
            cuflux.AllReduce(world, 1 << 14, "bfloat16") as ar, \
            cuflux.AllReduce(world, 1 << 14, "bfloat16") as ar_out, \
            cuflux.AllReduceRMSNorm(world, 64, H, "bfloat16") as norm, \
            cuflux.All2AllHeads(world, T + 2, 2 * W, D, "bfloat16") as a2a, \
            cuflux.All2AllHeads(world, T + 2, 2 * W, D, "float8_e4m3fn") as a2q:
        # each kind of call counted apart (ar: owned outputs, ar_out: out=)
        counts = {"ar owned": full_calls(ar), "ar out=": full_calls(ar_out),
                  "norm": full_calls(norm),
                  "a2a scatter": full_calls(a2a, "_run", 1, False),
                  "a2a gather": full_calls(a2a, "_run", 1, True),
                  "a2a fp8 scatter": full_calls(a2q, "_run", 1)}
        res = draw(999, T, H)
        w = draw(998, H)
        # Inputs refilled in place each call (fresh data, the same tensors), as a model's
        # step refills its buffers: the loop's allocations repeat call after call, so do
        # the torch allocator's blocks, so do the calls' keys.
        bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
        x, given, r_t, r_t2 = (torch.empty(T, H, dtype=bf16, device=dev) for _ in range(4))
        xs = torch.empty(1, tokens[me], 2 * W, D, dtype=bf16, device=dev)
        xq = torch.empty(1, tokens[me], 2 * W, D, dtype=fp8, device=dev)
        sq = torch.empty(1, tokens[me], dtype=torch.float32, device=dev)
        for i in range(calls):
            x.copy_(draw(i, T, H))
            poison((T, H), bf16)
            y = ar(x)
            y2 = ar_out(x, out=given)
            assert y2 is given
            want = ar(cu(x), stream=cs)
            same(y, want, f"allreduce call {i}")
            same(y2, want, f"allreduce out= call {i}")

            r_t.copy_(res)
            r_t2.copy_(res)
            r_c = cu(r_t2)
            poison((T, H), bf16)
            z = norm(x, r_t, w)
            zc = norm(cu(x), r_c, cu(w), stream=cs)
            same(z, zc, f"norm call {i}")
            same(r_t, r_c, f"norm residual call {i}")

            xs.copy_(draw(100 + i, 1, tokens[me], 2 * W, D))
            poison((1, sum(tokens), 2, D), bf16)
            ys = a2a.scatter_heads(xs, tokens)
            same(ys, a2a.scatter_heads(cu(xs), tokens, stream=cs), f"a2a scatter call {i}")
            back = a2a.gather_heads(ys, tokens)
            same(back, xs, f"a2a round trip call {i}")

            xq.copy_(draw(200 + i, 1, tokens[me], 2 * W, D, dtype=fp8))
            sq.copy_(draw(300 + i, 1, tokens[me]).abs().float() + 0.5)
            poison((1, sum(tokens), 2, D), fp8)
            yq, yqs = a2q.scatter_heads(xq, tokens, sq)
            assert yq.dtype == fp8 and yqs.dtype == torch.float32
            wq, wqs = a2q.scatter_heads(cu(xq), tokens, cu(sq), stream=cs)
            same(yq, wq, f"a2a fp8 call {i}")
            same(yqs, wqs, f"a2a fp8 scales call {i}")
            del y, y2, z, ys, back, yq, yqs
        side.synchronize()
        # a key is bound at its second sighting and the loop's pointers repeat (torch's
        # allocator hands the dropped blocks back): at least half of each kind replayed
        full = {name: count[0] for name, count in counts.items()}
        assert all(n <= calls // 2 for n in full.values()), \
            f"of {calls} torch calls of each kind, these took the full path: {full}"
        # an output still held is not the next call's: its values stay
        held = ar(x)
        ar(x * 2)
        same(held, ar(cu(x), stream=cs), "held allreduce output")
        # a tensor that requires grad is refused, also where its twin's call was bound
        ar_out(x, out=given)
        ar_out(x, out=given)  # bound
        x.requires_grad_()
        with pytest.raises((RuntimeError, TypeError)):
            ar_out(x, out=given)
        x.requires_grad_(False)
        with pytest.raises(ValueError, match="contiguous"):  # not C-contiguous: refused
            ar(x.t())
        # owned outputs of a call on a stream that is not torch's current one (its pool)
        other = torch.cuda.Stream(device=dev)
        other.wait_stream(side)
        for i in range(3):
            got = ar(x, stream=other)
            other.synchronize()
            same(got, ar(cu(x), stream=cs), f"allreduce on another stream, call {i}")
            side.synchronize()
        for name, op in (("ar", ar), ("ar_out", ar_out), ("norm", norm), ("a2a", a2a),
                         ("a2q", a2q)):
            assert torch_keyed(op._memo) >= 1, f"{name}: no call keyed by torch tensors bound"

    # gemm (local at any W) and GemmReduceScatter at W = 1
    M, N, K = 24, 64, 128
    memo = gemm_mod._memo()
    with torch.cuda.stream(side):
        b = draw(400, N, K)
        for i in range(calls):
            a = draw(500 + i, M, K)
            poison((M, N), torch.bfloat16)
            c = cuflux.gemm(a, b, b_layout="nk")
            given = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
            c2 = cuflux.gemm(a, b, out=given, b_layout="nk")
            assert c2 is given
            want = cuflux.gemm(cu(a), cu(b), b_layout="nk", stream=cs)
            same(c, want, f"gemm call {i}")
            same(c2, want, f"gemm out= call {i}")
            del c, c2
        assert torch_keyed(memo) >= 2, "gemm: no torch-keyed call bound"
        if W == 1:
            with cuflux.GemmReduceScatter(world, M, N, K, "bfloat16", b_layout="nk") as rs:
                for i in range(calls):
                    a = draw(600 + i, M, K)
                    poison((M, N), torch.bfloat16)
                    c = rs(a, b)
                    same(c, cuflux.gemm(cu(a), cu(b), b_layout="nk", stream=cs),
                         f"gemm_rs W=1 call {i}")
                    del c
                assert torch_keyed(rs._memo) >= 1, "gemm_rs: no torch-keyed call bound"
    side.synchronize()
    return True


@on_ranks
def torch_graph_capture(world, seed=60, replays=4):
    """The memoized ops captured by torch itself (torch.cuda.graph, its default capture mode)
    after a warm-up on the side stream, as a decode loop captures a layer: each replay with
    new inputs written in place is bit for bit the CuPy call of the same op on the same data.
    AllReduce, AllReduceRMSNorm (output left to the op, from torch's graph pool), gemm with
    out=, All2AllHeads scatter with out=."""
    torch = _torch()
    if torch is None:
        return "torch missing"
    import cupy

    W, me = world.size, world.rank
    dev, side, cs = _side_streams(torch, world)
    g = torch.Generator().manual_seed(seed * 7919 + me)

    def fresh(t):
        t.copy_((torch.rand(t.shape, generator=g) * 2 - 1).to(t.dtype))

    H, T, D, M, N, K = 256, 8, 64, 16, 64, 128
    tokens = (T,) * W
    bf16 = torch.bfloat16
    # the references run on ops of their own: an op a graph holds is replayed, not mixed with
    # eager calls here
    with cuflux.AllReduce(world, 1 << 14, "bfloat16") as ar, \
            cuflux.AllReduceRMSNorm(world, 64, H, "bfloat16") as norm, \
            cuflux.All2AllHeads(world, T, 2 * W, D, "bfloat16") as a2a, \
            cuflux.AllReduce(world, 1 << 14, "bfloat16") as ar_ref, \
            cuflux.AllReduceRMSNorm(world, 64, H, "bfloat16") as norm_ref, \
            cuflux.All2AllHeads(world, T, 2 * W, D, "bfloat16") as a2a_ref:
        x, res, r_ref = (torch.empty(T, H, dtype=bf16, device=dev) for _ in range(3))
        w = torch.empty(H, dtype=bf16, device=dev)
        a, b = torch.empty(M, K, dtype=bf16, device=dev), torch.empty(N, K, dtype=bf16, device=dev)
        c = torch.empty(M, N, dtype=bf16, device=dev)
        xs = torch.empty(1, T, 2 * W, D, dtype=bf16, device=dev)
        ys = torch.empty(1, T * W, 2, D, dtype=bf16, device=dev)
        for t in (x, res, w, a, b, xs):
            fresh(t)
        side.wait_stream(torch.cuda.current_stream(dev))

        def step():
            y = ar(x)
            z = norm(x, res, w)
            cuflux.gemm(a, b, out=c, b_layout="nk")
            a2a.scatter_heads(xs, tokens, out=ys)
            return y, z

        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: bound, cuBLAS's workspace on this stream
                step()
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            y, z = step()
        for i in range(replays):
            for t in (x, res, w, a, b, xs):
                fresh(t)
            r_ref.copy_(res)
            torch.cuda.synchronize(dev)
            graph.replay()
            torch.cuda.synchronize(dev)
            with cs:
                want_y = ar_ref(cupy.from_dlpack(x), stream=cs)
                want_z = norm_ref(cupy.from_dlpack(x), cupy.from_dlpack(r_ref),
                                  cupy.from_dlpack(w), stream=cs)
                want_c = cuflux.gemm(cupy.from_dlpack(a), cupy.from_dlpack(b), b_layout="nk",
                                     stream=cs)
                want_ys = a2a_ref.scatter_heads(cupy.from_dlpack(xs), tokens, stream=cs)
            cs.synchronize()
            for got, want, what in ((y, want_y, "allreduce"), (z, want_z, "norm"),
                                    (res, r_ref, "norm residual"), (c, want_c, "gemm"),
                                    (ys, want_ys, "a2a")):
                want = want if isinstance(want, torch.Tensor) else torch.from_dlpack(want)
                assert torch.equal(_bits(got), _bits(want)), f"{what} replay {i} rank {me}"
    return True


# Each case runs at every W on fresh random data and returns True on every rank when its checks
# passed (a failure names the seed).
CASES = {"column_and_row_parallel_linear_forward_backward": linear_layers,
         "parallel_rmsnorm_every_output_forward_backward": norm_layer,
         "ulysses_attention_forward_backward": ulysses,
         "torch_in_torch_out_on_torch_current_stream": torch_in_torch_out,
         "init_on_a_torch_distributed_group": torch_route,
         "torch_calls_replay_bit_for_bit": torch_calls_replay,
         "captured_by_torch_cuda_graph": torch_graph_capture}


@pytest.mark.gpu
@needs_torch
@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("what", list(CASES))
def test_torch_route(what, W):
    seed = fresh_seed()
    try:
        result = CASES[what].run(W, timeout_s=300, seed=seed)
    except AssertionError as e:
        raise AssertionError(f"seed={seed}: {e}") from None
    assert result == [True] * W, f"seed={seed}"


# ==== CPU tests (no GPU needed) ===================================================================
def _python(code: str, env=None, timeout=120):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=e, cwd=ROOT)


# ---- cuflux.torch needs torch ------------------------------------------------------------------
def test_cuflux_torch_without_torch_says_pip_install_torch():
    out = _python("""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        import cuflux  # cuflux itself never needs torch
        try:
            import cuflux.torch
        except ImportError as e:
            print("REFUSED:", e)
    """)
    assert "REFUSED: cuflux.torch needs PyTorch" in out.stdout, out.stdout + out.stderr
    assert "pip install torch" in out.stdout


@needs_torch
def test_cuflux_torch_imports_and_exports_the_layers():
    import cuflux.torch as ct

    for name in ("ColumnParallelLinear", "RowParallelLinear", "ParallelRMSNorm",
                 "UlyssesAttention"):
        assert issubclass(getattr(ct, name), torch.nn.Module)


# ---- the launcher ------------------------------------------------------------------------------
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
          "OMPI_COMM_WORLD_LOCAL_RANK": "0"}


def test_launcher_from_env_reads_torchrun_and_mpi_launchers():
    t, m = world_mod.launcher_from_env(TORCHRUN)
    assert t == world_mod.Launch("torchrun", 1, 2, 1, "RANK=1, WORLD_SIZE=2") and m is None
    t, m = world_mod.launcher_from_env(MPIRUN)
    assert t is None and (m.launcher, m.rank, m.size, m.local_rank) == ("mpirun", 0, 4, 0)
    t, m = world_mod.launcher_from_env({"PMI_RANK": "3", "PMI_SIZE": "8"})
    assert (m.rank, m.size, m.local_rank) == (3, 8, None)
    assert world_mod.launcher_from_env({}) == (None, None)
    assert world_mod.launcher_from_env({"RANK": "x", "WORLD_SIZE": "2"}) == (None, None)


@pytest.mark.parametrize("env,torch_size,route", [
    (TORCHRUN, None, "torch"),                 # torchrun: torch.distributed from its env
    (MPIRUN, None, "mpi"),                     # mpirun
    ({}, None, "mpi"),                         # no launcher: one process, MPI's singleton
    ({}, 1, "torch"),                          # the caller initialised torch.distributed
    (MPIRUN, 4, "torch"),                      # ... under mpirun, same size: theirs
    (dict(MPIRUN, RANK="0", WORLD_SIZE="4"), None, "mpi"),  # scripts that copy the MPI vars
])
def test_choose_route(env, torch_size, route):
    assert world_mod.choose_route(env, torch_size) == route


@pytest.mark.parametrize("env,torch_size,says", [
    (dict(MPIRUN, RANK="0", WORLD_SIZE="2"), None,
     r"torchrun says 2 \(RANK=0, WORLD_SIZE=2\); mpirun says 4"),
    (TORCHRUN, 1, r"torchrun says 2 .*torch.distributed says 1"),
    (MPIRUN, 2, r"mpirun says 4 .*torch.distributed says 2"),
])
def test_launchers_that_disagree_are_refused(env, torch_size, says):
    with pytest.raises(CufluxError, match="cuflux.init: the launchers disagree on the number "
                                          "of processes: .*" + says):
        world_mod.choose_route(env, torch_size)


@needs_torch
def test_init_refuses_torch_objects_that_are_not_process_groups():
    with pytest.raises(TypeError, match=r"comm is a torch object \(torch.Tensor\) but not a "
                                        r"torch.distributed ProcessGroup; comm must be .*"
                                        r"a torch.distributed ProcessGroup"):
        cuflux.init(torch.zeros(1))


# ---- torch in, torch out ------------------------------------------------------------------------
@needs_torch
def test_framework_of_is_a_type_test():
    assert framework_of(torch.zeros(2)) == "torch" and is_torch(torch.zeros(2))
    assert framework_of(np.zeros(2)) == "cupy" and not is_torch(np.zeros(2))
    assert not is_torch(None)


@needs_torch
def test_to_caller_gives_torch_tensors_sharing_memory():
    out = np.arange(6, dtype=np.float32).reshape(2, 3)
    like = torch.zeros(1)
    t = to_caller(out, like)
    assert isinstance(t, torch.Tensor) and t.shape == (2, 3)
    out[0, 0] = 42  # zero-copy: the tensor sees it
    assert t[0, 0].item() == 42
    assert to_caller(out, np.zeros(1)) is out  # CuPy (or anything else) in: as it is
    given = torch.empty(2, 3)
    assert to_caller(out, like, given) is given  # the caller's own out= comes back
    pair = to_caller((out, None), like, (None, None))
    assert isinstance(pair[0], torch.Tensor) and pair[1] is None
    scale = np.ones(2, np.float32)
    pair = to_caller((out, scale), like, (given, None))
    assert pair[0] is given and isinstance(pair[1], torch.Tensor)


# ---- the layers' argument checks -----------------------------------------------------------------
@needs_torch
def test_linear_argument_checks():
    from cuflux.torch import check_linear_args, shard_rows

    assert check_linear_args("L", 2, 64, 128, 256, torch.bfloat16, "out") == (64, 64)
    assert check_linear_args("L", 2, 128, 64, 256, torch.float16, "in") == (64, 64)
    with pytest.raises(ValueError, match="L: out_features=100 must be divisible by the world "
                                         "size 8"):
        check_linear_args("L", 8, 64, 100, 256, torch.bfloat16, "out")
    with pytest.raises(ValueError, match=r"in_features per rank = 12 must be a multiple of 8"):
        check_linear_args("L", 2, 24, 64, 256, torch.bfloat16, "in")
    with pytest.raises(TypeError, match="dtype must be torch.bfloat16 or torch.float16"):
        check_linear_args("L", 2, 64, 64, 256, torch.float32, "out")
    with pytest.raises(ValueError, match="max_tokens=255 must be a multiple of the world size"):
        check_linear_args("L", 2, 64, 64, 255, torch.bfloat16, "out")
    with pytest.raises(ValueError, match="in_features must be an int >= 1, got 64.0"):
        check_linear_args("L", 2, 64.0, 64, 256, torch.bfloat16, "out")
    assert shard_rows(12, 3, 1) == slice(4, 8)


@needs_torch
def test_layers_check_arguments_before_building_ops():
    """A stand-in world (no GPU, no ranks): the checks raise before any op is built."""
    from types import SimpleNamespace

    from cuflux.torch import ColumnParallelLinear, RowParallelLinear

    world = SimpleNamespace(size=4, rank=0, device=None)
    with pytest.raises(ValueError, match="ColumnParallelLinear: out_features=66 must be "
                                         "divisible by the world size 4"):
        ColumnParallelLinear(world, 64, 66, 256)
    with pytest.raises(ValueError, match="RowParallelLinear: in_features per rank = 4"):
        RowParallelLinear(world, 16, 64, 256)


# ---- the parallel Linear layers' autograd, with the ops stood in by torch math (W = 1) ---------
@needs_torch
@pytest.mark.parametrize("which", ["column", "row"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_autograd_matches_nn_linear(which, with_bias, monkeypatch):
    """_ColumnFn / _RowFn forward and backward against F.linear's autograd in float64, the
    cuflux ops replaced by what they compute at W = 1 (gather: identity; reduce-scatter: the
    plain product), so every gradient path of both Functions runs without a GPU."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    import cuflux.torch as ct


    def gemm(a, b, bias=None, stream=None, layout="nk"):
        y = a @ (b.t() if layout == "nk" else b)
        return y if bias is None else y + bias

    layer = SimpleNamespace(
        ag_gemm=lambda x, w, bias=None, return_gathered=False, stream=None:
            (gemm(x, w, bias), x),
        gemm_rs=lambda a, b, bias=None, stream=None:
            gemm(a, b, bias, layout="nk" if which == "row" else "kn"),
        all_gather=lambda x, stream=None: x)
    g = torch.Generator().manual_seed(5)
    x, w, go = (torch.randn(*shape, generator=g, dtype=torch.float64)
                for shape in ((6, 8), (4, 8), (6, 4)))
    b = torch.randn(4, generator=g, dtype=torch.float64) if with_bias else None
    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if with_bias else ())]
    fn = ct._ColumnFn if which == "column" else ct._RowFn
    got = fn.apply(leaves[0], leaves[1], leaves[2] if with_bias else None, layer)
    got_grads = torch.autograd.grad(got, leaves, go)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if with_bias else ())]
    want = F.linear(*ref_leaves)
    want_grads = torch.autograd.grad(want, ref_leaves, go)
    assert torch.allclose(got, want)
    for name, gg, ww in zip(("x", "weight", "bias"), got_grads, want_grads):
        assert torch.allclose(gg, ww), name


# ---- ParallelRMSNorm's backward: the local math and the gather of uneven slices ---------------
@needs_torch
def test_rmsnorm_backward_closed_form_matches_autograd():
    from cuflux.torch import _rmsnorm_backward

    g = torch.Generator().manual_seed(3)
    h, go = (torch.randn(7, 40, generator=g, dtype=torch.float64) for _ in range(2))
    w = 1 + 0.3 * torch.randn(40, generator=g, dtype=torch.float64)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
    want_h, want_w = torch.autograd.grad(out, (hr, wr), go)
    gh, gw = _rmsnorm_backward(h, w, 1e-6, go)  # fp32 inside
    assert torch.allclose(gh.double(), want_h, rtol=1e-4, atol=1e-5)
    assert torch.allclose(gw.double(), want_w, rtol=1e-4, atol=1e-4)


@needs_torch
@pytest.mark.parametrize("T,W", [(12, 4), (13, 4), (3, 4), (7, 2), (5, 1)])
def test_norm_gathers_every_ranks_token_slice_in_token_order(T, W, monkeypatch):
    """_gather_slices pads this rank's slice to the largest for AllGather (equal rows per rank)
    and drops every rank's padding: token t lands at row t. A stand-in AllGather returns what
    the W ranks would pass, padding rows set to -1."""
    from types import SimpleNamespace

    import cuflux.torch as ct
    from cuflux.ops.allreduce import token_slice

    n_max = -(-T // W)
    tokens = torch.arange(T, dtype=torch.float32)[:, None].expand(T, 3)
    for me in range(W):
        def all_gather(part, stream=None):
            padded = [torch.full((n_max, 3), -1.0) for _ in range(W)]
            for r in range(W):
                a, b = token_slice(T, W, r)
                padded[r][:b - a] = tokens[a:b]
            a, b = token_slice(T, W, me)
            assert part.shape == (n_max, 3) and torch.equal(part[:b - a], tokens[a:b])
            return torch.cat(padded)

        layer = SimpleNamespace(world=SimpleNamespace(size=W, rank=me), all_gather=all_gather)
        a, b = token_slice(T, W, me)
        got = ct.ParallelRMSNorm._gather_slices(layer, tokens[a:b], T)
        assert torch.equal(got, tokens), (me, got[:, 0])


# ---- cuflux.init on a torch.distributed group: two CPU processes over gloo ----------------------
_RANK_BODY = """
    import os, sys, time
    import torch.distributed as dist
    import cuflux
    from cuflux.errors import CommTimeoutError
    rank = int(os.environ["RANK"])
    if os.environ["HOW"] == "group":
        dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=2)
        world = cuflux.init(dist.group.WORLD, timeout_s=20)
    else:  # torchrun's variables: init reads them
        world = cuflux.init(timeout_s=20)
    assert "mpi4py.MPI" not in sys.modules, "the torch route imported mpi4py"
    assert (world.rank, world.size, world.device) == (rank, 2, None), world
    assert world.allgather(rank * 10) == [0, 10]
    world.check_same(("same", 1), "arguments")
    try:
        world.check_same(rank, "rank")
        raise AssertionError("check_same passed different values")
    except ValueError as e:
        assert "rank 0: 0, rank 1: 1" in str(e)
    oc = world.sub_comm("AllReduce")
    assert oc.op_id == "AllReduce#0" and oc.allgather("x") == ["x", "x"]
    assert oc.exchange_digest(2**64 - 1 - rank, 10.0) == [2**64 - 1, 2**64 - 2]
    oc.close()
    # split_nodes on the torch route: two emulated nodes of one rank (gloo groups of cuflux's)
    w1 = (cuflux.init(dist.group.WORLD, timeout_s=20, node_size=1) if os.environ["HOW"] == "group"
          else cuflux.init(timeout_s=20, node_size=1))
    node, rail = w1.split_nodes()
    assert node.size == 1 and node.allgather(rank) == [rank], node
    assert rail.allgather(rank, what="rail ranks") == [0, 1]
    rail.free()
    node.close()
    w1.close()
    if rank == 1:
        time.sleep(4)  # never comes to the barrier
        print("RANK1-DONE")
    else:
        t = time.monotonic()
        try:
            world.barrier(timeout_s=1.5)
        except CommTimeoutError as e:
            print(f"TIMEOUT op={e.op!r} rank={e.rank} peer={e.peer} after "
                  f"{time.monotonic() - t:.1f}")
    world.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_torch
@pytest.mark.parametrize("how", ["group", "torchrun_env"])
def test_init_on_torch_distributed_gloo_two_processes(how):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HOW=how, INIT=f"tcp://127.0.0.1:{port}", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE="2")
    for k in [k for k in env if k.startswith(("OMPI_", "PMI_", "PMIX_"))]:
        del env[k]
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RANK_BODY)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\nKILLED")
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(outs)
    assert "TIMEOUT op='World World.barrier' rank=0 peer=1" in outs[0], outs[0]
    seconds = float(outs[0].split("after ")[1].split()[0])
    assert 1.0 <= seconds < 10, outs[0]
    assert "RANK1-DONE" in outs[1]
