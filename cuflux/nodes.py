"""Nodes of a World, and how each op's data crosses them (the plans of issue #20).

A *node* is a set of ranks that all map each other's GPU memory (CUDA IPC: one host, P2P
between every pair). Inside a node the ops keep their IPC paths; between nodes the data goes
through NCCL. Every node must hold the same number of ranks (the hierarchical plans pair rank i
of one node with rank i of every other: its *rail*).

`node_layout(hosts, p2p, node_size)` finds the nodes from what every rank sees (its host and
its P2P row); `node_size` (World(node_size=...) or CUFLUX_NODE_SIZE) splits each one into
smaller nodes of consecutive ranks, so one host emulates several nodes (two GPUs as two nodes of
one). `World.split_nodes()` gives each rank its node (a World of one node, where the IPC paths
run) and its rail (a host group, the ranks a NCCL communicator will span). The plans below
are pure functions of a NodeLayout: which rows or chunks each rank exchanges with whom, in
which step, over IPC or NCCL. They hold no memory and launch nothing;
tests/test_nodes.py plays each one on NumPy arrays over fake layouts (2 x 1, 2 x 2, 2 x 4,
4 x 2) and checks the result against the op's definition.

    AllReduce (+RMSNorm)   reduce-scatter in the node, all-reduce of the owned shard across the
                           rail, all-gather in the node (node_size x less NCCL traffic than a
                           flat all-reduce; the norm runs on whole rows, so shards are row sets)
    GemmReduceScatter      the GEMM's rows of every owner reduced in the node first (each
                           local rank sums the rows owned by its rail), then reduce-scattered
                           across the rail
    AllGather(+Gemm)       each rank's rows all-gathered across its rail (NCCL), then every
                           node-local rank's rail rows pulled over IPC; a chunk's flag is raised
                           when its copy lands, so the GEMM takes chunks in arrival order
    All2AllHeads           two hops: across the rail (NCCL send/recv, one message per rail
                           peer) the head groups of the peer's whole node, then the node's
                           IPC All2AllHeads hands each rank its head group
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from cuflux.errors import CufluxError

__all__ = ["NodeLayout", "Step", "node_layout", "require_one_node", "row_shards",
           "allreduce_plan", "gemm_rs_plan", "allgather_plan", "all2all_plan",
           "all2all_tokens", "all2all_rows"]


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """nodes[n] = the ranks of node n in rank order; every node holds node_size ranks."""

    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        sizes = {len(n) for n in self.nodes}
        if len(sizes) != 1 or 0 in sizes:
            raise CufluxError(f"cuflux: every node must hold the same number of ranks (rank i of "
                              f"each node pairs with rank i of the others); nodes: "
                              f"{[list(n) for n in self.nodes]}")
        ranks = sorted(r for n in self.nodes for r in n)
        if ranks != list(range(len(ranks))):
            raise CufluxError(f"cuflux: nodes must hold every rank once, got "
                              f"{[list(n) for n in self.nodes]}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.node_size

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def node_size(self) -> int:
        return len(self.nodes[0])

    def node_of(self, rank: int) -> int:
        return next(i for i, n in enumerate(self.nodes) if rank in n)

    def local_index(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def node_peers(self, rank: int) -> tuple[int, ...]:
        """The ranks of this rank's node (itself included): reached over IPC."""
        return self.nodes[self.node_of(rank)]

    def rail(self, rank: int) -> tuple[int, ...]:
        """The ranks with this rank's local index, one per node, in node order: the group its
        NCCL communicator spans."""
        i = self.local_index(rank)
        return tuple(n[i] for n in self.nodes)


