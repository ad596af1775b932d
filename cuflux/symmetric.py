"""Symmetric memory: the same allocation on every rank, each mapped into every peer.

Every rank allocates the same number of bytes, exports a handle, all-gathers the handles over
MPI and opens every peer's. The result is W base pointers per buffer (also as a device array
for kernels) and CuPy views of the local and of every peer's memory. Two kinds of memory:
  device  cudaMalloc + CUDA IPC (data, and flags that kernels poll);
  host    pinned host pages shared by the ranks of one machine (a file in /dev/shm that every
          rank maps and registers with cudaHostRegister): flags that a stream waits on with
          cuStreamWaitValue32, so the watchdog can release a timed-out wait with a CPU store.

Set-up is agreed, never assumed (`establish`): each rank tries its allocation and export, then
all ranks all-gather (ok, handle or error text); if any failed, every rank frees what it made
and raises CufluxError naming the failing ranks and why. Opening the peers' handles is followed
by a second agreement round the same way. Every collective is bounded (World/OpComm timeout).

Freeing: `close()` synchronises the device, waits (bounded) until every rank is done with the
buffer, closes the peers' handles, waits again and frees. `close(abort=True)` is local and
returns at once (see SymmetricBuffer.close).

A buffer is carved into named, typed regions by a `Layout` (128-byte aligned, the byte layout
written out by `Layout.describe()`), so one IPC handle serves an op's data and flags.

Signal pads are symmetric uint32 regions of epoch flags, zeroed at set-up and never reset: call
i of an op writes i, and a waiter compares with wrap-around arithmetic.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
import os
import secrets
import stat
from typing import Sequence

import numpy as np

from cuflux.errors import CommTimeoutError, CufluxError
from cuflux.nodes import require_one_node
from cuflux.resource import Closeable

__all__ = ["Layout", "SymmetricBuffer", "ALIGN_BYTES", "establish", "DeviceIpcMemory",
           "SharedHostMemory", "leaked_bytes"]

ALIGN_BYTES = 128


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def num_bytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize


class Layout:
    """A cursor that places named regions at 128-byte aligned offsets."""

    def __init__(self):
        self.regions: dict[str, Region] = {}
        self.num_bytes = 0

    def add(self, name: str, shape: Sequence[int] | int, dtype) -> Region:
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if name in self.regions:
            raise ValueError(f"Layout: region {name!r} added twice")
        offset = -(-self.num_bytes // ALIGN_BYTES) * ALIGN_BYTES
        reg = Region(name, offset, shape, np.dtype(dtype))
        self.regions[name] = reg
        self.num_bytes = offset + reg.num_bytes
        return reg

    def describe(self) -> str:
        return "\n".join(f"[{r.offset:>12}, {r.offset + r.num_bytes:>12}) {r.name}: "
                         f"{r.dtype.name}{list(r.shape)}" for r in self.regions.values())


# ---- the two kinds of memory -------------------------------------------------------------------
# Both offer what `establish` needs: alloc (zeroed) -> local pointer, export -> a picklable
# handle, open(handle) -> pointer to a peer's memory, close(pointer of a peer), free(local).
class DeviceIpcMemory:
    """cudaMalloc (IPC-exportable, never managed memory) + cudaIpc*MemHandle."""

    kind = "device"

    def __init__(self, device: int):
        self.device = device

    def alloc(self, num_bytes: int) -> int:
        import cupy
        from cupy.cuda import runtime

        with cupy.cuda.Device(self.device):
            ptr = runtime.malloc(num_bytes)
            try:
                # Zeroed before any peer can see it, without waiting for the caller's streams.
                s = cupy.cuda.Stream(non_blocking=True)
                runtime.memsetAsync(ptr, 0, num_bytes, s.ptr)
                s.synchronize()
            except BaseException:
                runtime.free(ptr)
                raise
        return ptr

    def export(self, ptr: int):
        from cupy.cuda import runtime

        return runtime.ipcGetMemHandle(ptr)

    def open(self, handle) -> int:
        import cupy
        from cupy.cuda import runtime

        with cupy.cuda.Device(self.device):
            return runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)

    def close(self, ptr: int) -> None:
        import cupy
        from cupy.cuda import runtime

        with cupy.cuda.Device(self.device):
            runtime.ipcCloseMemHandle(ptr)

    def free(self, ptr: int) -> None:
        import cupy
        from cupy.cuda import runtime

        with cupy.cuda.Device(self.device):
            runtime.free(ptr)

    def set_up(self, ptr: int) -> None:
        """Every peer has opened the handle (nothing to do for device memory)."""


_HOST_MAPS: dict[int, tuple] = {}  # SharedHostMemory's mappings, by device pointer


class SharedHostMemory:
    """Pinned host memory shared by the ranks of one machine.

    A rank creates a file in /dev/shm (exclusively, mode 0600, a random name), maps it and
    registers the mapping with CUDA (portable + mapped); the handle is the file's name. A peer
    opens the file (it must be a regular file of ours, of the right size), maps and registers
    it. Once every peer has opened it (`set_up`), the owner unlinks the name, so nothing stays
    in /dev/shm; the pages live while a rank maps them, so a rank unmapping its own copy never
    pulls memory from under a peer.
    """

    kind = "host"
    DIRECTORY = "/dev/shm"

    def __init__(self, device: int | None):
        self.device = device
        # device pointer -> (mmap, anchor, host ptr, path), one dict for the process: a mapping
        # lives until close() unregisters and unmaps it, never until its owner is collected
        # (an unmap left registered makes the next mapping at that address fail to register,
        # cudaErrorHostMemoryAlreadyRegistered, and a queued kernel could touch freed pages).
        self._maps = _HOST_MAPS

    def _map(self, fd: int, num_bytes: int, path: str | None) -> int:
        from cuflux import driver

        mm = mmap.mmap(fd, num_bytes)
        anchor = (ctypes.c_char * num_bytes).from_buffer(mm)
        host = ctypes.addressof(anchor)
        try:
            if self.device is None:
                dev = host
            else:
                import cupy

                with cupy.cuda.Device(self.device):
                    dev = driver.host_register(host, num_bytes)
        except BaseException:
            anchor = None  # release the buffer export, so the mapping can close
            mm.close()
            raise
        self._maps[dev] = (mm, anchor, host, path)
        return dev

    def alloc(self, num_bytes: int) -> int:
        num_bytes = -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        path = os.path.join(self.DIRECTORY, f"cuflux-{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, num_bytes)  # zero-filled
            return self._map(fd, num_bytes, path)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    def export(self, ptr: int):
        mm, _, _, path = self._maps[ptr]
        return (path, len(mm))

    def open(self, handle) -> int:
        path, num_bytes = handle
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != num_bytes:
                raise CufluxError(f"{path} is not a {num_bytes}-byte file of this user")
            return self._map(fd, num_bytes, None)
        finally:
            os.close(fd)

    def host_address(self, ptr: int) -> int:
        return self._maps[ptr][2]

    def close(self, ptr: int) -> None:
        mm, anchor, host, path = self._maps.pop(ptr)
        if self.device is not None:
            import cupy

            from cuflux import driver

            with cupy.cuda.Device(self.device):
                driver.host_unregister(host)
        del anchor
        mm.close()
        if path is not None:
            self._unlink(path)

    def free(self, ptr: int) -> None:
        self.close(ptr)

    def set_up(self, ptr: int) -> None:
        mm, anchor, host, path = self._maps[ptr]
        if path is not None:
            self._unlink(path)
            self._maps[ptr] = (mm, anchor, host, None)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# Allocations given up rather than freed (a peer might still write into them): they stay
# mapped until the process exits, when the driver reclaims them.
_LEAKED: list[tuple[str, int, int]] = []  # (kind, pointer, bytes)


def leaked_bytes() -> int:
    return sum(n for _, _, n in _LEAKED)


def _leak(kind: str, ptr: int, num_bytes: int) -> None:
    _LEAKED.append((kind, ptr, num_bytes))


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def establish(group, mem, num_bytes: int, what: str = "SymmetricBuffer", finish=None):
    """Allocate, exchange and open one symmetric allocation, agreed by every rank.

    group: the ranks (World, OpComm or anything with rank, size and a bounded allgather(obj,
    timeout_s, what)); mem: DeviceIpcMemory, SharedHostMemory or a test double; finish(ptrs):
    optional last local step (its failure counts as this rank's). Returns (local pointer, the W
    base pointers, the peers' pointers this rank opened). Raises CufluxError on every rank
    when any rank failed, naming them; CommTimeoutError when a peer never arrived.
    """
    me = group.rank
    base = None
    try:
        base = mem.alloc(num_bytes)
        mine = (True, mem.export(base))
    except Exception as e:
        mine = (False, _reason(e))
    try:
        everyone = group.allgather(mine, what=f"{what}: allocate")
    except BaseException:
        # No rank has passed this round, so none has opened our handle: freeing is safe.
        if base is not None:
            mem.free(base)
        raise
    failed = [(r, msg) for r, (ok, msg) in enumerate(everyone) if not ok]
    if failed:
        if base is not None:
            mem.free(base)
        raise CufluxError(f"{what}: allocation failed on rank(s) {[r for r, _ in failed]} "
                          f"({num_bytes} bytes): "
                          + "; ".join(f"rank {r}: {msg}" for r, msg in failed))
    opened: list[int] = []
    ptrs: list[int] = []
    error = None
    try:
        for r, (_, handle) in enumerate(everyone):
            if r == me:
                ptrs.append(base)
                continue
            try:
                p = mem.open(handle)
            except Exception as e:
                raise CufluxError(f"opening rank {r}'s handle: {_reason(e)}") from e
            opened.append(p)
            ptrs.append(p)
        if finish is not None:
            finish(ptrs)
    except Exception as e:
        error = str(e) if isinstance(e, CufluxError) else _reason(e)

    def close_opened():
        for p in opened:
            try:
                mem.close(p)
            except Exception:
                pass

    try:
        everyone = group.allgather((error is None, error), what=f"{what}: open")
    except BaseException:
        # A late peer may still complete this round (it has our message), return and write
        # into our memory: keep it (leak) rather than free memory a peer may write.
        close_opened()
        _leak(getattr(mem, "kind", "?"), base, num_bytes)
        raise
    failed = [(r, msg) for r, (ok, msg) in enumerate(everyone) if not ok]
    if failed:
        close_opened()
        mem.free(base)  # every rank saw the failure: none proceeds to write into it
        raise CufluxError(f"{what}: opening the peers' memory failed on rank(s) "
                          f"{[r for r, _ in failed]}: "
                          + "; ".join(f"rank {r}: {msg}" for r, msg in failed))
    mem.set_up(base)
    return base, ptrs, opened


def _stream_idle(s) -> bool:
    """cudaStreamQuery: has every piece of work queued on `s` finished? (never blocks)"""
    if hasattr(s, "done"):
        return bool(s.done)
    from cupy.cuda import runtime

    from cuflux import driver

    return runtime.streamQuery(driver.stream_handle(s)) == 0


class SymmetricBuffer(Closeable):
    """One symmetric allocation (optionally carved by a Layout) across the ranks of a World.

    world.alloc_symmetric(shape, dtype) makes a single-region buffer named "data".
    group: the ranks' collectives (an op's OpComm; default: the World's). memory: "device"
    (cudaMalloc + IPC) or "host" (pinned host pages shared within one machine; `host_view`
    gives the CPU a NumPy view of this rank's words).
    Views: `local(name)` (this rank) and `peer(rank, name)` (through the mapping); addresses:
    `ptr(rank, name)`; `ptrs_dev`: device uint64 array of the W base pointers.
    `close()` is collective and bounded; `close(abort=True)` is local (see close).
    """

    def __init__(self, world, layout: Layout, group=None, memory: str = "device"):
        if world.device is None:
            from cuflux.world import NoDeviceError

            raise NoDeviceError("SymmetricBuffer: needs a CUDA device; this rank has none")
        if memory not in ("device", "host"):
            raise ValueError(f"SymmetricBuffer: memory must be 'device' or 'host', got {memory!r}")
        require_one_node(world, "SymmetricBuffer")
        import cupy

        self.world, self.layout, self.memory = world, layout, memory
        self.group = group if group is not None else world
        self.num_bytes = max(ALIGN_BYTES, -(-layout.num_bytes // ALIGN_BYTES) * ALIGN_BYTES)
        self._closed = False
        self._opened: list[int] = []
        self.base_ptrs: list[int] = []
        if memory == "host":
            away = [l.peer for l in world.topology.links if not l.same_host]
            if away:
                raise CufluxError(f"SymmetricBuffer(memory='host'): ranks {away} run on another "
                                  "machine; host memory is shared within one machine only")
            self._mem = SharedHostMemory(world.device)
        else:
            self._mem = DeviceIpcMemory(world.device)

        # The n-th buffer of the group on every rank: named in every collective of its set-up
        # and close, so buffers made or closed in different orders raise instead of pairing.
        self.serial = getattr(self.group, "_symmetric_buffers", 0)
        self.group._symmetric_buffers = self.serial + 1
        self.name = f"SymmetricBuffer #{self.serial} ({memory}, {self.num_bytes} bytes)"

        def finish(ptrs):
            self.ptrs_dev = cupy.asarray(np.array(ptrs, dtype=np.uint64))

        with cupy.cuda.Device(world.device):
            self._base, self.base_ptrs, self._opened = establish(
                self.group, self._mem, self.num_bytes, self.name, finish)

    # ---- views and addresses ---------------------------------------------------------------
    def _region(self, name: str | None) -> Region:
        if name is None:
            if len(self.layout.regions) != 1:
                raise ValueError("SymmetricBuffer: name the region")
            return next(iter(self.layout.regions.values()))
        return self.layout.regions[name]

    def ptr(self, rank: int, name: str | None = None, byte_offset: int = 0) -> int:
        self._check_open()
        return self.base_ptrs[rank] + self._region(name).offset + byte_offset

    def peer(self, rank: int, name: str | None = None):
        """CuPy view of region `name` in rank's memory (this rank's own when rank == self)."""
        import cupy

        reg = self._region(name)
        mem = cupy.cuda.UnownedMemory(self.ptr(rank, name), reg.num_bytes, self,
                                      device_id=self.world.device)
        return cupy.ndarray(reg.shape, dtype=reg.dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def local(self, name: str | None = None):
        return self.peer(self.world.rank, name)

    def host_ptr(self, rank: int, name: str | None = None) -> int:
        """memory="host": host address, in this process, of region `name` of rank's pages."""
        if self.memory != "host":
            raise CufluxError("SymmetricBuffer.host_ptr: only for memory='host'")
        self._check_open()
        return self._mem.host_address(self.base_ptrs[rank]) + self._region(name).offset

    def host_view(self, name: str | None = None) -> np.ndarray:
        """memory="host": NumPy view of this rank's region (CPU loads and stores)."""
        if self.memory != "host":
            raise CufluxError("SymmetricBuffer.host_view: only for memory='host'")
        self._check_open()
        reg = self._region(name)
        host = self._mem.host_address(self._base) + reg.offset
        words = (ctypes.c_uint8 * reg.num_bytes).from_address(host)
        return np.frombuffer(words, dtype=reg.dtype).reshape(reg.shape)

    # ---- lifetime -----------------------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise CufluxError("SymmetricBuffer is closed")

    def close(self, abort: bool = False, streams=None) -> None:
        """Free the buffer; idempotent.

        abort=False (collective, bounded by the group's timeout): synchronise this rank's
        device, wait until every rank is done with the buffer, close the peers' handles, wait
        until every rank closed its handles, free. If the first wait times out the local
        allocation is kept (leaked: a peer may still write into it) and CommTimeoutError is
        raised; if the second does, it is freed (every peer was done with it) and raised.

        abort=True (local: no collective, returns at once): for a peer that is dead or late.
        `streams`: this rank's streams that may still touch the buffer. The peers' handles are
        closed only when every one of them is idle (unmapping under a queued copy would fault
        the context); with streams=None that cannot be known and they stay open. This rank's
        own allocation is never freed while a peer may still write into it: device memory is
        leaked (reclaimed when the process exits) unless the world has one rank; host memory
        is unmapped (the peers keep their own mappings of the pages).
        """
        if self._closed:
            return
        self._closed = True
        if abort:
            self._abort(streams)
        else:
            self._release()

    def __exit__(self, exc_type, exc, tb):
        # A peer known to be late or dead: a collective close would only wait for it again.
        self.close(abort=isinstance(exc, CommTimeoutError))

    def _abort(self, streams) -> None:
        local_idle = streams is not None and all(_stream_idle(s) for s in streams)
        if local_idle:
            for p in self._opened:
                try:
                    self._mem.close(p)
                except Exception:
                    pass
        else:
            for p in self._opened:
                _leak(self.memory + " (peer mapping)", p, self.num_bytes)
        if local_idle and (self.memory == "host" or self.group.size == 1):
            self._mem.free(self._base)
        else:
            _leak(self.memory, self._base, self.num_bytes)
        self._opened, self.base_ptrs = [], []

    def _synchronize_device(self) -> None:
        import cupy

        cupy.cuda.Device(self.world.device).synchronize()

    def _release(self) -> None:
        self._synchronize_device()
        try:
            self.group.barrier(what=f"{self.name} close: every rank done with it")
        except BaseException:
            self._abort(streams=())  # our own work is done: our mappings are idle
            raise
        for p in self._opened:
            self._mem.close(p)
        self._opened = []
        try:
            self.group.barrier(what=f"{self.name} close: every rank unmapped it")
        finally:
            # Every peer finished with it before the first barrier: safe even if this one
            # timed out.
            self._mem.free(self._base)
            self.base_ptrs = []


def alloc_symmetric(world, shape, dtype, group=None) -> SymmetricBuffer:
    layout = Layout()
    layout.add("data", shape, dtype)
    return SymmetricBuffer(world, layout, group=group)
