"""AllGather + GEMM (AllGatherGemm): GPU tests and CPU tests in one file.

GPU tests (marked gpu; skipped with "no CUDA device" where there is none) run the rank bodies
beside them (@on_ranks: body.run(W, ...)) under mpiexec, the ranks sharing the GPU, W from
CUFLUX_TEST_WORLD_SIZES (1, 2, 4 by default; 8 on the GPU machine). Every rank's shard is seeded
by (seed, case, call, rank) and its weight by (seed, case, rank), so a check proves who sent
what. Each call: outputs poisoned with NaN (every element must be written), the gathered A
compared bit for bit, the output against a float64 NumPy reference and, bit for bit, against
the plain GEMM (cuflux.gemm, same core and configuration) on the same gathered A: the fused
kernel must compute exactly the same tiles.

CPU tests: the kernels compile and wait before they load; the pure helpers the kernel mirrors
(chunks of a row range, visit order, block size, default chunk); argument checks; the float64
reference; the route (fused or unfused) and its plan; and the host protocol itself
(CopyGather.begin / send_peers / release, AllGatherGemm._issue and _issue_unfused), run for
several ranks on a simulated GPU: streams executing their queues in random interleavings over a
byte-addressed memory, with a model GEMM that reads each tile's rows after waiting on their
chunk flags; and the ops' lifetime on CommOp (one communicator, everything freed once, by
close() or abort())."""
import collections
import contextlib
import itertools
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

import cuflux.arrays as arrays
import cuflux.ops.ag_gemm as AGG
import cuflux.ops.allgather as AGM
from cuflux import errors as E
from cuflux import kernels, topology
from cuflux.arrays import dtype_info
from cuflux.errors import CommTimeoutError, CufluxError
from cuflux.ops import base as op_base
from cuflux.ops.ag_gemm import (AllGatherGemm, block_tiles_for, check_build_args,
                                chunks_for_rows, default_chunk_rows, reference_ag_gemm,
                                visit_order)
from cuflux.ops.allgather import arrival_order, arrival_stages
from cuflux.topology import PeerLink, Topology
from tests.checks import check_close, poisoned
from tests.fakes import FakeArray, FakeErrorRecord
from tests.mpi import fresh_seed, gpu_available, on_ranks, world_sizes

WS = world_sizes()


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
    assert op._gathered is None  # a closed op keeps no scratch (CommOp._scratch)


_BITS = {2: np.uint16, 4: np.uint32}


def _host(key, shape, dtype, scale=1.0):
    rng = np.random.default_rng(key)
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(
        dtype_info(dtype).storage)


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
    out = poisoned((W * rows, op.n), op.out_dtype.name)
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


def _small_int(key, shape):
    """Integers in [-2, 2] as bf16: products and sums of 64 terms are exact in fp32."""
    rng = np.random.default_rng(key)
    return rng.integers(-2, 3, shape).astype(np.float32).astype(dtype_info("bfloat16").storage)


def _skip_push_at_one(W, mode):
    if W == 1 and mode == "push":  # saves GPU time: at W = 1 both modes run the same path
        pytest.skip("W = 1 has no gather: mode='push' runs the pull path")


@pytest.fixture(scope="module", autouse=True)
def _compiled_once():
    """Compile the two families here once, so W rank processes do not all compile at once."""
    if not gpu_available():
        return
    import cuflux.ops  # noqa: F401  (registers every family)
    import cuflux.ops.ag_gemm  # noqa: F401  (until cuflux.ops imports it)
    from cuflux import kernels

    arch = kernels.device_arch()
    for src in ("ag_gemm.cu", "gemm.cu"):
        fam = kernels.families()[src]
        kernels.compile_source(fam.source, fam.names, arch)


# ==== GPU tests: each rank body, then its test(s) ===============================================

# (chunk_rows, b_layout, dtype, out_dtype, bias, n, k, rows of each call): odd shapes, tiles
# that straddle two ranks' shards and several chunks, a chunk of one row, N = 8, K % 64 != 0.
CASES = [
    (None, "kn", "bfloat16", "bfloat16", True, 520, 264, [77, 200, 1, 130]),
    (64, "nk", "float16", "float32", False, 264, 136, [160, 63, 129]),
    (37, "kn", "bfloat16", "float32", True, 136, 520, [150, 37, 74, 5]),
    (64, "nk", "bfloat16", "float16", True, 8, 72, [300, 257]),
]


@on_ranks
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


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_matches_float64_and_the_plain_gemm(W, mode, impl):
    _skip_push_at_one(W, mode)
    sweep.run(W, timeout_s=300, mode=mode, impl=impl, seed=fresh_seed())


@on_ranks
def routes(world, mode, seed):
    """route="unfused", "fused" and "auto" at small M (auto: unfused exactly where
    cuflux.gemm_tuner.fastest says cuBLAS; W = 1: the fused kernel on every route). plan(M) says
    the route before each new M; every call matches reference_ag_gemm (each rank its own
    weight and bias), outputs poisoned, the gathered A bit for bit every other call. Returns
    the routes taken, by the op's route."""
    import cupy

    from cuflux import gemm_tuner as T
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
                        wants[M] = ("unfused" if T.fastest(M, n, k, "bfloat16", "nk") == T.CUBLAS
                                    else "fused")
                what = (f"rank {me}/{W} {mode} route={route} call {call} rows {rows} "
                        f"seed {seed}")
                assert op.plan(M) == wants[M], f"{what}: plan {op.plan(M)}, want {wants[M]}"
                shards = [_host([seed, case, call, p], (rows, k), "bfloat16") for p in range(W)]
                ref = reference_ag_gemm(shards, bs, biases, "nk")[me]
                _checked_call(op, shards, b, bias, ref, call % 2 == 0, what)
                taken.setdefault(route, []).append(wants[M])
    return taken


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_routes_match_float64(W, mode):
    """route="unfused", "fused" and "auto" (small M: unfused where cuflux.gemm takes cuBLAS)
    against reference_ag_gemm; W = 1 runs the fused kernel on every route."""
    _skip_push_at_one(W, mode)
    res = routes.run(W, timeout_s=300, mode=mode, seed=fresh_seed())
    for taken in res:
        assert set(taken["fused"]) == {"fused"}
        assert set(taken["unfused"]) == {"fused" if W == 1 else "unfused"}
        assert W > 1 or set(taken["auto"]) == {"fused"}


@on_ranks
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


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w <= 2])
def test_every_configuration(W):
    assert every_config.run(W, timeout_s=300, seed=fresh_seed())[0] >= 1


@on_ranks
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


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_back_to_back_calls_with_changing_rows(W, mode):
    _skip_push_at_one(W, mode)
    assert back_to_back.run(W, timeout_s=300, mode=mode) == [1000] * W


@on_ranks
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
            out = poisoned((W * rows, n), "float32")
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


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1][:1])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_late_peer_is_waited_for(W, mode, impl):
    waited = late_peer.run(W, timeout_s=180, mode=mode, impl=impl)
    assert waited[-1] is None and all(w > 0.5 for w in waited[:-1])


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


@on_ranks
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


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("route", ["fused", "unfused"])
def test_timeout_names_the_missing_rank(W, mode, route):
    res = timeout.run(W, timeout_s=300, mode=mode, route=route)
    assert all(r["waited"] is not None for r in res[:-1]) and res[-1]["waited"] is None
    assert all(r["after"] < 1e-2 for r in res)


@on_ranks
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
        (lambda: op(cupy.zeros((65, 64), bf), b), ValueError, "more than max_m // W=64"),
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


test_bad_input_raises_before_anything_is_queued = bad_input.test(
    sizes=[w for w in WS if w > 1][:1] or [1], timeout_s=300)


