"""Exceptions and the per-op error record that device-side waits write on timeout."""
from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["CufluxError", "CommTimeoutError", "CudaError", "CompileError", "CaptureError",
           "NoDeviceError", "CudaSetupError",
           "ErrorRecord", "OP_CODES"]

# Op codes written by kernels into the error record (kernels receive them as an argument).
OP_CODES = {
    "AllGather": 1,
    "All2AllHeads": 2,
    "AllReduce": 3,
    "AllReduceRMSNorm": 4,
    "GemmReduceScatter": 5,
    "AllGatherGemm": 6,
    "test": 99,
}
_OP_NAMES = {v: k for k, v in OP_CODES.items()}

# Words of the record; mirrors the enum in kernels_cu/include/cuflux/sync.cuh.
STATUS, OP, RANK, PEER, OBSERVED, EXPECTED, INDEX, ABORT, NUM_WORDS = range(9)
STATUS_OK, STATUS_TIMEOUT, STATUS_ABORTED = 0, 1, 2


class CufluxError(RuntimeError):
    """Base class of cuflux's runtime errors."""


class CompileError(CufluxError):
    """NVRTC could not compile a kernel file; the message holds its log."""


class NoDeviceError(CufluxError):
    """An op needs a CUDA device and this process has none."""


class CudaSetupError(CufluxError):
    """CUDA is installed in a way that cannot work here (CuPy missing, driver too old for the
    CUDA extra installed, driver not loaded); the message says what to install or fix."""


class CaptureError(CufluxError):
    """An op (or one path of it) that cannot be captured in a CUDA graph was called while its
    stream was being captured."""


class CudaError(CufluxError):
    """A CUDA call or kernel launch failed; the message names the op and the kernel."""


class CommTimeoutError(CufluxError):
    """A bounded wait expired: `rank` waited for `peer` for `seconds` in `op`."""

    def __init__(self, op: str, rank: int, peer: int, seconds: float, detail: str = ""):
        self.op, self.rank, self.peer, self.seconds = op, rank, peer, seconds
        msg = (f"{op}: rank {rank} timed out after {seconds:.3g} s waiting for rank {peer}"
               + (f" ({detail})" if detail else ""))
        super().__init__(msg)


class ErrorRecord:
    """NUM_WORDS uint32 in pinned, mapped host memory plus a device claim word.

    Kernels write it on timeout (see sync.cuh); the host reads it at any moment without
    synchronising, and can ask every waiter of the op to give up by setting the abort word.
    """

    fault: BaseException | None = None  # set by a watchdog whose thread failed
    host_detail: str = ""               # set when a host exchange of the op failed it

    def __init__(self, op: str, rank: int, timeout_s: float):
        import cupy
        from cupy.cuda import runtime

        self.op, self.rank, self.timeout_s = op, rank, float(timeout_s)
        nbytes = NUM_WORDS * 4
        # cudaHostAllocPortable | cudaHostAllocMapped: under UVA the host pointer is also the
        # device pointer, so kernels store into it directly.
        self._host_ptr = runtime.hostAlloc(nbytes, 3)
        self.words = np.ctypeslib.as_array((ctypes.c_uint32 * NUM_WORDS).from_address(self._host_ptr))
        self.words[:] = 0
        # The status word alone, read on every call (0.05 us, against 1.5 us for the array).
        self._status = ctypes.c_uint32.from_address(self._host_ptr + 4 * STATUS)
        self.claim = cupy.zeros(1, dtype=cupy.uint32)

    @property
    def ptr(self) -> int:
        return self._host_ptr

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def record_host_failure(self, op_code: int, peer: int, detail: str) -> None:
        """Fail the op from the host (a bounded host exchange of the op timed out), as a
        device wait would: every later call and synchronize() raise CommTimeoutError."""
        self.host_detail = detail
        self.words[OP], self.words[RANK], self.words[PEER] = op_code, self.rank, max(peer, 0)
        self.words[STATUS] = STATUS_TIMEOUT

    def failed(self) -> bool:
        return self._status.value != STATUS_OK  # the status word alone (the watchdog polls it)

    def check(self) -> None:
        """Raise CommTimeoutError if a device wait of this op has failed."""
        if self._status.value == STATUS_OK:
            return
        if self.fault is not None:  # the stream-wait watchdog thread died
            raise CufluxError(f"{self.op}: the stream-wait watchdog failed: {self.fault!r}") \
                from self.fault
        w = [int(x) for x in self.words]
        if w[STATUS] == STATUS_OK:
            return
        name = _OP_NAMES.get(w[OP], self.op)
        detail = self.host_detail or (f"flag {w[INDEX]}: observed epoch {w[OBSERVED]}, "
                                      f"expected {w[EXPECTED]}")
        raise CommTimeoutError(name, w[RANK], w[PEER], self.timeout_s, detail)

    def reset(self) -> None:
        """Clear a reported failure (after the caller handled it) so the op can run again."""
        self.words[:] = 0
        self.claim.fill(0)

    def abort(self) -> None:
        """Release every waiter of this op: they return at their next timer check."""
        self.words[ABORT] = 1

    def close(self) -> None:
        if self._host_ptr:
            from cupy.cuda import runtime

            self.words = None
            self._status = ctypes.c_uint32(STATUS_OK)  # the pinned word is freed below
            runtime.freeHost(self._host_ptr)
            self._host_ptr = 0
