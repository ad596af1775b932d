"""Rank bodies of the AllGather + GEMM GPU tests (tests/test_ag_gemm.py), run under tests/mpi.py
with the ranks sharing the GPU.

Every rank's shard is seeded by (seed, case, call, rank) and its weight by (seed, case, rank),
so a check proves who sent what. Each call: outputs poisoned with NaN (every element must be
written), the gathered A compared bit for bit, the output against a float64 NumPy reference
and, bit for bit, against the plain GEMM (cuflux.gemm, same core and configuration) on the same
gathered A: the fused kernel must compute exactly the same tiles.
"""
import contextlib
import time

import numpy as np

from cuflux.arrays import dtype_info
from cuflux.errors import CommTimeoutError, CufluxError
from tests.checks import check_close

# Bound of every wait in these tests (it starts when the stream or CTA reaches the wait). A
# legitimate wait is a peer's copy plus time-slicing (milliseconds); a protocol bug should fail
# in seconds, not eat the GPU lease.
WAIT_S = 20.0


@contextlib.contextmanager
def _op(world, *args, **kwargs):
    """An AllGatherGemm closed (collectively) when the block succeeds. When the block raises it
    is left open on purpose: a failed check is usually on one rank, whose peers are already in
    their next call or collective; a collective close would hold every rank until the waits
    time out. The rank exits instead (tests/rank_main.py) and mpiexec ends the others."""
    from cuflux.ops.ag_gemm import AllGatherGemm

    kwargs.setdefault("timeout_s", WAIT_S)
    # The fused kernel whatever M (route="auto" runs small calls unfused: `routes` tests that).
    kwargs.setdefault("route", "fused")
    op = AllGatherGemm(world, *args, **kwargs)
    yield op
    op.close()
_BITS = {2: np.uint16, 4: np.uint32}


def _host(key, shape, dtype, scale=1.0):
    rng = np.random.default_rng(key)
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(
        dtype_info(dtype).storage)


def _poisoned(shape, dtype):
    import cupy

    return cupy.full(shape, np.nan, dtype=np.float32).astype(dtype_info(dtype).storage)


def _same_bits(x, y) -> bool:
    import cupy

    bits = _BITS[x.dtype.itemsize]
    return bool(cupy.all(x.view(bits) == y.view(bits)))


def _checked_call(op, shards, b, bias, ref, return_gathered, what):
    """One call of `op` (this rank's shard of `shards`) into a poisoned out: the gathered A bit
    for bit when asked back, out against the float64 reference `ref`; returns (out, relative
    error)."""
    import cupy

    W, rows = op.world.size, shards[0].shape[0]
    a = cupy.asarray(shards[op.world.rank])
    out = _poisoned((W * rows, op.n), op.out_dtype.name)
    res = op(a, b, bias=bias, return_gathered=return_gathered, out=out)
    got, gathered = res if return_gathered else (res, None)
    assert got is out, f"{what}: the output is not the array passed as out="
    op.synchronize()
    if return_gathered:
        full = np.concatenate(shards)
        assert gathered.shape == (W * rows, op.k) and gathered.dtype == op.dtype.storage
        assert np.array_equal(cupy.asnumpy(gathered).view(np.uint8), full.view(np.uint8)), \
            f"{what}: gathered A differs from the ranks' shards"
    return got, check_close(got, ref, op.out_dtype.name, what)


