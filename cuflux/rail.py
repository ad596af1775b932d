"""Collectives across a rail: rank i of every node, one rank per node (issue 20).

Inside a node the ops move data over CUDA IPC; between nodes their cross-node step goes through
a rail communicator, queued on a CUDA stream of the op's (World.split_nodes() gives the rail's
host group). Two kinds, one interface:

  NcclRail  NCCL (cupy.cuda.nccl) on the op's stream: what runs across real nodes.
  HostRail  the rail's host group (MPI or gloo), staged through host memory and summed there
            in rail-rank order. For ranks that share a GPU (NCCL refuses two ranks on one GPU:
            this is how the cross-node paths are tested on a one-GPU machine) and for machines
            without NCCL. It synchronizes the stream and the host: correct, not fast.

    all_reduce(x, out, stream)      out = sum over the rail of x (out may be x)
    all_gather(x, out, stream)      out = the rail ranks' x one after another, in rail order
    reduce_scatter(x, out, stream)  out = rail rank r's part of sum(x): x.size / rail size
                                    elements from r * out.size
    all_to_all(sends, recvs, stream)  recvs[j] = rail rank j's sends[r] (blocks of any sizes;
                                    this rank's own pair is not moved: the caller places it)
    wait(stream, what)              returns once the rail's queued work is done

Arrays are C-contiguous CuPy arrays (HostRail also takes NumPy arrays: its CPU tests) of one
dtype: float32, float16 or bfloat16 (cuflux's storage, ml_dtypes' bfloat16, or its uint16
bits); all_gather and all_to_all move any dtype. Every wait
is bounded: a rail call that does not complete within timeout_s raises CommTimeoutError naming
the call and this rank, and a NcclRail is aborted then (a timed-out rail is not used again).
"""
from __future__ import annotations

import time

import numpy as np

from cuflux.errors import CommTimeoutError, CufluxError

__all__ = ["NcclRail", "HostRail", "make_rail", "NCCL_DTYPES", "to_float", "from_float"]

# NCCL's ncclDataType_t values (nccl.h) for the dtypes cuflux sums; all_gather moves bytes.
NCCL_DTYPES = {"float16": 6, "float32": 7, "bfloat16": 9}
_NCCL_UINT8, _NCCL_SUM = 1, 0
_REDUCIBLE = tuple(NCCL_DTYPES)


