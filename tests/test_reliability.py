"""Issue 19's reliability work: bounded host collectives (a late or absent rank is named within
the timeout), agreement on symmetric set-up, op communicators built or closed in different
orders, the GPU choice, what device_count's failures mean, the environment on import, the
stream-wait watchdog's CPU release and its failure path, and SymmetricBuffer.close(abort=True).

Every multi-rank test runs the rank body just above it (decorated @on_ranks) on W ranks.
GPU tests (marked gpu; skipped with "no CUDA device" where there is none): the World's GPU
choice on a sub-communicator and the caller's current device, close(abort=True) with a peer
gone, stream waits on host-mapped symmetric flags, and the watchdog's CPU release with
CUDA_DEVICE_MAX_CONNECTIONS=1. CPU tests (no GPU needed, never skipped): test doubles for
memory, events, streams and groups, and rank bodies that never touch CUDA.
"""
import ctypes
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import cuflux
from cuflux import errors as E
from cuflux import symmetric, watchdog
from cuflux import world as world_mod
from cuflux.errors import CommTimeoutError, CufluxError
from tests.fakes import FakeErrorRecord
from tests.mpi import ROOT, on_ranks, world_sizes

WS = world_sizes()
GPU_SLACK_S = 2.0  # slack on the GPU tests' timings
SLACK_S = 1.5  # scheduling slack on a loaded 2-core machine (ranks share the cores)


def _short(world, timeout_s):
    """A World on the same ranks with a short bound (collective)."""
    return cuflux.World(world.comm, timeout_s=timeout_s)


def _outcome(fn):
    """(exception class name, message, seconds it took) of fn(), or ("ok", result, seconds)."""
    t0 = time.monotonic()
    try:
        result = fn()
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "peer": getattr(e, "peer", None), "first": getattr(e, "first", None)}
    return {"error": None, "result": result, "seconds": time.monotonic() - t0}


# ==== GPU tests: each rank body, then its test ====================================================
@on_ranks
def gpu_subcomm_device(world):
    """A World on a sub-communicator picks the GPU a World on COMM_WORLD picks, and neither
    moves the caller's current device."""
    import cupy
    from mpi4py import MPI

    n = cupy.cuda.runtime.getDeviceCount()
    before = cupy.cuda.runtime.getDevice()
    other = (world.device + 1) % n  # the caller's choice, different from ours where possible
    cupy.cuda.runtime.setDevice(other)
    full = cuflux.World(MPI.COMM_WORLD)
    assert cupy.cuda.runtime.getDevice() == other, "World moved the current device"
    sub = cuflux.World(MPI.COMM_WORLD.Split(world.rank % 2, world.rank))
    assert cupy.cuda.runtime.getDevice() == other, "World(sub) moved the current device"
    assert sub.device == full.device, (sub.device, full.device)
    explicit = cuflux.World(MPI.COMM_WORLD, device=n - 1)
    assert explicit.device == n - 1 and cupy.cuda.runtime.getDevice() == other
    buf = full.alloc_symmetric((16,), np.uint32)
    assert cupy.cuda.runtime.getDevice() == other, "SymmetricBuffer moved the current device"
    assert buf.local().device.id == full.device
    buf.close()
    assert cupy.cuda.runtime.getDevice() == other
    cupy.cuda.runtime.setDevice(before)
    return {"device": full.device, "devices": n}


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_sub_communicator_world_picks_the_same_gpu_and_leaves_the_current_device(W):
    res = gpu_subcomm_device.run(W)
    n = res[0]["devices"]
    assert [r["device"] for r in res] == [r % n for r in range(W)]  # one host: rank = local


@on_ranks
def gpu_abort_close(world, bound_s=2.0):
    """The last rank is gone (never closes): a normal close raises CommTimeoutError within the
    timeout; close(abort=True) returns at once and keeps (leaks) the local allocation."""
    import cupy

    w = _short(world, bound_s)
    a = w.alloc_symmetric((1024,), np.float32)
    b = w.alloc_symmetric((1024,), np.float32)
    w.barrier()
    gone = w.size - 1
    if w.rank == gone:
        return {"gone": True}
    t0 = time.monotonic()
    b.close(abort=True, streams=[cupy.cuda.get_current_stream()])
    abort_s = time.monotonic() - t0
    before = symmetric.leaked_bytes()
    out = _outcome(a.close)
    return {"abort_s": abort_s, "close": out, "leaked": symmetric.leaked_bytes() - before}


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_abort_close_returns_at_once_with_a_peer_gone(W):
    res = gpu_abort_close.run(W, bound_s=2.0)
    assert res[-1]["gone"]
    for out in res[:-1]:
        assert out["abort_s"] < 0.5, out
        close = out["close"]
        assert close["error"] == "CommTimeoutError" and close["peer"] == W - 1, out
        assert 2.0 <= close["seconds"] < 2.0 + GPU_SLACK_S, out
        assert out["leaked"] > 0  # the local allocation is kept, not freed under a peer


@on_ranks
def gpu_host_flags(world, bound_s=1.0):
    """Stream waits on host-mapped symmetric flags: rank p signals every peer with
    cuStreamWriteValue32 into their host memory and the waits pass; then a flag nobody writes
    times out and the watchdog releases it with a CPU store."""
    import cupy

    from cuflux import driver
    from cuflux.errors import OP_CODES, ErrorRecord
    from cuflux.symmetric import Layout
    from cuflux.watchdog import StreamWaiter

    W, me = world.size, world.rank
    layout = Layout()
    layout.add("flags", (W,), np.uint32)
    layout.add("never", (1,), np.uint32)
    with world.device_context():
        pad = world.alloc_layout(layout, memory="host")
        err = ErrorRecord("test", me, bound_s)
        waiter = StreamWaiter(err, world.device, OP_CODES["test"])
        s = cupy.cuda.Stream(non_blocking=True)
        for p in range(W):
            if p != me:
                driver.stream_write_value32(s, pad.ptr(p, "flags", 4 * me), 7)
        for p in range(W):
            if p != me:
                waiter.wait(s, pad.ptr(me, "flags", 4 * p), 7, peer=p, index=p)
        s.synchronize()
        err.check()
        seen = [int(x) for x in pad.host_view("flags")]
        world.barrier()
        t0 = time.monotonic()
        waiter.wait(s, pad.ptr(me, "never"), 1, peer=(me + 1) % W, index=99)
        s.synchronize()  # released by the CPU after bound_s
        released_s = time.monotonic() - t0
        out = _outcome(err.check)
        waiter.close()
        world.barrier()
        pad.close()
        err.close()
    return {"seen": seen, "released_s": released_s, "check": out}


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_stream_waits_on_host_mapped_flags(W):
    res = gpu_host_flags.run(W, bound_s=1.0)
    for me, out in enumerate(res):
        assert out["seen"] == [0 if p == me else 7 for p in range(W)], out
        assert 1.0 <= out["released_s"] < 1.0 + GPU_SLACK_S, out
        assert out["check"]["error"] == "CommTimeoutError", out