def _one_call(world, op, seed, case, call, rows, b_host, b, bias_host, bias, return_gathered,
              what):
    """One call of `op` on fresh shards; every check; returns the relative error."""
    import cupy

    import cuflux.ops.gemm as G

    W = world.size
    shards = [_host([seed, case, call, p], (rows, op.k), op.dtype.name) for p in range(W)]
    full = np.concatenate(shards)
    b64 = b_host.astype(np.float64)
    ref = full.astype(np.float64) @ (b64 if op.b_layout == "kn" else b64.T)
    if bias_host is not None:
        ref += bias_host.astype(np.float64)[None, :]
    got, rel = _checked_call(op, shards, b, bias, ref, return_gathered, what)
    if op.plan(W * rows) == "unfused":  # cuflux.gemm ran (cuBLAS): the reference suffices
        return rel
    plan = op.plan_for(rows)
    plain = G.gemm(cupy.asarray(full), b, bias=bias, out_dtype=op.out_dtype.name,
                   b_layout=op.b_layout, impl=plan.impl,
                   config=plan.config if plan.impl == "sm90" else None)
    cupy.cuda.Device().synchronize()
    assert _same_bits(got, plain), (f"{what}: differs from cuflux.gemm ({plan.impl} "
                                    f"{plan.config}) on the same gathered A")
    return rel


# (chunk_rows, b_layout, dtype, out_dtype, bias, n, k, rows of each call): odd shapes, tiles
# that straddle two ranks' shards and several chunks, a chunk of one row, N = 8, K % 64 != 0.
CASES = [
    (None, "kn", "bfloat16", "bfloat16", True, 520, 264, [77, 200, 1, 130]),
    (64, "nk", "float16", "float32", False, 264, 136, [160, 63, 129]),
    (37, "kn", "bfloat16", "float32", True, 136, 520, [150, 37, 74, 5]),
    (64, "nk", "bfloat16", "float16", True, 8, 72, [300, 257]),
]


def sweep(world, mode, impl, seed):
    """Every case of CASES, calls with changing rows, return_gathered on every other call."""
    import cupy

    from cuflux import kernels

    kernels.load("gemm.cu")  # the plain GEMM of the bit-for-bit check, loaded before any wait
    W, me = world.size, world.rank
    errs = []
    for case, (chunk_rows, layout, dt, odt, with_bias, n, k, rows_seq) in enumerate(CASES):
        b_host = _host([seed, case, 1000 + me], (k, n) if layout == "kn" else (n, k), dt)
        bias_host = _host([seed, case, 2000 + me], (n,), dt, 4.0) if with_bias else None
        b = cupy.asarray(b_host)
        bias = cupy.asarray(bias_host) if with_bias else None
        with _op(world, W * max(rows_seq), n, k, dt, out_dtype=odt, b_layout=layout,
                 mode=mode, chunk_rows=chunk_rows, impl=impl) as op:
            for call, rows in enumerate(rows_seq):
                what = (f"rank {me}/{W} {mode} {impl} case {case} (chunk_rows={chunk_rows}, "
                        f"{layout}, {dt}->{odt}, bias={with_bias}, n={n}, k={k}) call {call} "
                        f"rows {rows} seed {seed}")
                errs.append(_one_call(world, op, seed, case, call, rows, b_host, b, bias_host,
                                      bias, call % 2 == 0, what))
    return max(errs)


def routes(world, mode, seed):
    """route="unfused", "fused" and "auto" at small M (auto: unfused exactly where
    cuflux.ops.gemm.plan says cuBLAS; W = 1: the fused kernel on every route). plan(M) says
    the route before each new M; every call matches reference_ag_gemm (each rank its own
    weight and bias), outputs poisoned, the gathered A bit for bit every other call. Returns
    the routes taken, by the op's route."""
    import cupy

    import cuflux.ops.gemm as G
    from cuflux import kernels
    from cuflux.ops.ag_gemm import reference_ag_gemm

    kernels.load("gemm.cu")  # the unfused route's GEMM, loaded before any wait
    W, me = world.size, world.rank
    n, k, rows_seq = 136, 72, [8, 1, 33, 8]
    taken = {}
    for case, route in enumerate(("unfused", "fused", "auto")):
        bs = [_host([seed, case, 1000 + p], (n, k), "bfloat16") for p in range(W)]
        biases = [_host([seed, case, 2000 + p], (n,), "bfloat16", 4.0) for p in range(W)]
        b, bias = cupy.asarray(bs[me]), cupy.asarray(biases[me])
        wants = {}
        with _op(world, W * max(rows_seq), n, k, "bfloat16", out_dtype="float32", b_layout="nk",
                 mode=mode, chunk_rows=16, route=route) as op:
            for call, rows in enumerate(rows_seq):
                M = W * rows
                if M not in wants:  # asked once, before the op decides (and a GEMM tunes)
                    if W == 1 or route != "auto":
                        wants[M] = "fused" if W == 1 else route
                    else:
                        wants[M] = ("unfused" if G.plan(M, n, k, "bfloat16", "nk") == G.CUBLAS
                                    else "fused")
                what = (f"rank {me}/{W} {mode} route={route} call {call} rows {rows} "
                        f"seed {seed}")
                assert op.plan(M) == wants[M], f"{what}: plan {op.plan(M)}, want {wants[M]}"
                shards = [_host([seed, case, call, p], (rows, k), "bfloat16") for p in range(W)]
                ref = reference_ag_gemm(shards, bs, biases, "nk")[me]
                _checked_call(op, shards, b, bias, ref, call % 2 == 0, what)
                taken.setdefault(route, []).append(wants[M])
    return taken


