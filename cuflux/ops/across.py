"""AllReduce and AllGather on a World of several nodes (issue 20): the node's IPC op, then the rail.

Built explicitly for now (`AllReduceAcrossNodes(world, ...)` takes AllReduce's arguments): until
their GPU tests have run, `cuflux.AllReduce` / `cuflux.AllGather` on a World of several nodes
still refuse it (require_one_node), as every other op does. Each rank gets its node (a World of one node, where the IPC op runs unchanged) and its rail (rank i of
every node: cuflux.rail, NCCL between GPUs of their own, else staged through the host) from
World.split_nodes().

  AllReduceAcrossNodes  x (n elements): the node's AllReduce gives every rank its node's sum;
                        node rank i all-reduces share i of the n elements (row_shards over the
                        node's k ranks) across its rail, so each rank sends n / k elements
                        between nodes (nodes.allreduce_plan); a second node AllReduce of every
                        rank's share, zeros elsewhere, puts the whole sum on every rank (adding
                        zeros is exact). Each rank of a node holds the same bits. The node moves
                        the data twice where an all-gather would move it once: later work.
  AllGatherAcrossNodes  x [rows, cols]: the rail gathers the rows of this rank's rail-mates
                        (one per node), the node's AllGather brings every node rank's gather,
                        and one copy puts the blocks in World-rank order.

Every wait is bounded: the node ops' own, and the rail's (`synchronize()` waits for the rail's
queued work at most timeout_s; a NCCL rail is aborted then). Arguments are checked, and agreed
across every rank (bounded, once per size), before anything is queued.
"""
from __future__ import annotations

import numpy as np

from cuflux.arrays import as_cupy, check_array, dtype_info, stream_of, to_caller
from cuflux.errors import CufluxError
from cuflux.nodes import row_shards
from cuflux.ops.base import DEFAULT_TIMEOUT_S, on_op_device, on_world_device, require_world_device
from cuflux.rail import make_rail
from cuflux.resource import Closeable

__all__ = ["AllReduceAcrossNodes", "AllGatherAcrossNodes"]


class _AcrossNodes(Closeable):
    """A node op and a rail of the World's: built together, closed together, and the one place
    that agrees a call's sizes across every rank of the World (once per size)."""

    op = ""

    def _split(self, world, timeout_s: float, rail: str, args: tuple) -> None:
        """The node and the rail, once every rank passed the same arguments (`args`, checked
        across the World: the node op checks them again only within its node)."""
        require_world_device(world, self.op)
        world.check_same(args, f"{self.op} arguments", timeout_s)
        self.world, self.timeout_s = world, timeout_s
        self.node, self.group = world.split_nodes(timeout_s)
        self.inner = None
        try:
            self.rail = make_rail(self.group, world.device, timeout_s, rail)
        except BaseException:
            self.group.free()
            self.node.close()
            raise
        self._agreed: set = set()

    def _check_open(self) -> None:
        if self._closed:
            raise CufluxError(f"{self.op}: the op is closed")

    def _agree(self, key, what: str) -> None:
        if key not in self._agreed:
            self.world.check_same(key, f"{self.op}: {what}", self.timeout_s)
            self._agreed.add(key)

    def synchronize(self, stream=None) -> None:
        """Wait for this rank's work on `stream` (bounded: CommTimeoutError)."""
        with self.world.device_context():
            self.rail.wait(stream_of(stream), f"{self.op} rail")
            self.inner.synchronize(stream)

    def _release(self, abort: bool = False) -> None:
        """Collective close (the node op's), or with abort local and at once: the node op
        aborted, the rail dropped (a NCCL one aborted)."""
        try:
            if self.inner is not None:
                self.inner.abort() if abort else self.inner.close()
        finally:
            self.rail.abort() if abort else self.rail.close()
            self.group.free()
            self.node.close()

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._release(abort=True)