@on_ranks
def gpu_watchdog_one_connection(world, bound_s=1.0):
    """Run with CUDA_DEVICE_MAX_CONNECTIONS=1 (set before CUDA starts): a stream blocked in
    cuStreamWaitValue32 on a host-mapped flag shares the one hardware queue with everything
    else, the release included; the CPU release still frees it, and the work queued behind it
    on another stream then runs."""
    import warnings

    import cupy

    from cuflux.errors import OP_CODES, ErrorRecord
    from cuflux.symmetric import Layout
    from cuflux.watchdog import StreamWaiter

    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    layout = Layout()
    layout.add("flag", (1,), np.uint32)
    with world.device_context():
        pad = world.alloc_layout(layout, memory="host")
        err = ErrorRecord("test", world.rank, bound_s)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            waiter = StreamWaiter(err, world.device, OP_CODES["test"])
        s = cupy.cuda.Stream(non_blocking=True)
        t = cupy.cuda.Stream(non_blocking=True)
        t0 = time.monotonic()
        waiter.wait(s, pad.ptr(world.rank, "flag"), 1, peer=world.rank, index=0)
        with t:
            x = cupy.arange(1 << 20, dtype=cupy.float32) * 2  # queued behind the wait
        t.synchronize()
        s.synchronize()
        elapsed = time.monotonic() - t0
        ok = bool(float(x[-1].get()) == 2.0 * ((1 << 20) - 1))
        out = _outcome(err.check)
        waiter.close()
        world.barrier()
        pad.close()
        err.close()
    return {"elapsed": elapsed, "ok": ok, "check": out,
            "warned": any("CUDA_DEVICE_MAX_CONNECTIONS=1" in str(w.message) for w in caught)}


@pytest.mark.gpu
def test_watchdog_releases_by_cpu_with_one_hardware_queue(monkeypatch):
    # A fresh process: the variable must be set before CUDA starts.
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("CUFLUX_TEST_POOL", "0")
    (out,) = gpu_watchdog_one_connection.run(1, timeout_s=120, bound_s=1.0)
    assert out["ok"], out  # the work queued behind the blocked wait ran, and ran right
    assert 1.0 <= out["elapsed"] < 1.0 + GPU_SLACK_S, out
    assert out["check"]["error"] == "CommTimeoutError", out
    assert out["warned"], out


# ---- the failure board (#19 item 1) -------------------------------------------------------------
def _told_op(world, kind, bound_s):
    """(op, call) of a small op of `kind` whose call makes every rank wait for every other:
    _queued_case's op and its first call (AllGather in push mode)."""
    op, call, _, _ = _queued_case(world, "allgather_push" if kind == "allgather" else kind,
                                  bound_s)
    return op, lambda: call(0, None, None)


def _queued_case(world, kind, bound_s):
    """(op, call(i, out, stream), out shape and dtype, want(i) on rank 1) of a small op of
    `kind` whose call i on rank r has inputs that depend on (r, i), so that rank 1's output of
    one call tells which call of rank 0 it met. Small integers: every sum is exact."""
    import cupy

    W = world.size
    v = [[1 + r + 2 * i for i in range(4)] for r in range(W)]  # rank r's value in call i
    me = world.rank
    if kind == "allreduce":  # one-shot: its only barrier is START (two-shot adds MID)
        n = 1 << 14
        op = cuflux.AllReduce(world, n, "float32", timeout_s=bound_s)
        xs = [cupy.full(n, v[me][i], cupy.float32) for i in range(4)]
        return (op, lambda i, out, s: op(xs[i], out=out, stream=s, algo="one_shot"),
                ((n,), cupy.float32), lambda i: np.full(n, sum(v[r][i] for r in range(W))))
    if kind == "all2all":
        op = cuflux.All2AllHeads(world, 16, 2 * W, 64, "float16", timeout_s=bound_s)
        xs = [cupy.full((1, 16, 2 * W, 64), v[me][i], cupy.float16) for i in range(4)]

        def want(i):  # rank 1's heads of every rank's 16 tokens, rank order
            return np.concatenate([np.full((1, 16, 2, 64), v[r][i], np.float16)
                                   for r in range(W)], axis=1)
        return (op, lambda i, out, s: op.scatter_heads(xs[i], [16] * W, out=out, stream=s),
                ((1, 16 * W, 2, 64), cupy.float16), want)
    if kind.startswith("allgather_"):  # copy engines behind guards (CopyGather)
        rows, cols = 16, 128
        op = cuflux.AllGather(world, rows, cols, "float32", mode=kind.split("_")[1],
                              timeout_s=bound_s)
        xs = [cupy.full((rows, cols), v[me][i], cupy.float32) for i in range(4)]
        return (op, lambda i, out, s: op(xs[i], out=out, stream=s),
                ((W * rows, cols), cupy.float32),
                lambda i: np.concatenate([np.full((rows, cols), v[r][i], np.float32)
                                          for r in range(W)]))
    M = 256 * W  # gemm_rs, the fused kernel: C_r = 64 * v (a = v, b = ones, k = 64)
    op = cuflux.GemmReduceScatter(world, M, 256, 64, "float16", timeout_s=bound_s,
                                  route="fused")
    a = [cupy.full((M, 64), v[me][i], cupy.float16) for i in range(4)]
    b = cupy.ones((64, 256), cupy.float16)
    return (op, lambda i, out, s: op(a[i], b, out=out, stream=s), ((256, 256), cupy.float16),
            lambda i: np.full((256, 256), 64 * sum(v[r][i] for r in range(W)), np.float16))


