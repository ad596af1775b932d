"""Symmetric memory: the same allocation on every rank, each mapped into every peer.

Every rank cudaMallocs the same number of bytes, exports an IPC handle, all-gathers the
handles over MPI and opens every peer's. The result is W base pointers per buffer (also as a
device array for kernels) and CuPy views of the local and of every peer's memory.

A buffer is carved into named, typed regions by a `Layout` (128-byte aligned, the byte layout
written out by `Layout.describe()`), so one IPC handle serves an op's data and flags.

Signal pads are symmetric uint32 regions of epoch flags, zeroed at set-up and never reset: call
i of an op writes i, and a waiter compares with wrap-around arithmetic.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from cuflux.errors import CufluxError
from cuflux.resource import Closeable

__all__ = ["Layout", "SymmetricBuffer", "ALIGN_BYTES"]

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


class SymmetricBuffer(Closeable):
    """One symmetric allocation (optionally carved by a Layout) across the ranks of a World.

    world.alloc_symmetric(shape, dtype) makes a single-region buffer named "data".
    Views: `local(name)` (this rank) and `peer(rank, name)` (through the IPC mapping);
    addresses: `ptr(rank, name)`; `ptrs_dev`: device uint64 array of the W base pointers.
    `close()` (idempotent, also on context exit) synchronises, waits for every rank, closes
    the peers' handles, waits again and frees, so nothing is freed while a peer may use it.
    """

    def __init__(self, world, layout: Layout):
        if world.device is None:
            raise CufluxError("symmetric memory needs a CUDA device; this rank has none")
        import cupy
        from cupy.cuda import runtime

        self.world, self.layout = world, layout
        self.num_bytes = max(ALIGN_BYTES, -(-layout.num_bytes // ALIGN_BYTES) * ALIGN_BYTES)
        self._closed = False
        with cupy.cuda.Device(world.device):
            self._base = runtime.malloc(self.num_bytes)  # plain cudaMalloc: IPC-exportable
            runtime.memset(self._base, 0, self.num_bytes)
            runtime.deviceSynchronize()
            handle = runtime.ipcGetMemHandle(self._base)
        handles = world.allgather(handle)
        self.base_ptrs: list[int] = []
        self._opened: list[int] = []
        try:
            for r, h in enumerate(handles):
                if r == world.rank:
                    self.base_ptrs.append(self._base)
                else:
                    p = runtime.ipcOpenMemHandle(h, runtime.cudaIpcMemLazyEnablePeerAccess)
                    self._opened.append(p)
                    self.base_ptrs.append(p)
        except Exception as e:
            for p in self._opened:
                runtime.ipcCloseMemHandle(p)
            runtime.free(self._base)
            self._closed = True
            raise CufluxError(f"rank {world.rank}: opening a peer's IPC handle failed: {e}") from e
        self.ptrs_dev = cupy.asarray(np.array(self.base_ptrs, dtype=np.uint64))
        world.barrier()  # every rank has opened every handle before anyone writes

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

    # ---- lifetime -----------------------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise CufluxError("SymmetricBuffer is closed")

    def _release(self) -> None:
        from cupy.cuda import runtime

        runtime.deviceSynchronize()
        self.world.barrier()  # no peer still reads or writes our memory
        for p in self._opened:
            runtime.ipcCloseMemHandle(p)
        self.world.barrier()  # every peer closed its mapping of our memory
        runtime.free(self._base)
        self._opened, self.base_ptrs = [], []


def alloc_symmetric(world, shape, dtype) -> SymmetricBuffer:
    layout = Layout()
    layout.add("data", shape, dtype)
    return SymmetricBuffer(world, layout)
