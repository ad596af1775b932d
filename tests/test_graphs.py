"""CUDA-graph capture for every op, on the GPU: each op captured once and replayed 100 times
with new inputs, every replay checked against the float64 / NumPy reference; ops (or paths) that
cannot be captured must raise CaptureError before anything is enqueued, and stay usable
afterwards. Each GPU test runs the rank body beside it (@on_ranks) on W ranks sharing the GPU
under mpiexec (W from CUFLUX_TEST_WORLD_SIZES); without a GPU they skip ("no CUDA device")."""
import numpy as np
import pytest

from cuflux.arrays import dtype_info
from cuflux.errors import CaptureError
from tests.checks import poison
from tests.mpi import on_ranks, world_sizes

WS = world_sizes()


def _rand(key, shape, storage):
    rng = np.random.default_rng(list(key))
    return rng.standard_normal(shape).astype(np.float32).astype(storage)


@on_ranks
def rmsnorm_modes(world, replays=100, T=37, H=1024):
    """AllReduceRMSNorm, all three output modes, captured in one graph: `replays` replays with
    new x, residual and weight each time, exact against the float64 reference."""
    import cupy as cp

    from cuflux.ops.allreduce import AllReduceRMSNorm, reference_allreduce_rmsnorm, token_slice
    W, me = world.size, world.rank
    st = dtype_info("bfloat16").storage
    modes = ("replicated", "sharded_residual", "sequence_parallel")
    s = cp.cuda.Stream(non_blocking=True)
    ops = [AllReduceRMSNorm(world, 64, H, "bfloat16", output=m, timeout_s=60) for m in modes]
    try:
        with s:
            a, b = token_slice(T, W, me)
            rows = {m: (b - a if m == "sequence_parallel" else T) for m in modes}
            xs = {m: cp.zeros((T, H), st) for m in modes}
            res = {m: cp.zeros((rows[m], H), st) for m in modes}
            outs = {m: cp.zeros((rows[m], H), st) for m in modes}
            wt = cp.zeros(H, st)
            s.synchronize()
            world.barrier()
            s.begin_capture()
            for m, op in zip(modes, ops):
                op(xs[m], res[m], wt, out=outs[m], stream=s)
            graph = s.end_capture()
            for rep in range(replays):
                xh = [_rand((rep, p, 1), (T, H), st) for p in range(W)]
                rh = _rand((rep, 2), (T, H), st)
                wh = _rand((rep, 3), (H,), st)
                wt[...] = cp.asarray(wh)
                for m in modes:
                    xs[m][...] = cp.asarray(xh[me])
                    res[m][...] = cp.asarray(rh[a:b] if m == "sequence_parallel" else rh)
                poison(*outs.values())
                graph.launch(stream=s)
                for op in ops:
                    op.synchronize(stream=s)
                for m in modes:
                    want = reference_allreduce_rmsnorm(xh, rh, wh, 1e-6, m, W)[me]
                    for got, ref, what in ((outs[m], want[0], "out"), (res[m], want[1], "res")):
                        g = cp.asnumpy(got).astype(np.float64)
                        if m == "sharded_residual" and what == "res":
                            g, ref = g[a:b], ref[a:b]
                        err = np.abs(g - ref).max() / (np.abs(ref).max() + 1e-30)
                        assert np.isfinite(g).all() and err < 2e-2, \
                            f"replay {rep} {m} {what}: max rel err {err:.3g}"
                world.barrier()  # the next replay's host writes wait for every rank
    finally:
        for op in ops:
            op.close()
    return replays


test_rmsnorm_every_mode_captured_and_replayed = rmsnorm_modes.test(expect=100, timeout_s=600)


@on_ranks
def all2all(world, replays=100, T=64, H=8, D=128):
    """All2AllHeads, scatter then gather (uneven tokens at W > 1), captured in one graph and
    replayed with new inputs: exact every replay (the call epoch lives on the device). Halfway,
    eager calls of six token lists (five or six new), more than the op's cache holds (CACHE_MAX
    set to 4 here),
    each exact: the full cache is emptied but for the plan the graph holds (its device prefix
    array), and the replays after stay exact. view=True is refused under capture (the slot's
    parity alternates without the host knowing), and after the op was captured."""
    import cupy as cp

    import cuflux.ops.all2all as A
    from cuflux.ops.all2all import All2AllHeads, reference_gather_heads, reference_scatter_heads
    W, me = world.size, world.rank
    cache_max, A.CACHE_MAX = A.CACHE_MAX, 4
    try:
        return _all2all_captured(world, replays, T, H, D, W, me, cp, A, All2AllHeads,
                                 reference_gather_heads, reference_scatter_heads)
    finally:
        A.CACHE_MAX = cache_max