@on_ranks
def queued_behind_a_failure(world, kind, bound_s=1.0):
    """#19 item 1, calls already queued when a wait gives up. Rank 1's GPU is held past the
    timeout with its call 1 queued behind the hold; rank 0 queues calls 1, 2 and 3 at once.
    Rank 0's wait in call 1 times out; its calls 2 and 3 must store nothing shared or remote:
    call 3 would land in the very buffer (same parity as call 1) that rank 1's call 1 has yet
    to read. Rank 1's call 1 then meets rank 0's call 1 and must come out exact, although
    its host is told of the failure (its synchronize raises). AllGather (copy engines): rank
    0's call 2 copies into rank 1's gathered rows (push) or its own staged shard that rank 1
    reads (pull) behind a guard, which the timeout must not release while rank 1 is alive."""
    import cupy

    from cuflux.bench.common import hold_stream

    me = world.rank
    with world.device_context():
        op, call, (shape, dtype), want = _queued_case(world, kind, bound_s)
        s = cupy.cuda.Stream(non_blocking=True)
        outs = [cupy.full(shape, -7, dtype) for _ in range(4)]
        hold_stream(s, 0)  # its kernel compiled and loaded before the race
        cupy.cuda.Device().synchronize()  # inputs and outputs filled on the default stream

        def issue(*calls):  # (returns None: an outcome must be JSON)
            for i in calls:
                call(i, outs[i], s)

        def warm_up():  # arguments agreed, kernels loaded, on every rank
            issue(0)
            op.synchronize(s)

        warm = _outcome(warm_up)
        world.barrier()
        if me == 1:
            hold_us = (bound_s + 2.0) * 1e6
            hold_stream(s, hold_us, max_us=hold_us)
            issued = _outcome(lambda: issue(1))
            s.synchronize()  # the hold, then call 1 (its waits find rank 0's call-1 flags)
            got = cupy.asnumpy(outs[1])
            exact = bool(np.array_equal(got, want(1)))
            seen = sorted(set(np.unique(got).tolist()))[:6]
        else:
            issued = _outcome(lambda: issue(1, 2, 3))
            exact, seen = None, None
        synced = _outcome(lambda: op.synchronize(s))
        op.abort()
    world.barrier()
    return {"warm": warm, "issued": issued, "exact": exact, "seen": seen, "synced": synced}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["allreduce", "all2all", "gemm_rs", "allgather_push",
                                  "allgather_pull"])
def test_calls_queued_behind_a_failed_wait_store_nothing(kind):
    if 2 not in WS:
        pytest.skip("runs at W = 2 (CUFLUX_TEST_WORLD_SIZES leaves it out)")
    res = queued_behind_a_failure.run(2, timeout_s=120, kind=kind, bound_s=1.0)
    for me, r in enumerate(res):
        assert r["warm"]["error"] is None and r["issued"]["error"] is None, (me, r)
        assert r["synced"]["error"] in ("CommTimeoutError", "PeerFailedError"), (me, r)
    assert res[1]["exact"], res[1]  # rank 0's later calls did not overwrite what it read


@on_ranks
def told_late_rank(world, kind, bound_s=1.0):
    """The last rank sleeps past the timeout while its peers' calls wait for it. The first peer
    to time out tells every rank through the op's failure board: every peer raises a
    CommTimeoutError naming the late rank (PeerFailedError, a subclass, where it was told before
    its own wait expired), and the late rank, whose call could otherwise find its peers' flags
    and return, raises PeerFailedError at once naming the rank that failed first."""
    W, me = world.size, world.rank
    with world.device_context():
        op, call = _told_op(world, kind, bound_s)

        def call_and_sync():
            call()
            op.synchronize()

        warm = _outcome(call_and_sync)  # every rank: arguments agreed, kernels loaded
        world.barrier()
        if me == W - 1:
            time.sleep(bound_s + 2.0)
        out = _outcome(call_and_sync)
        again = _outcome(call)  # a failed op refuses, on every rank
        op.abort()
    world.barrier()
    return {"warm": warm, "out": out, "again": again}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["allreduce", "all2all", "allgather", "gemm_rs"])
@pytest.mark.parametrize("W", [w for w in WS if w > 1][:2])
def test_a_late_rank_is_told_and_raises_instead_of_returning(W, kind):
    res = told_late_rank.run(W, timeout_s=120, kind=kind, bound_s=1.0)
    late = W - 1
    # Every rank's warm-up first: one that failed there tells the others before their call.
    assert [r["warm"]["error"] for r in res] == [None] * W, res
    for me, r in enumerate(res):
        out = r["out"]
        if me == late:
            assert out["error"] == "PeerFailedError" and out["first"] in range(W - 1), r
            assert out["seconds"] < 0.5, r  # refused at the call: nothing launched
        else:
            assert out["error"] in ("CommTimeoutError", "PeerFailedError"), (me, r)
            assert out["peer"] == late, (me, r)
            assert out["seconds"] < 1.0 + GPU_SLACK_S, (me, r)
        assert r["again"]["error"] in ("CommTimeoutError", "PeerFailedError"), (me, r)
    # The rank that failed first timed out itself; it is the one the late rank names.
    first = res[late]["out"]["first"]
    assert res[first]["out"]["error"] == "CommTimeoutError", res


# ==== CPU tests (no GPU needed, never skipped) ====================================================
# ---- the failure board (#19 item 1) -------------------------------------------------------------
def test_failure_board_keeps_the_first_teller_and_reaches_every_rank():
    W = 4
    pages = [(ctypes.c_uint32 * 1)() for _ in range(W)]  # each rank's word, "mapped" here
    boards = [E.FailureBoard(r, [ctypes.addressof(p) for p in pages]) for r in range(W)]
    assert [b.told() for b in boards] == [-1] * W
    boards[2].tell()
    assert [b.told() for b in boards] == [2] * W
    boards[0].tell()  # a later teller does not overwrite the first
    assert [b.told() for b in boards] == [2] * W
    pages[1][0] = 0  # a word still unwritten (its rank's page not reached yet)
    boards[3].tell(failed_rank=0)
    assert boards[1].told() == 0 and boards[3].told() == 2
    boards[3].detach()  # the pages may go: the board reads nothing of them any more
    pages[3][0] = 7
    assert boards[3].told() == -1