def _dtype_name(a) -> str:
    """cuflux's name for an array's dtype (bfloat16: ml_dtypes' bfloat16, or its uint16 bits)."""
    kind = np.dtype(a.dtype)
    if kind.name == "bfloat16" or kind == np.uint16:
        return "bfloat16"
    return {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(kind, str(kind))


def to_float(host: np.ndarray, dtype: str) -> np.ndarray:
    """Host values in float32 (bfloat16 from its bits: ml_dtypes' bfloat16 or uint16)."""
    if dtype == "bfloat16":
        return (host.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return host.astype(np.float32)


def from_float(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to nearest even in `dtype` (bfloat16 as its uint16 bits: view
    them as the storage dtype)."""
    if dtype == "bfloat16":
        bits = values.astype(np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)
    return values.astype(np.float16 if dtype == "float16" else np.float32)


def _check(op: str, x, out, out_size: int, reduce: bool) -> str:
    """Refuse a bad call before anything is queued; returns the dtype's name."""
    dt = _dtype_name(x)
    if reduce and dt not in _REDUCIBLE:
        raise TypeError(f"rail {op}: sums float32, float16 or bfloat16 (uint16), got {dt}")
    if out.dtype != x.dtype:
        raise TypeError(f"rail {op}: out is {out.dtype}, x is {x.dtype}")
    for name, a in (("x", x), ("out", out)):
        if not a.flags.c_contiguous:
            raise ValueError(f"rail {op}: {name} must be C-contiguous")
    if out.size != out_size:
        raise ValueError(f"rail {op}: out must hold {out_size} elements, got {out.size}")
    return dt


class _Rail:
    """What both kinds share: the rail's host group, its size and rank, the argument checks."""

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.size = group.rank, group.size
        self._failed: BaseException | None = None

    def abort(self) -> None:
        """Local: the rail is not used again (a NCCL communicator is aborted, not destroyed)."""
        self._failed = self._failed or CufluxError("the rail was aborted")
        self.close()

    def _usable(self, op: str) -> None:
        if self._failed is not None:
            raise CufluxError(f"rail {op}: this rail failed earlier ({self._failed}); build a "
                              "new one")

    def all_reduce(self, x, out, stream=None) -> None:
        self._usable("all_reduce")
        self._all_reduce(x, out, stream, _check("all_reduce", x, out, x.size, True))

    def all_gather(self, x, out, stream=None) -> None:
        self._usable("all_gather")
        _check("all_gather", x, out, x.size * self.size, False)
        self._all_gather(x, out, stream)

    def reduce_scatter(self, x, out, stream=None) -> None:
        self._usable("reduce_scatter")
        if x.size % self.size:
            raise ValueError(f"rail reduce_scatter: x holds {x.size} elements, not a multiple of "
                             f"the rail's {self.size} ranks")
        self._reduce_scatter(x, out, stream,
                             _check("reduce_scatter", x, out, x.size // self.size, True))

    def all_to_all(self, sends, recvs, stream=None) -> None:
        self._usable("all_to_all")
        if len(sends) != self.size or len(recvs) != self.size:
            raise ValueError(f"rail all_to_all: one send and one receive block per rail rank "
                             f"({self.size}), got {len(sends)} and {len(recvs)}")
        for name, blocks in (("sends", sends), ("recvs", recvs)):
            for j, a in enumerate(blocks):
                if j != self.rank and not a.flags.c_contiguous:
                    raise ValueError(f"rail all_to_all: {name}[{j}] must be C-contiguous")
        self._all_to_all(sends, recvs, stream)


class HostRail(_Rail):
    """The rail over its host group, staged through host memory (see the module's docstring).
    Sums run in float32 in rail-rank order, the same on every rank."""

    kind = "host"

    def _to_host(self, x, stream) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        import cupy

        host = cupy.asnumpy(x, stream=stream)
        (stream or cupy.cuda.get_current_stream()).synchronize()  # the copy has landed
        return host

    @staticmethod
    def _store(out, host: np.ndarray, stream) -> None:
        host = host.view(out.dtype)  # bfloat16 sums come back as their uint16 bits
        if isinstance(out, np.ndarray):
            out[...] = host.reshape(out.shape)
            return
        out.set(np.ascontiguousarray(host.reshape(out.shape)), stream=stream)

    def _gathered(self, x, stream, what: str) -> list:
        return self._allgather(self._to_host(x, stream).reshape(-1), what)

    def _allgather(self, payload, what: str) -> list:
        try:
            return self.group.allgather(payload, self.timeout_s, what)
        except BaseException as e:
            self._failed = e
            raise

    def _sum(self, x, stream, dt: str, what: str) -> np.ndarray:
        total = np.zeros(x.size, np.float32)
        for part in self._gathered(x, stream, what):  # rail-rank order on every rank
            total += to_float(part, dt)
        return from_float(total, dt)

    def _all_reduce(self, x, out, stream, dt) -> None:
        self._store(out, self._sum(x, stream, dt, "all_reduce"), stream)

    def _all_gather(self, x, out, stream) -> None:
        self._store(out, np.concatenate(self._gathered(x, stream, "all_gather")), stream)

    def _reduce_scatter(self, x, out, stream, dt) -> None:
        n = out.size
        mine = self._sum(x, stream, dt, "reduce_scatter")[self.rank * n:(self.rank + 1) * n]
        self._store(out, mine, stream)

    def _all_to_all(self, sends, recvs, stream) -> None:
        # Every rank's blocks to every rank (the host group has no all-to-all): the testing
        # path, where the blocks are small.
        mine = [None if j == self.rank else self._to_host(a, stream).reshape(-1)
                for j, a in enumerate(sends)]
        got = self._allgather(mine, "all_to_all")
        for j, out in enumerate(recvs):
            if j != self.rank and out.size:
                self._store(out, got[j][self.rank], stream)

    def wait(self, stream=None, what: str = "rail") -> None:
        """HostRail's calls return done (they synchronize): nothing is left to wait for."""
        self._usable(what)

    def close(self) -> None:
        self.group = None


class NcclRail(_Rail):
    """The rail through NCCL, its work queued on the caller's stream (see the module's
    docstring). Building it is collective over the rail and bounded: rank 0's unique id goes
    out through the host group, NCCL's blocking set-up runs in a thread joined against the
    deadline, and the rail agrees that every rank got a communicator. Each call records an
    event behind its NCCL work; `wait` polls the latest one and NCCL's asynchronous error
    against the deadline. Any failure aborts the communicator (never destroyed while work may
    be pending, nor before every rail rank is closing it too) and the rail is not used again."""

    kind = "nccl"

    def __init__(self, group, device: int, timeout_s: float):
        super().__init__(group, timeout_s)
        import threading

        import cupy
        from cupy.cuda import nccl

        if not nccl.available:
            raise CufluxError("NcclRail: CuPy finds no NCCL runtime; install it (cuflux's "
                              "nccl13 / nccl12 extra: nvidia-nccl-cu13 / -cu12) or use HostRail")
        self._nccl, self.device, self.comm = nccl, device, None
        with cupy.cuda.Device(device):  # re-recorded behind every call (done until the first)
            self._done = cupy.cuda.Event(disable_timing=True)
        uid = group.allgather(nccl.get_unique_id() if group.rank == 0 else None, timeout_s,
                              "NCCL unique id")[0]
        made: list = []
        lock, late = threading.Lock(), [False]

        def init():  # ncclCommInitRank waits for every rail rank: off the caller's thread
            comm = None
            try:
                with cupy.cuda.Device(device):
                    comm = nccl.NcclCommunicator(group.size, uid, group.rank)
                    self._connect(comm)
                got = comm
            except BaseException as e:  # noqa: BLE001 - reported below
                got = e
                if comm is not None:  # made, then its connecting failed
                    comm.abort()
                    comm = None
            with lock:
                if not late[0]:
                    made.append(got)
                    return
            if comm is not None:  # the caller gave up on it: never left to CuPy's finalizer
                comm.abort()  # (its destroy() would wait for every rank)

        worker = threading.Thread(target=init, name="cuflux-nccl-init", daemon=True)
        worker.start()
        worker.join(timeout_s)
        with lock:
            got = made[0] if made else None
            late[0] = got is None
        if isinstance(got, nccl.NcclCommunicator):
            self.comm = got
        try:
            ok = group.allgather(self.comm is not None, timeout_s, "NCCL set-up")
        except BaseException:
            self.abort()  # a communicator made here is aborted, not left to the finalizer
            raise
        if not all(ok):
            self._failed = _setup_failed(ok, got, group.rank, timeout_s)
            self.abort()
            raise self._failed

    def _connect(self, comm) -> None:
        """One tiny call of every kind the rail makes, completed, inside the bounded set-up:
        NCCL connects its channels at a kind's first call, and that connection blocks the
        calling host thread until the peers make the same call (no stream, no deadline), so a
        rank failing between a call's agreement and the call would leave its peers stuck there
        without it."""
        import cupy

        nccl, n, me = self._nccl, self.group.size, self.group.rank
        s = cupy.cuda.Stream(non_blocking=True)
        buf = cupy.zeros(2 * n, dtype=cupy.float32)
        comm.allReduce(buf.data.ptr, buf.data.ptr, 1, NCCL_DTYPES["float32"], _NCCL_SUM, s.ptr)
        comm.allGather(buf.data.ptr, buf[n:].data.ptr, 4, _NCCL_UINT8, s.ptr)
        comm.reduceScatter(buf.data.ptr, buf[n:].data.ptr, 1, NCCL_DTYPES["float32"],
                           _NCCL_SUM, s.ptr)
        if n > 1:  # a send and a receive with every peer
            _send_recv(nccl, comm, me, [buf[:1]] * n, [buf[n + j:n + j + 1] for j in range(n)],
                       s.ptr)
        s.synchronize()

    @staticmethod
    def _ptr(a) -> int:
        return a.data.ptr

    def _queued(self, call, *args, stream) -> None:
        """One NCCL call on `stream` (default: the current one), then the event wait() polls
        recorded behind it."""
        import cupy

        s = stream or cupy.cuda.get_current_stream()
        try:
            call(*args, s.ptr)
        except BaseException as e:
            self._failed = e
            self.abort()
            raise
        self._done.record(s)

    def _all_reduce(self, x, out, stream, dt) -> None:
        self._queued(self.comm.allReduce, self._ptr(x), self._ptr(out), x.size,
                     NCCL_DTYPES[dt], _NCCL_SUM, stream=stream)

    def _all_gather(self, x, out, stream) -> None:
        self._queued(self.comm.allGather, self._ptr(x), self._ptr(out), x.nbytes, _NCCL_UINT8,
                     stream=stream)

    def _reduce_scatter(self, x, out, stream, dt) -> None:
        self._queued(self.comm.reduceScatter, self._ptr(x), self._ptr(out), out.size,
                     NCCL_DTYPES[dt], _NCCL_SUM, stream=stream)

    def _all_to_all(self, sends, recvs, stream) -> None:
        self._queued(_send_recv, self._nccl, self.comm, self.rank, sends, recvs, stream=stream)

    def wait(self, stream=None, what: str = "rail") -> None:
        """Until the latest NCCL call is done, at most timeout_s (then, or on NCCL's
        asynchronous error, the communicator is aborted and the call's error raised)."""
        self._usable(what)
        deadline, polls = time.monotonic() + self.timeout_s, 0
        while not self._done.done:
            polls += 1
            if polls % 64 == 0:
                self._check_async(what)
            if time.monotonic() > deadline:
                # NCCL does not say whom it waits for: the other rank of a two-rank rail, else
                # the next one (rail ranks, in World-rank order)
                self._failed = CommTimeoutError(what, self.rank, (self.rank + 1) % self.size,
                                                self.timeout_s,
                                                "rail ranks: the rail's NCCL work did not "
                                                "complete")
                self.abort()
                raise self._failed
            time.sleep(0.0002)
        self._check_async(what)

    def _check_async(self, what: str) -> None:
        try:
            self.comm.check_async_error()
        except BaseException as e:
            self._failed = CufluxError(f"{what}: NCCL failed on rail rank {self.rank}: {e}")
            self.abort()
            raise self._failed from e

    def close(self) -> None:
        """Destroy the communicator once its work is done and every rail rank is closing it
        too (both bounded); abort it otherwise. NCCL's destroy waits, with no deadline, for
        the communicator's other ranks on this host to destroy theirs: a peer that aborted
        instead (its wait timed out) would never come, so the ranks agree first."""
        if self.comm is not None and self._failed is None:
            try:
                self.wait(what="closing the rail")
            except CufluxError:
                return  # wait() aborted it
            try:
                self.group.allgather(True, self.timeout_s, "rail close")
            except Exception as e:  # a rail rank failed or left: destroy would wait for it
                import warnings

                warnings.warn(f"rail close: not every rail rank came ({e}); aborted this "
                              f"rank's NCCL communicator", RuntimeWarning, stacklevel=2)
                self._failed = e
            comm, self.comm = self.comm, None
            if self._failed is None:
                comm.destroy()
            else:
                comm.abort()
            return
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.abort()


def _setup_failed(ok: list, got, me: int, timeout_s: float) -> CufluxError:
    """The error of a NCCL set-up that not every rail rank got through (ok[r]: rank r has its
    communicator; got: this rank's outcome, a communicator, NCCL's exception, or None where
    its set-up outlived the deadline). NCCL's own refusal is said as such, not as a timeout."""
    bad = [r for r, good in enumerate(ok) if not good]
    detail = f"rail ranks {bad} got no NCCL communicator"
    if isinstance(got, BaseException):
        return CufluxError(f"rail NCCL set-up failed on rail rank {me} ({detail}): {got!r}")
    # a rank that failed or never came: the first other one, else (this one's set-up timed
    # out alone) the next rank, whom NCCL's set-up was waiting for as much as any
    peer = next((r for r in bad if r != me), (me + 1) % len(ok))
    return CommTimeoutError("rail NCCL set-up", me, peer, timeout_s, detail)


def _send_recv(nccl, comm, me: int, sends, recvs, stream_ptr: int) -> None:
    """One NCCL group: this rank's send of sends[j] to and receive of recvs[j] from every
    other rank j (arrays; empty ones skipped), all at once."""
    nccl.groupStart()
    try:
        for j in range(len(sends)):
            if j != me and sends[j].nbytes:
                comm.send(sends[j].data.ptr, sends[j].nbytes, _NCCL_UINT8, j, stream_ptr)
            if j != me and recvs[j].nbytes:
                comm.recv(recvs[j].data.ptr, recvs[j].nbytes, _NCCL_UINT8, j, stream_ptr)
    finally:
        nccl.groupEnd()


def make_rail(group, device: int | None, timeout_s: float, kind: str = "auto"):
    """The rail communicator for a host group from World.split_nodes(): kind "nccl", "host", or
    "auto": NCCL where every rail rank has a GPU of its own (told apart by PCI bus id) and CuPy
    has NCCL, else the host kind (NCCL refuses two ranks on one GPU). Collective over the rail;
    every rank makes the same choice."""
    if kind not in ("auto", "nccl", "host"):
        raise ValueError(f"make_rail: kind must be 'auto', 'nccl' or 'host', got {kind!r}")
    if kind == "auto":
        import socket

        mine = (socket.gethostname(), None, False)
        if device is not None:
            from cupy.cuda import nccl, runtime

            mine = (mine[0], runtime.deviceGetPCIBusId(device), bool(nccl.available))
        seen = group.allgather(mine, timeout_s, "rail devices")
        distinct = len({(host, bus) for host, bus, _ in seen}) == len(seen)
        usable = all(bus is not None and has_nccl for _, bus, has_nccl in seen)
        kind = "nccl" if distinct and usable else "host"
    if kind == "nccl":
        return NcclRail(group, device, timeout_s)
    return HostRail(group, timeout_s)