def every_config(world, seed):
    """Each Hopper configuration (and the portable core) once, both layouts."""
    import cupy

    from cuflux import kernels
    from cuflux.ops.ag_gemm import AG_SM90_CONFIGS

    kernels.load("gemm.cu")
    W, me = world.size, world.rank
    hopper = kernels.device_arch() == "sm_90a"
    runs = [("sm90", c) for c in AG_SM90_CONFIGS] if hopper else []
    runs.append(("sm80", None))
    n, k, rows = 264, 200, 150
    for i, (impl, config) in enumerate(runs):
        layout = "kn" if i % 2 == 0 else "nk"
        for odt in ("bfloat16", "float32"):
            b_host = _host([seed, i, 1000 + me], (k, n) if layout == "kn" else (n, k), "bfloat16")
            bias_host = _host([seed, i, 2000 + me], (n,), "bfloat16", 4.0)
            with _op(world, W * rows, n, k, "bfloat16", out_dtype=odt, b_layout=layout,
                     chunk_rows=64, impl=impl, config=config) as op:
                if config is not None:
                    assert op.plan_for(rows).config == config
                _one_call(world, op, seed, i, 0, rows, b_host, cupy.asarray(b_host), bias_host,
                          cupy.asarray(bias_host), True, f"rank {me} {impl} {config} {layout} "
                                                          f"-> {odt} seed {seed}")
    return len(runs)


def _small_int(key, shape):
    """Integers in [-2, 2] as bf16: products and sums of 64 terms are exact in fp32."""
    rng = np.random.default_rng(key)
    return rng.integers(-2, 3, shape).astype(np.float32).astype(dtype_info("bfloat16").storage)


def back_to_back(world, mode, calls=1000):
    """Many calls with changing rows (every value 1..40) and no host sync between them; every
    output is checked exactly (small integers) and every third gathered A bit for bit."""
    import cupy

    W, me = world.size, world.rank
    n, k, max_rows = 64, 64, 40
    rows_seq = [1 + (i * 7) % max_rows for i in range(calls)]
    b_host = _small_int([7, me], (k, n))
    # Every input is on the device before the first call: no CuPy kernel or allocation of a
    # new size has to load while a stream waits on a peer.
    inputs = [cupy.asarray(_small_int([me, i], (r, k))) for i, r in enumerate(rows_seq)]
    b = cupy.asarray(b_host)
    cupy.cuda.Device().synchronize()
    results = []
    # Every wait's budget starts when its stream (or CTA) reaches it, not when the host queued
    # it (cuflux/watchdog.py), so a long queue needs no long timeout; a short one makes a real
    # hang fail in seconds instead of eating the test's deadline.
    with _op(world, W * max_rows, n, k, "bfloat16", out_dtype="float32", mode=mode,
             chunk_rows=16, timeout_s=30) as op:
        for i, x in enumerate(inputs):
            results.append(op(x, b, return_gathered=i % 3 == 0))
        op.synchronize()
        for i, (rows, res) in enumerate(zip(rows_seq, results)):
            full = np.concatenate([_small_int([p, i], (rows, k)) for p in range(W)])
            out, gathered = res if i % 3 == 0 else (res, None)
            want = full.astype(np.float64) @ b_host.astype(np.float64)
            got = cupy.asnumpy(out)
            assert np.array_equal(got, want), (f"rank {me} {mode} call {i} rows {rows}: "
                                               f"{int((got != want).sum())} elements differ")
            if gathered is not None:
                assert np.array_equal(cupy.asnumpy(gathered).view(np.uint16),
                                      full.view(np.uint16)), f"rank {me} call {i}: gathered A"
    return calls


