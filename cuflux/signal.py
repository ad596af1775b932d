"""Transport, not an op: stream-side bounded flag waits (kernels_cu/signal.cu), shared by the
host-driven DMA path (AllGather built with wait="kernel")."""
from __future__ import annotations

import numpy as np

from cuflux import kernels
from cuflux.errors import OP_CODES
from cuflux.launch import current_device

FAMILY = kernels.register("signal.cu", ["cuflux_wait_flags"])
_WAIT: dict = {}  # device -> cuflux_wait_flags loaded there


def _wait_kernel():
    """cuflux_wait_flags on the current device (kernels.load once per device, not per wait)."""
    dev = current_device()
    fn = _WAIT.get(dev)
    if fn is None:
        fn = _WAIT[dev] = kernels.load("signal.cu", dev)["cuflux_wait_flags"]
    return fn


def wait_flags(flags_ptr: int, expected_epoch: int, err, stream, *, op: str, num_groups: int = 1,
               per_group: int = 1, group_stride_words: int | None = None,
               first_peer: int = 0) -> None:
    """Make `stream` wait, bounded by err.timeout_s, until every flag reached `expected_epoch`.

    Flags: num_groups groups of per_group uint32 words at flags_ptr (this rank's memory), group
    g at g * group_stride_words (default per_group: contiguous) and written by rank
    first_peer + g. err: the op's ErrorRecord.
    """
    if group_stride_words is None:
        group_stride_words = per_group
    num_flags = num_groups * per_group
    if num_flags == 0:
        return
    threads = min(256, 32 * ((num_flags + 31) // 32))
    kernels.launch(
        _wait_kernel(), (1,), (threads,),
        (np.uint64(flags_ptr), np.uint32(num_groups), np.uint32(per_group),
         np.uint32(group_stride_words), np.uint32(first_peer),
         np.uint32(expected_epoch & 0xFFFFFFFF), np.uint64(err.ptr), err.claim,
         np.uint64(err.timeout_ns), np.uint32(OP_CODES.get(op, 0)), np.uint32(err.rank)),
        stream, op=op, name="cuflux_wait_flags")
