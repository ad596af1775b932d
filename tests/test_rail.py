"""Rail communicators (cuflux/rail.py): collectives across rank i of every node (issue 20).

CPU: HostRail on real MPI ranks over NumPy arrays (the same code stages CuPy arrays through the
host), the bfloat16 conversions exhaustively, bad calls refused before any collective. GPU
(marked gpu): HostRail on CuPy arrays with ranks sharing the GPU, and NcclRail on a rail of one
rank (NCCL refuses two ranks on one GPU; two GPUs run it at W = 2 in `gpu.sh multi-tests`).
"""
import contextlib

import numpy as np
import pytest

from cuflux.arrays import dtype_info
from cuflux.rail import from_float, to_float
from tests.checks import poisoned, rail_kind_as_expected
from tests.mpi import on_ranks, world_sizes

WS = world_sizes()
DTYPES = ("float32", "float16", "bfloat16")
# Unit roundoff of each dtype: a rail sum of n parts may round at each of its n steps (NCCL
# rounds partial sums to the dtype), so an element may be off by n * u * sum(|parts|).
UNIT = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def check_sum(got, parts, what):
    """got (float64 values of a rail sum) within the rounding bound of the exact sum."""
    exact = np.sum(parts, axis=0)
    bound = len(parts) * UNIT[what[0]] * np.sum(np.abs(parts), axis=0)
    worst = np.abs(got - exact) - bound
    assert (worst <= 0).all(), f"{what}: element {int(worst.argmax())} off by more than the bound"


def _values(rng, n, dtype):
    """Random values exactly representable in dtype (its storage), and the same in float64."""
    x = from_float(rng.standard_normal(n).astype(np.float32), dtype)
    x = x.view(dtype_info(dtype).storage)  # bfloat16: its bits as cuflux's storage dtype
    return x, to_float(x, dtype).astype(np.float64)


@contextlib.contextmanager
def _rail(comm, node_size=None, kind="host", gpu=False):
    """A World on `comm` split into nodes, and its rail (make_rail's kind); closed after."""
    import cuflux
    from cuflux.rail import make_rail

    w = cuflux.World(comm, timeout_s=30, node_size=node_size)
    node, group = w.split_nodes()
    rail = make_rail(group, w.device if gpu else None, 30.0, kind=kind)
    try:
        yield w, group, rail
    finally:
        rail.close()
        group.free()
        node.close()
        w.close()


@on_ranks
def rail_collectives(world, seed, node_size=1, xp="numpy", kind="host"):
    """Every collective of a rail (make_rail's kind) over this World's rails, each dtype,
    against float64: sums within a rounding of the exact sum, gathers exact, a reduce-scatter
    this rank's part of the same sum."""
    from mpi4py import MPI

    if xp == "cupy":
        import cupy as xp
    else:
        xp = np
    with _rail(MPI.COMM_WORLD, node_size, kind, gpu=xp is not np) as (w, group, rail):
        if kind == "auto" and xp is not np:
            rail_kind_as_expected(w, rail)
        return _every_collective(w, group, rail, xp, seed)