def late_peer(world, mode, impl, delay_s=1.0):
    """The last rank calls delay_s seconds after the others, whose GEMMs are then already
    running over a gathered A that still holds the previous call's rows: they must wait for the
    late rank's chunks (exact small-integer data, so a row read before its flag shows), and
    their calls must have lasted about delay_s (the late scenario really happened)."""
    import cupy

    W, me = world.size, world.rank
    late = W - 1
    n, k, rows = 64, 64, 128
    b_host = _small_int([9, me], (k, n))
    b = cupy.asarray(b_host)
    waited = None
    with _op(world, W * rows, n, k, "bfloat16", out_dtype="float32", mode=mode,
             chunk_rows=32, impl=impl) as op:
        for call in range(2):  # call 0 leaves its rows behind; call 1 has a late rank
            x = cupy.asarray(_small_int([me, 100 + call], (rows, k)))
            out = _poisoned((W * rows, n), "float32")
            cupy.cuda.Device().synchronize()
            world.barrier()
            if call == 1 and me == late:
                time.sleep(delay_s)
            t0 = time.perf_counter()
            op(x, b, out=out)
            op.synchronize()
            if call == 1 and me != late:
                waited = time.perf_counter() - t0
            full = np.concatenate([_small_int([p, 100 + call], (rows, k)) for p in range(W)])
            want = full.astype(np.float64) @ b_host.astype(np.float64)
            got = cupy.asnumpy(out)
            assert np.array_equal(got, want), (
                f"rank {me} {mode} {impl} call {call}: {int((got != want).sum())} elements "
                f"differ (rows of rank {late} read before they landed?)")
    if me != late:
        assert waited > 0.5 * delay_s, f"rank {me}: the call took {waited:.3f} s, the late " \
                                       f"rank came after {delay_s} s"
    return waited


def timeout(world, mode, route="fused", timeout_s=2.0):
    """After one call on every rank, the last rank never calls again: the others raise
    CommTimeoutError naming it within the timeout plus slack, the failed op refuses to run,
    closes, and a new op runs correctly. The first call agrees the rows (a host exchange that
    would time out first otherwise), so the second one times out where its route waits: the
    fused kernel's chunk waits, or (unfused) the gather's stream waits, cuflux.gemm then
    running on what it has."""
    import cupy

    from cuflux.ops.ag_gemm import AllGatherGemm

    W, me = world.size, world.rank
    late = W - 1
    op = AllGatherGemm(world, W * 64, 64, 64, "bfloat16", mode=mode, timeout_s=timeout_s,
                       route=route)
    a = cupy.asarray(_small_int([me, 0], (64, 64)))
    b = cupy.asarray(_small_int([1, me], (64, 64)))
    cupy.cuda.Device().synchronize()
    world.barrier()  # the ranks start together: the first call's waits are milliseconds
    op(a, b)  # every rank: rows agreed, the GEMM's choice made (tuned) outside the timed call
    op.synchronize()
    world.barrier()
    waited = None
    if me != late:
        t0 = time.perf_counter()
        try:
            op(a, b)
            op.synchronize()
            raise AssertionError("no CommTimeoutError although a rank never sent")
        except CommTimeoutError as e:
            waited = time.perf_counter() - t0
            assert (e.op, e.rank, e.peer) == ("AllGatherGemm", me, late), str(e)
            assert waited < timeout_s + 3.0, waited
        try:
            op(a, b)
            raise AssertionError("a failed op ran again")
        except CommTimeoutError:
            pass
    world.barrier()
    op.close()
    op.close()  # idempotent
    try:
        op(None, None)
        raise AssertionError("a closed op ran")
    except CufluxError as e:
        assert "closed" in str(e)
    # The CUDA context is not poisoned: a new op works on every rank.
    rel = sweep_one(world, mode, seed=5)
    return {"waited": waited, "after": rel}


