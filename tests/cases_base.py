"""Rank bodies of tests/test_base.py: what every op inherits from CommOp, on the GPU."""
import time

from cuflux.arrays import dtype_info
from cuflux.errors import CommTimeoutError


def aliasing(world):
    """An output overlapping an input is refused before any launch, and the op still works."""
    import cupy as cp

    from cuflux.ops.all2all import All2AllHeads
    from cuflux.ops.allreduce import AllReduceRMSNorm
    from cuflux.ops.gemm_rs import GemmReduceScatter
    W = world.size
    st = dtype_info("bfloat16").storage
    refused = 0
    with GemmReduceScatter(world, 64 * W, 64, 64, "bfloat16", timeout_s=30) as rs:
        a = cp.ones((64 * W, 64), st)
        b = cp.ones((64, 64), st)
        try:
            rs(a, b, out=a[:64])
        except ValueError as e:
            assert "overlaps a" in str(e), e
            refused += 1
        out = rs(a, b)
        rs.synchronize()
        assert float(out.astype(cp.float32).max()) == 64.0 * W
    with AllReduceRMSNorm(world, 16, 256, "bfloat16", timeout_s=30) as norm:
        x, res, w = cp.ones((4, 256), st), cp.ones((4, 256), st), cp.ones(256, st)
        try:
            norm(x, res, w, out=res)
        except ValueError as e:
            assert "overlaps residual" in str(e), e
            refused += 1
    with All2AllHeads(world, 8, 2 * W, 64, "bfloat16", timeout_s=30) as a2a:
        y = cp.ones((1, 8 * W, 2, 64), st)
        try:
            a2a.gather_heads(y, [8] * W, out=y.reshape(-1)[:8 * 2 * W * 64].reshape(
                1, 8, 2 * W, 64))
        except ValueError as e:
            assert "overlaps input" in str(e), e
            refused += 1
    return refused


def mismatched_m(world):
    """Ranks passing different M to GemmReduceScatter: ValueError on every rank (the first time
    a call's M is seen it is compared across ranks), nothing launched, the op still usable."""
    import cupy as cp

    from cuflux.ops.gemm_rs import GemmReduceScatter
    W, me = world.size, world.rank
    st = dtype_info("bfloat16").storage
    with GemmReduceScatter(world, 64 * W, 64, 64, "bfloat16", timeout_s=30) as rs:
        b = cp.ones((64, 64), st)
        M = 32 * W if me == 0 else 64 * W
        try:
            rs(cp.ones((M, 64), st), b)
            raised = False
        except ValueError as e:
            assert "differs between ranks" in str(e), e
            raised = True
        out = rs(cp.ones((64 * W, 64), st), b)
        rs.synchronize()
        assert float(out.astype(cp.float32).min()) == 64.0 * W
    return raised


def abort_after_timeout(world, timeout_s=2.0):
    """The last rank never calls: the others raise CommTimeoutError within timeout + 2 s, and
    leaving the `with` block aborts at once instead of waiting at close()'s barrier."""
    import cupy as cp

    from cuflux.ops.allreduce import AllReduce
    W, me = world.size, world.rank
    st = dtype_info("bfloat16").storage
    late = me == W - 1
    op = AllReduce(world, 1 << 16, "bfloat16", timeout_s=timeout_s)
    x = cp.ones(1 << 16, st)
    if late:  # never calls; gives up its side locally once the others have
        time.sleep(timeout_s + 1.0)
        t1 = time.monotonic()
        op.abort()
        assert time.monotonic() - t1 < 1.0
        return None
    t0 = time.monotonic()
    waited = None
    try:
        with op:
            op(x)
            op.synchronize()
    except CommTimeoutError:
        waited = time.monotonic() - t0
    assert op.closed  # the with block aborted it
    t1 = time.monotonic()
    op.abort()  # idempotent
    assert time.monotonic() - t1 < 1.0
    assert waited is not None and waited < timeout_s + 2.0, waited
    return round(waited, 2)
