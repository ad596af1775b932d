"""Bounded stream waits that use no SM: cuStreamWaitValue32 plus a host watchdog.

`cuStreamWaitValue32` makes a stream wait for a flag in the copy/front-end hardware, without a
kernel, which is what the host-driven DMA path wants (no SM taken from a concurrent GEMM, and
when ranks share one GPU a blocked stream does not hold the GPU the way a spinning kernel
does). It has no timeout of its own, so every wait is registered with a watchdog thread: when
the wait has not completed by its deadline, the thread records the timeout in the op's
ErrorRecord (op, rank, peer, observed, expected) and releases the stream by writing the
awaited value into the flag from a private stream. The flag lives in this rank's own memory,
so the release never touches a peer. The op is then failed: its next call or synchronize()
raises CommTimeoutError.
"""
from __future__ import annotations

import collections
import threading
import time

import numpy as np

from cuflux import driver
from cuflux import errors as E

__all__ = ["StreamWaiter"]

_POLL_S = 0.002


class StreamWaiter:
    def __init__(self, err: E.ErrorRecord, device: int, op_code: int):
        import cupy

        self.err, self.device, self.op_code = err, device, op_code
        self._pending: dict[int, collections.deque] = {}
        self._lock = threading.Lock()
        self._release = cupy.cuda.Stream(non_blocking=True)
        self._observed = cupy.cuda.alloc_pinned_memory(4)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def wait(self, stream, flag_addr: int, expected: int, peer: int, index: int = 0) -> None:
        """`stream` waits until the flag at flag_addr reached `expected` (epoch, wrap-aware)."""
        import cupy

        if self.err.failed():
            return  # the op already failed: do not block the stream behind a dead peer
        # The budget counts from when the stream reaches the wait (event `reached`), not from
        # when the host queued it: a long queue of back-to-back calls must not time out.
        reached = cupy.cuda.Event(disable_timing=True)
        reached.record(stream)
        driver.stream_wait_value32(stream, flag_addr, expected, "geq")
        passed = cupy.cuda.Event(disable_timing=True)
        passed.record(stream)
        item = [reached, passed, None, flag_addr, expected & 0xFFFFFFFF, peer, index, False]
        with self._lock:
            # One FIFO per stream: a stream passes its waits in order, so only the head of each
            # queue can be blocked and each poll looks at one wait per stream.
            self._pending.setdefault(driver.stream_handle(stream), collections.deque()).append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cuflux-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        import cupy

        if self.device is not None:
            cupy.cuda.Device(self.device).use()
        while not self._stop.is_set():
            time.sleep(_POLL_S)
            w = self.err.words
            aborted = w is not None and int(w[E.ABORT]) != 0
            # Once one wait of the op expired the op is failed: release every later wait as soon
            # as its stream reaches it, so a dead peer costs one timeout, not one per flag.
            failed = w is not None and int(w[E.STATUS]) != E.STATUS_OK
            with self._lock:
                queues = list(self._pending.values())
            for q in queues:
                while True:
                    with self._lock:
                        if not q:
                            break
                        item = q[0]
                    reached, passed, started = item[0], item[1], item[2]
                    if passed.done:
                        with self._lock:
                            q.popleft()
                        continue
                    now = time.monotonic()
                    if started is None and reached.done:
                        item[2] = started = now
                    if not item[7] and (aborted or (started is not None and (
                            failed or now - started > self.err.timeout_s))):
                        self._expire(item, E.STATUS_ABORTED if aborted else E.STATUS_TIMEOUT)
                        item[7] = True  # released: it passes shortly and is popped then
                    break

    def _expire(self, item, status: int) -> None:
        from cupy.cuda import runtime

        flag_addr, expected, peer, index = item[3:7]
        runtime.memcpyAsync(self._observed.ptr, flag_addr, 4, 2, self._release.ptr)  # D2H
        self._release.synchronize()
        observed = int(np.frombuffer(self._observed, dtype=np.uint32, count=1)[0])
        w = self.err.words
        if w is not None and int(w[E.STATUS]) == E.STATUS_OK:
            w[E.OP], w[E.RANK], w[E.PEER] = self.op_code, self.err.rank, peer
            w[E.OBSERVED], w[E.EXPECTED], w[E.INDEX] = observed, expected, index
            w[E.STATUS] = status
        # Release the stream: the flag is ours, so writing it touches no peer.
        driver.stream_write_value32(self._release, flag_addr, expected)
        self._release.synchronize()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
