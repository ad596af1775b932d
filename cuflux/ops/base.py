"""CommOp: what every collective op owns, written once.

An op holds a World, an error record that its kernels and watchdogs write on timeout, a
symmetric buffer (allocated by the op once it knows its layout), an open/closed state and the
timeout that bounds every wait. This base owns all of that and the call-path steps every op
takes in the same order:

  1. `_check_open()`           closed? a failed wait recorded? (a host-memory read: no sync)
  2. the op's argument checks  (its own module; clear errors before any launch)
  3. `_no_capture(stream)`     only for paths that cannot be captured in a CUDA graph
  4. the launch                (cuflux.launch: argument blocks cached, ~7 us a launch)

Kernels take the error record as four trailing arguments (`self.err_args`: record pointer,
claim word, timeout in ns, op code); they never change, so they are built once here.
"""
from __future__ import annotations

import math

import numpy as np

from cuflux.errors import OP_CODES, CaptureError, CufluxError, ErrorRecord
from cuflux.resource import Closeable

__all__ = ["CommOp", "DEFAULT_TIMEOUT_S", "check_timeout", "refuse_capture", "ranks_on_my_gpu",
           "sm_count"]

# Bound of every wait of an op, unless its constructor is given another. Long enough for a
# peer that is compiling kernels on first use (up to ~40 s a file, once per machine) to be
# reported as late rather than dead only when it truly is; short enough to surface a hang.
DEFAULT_TIMEOUT_S = 30.0

_SM_COUNTS: dict[int, int] = {}


def sm_count(device: int) -> int:
    """Multiprocessors of a device (cached: the attribute query costs microseconds)."""
    n = _SM_COUNTS.get(device)
    if n is None:
        from cupy.cuda import runtime

        n = _SM_COUNTS[device] = runtime.deviceGetAttribute(
            runtime.cudaDevAttrMultiProcessorCount, device)
    return n


def ranks_on_my_gpu(world) -> int:
    """Ranks of the world running on this rank's GPU, this one included. Their spinning grids
    run side by side (MPS) or time-sliced, so grids that must stay co-resident split the SMs
    between them."""
    return 1 + sum(1 for link in world.topology.links
                   if link.same_gpu and link.peer != world.rank)


def check_timeout(op: str, timeout_s) -> float:
    """timeout_s must be a finite number of seconds > 0 (nan and inf would make waits
    unbounded)."""
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float, np.floating))
            or not math.isfinite(timeout_s) or timeout_s <= 0):
        raise ValueError(f"{op}: timeout_s must be a finite number of seconds > 0, "
                         f"got {timeout_s!r}")
    return float(timeout_s)


def refuse_capture(op: str, stream, why: str) -> None:
    """Refuse, before anything is enqueued, a path that cannot run inside a CUDA graph."""
    from cuflux.launch import capturing

    if capturing(stream):
        raise CaptureError(f"{op}: cannot be captured in a CUDA graph: {why}")


class CommOp(Closeable):
    """Base of the collective ops. Subclasses set `self.buf` (a SymmetricBuffer, or None) and
    free whatever else they own in `_free()`; `close()` is collective (every rank calls it)."""

    def __init__(self, world, op: str, timeout_s: float):
        self.op = op
        timeout_s = check_timeout(op, timeout_s)
        if world.device is None:
            raise CufluxError(f"{op}: needs a CUDA device; rank {world.rank} has none")
        self.world = world
        self.timeout_s = timeout_s
        self.buf = None
        self.err = ErrorRecord(op, world.rank, timeout_s)
        self.err_args = (np.uint64(self.err.ptr), self.err.claim, np.uint64(self.err.timeout_ns),
                         np.uint32(OP_CODES[op]))
        self.num_sms = sm_count(world.device)
        self.sharers = ranks_on_my_gpu(world)

    # ---- the call path -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CufluxError(f"{self.op}: the op is closed")
        self.err.check()  # host memory read: no synchronisation, capture-safe

    def _no_capture(self, stream, why: str) -> None:
        refuse_capture(self.op, stream, why)

    # ---- lifetime ----------------------------------------------------------------------------
    def synchronize(self, stream=None) -> None:
        """Wait for this rank's work on `stream` (default: the current stream); raise
        CommTimeoutError if a wait of this op failed."""
        from cuflux.arrays import stream_of

        stream_of(stream).synchronize()
        self.err.check()

    def _free(self) -> None:
        """Subclasses: free what they own beyond the buffer and the error record."""

    def _release(self) -> None:
        """Collective and idempotent. After a CommTimeoutError the op cannot run again (its
        epochs disagree across ranks): close it and build a new one."""
        try:
            self._free()
        finally:
            if self.buf is not None:
                self.buf.close()
            self.err.close()
