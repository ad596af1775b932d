"""Rank bodies of the reliability tests (issue 19): bounded host collectives, agreed symmetric
set-up, op communicators, GPU choice, abort close, the watchdog's CPU release.

The CPU cases (no GPU needed) use test doubles for memory; the GPU cases are named gpu_*.
"""
import ctypes
import os
import time

import numpy as np

import cuflux
from cuflux import symmetric


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
                "peer": getattr(e, "peer", None)}
    return {"error": None, "result": result, "seconds": time.monotonic() - t0}


# ---- bounded host collectives ------------------------------------------------------------------
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


def mismatched_collectives(world):
    """Rank 0 runs a barrier while the others run an allgather: every rank says so."""
    w = _short(world, 5.0)
    if world.rank == 0:
        return _outcome(lambda: w.barrier(what="close buffers"))
    return _outcome(lambda: w.allgather(1, what="exchange handles"))


# ---- agreed symmetric set-up -------------------------------------------------------------------
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


# ---- op communicators --------------------------------------------------------------------------
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


# ---- GPU cases ---------------------------------------------------------------------------------
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
