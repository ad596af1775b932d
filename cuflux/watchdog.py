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
        self._pending: list[tuple] = []
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
        driver.stream_wait_value32(stream, flag_addr, expected, "geq")
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        deadline = time.monotonic() + self.err.timeout_s
        with self._lock:
            self._pending.append((ev, deadline, flag_addr, expected & 0xFFFFFFFF, peer, index))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cuflux-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        import cupy

        cupy.cuda.Device(self.device).use()
        while not self._stop.is_set():
            time.sleep(_POLL_S)
            with self._lock:
                items, self._pending = self._pending, []
            now, keep = time.monotonic(), []
            aborted = self.err.words is not None and int(self.err.words[E.ABORT]) != 0
            for item in items:
                if item[0].done:
                    continue
                if aborted or now > item[1]:
                    self._expire(item, E.STATUS_ABORTED if aborted else E.STATUS_TIMEOUT)
                else:
                    keep.append(item)
            with self._lock:
                self._pending = keep + self._pending

    def _expire(self, item, status: int) -> None:
        from cupy.cuda import runtime

        _, _, flag_addr, expected, peer, index = item
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
