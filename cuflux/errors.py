"""Exceptions and the per-op error record that device-side waits write on timeout."""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

__all__ = ["CufluxError", "CommTimeoutError", "CudaError", "CompileError", "CaptureError",
           "NoDeviceError", "CudaSetupError", "PeerFailedError",
           "ErrorRecord", "FailureBoard", "OP_CODES"]

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

# Words of the record; mirrors the enum in kernels_cu/include/cuflux/sync.cuh. BOARD_* / PEERS_*:
# 64-bit device pointers (low word first) of this rank's failure-board word and of the device
# array of every rank's board word, WORLD their count (0: no board, W = 1).
(STATUS, OP, RANK, PEER, OBSERVED, EXPECTED, INDEX, ABORT, BOARD_LO, BOARD_HI, PEERS_LO, PEERS_HI,
 WORLD, NUM_WORDS) = range(14)
STATUS_OK, STATUS_TIMEOUT, STATUS_ABORTED = 0, 1, 2
STATUS_PEER_FAILED = 4  # a wait gave up: another rank failed the op and told this one (3: a2a)


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


class PeerFailedError(CommTimeoutError):
    """Another rank failed the op first (a wait of its timed out, or it aborted) and told every
    rank through the op's failure board: this rank's calls of the op since are void, whatever
    they returned; close or abort the op and build a new one."""

    def __init__(self, op: str, rank: int, peer: int, seconds: float, first: int):
        # peer: whom this rank was waiting for when it gave up (else `first`); first: the rank
        # that failed the op first (-1: not known here).
        self.op, self.rank, self.peer, self.seconds, self.first = op, rank, peer, seconds, first
        who = f"rank {first}" if first >= 0 else "another rank"
        head = (f"rank {rank} gave up waiting for rank {peer}: {who} failed the op and told "
                f"every rank" if peer != first else f"{who} failed the op and told rank {rank}")
        CufluxError.__init__(self, f"{op}: {head}; every call of it on rank {rank} since then is "
                                   f"void (outputs may be partial): close or abort the op")


@functools.cache
def _pid_namespace() -> int:
    """This process's pid namespace (low 32 bits of its inode; 0 where /proc has none): pids
    compare only within one namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def process_alive(pid: int) -> bool:
    """Whether process `pid` (this pid namespace) still runs: a zombie (killed, not yet reaped
    by its launcher) has stopped running and counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


class FailureBoard:
    """One uint32 per rank that any rank of the op can write: 0 while the op is healthy, else
    1 + the rank that failed it first. Host memory shared by the ranks of one machine
    (SymmetricBuffer(memory="host")), so the host reads and writes it with plain loads and
    stores and kernels reach every rank's word through mapped device pointers.

    #19 item 1: the first rank to fail an op (a device wait timed out, a host exchange timed
    out, the stream-wait watchdog expired a wait, or abort()) tells every peer at once; a told
    rank's waits give up at their next check (sync.cuh op_failed), its host refuses new calls,
    and synchronize() raises PeerFailedError instead of returning outputs a late peer may have
    half written.

    It also says whether a rank has left the op (`gone`): a copy into a peer's memory waits
    for that peer's own word that the memory is free, and never for a timeout; once the peer
    has left (closed or aborted the op: its `left` word) or its process is dead, nothing of it
    reads that memory any more and the wait may be released (watchdog.StreamWaiter guards).

    host_addrs: each rank's word as seen by this process (host addresses); dev_word: this
    rank's word as a device pointer; dev_table: device array of the W words' device pointers;
    left_addrs / pid_addrs: each rank's `left` word and its two process words (pid, pid
    namespace), host addresses (None: no such words; every rank reads as gone).
    """

    def __init__(self, rank: int, host_addrs, dev_word: int = 0, dev_table: int = 0,
                 left_addrs=None, pid_addrs=None):
        self.rank, self.world_size = rank, len(host_addrs)
        self.dev_word, self.dev_table = dev_word, dev_table
        self._words = [ctypes.c_uint32.from_address(a) for a in host_addrs]
        self._left = ([ctypes.c_uint32.from_address(a) for a in left_addrs]
                      if left_addrs is not None else None)
        self._pids = ([(ctypes.c_uint32 * 2).from_address(a) for a in pid_addrs]
                      if pid_addrs is not None else None)
        if self._pids is not None:  # ours, for the peers' liveness checks
            self._pids[rank][1] = _pid_namespace()
            self._pids[rank][0] = os.getpid()

    def told(self) -> int:
        """-1 while nobody failed the op, else the rank that told this one (the first to fail
        it; two ranks failing at the same moment may each reach some words first)."""
        return self._words[self.rank].value - 1

    def tell(self, failed_rank: int | None = None) -> None:
        """Write 1 + failed_rank (default: this rank) into every rank's word not yet written,
        this rank's own included (CPU stores into shared pages: nothing queued on a GPU)."""
        v = (self.rank if failed_rank is None else failed_rank) + 1
        for w in self._words:
            if w.value == 0:
                w.value = v

    def leave(self) -> None:
        """This rank reads none of the op's memory any more (close, abort): a peer's guarded
        copy into it may be released."""
        if self._left is not None:
            self._left[self.rank].value = 1

    def gone(self, rank: int) -> bool:
        """True once `rank` has left the op (its `left` word) or its process is dead; a rank
        whose process this one cannot judge (another pid namespace, no pid yet) reads as
        present until it leaves."""
        left, pids = self._left, self._pids  # (detach() may run meanwhile: the watchdog asks)
        if left is None or pids is None:
            return True
        if left[rank].value:
            return True
        pid, namespace = int(pids[rank][0]), int(pids[rank][1])
        if pid == 0 or namespace != _pid_namespace():
            return False
        return not process_alive(pid)

    def detach(self) -> None:
        """Forget the mapped words (before the pages are unmapped); every rank reads as gone."""
        self._words = [ctypes.c_uint32(0) for _ in self._words]
        self._left = self._pids = None