def _islands(ranks: Sequence[int], p2p) -> list[tuple[int, ...]]:
    """Ranks of one host split into groups that all reach each other (cliques of p2p); a rank
    that reaches part of a group only is refused (the IPC paths need every pair)."""
    left, out = list(ranks), []
    while left:
        first = left[0]
        group = tuple(r for r in left if r == first or (p2p[first][r] and p2p[r][first]))
        for a in group:
            for b in group:
                if a != b and not (p2p[a][b] and p2p[b][a]):
                    raise CufluxError(
                        f"cuflux: ranks {a} and {b} both reach rank {first} by P2P but not each "
                        f"other: no node can hold all three (IPC needs every pair)")
        out.append(group)
        left = [r for r in left if r not in group]
    return out


def node_layout(hosts: Sequence[str], p2p, node_size: int | None = None) -> NodeLayout:
    """The nodes of a world: hosts[r] is rank r's host, p2p[r][p] whether rank r maps rank p's
    GPU memory (True on the diagonal and for ranks sharing a GPU). node_size, when given, splits
    every natural node into nodes of that many consecutive ranks (it must divide each)."""
    W = len(hosts)
    if node_size is not None and (type(node_size) is not int or node_size < 1):
        raise ValueError(f"cuflux: node_size must be an int >= 1, got {node_size!r}")
    natural = []
    for host in dict.fromkeys(hosts):  # hosts in order of their first rank
        natural += _islands([r for r in range(W) if hosts[r] == host], p2p)
    natural.sort()
    if node_size is None:
        return NodeLayout(tuple(natural))
    nodes = []
    for n in natural:
        if len(n) % node_size:
            raise CufluxError(f"cuflux: node_size={node_size} does not divide the node "
                              f"{list(n)} ({len(n)} ranks that reach each other by P2P)")
        nodes += [n[i:i + node_size] for i in range(0, len(n), node_size)]
    return NodeLayout(tuple(sorted(nodes)))


def require_one_node(world, what: str) -> None:
    """CufluxError where the World spans several nodes and `what` (symmetric memory, an op's
    one-node form) reaches peers through CUDA IPC only. The ops themselves build their
    cross-node forms on such a World (cuflux.ops.across). Every rank sees the same layout, so
    every rank raises, before anything is allocated."""
    nodes = getattr(world, "nodes", None)  # test doubles of a World may have none
    if nodes is not None and nodes.num_nodes > 1:
        raise CufluxError(
            f"{what}: this World spans {nodes.num_nodes} nodes of {nodes.node_size} ranks "
            f"({[list(n) for n in nodes.nodes]}); {what} reaches its peers through CUDA IPC, "
            f"within one node: build it on a node's World (World.split_nodes() gives each "
            f"rank its node)")