def test_failure_board_says_when_a_rank_has_left_or_died():
    """FailureBoard.gone (#19 item 1, guards): a rank is gone once it left the op (its own
    word), once its process is dead (a zombie not yet reaped counts) and never while it runs;
    a rank of another pid namespace, or one whose pid is not written yet, is present until it
    leaves. A detached board reads every rank as gone."""
    W = 3
    failed = [(ctypes.c_uint32 * 1)() for _ in range(W)]
    left = [(ctypes.c_uint32 * 1)() for _ in range(W)]
    pids = [(ctypes.c_uint32 * 2)() for _ in range(W)]
    boards = [E.FailureBoard(r, [ctypes.addressof(p) for p in failed],
                             left_addrs=[ctypes.addressof(p) for p in left],
                             pid_addrs=[ctypes.addressof(p) for p in pids]) for r in range(W)]
    assert [int(p[0]) for p in pids] == [os.getpid()] * W  # each wrote its own (one process)
    assert not any(boards[0].gone(r) for r in range(W))  # this process runs
    boards[2].leave()
    assert boards[0].gone(2) and boards[1].gone(2) and not boards[0].gone(1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while E.process_alive(zombie.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # exits, unreaped: a zombie
    pids[1][0] = dead.pid
    assert boards[0].gone(1)
    pids[1][0] = zombie.pid
    assert boards[0].gone(1) and not E.process_alive(zombie.pid)
    zombie.wait()
    pids[1][1] ^= 1  # another pid namespace: not judged by pid
    assert not boards[0].gone(1)
    pids[1][:] = [0, pids[0][1]]  # no pid yet
    assert not boards[0].gone(1)
    boards[0].detach()
    assert boards[0].gone(1)
    assert E.FailureBoard(0, [ctypes.addressof(failed[0])]).gone(1)  # no such words


def test_peer_failed_error_names_whom_it_waited_for_and_who_failed_first():
    e = E.PeerFailedError("AllReduce", 1, 3, 2.0, 0)
    assert isinstance(e, CommTimeoutError) and (e.rank, e.peer, e.first) == (1, 3, 0)
    assert "rank 1 gave up waiting for rank 3: rank 0 failed the op" in str(e)
    e = E.PeerFailedError("AllReduce", 1, 0, 2.0, 0)
    assert "AllReduce: rank 0 failed the op and told rank 1; every call" in str(e)


def test_watchdog_expiry_status():
    assert watchdog.expiry_status(True, 99.0, 1.0) == E.STATUS_ABORTED
    assert watchdog.expiry_status(False, 1.5, 1.0) == E.STATUS_TIMEOUT
    assert watchdog.expiry_status(False, 0.1, 1.0) == E.STATUS_PEER_FAILED  # failed meanwhile


@pytest.mark.parametrize("status,tells", [(E.STATUS_PEER_FAILED, 0), (E.STATUS_TIMEOUT, 1)])
def test_watchdog_records_the_expiry_and_only_its_own_timeout_tells(status, tells):
    """A released wait is recorded naming the peer it waited for and released by a CPU store;
    only a wait that ran out of time tells the peers (a told one: the teller wrote every word,
    and telling again would name this rank as the one that failed)."""
    err = FakeErrorRecord(timeout_s=30.0, rank=1)
    told = {"tells": 0}
    err.tell = lambda: told.__setitem__("tells", told["tells"] + 1)
    host = (ctypes.c_uint32 * 1)()
    w = watchdog.StreamWaiter.__new__(watchdog.StreamWaiter)
    w.err, w.op_code = err, E.OP_CODES["test"]
    item = watchdog.PendingWait(None, None, 0x1000, 5, peer=2, index=9,
                                host=ctypes.addressof(host), started=0.0)
    w._expire(item, status)
    assert host[0] == 5  # released by a CPU store
    assert int(err.words[E.STATUS]) == status and int(err.words[E.PEER]) == 2
    assert told["tells"] == tells


# ---- bounded host collectives ------------------------------------------------------------------
class _SlowSendComm:
    """Rank 0 of two, as MPI shows it when messages are large: every peer's message is there
    at once, but this rank's own send completes only after `send_tests` more MPI calls of
    this rank (the peer pulls the data while the sender progresses it); None: never."""

    def __init__(self, send_tests):
        self.send_tests, self.sends = send_tests, []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def isend(self, obj, dest, tag):
        comm = self

        class Send:
            tests = 0

            def Test(self):
                self.tests += 1
                return comm.send_tests is not None and self.tests > comm.send_tests

        self.sends.append(Send())
        return self.sends[-1]

    def improbe(self, source, tag):
        comm = self

        class Message:
            def irecv(self):
                class Recv:
                    def test(self):
                        return True, comm.peer_message
                return Recv()

        return Message()


def test_allgather_returns_only_once_its_own_sends_are_delivered():
    """A rank that returned with a large send in flight and then blocked in CUDA (no MPI calls)
    left its peer inside the collective, waiting for data only the sender's progress moves:
    the soak of 2026-12-01 timed out that way (scripts/results/campaigns)."""
    comm = _SlowSendComm(send_tests=5)
    g = world_mod.HostGroup(comm, 5.0, "test group", "gid")
    comm.peer_message = ("gid", 0, "allgather", "theirs")
    assert g.allgather("mine") == ["mine", "theirs"]
    assert comm.sends and all(r.tests > 5 for r in comm.sends)  # delivered before returning


def test_allgather_names_the_rank_that_never_takes_its_message():
    comm = _SlowSendComm(send_tests=None)
    g = world_mod.HostGroup(comm, 0.3, "test group", "gid")
    comm.peer_message = ("gid", 0, "allgather", "theirs")
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="ranks \\[1\\] did not take this rank's message"):
        g.allgather("mine")
    assert time.monotonic() - t0 < 0.3 + SLACK_S


@on_ranks
def late_rank(world, late, op="barrier", bound_s=1.0, sleep_s=None):
    """Every rank but `late` runs one bounded collective at once; `late` arrives after the
    others gave up (sleep_s) or never (sleep_s None)."""
    w = _short(world, bound_s)
    run = (lambda: w.barrier()) if op == "barrier" else (lambda: w.allgather(w.rank * 10))
    if world.rank == late:
        if sleep_s is None:
            return {"error": None, "skipped": True}
        time.sleep(sleep_s)
        out = _outcome(run)  # the others' messages are there: the late rank passes
    else:
        out = _outcome(run)
        # Out of step from now on: later collectives refuse at once.
        out["after"] = _outcome(lambda: w.barrier())
    return out


@on_ranks
def mismatched_collectives(world):
    """Rank 0 runs a barrier while the others run an allgather: every rank says so."""
    w = _short(world, 5.0)
    if world.rank == 0:
        return _outcome(lambda: w.barrier(what="close buffers"))
    return _outcome(lambda: w.allgather(1, what="exchange handles"))


@pytest.mark.parametrize("op", ["barrier", "allgather"])
def test_absent_rank_is_named_within_the_timeout(op):
    res = late_rank.run(4, timeout_s=120, late=2, op=op)
    for r, out in enumerate(res):
        if r == 2:
            assert out["skipped"]
            continue
        assert out["error"] == "CommTimeoutError", out
        assert out["peer"] == 2 and "rank 2" in out["message"], out
        assert 1.0 <= out["seconds"] < 1.0 + SLACK_S, out
        # The group is out of step now: the next collective refuses at once.
        assert out["after"]["error"] == "CufluxError" and "out of step" in out["after"]["message"]
        assert out["after"]["seconds"] < 0.5


def test_late_rank_times_out_its_peers_and_passes_itself():
    res = late_rank.run(3, timeout_s=120, late=1, op="allgather", sleep_s=2.5)
    for r in (0, 2):
        assert res[r]["error"] == "CommTimeoutError" and res[r]["peer"] == 1, res[r]
    # The late rank finds the messages its peers sent before giving up.
    assert res[1]["error"] is None and res[1]["result"] == [0, 10, 20], res[1]


def test_ranks_at_different_collectives_raise_instead_of_pairing():
    res = mismatched_collectives.run(2, timeout_s=120)
    for out in res:
        assert out["error"] == "CufluxError", out
        assert "different orders" in out["message"], out
        assert "close buffers" in out["message"] and "exchange handles" in out["message"], out
        assert out["seconds"] < 2.0


# ---- agreed symmetric set-up (test doubles for the memory) -------------------------------------
class FakeMemory:
    """What establish() asks of a memory kind, recording every call; fails where told."""

    kind = "fake"

    def __init__(self, rank, fail_alloc=False, fail_open=False):
        self.rank, self.fail_alloc, self.fail_open = rank, fail_alloc, fail_open
        self.allocated, self.freed, self.opened, self.closed, self.set = [], [], [], [], []

    def alloc(self, num_bytes):
        if self.fail_alloc:
            raise MemoryError(f"out of memory allocating {num_bytes} bytes (on purpose)")
        ptr = 0x1000 * (self.rank + 1)
        self.allocated.append(ptr)
        return ptr

    def export(self, ptr):
        return ("handle", self.rank, ptr)

    def open(self, handle):
        if self.fail_open:
            raise RuntimeError("cudaErrorMapBufferObjectFailed (on purpose)")
        _, owner, ptr = handle
        p = 0x100000 * (self.rank + 1) + ptr
        self.opened.append(p)
        return p

    def close(self, ptr):
        self.closed.append(ptr)

    def free(self, ptr):
        self.freed.append(ptr)

    def set_up(self, ptr):
        self.set.append(ptr)

    def state(self):
        return {"allocated": self.allocated, "freed": self.freed, "opened": self.opened,
                "closed": self.closed, "set": self.set}


@on_ranks
def symmetric_agreement(world, fail_rank=None, stage="alloc", absent_rank=None, bound_s=5.0):
    """establish() with a test double: one rank fails its allocation or opening (or never comes);
    every rank must raise, name it, and free / close everything it made."""
    w = _short(world, bound_s)
    if world.rank == absent_rank:
        return {"absent": True}
    mem = FakeMemory(world.rank, fail_alloc=(world.rank == fail_rank and stage == "alloc"),
                     fail_open=(world.rank == fail_rank and stage == "open"))
    before = symmetric.leaked_bytes()
    out = _outcome(lambda: symmetric.establish(w, mem, 4096)[1])
    out["mem"] = mem.state()
    out["leaked"] = symmetric.leaked_bytes() - before
    return out


@on_ranks
def shared_host_memory(world):
    """The host kind without CUDA (device=None: no registration): every rank writes word `me`
    of every peer's allocation through its own mapping, and reads what the peers wrote into
    its own; the /dev/shm names are gone once set up."""
    w = _short(world, 10.0)
    mem = symmetric.SharedHostMemory(None)
    base, ptrs, opened = symmetric.establish(w, mem, 4096, "test")
    W, me = w.size, w.rank
    leftover = [f for f in os.listdir(mem.DIRECTORY) if f.startswith(f"cuflux-{os.getpid()}-")]
    words = {p: np.ctypeslib.as_array((ctypes.c_uint32 * W).from_address(ptrs[p]))
             for p in range(W)}
    for p in range(W):
        words[p][me] = 1000 * me + p + 1
    w.barrier()
    got = [int(x) for x in words[me]]
    w.barrier()
    for p in opened:
        mem.close(p)
    w.barrier()
    mem.free(base)
    return {"got": got, "leftover": leftover}


def test_symmetric_set_up_succeeds_and_opens_every_peer():
    res = symmetric_agreement.run(3, timeout_s=120)
    for r, out in enumerate(res):
        assert out["error"] is None, out
        ptrs = out["result"]
        assert len(ptrs) == 3 and ptrs[r] == 0x1000 * (r + 1)
        mem = out["mem"]
        assert len(mem["opened"]) == 2 and mem["freed"] == [] and mem["closed"] == []
        assert mem["set"] == [0x1000 * (r + 1)]


@pytest.mark.parametrize("stage", ["alloc", "open"])
def test_one_rank_failing_set_up_fails_every_rank_and_frees_everything(stage):
    res = symmetric_agreement.run(3, timeout_s=120, fail_rank=1, stage=stage)
    for r, out in enumerate(res):
        assert out["error"] == "CufluxError", out
        assert "rank(s) [1]" in out["message"], out
        assert "on purpose" in out["message"], out  # the failing rank's reason, on every rank
        mem = out["mem"]
        assert sorted(mem["freed"]) == sorted(mem["allocated"]), mem  # nothing kept
        assert sorted(mem["closed"]) == sorted(mem["opened"]), mem
        assert mem["set"] == [] and out["leaked"] == 0


def test_absent_rank_at_set_up_is_named_and_nothing_leaks():
    res = symmetric_agreement.run(3, timeout_s=120, absent_rank=2, bound_s=1.0)
    for r in (0, 1):
        out = res[r]
        assert out["error"] == "CommTimeoutError" and out["peer"] == 2, out
        # Nobody passed the allocation round, so nobody can have opened our handle: freed.
        assert out["mem"]["freed"] == out["mem"]["allocated"] and out["leaked"] == 0
    assert res[2]["absent"]


def test_host_memory_is_shared_between_ranks_and_leaves_no_file():
    res = shared_host_memory.run(3, timeout_s=120)
    for me, out in enumerate(res):
        want = [1000 * p + me + 1 if p != me else 1000 * me + me + 1 for p in range(3)]
        assert out["got"] == want, (me, out)
        assert out["leftover"] == []


# ---- op communicators --------------------------------------------------------------------------
@on_ranks
def sub_comm_order(world, swap_rank=None):
    """Ranks build two ops; `swap_rank` builds them in the other order."""
    w = _short(world, 5.0)
    names = ["AllGather", "AllReduce"]
    if world.rank == swap_rank:
        names.reverse()
    first = []
    out = _outcome(lambda: first.append(w.sub_comm(names[0])) or first[0].op_id)
    if out["error"] is None:
        first[0].free()
        a = w.sub_comm(names[1])
        # The op's own collectives do not pair with the World's.
        got = a.allgather(world.rank, what="op exchange")
        w.barrier()
        a.barrier()
        out["second"] = a.op_id
        out["gathered"] = got
        a.close()
    return out


@on_ranks
def close_order(world, swap_rank=None):
    """Two ops closed in different orders: check_close raises on every rank."""
    w = _short(world, 5.0)
    ops = [w.sub_comm("AllGather"), w.sub_comm("AllReduce")]
    if world.rank == swap_rank:
        ops.reverse()
    out = _outcome(lambda: ops[0].check_close())
    for op in ops:
        op.free()
    return out


def test_sub_comm_agreed_in_order():
    res = sub_comm_order.run(3, timeout_s=120)
    for out in res:
        assert out["error"] is None, out
        assert out["result"] == "AllGather#0" and out["second"] == "AllReduce#1"
        assert out["gathered"] == [0, 1, 2]


def test_sub_comm_built_in_different_orders_raises_on_every_rank():
    res = sub_comm_order.run(3, timeout_s=120, swap_rank=2)
    for out in res:
        assert out["error"] == "CufluxError", out
        assert "different orders" in out["message"]
        assert "rank 2 builds op #0 'AllReduce'" in out["message"], out
        assert out["seconds"] < 2.0


def test_ops_closed_in_different_orders_raise_on_every_rank():
    res = close_order.run(2, timeout_s=120, swap_rank=1)
    for out in res:
        assert out["error"] == "CufluxError", out
        assert "rank 0 closes AllGather#0, rank 1 closes AllReduce#1" in out["message"], out


# ---- GPU choice ---------------------------------------------------------------------------------
def test_choose_device():
    choose = world_mod.choose_device
    assert choose(0) is None  # no GPU: no device, whatever the rank
    assert choose(2, env_local_rank=3) == 1
    assert choose(8, env_local_rank=3, node_local_rank=5) == 3  # the launcher's word first
    assert choose(8, node_local_rank=5) == 5
    assert choose(8, device=6, env_local_rank=1) == 6  # device= wins
    with pytest.raises(ValueError, match="device=8 is not one of the 8"):
        choose(8, device=8)
    with pytest.raises(TypeError, match="device must be an int"):
        choose(8, device="0")
    with pytest.raises(world_mod.NoDeviceError, match="no CUDA device"):
        choose(0, device=0)
    with pytest.raises(CufluxError, match="pass device="):
        choose(8)  # a sub-communicator, no launcher variable, COMM_WORLD never seen


def test_local_rank_from_env_prefers_the_mpi_launcher():
    env = {"SLURM_LOCALID": "0", "LOCAL_RANK": "2", "MPI_LOCALRANKID": "3"}
    assert world_mod.local_rank_from_env(env) == ("MPI_LOCALRANKID", 3)
    assert world_mod.local_rank_from_env({"SLURM_LOCALID": "1"}) == ("SLURM_LOCALID", 1)
    assert world_mod.local_rank_from_env({"LOCAL_RANK": "x"}) is None
    assert world_mod.local_rank_from_env({}) is None


@on_ranks
def node_local_rank(world):
    """The node-local rank computed over COMM_WORLD (the launcher's variable hidden) and the GPU
    a World on a sub-communicator would choose from it."""
    from mpi4py import MPI

    from cuflux import world as world_mod

    saved = {k: os.environ.pop(k) for k in world_mod.LOCAL_RANK_ENV if k in os.environ}
    try:
        world_mod._NODE_LOCAL_RANK = None
        full = cuflux.World(MPI.COMM_WORLD, timeout_s=10.0)
        computed = world_mod._NODE_LOCAL_RANK
        sub = cuflux.World(world.comm.Split(world.rank % 2, world.rank), timeout_s=10.0)
        pick = world_mod.choose_device(4, None, None, world_mod._NODE_LOCAL_RANK)
        return {"computed": computed, "local_rank": full.local_rank, "sub_rank": sub.rank,
                "sub_local_rank": sub.local_rank, "pick": pick}
    finally:
        os.environ.update(saved)


def test_node_local_rank_from_comm_world_serves_a_sub_communicator():
    res = node_local_rank.run(4, timeout_s=120)
    for r, out in enumerate(res):
        assert out["computed"] == r and out["local_rank"] == r  # one host in tests
        assert out["sub_rank"] == r // 2 and out["pick"] == r % 4, out


def test_world_timeout_is_validated(monkeypatch):
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="finite number of seconds"):
            world_mod.check_timeout("World", bad)
    monkeypatch.setenv(world_mod.TIMEOUT_ENV, "nan")
    with pytest.raises(ValueError, match=world_mod.TIMEOUT_ENV):
        world_mod.default_timeout_s()
    monkeypatch.setenv(world_mod.TIMEOUT_ENV, "7.5")
    assert world_mod.default_timeout_s() == 7.5