class AllReduceAcrossNodes(_AcrossNodes):
    """cuflux.AllReduce on a World of several nodes (see the module's docstring); the same
    arguments, plus rail ("auto", "nccl" or "host": cuflux.rail.make_rail)."""

    op = "AllReduce"

    @on_world_device
    def __init__(self, world, max_elems: int, dtype, algo: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_blocks: int | None = None,
                 rail: str = "auto"):
        from cuflux.ops.allreduce import AllReduce

        self._split(world, timeout_s, rail,
                    (max_elems, dtype_info(dtype, op=self.op).name, algo, max_blocks, rail))
        try:
            self.inner = AllReduce(self.node, max_elems, dtype, algo, timeout_s, max_blocks)
            import cupy

            self.dtype, self.max_elems = self.inner.dtype, self.inner.max_elems
            # The node's sum, then this rank's share of the whole sum; and that share alone
            # (zeros elsewhere) for the second node AllReduce.
            self._sum = cupy.zeros(self.max_elems, self.dtype.storage)
            self._own = cupy.zeros(self.max_elems, self.dtype.storage)
        except BaseException:
            self._release()
            raise

    @on_op_device
    def __call__(self, x, out=None, stream=None, algo: str | None = None):
        """x: any shape, C-contiguous, x.size <= max_elems, the same on every rank -> out
        (same shape) = the sum over every rank of the World."""
        import cupy

        self._check_open()
        x_in, out_in = x, out
        x = check_array(as_cupy(x, "x", self.op), name="x", op=self.op, dtype=self.dtype,
                        device=self.world.device)
        if x.size > self.max_elems:
            raise ValueError(f"{self.op}: x has {x.size} elements, more than "
                             f"max_elems={self.max_elems}")
        s = stream_of(stream, x_in)
        if out is None:
            out = cupy.empty(x.shape, self.dtype.storage)
        else:
            out = check_array(as_cupy(out, "out", self.op), name="out", op=self.op,
                              shape=x.shape, dtype=self.dtype, device=self.world.device)
        n = x.size
        self._agree((n, algo), "x.size and algo of the call")
        if n:
            lo, hi = row_shards(n, self.node.size)[self.node.rank]
            whole, own = self._sum[:n], self._own[:n]
            self.inner(x.reshape(-1), out=whole, stream=s, algo=algo)
            self.rail.all_reduce(whole[lo:hi], whole[lo:hi], s)
            with s:
                own.fill(0)
                own[lo:hi] = whole[lo:hi]
            self.inner(own, out=out.reshape(-1), stream=s, algo=algo)
        return to_caller(out, x_in, out_in)


class AllGatherAcrossNodes(_AcrossNodes):
    """cuflux.AllGather on a World of several nodes (see the module's docstring); the same
    arguments, plus rail ("auto", "nccl" or "host")."""

    op = "AllGather"

    @on_world_device
    def __init__(self, world, max_rows: int, cols: int, dtype, mode: str = "pull",
                 chunk_rows: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 wait: str = "stream", name: str = "AllGather", rail: str = "auto"):
        from cuflux.ops.allgather import AllGather

        self.op = name
        self._split(world, timeout_s, rail, (max_rows, cols, dtype_info(dtype, op=name).name,
                                             mode, chunk_rows, wait, rail))
        try:
            nodes = world.nodes.num_nodes
            self.inner = AllGather(self.node, nodes * max_rows, cols, dtype, mode, chunk_rows,
                                   timeout_s, wait, name)
            import cupy

            self.dtype, self.cols, self.max_rows = self.inner.dtype, cols, max_rows
            k = self.node.size
            self._rail_rows = cupy.empty((nodes * max_rows, cols), self.dtype.storage)
            self._node_rows = cupy.empty((k * nodes * max_rows, cols), self.dtype.storage)
            # Block b = a * nodes + j of the node's gather holds the rows of node rank a's rail
            # member j: World rank rails[a][j]. The World's order takes block src[r] for rank r.
            rails = self.node.allgather(self.group.allgather(world.rank, timeout_s, "rail ranks"),
                                        timeout_s, f"{name} rails")
            src = np.empty(world.size, np.int64)
            for a, members in enumerate(rails):
                for j, r in enumerate(members):
                    src[r] = a * nodes + j
            self._src = cupy.asarray(src)
        except BaseException:
            self._release()
            raise

    @on_op_device
    def __call__(self, x, out=None, stream=None):
        """x [rows, cols] (rows <= max_rows, the same on every rank) -> [W * rows, cols] in
        World-rank order."""
        import cupy

        self._check_open()
        x_in, out_in = x, out
        x = check_array(as_cupy(x, "x", self.op), name="x", op=self.op, ndim=2,
                        dtype=self.dtype, device=self.world.device)
        rows, W = x.shape[0], self.world.size
        if x.shape[1] != self.cols or rows > self.max_rows:
            raise ValueError(f"{self.op}: x must be [rows <= max_rows={self.max_rows}, "
                             f"cols={self.cols}], got shape {tuple(x.shape)}")
        s = stream_of(stream, x_in)
        if out is None:
            out = cupy.empty((W * rows, self.cols), self.dtype.storage)
        else:
            out = check_array(as_cupy(out, "out", self.op), name="out", op=self.op,
                              shape=(W * rows, self.cols), dtype=self.dtype,
                              device=self.world.device)
        self._agree(rows, "rows of the call")
        if rows:
            nodes, k = self.world.nodes.num_nodes, self.node.size
            mates = self._rail_rows[:nodes * rows]
            gathered = self._node_rows[:k * nodes * rows]
            self.rail.all_gather(x, mates, s)
            self.inner(mates, out=gathered, stream=s)
            with s:
                cupy.take(gathered.reshape(k * nodes, rows, self.cols), self._src, axis=0,
                          out=out.reshape(W, rows, self.cols))
        return to_caller(out, x_in, out_in)