# ---- plans ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a plan as seen by one rank: `what` it does with `group` (ranks, in the order
    the collective uses them) over `via` ("ipc" or "nccl"), on `rows` (range of rows of the
    op's tensor, or None for the step's whole buffer)."""

    what: str
    via: str
    group: tuple[int, ...]
    rows: tuple[int, int] | None = None


def row_shards(rows: int, parts: int) -> list[tuple[int, int]]:
    """rows split into `parts` contiguous ranges, the first `rows % parts` one row longer
    (whole rows: AllReduceRMSNorm normalises rows, so no row is split between ranks)."""
    base, extra = divmod(rows, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (i < extra)
        out.append((lo, hi))
        lo = hi
    return out


def allreduce_plan(layout: NodeLayout, rank: int, rows: int) -> list[Step]:
    """Sum over every rank of x [rows, ...], on every rank: reduce-scatter of row shards in the
    node (local rank i owns shard i), all-reduce of shard i across the rail, all-gather of the
    shards in the node. One node: one IPC all-reduce (today's kernels)."""
    node = layout.node_peers(rank)
    if layout.num_nodes == 1:
        return [Step("allreduce", "ipc", node, (0, rows))]
    shard = row_shards(rows, layout.node_size)[layout.local_index(rank)]
    return [Step("reduce_scatter", "ipc", node, None),
            Step("allreduce", "nccl", layout.rail(rank), shard),
            Step("allgather", "ipc", node, None)]


def gemm_rs_plan(layout: NodeLayout, rank: int, M: int) -> list[Step]:
    """GemmReduceScatter's rows: rank o receives rows [o M/W, (o+1) M/W) of the sum over ranks.
    Step 1 (IPC, in the node): this rank sums, over its node, the rows of every owner on its
    rail (one block per node, in rail order); step 2 (NCCL, across the rail): those blocks are
    reduce-scattered, block n to the rail's rank of node n. Each owner's rows cross the network
    once per node instead of once per rank."""
    W = layout.world_size
    if M % W:
        raise ValueError(f"GemmReduceScatter: M={M} is not divisible by the world size {W}")
    per = M // W
    rail = layout.rail(rank)
    blocks = [(o * per, (o + 1) * per) for o in rail]
    steps = [Step("reduce_node_rows", "ipc", layout.node_peers(rank), b) for b in blocks]
    if layout.num_nodes > 1:
        steps.append(Step("reduce_scatter", "nccl", rail, None))
    return steps


def allgather_plan(layout: NodeLayout, rank: int) -> list[Step]:
    """Every rank's block of rows on every rank. Step 1 (NCCL): all-gather across the rail,
    which brings the blocks of this rank's rail; step 2 (IPC): from each node peer, the blocks
    its rail brought (its own node's block first: the peer has it before NCCL does anything,
    so a GEMM consuming in arrival order starts on node-local rows). `rows` is the source rank
    of each block (row units of one rank's block)."""
    steps = []
    node = layout.node_peers(rank)
    for p in node:  # node-local blocks: copy engines, as today
        if p != rank:
            steps.append(Step("copy_block", "ipc", (p,), (p, p + 1)))
    if layout.num_nodes == 1:
        return steps
    rail = layout.rail(rank)
    steps.append(Step("allgather", "nccl", rail, None))
    for p in node:  # then the remote blocks: the ones on this rank's rail came by NCCL
        for src in layout.rail(p):
            if layout.node_of(src) == layout.node_of(rank):
                continue
            if p != rank:
                steps.append(Step("copy_block", "ipc", (p,), (src, src + 1)))
    return steps


def all2all_plan(layout: NodeLayout, rails, rank: int) -> tuple[tuple[int, ...], ...]:
    """All2AllHeads across nodes in two hops (rails[a]: the World ranks of node-local index a's
    rail, in that rail's order; the same on every rank). Hop 1, the rail: this rank sends to
    its rail rank j its tokens with the head groups of every rank of j's node, in node order
    (returned: those ranks, per rail rank j). Hop 2, the node: the node's All2AllHeads with
    node_size * H / W heads, node rank a's tokens being the blocks its rail brought
    (all2all_rows says in which order), hands node rank b its head group. Every byte crosses
    the network once, in one message per pair of rail ranks (not one per pair of World ranks,
    and no communicator spanning the World), and moves once more over IPC."""
    mine = rails[layout.local_index(rank)]
    if rank not in mine:
        raise CufluxError(f"all2all_plan: rank {rank} is not on its rail {list(mine)}")
    return tuple(layout.node_peers(m) for m in mine)


def all2all_tokens(rails, tokens, batch: int) -> tuple[int, ...]:
    """Hop 2's token count of each node rank a: its rail's blocks, batch folded into tokens."""
    return tuple(batch * sum(tokens[w] for w in members) for members in rails)


def all2all_rows(rails, tokens, batch: int):
    """Where hop 2's output rows belong (the same on every rank): row i (node rank a, then its
    rail's ranks in rail order, then batch, then token) is row q[i] of the op's output
    [batch, S] flattened (World ranks' tokens one after another). A NumPy int64 array."""
    import numpy as np

    prefix = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    S = int(prefix[-1])
    parts = [(np.arange(batch)[:, None] * S + prefix[w] + np.arange(tokens[w])[None, :]).ravel()
             for members in rails for w in members]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