class ErrorRecord:
    """NUM_WORDS uint32 in pinned, mapped host memory plus a device claim word.

    Kernels write it on timeout (see sync.cuh); the host reads it at any moment without
    synchronising, and can ask every waiter of the op to give up by setting the abort word.
    """

    fault: BaseException | None = None  # set by a watchdog whose thread failed
    host_detail: str = ""               # set when a host exchange of the op failed it
    board: FailureBoard | None = None   # the op's failure board (W > 1), attach_board()

    def __init__(self, op: str, rank: int, timeout_s: float):
        from cupy.cuda import runtime

        from cuflux.arrays import zeros_settled

        self.op, self.rank, self.timeout_s = op, rank, float(timeout_s)
        nbytes = NUM_WORDS * 4
        # cudaHostAllocPortable | cudaHostAllocMapped: under UVA the host pointer is also the
        # device pointer, so kernels store into it directly.
        self._host_ptr = runtime.hostAlloc(nbytes, 3)
        self.words = np.ctypeslib.as_array((ctypes.c_uint32 * NUM_WORDS).from_address(self._host_ptr))
        self.words[:] = 0
        # The status word alone, read on every call (0.05 us, against 1.5 us for the array).
        self._status = ctypes.c_uint32.from_address(self._host_ptr + 4 * STATUS)
        # The claim word also says "a wait of this op gave up" (sync.cuh op_gave_up), which
        # makes kernels skip their stores: it must read 0 before any stream of the op can read
        # it (zeros_settled).
        self.claim = zeros_settled(1, np.uint32)

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
        self.tell()

    def attach_board(self, board: FailureBoard) -> None:
        """Give the kernels (through the record's words) and the host the op's board."""
        self.board = board
        w = self.words
        w[BOARD_LO], w[BOARD_HI] = board.dev_word & 0xFFFFFFFF, board.dev_word >> 32
        w[PEERS_LO], w[PEERS_HI] = board.dev_table & 0xFFFFFFFF, board.dev_table >> 32
        w[WORLD] = board.world_size

    def detach_board(self) -> None:
        """Before the board's pages are unmapped: kernels and the host stop using it."""
        if self.board is not None:
            if self.words is not None:
                self.words[BOARD_LO:NUM_WORDS] = 0
            self.board.detach()

    def tell(self) -> None:
        """Tell every rank of the op that this rank failed it (no-op without a board)."""
        if self.board is not None:
            self.board.tell()

    def failed(self) -> bool:
        # The status word and the board word alone (the watchdog polls them): ~0.1 us.
        return self._status.value != STATUS_OK or (self.board is not None
                                                   and self.board.told() >= 0)

    def check(self) -> None:
        """Raise CommTimeoutError if a device wait of this op has failed, PeerFailedError if
        another rank failed the op and told this one."""
        if self._status.value == STATUS_OK:
            told = -1 if self.board is None else self.board.told()
            if told < 0:
                return
            if told != self.rank:
                raise PeerFailedError(self.op, self.rank, told, self.timeout_s, told)
        if self.fault is not None:  # the stream-wait watchdog thread died
            raise CufluxError(f"{self.op}: the stream-wait watchdog failed: {self.fault!r}") \
                from self.fault
        w = [int(x) for x in self.words]
        if w[STATUS] == STATUS_OK:
            return
        name = _OP_NAMES.get(w[OP], self.op)
        if w[STATUS] == STATUS_PEER_FAILED:
            raise PeerFailedError(name, w[RANK], w[PEER], self.timeout_s,
                                  -1 if self.board is None else self.board.told())
        # Flags hold epochs (AllReduce's START slots e * 8 + chunk + 1: kernels_cu/sync.cuh),
        # low 32 bits.
        detail = self.host_detail or (f"flag {w[INDEX]}: observed {w[OBSERVED]}, "
                                      f"expected {w[EXPECTED]} (low 32 bits)")
        raise CommTimeoutError(name, w[RANK], w[PEER], self.timeout_s, detail)

    def abort(self) -> None:
        """Release every waiter of this op (they return at their next timer check) and tell
        every peer: this rank is leaving the op."""
        self.words[ABORT] = 1
        self.tell()
        self.leave()

    def leave(self) -> None:
        """This rank reads none of the op's memory any more (close, abort): see
        FailureBoard.gone."""
        if self.board is not None:
            self.board.leave()

    def peer_gone(self, rank: int) -> bool:
        """Whether rank `rank` has left the op or died (True without a board: W = 1)."""
        return self.board is None or self.board.gone(rank)

    def close(self) -> None:
        if self._host_ptr:
            from cupy.cuda import runtime

            self.words = None
            self._status = ctypes.c_uint32(STATUS_OK)  # the pinned word is freed below
            runtime.freeHost(self._host_ptr)
            self._host_ptr = 0
