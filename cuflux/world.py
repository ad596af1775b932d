"""World: rank, size, device and topology of an mpi4py communicator (a TP group)."""
from __future__ import annotations

import hashlib
import os
import pickle
import socket
from typing import Any

from cuflux.errors import CufluxError
from cuflux.topology import PeerLink, Topology

__all__ = ["World", "init", "device_count"]


def device_count() -> int:
    """Number of visible CUDA devices; 0 when there is no GPU or no usable driver."""
    try:
        from cupy.cuda import runtime

        return runtime.getDeviceCount()
    except Exception:
        return 0


class World:
    """The ranks of one communicator and the GPU each uses.

    rank -> device is `local_rank % device_count`, so several ranks may share one GPU (how every
    multi-rank path is tested on a one-GPU machine). On a machine without a GPU `device` is
    None: the world still bootstraps (topology checks, argument checks), but allocating
    symmetric memory raises.
    """

    def __init__(self, comm=None):
        from mpi4py import MPI

        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = node.Get_rank()
        self.local_size: int = node.Get_size()
        node.Free()
        self.hostname = socket.gethostname()
        self.num_devices = device_count()
        self.device: int | None = self.local_rank % self.num_devices if self.num_devices else None
        self._closed_hooks: list = []
        if self.device is not None:
            import cupy

            cupy.cuda.Device(self.device).use()
        self.topology = self._discover()
        bad = self.allgather(self.topology.unreachable() if self.device is not None else [])
        pairs = sorted({tuple(sorted((r, p))) for r, peers in enumerate(bad) for p in peers})
        if pairs:
            raise CufluxError(
                "cuflux.init: these rank pairs cannot reach each other's GPU memory (no P2P "
                f"access; multi-node transport is not implemented yet): {pairs}")

    # ---- collectives on the host ------------------------------------------------------------
    def barrier(self) -> None:
        self.comm.Barrier()

    def allgather(self, obj: Any) -> list:
        return self.comm.allgather(obj)

    def check_same(self, value: Any, what: str) -> None:
        """Raise on every rank if `value` differs between ranks (cheap: compares a hash)."""
        digest = hashlib.sha1(pickle.dumps(value)).hexdigest()
        digests = self.allgather(digest)
        if len(set(digests)) > 1:
            values = self.allgather(value)
            raise ValueError(f"{what} differs between ranks: "
                             + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)))

    # ---- symmetric memory (collective calls) ------------------------------------------------
    def alloc_symmetric(self, shape, dtype):
        """Same-size buffer on every rank, mapped into every peer: a SymmetricBuffer."""
        from cuflux.symmetric import alloc_symmetric

        return alloc_symmetric(self, shape, dtype)

    def alloc_layout(self, layout):
        """Symmetric buffer carved into named regions by a cuflux.symmetric.Layout."""
        from cuflux.symmetric import SymmetricBuffer

        return SymmetricBuffer(self, layout)

    # ---- topology --------------------------------------------------------------------------
    def _pci_bus_id(self) -> str | None:
        if self.device is None:
            return None
        from cupy.cuda import runtime

        return runtime.deviceGetPCIBusId(self.device)

    def _discover(self) -> Topology:
        me = (self.hostname, self._pci_bus_id())
        everyone = self.allgather(me)
        links = []
        for peer, (host, bus) in enumerate(everyone):
            same_host = host == self.hostname
            same_gpu = same_host and bus is not None and bus == me[1]
            if peer == self.rank:
                links.append(PeerLink(peer, True, True, True, "self"))
            elif same_gpu:
                links.append(PeerLink(peer, True, True, True, "same_gpu"))
            elif same_host and bus is not None and me[1] is not None:
                links.append(self._probe_link(peer, bus))
            else:
                links.append(PeerLink(peer, same_host, False, False, "none"))
        numa = int(os.environ.get("CUFLUX_NUMA_SIZE", "0"))
        return Topology(self.rank, tuple(links), numa)

    def _probe_link(self, peer: int, bus: str) -> PeerLink:
        from cupy.cuda import runtime

        peer_dev = runtime.deviceGetByPCIBusId(bus)
        p2p = bool(runtime.deviceCanAccessPeer(self.device, peer_dev))
        link = "none"
        if p2p:
            link = "nvlink" if _native_atomics(self.device, peer_dev) else "pcie"
        return PeerLink(peer, True, False, p2p, link)

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"device={self.device}, topology={self.topology.kind})")


def _native_atomics(dev: int, peer_dev: int) -> bool:
    """NVLink peers support native atomics; PCIe peers (as a rule) do not."""
    try:
        from cuda.bindings import runtime as rt

        err, val = rt.cudaDeviceGetP2PAttribute(
            rt.cudaDeviceP2PAttr.cudaDevP2PAttrNativeAtomicSupported, dev, peer_dev)
        return err == rt.cudaError_t.cudaSuccess and val == 1
    except Exception:
        return False


def init(comm=None) -> World:
    """Bootstrap cuflux on an mpi4py communicator (MPI.COMM_WORLD by default)."""
    return World(comm)