@on_ranks
def sm_path(world, seed, n=136, k=128):
    """AllGatherGemm(path="sm"): the gather is allgather.cu's kernel, then the GEMM (unfused at
    W > 1, the fused kernel at W = 1). Calls back to back with no host sync between them, rows
    changing (0 included), every other call with return_gathered; each checked afterwards:
    the gathered A exact, out against the float64 reference."""
    import cupy as cp

    from cuflux.ops.ag_gemm import reference_ag_gemm
    W, me = world.size, world.rank
    st = dtype_info("bfloat16").storage
    rng = np.random.default_rng([seed, 7])
    bh = [rng.standard_normal((n, k)).astype(np.float32).astype(st) for _ in range(W)]
    calls = []
    with AllGatherGemm(world, 64 * W, n, k, "bfloat16", out_dtype="float32", b_layout="nk",
                       timeout_s=60, path="sm") as agm:
        assert W == 1 or agm.plan(64 * W) == "unfused"
        b = cp.asarray(bh[me])
        for i, rows in enumerate((64, 1, 37, 0, 64, 5, 64, 33)):
            ah = [np.random.default_rng([seed, i, p]).standard_normal((rows, k)).astype(
                np.float32).astype(st) for p in range(W)]
            got = agm(cp.asarray(ah[me]), b, return_gathered=bool(i % 2))
            calls.append((ah, got))
        agm.synchronize()
        for i, (ah, got) in enumerate(calls):
            out, gathered = got if i % 2 else (got, None)
            want = reference_ag_gemm(ah, bh, b_layout="nk")[me]
            if want.size:
                check_close(cp.asnumpy(out), want, "float32", f"call {i}")
            if gathered is not None:
                assert np.array_equal(cp.asnumpy(gathered).view(np.uint16),
                                      np.concatenate(ah).view(np.uint16)), f"call {i}"
    return len(calls)


test_sm_path_back_to_back = sm_path.test(expect=8, timeout_s=300, seed=fresh_seed)


# ==== CPU tests ===================================================================================

# ---- kernels -------------------------------------------------------------------------------------
def test_family_has_every_config_dtype_and_layout():
    fam = kernels.families()["ag_gemm.cu"]
    assert fam.min_arch == 80
    assert len(fam.names) == 2 * 2 * (len(AGG.AG_SM90_CONFIGS) + 1)
    assert set(AGG.AG_SM90_CONFIGS) >= {"256x128s4c1", "128x256s4c1", "128x128s6c1"}
    assert all(c.cluster == 1 for c in AGG.AG_SM90_CONFIGS.values())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_compiles_for_both_targets(arch):
    fam = kernels.families()["ag_gemm.cu"]
    cubin, lowered = kernels.compile_source(fam.source, fam.names, arch)
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(fam.names)


def _ptx(arch: str, names) -> str:
    return kernels.compile_ptx("ag_gemm.cu", names, arch)


def test_hopper_kernel_waits_with_acquire_then_loads_by_tma():
    cfg = AGG.AG_SM90_CONFIGS["256x128s4c1"]
    ptx = _ptx("sm_90a", [AGG._sm90_kernel(cfg, "__nv_bfloat16", True)])
    for instr in ("ld.acquire.sys.global.u32", "fence.proxy.async.global", "%globaltimer",
                  "nanosleep", "cp.async.bulk.tensor.2d", "wgmma.mma_async"):
        assert instr in ptx, instr
    assert "trap" not in ptx  # a timeout records and returns, never traps
    # The wait sits before the producer's first TMA load of a tile.
    assert ptx.index("ld.acquire.sys.global.u32") < ptx.index("cp.async.bulk.tensor.2d")


def test_portable_kernel_waits_and_has_no_hopper_code():
    ptx = _ptx("sm_80", [AGG._sm80_kernel("__half", False),
                         AGG._sm90_kernel(AGG.AG_SM90_CONFIGS["128x256s4c1"], "__half", False)])
    assert "ld.acquire.sys.global.u32" in ptx and "cp.async.cg.shared.global" in ptx
    assert "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx and "trap" not in ptx