def _all2all_captured(world, replays, T, H, D, W, me, cp, A, All2AllHeads,
                      reference_gather_heads, reference_scatter_heads):
    st = dtype_info("bfloat16").storage
    s = cp.cuda.Stream(non_blocking=True)
    tokens = tuple(T - (r % 3) for r in range(W))
    S = sum(tokens)
    with All2AllHeads(world, T, H, D, "bfloat16", timeout_s=60) as op, s:
        x = cp.zeros((1, tokens[me], H, D), st)
        y = cp.zeros((1, S, H // W, D), st)
        yin = cp.zeros((1, S, H // W, D), st)
        xo = cp.zeros((1, tokens[me], H, D), st)
        op.scatter_heads(x, tokens, out=y, stream=s)  # the arguments are agreed outside
        op.gather_heads(yin, tokens, out=xo, stream=s)
        s.synchronize()
        world.barrier()
        s.begin_capture()
        op.scatter_heads(x, tokens, out=y, stream=s)
        op.gather_heads(yin, tokens, out=xo, stream=s)
        graph = s.end_capture()
        for rep in range(replays):
            if rep == replays // 2:  # eager calls of new token lists: the cache fills, empties
                for i in range(6):
                    t_i = tuple((T - 1 - i - r) % T + 1 for r in range(W))
                    xi = [_rand((rep, i, p, 3), (1, t_i[p], H, D), st) for p in range(W)]
                    got = op.scatter_heads(cp.asarray(xi[me]), t_i, stream=s)
                    s.synchronize()
                    want = reference_scatter_heads(xi, t_i, W)[me]
                    assert np.array_equal(cp.asnumpy(got).view(np.uint16),
                                          want.view(np.uint16)), (rep, i)
                assert len(op._plans) <= A.CACHE_MAX + 1, len(op._plans)
                if W > 1:  # (W = 1 copies without the device prefix array)
                    assert op._plans[tokens].captured
                world.barrier()
            xh = [_rand((rep, p, 1), (1, tokens[p], H, D), st) for p in range(W)]
            yh = [_rand((rep, p, 2), (1, S, H // W, D), st) for p in range(W)]
            x[...], yin[...] = cp.asarray(xh[me]), cp.asarray(yh[me])
            poison(y, xo)
            world.barrier()  # every rank's inputs are in place before any replay starts
            graph.launch(stream=s)
            op.synchronize(stream=s)
            want_y = reference_scatter_heads(xh, tokens, W)[me]
            want_x = reference_gather_heads(yh, tokens, W)[me]
            assert np.array_equal(cp.asnumpy(y).view(np.uint16), want_y.view(np.uint16)), rep
            assert np.array_equal(cp.asnumpy(xo).view(np.uint16), want_x.view(np.uint16)), rep
            world.barrier()  # the next replay's host writes wait for every rank
        if W > 1:
            try:
                op.scatter_heads(x, tokens, view=True, stream=s)
                raise AssertionError("view=True after a capture must be refused")
            except CaptureError:
                pass
    return replays


test_all2all_capture = all2all.test(expect=100, timeout_s=300)


@on_ranks
def gemm_rs(world, replays=100, M=512, n=264, k=136):
    """GemmReduceScatter captured and replayed: W = 1 the plain GEMM; W > 1 the fused kernel
    and the comm-only reduce_scatter in one graph (both read and advance the op's device
    epoch: every replay must find fresh flags and the right buffer parity), new inputs every
    replay, against the float64 reference."""
    import cupy as cp

    from cuflux.ops.gemm_rs import GemmReduceScatter, reference_gemm_rs
    W, me = world.size, world.rank
    st = dtype_info("bfloat16").storage
    s = cp.cuda.Stream(non_blocking=True)
    with GemmReduceScatter(world, M, n, k, "bfloat16", out_dtype="float32", b_layout="nk",
                           timeout_s=60, route="fused") as op, s:
        a = cp.zeros((M, k), st)
        b = cp.zeros((n, k), st)
        out = cp.zeros((M // W, n), np.float32)
        if W == 1:
            op(a, b, out=out, stream=s)  # tunes the shape class outside the capture
            s.synchronize()
            s.begin_capture()
            op(a, b, out=out, stream=s)
            graph = s.end_capture()
            for rep in range(replays):
                ah, bh = _rand((rep, 1), (M, k), st), _rand((rep, 2), (n, k), st)
                a[...], b[...] = cp.asarray(ah), cp.asarray(bh)
                out.fill(np.nan)
                graph.launch(stream=s)
                s.synchronize()
                want = ah.astype(np.float64) @ bh.astype(np.float64).T
                err = np.abs(cp.asnumpy(out) - want).max() / np.abs(want).max()
                assert err < 1e-2, f"replay {rep}: {err:.3g}"
            return replays
        partial = cp.zeros((M, n), np.float32)
        out2 = cp.zeros((M // W, n), np.float32)
        # Outside the capture first: M compared across ranks, kernels loaded and prepared.
        op(a, b, out=out, stream=s)
        op.reduce_scatter(partial, out=out2, stream=s)
        op.synchronize(stream=s)
        world.barrier()
        s.begin_capture()
        op(a, b, out=out, stream=s)
        op.reduce_scatter(partial, out=out2, stream=s)
        graph = s.end_capture()
        for rep in range(replays):
            ah = [_rand((rep, p, 1), (M, k), st) for p in range(W)]
            bh = [_rand((rep, p, 2), (n, k), st) for p in range(W)]
            ph = [np.random.default_rng([rep, p, 3]).standard_normal((M, n)).astype(np.float32)
                  for p in range(W)]
            a[...], b[...], partial[...] = cp.asarray(ah[me]), cp.asarray(bh[me]), cp.asarray(ph[me])
            out.fill(np.nan)
            out2.fill(np.nan)
            s.synchronize()
            world.barrier()  # every rank's inputs are in place before any replay starts
            graph.launch(stream=s)
            op.synchronize(stream=s)
            want = reference_gemm_rs(ah, bh, b_layout="nk", rank=me)
            err = np.abs(cp.asnumpy(out) - np.asarray(want)).max() / np.abs(want).max()
            assert err < 1e-2, f"replay {rep}: fused {err:.3g}"
            want2 = sum(p.astype(np.float64)[me * (M // W):(me + 1) * (M // W)] for p in ph)
            err2 = np.abs(cp.asnumpy(out2) - want2).max() / np.abs(want2).max()
            assert err2 < 1e-5, f"replay {rep}: reduce_scatter {err2:.3g}"
            world.barrier()  # the next replay's host writes wait for every rank
        assert int(op.state[0]) == 2 * (replays + 1)  # two calls a replay, two before
    # The unfused route (route="auto", M < 256: cuflux.gemm into a partial, then the comm-only
    # kernel) captured too: its partial must be the op's own buffer, not a pool temporary that
    # the graph would keep writing after the pool gave it away (`junk` would take it).
    m = 24 * W
    with GemmReduceScatter(world, m, n, k, "bfloat16", out_dtype="float32", b_layout="nk",
                           timeout_s=60) as op, s:
        assert op.plan(m) == "unfused"
        a = cp.zeros((m, k), st)
        out = cp.zeros((m // W, n), np.float32)
        op(a, b, out=out, stream=s)
        op.synchronize(stream=s)
        world.barrier()
        s.begin_capture()
        op(a, b, out=out, stream=s)
        graph = s.end_capture()
        for rep in range(20):
            junk = cp.full((m, n), 7.0, np.float32)  # the pool's next block of that size
            ah = [_rand((rep, p, 4), (m, k), st) for p in range(W)]
            bh = [_rand((rep, p, 5), (n, k), st) for p in range(W)]
            a[...], b[...] = cp.asarray(ah[me]), cp.asarray(bh[me])
            out.fill(np.nan)
            s.synchronize()
            world.barrier()
            graph.launch(stream=s)
            op.synchronize(stream=s)
            want = reference_gemm_rs(ah, bh, b_layout="nk", rank=me)
            err = np.abs(cp.asnumpy(out) - np.asarray(want)).max() / np.abs(want).max()
            assert err < 1e-2, f"unfused replay {rep}: {err:.3g}"
            assert bool((junk == 7.0).all()), f"unfused replay {rep} wrote into freed memory"
            world.barrier()
    return replays


test_gemm_rs_capture = gemm_rs.test(expect=100, timeout_s=300)


@on_ranks
def sm_gather(world, replays=100, rows=37, cols=200, n=136, k=128):
    """AllGather and AllGatherGemm built with path="sm" (the gather is one kernel, its epoch on
    the device) captured in one graph and replayed with new inputs: the gather exact every
    replay, the GEMM against the float64 reference; AllGatherGemm's gathered A is the op's own
    buffer (a pool temporary would be taken by `junk` after the capture). Rank 0's shard is a
    view 2 bytes off 16-byte alignment (its copies go bytewise, the others' in 16-byte
    vectors: a block must still own the same bytes on every rank)."""
    import cupy as cp

    from cuflux.ops.ag_gemm import AllGatherGemm, reference_ag_gemm
    from cuflux.ops.allgather import AllGather
    W, me = world.size, world.rank
    st = dtype_info("bfloat16").storage
    s = cp.cuda.Stream(non_blocking=True)
    with AllGather(world, rows, cols, "bfloat16", timeout_s=60, path="sm") as ag, \
            AllGatherGemm(world, W * rows, n, k, "bfloat16", out_dtype="float32", b_layout="nk",
                          timeout_s=60, path="sm") as agm, s:
        base = cp.zeros(rows * cols + 1, st)
        x = base[1:].reshape(rows, cols) if me == 0 else cp.zeros((rows, cols), st)
        y = cp.zeros((W * rows, cols), st)
        a = cp.zeros((rows, k), st)
        b = cp.zeros((n, k), st)
        out = cp.zeros((W * rows, n), np.float32)
        ag(x, out=y, stream=s)  # outside the capture: rows agreed, the GEMM's choice made
        agm(a, b, out=out, stream=s)
        ag.synchronize(stream=s)
        agm.synchronize(stream=s)
        if W > 1:
            assert agm.plan(W * rows) == "unfused"
        world.barrier()
        s.begin_capture()
        ag(x, out=y, stream=s)
        agm(a, b, out=out, stream=s)
        graph = s.end_capture()
        for rep in range(replays):
            junk = cp.full((W * rows, k), 7, np.uint16)  # the pool's next block of that size
            xh = [_rand((rep, p, 1), (rows, cols), st) for p in range(W)]
            ah = [_rand((rep, p, 2), (rows, k), st) for p in range(W)]
            bh = [_rand((rep, p, 3), (n, k), st) for p in range(W)]
            x[...], a[...], b[...] = cp.asarray(xh[me]), cp.asarray(ah[me]), cp.asarray(bh[me])
            poison(y, out)
            s.synchronize()
            world.barrier()  # every rank's inputs are in place before any replay starts
            graph.launch(stream=s)
            ag.synchronize(stream=s)
            agm.synchronize(stream=s)
            assert np.array_equal(cp.asnumpy(y).view(np.uint16),
                                  np.concatenate(xh).view(np.uint16)), f"replay {rep}: gather"
            want = reference_ag_gemm(ah, bh, b_layout="nk")[me]
            err = np.abs(cp.asnumpy(out) - want).max() / np.abs(want).max()
            assert err < 1e-2, f"replay {rep}: gemm {err:.3g}"
            assert bool((junk == 7).all()), f"replay {rep} wrote into freed memory"
            world.barrier()  # the next replay's host writes wait for every rank
        if W > 1:
            assert int(ag.state[0]) == replays + 1 and int(agm.state[0]) == replays + 1
    return replays


test_sm_gather_capture = sm_gather.test(expect=100, timeout_s=300)


@on_ranks
def host_driven(world):
    """AllGather (W > 1) and AllGatherGemm refuse capture with CaptureError, naming why."""
    import cupy as cp

    from cuflux.ops.ag_gemm import AllGatherGemm
    from cuflux.ops.allgather import AllGather
    W = world.size
    st = dtype_info("bfloat16").storage
    s = cp.cuda.Stream(non_blocking=True)
    seen = []
    with AllGather(world, 64, 128, "bfloat16", timeout_s=60) as ag, \
            AllGatherGemm(world, 64 * W, 136, 128, "bfloat16", timeout_s=60) as agm, s:
        x = cp.zeros((64, 128), st)
        w = cp.zeros((128, 136), st)
        s.synchronize()
        for name, call in (("AllGather", lambda: ag(x, stream=s)),
                           ("AllGatherGemm", lambda: agm(x, w, stream=s))):
            if name == "AllGather" and W == 1:
                continue
            s.begin_capture()
            try:
                call()
                seen.append((name, False))
            except CaptureError as e:
                assert name in str(e) and "graph" in str(e)
                seen.append((name, True))
            finally:
                s.end_capture()
        assert all(r for _, r in seen), seen
        y = ag(x, stream=s)  # still usable
        ag.synchronize(stream=s)
        assert y.shape == (W * 64, 128)
    return len(seen)


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_host_driven_ops_refuse_capture(W):
    assert host_driven.run(W, timeout_s=300) == [(2 if W > 1 else 1)] * W