# ---- what device_count's failures mean ----------------------------------------------------------
def test_no_gpu_reads_as_zero():
    classify = world_mod.classify_device_error
    assert classify(100, driver_present=True) == 0  # cudaErrorNoDevice
    assert classify(35, driver_present=False) == 0  # no libcuda: no driver at all


def test_wrong_extra_or_old_driver_raises_and_says_what_to_install():
    classify = world_mod.classify_device_error
    with pytest.raises(world_mod.CudaSetupError, match=r"cuflux\[cuda12\]") as e:
        classify(35, driver_present=True, driver_version=12040, runtime_version=13000)
    assert "CUDA 12.4" in str(e.value) and "CUDA 13.0" in str(e.value)
    with pytest.raises(world_mod.CudaSetupError, match="update the NVIDIA driver"):
        classify(35, driver_present=True, driver_version=11080, runtime_version=12060)
    with pytest.raises(world_mod.CudaSetupError, match="could not start"):
        classify(3, driver_present=True, message="initialization error")
    assert issubclass(world_mod.CudaSetupError, CufluxError)


def test_device_count_without_cupy_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    with pytest.raises(world_mod.CudaSetupError, match="needs CuPy"):
        world_mod.device_count()


def test_device_count_here_is_honest():
    present, _ = world_mod._driver_probe()
    n = world_mod.device_count()  # must not raise on this machine
    if not present:
        assert n == 0
        with pytest.raises(world_mod.NoDeviceError,
                           match="AllGather: needs a CUDA device; no NVIDIA driver"):
            world_mod.require_device("AllGather")


