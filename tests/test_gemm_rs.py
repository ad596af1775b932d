"""Tests of GemmReduceScatter, GPU and CPU in one file.

GPU tests (marked gpu; skipped, with the reason, without a GPU) run the rank bodies beside them
(@on_ranks) on W ranks sharing the GPU under mpiexec (W from CUFLUX_TEST_WORLD_SIZES; 8 included
on the GPU machine). Every rank draws every rank's operands from seeds that name the source rank,
so each rank can compute the float64 reference of its own rows (on the GPU, in float64: the
shapes reach 4096 x 12288 x 6144). Outputs are poisoned (all bits set: NaN) before each call, so
an element nobody wrote fails. Values are rounded to bf16 / fp16 with integer operations on
float32, so the reference sees exactly the operands the kernels see.

CPU tests (no GPU needed): the kernels compile for sm_80 and sm_90a and use the instructions the
protocol relies on; the tile order (every tile once, own tiles last in L2 groups, no two ranks
writing into one owner at a step, no cycle of waits: a simulation of the protocol); buffer
layout; the float64 golden model; argument checks (fake world and fake arrays); launch arguments
against the kernel signatures.
"""
import contextlib
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest

import cuflux.ops.gemm_rs as R
from cuflux import kernels
from cuflux.arrays import dtype_info
from cuflux.errors import CommTimeoutError, CufluxError
from cuflux import gemm_core as G
from cuflux.ops.gemm_rs import (REDUCE_MODES, W1_MODES, GemmReduceScatter, make_layout,
                                own_tile_rows, reference_gemm_rs, tile_order)
from cuflux.topology import PeerLink, Topology
from cuflux.world import World
from tests.checks import GEMM_TOL, check_close, f64, poison_owned, poisoned, raises_each
from tests.fakes import FakeArray
from tests.kernel_args import DeviceArray, check_args
from tests.kernel_args import names as kernel_names
from tests.mpi import core_impls, fresh_seed, on_ranks, world_sizes

TOL = GEMM_TOL  # relative Frobenius error
# Error allowed relative to cuBLAS + a bf16 ring reduce-scatter measured in the same run. The
# issue asks for "no worse": deterministic mode rounds each peer's partial once and sums in fp32
# (the own partial unrounded), so from W = 2 it must not lose to the ring (2 % for the noise of
# a one-row cell); at W = 1 there is no reduction, and it is our GEMM against cuBLAS (10 %).
# Atomic mode adds in the output dtype at the owner (red.add), as lossy as the ring: 30 %.
SLACK = {"deterministic": 1.02, "atomic": 1.3}
SLACK_W1 = 1.1
# Bound of every device wait in these tests. A legitimate wait is a peer's GEMM plus time-slicing
# (milliseconds); a protocol bug should fail in seconds, not eat the GPU lease.
WAIT_S = 20.0
WS = world_sizes()
MODES = ["deterministic", "atomic"]


@pytest.fixture(autouse=True)
def _no_gemm_tuning(monkeypatch):
    # At W = 1 the op is the plain GEMM; its tuner would time candidates on every new shape.
    monkeypatch.setenv("CUFLUX_GEMM_TUNE", "0")


# ==== GPU tests: rank bodies (@on_ranks) beside the tests that run them ===========================
@contextlib.contextmanager
def _op(world, *args, **kwargs):
    """A GemmReduceScatter that is closed (collectively) when the block succeeds. When the block
    raises, it is left open on purpose: a failed check is often on one rank only, its peers are
    already in the next collective, and a collective close would wait for them until the test's
    deadline. The rank exits instead (tests/rank_main.py) and mpiexec ends the others at once."""
    kwargs.setdefault("timeout_s", WAIT_S)
    kwargs.setdefault("route", "fused")  # the fused kernel even at small M (not cuBLAS + RS)
    op = GemmReduceScatter(world, *args, **kwargs)
    yield op
    op.close()
    # A closed op keeps no scratch (CommOp._scratch): its partial, its chunked route's staging
    assert op._partial is None and (op._chunked is None or op._chunked.staging is None)


# ---- operands -----------------------------------------------------------------------------------
def _round_to(x32, dtype):
    """float32 values rounded (to nearest even) to dtype, still float32 (device)."""
    import cupy as cp

    if dtype == "float32":
        return x32
    if dtype == "float16":
        return x32.astype(cp.float16).astype(cp.float32)
    u = x32.view(cp.uint32)
    r = (u + cp.uint32(0x7FFF) + ((u >> cp.uint32(16)) & cp.uint32(1))) & cp.uint32(0xFFFF0000)
    return r.view(cp.float32)


def _to_f32(x, dtype):
    """Device array in dtype's storage -> float32 (bf16 through its bits: exact)."""
    import cupy as cp

    if dtype == "bfloat16":
        return (x.view(cp.uint16).astype(cp.uint32) << cp.uint32(16)).view(cp.float32)
    return x.astype(cp.float32)


def _operand(shape, dtype, seed, scale=1.0, ints=None):
    """(x in dtype's storage, the same values as float32), random normal * scale, or random
    integers in [-ints, ints]."""
    import cupy as cp

    rs = cp.random.RandomState(seed)
    if ints is not None:
        x = rs.randint(-ints, ints + 1, size=shape).astype(cp.float32)
    else:
        x = _round_to(rs.standard_normal(shape, dtype=cp.float32) * np.float32(scale), dtype)
    return x.astype(dtype_info(dtype).storage), x


def _seed(seed, rank, what):
    return (seed * 7919 + rank * 101 + what) % (2**31)


def _inputs(seed, rank, M, n, k, dtype, layout, ints=None):
    a = _operand((M, k), dtype, _seed(seed, rank, 1), ints=ints)
    b = _operand((k, n) if layout == "kn" else (n, k), dtype, _seed(seed, rank, 2), ints=ints)
    return a, b


def _reference(world, seed, M, n, k, dtype, layout, bias32, ints=None):
    """Float64 rows of this rank, from every rank's operands (generated here, one at a time)."""
    import cupy as cp

    W, me = world.size, world.rank
    R = M // W
    total = cp.zeros((R, n), dtype=cp.float64)
    for p in range(W):
        (_, a32), (_, b32) = _inputs(seed, p, M, n, k, dtype, layout, ints)
        total += reference_gemm_rs([a32[me * R:(me + 1) * R]], [b32], b_layout=layout, xp=cp)[0]
        del a32, b32
    if bias32 is not None:
        total += bias32.astype(cp.float64)[None, :]
    return total


def _all_rows(world, seed, M, n, k, dtype, layout):
    """Float64 sum over ranks of a_r @ b_r, all M rows (rows of the first M' < M rows of a
    depend only on those rows: one table serves calls with any M')."""
    import cupy as cp

    total = cp.zeros((M, n), dtype=cp.float64)
    for p in range(world.size):
        (_, a32), (_, b32) = _inputs(seed, p, M, n, k, dtype, layout)
        total += reference_gemm_rs([a32], [b32], b_layout=layout, xp=cp)[0]
    return total


def _ring_baseline(world, seed, M, n, k, layout, bias32):
    """What cuBLAS (bf16 out) + a bf16 ring reduce-scatter + a bf16 bias add give on this rank:
    the chunk of rank r starts at r+1 and each hop adds one partial, rounded to bf16."""
    import cupy as cp

    W, me = world.size, world.rank
    R = M // W
    s = None
    for i in range(W):
        p = (me + 1 + i) % W
        (a, _), (b, _) = _inputs(seed, p, M, n, k, "bfloat16", layout)
        part = cp.matmul(a[me * R:(me + 1) * R], b if layout == "kn" else b.T)
        part32 = _to_f32(part, "bfloat16")
        s = part32 if s is None else _round_to(s + part32, "bfloat16")
    if bias32 is not None:
        s = _round_to(s + bias32[None, :], "bfloat16")
    return s


def _errors(got32, ref):
    import cupy as cp

    g = got32.astype(cp.float64)
    bad = int((~cp.isfinite(g)).sum())
    norm = float(cp.linalg.norm(ref)) + 1e-30
    rel = float(cp.linalg.norm(g - ref)) / norm
    rms = norm / max(1, ref.size) ** 0.5
    worst = float(cp.abs(g - ref).max()) / rms if ref.size else 0.0
    return bad, rel, worst


# ---- exact routing ------------------------------------------------------------------------------
EXACT_CASES = [  # (rows per rank, n, k, dtype, out_dtype, bias): integer operands, exact sums
    (1, 264, 24, "bfloat16", "bfloat16", True),
    (37, 1032, 24, "bfloat16", "bfloat16", False),
    (64, 8, 24, "float16", "float16", True),
    (300, 1032, 264, "float16", "float32", True),
    (129, 520, 136, "bfloat16", "float32", False),
]