# ---- pure helpers --------------------------------------------------------------------------------
@pytest.mark.parametrize("R,chunk", [(1, 1), (77, 37), (77, 1000), (128, 64), (200, 64), (5, 2)])
def test_chunks_for_rows_is_exactly_the_rows_sources(R, chunk):
    W = 4
    for r0, r1 in itertools.combinations(range(0, W * R + 1, max(1, R // 3)), 2):
        want = sorted({(r // R, (r % R) // chunk) for r in range(r0, r1)})
        got = chunks_for_rows(r0, r1, R, chunk)
        assert got == want, (r0, r1)
    assert chunks_for_rows(5, 5, R, chunk) == []


def test_arrival_order_own_first_then_stages_chunk_major():
    order = [[2, 3], [0]]
    seq = arrival_order(1, order, 3)
    assert seq[:3] == [(1, 0), (1, 1), (1, 2)]
    assert seq[3:9] == [(2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (3, 2)]
    assert seq[9:] == [(0, 0), (0, 1), (0, 2)]
    for W in (1, 2, 5, 8):
        for rank in range(W):
            for stages in (topology.full_mesh_order(rank, W), topology.ring_order(rank, W)):
                s = arrival_order(rank, stages, 4)
                assert sorted(s) == [(p, c) for p in range(W) for c in range(4)]


def test_arrival_stages_pull_is_own_order_push_follows_the_senders():
    W = 6
    for fn in (topology.full_mesh_order, topology.ring_order,
               lambda r, w: topology.ring2d_order(r, w, 3)):
        orders = [fn(p, W) for p in range(W)]
        for rank in range(W):
            assert arrival_stages(rank, orders, "pull") == orders[rank]
            push = arrival_stages(rank, orders, "push")
            assert sorted(p for st in push for p in st) == [p for p in range(W) if p != rank]
            for i, st in enumerate(push):  # stage i: exactly the senders whose stage i is to rank
                assert all(rank in orders[p][i] for p in st)
    ring = [topology.ring_order(p, 4) for p in range(4)]
    assert ring[1] == [[0], [3], [2]]            # rank 1 pulls from 0 first ...
    assert arrival_stages(1, ring, "push") == [[2], [3], [0]]  # ... but is pushed to by 2 first


def _orders(W, rank):
    yield topology.full_mesh_order(rank, W)
    yield topology.ring_order(rank, W)
    if W % 2 == 0 and W > 2:
        yield topology.ring2d_order(rank, W, W // 2)


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("R,chunk,tile", [(77, 37, 128), (512, 128, 256), (1024, 256, 128),
                                          (300, 300, 128), (1, 1, 128), (640, 64, 64)])
def test_visit_order_follows_arrival(W, R, chunk, tile):
    for rank in range(W):
        for stages in _orders(W, rank):
            bt = block_tiles_for(W, R, chunk, tile)
            order = visit_order(W, rank, stages, R, chunk, tile, bt)
            M = W * R
            nblocks = -(-(-(-M // tile)) // bt)
            assert sorted(order) == list(range(nblocks))
            when = {sc: i for i, sc in enumerate(arrival_order(rank, stages, -(-R // chunk)))}
            keys = [max(when[sc] for sc in chunks_for_rows(b * bt * tile,
                                                           min(M, (b + 1) * bt * tile), R, chunk))
                    for b in order]
            assert keys == sorted(keys)  # never a block before one that is ready earlier
            if W == 1:
                assert order == [0]
            elif R % (bt * tile) == 0:  # blocks align with shards: own shard first
                own = R // (bt * tile)
                assert order[:own] == list(range(rank * own, (rank + 1) * own))


def test_block_tiles_and_default_chunk():
    assert block_tiles_for(1, 4096, 4096, 256) == 16  # W = 1: one block, the plain order
    assert block_tiles_for(8, 512, 128, 256) == 1
    assert block_tiles_for(8, 1024, 512, 128) == 4
    assert block_tiles_for(2, 77, 1000, 128) == 1
    assert default_chunk_rows(4096, 24576, 1) == 4096
    assert default_chunk_rows(512, 24576, 8) == 128    # Flux AG at W = 8: 4 chunks of 3 MiB
    assert default_chunk_rows(1024, 16384, 8) == 256   # Llama-70B, M = 8192, W = 8
    assert default_chunk_rows(100, 64, 4) == 100       # small shards: one chunk
    for max_rows in (1, 7, 128, 1000, 8192):
        for W in (2, 8):
            c = default_chunk_rows(max_rows, 8192, W)
            assert 1 <= c <= max_rows and (c == max_rows or c % 128 == 0)


# ---- arguments -----------------------------------------------------------------------------------
GOOD = dict(max_m=512, n=256, k=128, dtype="bfloat16", out_dtype=None, b_layout="kn",
            mode="pull", chunk_rows=None, timeout_s=5.0, impl="auto", config=None, group_m=8)


@pytest.mark.parametrize("change,err,match", [
    ({"dtype": "float32"}, TypeError, "AllGatherGemm: dtype 'float32' is not supported"),
    ({"out_dtype": "int8"}, TypeError, "dtype 'int8' is not supported"),
    ({"b_layout": "tn"}, ValueError, "b_layout must be 'kn'"),
    ({"mode": "ring"}, ValueError, "mode must be 'pull' or 'push'"),
    ({"n": 100}, ValueError, r"n must be an integer in \[8, 2147483640\], a multiple of 8 .*"
                             r"got 100 \(int\)"),
    ({"k": 0}, ValueError, "k must be an integer in .*, a multiple of 8"),
    ({"max_m": 3}, ValueError, r"max_m must be an integer in \[4, 2147483647\] \(.*world size "
                               r"4 \* rows per rank\), got 3"),
    ({"chunk_rows": 0}, ValueError, "chunk_rows must be an integer >= 1 or None"),
    ({"timeout_s": 0}, ValueError, "timeout_s must be a finite number of seconds > 0"),
    ({"impl": "cuda"}, ValueError, "impl must be 'auto', 'sm90' or 'sm80'"),
    ({"config": "128x256s4c2"}, ValueError, "config must be one of"),
    ({"config": "256x128s4c1", "impl": "sm80"}, ValueError, "impl='sm80' has one fixed tile"),
    ({"group_m": 0}, ValueError, "group_m must be an integer >= 1"),
])
def test_bad_construction_is_named(change, err, match):
    with pytest.raises(err, match=match):
        check_build_args(4, **{**GOOD, **change})


def test_good_construction_args():
    dt, odt, max_rows = check_build_args(4, **{**GOOD, "max_m": 515, "out_dtype": "float32"})
    assert (dt.name, odt.name, max_rows) == ("bfloat16", "float32", 128)


def test_no_device_is_named(monkeypatch):
    from cuflux import world as world_mod

    monkeypatch.setattr(world_mod, "_device_count_and_reason",
                        lambda: (0, "no NVIDIA driver is installed on this machine"))
    world = SimpleNamespace(rank=1, size=2, device=None, check_same=lambda v, what: None)
    with pytest.raises(CufluxError, match="^AllGatherGemm: needs a CUDA device; no NVIDIA"):
        AllGatherGemm(world, 64, 64, 64, "bfloat16")


def test_host_arrays_are_refused_before_anything():
    op = object.__new__(AllGatherGemm)
    op.world, op.dtype = SimpleNamespace(size=2, rank=0, device=0), AGG.dtype_info("bfloat16")
    op.k, op.n, op.max_rows, op.b_layout = 64, 64, 32, "kn"
    a = np.zeros((8, 64), np.float32)
    with pytest.raises(TypeError, match="AllGatherGemm: a_shard"):
        op._check_call(a, a, None, None)


# ---- reference -----------------------------------------------------------------------------------
def test_reference_matches_loops():
    rng = np.random.default_rng(0)
    W, R, k, n = 3, 4, 5, 6
    shards = [rng.standard_normal((R, k)).astype(np.float32) for _ in range(W)]
    bs = [rng.standard_normal((k, n)) for _ in range(W)]
    biases = [rng.standard_normal(n) for _ in range(W)]
    outs = reference_ag_gemm(shards, bs, biases)
    outs_nk = reference_ag_gemm(shards, [b.T.copy() for b in bs], biases, b_layout="nk")
    for r in range(W):
        for i in range(W * R):
            for j in range(n):
                want = sum(float(shards[i // R][i % R, t]) * bs[r][t, j] for t in range(k))
                assert abs(outs[r][i, j] - want - biases[r][j]) < 1e-12
        np.testing.assert_allclose(outs_nk[r], outs[r], rtol=1e-13)
    with pytest.raises(ValueError, match="3 shards but 2 weights"):
        reference_ag_gemm(shards, bs[:2])
    with pytest.raises(ValueError, match="b_layout"):
        reference_ag_gemm(shards, bs, b_layout="t")


# ---- the host protocol on a simulated GPU -------------------------------------------------------
class _Event:
    def __init__(self, disable_timing=True):
        self.version, self.done = 0, set()

    def record(self, stream):
        self.version += 1
        stream.q.append(("record", self, self.version))


class _Stream:
    def __init__(self, sim):
        self.sim, self.q = sim, collections.deque()
        self.ptr = 0x1000 + len(sim.streams)
        sim.streams.append(self)

    def wait_event(self, ev):
        self.q.append(("wait_event", ev, ev.version))

    @property
    def done(self):  # polled by CommOp._drain: each look lets the GPU run one step
        if self.q:
            self.sim.step()
        return not self.q

    def __enter__(self):  # `with stream:` (CuPy's current stream): nothing to simulate
        return self

    def __exit__(self, *exc):
        return None

    def synchronize(self):  # every stream runs (in a random interleaving) until all are idle
        self.sim.run()


class _Array:  # what the host code touches of a device array
    def __init__(self, sim, rows, row_bytes):
        self.shape = (rows, row_bytes // 2)
        self.data = SimpleNamespace(ptr=sim.alloc(max(1, rows * row_bytes)))


class _Sim:
    """Streams run their queues in random interleavings; memory is byte-addressed."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.streams, self.allocs, self.next_base = [], [], 1 << 32
        self.sym = collections.defaultdict(list)  # rank -> symmetric bases, in allocation order
        self.log = []  # (rank, what): the collective and lifetime calls of the ops

    def alloc(self, nbytes):
        base = self.next_base
        self.allocs.append((base, np.zeros(nbytes, np.uint8)))
        self.next_base += (nbytes + 4095) // 4096 * 4096 + 4096
        return base

    def view(self, addr, nbytes):
        for base, arr in self.allocs:
            if base <= addr and addr + nbytes <= base + arr.size:
                return arr[addr - base:addr - base + nbytes]
        raise AssertionError(f"access [{addr:#x}, +{nbytes}) outside every allocation")

    def word(self, addr):
        return int(self.view(addr, 4).view(np.uint32)[0])

    def _ready(self, op):
        kind = op[0]
        if kind == "wait":
            return AGM_epoch_reached(self.word(op[1]), op[2])
        if kind == "wait_event":
            return op[2] == 0 or op[2] in op[1].done
        if kind == "kernel":
            return op[1].can_step()
        return True

    def _execute(self, st):
        op = st.q[0]
        kind = op[0]
        if kind == "copy":
            self.view(op[1], op[3])[:] = self.view(op[2], op[3])
        elif kind == "write":
            self.view(op[1], 4).view(np.uint32)[0] = op[2]
        elif kind == "record":
            op[1].done.add(op[2])
        elif kind == "kernel":
            if not op[1].step():
                return  # the kernel stays at the head until its last tile
        st.q.popleft()

    def step(self) -> bool:
        """Run one queued operation of some stream whose head can run; False if none can."""
        runnable = [st for st in self.streams if st.q and self._ready(st.q[0])]
        if runnable:
            self._execute(self.rng.choice(runnable))
        return bool(runnable)

    def run(self):
        while self.step():
            pass
        live = [st for st in self.streams if st.q]
        if live:
            heads = [(st.ptr, st.q[0][0], st.q[0][1:3]) for st in live]
            raise AssertionError(f"deadlock: every stream waits; heads {heads}")


def AGM_epoch_reached(observed, expected):
    return ((observed - expected) & 0xFFFFFFFF) < 0x80000000


class _Kernel:
    """The GEMM of one call as the prologue sees it: tile rows in the scheduler's order (blocks
    of visit_order, rows of a block in order), each after its chunks' flags; it checks every row
    it reads, and at the end that the whole gathered A still holds this call's rows (a peer must
    not overwrite them while the GEMM runs)."""

    def __init__(self, sim, op, a_ptr, rows, e, order, plan, expected):
        self.sim, self.a_ptr, self.R, self.e, self.expected = sim, a_ptr, rows, e, expected
        self.flags, self.max_chunks, self.chunk_rows = op.chunk_flags_ptr(), \
            op.max_chunks, op.chunk_rows
        self.row_bytes = op.row_bytes
        M, T = op.world.size * rows, plan.tile_rows
        tiles_m = -(-M // T)
        self.tiles = [(tm * T, min(M, (tm + 1) * T)) for b in order
                      for tm in range(b * plan.block_tiles,
                                      min(tiles_m, (b + 1) * plan.block_tiles))]
        self.next = 0

    def can_step(self):
        if self.next == len(self.tiles):
            return True
        r0, r1 = self.tiles[self.next]
        return all(AGM_epoch_reached(self.sim.word(self.flags + 4 * (p * self.max_chunks + c)),
                                     self.e)
                   for p, c in chunks_for_rows(r0, r1, self.R, self.chunk_rows))

    def _check(self, r0, r1, what):
        got = self.sim.view(self.a_ptr + r0 * self.row_bytes, (r1 - r0) * self.row_bytes)
        want = self.expected[r0 * self.row_bytes:r1 * self.row_bytes]
        assert np.array_equal(got, want), f"call {self.e}: {what} rows [{r0}, {r1})"

    def step(self):
        if self.next == len(self.tiles):
            self._check(0, len(self.expected) // self.row_bytes,
                        "gathered A changed under the GEMM:")
            return True
        r0, r1 = self.tiles[self.next]
        self._check(r0, r1, "tile read unflagged or stale")
        self.next += 1
        return False


def _fake_env(monkeypatch, sim):
    import cupy

    from cuflux import driver

    monkeypatch.setattr(cupy.cuda, "Event", _Event)
    monkeypatch.setattr(cupy.cuda, "Stream", lambda non_blocking=True: _Stream(sim))
    by_ptr = lambda p: next(st for st in sim.streams if st.ptr == p)  # noqa: E731
    monkeypatch.setattr(cupy.cuda.runtime, "memcpyAsync",
                        lambda dst, src, n, kind, sptr: by_ptr(sptr).q.append(("copy", dst, src,
                                                                               n)))
    monkeypatch.setattr(driver, "stream_write_value32",
                        lambda st, addr, v: st.q.append(("write", addr, v & 0xFFFFFFFF)))
    monkeypatch.setattr(driver, "stream_wait_value32",
                        lambda st, addr, v, cmp="geq": st.q.append(("wait", addr, v & 0xFFFFFFFF)))
    monkeypatch.setattr(AGM, "StreamWaiter", lambda err, dev, code: _Waiter(sim, err.rank))
    monkeypatch.setattr(op_base, "ErrorRecord", lambda op, rank, timeout_s: _Err(sim, op, rank,
                                                                              timeout_s))
    monkeypatch.setattr(op_base, "sm_count", lambda device: 132)
    monkeypatch.setattr(op_base, "failure_board", lambda world, comm: (None, None))  # host pages
    monkeypatch.setattr(op_base, "current_device", lambda: 0)  # the op's device (world.device)
    monkeypatch.setattr(kernels, "load", lambda *a, **k: None)
    monkeypatch.setattr(kernels, "device_arch", lambda device=None: "sm_90a")
    for mod in (AGM, arrays):
        for name in ("as_cupy", "check_array"):
            monkeypatch.setattr(mod, name, lambda x, *a, **k: x)
    monkeypatch.setattr(AGM, "stream_of", lambda s, like=None: s)
    from cuflux import launch

    monkeypatch.setattr(launch, "capturing", lambda s: False)  # simulated streams


def _world_topo(W, rank, kind):
    link = "pcie" if kind.startswith("pcie") else "nvlink"
    links = tuple(PeerLink(p, True, False, True, "self" if p == rank else link) for p in range(W))
    return Topology(rank, links, W // 2 if kind == "pcie_numa" else 0)


class _Err(FakeErrorRecord):
    """An op's error record (base.ErrorRecord): words the watchdog and abort() write."""

    def __init__(self, sim, op, rank, timeout_s):
        super().__init__(timeout_s, rank)
        self.sim, self.op = sim, op
        self.ptr, self.claim, self.timeout_ns = 1 << 40, np.zeros(1, np.uint32), 10**9

    def check(self):
        if self.failed():
            raise CommTimeoutError(self.op, self.rank, int(self.words[E.PEER]), self.timeout_s)

    def abort(self):
        self.sim.log.append((self.rank, "err.abort"))
        self.words[E.ABORT] = 1

    left = False

    def leave(self):  # idempotent, as FailureBoard.leave: logged once
        if not self.left:
            self.left = True
            self.sim.log.append((self.rank, "err.leave"))

    def close(self):
        self.sim.log.append((self.rank, "err.close"))


class _Waiter:
    """StreamWaiter: a stream wait on the flag (the simulator runs it when the flag is there)."""

    def __init__(self, sim, rank):
        self.sim, self.rank = sim, rank

    def wait(self, st, addr, v, peer, index=0, guard=False, follow=False):
        st.q.append(("wait", addr, v & 0xFFFFFFFF))

    def close(self):
        self.sim.log.append((self.rank, "waiter.close"))


def _world(sim, W, rank, kind):
    topo = _world_topo(W, rank, kind)
    log = sim.log

    def alloc_layout(layout, group=None):
        assert group is not None and group.rank == rank  # over the op's own communicator
        log.append((rank, f"alloc {group.tag}"))
        sim.sym[rank].append(sim.alloc(layout.num_bytes))
        idx = len(sim.sym[rank]) - 1

        def close(abort=False, streams=None):
            log.append((rank, ("buf.close", abort, streams)))

        def ptr(r, name, off=0):
            return sim.sym[r][idx] + layout.regions[name].offset + off

        def local(name):  # this rank's words of a flag region
            return sim.view(ptr(rank, name), layout.regions[name].num_bytes).view(np.uint32)

        return SimpleNamespace(ptr=ptr, local=local, close=close)

    def allgather(obj, timeout_s=None, what=""):  # the transfer orders of every rank
        assert obj == topology.transfer_order(topo, W), what
        return [topology.transfer_order(_world_topo(W, p, kind), W)
                for p in range(W)]

    def sub_comm(tag, timeout_s=None):
        log.append((rank, f"sub_comm {tag}"))
        return SimpleNamespace(
            rank=rank, tag=tag, allgather=allgather,
            check_same=lambda value, what, timeout_s=None: log.append((rank, f"agree {value}")),
            check_close=lambda timeout_s=None: log.append((rank, f"check_close {tag}")),
            barrier=lambda timeout_s=None, what="": log.append((rank, "barrier")),
            free=lambda: log.append((rank, f"comm.free {tag}")))

    return SimpleNamespace(rank=rank, size=W, device=0, topology=topo, alloc_layout=alloc_layout,
                           check_same=lambda v, what: None, sub_comm=sub_comm,
                           device_context=contextlib.nullcontext)


def _shard(sim, rank, call, rows, row_bytes):
    x = _Array(sim, rows, row_bytes)
    data = np.random.default_rng([rank, call, rows]).integers(0, 256, rows * row_bytes, np.uint8)
    sim.view(x.data.ptr, rows * row_bytes)[:] = data
    return x, data


def _rank_log(sim, rank):
    return [what for r, what in sim.log if r == rank]


CALLS = [[77, 1, 130, 64, 129], [5, 5, 3, 8, 1]]


class _WholeA:
    """The unfused route's GEMM as the stream runs it: it reads the whole gathered A at once,
    after the gather's copies; it checks every row is this call's."""

    def __init__(self, sim, a_ptr, expected, e):
        self.sim, self.a_ptr, self.expected, self.e = sim, a_ptr, expected, e

    def can_step(self):
        return True

    def step(self):
        got = self.sim.view(self.a_ptr, self.expected.size)
        assert np.array_equal(got, self.expected), f"call {self.e}: unfused GEMM read stale A"
        return True


def _ag_gemm_ops(monkeypatch, sim, W, kind, mode, max_rows, row_bytes, chunk_rows, **kwargs):
    """One AllGatherGemm per simulated rank, built by its constructor."""
    _fake_env(monkeypatch, sim)
    return [AllGatherGemm(_world(sim, W, rank, kind), n=8, k=row_bytes // 2, dtype="bfloat16",
                          mode=mode, chunk_rows=chunk_rows, timeout_s=1,
                          max_rows_per_rank=max_rows, **kwargs) for rank in range(W)]


@pytest.mark.parametrize("W,kind", [(1, "nvlink"), (2, "nvlink"), (3, "nvlink"), (4, "nvlink"),
                                    (4, "pcie"), (4, "pcie_numa"), (8, "nvlink")])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("chunk_rows", [None, 64, 37, 1])
def test_fused_protocol_on_simulated_streams(monkeypatch, W, kind, mode, chunk_rows):
    """Every rank queues the same calls (changing rows, return_gathered alternating), each rank
    taking the fused or the unfused route at random (W > 1: both routes run one protocol, so
    ranks may differ); streams then run in a random order. Nothing deadlocks, the GEMM model
    never reads a row before its flag or after a later call overwrote it, and every gathered A
    is exact."""
    rows_seq = CALLS[0] if chunk_rows != 1 else CALLS[1]
    max_rows, row_bytes = max(rows_seq), 16
    for seed in range(3 if W < 8 else 1):
        sim = _Sim(seed)
        ops = _ag_gemm_ops(monkeypatch, sim, W, kind, mode, max_rows, row_bytes, chunk_rows)
        for op in ops:
            assert op.chunk_rows == (chunk_rows or max_rows)
            op.test_stream = _Stream(sim)  # calls of one op are ordered on each rank
        routes = random.Random(seed)
        checks, unfused_calls = [], 0
        for call, rows in enumerate(rows_seq):
            shards = [_shard(sim, r, call, rows, row_bytes) for r in range(W)]
            expected = np.concatenate([d for _, d in shards])
            monkeypatch.setattr(AGG.gemm_op, "gemm", lambda a, b, stream, exp=expected, **kw:
                                stream.q.append(("kernel", _WholeA(sim, a.data.ptr, exp, call))))
            for rank, op in enumerate(ops):
                tile = 64
                plan = SimpleNamespace(tile_rows=tile, block_tiles=block_tiles_for(
                    W, rows, op.chunk_rows, tile))
                op.plan_for = lambda r, plan=plan: plan
                op._order = lambda r, plan, op=op: visit_order(
                    W, op.world.rank, op.arrival_stages, r, op.chunk_rows, tile,
                    plan.block_tiles)
                op._launch = (lambda plan, a_ptr, b, bias, out, r, e, order, s, op=op,
                              exp=expected: s.q.append(("kernel", _Kernel(
                                  sim, op, a_ptr, r, e, order, plan, exp))))
                s = op.test_stream
                want_back = call % 2 == 0
                pull = mode == "pull" or W == 1
                unfused = W > 1 and routes.random() < 0.5
                gathered = _Array(sim, W * rows, row_bytes) if want_back or (
                    W > 1 and (pull or unfused)) else None
                if unfused:
                    e = op._issue_unfused(shards[rank][0], gathered, None, None, None, s)
                    unfused_calls += 1
                else:
                    if pull and gathered is None:
                        gathered = shards[rank][0]
                    e = op._issue(shards[rank][0], rows, gathered, None, None, None, s)
                assert e == call + 1 and op._last_stream is s
                if want_back or unfused:
                    checks.append((rank, call, gathered, expected))
        sim.run()
        for rank, call, gathered, expected in checks:
            got = sim.view(gathered.data.ptr, expected.size)
            assert np.array_equal(got, expected), f"seed {seed} rank {rank} call {call}"
        assert unfused_calls > 0 or W == 1  # both routes were taken


@pytest.mark.parametrize("W,kind", [(2, "nvlink"), (4, "pcie"), (4, "pcie_numa"), (8, "nvlink")])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_plain_allgather_still_gathers_on_simulated_streams(monkeypatch, W, kind, mode):
    """AllGather.__call__ (gather_into: begin / send_peers / release) on the same simulator."""
    row_bytes = 16
    for seed in range(3):
        sim = _Sim(seed)
        _fake_env(monkeypatch, sim)
        ags = [AGM.AllGather(_world(sim, W, r, kind), 130, row_bytes // 2, "bfloat16", mode=mode,
                             chunk_rows=37, timeout_s=1) for r in range(W)]
        streams = [_Stream(sim) for _ in range(W)]
        checks = []
        for call, rows in enumerate([130, 1, 77, 0, 64]):
            shards = [_shard(sim, r, call, rows, row_bytes) for r in range(W)]
            expected = np.concatenate([d for _, d in shards])
            for r, ag in enumerate(ags):
                out = _Array(sim, W * rows, row_bytes)
                assert ag(shards[r][0], out=out, stream=streams[r]) is out
                checks.append((out, expected))
        sim.run()
        for out, expected in checks:
            assert np.array_equal(sim.view(out.data.ptr, expected.size), expected)
        for r in range(W):  # each row count compared across ranks once, before its call
            assert [w for w in _rank_log(sim, r) if w.startswith("agree")] == [
                "agree 130", "agree 1", "agree 77", "agree 0", "agree 64"]


# ---- lifetime on CommOp -----------------------------------------------------------------------
def _build(cls, world, mode="pull", **kwargs):
    if cls == "AllGather":
        return AGM.AllGather(world, 130, 8, "bfloat16", mode=mode, chunk_rows=37, timeout_s=1,
                             **kwargs)
    return AllGatherGemm(world, max_rows_per_rank=130, n=8, k=8, dtype="bfloat16", mode=mode,
                         chunk_rows=37, timeout_s=1, **kwargs)


def test_each_op_is_one_comm_op_in_construction_order(monkeypatch):
    """AllGather and AllGatherGemm are CommOps: each takes one communicator of its own
    (World.sub_comm, so the ranks' construction order is checked) and allocates its one
    buffer over it; an AllGatherGemm holds no second op. The error record and the kernels'
    error arguments carry the op's own name and code."""
    sim = _Sim(0)
    _fake_env(monkeypatch, sim)
    W = 2
    for rank in range(W):
        world = _world(sim, W, rank, "nvlink")
        ops = [_build("AllGather", world), _build("AllGatherGemm", world),
               AGM.AllGather(world, 8, 8, "bfloat16", timeout_s=1, name="AllGatherGemm")]
        assert all(isinstance(op, op_base.CommOp) and not op.closed for op in ops)
        assert [(op.op, op.err.op, int(op.err_args[3])) for op in ops] == [
            (n, n, E.OP_CODES[n]) for n in ("AllGather", "AllGatherGemm", "AllGatherGemm")]
    for rank in range(W):
        assert _rank_log(sim, rank) == ["sub_comm AllGather", "alloc AllGather",
                                        "sub_comm AllGatherGemm", "alloc AllGatherGemm",
                                        "sub_comm AllGatherGemm", "alloc AllGatherGemm"]


def _queue_call(op, sim, rows=77):
    """One gather of the op on a stream of the test's (its whole protocol, not run yet)."""
    x, _ = _shard(sim, op.world.rank, 0, rows, op.row_bytes)
    s = _Stream(sim)
    op.gather_into(x, _Array(sim, op.world.size * rows, op.row_bytes).data.ptr, s)
    return s


@pytest.mark.parametrize("cls", ["AllGather", "AllGatherGemm"])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_close_frees_everything_once(monkeypatch, cls, mode):
    """close() (collective): the ranks agree they close this op, this rank's streams finish
    while the watchdog still bounds their waits, then the watchdog stops and the buffer, the
    communicator and the error record are freed, each once; a second close does nothing and a
    closed op refuses to run."""
    sim = _Sim(1)
    _fake_env(monkeypatch, sim)
    W = 2
    ops = [_build(cls, _world(sim, W, r, "nvlink"), mode) for r in range(W)]
    streams = [_queue_call(op, sim) for op in ops]
    if cls == "AllGatherGemm":
        ops[0]._orders[(77, 64, 1)] = "a visit order on the device"
    sim.log.clear()
    for op in ops:
        op.close()
        op.close()
    assert all(st.done for st in sim.streams)
    for rank, op in enumerate(ops):
        assert _rank_log(sim, rank) == [f"check_close {cls}", "err.leave", "waiter.close",
                                        ("buf.close", False, None), f"comm.free {cls}",
                                        "err.close"]
        assert op.closed and op._last_stream is streams[rank]
        with pytest.raises(CufluxError, match=f"^{cls}: the op is closed$"):
            op(None) if cls == "AllGather" else op(None, None)
    assert cls == "AllGather" or not ops[0]._orders


@pytest.mark.parametrize("cls", ["AllGather", "AllGatherGemm"])
def test_abort_keeps_what_queued_work_may_touch(monkeypatch, cls):
    """abort() (local, at once) while this rank's call waits for a peer that never comes: the
    record's abort word is set (waits give up), the buffer is closed as an abort with every
    stream the op's work is queued on (the call's, the copy lanes, AllGatherGemm's side
    stream), the communicator is freed; the watchdog keeps running (it releases the waits as
    their streams reach them) and the record stays allocated. Once only."""
    sim = _Sim(2)
    _fake_env(monkeypatch, sim)
    W = 2
    ops = [_build(cls, _world(sim, W, r, "nvlink")) for r in range(W)]
    s = _queue_call(ops[0], sim)  # rank 1 never calls: rank 0's lanes wait for its ready flag
    if cls == "AllGatherGemm":
        ops[0]._orders[(77, 64, 1)] = "a visit order a queued kernel may read"
    sim.log.clear()
    ops[0].abort()
    own = ops[0].lanes + [ops[0].stager] + ([ops[0]._side] if cls == "AllGatherGemm" else [])
    assert len(ops[0].lanes) == 1 and not all(st.done for st in [s] + own)
    assert _rank_log(sim, 0) == ["err.abort", ("buf.close", True, (s, *own)),
                                 f"comm.free {cls}"]
    assert ops[0].closed and int(ops[0].err.words[E.ABORT]) == 1
    assert cls == "AllGather" or ops[0]._orders
    ops[0].abort()
    ops[0].close()
    assert len(_rank_log(sim, 0)) == 3
    # Rank 1 leaves a `with` block on a CommTimeoutError: abort, and with nothing queued its
    # streams are idle, so its watchdog stops.
    with pytest.raises(CommTimeoutError):
        with ops[1]:
            raise CommTimeoutError(cls, 1, 0, 1.0)
    own = ops[1].lanes + [ops[1].stager] + ([ops[1]._side] if cls == "AllGatherGemm" else [])
    assert _rank_log(sim, 1) == ["err.abort", "waiter.close", ("buf.close", True, tuple(own)),
                                 f"comm.free {cls}"]


def test_epochs_are_commops_and_rearm_with_the_last_calls_stream(monkeypatch):
    """A call's epoch comes from CommOp._next_epoch: at EPOCH_REARM_AT the op re-arms first,
    draining the stream of the call before (its copy lanes joined it), and counts from 1;
    the regions it zeroes are every flag region of the layout, not the data."""
    sim = _Sim(5)
    (op,) = _ag_gemm_ops(monkeypatch, sim, 1, "nvlink", "pull", 130, 16, 37)
    assert set(op._epoch_regions) == set(op.layout.regions) - {"data"}
    rearmed = []

    def rearm(self, stream):
        rearmed.append(stream)
        self.epoch = 0

    monkeypatch.setattr(op_base.CommOp, "_rearm", rearm)
    monkeypatch.setattr(op_base, "EPOCH_REARM_AT", 2)
    s1, s2 = _Stream(sim), _Stream(sim)
    x, _ = _shard(sim, 0, 0, 5, op.row_bytes)
    assert [op.begin(x, x.data.ptr, s) for s in (s1, s1, s2, s2)] == [1, 2, 1, 2]
    assert rearmed == [s1] and op._last_stream is s2


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_after_a_rearm_the_protocol_starts_again(monkeypatch, mode):
    """Every rank re-arms (CommOp._rearm: its flag regions zeroed) after some calls, as the
    barriers order it (this simulator runs one rank's host code at a time, so the test calls
    the re-arm of every rank before any queues its next call); calls from epoch 1 again still
    gather exactly: no flag of the old count is left to pass a wait early."""
    W, row_bytes = 3, 16
    for seed in range(6):
        sim = _Sim(seed)
        ops = _ag_gemm_ops(monkeypatch, sim, W, "nvlink", mode, 130, row_bytes, 37)
        streams = [_Stream(sim) for _ in ops]

        def calls(first, rows_seq):
            checks = []
            for call, rows in enumerate(rows_seq, first):
                shards = [_shard(sim, r, call, rows, row_bytes) for r in range(W)]
                for op, s in zip(ops, streams):
                    out = _Array(sim, W * rows, row_bytes)
                    op.gather_into(shards[op.world.rank][0], out.data.ptr, s)
                    checks.append((out, np.concatenate([d for _, d in shards]), call))
            sim.run()
            for out, expected, call in checks:
                assert np.array_equal(sim.view(out.data.ptr, expected.size), expected), \
                    f"seed {seed} call {call}"

        calls(0, [130, 77, 130])
        assert all(op.epoch == 3 for op in ops)
        for op, s in zip(ops, streams):
            op._rearm(s)
            assert op.epoch == 0 and not any(op.buf.local(n).any() for n in op._epoch_regions)
        calls(3, [130, 5, 130, 64, 130])
        assert all(op.epoch == 5 for op in ops)


# ---- route: fused or unfused ------------------------------------------------------------------
def _route_op(monkeypatch, W=4, route="auto"):
    sim = _Sim(0)
    _fake_env(monkeypatch, sim)
    return AllGatherGemm(_world(sim, W, 0, "nvlink"), max_m=W * 1024, n=1024, k=512,
                         dtype="bfloat16", b_layout="nk", timeout_s=1, route=route)


@pytest.mark.parametrize("route", ["sometimes", "FUSED", None, 1])
def test_bad_route_is_refused_before_any_collective(route):
    seen = []
    world = SimpleNamespace(rank=0, size=2, device=0, check_same=lambda v, what: seen.append(v))
    with pytest.raises(ValueError, match=r"^AllGatherGemm: route must be one of \('auto', "
                                         r"'fused', 'unfused'\), got "):
        AllGatherGemm(world, 64, 64, 64, "bfloat16", route=route)
    assert not seen
    with pytest.raises(ValueError, match="route must be one of"):
        check_build_args(2, **{**GOOD, "route": route})


@pytest.mark.parametrize("route", ["auto", "fused", "unfused"])
def test_route_is_compared_across_ranks(route):
    seen = []

    def check_same(value, what):
        seen.append((value, what))
        raise KeyboardInterrupt  # stop at the first collective

    world = SimpleNamespace(rank=0, size=2, device=0, check_same=check_same)
    with pytest.raises(KeyboardInterrupt):
        AllGatherGemm(world, 64, 64, 64, "bfloat16", route=route)
    (value, what), = seen
    assert value[-2:] == (route, "copy") and what.endswith("group_m, route, path)")


def test_auto_plan_follows_the_tuners_winner_once_per_m(monkeypatch):
    """route="auto": unfused exactly where cuflux.gemm_tuner.fastest says cuBLAS (whatever the
    reason: the tuner's table or its heuristic), asked once per M with the op's shape."""
    asked = []

    def winner(M, N, K, dtype="bfloat16", b_layout="kn"):
        asked.append((M, N, K, dtype, b_layout))
        return {8: "cublas", 300: "128x128s6c1", 512: "cublas", 1024: "sm80"}[M]

    op = _route_op(monkeypatch)
    monkeypatch.setattr(AGG.tuner, "fastest", winner)
    Ms = [8, 300, 512, 1024, 8, 512, 300]
    assert [op.plan(M) for M in Ms] == ["unfused", "fused", "unfused", "fused", "unfused",
                                        "unfused", "fused"]
    assert asked == [(M, 1024, 512, "bfloat16", "nk") for M in (8, 300, 512, 1024)]
    assert op.plan(np.int64(300)) == "fused" and len(asked) == 4


def test_auto_plan_with_the_tuners_own_winner(monkeypatch):
    """No stand-in for the tuner: without the Hopper path gemm's untuned rule (cuBLAS below
    CUBLAS_BELOW_M rows); on sm_90a the tuner's winner where it measured the shape class, else
    the heuristic. A near-tie that cuflux.gemm gives to cuBLAS (CORE_MARGIN) still fuses: our
    core was the faster, and the fused kernel hides the gather under it."""
    from cuflux import gemm_tuner as tuner
    from cuflux import knobs

    B = tuner.CUBLAS_BELOW_M
    op = _route_op(monkeypatch)
    monkeypatch.setattr(tuner, "device_props", lambda dev=None: (0, "sm_80", 108, "A100"))
    assert (op.plan(B - 4), op.plan(B), op.plan(4096)) == ("unfused", "fused", "fused")
    op = _route_op(monkeypatch)
    monkeypatch.setattr(tuner, "device_props", lambda dev=None: (0, "sm_90a", 132, "H200"))
    monkeypatch.setattr(knobs, "gemm_tune", lambda environ=None: True)
    measured = tuner.tune_key(op.dtype, "nk", 4096, 1024, 512)
    near = tuner.tune_key(op.dtype, "nk", 1024, 1024, 512)
    monkeypatch.setattr(tuner, "_TUNER_TABLE", {
        measured: {"config": tuner.CUBLAS},
        near: {"config": "128x128s6c1", "ms": {tuner.CUBLAS: 1.00, "128x128s6c1": 0.99}}})
    assert op.plan(4096) == "unfused"                    # cuBLAS measured faster
    assert (op.plan(2048), op.plan(B - 4)) == ("fused", "unfused")  # heuristic
    assert op.plan(1024) == "fused"
    assert tuner.plan(1024, 1024, 512, "bfloat16", "nk") == tuner.CUBLAS  # gemm's own pick


@pytest.mark.parametrize("route", ["fused", "unfused"])
def test_forced_route_never_asks(monkeypatch, route):
    op = _route_op(monkeypatch, route=route)
    monkeypatch.setattr(AGG.tuner, "fastest", lambda *a, **k: pytest.fail("the tuner asked"))
    assert {op.plan(M) for M in (4, 256, 4096)} == {route}


@pytest.mark.parametrize("route", ["auto", "fused", "unfused"])
def test_one_rank_runs_the_fused_kernel_on_every_route(monkeypatch, route):
    op = _route_op(monkeypatch, W=1, route=route)
    monkeypatch.setattr(AGG.tuner, "fastest", lambda *a, **k: "cublas")
    assert op.plan(1) == op.plan(1024) == "fused"


@pytest.mark.parametrize("M", [0, -4, 4 * 1024 + 4, 64.0, "64", True, None])
def test_plan_refuses_what_is_not_a_calls_m(monkeypatch, M):
    op = _route_op(monkeypatch)
    with pytest.raises(ValueError, match=r"^AllGatherGemm: M must be an integer in \[1, 4096\] "
                                         r"\(the gathered rows of a call\), got "):
        op.plan(M)


def _sim_calls(monkeypatch, sim):
    """AllGatherGemm.__call__ on the simulator: arrays allocated in simulated memory, the fused
    kernel and cuflux.gemm replaced by models that check the gathered A they read."""
    import cupy

    import cuflux.gemm_core as G

    for mod in (AGG, G, arrays):
        monkeypatch.setattr(mod, "as_cupy", lambda x, *a, **k: x)
    for mod in (AGG, arrays):
        monkeypatch.setattr(mod, "check_array", lambda x, *a, **k: x)
    monkeypatch.setattr(AGG, "stream_of", lambda s, like=None: s)
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: _Array(sim, shape[0],
                                                                        2 * shape[1]))


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_calls_take_the_planned_route(monkeypatch, W, mode):
    """Whole calls: rows compared across ranks once per new row count; route="auto" takes
    the route plan(M) gives (unfused where the tuner's winner is cuBLAS: here below 4 * 64
    rows), the unfused GEMM reads a gathered A that is complete, return_gathered gives it
    back."""
    sim = _Sim(3)
    ops = _ag_gemm_ops(monkeypatch, sim, W, "nvlink", mode, 130, 16, 37)
    _sim_calls(monkeypatch, sim)
    streams = [_Stream(sim) for _ in ops]  # calls of one op are ordered on each rank
    monkeypatch.setattr(AGG.tuner, "fastest", lambda M, N, K, dtype, b_layout:
                        "cublas" if M < W * 64 else "sm80")
    taken, checks = [], []
    for call, rows in enumerate([130, 5, 130, 0, 64, 63]):
        shards = [_shard(sim, r, call, rows, 16) for r in range(W)]
        expected = np.concatenate([d for _, d in shards])
        monkeypatch.setattr(AGG.gemm_op, "gemm", lambda a, b, stream, exp=expected, **kw: (
            taken.append("unfused"), stream.q.append(("kernel", _WholeA(sim, a.data.ptr, exp,
                                                                        call)))))
        for op in ops:
            op._launch = lambda *a, **k: taken.append("fused")
            op._order = lambda rows, plan: None
            op.plan_for = lambda rows: SimpleNamespace(tile_rows=64, block_tiles=1)
            me = op.world.rank
            out, gathered = op(shards[me][0], FakeArray((8, 8)), return_gathered=True,
                               stream=streams[me])
            assert out.shape[0] == W * rows
            checks.append((gathered, expected))
        want = "fused" if W == 1 or rows >= 64 else "unfused"
        assert taken == ([want] * W if rows else []), (call, rows)
        taken.clear()
    sim.run()
    for gathered, expected in checks:
        assert np.array_equal(sim.view(gathered.data.ptr, expected.size), expected)
    agreed = [w for w in _rank_log(sim, 0) if w.startswith("agree")]
    assert agreed == ([] if W == 1 else ["agree 130", "agree 5", "agree 0", "agree 64",
                                         "agree 63"])


# ---- benchmark shapes ---------------------------------------------------------------------------
@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
def test_bench_cases_are_valid_shapes(W):
    from cuflux.bench import ag_gemm as bench

    full = bench.cases(W, quick=False)
    assert [c[0] for c in full] == [s[0] for s in bench.SHAPES]
    assert {c[0] for c in bench.cases(W, quick=True)} == set(bench.QUICK)
    for name, M, n, k in full:
        assert M % W == 0 and M >= W and n % 8 == 0 and n >= 8 and k % 8 == 0, name
        check_build_args(W, M, n, k, "bfloat16", None, "nk", "pull", None, 30.0, "auto", None, 8)
    flux = dict((c[0], c[1:]) for c in full)["flux"]
    assert flux == (4096 // W * W, 49152 // W // 8 * 8, 12288)


# ---- launch arguments against the kernel signatures (a wrong order would corrupt on the GPU) --
@pytest.mark.parametrize("impl", ["sm90", "sm80"])
@pytest.mark.parametrize("b_layout", ["kn", "nk"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_launch_arguments_match_kernel_signatures(monkeypatch, impl, b_layout, with_bias):
    from cuflux import gemm_core as G
    from cuflux.arrays import dtype_info
    from tests.kernel_args import DeviceArray, check_args

    captured = []
    monkeypatch.setattr(AGG.kernels, "launch", lambda fn, grid, block, args, stream, **kw:
                        captured.append((kw["name"], args)))
    monkeypatch.setattr(G, "tensor_map", lambda *a: np.zeros(1, np.dtype((np.void, 128)))[0])
    op = object.__new__(AllGatherGemm)
    op.world = SimpleNamespace(size=4, rank=1, device=0)
    op.n, op.k, op.group_m, op.chunk_rows, op.b_layout = 256, 512, 8, 64, b_layout
    op.dtype = op.out_dtype = dtype_info("bfloat16")
    op.module = {n: n for n in AGG.FAMILY.names}
    op.err_args = (np.uint64(1 << 40), DeviceArray(), np.uint64(10**9),
                   np.uint32(E.OP_CODES["AllGatherGemm"]))  # CommOp's
    op.buf, op.max_chunks = SimpleNamespace(ptr=lambda rank, region, off=0: 1 << 41), 2
    t, transposed = "__nv_bfloat16", b_layout == "kn"
    if impl == "sm90":
        cfg = AGG.AG_SM90_CONFIGS["256x128s4c1"]
        kernel = AGG._sm90_kernel(cfg, t, transposed)
        plan = AGG._Plan("sm90", "256x128s4c1", kernel, cfg.bm, 1, 8, 384, cfg.smem_bytes)
    else:
        kernel = AGG._sm80_kernel(t, transposed)
        plan = AGG._Plan("sm80", G.SM80_CONFIG, kernel, 128, 1, 8, 256, 0)
    arr = DeviceArray()
    arr.data = SimpleNamespace(ptr=1 << 30)
    op._launch(plan, 1 << 31, arr, arr if with_bias else None, arr, 128, 3, DeviceArray(), None)
    (name, args), = captured
    assert name == kernel
    check_args("ag_gemm.cu", kernel.split("<")[0], args)


# ---- call checks with fake device arrays (every argument, wrong device included) -----------------
def _checking_op(b_layout="kn"):
    op = object.__new__(AllGatherGemm)
    op.world = SimpleNamespace(size=4, rank=1, device=0)
    op.dtype, op.out_dtype = AGG.dtype_info("bfloat16"), AGG.dtype_info("bfloat16")
    op.k, op.n, op.max_rows, op.b_layout = 128, 256, 32, b_layout
    return op


_A = FakeArray


@pytest.mark.parametrize("a,b,bias,out,exc,text", [
    (_A((16, 128), device=1), _A((128, 256)), None, None, ValueError,
     "a_shard is on device 1, this rank uses device 0"),
    (_A((16, 128)), _A((128, 256), device=2), None, None, ValueError, "b is on device 2"),
    (_A((16, 128)), _A((128, 256)), _A((256,), device=3), None, ValueError, "bias is on device 3"),
    (_A((16, 128)), _A((128, 256)), None, _A((64, 256), device=1), ValueError,
     "out is on device 1"),
    (_A((16, 128), "float16"), _A((128, 256)), None, None, TypeError, "a_shard must be bfloat16"),
    (_A((16, 64)), _A((128, 256)), None, None, ValueError, r"a_shard must be \[rows, k=128\]"),
    (_A((33, 128)), _A((128, 256)), None, None, ValueError, "more than max_m // W=32"),
    (_A((16, 128)), _A((256, 128)), None, None, ValueError, r"must be \[k=128, n=256\]"),
    (_A((16, 128)), _A((128, 256)), None, _A((16, 256)), ValueError,
     r"out must have shape \(64, 256\)"),
    (_A((16, 128), contiguous=False), _A((128, 256)), None, None, ValueError,
     "a_shard must be C-contiguous"),
])
def test_call_checks_name_the_argument(monkeypatch, a, b, bias, out, exc, text):
    import cuflux.gemm_core as G

    for mod in (AGG, G, arrays):
        monkeypatch.setattr(mod, "as_cupy", lambda x, name, op: x)
    with pytest.raises(exc, match=text) as e:
        _checking_op()._check_call(a, b, bias, out)
    assert "AllGatherGemm" in str(e.value)


def test_call_checks_accept_good_arguments(monkeypatch):
    import cuflux.gemm_core as G

    for mod in (AGG, G, arrays):
        monkeypatch.setattr(mod, "as_cupy", lambda x, name, op: x)
    got = _checking_op()._check_call(_A((16, 128)), _A((128, 256)), _A((256,)), _A((64, 256)))
    assert got[-1] == 16


def test_mismatched_arguments_between_ranks_found_at_construction():
    """A peer built the op with another n: World.check_same (digests, then the values) names
    it before any buffer is allocated."""
    from cuflux.world import World

    w = SimpleNamespace(rank=0, size=2, device=0)
    w.allgather = lambda v: [v, "another digest" if isinstance(v, str) else
                             (v[0], v[1] + 8) + tuple(v[2:])]
    w.check_same = lambda value, what: World.check_same(w, value, what)
    with pytest.raises(ValueError, match="differs between ranks") as e:
        AllGatherGemm(w, 64, 64, 64, "bfloat16")
    assert "AllGatherGemm" in str(e.value)
