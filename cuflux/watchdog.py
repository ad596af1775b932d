"""Bounded stream waits that use no SM: cuStreamWaitValue32 plus a host watchdog.

`cuStreamWaitValue32` makes a stream wait for a flag in the copy/front-end hardware, without a
kernel, which is what the host-driven DMA path wants (no SM taken from a concurrent GEMM, and
when ranks share one GPU a blocked stream does not hold the GPU the way a spinning kernel
does). It has no timeout of its own, so every wait is registered with a watchdog thread: when
the wait has not completed by its deadline, the thread records the timeout in the op's
ErrorRecord (op, rank, peer, observed, expected) and releases the stream by making the flag
reach the awaited value. The flag lives in this rank's own memory, so the release never
touches a peer. The op is then failed: its next call or synchronize() raises CommTimeoutError.

How the flag is released depends on where it lives:
- pinned host-mapped memory (SymmetricBuffer(memory="host"), cudaHostAlloc'ed mapped memory):
  a plain CPU store. No GPU queue is involved, so the release cannot sit behind the blocked
  wait, whatever CUDA_DEVICE_MAX_CONNECTIONS is. This is the path ops should use.
- device memory: cuStreamWriteValue32 from a private stream (and a D2H copy to read the
  observed value). With few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS=1, or many streams)
  that stream can share a queue with the blocked wait and never run: the thread waits for it
  a bounded time, then records a fault instead of hanging.

A guard wait (`wait(guard=True)`) is one that a copy into a peer's memory, or into memory a
peer reads, sits behind (#19 item 1: AllGather's push copies wait for the peer's `free` word,
its pull staging for every peer's `done` word). Releasing it early would let this rank's copy
overwrite what a late but alive peer still reads. On expiry it is recorded (and told) like
any wait, but it is released only by its flag (the peer got there after all) or once the peer
has left the op or died (ErrorRecord.peer_gone): the stream behind it stays held until then,
so the ops join such streams through a follower wait (`wait(follow=True)`): it has no clock
of its own (the waits ahead of it on the joined streams bound the time and name the late peer)
and is released once the op has failed or been aborted (allgather.py).

The thread never dies silently: an exception in it is kept (`fault`, also set on the
ErrorRecord as `err.fault`), the op's error record is marked aborted (so its next call
raises), every pending wait on host-mapped memory is released, and `wait()`/`check()` raise
a CufluxError carrying it.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import threading
import time
import warnings

import numpy as np

from cuflux import driver
from cuflux import errors as E
from cuflux.errors import CufluxError

__all__ = ["PendingWait", "StreamWaiter", "warn_if_one_connection"]

_POLL_S = 0.002
_RELEASE_BOUND_S = 2.0  # how long the device-memory release may take before it is a fault
_UNKNOWN = 0xFFFFFFFF   # observed value when the flag could not be read

_warned_one_connection = False


def warn_if_one_connection(env=None) -> bool:
    """Warn once per process when CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's setting); True if
    it warned now. cuflux does not set the variable: it is the caller's choice, and stream
    waits on host-mapped flags are released by the CPU whatever it is. The cost is overlap."""
    global _warned_one_connection
    env = os.environ if env is None else env
    if _warned_one_connection or env.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() != "1":
        return False
    _warned_one_connection = True
    warnings.warn(
        "cuflux: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream of this process on one "
        "hardware queue: while a cuflux stream waits for a peer (cuStreamWaitValue32), work "
        "queued after it on any stream, your own kernels included, waits too, so communication "
        "does not overlap computation. Timed-out waits are still released. Ops built with "
        "wait='kernel' (a waiting kernel does not hold the queue) keep the overlap.",
        RuntimeWarning, stacklevel=3)
    return True


def expiry_status(aborted: bool, waited_s: float, timeout_s: float) -> int:
    """Why a stream wait is released: the host aborted the op, the wait ran out of time (a
    timeout, told to every rank), or the op failed meanwhile here or on a rank that told this
    one (recorded as such, naming the peer the wait was for)."""
    if aborted:
        return E.STATUS_ABORTED
    return E.STATUS_TIMEOUT if waited_s > timeout_s else E.STATUS_PEER_FAILED


@dataclasses.dataclass(eq=False)
class PendingWait:
    """One stream wait the watchdog bounds (StreamWaiter.wait says what guard and follower
    mean)."""

    reached: object  # event recorded before the wait: the stream got there (the budget starts)
    passed: object  # event recorded after it: the stream got past it (then it is dropped)
    flag_addr: int
    expected: int  # uint32
    peer: int
    index: int = 0
    host: int | None = None  # CPU address of the flag where it is host-mapped, else None
    guard: bool = False
    follower: bool = False
    started: float | None = None  # time.monotonic() when the watchdog saw `reached` done
    released: bool = False  # its flag was stored by the watchdog
    recorded: bool = False  # its expiry is in the error record (a guard: held, not released)


class StreamWaiter:
    """The stream waits of one op (PendingWait, a FIFO per stream) and the thread that bounds
    them."""

    fault: BaseException | None = None  # what killed the thread (or a release that could not run)

    def __init__(self, err: E.ErrorRecord, device: int, op_code: int):
        import cupy

        self.err, self.device, self.op_code = err, device, op_code
        self._pending: dict[int, collections.deque] = {}
        self._lock = threading.Lock()
        with cupy.cuda.Device(device):
            self._release = cupy.cuda.Stream(non_blocking=True)
            self._observed = cupy.cuda.alloc_pinned_memory(4)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._host_words: dict[int, int | None] = {}
        warn_if_one_connection()

    def _host_word(self, flag_addr: int) -> int | None:
        """CPU address of the flag when it is host-mapped (cached per address)."""
        cache = self.__dict__.setdefault("_host_words", {})
        if flag_addr not in cache:
            cache[flag_addr] = driver.host_address(flag_addr)
        return cache[flag_addr]

    def check(self) -> None:
        """Raise CufluxError if the watchdog failed (its thread died, or a release could not
        run); the op's error record says the same through err.check()."""
        fault = self.fault
        if fault is not None:
            op = E._OP_NAMES.get(self.op_code, "op")
            raise CufluxError(f"{op}: the stream-wait watchdog failed: "
                              f"{type(fault).__name__}: {fault}") from fault

    def wait(self, stream, flag_addr: int, expected: int, peer: int, index: int = 0,
             guard: bool = False, follow: bool = False) -> None:
        """`stream` waits until the flag at flag_addr reached `expected` (epoch, wrap-aware).
        Put the flag in host-mapped memory: then a timed-out wait is released by the CPU.
        guard: a copy into `peer`'s memory (or into memory it reads) follows; on expiry the
        wait is recorded but released only by the flag or once the peer has left or died.
        follow: the flag is raised by this rank's own streams after bounded waits of theirs;
        no clock of its own: released (unrecorded) once the op failed or was aborted."""
        import cupy

        self.check()
        if self.err.failed() and not guard:
            return  # the op already failed: do not block the stream behind a dead peer
        host = self._host_word(flag_addr)
        # The budget counts from when the stream reaches the wait (event `reached`), not from
        # when the host queued it: a long queue of back-to-back calls must not time out.
        reached = cupy.cuda.Event(disable_timing=True)
        reached.record(stream)
        driver.stream_wait_value32(stream, flag_addr, expected, "geq")
        passed = cupy.cuda.Event(disable_timing=True)
        passed.record(stream)
        item = PendingWait(reached, passed, flag_addr, expected & 0xFFFFFFFF, peer, index, host,
                           guard, follow)
        with self._lock:
            # One FIFO per stream: a stream passes its waits in order, so only the head of each
            # queue can be blocked and each poll looks at one wait per stream.
            self._pending.setdefault(driver.stream_handle(stream), collections.deque()).append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cuflux-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # never die silently: the op's next call raises it
            self._fail(e)

    def _loop(self) -> None:
        import cupy

        if self.device is not None:
            cupy.cuda.Device(self.device).use()  # this thread's device, not the caller's
        while not self._stop.is_set():
            time.sleep(_POLL_S)
            w = self.err.words
            aborted = w is not None and int(w[E.ABORT]) != 0
            # Once one wait of the op expired (here, or on a rank that told this one through
            # the op's failure board) the op is failed: release every later wait as soon as its
            # stream reaches it, so a dead peer costs one timeout, not one per flag.
            failed = w is not None and self.err.failed()
            with self._lock:
                queues = list(self._pending.items())
            for stream, q in queues:
                while True:
                    with self._lock:
                        if not q:  # a stream's queue goes once passed (streams come and go)
                            if self._pending.get(stream) is q:
                                del self._pending[stream]
                            break
                        item = q[0]
                    if item.passed.done:
                        with self._lock:
                            q.popleft()
                        continue
                    now = time.monotonic()
                    if item.started is None and item.reached.done:
                        item.started = now
                    started = item.started
                    if not item.released and (aborted or (started is not None and (
                            failed or (now - started > self.err.timeout_s
                                       and not item.follower)))):
                        waited_s = 0.0 if started is None else now - started
                        status = expiry_status(aborted, waited_s, self.err.timeout_s)
                        if item.guard and not self.err.peer_gone(item.peer):
                            if not item.recorded:  # record (and tell) once; keep holding
                                self._expire(item, status, release=False)
                                item.recorded = True
                        else:
                            # A follower names nobody: the waits it follows record the peer.
                            self._expire(item, status, record=not item.follower)
                            item.released = True  # it passes shortly and is popped then
                    break

    def _record(self, item: PendingWait, status: int, observed: int) -> None:
        w = self.err.words
        if w is not None and int(w[E.STATUS]) == E.STATUS_OK:
            w[E.OP], w[E.RANK], w[E.PEER] = self.op_code, self.err.rank, item.peer
            w[E.OBSERVED], w[E.EXPECTED], w[E.INDEX] = observed, item.expected, item.index
            w[E.STATUS] = status
            if status == E.STATUS_TIMEOUT:  # every peer's queued work gives up too (#19 item 1)
                self.err.tell()  # (told waits tell nobody: the teller wrote every word)

    def _expire(self, item: PendingWait, status: int, release: bool = True,
                record: bool = True) -> None:
        """Record why the wait ends (once: later records keep the first; not `record`: a
        follower), then release it unless `release` is False (a guard whose peer is still in
        the op)."""
        if item.host is not None:
            # The flag is ours and host-mapped: read it and release the wait with CPU accesses
            # (an aligned 32-bit store; the stream's wait sees it at its next poll).
            word = ctypes.c_uint32.from_address(item.host)
            if record:
                self._record(item, status, word.value)
            if release:
                word.value = item.expected
            return
        self._expire_device(item, status, release, record)

    def _expire_device(self, item: PendingWait, status: int, release: bool = True,
                       record: bool = True) -> None:
        from cupy.cuda import runtime

        if record and not item.recorded:  # not read and recorded yet
            runtime.memcpyAsync(self._observed.ptr, item.flag_addr, 4, 2,
                                self._release.ptr)  # D2H
            read = self._wait_release()
            observed = (int(np.frombuffer(self._observed, dtype=np.uint32, count=1)[0]) if read
                        else _UNKNOWN)
            self._record(item, status, observed)
        else:
            read = True
        if not release:
            return
        # Release the stream: the flag is ours, so writing it touches no peer.
        driver.stream_write_value32(self._release, item.flag_addr, item.expected)
        if not (read and self._wait_release()):
            self.fault = CufluxError(
                "the release of a timed-out stream wait on a device-memory flag did not run "
                f"within {_RELEASE_BOUND_S} s: its GPU queue sits behind the blocked wait "
                "(CUDA_DEVICE_MAX_CONNECTIONS="
                f"{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}); keep stream-waited "
                "flags in host-mapped memory (SymmetricBuffer(memory='host'))")
            self._mark_err_fault(self.fault)

    def _wait_release(self) -> bool:
        """Bounded wait for the private release stream (it may share a blocked queue)."""
        deadline = time.monotonic() + _RELEASE_BOUND_S
        while not self._release.done:
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def _mark_err_fault(self, exc: BaseException) -> None:
        try:
            self.err.fault = exc  # for an ErrorRecord.check() that raises it
        except Exception:
            pass
        w = self.err.words
        if w is not None:
            if int(w[E.STATUS]) == E.STATUS_OK:
                w[E.OP], w[E.RANK], w[E.PEER] = self.op_code, self.err.rank, self.err.rank
                w[E.OBSERVED], w[E.EXPECTED], w[E.INDEX] = _UNKNOWN, _UNKNOWN, _UNKNOWN
                w[E.STATUS] = E.STATUS_ABORTED
            w[E.ABORT] = 1  # kernel waits of the op give up too
            self.err.tell()

    def _fail(self, exc: BaseException) -> None:
        """The thread is dying: keep the exception, fail the op, release what the CPU can."""
        self.fault = exc
        try:
            self._mark_err_fault(exc)
        except Exception:
            pass
        with self._lock:
            items = [item for q in self._pending.values() for item in q]
        for item in items:
            # A guard stays held (its flag or its peer's leaving is the only release); with the
            # thread gone, its peer's progress releases it.
            if item.host is not None and not item.released and not item.guard:
                try:
                    ctypes.c_uint32.from_address(item.host).value = item.expected
                    item.released = True
                except Exception:
                    pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