def sweep_one(world, mode, seed):
    """One small correct call on a new op (after a failure)."""
    import cupy

    from cuflux import kernels

    kernels.load("gemm.cu")
    me = world.rank
    b_host = _host([seed, 1000 + me], (72, 40), "bfloat16")
    with _op(world, world.size * 33, 40, 72, "bfloat16", mode=mode) as op:
        return _one_call(world, op, seed, 0, 0, 33, b_host, cupy.asarray(b_host), None, None,
                         True, f"rank {me} after a timeout")


def bad_input(world):
    """Every bad argument raises a named error before anything is queued; a good call on every
    rank afterwards proves no rank moved its epoch or touched a peer."""
    import cupy
    import pytest

    from cuflux import kernels
    from cuflux.ops.ag_gemm import AllGatherGemm

    kernels.load("gemm.cu")
    W, me = world.size, world.rank
    bf = dtype_info("bfloat16").storage
    with pytest.raises(ValueError, match=r"n must be an integer in \[8, \d+\], a multiple of 8"):
        AllGatherGemm(world, W * 64, 60, 64, "bfloat16")
    with pytest.raises(TypeError, match="dtype 'float32' is not supported"):
        AllGatherGemm(world, W * 64, 64, 64, "float32")
    op = AllGatherGemm(world, W * 64, 64, 64, "bfloat16", b_layout="kn", timeout_s=WAIT_S)
    a = cupy.asarray(_small_int([me, 1], (64, 64)))
    b = cupy.asarray(_small_int([2, me], (64, 64)))
    flat = cupy.zeros(64 * 64 + 1, dtype=bf)
    bad = [
        (lambda: op(cupy.zeros((64, 64), cupy.float16), b), TypeError,
         "a_shard must be bfloat16"),
        (lambda: op(a[:, :32].copy(), b), ValueError, r"a_shard must be \[rows, k=64\]"),
        (lambda: op(cupy.zeros((65, 64), bf), b), ValueError, "more than max_m // W = 64"),
        (lambda: op(a, b[:32].copy()), ValueError, r"b \(layout 'kn'\) must be \[k=64, n=64\]"),
        (lambda: op(a, cupy.zeros((64, 64), cupy.float16)), TypeError, "b must be bfloat16"),
        (lambda: op(a, b, bias=cupy.zeros(32, bf)), ValueError, "bias must have shape"),
        (lambda: op(a, b, out=cupy.zeros((W * 64 + 1, 64), np.float32)), ValueError,
         "out must have shape"),
        (lambda: op(a, b, out=cupy.zeros((W * 64, 64), np.float32)), TypeError,
         "out must be bfloat16"),
        (lambda: op(flat[1:].reshape(64, 64), b), ValueError,
         "a_shard must start at a 16-byte aligned address"),
        (lambda: op(a.T, b), ValueError, "C-contiguous"),
    ]
    for fn, err, match in bad:
        with pytest.raises(err, match=match):
            fn()
    assert op.epoch == 0  # nothing was queued
    b_host = _host([3, 1000 + me], (64, 64), "bfloat16")
    rel = _one_call(world, op, 3, 0, 0, 64, b_host, cupy.asarray(b_host), None, None, True,
                    f"rank {me}: good call after bad ones")
    op.close()
    return rel
