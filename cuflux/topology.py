"""Which peers a rank can reach, over what link, and the transfer orders SPEC.md asks for.

A transfer order is a list of *stages*; the peers inside one stage are served at the same time
(one copy stream each), stages run one after another. Every order starts from rank+1 so that
no two ranks fetch from the same peer at the same moment.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["PeerLink", "Topology", "full_mesh_order", "ring_order", "ring2d_order",
           "transfer_order"]


@dataclasses.dataclass(frozen=True)
class PeerLink:
    peer: int
    same_host: bool
    same_gpu: bool        # both ranks run on one device (ranks sharing a GPU)
    p2p: bool             # this rank's device can load/store the peer's memory
    link: str             # "self", "same_gpu", "nvlink", "pcie", "none"


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int
    links: tuple[PeerLink, ...]
    numa_size: int = 0    # ranks per NUMA domain when known (0: one domain)

    @property
    def all_p2p(self) -> bool:
        return all(l.p2p for l in self.links)

    @property
    def kind(self) -> str:
        """"nvlink" (full mesh), "pcie" (ring), "pcie_numa" (2-D ring) or "single"."""
        kinds = {l.link for l in self.links if l.peer != self.rank}
        if not kinds or kinds <= {"same_gpu"}:
            return "single" if not kinds else "nvlink"
        if "pcie" in kinds:
            return "pcie_numa" if self.numa_size and self.numa_size < len(self.links) else "pcie"
        return "nvlink"

    def unreachable(self) -> list[int]:
        return [l.peer for l in self.links if not l.p2p]


def full_mesh_order(rank: int, world_size: int) -> list[list[int]]:
    """NVLink: fetch every peer at once (one stage), starting from rank+1."""
    peers = [(rank + i) % world_size for i in range(1, world_size)]
    return [peers] if peers else []


def ring_order(rank: int, world_size: int) -> list[list[int]]:
    """PCIe: one peer at a time, nearest on the ring first (rank-1, rank-2, ...)."""
    return [[(rank - i) % world_size] for i in range(1, world_size)]


def ring2d_order(rank: int, world_size: int, group_size: int) -> list[list[int]]:
    """Two levels (NUMA domains of `group_size` ranks). Stage 0: the peers with this rank's
    local index in the other domains (the slow inter-domain transfers, all at once). Stage i:
    local ring step i inside this domain overlapped with the same step in the other domains."""
    if group_size <= 0 or world_size % group_size:
        raise ValueError(f"ring2d_order: world_size {world_size} is not a multiple of "
                         f"group_size {group_size}")
    group, local = divmod(rank, group_size)
    num_groups = world_size // group_size
    others = [(group + g) % num_groups for g in range(1, num_groups)]
    stages = [[g * group_size + local for g in others]] if others else []
    for i in range(1, group_size):
        idx = (local - i) % group_size
        stages.append([group * group_size + idx] + [g * group_size + idx for g in others])
    return stages


def transfer_order(topo: Topology, world_size: int) -> list[list[int]]:
    kind = topo.kind
    if kind == "pcie":
        return ring_order(topo.rank, world_size)
    if kind == "pcie_numa":
        return ring2d_order(topo.rank, world_size, topo.numa_size)
    return full_mesh_order(topo.rank, world_size)


def flatten(order: Sequence[Sequence[int]]) -> list[int]:
    return [p for stage in order for p in stage]