def _every_collective(w, group, rail, xp, seed) -> int:
    n, me = rail.size, rail.rank
    rng = np.random.default_rng((seed, w.rank))
    checked = 0
    for dtype in DTYPES:
        for count in (1, 7 * n, 4096 * n):
            x, x64 = _values(rng, count, dtype)
            every = np.stack(group.allgather(x64, what="inputs"))
            what = (dtype, count, f"seed {seed}")
            out = poisoned((count,), dtype, xp=xp)
            rail.all_reduce(xp.asarray(x), out)
            rail.wait()
            got = to_float(np.asarray(out.get() if xp is not np else out), dtype)
            check_sum(got, every, what)
            gathered = xp.zeros(count * n, dtype=x.dtype)
            rail.all_gather(xp.asarray(x), gathered)
            rail.wait()
            g = np.asarray(gathered.get() if xp is not np else gathered)
            assert np.array_equal(g, np.concatenate(group.allgather(x, what="mine"))), dtype
            part = poisoned((count // n,), dtype, xp=xp)
            if count % n == 0:
                rail.reduce_scatter(xp.asarray(x), part)
                rail.wait()
                p = to_float(np.asarray(part.get() if xp is not np else part), dtype)
                lo, hi = me * (count // n), (me + 1) * (count // n)
                check_sum(p, every[:, lo:hi], what)
            _check_all_to_all(rail, xp, x.dtype, count, seed)
            checked += 1
    return checked


def _check_all_to_all(rail, xp, dtype, count, seed) -> None:
    """Blocks of uneven sizes (some empty) between every pair of rail ranks land exactly; this
    rank's own receive block is not touched (the caller places its own)."""
    n, me = rail.size, rail.rank

    def block(src, dst):  # the same on sender and receiver
        size = count * ((src + 2 * dst) % 3) // 2
        bits = np.random.default_rng((seed, src, dst, count)).integers(0, 255, size * 8)
        return bits.astype(np.uint8).view(dtype)[:size]

    sends = [xp.asarray(block(me, j)) for j in range(n)]
    recvs = [poisoned((block(j, me).size,), dtype, xp=xp) for j in range(n)]
    own = np.asarray(recvs[me].get() if xp is not np else recvs[me]).copy()
    rail.all_to_all(sends, recvs)
    rail.wait()
    for j in range(n):
        got = np.asarray(recvs[j].get() if xp is not np else recvs[j])
        want = own if j == me else block(j, me)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), ("all_to_all", j, count)


@pytest.mark.parametrize("W,node_size", [(2, 1), (3, 1), (4, 2)])
def test_host_rail_sums_and_gathers_across_the_rail(W, node_size):
    import secrets

    res = rail_collectives.run(W, timeout_s=180, seed=secrets.randbelow(1 << 30),
                                    node_size=node_size)
    assert res == [9] * W


def test_bfloat16_round_trips_every_finite_value_and_rounds_to_nearest_even():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = to_float(bits, "bfloat16")
    finite = np.isfinite(values)
    assert np.array_equal(from_float(values[finite], "bfloat16"), bits[finite])
    assert np.isnan(to_float(from_float(np.array([np.nan], np.float32), "bfloat16"),
                             "bfloat16")).all()
    # halfway between 1.0 (0x3F80) and the next bfloat16 (0x3F81): even wins; just above: up
    half = np.array([0x3F808000, 0x3F808001, 0x3F818000], np.uint32).view(np.float32)
    assert from_float(half, "bfloat16").tolist() == [0x3F80, 0x3F81, 0x3F82]


def test_bad_calls_are_refused_before_any_collective():
    from cuflux.rail import HostRail

    class NoCollective:
        rank, size = 0, 2

        def allgather(self, *a, **k):
            raise AssertionError("a collective ran for a bad call")

    rail = HostRail(NoCollective(), 5.0)
    f32, f16 = np.zeros(8, np.float32), np.zeros(8, np.float16)
    cases = [
        (lambda: rail.all_reduce(f32, f16), TypeError, "out is float16, x is float32"),
        (lambda: rail.all_reduce(f32, np.zeros(4, np.float32)), ValueError, "hold 8 elements"),
        (lambda: rail.all_reduce(np.zeros(8, np.int32), np.zeros(8, np.int32)), TypeError,
         "sums float32"),
        (lambda: rail.all_gather(f32, np.zeros(8, np.float32)), ValueError, "hold 16"),
        (lambda: rail.reduce_scatter(np.zeros(7, np.float32), np.zeros(3, np.float32)),
         ValueError, "not a multiple"),
        (lambda: rail.all_reduce(np.zeros((4, 4), np.float32)[:, :2],
                                 np.zeros(8, np.float32)), ValueError, "C-contiguous"),
        (lambda: rail.all_to_all([f32], [f32]), ValueError, "one send and one receive block"),
        (lambda: rail.all_to_all([f32, np.zeros((4, 4), np.float32)[:, :2]], [f32, f32]),
         ValueError, r"sends\[1\] must be C-contiguous"),
    ]
    for call, exc, text in cases:
        with pytest.raises(exc, match=text):
            call()


def test_make_rail_refuses_an_unknown_kind():
    from cuflux.rail import make_rail

    with pytest.raises(ValueError, match="kind must be"):
        make_rail(object(), None, 1.0, kind="mpi")


class _Comm:
    """A stand-in NCCL communicator that logs how it ends."""

    def __init__(self, log):
        self.log = log

    def destroy(self):
        self.log.append("destroy")

    def abort(self):
        self.log.append("abort")


def _nccl_rail_closing(log, allgather):
    """An NcclRail past its set-up (its work done: wait() returns), on a stand-in group."""
    from types import SimpleNamespace

    from cuflux.rail import NcclRail

    rail = NcclRail.__new__(NcclRail)
    rail.group, rail.timeout_s, rail._failed = SimpleNamespace(allgather=allgather), 5.0, None
    rail.comm = _Comm(log)
    rail.wait = lambda stream=None, what="rail": log.append("wait")
    return rail


def test_nccl_rail_close_destroys_only_once_every_rail_rank_is_closing():
    """NCCL's destroy waits, with no deadline, for the other ranks on the host to destroy
    theirs: the rail ranks agree (bounded) first, and destroy only then."""
    log = []
    rail = _nccl_rail_closing(log, lambda obj, t, what: log.append(what) or [True, True])
    rail.close()
    assert log == ["wait", "rail close", "destroy"] and rail.comm is None
    rail.close()  # idempotent
    assert log == ["wait", "rail close", "destroy"]


def test_nccl_rail_close_aborts_where_a_rail_rank_never_comes():
    from cuflux.errors import CommTimeoutError

    log = []

    def allgather(obj, timeout_s, what):
        raise CommTimeoutError(what, 0, 1, timeout_s)

    rail = _nccl_rail_closing(log, allgather)
    with pytest.warns(RuntimeWarning, match="not every rail rank came .* aborted"):
        rail.close()  # no raise: the op's close goes on freeing the rest
    assert log == ["wait", "abort"] and rail.comm is None


def test_nccl_set_up_failures_say_what_failed_and_whom_a_timeout_waited_for():
    from cuflux.errors import CommTimeoutError, CufluxError
    from cuflux.rail import _setup_failed

    refused = _setup_failed([True, False], RuntimeError("NCCL_ERROR_SYSTEM_ERROR"), 1, 30.0)
    assert type(refused) is CufluxError and "NCCL_ERROR_SYSTEM_ERROR" in str(refused)
    assert "failed on rail rank 1" in str(refused) and "timed out" not in str(refused)
    peer_late = _setup_failed([True, False, True], object(), 0, 30.0)  # got its communicator
    assert isinstance(peer_late, CommTimeoutError) and (peer_late.rank, peer_late.peer) == (0, 1)
    alone = _setup_failed([True, True, False], None, 2, 30.0)  # its own set-up timed out
    assert isinstance(alone, CommTimeoutError) and (alone.rank, alone.peer) == (2, 0)
    assert "rail ranks [2] got no NCCL communicator" in str(alone)


# ---- GPU ----------------------------------------------------------------------------------------
# kind "auto": HostRail where ranks share a GPU, NcclRail on distinct GPUs (gpu.sh multi-tests)
test_rail_on_gpu_arrays = rail_collectives.test(
    expect=9, sizes=[w for w in WS if w > 1], timeout_s=300, seed=7, xp="cupy", kind="auto")


@on_ranks
def nccl_rail_of_one(world):
    """NcclRail on a rail of one rank (each rank its own node): every collective is a copy of x
    into a poisoned output, each checked; then the rail closes (destroy after a bounded wait)."""
    import cupy
    from mpi4py import MPI

    checked = 0
    with _rail(MPI.COMM_SELF, kind="nccl", gpu=True) as (w, group, rail), \
            cupy.cuda.Device(w.device):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:  # inputs, poison and NCCL's work in one stream's order
            x = cupy.arange(1024, dtype=cupy.float32)
            for call in (rail.all_reduce, rail.all_gather, rail.reduce_scatter):
                out = cupy.full(1024, np.nan, cupy.float32)
                call(x, out, s)
                rail.wait(s, "NcclRail test")
                assert bool((out == x).all()), call.__name__
                checked += 1
            out = cupy.full(1024, np.nan, cupy.float32)
            rail.all_to_all([x], [out], s)  # one rank: its own pair is not moved (a NCCL group)
            rail.wait(s, "NcclRail test")
            assert bool(cupy.isnan(out).all()), "all_to_all moved this rank's own block"
            checked += 1
    return checked


test_nccl_rail_of_one_rank = nccl_rail_of_one.test(expect=4, sizes=[1], timeout_s=120)
