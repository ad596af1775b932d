"""Rank bodies of the PyTorch GPU tests (run under tests/mpi.py; ranks share the GPU).

Every rank draws the full layer (weights, inputs, output gradients) from one seed, runs its
shard through cuflux.torch, and checks its share of the outputs and gradients against the
unsharded torch layer computed in float64 from the same (bf16-rounded) values, to bf16 / cuBLAS
tolerance. Returns True, or "torch missing" where torch cannot be imported.
"""
import os
import tempfile


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


def _draw(torch, seed, *shape, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1) * scale


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


def torch_in_torch_out(world, seed=30):
    """AllReduce / AllReduceRMSNorm / All2AllHeads / AllGather: torch tensors in, torch tensors
    out, on torch's current stream (a side stream here) by default."""
    torch = _torch()
    if torch is None:
        return "torch missing"
    import cuflux

    W, me = world.size, world.rank
    dev = torch.device("cuda", world.device)
    side = torch.cuda.Stream(device=dev)
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