def test_require_device_says_which_op(monkeypatch):
    monkeypatch.setattr(world_mod, "_device_count_and_reason",
                        lambda: (0, "CUDA sees no device (CUDA_VISIBLE_DEVICES='')"))
    with pytest.raises(world_mod.NoDeviceError,
                       match=r"^All2AllHeads: needs a CUDA device; CUDA sees no device"):
        world_mod.require_device("All2AllHeads")
    monkeypatch.setattr(world_mod, "_device_count_and_reason", lambda: (2, ""))
    assert world_mod.require_device("All2AllHeads") == 2


# ---- the environment on import -------------------------------------------------------------------
def test_import_sets_only_nccl_nvls():
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING", "NCCL_NVLS_ENABLE")}
    env["PYTHONPATH"] = ROOT
    code = ("import os, cuflux; print(repr(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')), "
            "repr(os.environ.get('CUDA_MODULE_LOADING')), os.environ.get('NCCL_NVLS_ENABLE'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None", "0"], out.stdout
    env.update(NCCL_NVLS_ENABLE="1", CUDA_DEVICE_MAX_CONNECTIONS="1")  # the caller's values stay
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["'1'", "None", "1"], out.stdout


def test_one_connection_warns_once(monkeypatch):
    monkeypatch.setattr(watchdog, "_warned_one_connection", False)
    assert not watchdog.warn_if_one_connection({"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    with pytest.warns(RuntimeWarning, match="one hardware queue"):
        assert watchdog.warn_if_one_connection({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert not watchdog.warn_if_one_connection({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


# ---- the watchdog: CPU release of host-mapped flags, and its failure path ----------------------
class FakeEvent:
    def __init__(self, *a, **k):
        self.done = False

    def record(self, stream):
        pass


class BrokenEvent(FakeEvent):
    @property
    def done(self):
        raise RuntimeError("cudaErrorIllegalAddress (on purpose)")

    @done.setter
    def done(self, value):
        pass


def _waiter(monkeypatch, timeout_s, host_flags, event=FakeEvent):
    """A StreamWaiter without CUDA: fake events, no stream wait; the flags in `host_flags` (a
    NumPy uint32 array standing for host-mapped memory) are known to be host-mapped."""
    import cupy

    monkeypatch.setattr(cupy.cuda, "Event", event)
    monkeypatch.setattr(watchdog.driver, "stream_wait_value32", lambda *a, **k: None)
    base = host_flags.ctypes.data
    monkeypatch.setattr(watchdog.driver, "host_address",
                        lambda p: base + (p - 0x9000) if 0x9000 <= p < 0x9000 + 4 * host_flags.size
                        else None)
    w = watchdog.StreamWaiter.__new__(watchdog.StreamWaiter)
    w.err, w.device = FakeErrorRecord(timeout_s, rank=3), None
    w.op_code = E.OP_CODES["AllGather"]
    w._pending, w._lock, w._thread, w._stop = {}, threading.Lock(), None, threading.Event()
    w._host_words = {}

    def no_gpu(*a, **k):
        raise AssertionError("a host-mapped flag must be released by the CPU, not a stream")
    w._expire_device = no_gpu
    return w


def test_host_mapped_wait_is_released_by_a_cpu_store(monkeypatch):
    flags = np.zeros(4, dtype=np.uint32)
    flags[2] = 4  # the peer got as far as epoch 4
    w = _waiter(monkeypatch, 0.1, flags)
    try:
        w.wait(7, 0x9000 + 8, 5, peer=1, index=2)
        (item,) = list(w._pending[7])
        assert item.host == flags.ctypes.data + 8
        item.reached.done = True  # the stream reaches the wait
        time.sleep(0.4)
        assert int(flags[2]) == 5  # released: the awaited value, stored by the CPU
        words = w.err.words
        assert int(words[E.STATUS]) == E.STATUS_TIMEOUT and int(words[E.PEER]) == 1
        assert int(words[E.OBSERVED]) == 4 and int(words[E.EXPECTED]) == 5
        assert int(words[E.INDEX]) == 2 and int(words[E.RANK]) == 3
        assert w.fault is None
    finally:
        w.close()


def test_guard_wait_is_recorded_on_expiry_but_released_only_when_its_peer_leaves(monkeypatch):
    """#19 item 1: a wait guarding a copy into a peer's memory is recorded and told when it runs
    out of time, like any wait, but its flag is not forged while the peer is still in the op:
    only the peer's own word or its leaving releases it. A plain wait behind the failure is
    released at once."""
    flags = np.zeros(4, dtype=np.uint32)
    flags[1] = 6
    w = _waiter(monkeypatch, 0.1, flags)
    w.err.gone = set()  # a board: rank 1 is still in the op
    tells = []
    w.err.tell = lambda: tells.append(1)
    try:
        w.wait(5, 0x9000 + 4, 7, peer=1, index=1, guard=True)
        (item,) = list(w._pending[5])
        item.reached.done = True  # the stream reaches the guard
        time.sleep(0.5)
        words = w.err.words
        assert int(words[E.STATUS]) == E.STATUS_TIMEOUT and int(words[E.PEER]) == 1
        assert int(words[E.OBSERVED]) == 6 and tells == [1]
        assert int(flags[1]) == 6 and not item.released  # held: rank 1 may still read its rows
        w.wait(6, 0x9000 + 8, 3, peer=2, index=2)  # the op failed: a plain wait is not queued
        w.wait(7, 0x9000 + 12, 3, peer=2, index=3, guard=True)  # a guard still is
        assert 6 not in w._pending and len(w._pending[7]) == 1
        w._pending[7][0].reached.done = True
        time.sleep(0.1)
        assert int(flags[3]) == 0 and int(flags[1]) == 6  # both guards held
        w.err.gone.update((1, 2))  # ranks 1 and 2 left the op (or died)
        time.sleep(0.1)
        assert int(flags[1]) == 7 and item.released and tells == [1]  # released, recorded once
        assert int(flags[3]) == 3
    finally:
        w.close()


def test_follower_wait_has_no_clock_and_names_nobody(monkeypatch):
    """The wait by which a call's stream joins streams that may hold a guard (AllGather) has no
    clock of its own: it outlives the timeout unreleased while the op is healthy (the waits
    ahead of it bound the time), and once another wait expires it is released without a record
    of its own, so the error names the late peer, not this rank."""
    flags = np.zeros(3, dtype=np.uint32)
    w = _waiter(monkeypatch, 0.1, flags)
    w.err.gone = set()
    try:
        w.wait(5, 0x9000, 2, peer=3, index=0, follow=True)  # joins rank 3's own stream
        (follower,) = list(w._pending[5])
        follower.reached.done = True
        time.sleep(0.4)
        assert int(flags[0]) == 0 and not follower.released  # 4 timeouts long: still waiting
        assert int(w.err.words[E.STATUS]) == E.STATUS_OK
        w.wait(6, 0x9000 + 4, 9, peer=1, index=1, guard=True)  # the lane's guard, for rank 1
        w._pending[6][0].reached.done = True
        time.sleep(0.4)
        assert int(w.err.words[E.STATUS]) == E.STATUS_TIMEOUT and int(w.err.words[E.PEER]) == 1
        assert int(flags[0]) == 2 and follower.released  # released, once the op failed
        assert int(flags[1]) == 0  # the guard still held
    finally:
        w.close()


def test_guard_wait_passes_when_its_peer_gets_there(monkeypatch):
    flags = np.zeros(2, dtype=np.uint32)
    w = _waiter(monkeypatch, 0.1, flags)
    w.err.gone = set()
    try:
        w.wait(5, 0x9000, 4, peer=1, guard=True)
        (item,) = list(w._pending[5])
        item.reached.done = True
        time.sleep(0.3)
        assert not item.released and int(flags[0]) == 0
        flags[0] = 4  # the peer's word comes after all: the stream passes
        item.passed.done = True
        time.sleep(0.1)
        assert 5 not in w._pending and not item.released  # popped, never forged
    finally:
        w.close()


def test_watchdog_thread_failure_is_recorded_and_raised(monkeypatch):
    flags = np.zeros(2, dtype=np.uint32)
    w = _waiter(monkeypatch, 30, flags, event=BrokenEvent)
    try:
        w.wait(1, 0x9000, 9, peer=2)
        deadline = time.monotonic() + 5
        while w.fault is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(w.fault, RuntimeError) and "on purpose" in str(w.fault)
        assert w.err.fault is w.fault
        words = w.err.words
        assert int(words[E.STATUS]) == E.STATUS_ABORTED and int(words[E.ABORT]) == 1
        assert int(flags[0]) == 9  # the pending host-mapped wait was released on the way out
        with pytest.raises(CufluxError, match="AllGather: the stream-wait watchdog failed"):
            w.wait(1, 0x9004, 1, peer=2)  # the op's next call raises it
        with pytest.raises(CufluxError, match="on purpose"):
            w.check()
    finally:
        w.close()


# ---- SymmetricBuffer.close on test doubles ------------------------------------------------------
class FakeGroup:
    def __init__(self, size, fail=None):
        self.rank, self.size, self.fail, self.calls = 0, size, fail, []

    def barrier(self, timeout_s=None, what=""):
        self.calls.append(what)
        if self.fail is not None:
            raise self.fail


class FakeStream:
    def __init__(self, done):
        self.done = done


def _buffer(size, memory="device", fail=None):
    buf = symmetric.SymmetricBuffer.__new__(symmetric.SymmetricBuffer)
    buf.memory, buf.num_bytes, buf._closed = memory, 4096, False
    buf.name = "SymmetricBuffer #0"
    buf.group = FakeGroup(size, fail)
    buf._mem = FakeMemory(0)
    buf._base = buf._mem.alloc(4096)
    buf._opened = [buf._mem.open(("handle", p, 0x1000 * (p + 1))) for p in range(1, size)]
    buf.base_ptrs = [buf._base] + buf._opened
    buf._synchronize_device = lambda: None
    return buf


def test_abort_close_is_local_and_keeps_memory_a_peer_may_write():
    before = symmetric.leaked_bytes()
    buf = _buffer(3)
    t0 = time.monotonic()
    buf.close(abort=True)  # streams unknown: nothing is unmapped, nothing freed
    assert time.monotonic() - t0 < 0.1 and buf.group.calls == []
    assert buf._mem.closed == [] and buf._mem.freed == [] and buf.closed
    assert symmetric.leaked_bytes() - before == 3 * 4096
    buf.close(abort=True)  # idempotent

    buf = _buffer(3)
    buf.close(abort=True, streams=[FakeStream(True)])  # our work is done: unmap the peers
    assert sorted(buf._mem.closed) == sorted(buf._mem.opened) and buf._mem.freed == []
    buf = _buffer(3)
    buf.close(abort=True, streams=[FakeStream(True), FakeStream(False)])  # still running
    assert buf._mem.closed == []
    buf = _buffer(1)
    buf.close(abort=True, streams=[])  # no peer: freeing is safe
    assert buf._mem.freed == buf._mem.allocated
    buf = _buffer(3, memory="host")
    buf.close(abort=True, streams=[])  # host pages: the peers keep their own mappings
    assert buf._mem.freed == buf._mem.allocated


def test_close_with_a_dead_peer_raises_and_leaks_rather_than_frees():
    buf = _buffer(2, fail=CommTimeoutError("SymmetricBuffer.close", 0, 1, 1.0))
    with pytest.raises(CommTimeoutError):
        buf.close()
    assert buf._mem.freed == [] and sorted(buf._mem.closed) == sorted(buf._mem.opened)

    buf = _buffer(2)
    buf.close()
    assert buf.group.calls == ["SymmetricBuffer #0 close: every rank done with it",
                               "SymmetricBuffer #0 close: every rank unmapped it"]
    assert buf._mem.freed == buf._mem.allocated


def test_context_exit_on_a_timeout_aborts():
    buf = _buffer(2)
    with pytest.raises(CommTimeoutError):
        with buf:
            raise CommTimeoutError("AllGather", 0, 1, 1.0)
    assert buf.closed and buf.group.calls == []  # no collective after a peer timed out