def _run_exact(world, op, case, seed):
    """Two calls of `op` (both buffer parities) on integer operands; every element must equal
    the float64 reference exactly."""
    import cupy as cp

    W = world.size
    rows, n, k, dtype, out_dtype, with_bias = case
    M = rows * W
    # |a|, |b| <= 1: partial sums <= k, totals <= W * k + 8. k = 24 keeps totals <= 200 for the
    # 2-byte outputs (integers up to 256 are exact in bf16); fp32 outputs take k up to 264.
    (a, _), (b, _) = _inputs(seed, world.rank, M, n, k, dtype, op.b_layout, ints=1)
    bias, bias32 = _operand((n,), dtype, _seed(seed, 99, 3), ints=8) if with_bias else (None, None)
    ref = _reference(world, seed, M, n, k, dtype, op.b_layout, bias32, ints=1)
    # Every rank ready before the first launch: the device waits' bound (WAIT_S) is for the
    # protocol, not for a peer still building its reference on a time-sliced GPU.
    cp.cuda.Device().synchronize()
    world.barrier()
    for call in range(2):  # the second call uses the other parity of the buffers
        out = poisoned((rows, n), out_dtype)
        assert op(a, b, bias=bias, out=out) is out
        op.synchronize()
        got = _to_f32(out, out_dtype).astype(cp.float64)
        if not bool(cp.array_equal(got, ref)):
            diff = cp.argwhere(got != ref)
            i, j = (int(v) for v in diff[0])
            raise AssertionError(
                f"rank {world.rank} W={W} {op.impl} {op.reduce} {op.b_layout} config={op.config} "
                f"case={case} call {call}: {len(diff)} of {ref.size} elements differ; first "
                f"[{i}, {j}]: got {float(got[i, j])}, want {float(ref[i, j])} (seed {seed})")


def _exact_case(world, impl, reduce, layout, case, config, seed, w1="gemm", route="fused"):
    rows, n, k, dtype, out_dtype, _ = case
    W = world.size
    with _op(world, (rows + 2) * W, n, k, dtype, out_dtype=out_dtype, b_layout=layout,
             reduce=reduce, impl=impl, config=config, w1=w1, route=route) as op:
        if W > 1:
            assert op.plan(rows * W) == route, (route, op.plan(rows * W))
        _run_exact(world, op, case, seed)


@on_ranks
def exact_routing(world, seed, impls):
    """Integer operands (every sum exact in the output dtype): every element of every rank's
    output equals the float64 reference bit for bit, for both cores, both reduce modes, both
    b layouts, both Hopper configurations, odd shapes (rows per rank 1, 37, 64, 129, 300:
    tiles shared by several owners), with and without bias; at W = 1 also the fused kernel
    itself (not only the plain GEMM the op uses there); at W > 1 also the unfused route
    (cuflux.gemm into a partial, then the op's reduce-scatter) with the first core, and the
    chunked route (cuBLAS chunks moved by copy engines, deterministic only)."""
    count = 0
    for impl in impls:
        for reduce in REDUCE_MODES:
            for layout in ("kn", "nk"):
                for i, case in enumerate(EXACT_CASES):
                    config = None
                    if impl == "sm90":
                        config = ("256x128s4c1", "128x256s4c1")[(i + len(layout)) % 2]
                    for w1 in (W1_MODES if world.size == 1 else ["gemm"]):
                        _exact_case(world, impl, reduce, layout, case, config, seed + i, w1)
                        count += 1
                    if world.size > 1 and impl == impls[0]:
                        _exact_case(world, impl, reduce, layout, case, None, seed + i,
                                    route="unfused")
                        count += 1
                    if world.size > 1 and impl == impls[0] and reduce == "deterministic":
                        _exact_case(world, impl, reduce, layout, case, None, seed + i,
                                    route="chunked")
                        count += 1
    return count


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_exact_routing_every_core_mode_layout(W):
    count = exact_routing.run(W, timeout_s=300, seed=fresh_seed(), impls=core_impls())
    assert count == [count[0]] * W and count[0] >= 20


# ---- float sweep against float64 and against cuBLAS + ring reduce-scatter -----------------------
def sweep_cells(W):
    """The issue's grid as a Latin square: every pair of (M, n), (M, k), (n, k) values once."""
    Ms, ns, ks = (W * 1, W * 64, 4096), (1024, 4096 + 64, 12288), (512, 1536, 6144)
    return [(Ms[i], ns[j], ks[(i + j) % 3]) for i in range(3) for j in range(3)]


@on_ranks
def float_sweep(world, seed, impl):
    """Random operands, bf16 in and out (cells of the middle column in "nk" fp16 -> fp32), both
    reduce modes and b layouts: relative error under the dtype's tolerance, and (bf16) no worse
    than cuBLAS + a bf16 ring reduce-scatter measured in the same run; deterministic: a second
    call is bit-identical. Returns the worst error ratio to that baseline per mode."""
    import cupy as cp

    W = world.size
    worst_ratio = {mode: 0.0 for mode in REDUCE_MODES}
    for c, (M, n, k) in enumerate(sweep_cells(W)):
        for layout in ("kn", "nk"):
            dtype, out_dtype = ("float16", "float32") if (c % 3 == 1 and layout == "nk") else \
                ("bfloat16", "bfloat16")
            s = seed + 10 * c + len(layout)
            (a, _), (b, _) = _inputs(s, world.rank, M, n, k, dtype, layout)
            bias, bias32 = _operand((n,), dtype, _seed(s, 99, 3), scale=4.0) if c % 2 else \
                (None, None)
            ref = _reference(world, s, M, n, k, dtype, layout, bias32)
            base_rel = None
            if dtype == "bfloat16":
                _, base_rel, _ = _errors(_ring_baseline(world, s, M, n, k, layout, bias32), ref)
            for reduce in REDUCE_MODES:
                label = (f"rank {world.rank} W={W} {impl} {reduce} {layout} M={M} n={n} k={k} "
                         f"{dtype}->{out_dtype} bias={bias is not None} seed={s}")
                with _op(world, 4096, n, k, dtype, out_dtype=out_dtype, b_layout=layout,
                         reduce=reduce, impl=impl) as op:
                    out = op(a, b, bias=bias, out=poisoned((M // W, n), out_dtype))
                    op.synchronize()
                    bad, rel, worst = _errors(_to_f32(out, out_dtype), ref)
                    assert bad == 0, f"{label}: {bad} elements not written"
                    assert rel < TOL[out_dtype], f"{label}: relative error {rel:.3g}"
                    assert worst < 10 * TOL[out_dtype], f"{label}: worst element {worst:.3g} x rms"
                    if reduce == "deterministic":
                        again = op(a, b, bias=bias, out=poisoned((M // W, n), out_dtype))
                        op.synchronize()
                        assert bool(cp.array_equal(again.view(cp.uint8), out.view(cp.uint8))), \
                            f"{label}: a second call differs in bits"
                if base_rel is not None:
                    ratio = rel / base_rel
                    slack = SLACK_W1 if W == 1 and reduce == "deterministic" else SLACK[reduce]
                    assert ratio <= slack, \
                        f"{label}: error {rel:.3g} vs cuBLAS + bf16 ring {base_rel:.3g}"
                    worst_ratio[reduce] = max(worst_ratio[reduce], ratio)
            del a, b, ref
            cp.get_default_memory_pool().free_all_blocks()
    return worst_ratio


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_float_sweep_against_float64_and_ring(W, impl):
    ratios = float_sweep.run(W, timeout_s=300, seed=fresh_seed(), impl=impl)
    # the bf16 comparison with the ring baseline ran for both modes on every rank
    assert all(r[m] > 0 for r in ratios for m in MODES)


# ---- comm-only reduce-scatter: bit-exact against the kernel's own order -------------------------
@on_ranks
def reduce_scatter_exact(world, seed):
    """op.reduce_scatter(partial): deterministic mode equals, bit for bit, the sum of the W
    partials in float32 in rank order 0..W-1, plus bias, rounded once; atomic within tolerance."""
    import cupy as cp

    W, me = world.size, world.rank
    n = 1032
    for reduce in REDUCE_MODES:
        for dtype, out_dtype in (("bfloat16", "bfloat16"), ("float16", "float32")):
            with _op(world, 300 * W, n, 64, dtype, out_dtype=out_dtype, reduce=reduce) as op:
                for rows in (1, 129, 300):
                    M = rows * W
                    parts = [_operand((M, n), out_dtype, _seed(seed + rows, p, 5))
                             for p in range(W)]
                    bias, bias32 = _operand((n,), dtype, _seed(seed + rows, 99, 6), scale=4.0)
                    out = op.reduce_scatter(parts[me][0], bias=bias,
                                            out=poisoned((rows, n), out_dtype))
                    op.synchronize()
                    want = cp.zeros((rows, n), cp.float32)
                    for p in range(W):
                        want = want + parts[p][1][me * rows:(me + 1) * rows]
                    want = _round_to(want + bias32[None, :], out_dtype)
                    got = _to_f32(out, out_dtype)
                    label = f"rank {me} W={W} {reduce} {dtype}->{out_dtype} rows={rows}"
                    if reduce == "deterministic":
                        assert bool(cp.array_equal(got.view(cp.uint32), want.view(cp.uint32))), \
                            f"{label}: {int((got != want).sum())} elements differ from rank order"
                    else:
                        bad, rel, _ = _errors(got, want.astype(cp.float64))
                        assert bad == 0 and rel < TOL[out_dtype], f"{label}: {bad} bad, rel {rel}"
    return True


test_reduce_scatter_only_matches_rank_order_bits = reduce_scatter_exact.test(
    expect=True, timeout_s=200, seed=fresh_seed)


# ---- back to back -------------------------------------------------------------------------------
@on_ranks
def back_to_back(world, seed, reduce, calls=1000):
    """`calls` calls without a host sync, M changing every call (rows per rank 1..160), bias on
    every third, a comm-only reduce_scatter every tenth (sharing the op's epochs), route="auto"
    (M on both sides of UNFUSED_BELOW_M at W > 1: fused and unfused calls interleave); then every
    result is checked."""
    import cupy as cp

    W, me = world.size, world.rank
    n, k, max_rows, sets = 136, 64, 160, 3
    max_m = max_rows * W
    dtype = "bfloat16"
    ops_in, totals, partials, part_sums = [], [], [], []
    for st in range(sets):
        (a, _), (b, _) = _inputs(seed + st, me, max_m, n, k, dtype, "nk")
        ops_in.append((a, b))
        totals.append(_all_rows(world, seed + st, max_m, n, k, dtype, "nk"))
        parts = [_operand((max_m, n), dtype, _seed(seed + st, p, 7)) for p in range(W)]
        partials.append(parts[me][0])
        part_sums.append(sum(p[1].astype(cp.float64) for p in parts))
    bias, bias32 = _operand((n,), dtype, _seed(seed, 99, 8), scale=4.0)
    issued = []
    cp.cuda.Device().synchronize()
    world.barrier()  # every rank's operands ready: the waits' bound is for the protocol
    with _op(world, max_m, n, k, dtype, b_layout="nk", reduce=reduce, route="auto") as op:
        if W > 1:  # both routes are exercised
            assert {op.plan(r * W) for r in range(1, max_rows + 1)} == {"fused", "unfused"}
        for i in range(calls):
            rows = 1 + (i * 37) % max_rows
            M, st, with_bias = rows * W, i % sets, i % 3 == 0
            if i % 10 == 9:
                out = op.reduce_scatter(partials[st][:M], bias=bias if with_bias else None)
                issued.append((i, rows, part_sums[st], with_bias, out))
            else:
                a, b = ops_in[st]
                out = op(a[:M], b, bias=bias if with_bias else None)
                issued.append((i, rows, totals[st], with_bias, out))
        op.synchronize()
    for i, rows, total, with_bias, out in issued:
        ref = total[me * rows:(me + 1) * rows]  # rows of the first M only depend on those rows
        if with_bias:
            ref = ref + bias32.astype(cp.float64)[None, :]
        bad, rel, worst = _errors(_to_f32(out, dtype), ref)
        assert bad == 0 and rel < TOL[dtype] and worst < 10 * TOL[dtype], \
            f"rank {me} call {i} (rows {rows}): {bad} not finite, rel {rel:.3g}, worst {worst:.3g}"
    return len(issued)


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("reduce", MODES)
def test_back_to_back_calls_with_changing_m(W, reduce):
    issued = back_to_back.run(W, timeout_s=400, seed=fresh_seed(), reduce=reduce)
    assert issued == [1000] * W


@on_ranks
def chunked_back_to_back(world, seed, calls=60):
    """route="chunked": `calls` calls without a host sync (the copy lanes' guards and the
    staging reuse under load), rows per rank changing every call (1..160, uneven against every
    tile), bias on every third, fp32 output on a second op interleaved (at W = 2 both fold,
    the fp32 one's calls with a bias not); every result against
    the float64 reference; the same inputs twice give the same bits (rank-order sums); a call
    under CUDA-graph capture is refused before anything is queued."""
    import cupy as cp

    from cuflux.errors import CaptureError

    W, me = world.size, world.rank
    n, k, max_rows, sets = 136, 72, 160, 3
    max_m = max_rows * W
    dtype = "bfloat16"
    ops_in, totals = [], []
    for st in range(sets):
        (a, _), (b, _) = _inputs(seed + st, me, max_m, n, k, dtype, "nk")
        ops_in.append((a, b))
        totals.append(_all_rows(world, seed + st, max_m, n, k, dtype, "nk"))
    bias, bias32 = _operand((n,), dtype, _seed(seed, 99, 8), scale=4.0)
    issued = []
    cp.cuda.Device().synchronize()
    world.barrier()  # every rank's operands ready: the waits' bound is for the protocol
    with _op(world, max_m, n, k, dtype, b_layout="nk", route="chunked") as op, \
            _op(world, max_m, n, k, dtype, out_dtype="float32", b_layout="nk",
                route="chunked") as op32:
        if W > 1:
            assert op.plan(W) == op.plan(max_m) == "chunked"
        assert op.fold == op32.fold == (W == 2)  # k = 72: W = 2 folds (fp32 + bias: not)
        for i in range(calls):
            rows = 1 + (i * 37) % max_rows
            M, st, with_bias = rows * W, i % sets, i % 3 == 0
            a, b = ops_in[st]
            use = op32 if i % 4 == 1 else op
            out = use(a[:M], b, bias=bias if with_bias else None,
                      out=poisoned((rows, n), use.out_dtype.name))
            issued.append((i, rows, totals[st], with_bias, out, use.out_dtype.name))
        a, b = ops_in[0]
        again = [op(a[:W * 100], b, bias=bias) for _ in range(2)]
        op.synchronize()
        op32.synchronize()
        assert bool(cp.array_equal(again[0], again[1])), f"rank {me}: run-to-run bits differ"
        if W > 1:
            s = cp.cuda.Stream(non_blocking=True)
            with s:
                s.begin_capture()
                try:
                    op(a[:W], b, stream=s)
                    raise AssertionError("a chunked call was captured")
                except CaptureError as e:
                    assert "chunked" in str(e), str(e)
                finally:
                    s.end_capture()
            op(a[:W], b).get()  # the op still runs after the refusal
            op.synchronize()
    for i, rows, total, with_bias, out, odt in issued:
        ref = total[me * rows:(me + 1) * rows]  # rows of the first M only depend on those rows
        if with_bias:
            ref = ref + bias32.astype(cp.float64)[None, :]
        bad, rel, worst = _errors(_to_f32(out, odt), ref)
        tol = TOL[dtype]
        assert bad == 0 and rel < tol and worst < 10 * tol, \
            f"rank {me} call {i} (rows {rows}, {odt}): {bad} not finite, rel {rel:.3g}, " \
            f"worst {worst:.3g}"
    return len(issued)


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_chunked_route_back_to_back(W):
    issued = chunked_back_to_back.run(W, timeout_s=300, seed=fresh_seed())
    assert issued == [60] * W


# ---- device epochs past 2^32 ------------------------------------------------------------------
@on_ranks
def epochs_past_32_bits(world, seed):
    """The call epoch lives on the device as a 64-bit count (rs_hooks.cuh) and is never re-armed:
    seeded just below 2^32 on every rank (its flags still 0, which a 32-bit compare would read
    as reached at once: 2^32 truncates to 0), calls crossing 2^32 stay exact on both buffer
    parities, the count goes on past it, and every peer's flag of this rank's own tiles holds
    the last call's full 64-bit epoch."""
    import cupy as cp

    rows, n, k, dtype, out_dtype, _ = case = EXACT_CASES[3]
    W, me = world.size, world.rank
    with _op(world, (rows + 2) * W, n, k, dtype, out_dtype=out_dtype, reduce="deterministic",
             route="fused") as op:
        start = 2**32 - 1
        op.state[0] = start
        cp.cuda.Device().synchronize()
        _run_exact(world, op, case, seed)          # epochs 2^32 and 2^32 + 1
        _run_exact(world, op, case, seed + 1)      # and two more
        assert int(op.state[0]) == start + 4 and int(op.state[1]) == 0, op.state
        cfg = G.SM90_CONFIGS[op.config] if op.impl == "sm90" else G.SM80
        tiles_n = -(-n // cfg.bn)
        own_lo, own_hi = own_tile_rows(rows * W, W, me, cfg.bm)
        flags = cp.asnumpy(op.buf.local("flags"))
        for tm in range(own_lo, own_hi + 1):
            for tn in range(tiles_n):
                got = [int(flags[tm * tiles_n + tn, p]) for p in range(W) if p != me]
                assert got == [start + 4] * (W - 1), (tm, tn, got)
    return True


test_epochs_past_32_bits_stay_exact = epochs_past_32_bits.test(
    expect=True, sizes=[w for w in WS if w > 1], timeout_s=120, seed=fresh_seed)


# ---- failures -----------------------------------------------------------------------------------
TIMEOUT_FORMS = (("deterministic", "auto"), ("atomic", "auto"), ("deterministic", "chunked"))


@on_ranks
def timeout(world, timeout_s=2.0):
    """The last rank never computes: the others raise CommTimeoutError naming it within the
    timeout plus a margin; the failed op refuses to run again; a new op runs correctly. Both
    reduce modes, one after the other, then route="chunked" (its chunk waits are the copy
    protocol's watched stream waits)."""
    W, me = world.size, world.rank
    late = W - 1
    waited = {}
    for reduce, route in TIMEOUT_FORMS:
        op = GemmReduceScatter(world, 256 * W, 512, 64, "bfloat16", reduce=reduce,
                               timeout_s=timeout_s, route=route)
        (a, _), (b, _) = _inputs(1, me, 256 * W, 512, 64, "bfloat16", "kn")
        op(a, b)  # every rank: this M is now agreed, so the next call launches at once
        op.synchronize()
        if me != late:
            t0 = time.perf_counter()
            try:
                op(a, b)  # launches; the kernel's waits for the late rank's tiles start now
                op.synchronize()
                raise AssertionError(f"{reduce}/{route}: no CommTimeoutError although a rank "
                                     f"never computed")
            except CommTimeoutError as e:
                waited[reduce, route] = time.perf_counter() - t0
                assert e.op == "GemmReduceScatter" and e.rank == me and e.peer == late, str(e)
                assert waited[reduce, route] < timeout_s + 3.0, waited
            try:
                op(a, b)
                raise AssertionError(f"{reduce}/{route}: a failed op ran again")
            except CommTimeoutError:
                pass
        world.barrier()
        op.close()
        _exact_case(world, "auto", reduce, "kn", EXACT_CASES[1], None, 5,
                    route="fused" if route == "auto" else route)
    return {"waited": [list(form) for form in sorted(waited)] or None}


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_timeout_names_the_rank_that_never_computes(W):
    res = timeout.run(W, timeout_s=150)
    want = sorted(list(f) for f in TIMEOUT_FORMS)
    assert all(r["waited"] == want for r in res[:-1]) and res[-1]["waited"] is None


@on_ranks
def bad_input(world):
    """Clear errors before any launch (every rank raises alike, nothing reaches a peer); the op
    is still usable afterwards; mismatched shapes between ranks are found at construction."""
    import cupy as cp

    W = world.size
    st = dtype_info("bfloat16").storage
    case = (64, 256, 24, "bfloat16", "bfloat16", True)
    with _op(world, 64 * W, 256, 24, "bfloat16", reduce="deterministic") as op:
        a, b = cp.zeros((64 * W, 24), st), cp.zeros((24, 256), st)
        cases = [
            (lambda: op(a.astype(cp.float16), b), TypeError, "a must be bfloat16"),
            (lambda: op(a, cp.zeros((256, 24), st)), ValueError, "b (layout 'kn') must be"),
            (lambda: op(cp.zeros((64 * W, 16), st), b), ValueError, "a must be [M, k=24]"),
            (lambda: op(cp.zeros((65 * W, 24), st), b), ValueError, "more than max_m"),
            (lambda: op(np.zeros((64 * W, 24), np.float32), b), TypeError, "GemmReduceScatter: a "),
            (lambda: op(a, b, bias=cp.zeros(255, st)), ValueError, "bias must have shape"),
            (lambda: op(a, b, out=cp.zeros((64, 256), cp.float32)), TypeError,
             "out must be bfloat16"),
            (lambda: op(cp.zeros((24, 64 * W), st).T, b), ValueError, "C-contiguous"),
            (lambda: op.reduce_scatter(cp.zeros((64 * W, 255), st)), ValueError,
             "partial must be [M, n=256]"),
        ]
        if W > 1:
            cases.append((lambda: op(cp.zeros((64 * W - 1, 24), st), b), ValueError,
                          "not divisible by the world size"))
        if cp.cuda.runtime.getDeviceCount() > 1:  # one GPU: the CPU tests cover it
            other = (world.device + 1) % cp.cuda.runtime.getDeviceCount()
            with cp.cuda.Device(other):
                a_other = cp.zeros((64 * W, 24), st)
            cases.append((lambda: op(a_other, b), ValueError, f"a is on device {other}"))
        raises_each(cases, "GemmReduceScatter")
        assert int(op.state[0]) == 0  # nothing was launched (no call counted out)
        _run_exact(world, op, case, 3)  # still usable
    if W > 1:
        try:
            GemmReduceScatter(world, 64 * W, 256 + 8 * (world.rank % 2), 128, "bfloat16")
            raise AssertionError("mismatched n between ranks was not found")
        except ValueError as e:
            assert "differs between ranks" in str(e), str(e)
    return True


test_bad_input_raises_before_launch = bad_input.test(
    expect=True, sizes=sorted({1} | {w for w in WS if w > 1}), timeout_s=150)


@on_ranks
def memo_replays_w1(world, seed, M=256, n=264, k=520):
    """W = 1 (the plain GEMM): calls with out= whose arrays repeat, fresh values written in
    place, replay cuflux.gemm's bound launch from the second repeat on (base.CallMemo); each
    is exact with out poisoned first, on two streams taking turns; a dtype view of a is
    refused before any launch."""
    import cupy as cp

    st = dtype_info("bfloat16").storage
    streams = [cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)]
    with GemmReduceScatter(world, M, n, k, "bfloat16", b_layout="nk", timeout_s=60) as op:
        a, b, out = cp.empty((M, k), st), cp.empty((n, k), st), cp.empty((M, n), st)
        for i in range(6):
            rng = np.random.default_rng([seed, i])
            a[...] = cp.asarray(rng.standard_normal((M, k), np.float32)).astype(st)
            b[...] = cp.asarray(rng.standard_normal((n, k), np.float32)).astype(st)
            cp.cuda.runtime.memset(out.data.ptr, 0xFF, out.nbytes)
            cp.cuda.Device().synchronize()
            s = streams[(i // 2) % 2]
            assert op(a, b, out=out, stream=s) is out
            s.synchronize()
            check_close(out, f64(a) @ f64(b).T, "bfloat16", f"call {i} seed {seed}")
        assert any(callable(e) for e in op._memo.entries.values())
        raises_each([(lambda: op(a.view(cp.float16), b, out=out), TypeError,
                      "a must be bfloat16")], "GemmReduceScatter")
        op._memo.clear()
        ptrs = []
        for i in range(6):  # out left to the op, dropped each call: made before the key
            rng = np.random.default_rng([seed, 10 + i])
            a[...] = cp.asarray(rng.standard_normal((M, k), np.float32)).astype(st)
            poison_owned(op._memo, (M, n), st)
            got = op(a, b)
            ptrs.append(got.data.ptr)
            assert got.shape == (M, n) and got.dtype == st
            check_close(got, f64(a) @ f64(b).T, "bfloat16", f"owned call {i} seed {seed}")
            if i == 3:  # held: the same call again gets another output, also exact
                again = op(a, b)
                assert again.data.ptr != got.data.ptr
                check_close(again, f64(a) @ f64(b).T, "bfloat16", f"held call seed {seed}")
                del again
            del got
        assert any(callable(e) for e in op._memo.entries.values())
        assert len(set(ptrs)) == 1, ptrs  # every dropped output came back
    return 12


test_w1_repeated_calls_replay_and_stay_exact = memo_replays_w1.test(
    expect=12, sizes=[1], seed=fresh_seed, timeout_s=150)


# ==== CPU tests (no GPU needed) ===================================================================
# ---- compilation --------------------------------------------------------------------------------
def test_family_registered():
    fam = kernels.families()["gemm_rs.cu"]  # registered when cuflux.ops.gemm_rs is imported
    assert fam == R.FAMILY
    assert fam.min_arch == 80 and len(set(fam.names)) == len(fam.names) == 36
    for dt in ("__nv_bfloat16", "__half"):
        for tr in (False, True):
            for at in (False, True):
                assert R.sm80_kernel(dt, tr, at) in fam.names
                for c in R.SM90_RS_CONFIGS:
                    assert R.sm90_kernel(dt, c, tr, at) in fam.names
            for o in (dt, "float"):
                assert R.copy_kernel(dt, o, tr) in fam.names
        for o in (dt, "float"):
            assert R.sum_kernel(dt, o) in fam.names
    assert R.SM90_RS_DEFAULT in R.SM90_RS_CONFIGS
    for c in R.SM90_RS_CONFIGS:  # the fused kernels instantiate 4 stages, 1-CTA clusters
        cfg = G.SM90_CONFIGS[c]
        assert (cfg.stages, cfg.cluster, cfg.tma_store) == (4, 1, False)
        assert min(cfg.bm, cfg.bn) >= R.MIN_TILE


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernels_compile(arch):
    cubin, lowered = kernels.compile_source(R.FAMILY.source, R.FAMILY.names, arch)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(R.FAMILY.names)


def _ptx(arch: str, names) -> str:
    return kernels.compile_ptx("gemm_rs.cu", names, arch)


def test_hopper_kernels_use_the_protocol_instructions():
    det = _ptx("sm_90a", [R.sm90_kernel("__nv_bfloat16", R.SM90_RS_DEFAULT, False, False)])
    for instr in ("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                  "cp.async.bulk.tensor.2d", "st.relaxed.sys.global.u64",
                  "ld.acquire.sys.global.u64", "fence.acq_rel.sys", "barrier.sync 6, 256",
                  "%globaltimer", "nanosleep", "atom.global.add.u64"):
        assert instr in det, instr
    # 64-bit device epochs (rs_hooks.cuh): no 32-bit flag access is left
    assert "st.relaxed.sys.global.u32" not in det and "ld.acquire.sys.global.u32" not in det
    # the tile flags are relaxed stores made release stores by the one fence before them
    assert det.index("fence.acq_rel.sys") < det.index("st.relaxed.sys.global.u64")
    assert not re.search(r"\sred\.", det)  # deterministic: plain stores only
    atomic = _ptx("sm_90a", [R.sm90_kernel("__nv_bfloat16", "128x256s4c1", True, True),
                             R.copy_kernel("__half", "float", True)])
    for instr in ("red.relaxed.sys.global.add.noftz.bf16x2", "red.relaxed.sys.global.add.v2.f32",
                  "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
                  "fence.acq_rel.sys", "st.relaxed.sys.global.u64", "atom.global.add.u64"):
        assert instr in atomic, instr


def test_portable_kernels_below_sm90():
    ptx = _ptx("sm_80", [R.sm80_kernel("__nv_bfloat16", True, True),
                         R.sm90_kernel("__half", R.SM90_RS_DEFAULT, False, False),
                         R.copy_kernel("__half", "__half", True)])
    assert "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx  # Hopper kernels: empty
    for instr in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "atom.sys.cas.b32",
                  "red.relaxed.sys.global.add.noftz.f16x2", "fence.acq_rel.sys",
                  "st.relaxed.sys.global.u64", "atom.global.add.u64"):
        assert instr in ptx, instr


# ---- tile order ---------------------------------------------------------------------------------
def _owners(tm, M, W, bm):
    R_ = M // W
    return range(tm * bm // R_, (min(M, tm * bm + bm) - 1) // R_ + 1)


CASES = [  # (M, N, W, bm, bn): aligned and unaligned rows per rank, remainders, one tile row
    (4096, 12288, 8, 256, 128), (4096, 12288, 8, 128, 256), (8192, 8192, 4, 256, 128),
    (2048, 4160, 2, 128, 128), (8, 1024, 8, 256, 128), (512, 4160, 8, 128, 256),
    (512, 1032, 8, 256, 128), (296, 1032, 8, 128, 128), (3, 264, 3, 128, 128),
    (1000, 136, 1, 256, 128), (4096, 1024, 1, 128, 256), (84, 8, 7, 128, 128),
]


@pytest.mark.parametrize("M,N,W,bm,bn", CASES)
@pytest.mark.parametrize("group_m", [1, 3, 8])
def test_every_tile_once_own_tiles_last_grouped(M, N, W, bm, bn, group_m):
    """Every tile once; own tiles last, in groups of group_m tile rows walked column by column
    (the plain GEMM's L2-friendly order), so each tile row is walked in increasing tn: the
    order the no-deadlock simulation below relies on."""
    tiles_m, tiles_n = -(-M // bm), -(-N // bn)
    everything = sorted((m, n) for m in range(tiles_m) for n in range(tiles_n))
    for rank in range(W):
        order = tile_order(M, N, W, rank, bm, bn, group_m)
        assert sorted(order) == everything
        own = [t for t in order if rank in _owners(t[0], M, W, bm)]
        assert order[len(order) - len(own):] == own, "own tiles must come last"
        lo, hi = own_tile_rows(M, W, rank, bm)
        assert {t[0] for t in own} == set(range(lo, hi + 1))
        want = [(lo + first + i, tn) for first in range(0, hi - lo + 1, group_m)
                for tn in range(tiles_n) for i in range(min(group_m, hi - lo + 1 - first))]
        assert own == want


@pytest.mark.parametrize("M,N,W,bm,bn", [c for c in CASES if (c[0] // c[2]) % c[3] == 0])
def test_no_two_ranks_write_into_one_owner_at_a_step(M, N, W, bm, bn):
    """Rows per rank a multiple of the tile: at every slot the W ranks' tiles belong to W
    different owners; rank r starts with owner r+1 and ends with itself."""
    orders = [tile_order(M, N, W, r, bm, bn) for r in range(W)]
    for slot in range(len(orders[0])):
        owners = [list(_owners(orders[r][slot][0], M, W, bm)) for r in range(W)]
        assert all(len(o) == 1 for o in owners)
        assert len({o[0] for o in owners}) == W, f"slot {slot}: owners {owners}"
    for r in range(W):
        assert list(_owners(orders[r][0][0], M, W, bm)) == [(r + 1) % W]
        assert list(_owners(orders[r][-1][0], M, W, bm)) == [r]


def _simulate(M, N, W, bm, bn, grid, group_m, order_fn=tile_order):
    """Run the protocol's waits on W ranks of `grid` persistent CTAs each, one step at a time
    (a CTA finishes its tile's phase A, then blocks until every peer delivered that tile if it
    holds its rows). Returns True if every CTA of every rank finishes."""
    orders = [order_fn(M, N, W, r, bm, bn, group_m) for r in range(W)]
    seqs = [[[orders[r][s] for s in range(c, len(orders[r]), grid)] for c in range(grid)]
            for r in range(W)]
    pos = [[0] * grid for _ in range(W)]       # next tile index of each CTA
    sent = [[False] * grid for _ in range(W)]  # phase A of the current tile done
    delivered = [set() for _ in range(W)]      # tiles rank r has released to every owner
    progress = True
    while progress:
        progress = False
        for r in range(W):
            for c in range(grid):
                if pos[r][c] == len(seqs[r][c]):
                    continue
                t = seqs[r][c][pos[r][c]]
                if not sent[r][c]:
                    sent[r][c] = True
                    delivered[r].add(t)
                    progress = True
                if r in _owners(t[0], M, W, bm) and not all(
                        t in delivered[p] for p in range(W) if p != r):
                    continue  # waiting for a peer
                pos[r][c] += 1
                sent[r][c] = False
                progress = True
    return all(pos[r][c] == len(seqs[r][c]) for r in range(W) for c in range(grid))


@pytest.mark.parametrize("M,N,W,bm,bn", CASES + [(24, 512, 8, 128, 128), (64, 2048, 4, 128, 256),
                                                 (192, 384, 3, 256, 128)])
@pytest.mark.parametrize("grid", [1, 2, 5, 132])
def test_protocol_never_deadlocks(M, N, W, bm, bn, grid):
    assert _simulate(M, N, W, bm, bn, grid, 8)
    assert _simulate(M, N, W, bm, bn, grid, 1)


def test_a_rank_order_without_own_tiles_last_would_deadlock():
    """The simulation can fail: own tiles first (Flux's literal order) with one CTA per rank."""
    def own_first(M, N, W, rank, bm, bn, group_m):
        order = tile_order(M, N, W, rank, bm, bn, group_m)
        own = [t for t in order if rank in _owners(t[0], M, W, bm)]
        return own + [t for t in order if t not in own]

    assert not _simulate(1024, 256, 4, 128, 128, 1, 8, order_fn=own_first)
    assert _simulate(1024, 256, 4, 128, 128, 1, 8)


# ---- buffers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("W", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("reduce", R.REDUCE_MODES)
def test_layout(W, reduce):
    max_m, n = 1000 * W + 7, 4160
    lay = make_layout(W, max_m, n, "bfloat16", reduce)
    data, flags = lay.regions["data"], lay.regions["flags"]
    rows = max_m // W
    assert data.shape == ((2, W, rows, n) if reduce == "deterministic" else (2, rows, n))
    assert data.dtype == dtype_info("bfloat16").storage and data.offset == 0
    assert flags.offset % 128 == 0 and flags.dtype == np.uint64  # device epochs: u64
    stride = flags.shape[1]
    assert stride >= W and stride % 16 == 0  # one (or more) whole 128-byte lines per tile
    for cfg in list(R.SM90_RS_CONFIGS):
        c = G.SM90_CONFIGS[cfg]
        assert flags.shape[0] >= -(-max_m // c.bm) * -(-n // c.bn)
    assert flags.shape[0] >= -(-max_m // R.COPY_TILE[0]) * -(-n // R.COPY_TILE[1])
    assert flags.shape[0] >= -(-max_m // G.SM80.bm) * -(-n // G.SM80.bn)
    # a slot row stride keeps 16-byte vectors aligned (finish() loads 16 bytes)
    assert n * 2 % 16 == 0 and (data.num_bytes // 2) % 16 == 0


# ---- golden model -------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("W", [1, 2, 3])
def test_reference_matches_a_loop(layout, W):
    rng = np.random.default_rng(W)
    M, n = 2 * W, 5
    ks = [3 + r for r in range(W)]  # k may differ between ranks
    a = [rng.standard_normal((M, k)) for k in ks]
    b = [rng.standard_normal((k, n) if layout == "kn" else (n, k)) for k in ks]
    bias = rng.standard_normal(n)
    got = reference_gemm_rs(a, b, bias, layout)
    for o in range(W):
        for i in range(M // W):
            for j in range(n):
                want = bias[j]  # once, not W times
                for r in range(W):
                    bb = b[r] if layout == "kn" else b[r].T
                    want += sum(a[r][o * (M // W) + i, t] * bb[t, j] for t in range(ks[r]))
                assert abs(got[o][i, j] - want) < 1e-12
        np.testing.assert_array_equal(reference_gemm_rs(a, b, bias, layout, rank=o), got[o])
    if W > 1:
        with pytest.raises(ValueError, match="not divisible"):
            reference_gemm_rs([x[:M - 1] for x in a], b)


# ---- constructor checks (fake world) ------------------------------------------------------------
def _topo(W, rank, kind):
    return Topology(rank, tuple(PeerLink(p, True, kind == "same_gpu", True,
                                         "self" if p == rank else kind) for p in range(W)))


def _fake_world(W=2, rank=0, device=None, kind="nvlink", peer_values=None):
    w = SimpleNamespace(rank=rank, size=W, device=device, topology=_topo(W, rank, kind))
    w.allgather = lambda o: [o] * W if peer_values is None else [o, peer_values(o)]
    w.check_same = lambda value, what: World.check_same(w, value, what)
    return w


@pytest.mark.parametrize("kwargs,exc,text", [
    (dict(dtype="float32"), TypeError, "expected one of"),
    (dict(dtype="float8_e4m3fn"), TypeError, "expected one of"),
    (dict(out_dtype="float16"), TypeError, "expected one of"),   # bf16 in: bf16 or fp32 out
    (dict(b_layout="tn"), ValueError, "b_layout must be"),
    (dict(reduce="ring"), ValueError, "reduce must be one of"),
    (dict(impl="cuda"), ValueError, "impl must be"),
    (dict(config="128x128s6c1"), ValueError, "config must be one of"),
    (dict(w1="plain"), ValueError, r"w1 must be one of \('gemm', 'fused'\)"),
    (dict(route="cublas"), ValueError,
     r"route must be one of \('auto', 'fused', 'unfused', 'chunked'\)"),
    (dict(route="chunked", reduce="atomic"), ValueError, "route='chunked' sums the partials"),
    (dict(route="chunked", fold="yes"), ValueError, "fold must be None, True or False"),
    (dict(route="chunked", fold=1.0), ValueError, "fold must be None, True or False"),
    (dict(fold=False), ValueError, "fold is route='chunked''s choice; got route='auto'"),
    (dict(timeout_s=0), ValueError, "timeout_s must be a finite number of seconds > 0"),
    (dict(max_m=0), ValueError, "max_m must be an int"),
    (dict(max_m=1.5), ValueError, "max_m must be an int"),
    (dict(n=2**31), ValueError, "n must be an int"),
    (dict(max_m=1), ValueError, r"max_m must be an integer in \[2, \d+\]"),
    (dict(n=1001), ValueError, r"n must be an integer in \[8, \d+\], a multiple of 8"),
    (dict(k=12), ValueError, r"k must be an integer in \[8, \d+\], a multiple of 8"),
    (dict(), CufluxError, "needs a CUDA device"),  # valid arguments reach the device check
])
def test_constructor_checks(kwargs, exc, text):
    args = dict(max_m=64, n=256, k=128, dtype="bfloat16")
    args.update(kwargs)
    with pytest.raises(exc, match=text) as e:
        GemmReduceScatter(_fake_world(), **args)
    assert "GemmReduceScatter" in str(e.value)


@pytest.mark.parametrize("W,w1,route,M,want", [
    (4, "gemm", "auto", 252, "unfused"),  # a GEMM of 252 rows: cuBLAS's side
    (2, "gemm", "auto", 254, "unfused"),
    (2, "gemm", "auto", 256, "fused"),
    (8, "gemm", "auto", 8, "unfused"),
    (8, "gemm", "auto", 4096, "fused"),
    (2, "gemm", "fused", 2, "fused"),
    (2, "gemm", "unfused", 8192, "unfused"),
    (1, "gemm", "fused", 4096, "gemm"),    # W = 1: w1 decides, nothing to reduce
    (1, "fused", "unfused", 8, "fused"),
    (2, "gemm", "chunked", 2, "chunked"),  # every M: the route is the caller's choice
    (8, "gemm", "chunked", 8192, "chunked"),
    (1, "gemm", "chunked", 4096, "gemm"),
])
def test_plan_is_a_function_of_m_and_the_agreed_arguments(W, w1, route, M, want):
    """Every rank must take the same route (the two use different flag protocols): plan(M)
    reads nothing but M, the world size, w1 and route (no tuner table, no timing)."""
    op = object.__new__(GemmReduceScatter)
    op.world, op.w1, op.route = SimpleNamespace(size=W), w1, route
    assert op.plan(M) == want


def test_mismatched_arguments_between_ranks_found_at_construction():
    # the peer has another n (World.check_same compares digests, then gathers the values)
    w = _fake_world(device=0, peer_values=lambda v: "another digest" if isinstance(v, str) else
                    (v[0], v[1] + 8) + tuple(v[2:]))
    with pytest.raises(ValueError, match="GemmReduceScatter arguments .* differs between ranks"):
        GemmReduceScatter(w, 64, 256, 128, "bfloat16")


@pytest.mark.parametrize("W,impl", [(2, "sm80"), (4, "sm80")])
def test_fold_where_it_cannot_is_refused_on_every_rank(W, impl):
    # impl="sm80": no device query (the fake world has no GPU behind device 0)
    with pytest.raises(ValueError, match=r"GemmReduceScatter: fold=True needs W = 2 .*impl='auto'"):
        GemmReduceScatter(_fake_world(W=W, device=0), 64, 256, 128, "bfloat16", impl=impl,
                          route="chunked", fold=True)


def test_atomic_mode_refused_over_pcie():
    # impl="sm80": no device query (the fake world has no GPU behind device 0)
    with pytest.raises(ValueError, match="reduce='atomic' needs peer atomics.*PCIe"):
        GemmReduceScatter(_fake_world(device=0, kind="pcie"), 64, 256, 128, "bfloat16",
                          reduce="atomic", impl="sm80")


def test_a_problem_on_one_rank_raises_on_every_rank():
    """Rank 0 is fine, its peer reports PCIe links: rank 0 raises too (no one is left waiting
    in the collective allocation)."""
    peer = ("reduce='atomic' needs peer atomics (rank 1)", False, 128, True)
    w = _fake_world(device=0, kind="nvlink",
                    peer_values=lambda o: peer if isinstance(o, tuple) and len(o) == 4 else o)
    with pytest.raises(ValueError, match=r"GemmReduceScatter: reduce='atomic' .*\(rank 1\)"):
        GemmReduceScatter(w, 64, 256, 128, "bfloat16", reduce="atomic", impl="sm80")


# ---- call checks (fake arrays) ------------------------------------------------------------------


def _fake_op(W=4, rank=1, layout="kn", out_dtype="bfloat16", k=128, n=256, max_m=512):
    op = object.__new__(GemmReduceScatter)
    op.world = SimpleNamespace(size=W, rank=rank, device=0)
    op.dtype, op.out_dtype = dtype_info("bfloat16"), dtype_info(out_dtype)
    op.max_m, op.n, op.k, op.b_layout = max_m, n, k, layout
    return op


A = FakeArray
OUT = A((32, 256))


@pytest.mark.parametrize("layout,a,b,bias,out,exc,text", [
    ("kn", A((128, 128), "float16"), A((128, 256)), None, OUT, TypeError, "a must be bfloat16"),
    ("kn", A((128,)), A((128, 256)), None, OUT, ValueError, "a must have 2 dimensions"),
    ("kn", A((128, 64)), A((128, 256)), None, OUT, ValueError, r"a must be \[M, k=128\]"),
    ("kn", A((128, 128)), A((256, 128)), None, OUT, ValueError,
     r"b \(layout 'kn'\) must be \[k, n\] = \(128, 256\)"),
    ("nk", A((128, 128)), A((128, 256)), None, OUT, ValueError,
     r"b \(layout 'nk'\) must be \[n, k\] = \(256, 128\)"),
    ("kn", A((128, 128)), A((128, 256), "float16"), None, OUT, TypeError, "b must be bfloat16"),
    ("kn", A((130, 128)), A((128, 256)), None, OUT, ValueError,
     "M=130 rows, which is not divisible by the world size 4.*pad it with zero rows"),
    ("kn", A((516, 128)), A((128, 256)), None, OUT, ValueError, "more than max_m=512"),
    ("kn", A((128, 128), device=1), A((128, 256)), None, OUT, ValueError,
     "a is on device 1, this rank uses device 0"),
    ("kn", A((128, 128)), A((128, 256), device=3), None, OUT, ValueError, "b is on device 3"),
    ("kn", A((128, 128), contiguous=False), A((128, 256)), None, OUT, ValueError,
     "a must be C-contiguous"),
    ("kn", A((128, 128), ptr=(1 << 20) + 8), A((128, 256)), None, OUT, ValueError,
     "a must start at a 16-byte aligned address"),
    ("kn", A((128, 128)), A((128, 256)), A((255,)), OUT, ValueError,
     r"bias must have shape \(256,\)"),
    ("kn", A((128, 128)), A((128, 256)), A((256,), "float32"), OUT, TypeError,
     "bias must be bfloat16"),
    ("kn", A((128, 128)), A((128, 256)), A((256,), ptr=(1 << 20) + 4), OUT, ValueError,
     "bias must start at a 16-byte aligned address"),
    ("kn", A((128, 128)), A((128, 256)), None, A((128, 256)), ValueError,
     r"out must have shape \(32, 256\)"),
    ("kn", A((128, 128)), A((128, 256)), None, A((32, 256), "float32"), TypeError,
     "out must be bfloat16"),
    ("kn", A((128, 128)), A((128, 256)), None, A((32, 256), device=2), ValueError,
     "out is on device 2"),
])
def test_call_checks(monkeypatch, layout, a, b, bias, out, exc, text):
    monkeypatch.setattr(R, "as_cupy", lambda x, name, op: x)
    with pytest.raises(exc, match=text) as e:
        _fake_op(layout=layout).check_call(a, b, bias, out)
    assert "GemmReduceScatter" in str(e.value)


def test_call_accepts_good_arguments(monkeypatch):
    monkeypatch.setattr(R, "as_cupy", lambda x, name, op: x)
    op = _fake_op(layout="nk", out_dtype="float32")
    got = op.check_call(A((512, 128)), A((256, 128)), A((256,)), A((128, 256), "float32"))
    assert got[4] == 512
    assert op.check_call(A((0, 128)), A((256, 128)), None, A((0, 256), "float32"))[4] == 0


@pytest.mark.parametrize("partial,out,exc,text", [
    (A((128, 256), "float16"), OUT, TypeError, "partial must be bfloat16"),
    (A((128, 255)), OUT, ValueError, r"partial must be \[M, n=256\]"),
    (A((6, 256)), A((1, 256)), ValueError, "not divisible by the world size 4"),
    (A((128, 256), ptr=(1 << 20) + 2), OUT, ValueError, "partial must start at a 16-byte"),
    (A((128, 256)), A((32, 256), ptr=(1 << 20) + 4), ValueError, "out must start at a 16-byte"),
])
def test_partial_checks(monkeypatch, partial, out, exc, text):
    monkeypatch.setattr(R, "as_cupy", lambda x, name, op: x)
    with pytest.raises(exc, match=text):
        _fake_op().check_partial(partial, None, out)


# ---- launch arguments against the kernel signatures ---------------------------------------------
@pytest.mark.parametrize("impl", ["sm90", "sm80"])
@pytest.mark.parametrize("reduce", R.REDUCE_MODES)
def test_launch_arguments_match_kernel_signatures(monkeypatch, impl, reduce):
    captured = []
    monkeypatch.setattr(R.kernels, "launch", lambda fn, grid, block, args, stream, **kw:
                        captured.append((kw["name"], grid, block, args, kw.get("shared_mem", 0))))
    monkeypatch.setattr(G, "prepare", lambda fn, smem: None)
    monkeypatch.setattr(G, "tensor_map", lambda *a: np.zeros(1, np.dtype((np.void, 128)))[0])
    W, me, M = 4, 2, 1000
    op = _fake_op(W=W, rank=me, layout="nk", max_m=1024)
    op.impl, op.config, op.reduce, op.atomic = impl, R.SM90_RS_DEFAULT, reduce, reduce == "atomic"
    op.module = {n: n for n in R.FAMILY.names}
    op.max_ctas = {"sm90": 132, "sm80": 264, "copy": 132}
    lay = make_layout(W, op.max_m, op.n, "bfloat16", reduce)
    op._data_off, op._flags_off = lay.regions["data"].offset, lay.regions["flags"].offset
    op.flag_stride = lay.regions["flags"].shape[1]
    op._slot_bytes, op._parity_bytes = op.max_m // W * op.n * 2, lay.regions["data"].num_bytes // 2
    op.buf = SimpleNamespace(ptrs_dev=DeviceArray())
    op.err_args = (np.uint64(1 << 40), DeviceArray(), np.uint64(10**9), np.uint32(5))
    op.state = DeviceArray()
    op._static_args()
    arr = DeviceArray()
    arr.data = SimpleNamespace(ptr=1 << 30)
    op._launch_fused(arr, arr, None, arr, M, None)
    op._launch_fused(arr, arr, arr, arr, M, None)
    name, grid, block, args, smem = captured[0]
    kernel = name.split("<")[0]
    assert kernel == f"gemm_rs_{impl}" and ("true>" in name) == (reduce == "atomic")
    for _, _, _, a, _ in captured:
        check_args("gemm_rs.cu", kernel, a)
    names = ["M", "N", "K", "out", "out_f32", "bias", "bases", "data_off", "parity_bytes",
             "slot_bytes", "flags_off", "flag_stride", "rows_per_rank", "world_size", "rank",
             "own_lo", "own_hi", "group_m", "state", "err", "err_claim", "timeout_ns", "op"]
    assert kernel_names("gemm_rs.cu", kernel)[2:] == names
    calls = [dict(zip(names, c[3][2:])) for c in captured]
    bm = G.SM90_CONFIGS[R.SM90_RS_DEFAULT].bm if impl == "sm90" else G.SM80.bm
    t = calls[0]
    assert (int(t["rows_per_rank"]), int(t["world_size"]), int(t["rank"])) == (250, W, me)
    assert (int(t["own_lo"]), int(t["own_hi"])) == own_tile_rows(M, W, me, bm)
    assert int(t["bias"]) == 0 and calls[1]["bias"] is arr
    # the epoch is the device's (op.state), so every call's arguments are the same: data[0]
    # and the distance to data[1], the kernel picking by the epoch's parity
    assert all(c["state"] is op.state for c in calls)
    assert [int(c["data_off"]) for c in calls] == [op._data_off] * 2
    assert all(int(c["parity_bytes"]) == op._parity_bytes for c in calls)
    assert block == ((384,) if impl == "sm90" else (256,)) and grid[0] <= op.max_ctas[impl]
    assert smem == (G.SM90_CONFIGS[R.SM90_RS_DEFAULT].smem_bytes if impl == "sm90"
                    else G.SM80.smem_bytes)
    # the comm-only kernel takes the same tail after (partial, M, N)
    full = (arr, np.int32(M), np.int32(op.n)) + op._tail(arr, None, M, R.COPY_TILE[0])
    check_args("gemm_rs.cu", "rs_tiles", full)
    assert kernel_names("gemm_rs.cu", "rs_tiles")[3:] == names[3:]


# ---- benchmark shapes ---------------------------------------------------------------------------
@pytest.mark.parametrize("W", [1, 2, 3, 4, 6, 8])
def test_bench_cases_are_valid_shapes(W):
    from cuflux.bench import gemm_rs as bench

    full = bench.cases(W, quick=False)
    assert [c[0] for c in full] == [s[0] for s in bench.SHAPES]
    assert {c[0] for c in bench.cases(W, quick=True)} == set(bench.QUICK)
    for name, M, n, K in full:
        k = K // W
        assert M % W == 0 and M >= W and n % 8 == 0 and K % W == 0 and k % 8 == 0 and k > 0, name
    if W in (1, 2, 4, 8):  # the shapes, unchanged
        assert dict((c[0], c[1:]) for c in full)["flux-rs"] == (4096, 12288, 49152)


# ---- route="chunked": what one call queues ------------------------------------------------------
def test_fold_route_and_bounds():
    """fold_route: W = 2 only, every rank's k (the largest) under FOLD_BELOW_K_BYTES in the
    output's bytes, impl "auto", the cublasLt route on; fold_bounds: min(splits, rows) parts
    within a row of each other, covering the rows in order."""
    lim = R.FOLD_BELOW_K_BYTES
    assert R.fold_route(2, [lim // 2 - 8] * 2, 2, "auto", True)
    assert not R.fold_route(2, [lim // 2 - 8, lim // 2], 2, "auto", True)  # the largest k
    assert R.fold_route(2, [lim // 4 - 8] * 2, 4, "auto", True)
    assert not R.fold_route(2, [lim // 4] * 2, 4, "auto", True)  # fp32 partials: half the k
    assert not R.fold_route(4, [8] * 4, 2, "auto", True)
    assert not R.fold_route(2, [8] * 2, 2, "sm90", True)
    assert not R.fold_route(2, [8] * 2, 2, "auto", False)
    big = [lim] * 2  # the caller's choice over k's
    assert R.fold_route(2, big, 2, "auto", True, fold=True)
    assert not R.fold_route(2, [8] * 2, 2, "auto", True, fold=False)
    for args in ((4, [8] * 4, 2, "auto", True), (2, [8] * 2, 2, "sm90", True),
                 (2, [8] * 2, 2, "auto", False)):
        assert not R.fold_route(*args, fold=False)
        with pytest.raises(ValueError, match="fold=True needs W = 2"):
            R.fold_route(*args, fold=True)
    assert R.fold_bounds(1, 2) == [(0, 1)]
    assert R.fold_bounds(5, 2) == [(0, 2), (2, 5)]
    assert R.fold_bounds(6, 1) == [(0, 6)]
    for rows in range(1, 40):
        for splits in (1, 2, 3):
            b = R.fold_bounds(rows, splits)
            assert b[0][0] == 0 and b[-1][1] == rows and len(b) == min(splits, rows)
            assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
            assert max(r1 - r0 for r0, r1 in b) - min(r1 - r0 for r0, r1 in b) <= 1


def _recording_chunked(monkeypatch, W, me, n, fold=False, lt_ok=True, out_dtype="bfloat16"):
    """A ChunkedRs on recording fakes (nothing runs): the log of what run() queues, and the
    kernel arguments rs_sum got."""
    import cupy

    log, launched = [], []
    row_bytes = n * 2 if out_dtype == "bfloat16" else n * 4

    class Lane:
        def __init__(self, i):
            self.i, self.ptr = i, 100 + i

        def wait_event(self, ev):
            log.append(("lane wait event", self.i, ev.key))

    class Ev:
        def __init__(self, key):
            self.key = key

        def record(self, s):
            log.append(("record", self.key))

    class Rows:  # a row slice: its first row's index stands for its pointer
        def __init__(self, name, r0=0, r1=None):
            self.name, self.r0, self.r1 = name, r0, r1
            self.data = SimpleNamespace(ptr=(name, r0))
            self.shape = (None, 72)

        def __getitem__(self, sl):
            return Rows(self.name, self.r0 + sl.start,
                        None if sl.stop is None else self.r0 + sl.stop)

        def reshape(self, *shape):
            return self

    op = object.__new__(R.ChunkedRs)
    op.world = SimpleNamespace(size=W, rank=me)
    op.fold, op.splits = fold, R.FOLD_SPLITS if fold else 1
    op.n, op.row_bytes, op.max_chunks, op.epoch, op._last_stream = n, row_bytes, op.splits, 0, None
    op.mode = "push"
    op.in_dtype, op.out_dtype = dtype_info("bfloat16"), dtype_info(out_dtype)
    op.order = [[(me + i) % W] for i in range(1, W)]  # one peer a stage
    op.lanes = [Lane(0)]
    op.peers = [st[0] for st in op.order]
    op.lane_of = {p: op.lanes[0] for p in op.peers}
    op.ready = {(p, c): Ev((p, c)) for p in op.peers for c in range(op.splits)}
    op.staging = Rows("staging")
    op.data = Rows("data")
    op.module = {R.sum_kernel("__nv_bfloat16", "__nv_bfloat16"): "rs_sum"}
    op.sum_name, op.sum_blocks = R.sum_kernel("__nv_bfloat16", "__nv_bfloat16"), 1056
    op.buf = SimpleNamespace(ptr=lambda rank, name, off=0: (rank, name, off))
    op._next_epoch = lambda s: setattr(op, "epoch", op.epoch + 1) or op.epoch
    op._guard = lambda lane, name, e, p: log.append(("guard", name, e, p))
    op._wait = lambda s, name, e, first, index0: log.append(("wait", name, e, first, index0))
    op._join_guarded = lambda s, lanes: log.append(("join", len(lanes)))
    op._flag = lambda rank, name, i=0: (rank, name, i)
    op._chunk_flag = lambda rank, src, c: (rank, "chunk", src, c)
    monkeypatch.setattr(R, "gemm", lambda a, b, out, b_layout, impl, stream: log.append(
        ("gemm", a.r0, a.r1, out.name, out.r0, b_layout, impl)))

    def lt(a, b, bias, out, dt, odt, M, N, K, b_layout, stream, addend=None, tune=True):
        log.append(("cublaslt", a.r0, a.r1, out.name, out.r0, M, N, K, addend.name, addend.r0,
                    bias))
        assert (dt.name, odt.name, b_layout, stream) == ("bfloat16", out_dtype, "nk", "S")
        assert not tune  # tuned by prepare_cublaslt, before any wait
        return lt_ok

    def prepare(a, b, bias, out, dt, odt, M, N, K, b_layout, stream, addend=None):
        log.append(("prepare", a.r0, a.r1, out.name, out.r0, M, N, K, addend.name, addend.r0,
                    bias))
        return True

    monkeypatch.setattr(R.core, "launch_cublaslt", lt)
    monkeypatch.setattr(R.core, "prepare_cublaslt", prepare)
    monkeypatch.setattr(cupy.cuda.runtime, "memcpyAsync", lambda dst, src, nb, kind, sptr:
                        log.append(("copy", dst, src, nb, sptr)))
    monkeypatch.setattr(R.driver, "stream_write_value32", lambda st, addr, v: log.append(
        ("write", "s" if st == "S" else st.i, addr, v)))
    monkeypatch.setattr(R.kernels, "launch", lambda fn, grid, block, args, stream, **kw:
                        launched.append(args) or log.append(("launch", kw["name"], grid)))
    return op, log, launched, Rows


def _check_sum_args(args, data_r0, rows, R_rows, W, n, bias_arg, out):
    assert args[0].name == "data" and args[0].r0 == data_r0 * n  # stands for the data pointer
    check_args("gemm_rs.cu", "rs_sum", (DeviceArray(),) + args[1:6] + (DeviceArray(),))
    assert (int(args[1]), int(args[2]), int(args[3]), int(args[4])) == (rows * n, R_rows * n, W,
                                                                         n)
    assert (args[5] is bias_arg) if bias_arg is not None else int(args[5]) == 0
    assert args[6] is out


@pytest.mark.parametrize("W,me,bias", [(2, 0, False), (4, 2, True), (3, 1, True)])
def test_chunked_call_queues_the_protocol_in_order(monkeypatch, W, me, bias):
    """ChunkedRs.run on recording fakes (impl "auto": every GEMM cuflux.gemm(impl="cublas")):
    the peer chunks' GEMMs in the copy order, each followed
    by its lane's event wait, guard (from the second call), copy to the owner's data at me * R
    rows and chunk flag; the own chunk's GEMM into this rank's data last; then the waits for
    every peer's chunk (the own one is ordered by the stream), rs_sum (arguments against its C
    signature), free[me] to every peer, the lanes joined."""
    n, rows = 64, 5
    op, log, launched, Rows = _recording_chunked(monkeypatch, W, me, n)
    row_bytes, M = op.row_bytes, rows * W
    bias_arg = DeviceArray() if bias else None
    out = DeviceArray()
    for call in (1, 2):
        log.clear()
        launched.clear()
        op.run(Rows("a"), "b", bias_arg, out, M, "S", "nk", "auto")
        want = []
        for j, p in enumerate(op.peers):
            want += [("gemm", p * rows, (p + 1) * rows, "staging", j * rows, "nk", "cublas"),
                     ("record", (p, 0)), ("lane wait event", 0, (p, 0))]
            if call > 1:
                want.append(("guard", "free", call - 1, p))
            want += [("copy", (p, "data", me * rows * row_bytes), ("staging", j * rows),
                      rows * row_bytes, 100),
                     ("write", 0, (p, "chunk", me, 0), call)]
        want += [("gemm", me * rows, (me + 1) * rows, "data", me * rows * n, "nk", "cublas")]
        want += [("wait", "chunk", call, p, p) for p in op.peers]  # max_chunks = 1
        want += [("launch", op.sum_name, (1,))]
        want += [("write", "s", (p, "free", me), call) for p in range(W) if p != me]
        want += [("join", 1)]
        assert log == want
        (args,) = launched
        _check_sum_args(args, 0, rows, rows, W, n, bias_arg, out)


@pytest.mark.parametrize("rows,bias,lt_ok,out_dtype", [
    (5, False, True, "bfloat16"), (4, True, True, "bfloat16"), (1, True, True, "bfloat16"),
    (5, True, False, "bfloat16"), (5, True, True, "float32"), (5, False, True, "float32")])
def test_folded_call_queues_parts_and_adds_them_in_the_own_gemm(monkeypatch, rows, bias, lt_ok,
                                                               out_dtype):
    """W = 2 folding: the peer's chunk in min(FOLD_SPLITS, R) row parts (fold_bounds), each
    part's GEMM into its staging rows, event, guard before the first part only (from the
    second call), copy to the peer's data at me * R + r0 rows and chunk[me][c]; then for each
    part: the wait for the peer's part c, the own part's GEMM by cublasLt into out[r0:r1] with
    the received part (our data at p * R + r0 rows) as its addend and the bias; where cublasLt
    has no algorithm (False) that part's cuflux.gemm into our data and rs_sum of its rows (slot
    stride R * n); an fp32 output with a bias does not fold (the own chunk's GEMM, the waits
    for every part, one rs_sum); then free[me] and the join."""
    W, me, n = 2, 1, 64
    p = 0
    op, log, launched, Rows = _recording_chunked(monkeypatch, W, me, n, fold=True, lt_ok=lt_ok,
                                                 out_dtype=out_dtype)
    row_bytes, M = op.row_bytes, rows * W
    parts = R.fold_bounds(rows, R.FOLD_SPLITS)
    assert len(parts) == min(2, rows)
    bias_arg = DeviceArray() if bias else None
    out = Rows("out")
    folds = not (bias and out_dtype == "float32")
    for call in (1, 2):
        log.clear()
        launched.clear()
        op.run(Rows("a"), "b", bias_arg, out, M, "S", "nk", "auto")
        want = []
        if folds:  # the own parts' plans tuned first, on the parts' own pointers
            want += [("prepare", me * rows + r0, me * rows + r1, "out", r0, r1 - r0, n, 72,
                      "data", (p * rows + r0) * n, bias_arg) for r0, r1 in parts]
        for c, (r0, r1) in enumerate(parts):
            want += [("gemm", p * rows + r0, p * rows + r1, "staging", r0, "nk", "cublas"),
                     ("record", (p, c)), ("lane wait event", 0, (p, c))]
            if call > 1 and c == 0:
                want.append(("guard", "free", call - 1, p))
            want += [("copy", (p, "data", (me * rows + r0) * row_bytes), ("staging", r0),
                      (r1 - r0) * row_bytes, 100),
                     ("write", 0, (p, "chunk", me, c), call)]
        sums = []
        if folds:
            for c, (r0, r1) in enumerate(parts):
                want += [("wait", "chunk", call, p, p * op.max_chunks + c),
                         ("cublaslt", me * rows + r0, me * rows + r1, "out", r0, r1 - r0, n,
                          72, "data", (p * rows + r0) * n, bias_arg)]
                if not lt_ok:
                    want += [("gemm", me * rows + r0, me * rows + r1, "data",
                              (me * rows + r0) * n, "nk", "cublas"),
                             ("launch", op.sum_name, (1,))]
                    sums.append((r0, r1 - r0))
        else:
            want += [("gemm", me * rows, (me + 1) * rows, "data", me * rows * n, "nk", "cublas")]
            want += [("wait", "chunk", call, p, p * op.max_chunks + c) for c in range(len(parts))]
            want += [("launch", op.sum_name, (1,))]
            sums.append((0, rows))
        want += [("write", "s", (p, "free", me), call), ("join", 1)]
        assert log == want
        assert len(launched) == len(sums)
        for args, (r0, nrows) in zip(launched, sums):
            _check_sum_args(args, r0, nrows, rows, W, n, bias_arg, args[6])
            assert args[6] is out if not folds else (args[6].name, args[6].r0) == ("out", r0)
