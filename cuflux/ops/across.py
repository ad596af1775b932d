"""The ops on a World of several nodes (issue 20): each node's IPC op, and a rail between nodes.

`cuflux.AllReduce(world, ...)` on a World of several nodes builds `AllReduceAcrossNodes(world,
...)` with the same arguments (CommOp.__new__), and so on for every op; each also takes
rail="auto" | "nccl" | "host" when built by its own name. Each rank gets its node (a World of
one node, where the IPC ops run unchanged) and its rail (rank i of every node: cuflux.rail,
NCCL between GPUs of their own, else staged through the host) from World.split_nodes().
GemmReduceScatter's arguments all reach its node op (reduce, w1, config and route choose the
node's kernel as they do on one node); AllGatherGemm's config and route, which choose its fused
kernel, are checked as there and have nothing to choose here: its cross-node form is composed
(AllGather across nodes and cuflux.gemm, overlapped: below).

  AllReduceAcrossNodes  x (n elements): the node's AllReduce runs a two-shot call in its two
                        halves (AllReduce.reduce_scatter, all_gather). The first leaves node
                        rank i the node's sum of its share i (allreduce.plain_share: about
                        n / k elements of the node's k ranks); rank i all-reduces that share
                        in place across its rail, so each rank sends n / k elements between
                        nodes; the second half gathers every share of the node. The node
                        moves what one two-shot AllReduce moves; every rank holds the same
                        bits.
  AllGatherAcrossNodes  x [rows, cols]: the rail gathers the rows of this rank's rail-mates
                        (one per node), the node's AllGather brings every node rank's gather,
                        and one copy puts the blocks in World-rank order.
  All2AllHeadsAcrossNodes  two hops (nodes.all2all_plan): across the rail, each rank sends
                        a rail peer its tokens with the head groups of that peer's whole node;
                        the node's All2AllHeads (node_size * H / W heads, the rail's blocks
                        as its tokens) hands each rank its head group; one copy puts the
                        tokens in World-rank order. gather_heads runs the same backwards.
  GemmReduceScatterAcrossNodes  a's rows in the order of their owners' rails, the node's
                        GemmReduceScatter (its fused kernel), then the rail's reduce-scatter:
                        each owner's rows cross the network once per node.
  AllGatherGemmAcrossNodes  the GEMM in row parts as the gather lands them: this node's
                        rows first (gathered inside the node, or the rank's own shard on a
                        node of one rank) while the rail gathers across nodes on a side
                        stream, then the other nodes' rows (AllGatherAcrossNodes.gather_parts).
  AllReduceRMSNormAcrossNodes  AllReduce above composed with the W = 1 norm kernel, correct
                        first (nothing overlapped yet).

Every wait is bounded: the node ops' own, and the rail's (`synchronize()` waits for the rail's
queued work at most timeout_s; a NCCL rail is aborted then). Arguments are checked, and agreed
across every rank (bounded, once per size), before anything is queued.
"""
from __future__ import annotations

import numpy as np

from cuflux.arrays import as_cupy, check_array, dtype_info, stream_of, to_caller
from cuflux.errors import CufluxError
from cuflux.ops.base import (DEFAULT_TIMEOUT_S, IndexCache, on_op_device, on_world_device,
                              require_world_device)
from cuflux.rail import make_rail
from cuflux.resource import Closeable

__all__ = ["AllReduceAcrossNodes", "AllGatherAcrossNodes", "All2AllHeadsAcrossNodes",
           "AllReduceRMSNormAcrossNodes", "AllGatherGemmAcrossNodes",
           "GemmReduceScatterAcrossNodes"]


class _AcrossNodes(Closeable):
    """A node op and a rail of the World's: built together, closed together, and the one place
    that agrees a call's sizes across every rank of the World (once per size)."""

    op = ""

    def _split(self, world, timeout_s: float, rail: str, args: tuple) -> None:
        """The node and the rail, once every rank passed the same arguments (`args`, checked
        across the World: the node op checks them again only within its node)."""
        require_world_device(world, self.op)
        world.check_same(args, f"{self.op} arguments", timeout_s)
        self.world, self.timeout_s, self.inner = world, timeout_s, None
        self.comm = world.sub_comm(self.op, timeout_s)  # the calls' agreements: the op's own
        try:
            self.node, self.group = world.split_nodes(timeout_s)
        except BaseException:
            self.comm.free()
            raise
        try:
            self.rail = make_rail(self.group, world.device, timeout_s, rail)
        except BaseException:
            self.group.free()
            self.node.close()
            self.comm.free()
            raise
        self._agreed: set = set()

    def _rails(self) -> tuple[tuple[int, ...], ...]:
        """rails[a]: the World ranks of node rank a's rail, in that rail's own order (the order
        its collectives go by), gathered (collective over the node, bounded): the same on
        every rank of the node."""
        mine = self.group.allgather(self.world.rank, self.timeout_s, "rail ranks")
        return tuple(tuple(m) for m in self.node.allgather(mine, self.timeout_s,
                                                           f"{self.op} rails"))

    def _built(self, error: BaseException | None) -> None:
        """Every rank agrees that it built its part (bounded) before any returns: the ranks
        that failed raise their error, the others CufluxError naming them; all free theirs."""
        try:
            oks = self.comm.allgather(error is None, self.timeout_s, "built")
        except BaseException:
            self._release(abort=True)
            raise
        if all(oks):
            return
        self._release(abort=True)
        if error is not None:
            raise error
        raise CufluxError(f"{self.op}: ranks {[r for r, ok in enumerate(oks) if not ok]} could "
                          f"not build their part of the op; this rank freed its own")

    def _check_open(self) -> None:
        if self._closed:
            raise CufluxError(f"{self.op}: the op is closed")

    _last_stream = None

    def _stream(self, stream, like):
        """The call's stream (stream_of), refused under CUDA-graph capture (the host-staged
        rail synchronizes, and the node ops are read through their receive slots), and ordered
        after the stream of this op's previous call: the op's scratch buffers are reused, so
        calls on different streams must not overlap."""
        import cupy

        from cuflux.ops.base import refuse_capture

        s = stream_of(stream, like)
        refuse_capture(self.op, s, "its cross-node form is not capturable")
        last = self._last_stream
        if last is not None and last.ptr != s.ptr:
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(last)
            s.wait_event(ev)
        self._last_stream = s
        return s

    def _out(self, out, shape: tuple, dtype, s):
        """A call's output: the caller's, checked ([shape], dtype, the World's device), or new
        from the pool arena of the stream that writes it."""
        import cupy

        if out is None:
            with s:
                return cupy.empty(shape, dtype.storage)
        return check_array(as_cupy(out, "out", self.op), name="out", op=self.op, shape=shape,
                           dtype=dtype, device=self.world.device)

    def _agree(self, key, what: str) -> None:
        if key not in self._agreed:
            self.comm.check_same(key, f"{self.op}: {what}", self.timeout_s)
            if len(self._agreed) >= 4096:  # token lists that change every call: stay bounded
                self._agreed.clear()       # (every rank clears at the same call)
            self._agreed.add(key)

    def synchronize(self, stream=None) -> None:
        """Wait for this rank's work on `stream` (bounded: CommTimeoutError): the rail's latest
        call first (its own event, so a node op failing later is not blamed on it), then the
        node op, which names a node peer that failed."""
        self._check_open()
        with self.world.device_context():
            self.rail.wait(stream_of(stream), f"{self.op} rail")
            if self.inner is not None:
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
            self.comm.free()
        if not abort:
            self._let_go()

    _scratch: tuple[str, ...] = ()  # the op's staging: let go at a clean close() (_let_go)

    def _let_go(self) -> None:
        """The op's staging (_scratch) dropped once the work of its calls is done, so a closed
        op the caller still references holds none of it (as CommOp._scratch). Every call ran
        on the stream of the previous one or after it (_stream; the rail's side stream joins
        the call's), so one event behind the last call's stream covers them all; polled at
        most timeout_s (the node op's close synchronized the device where there is one). Work
        still running then (a caller's long queue): the staging stays, with a warning, until
        the op is dropped (CuPy's pool would hand it out in another stream's order)."""
        last = self._last_stream
        if last is not None:
            import time

            import cupy

            with self.world.device_context():
                done = cupy.cuda.Event(disable_timing=True)
                try:
                    done.record(last)
                except cupy.cuda.runtime.CUDARuntimeError:  # a caller's raw stream since
                    return                                  # destroyed: kept with the op
                deadline = time.monotonic() + self.timeout_s
                while not done.done:
                    if time.monotonic() > deadline:
                        import warnings

                        warnings.warn(f"{self.op}: close() found this rank's last call still "
                                      f"running after {self.timeout_s} s; its staging is let "
                                      f"go with the op", RuntimeWarning, stacklevel=4)
                        return
                    time.sleep(1e-4)
        for name in self._scratch:
            setattr(self, name, None)

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._release(abort=True)


class AllReduceAcrossNodes(_AcrossNodes):
    """cuflux.AllReduce on a World of several nodes (see the module's docstring); the same
    arguments, plus rail ("auto", "nccl" or "host": cuflux.rail.make_rail). algo is checked
    but has nothing to choose where a node has several ranks: the node's step is always the
    two-shot call's halves (one_shot builds the node op two-shot capable all the same)."""

    op = "AllReduce"

    @on_world_device
    def __init__(self, world, max_elems: int, dtype, algo: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_blocks: int | None = None,
                 rail: str = "auto"):
        from cuflux.ops.allreduce import AllReduce

        self._split(world, timeout_s, rail,
                    (max_elems, dtype_info(dtype, op=self.op).name, algo, max_blocks, rail))
        error = None
        try:
            # The node op's grid counts every rank of the World on this GPU, emulated nodes
            # included (the node World carries its parent's gpu_sharers). One rank a node: the
            # node op is never called, the rail's all-reduce is the op. It only runs the
            # halves of two-shot calls: built "two_shot", its stage holds a slice, not a
            # one-shot call whole per sender.
            self.inner = AllReduce(self.node, max_elems, dtype, "two_shot", timeout_s,
                                   max_blocks)
            self.dtype, self.max_elems = self.inner.dtype, self.inner.max_elems
        except Exception as e:
            error = e
        self._built(error)

    @on_op_device
    def __call__(self, x, out=None, stream=None, algo: str | None = None):
        """x: any shape, C-contiguous, x.size <= max_elems, the same on every rank -> out
        (same shape) = the sum over every rank of the World."""
        self._check_open()
        x_in, out_in = x, out
        x = check_array(as_cupy(x, "x", self.op), name="x", op=self.op, dtype=self.dtype,
                        device=self.world.device)
        if x.size > self.max_elems:
            raise ValueError(f"{self.op}: x has {x.size} elements, more than "
                             f"max_elems={self.max_elems}")
        from cuflux.ops.allreduce import ALGOS

        if algo is not None and algo not in ALGOS:  # (nodes of one rank never reach the op's)
            raise ValueError(f"{self.op}: algo must be one of {ALGOS}, got {algo!r}")
        s = self._stream(stream, x_in)
        out = self._out(out, x.shape, self.dtype, s)
        n = x.size
        self._agree((n, algo), "x.size and algo of the call")
        if n and self.node.size == 1:  # nodes of one rank: the rail's all-reduce is the op
            self.rail.all_reduce(x.reshape(-1), out.reshape(-1), s)
        elif n:
            share = self.inner.reduce_scatter(x.reshape(-1), s)  # the node's sum of our share
            if share.size:  # (a share past n is empty on every node: the rail skips it alike)
                self.rail.all_reduce(share, share, s)
            self.inner.all_gather(out.reshape(-1), s)
        return to_caller(out, x_in, out_in)


class AllGatherAcrossNodes(_AcrossNodes):
    """cuflux.AllGather on a World of several nodes (see the module's docstring); the same
    arguments, plus rail ("auto", "nccl" or "host")."""

    op = "AllGather"
    _scratch = ("_rail_rows", "_node_rows", "_own_rows")

    @on_world_device
    def __init__(self, world, max_rows: int, cols: int, dtype, mode: str = "pull",
                 chunk_rows: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 wait: str = "stream", name: str = "AllGather", path: str = "copy",
                 rail: str = "auto"):
        from cuflux.ops.allgather import AllGather, check_path

        self.op = name
        check_path(name, path)
        self._split(world, timeout_s, rail, (max_rows, cols, dtype_info(dtype, op=name).name,
                                             mode, chunk_rows, wait, path, rail))
        error = None
        try:
            nodes = world.nodes.num_nodes
            self.inner = AllGather(self.node, nodes * max_rows, cols, dtype, mode, chunk_rows,
                                   timeout_s, wait, name, path)
            import cupy

            self.dtype, self.cols, self.max_rows = self.inner.dtype, cols, max_rows
            k = self.node.size
            # Block b = a * nodes + j of the node's gather holds the rows of node rank a's rail
            # member j: World rank rails[a][j]. The World's order takes block src[r] for rank r.
            rails = self._rails()
            src = np.empty(world.size, np.int64)
            for a, members in enumerate(rails):
                for j, r in enumerate(members):
                    src[r] = a * nodes + j
            self._src = cupy.asarray(src)
            # Nodes of one rank whose rails run in World order: the rail's gather is the op.
            self._direct = k == 1 and bool((src == np.arange(world.size)).all())
            staged = 0 if self._direct else nodes * max_rows  # the rail's rows, then the node's
            self._rail_rows = cupy.empty((staged, cols), self.dtype.storage)
            self._node_rows = cupy.empty((k * staged, cols), self.dtype.storage)
            # gather_parts: World ranks lo..hi-1 are this node's ranks in node-rank order (node
            # rank a is World rank lo + a), so its own gather is one block of the output; else
            # None (then no parts: the whole gather first).
            j = self.rail.rank
            lo = rails[0][j]
            self._span = ((lo, lo + k) if all(rails[a][j] == lo + a for a in range(k))
                          else None)
            self._own_rows = cupy.empty((0 if self._direct else k * max_rows, cols),
                                        self.dtype.storage)
            self._side = cupy.cuda.Stream(non_blocking=True)  # the rail's, in gather_parts
        except Exception as e:
            error = e
        self._built(error)

    @on_op_device
    def __call__(self, x, out=None, stream=None):
        """x [rows, cols] (rows <= max_rows, the same on every rank) -> [W * rows, cols] in
        World-rank order."""
        x_in, out_in = x, out
        x, out, s = self._checked(x, out, stream)
        if x.shape[0]:
            self._gather_all(x, out, s)
        return to_caller(out, x_in, out_in)

    def _checked(self, x, out, stream, check_more=None):
        """(x, out, stream) of a call, checked (out allocated on the stream where None), then
        check_more(x, out) (the caller's own checks, before anything is queued), then the
        call's rows agreed across the World."""
        self._check_open()
        x_in = x
        x = check_array(as_cupy(x, "x", self.op), name="x", op=self.op, ndim=2,
                        dtype=self.dtype, device=self.world.device)
        rows, W = x.shape[0], self.world.size
        if x.shape[1] != self.cols or rows > self.max_rows:
            raise ValueError(f"{self.op}: x must be [rows <= max_rows={self.max_rows}, "
                             f"cols={self.cols}], got shape {tuple(x.shape)}")
        s = self._stream(stream, x_in)
        out = self._out(out, (W * rows, self.cols), self.dtype, s)
        if check_more is not None:
            check_more(x, out)
        self._agree(rows, "rows of the call")
        return x, out, s

    def _rail_gather(self, x, stream):
        """The rows of this rank's rail-mates (one block per node, rail order), queued on
        `stream` into the op's staging."""
        mates = self._rail_rows[:self.world.nodes.num_nodes * x.shape[0]]
        self.rail.all_gather(x, mates, stream)
        return mates

    def _node_gather(self, mates, out, s) -> None:
        """The node's gather of every rank's rail blocks, then one copy into World order."""
        import cupy

        nodes, k, W = self.world.nodes.num_nodes, self.node.size, self.world.size
        rows = mates.shape[0] // nodes
        gathered = self._node_rows[:k * nodes * rows]
        self.inner(mates, out=gathered, stream=s)
        with s:
            cupy.take(gathered.reshape(k * nodes, rows, self.cols), self._src, axis=0,
                      out=out.reshape(W, rows, self.cols))

    @on_op_device
    def gather_parts(self, x, out, stream, part, check_more=None) -> None:
        """The gather of __call__ into out ([W * rows, cols], allocated where None), calling
        part(lo, hi, a) on the call's stream for World blocks lo..hi-1 (rows a, [(hi - lo) *
        rows, cols]) as soon as they are there, so a consumer (AllGatherGemm's GEMM) overlaps
        the gather between nodes: this node's blocks first (its own gather inside the node, or
        x itself on a node of one rank) while the rail gathers across nodes on the op's side
        stream; then the rest of out, in at most two parts. Without a span (this node's ranks
        not consecutive in World order) one part, after the whole gather. check_more(x, out):
        the consumer's checks, before anything is queued. Returns out."""
        import cupy

        x, out, s = self._checked(x, out, stream, check_more)
        rows, W = x.shape[0], self.world.size
        if not rows:
            return out
        if self._span is None:
            self._gather_all(x, out, s)
            part(0, W, out)
            return out
        lo, hi = self._span
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(s)
        side = self._side
        side.wait_event(ready)  # x (and the previous call's reads of the staging) are done
        if self._direct:
            self.rail.all_gather(x, out, side)
            part(lo, hi, x)
        else:
            mates = self._rail_gather(x, side)
            own = self._own_rows[:self.node.size * rows]
            self.inner(x, out=own, stream=s)
            part(lo, hi, own)
        landed = cupy.cuda.Event(disable_timing=True)
        landed.record(side)
        s.wait_event(landed)
        if not self._direct:
            self._node_gather(mates, out, s)
        if lo:
            part(0, lo, out[:lo * rows])
        if hi < W:
            part(hi, W, out[hi * rows:])
        return out

    def _gather_all(self, x, out, s) -> None:
        if self._direct:
            self.rail.all_gather(x, out, s)
        else:
            self._node_gather(self._rail_gather(x, s), out, s)


class All2AllHeadsAcrossNodes(_AcrossNodes):
    """cuflux.All2AllHeads on a World of several nodes (see the module's docstring): the same
    calls (scatter_heads, gather_heads; uneven and zero token counts, fp8, per-token or per-head
    scales, out= / out_scale=), the same arguments, plus rail. Not view=: the output is this
    op's copy in World order. Built on the node's All2AllHeads, whose receive slot it reads
    (view=True), so it is not captured in CUDA graphs."""

    op = "All2AllHeads"
    _scratch = ("_send", "_recv", "_send_scale", "_recv_scale", "_rows_in", "_scale_in")

    @on_world_device
    def __init__(self, world, max_tokens_per_rank: int, num_heads: int, head_dim: int, dtype,
                 batch: int = 1, num_sms: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, w1: str = "pdl", rail: str = "auto"):
        from cuflux.nodes import all2all_plan
        from cuflux.ops.all2all import W1_PATHS, All2AllHeads, Spec, check_op_args

        check_op_args(world.size, max_tokens_per_rank, num_heads, head_dim, batch, num_sms,
                      timeout_s)
        if w1 not in W1_PATHS:  # (checked here: nodes of one rank build no node op)
            raise ValueError(f"{self.op}: w1 must be one of {W1_PATHS}, got {w1!r}")
        info = dtype_info(dtype, op=self.op)
        self._split(world, timeout_s, rail, (max_tokens_per_rank, num_heads, head_dim,
                                             info.name, batch, num_sms, w1, rail))
        error = None
        try:
            import cupy

            W, nodes, k = world.size, world.nodes.num_nodes, self.node.size
            self.spec = Spec(W, world.rank, world.device, int(max_tokens_per_rank),
                             int(num_heads), int(head_dim), info, int(batch))
            self.dtype, hpr = info, self.spec.heads_per_rank
            self._rail_ranks = self._rails()
            # Per rail rank j: the head groups of j's node, as a slice where they are
            # consecutive (one strided copy), else a device index array.
            self._heads = tuple(
                slice(p[0], p[0] + k) if list(p) == list(range(p[0], p[0] + k))
                else cupy.asarray(np.array(p, np.int64))
                for p in all2all_plan(world.nodes, self._rail_ranks, world.rank))
            if k > 1:  # (a node of one rank has nothing to move: _node_call)
                self.inner = All2AllHeads(
                    self.node, self.spec.batch * nodes * self.spec.max_tokens, k * hpr,
                    self.spec.head_dim, info.name, batch=1, num_sms=num_sms,
                    timeout_s=timeout_s, w1=w1)
            block = self.spec.batch * self.spec.max_tokens * k * hpr  # heads of a node, a rank
            st = info.storage
            self._send = cupy.empty(nodes * block * self.spec.head_dim, st)
            self._recv = cupy.empty(nodes * block * self.spec.head_dim, st)
            self._send_scale = cupy.empty(nodes * block, np.float32)
            self._recv_scale = cupy.empty(nodes * block, np.float32)
            whole = self.spec.batch * W * self.spec.max_tokens * hpr  # [B, S, H/W] at most
            self._rows_in = cupy.empty(whole * self.spec.head_dim, st)
            self._scale_in = cupy.empty(whole, np.float32)
            self._orders = IndexCache()  # (tokens, B) -> hop 2's row order q and its inverse
        except Exception as e:
            error = e
        self._built(error)

    def scatter_heads(self, x, tokens_per_rank, scale=None, *, out=None, out_scale=None,
                      stream=None):
        """x [B, T_r, H, D] -> y [B, S, H/W, D] (and y_scale, as All2AllHeads.scatter_heads)."""
        return self._run(False, x, tokens_per_rank, scale, out, out_scale, stream)

    def gather_heads(self, y, tokens_per_rank, scale=None, *, out=None, out_scale=None,
                     stream=None):
        """y [B, S, H/W, D] -> x [B, T_r, H, D] (and x_scale, as All2AllHeads.gather_heads)."""
        return self._run(True, y, tokens_per_rank, scale, out, out_scale, stream)

    __call__ = scatter_heads

    def _order(self, tokens, B, s):
        """(q, q's inverse) on the device: hop 2's row i is row q[i] of the output [B * S]
        (uploaded on the call's stream `s`, which reads them)."""
        from cuflux.nodes import all2all_rows

        got = self._orders.get((tokens, B))
        if got is None:
            q = all2all_rows(self._rail_ranks, tokens, B)
            got = self._orders.put((tokens, B), (q, np.argsort(q)), s)
        return got

    @on_op_device
    def _run(self, gather, a, tokens_per_rank, scale, out, out_scale, stream):
        import cupy

        from cuflux.ops.all2all import check_call, check_tokens, io_shapes, scale_shapes
        from cuflux.ops.base import check_no_alias

        self._check_open()
        spec, name = self.spec, "y" if gather else "x"
        a_in, given = a, (out, out_scale)
        a = as_cupy(a, name, self.op)
        scale = None if scale is None else as_cupy(scale, "scale", self.op)
        tokens = check_tokens(tokens_per_rank, spec.world_size, spec.max_tokens)
        B, mode = check_call(spec, gather, a, tokens, scale)
        if out_scale is not None and not mode:
            raise ValueError(f"{self.op}: out_scale given without scale")
        _, out_shape = io_shapes(spec, gather, B, tokens)
        outs = [(out, "out", out_shape, self.dtype)]
        if mode:
            outs.append((out_scale, "out_scale", scale_shapes(spec, gather, B, tokens,
                                                              mode == 2)[1],
                         dtype_info("float32")))
        s = self._stream(stream, a_in)
        made = []
        for arr, what, shape, dt in outs:
            if arr is None:
                with s:
                    arr = cupy.empty(shape, dt.storage)
            else:
                arr = check_array(as_cupy(arr, what, self.op), name=what, op=self.op,
                                  shape=shape, dtype=dt, device=spec.device)
                check_no_alias(self.op, arr, input=a, scale=scale)
            made.append(arr)
        out, out_scale = made[0], (made[1] if mode else None)
        self._agree((gather, tokens, B, mode), "direction, tokens_per_rank, batch and scales "
                                               "of the call")
        if B * sum(tokens):
            (self._gather if gather else self._scatter)(a, scale, out, out_scale, tokens, B,
                                                        mode, s)
        if mode:
            return to_caller((out, out_scale), a_in, given)
        return to_caller(out, a_in, given[0])

    def _blocks(self, buf, tokens, B, cols, members=None):
        """Per rail rank j, the block of `buf` (one after another, `cols` elements a token)
        holding B * tokens[members[j]] tokens (members None: this rank's own count, fixed
        stride)."""
        sizes = ([B * tokens[w] * cols for w in members] if members is not None else
                 [B * tokens[self.spec.rank] * cols] * self.rail.size)
        offs = np.concatenate([[0], np.cumsum(sizes)])
        return [buf[offs[j]:offs[j + 1]] for j in range(len(sizes))]

    def _scatter(self, x, scale, out, out_scale, tokens, B, mode, s):
        from cuflux.nodes import all2all_tokens

        spec, me = self.spec, self.rail.rank
        W, hpr, D, k = spec.world_size, spec.heads_per_rank, spec.head_dim, self.node.size
        T, mine = tokens[spec.rank], self._rail_ranks[self.node.rank]
        row = k * hpr * D
        sends = self._blocks(self._send, tokens, B, row)
        recvs = self._blocks(self._recv, tokens, B, row, mine)
        x5 = x.reshape(B, T, W, hpr, D)
        with s:  # hop 1's blocks: this rank's own goes straight where hop 2 reads it
            for j, heads in enumerate(self._heads):
                dst = recvs[j] if j == me else sends[j]
                if dst.size:
                    dst.reshape(B, T, k, hpr, D)[...] = x5[:, :, heads]
        self.rail.all_to_all(sends, recvs, s)
        node_scale = None
        if mode:
            cols = 1 if mode == 1 else k * hpr
            ssend = self._blocks(self._send_scale, tokens, B, cols)
            srecv = self._blocks(self._recv_scale, tokens, B, cols, mine)
            with s:
                for j, heads in enumerate(self._heads):
                    dst = srecv[j] if j == me else ssend[j]
                    if dst.size:
                        src = (scale if mode == 1 else
                               scale.reshape(B, T, W, hpr)[:, :, heads])
                        dst.reshape(src.shape)[...] = src
            self.rail.all_to_all(ssend, srecv, s)
        node_tokens = all2all_tokens(self._rail_ranks, tokens, B)
        R = node_tokens[self.node.rank]
        xn = self._recv[:R * row].reshape(1, R, k * hpr, D)
        if mode:
            cols = 1 if mode == 1 else k * hpr
            node_scale = self._recv_scale[:R * cols].reshape((1, R) if mode == 1
                                                            else (1, R, k * hpr))
        yn, yn_scale = self._node_call(False, xn, node_tokens, node_scale, mode, s)
        _, inverse = self._order(tokens, B, s)
        with s:  # World order: output row i is hop 2's row inverse[i]
            cupy_take(yn.reshape(-1, hpr * D), inverse, out.reshape(-1, hpr * D))
            if mode:
                c = 1 if mode == 1 else hpr
                cupy_take(yn_scale.reshape(-1, c), inverse, out_scale.reshape(-1, c))

    def _node_call(self, gather, a, node_tokens, node_scale, mode, s):
        """Hop 2: the node's All2AllHeads (its receive slot, view=True) -> (rows, scales). A
        node of one rank has nothing to move: its input is its output (the scales of a gather
        get the unit axis of the node's one head group)."""
        if self.node.size == 1:
            if gather and mode == 1:
                node_scale = node_scale.reshape(node_scale.shape + (1,))
            return a, node_scale
        op = self.inner.gather_heads if gather else self.inner.scatter_heads
        got = op(a, node_tokens, node_scale, view=True, stream=s)
        return got if mode else (got, None)

    def _gather(self, y, scale, out, out_scale, tokens, B, mode, s):
        from cuflux.nodes import all2all_tokens

        spec, me = self.spec, self.rail.rank
        W, hpr, D, k = spec.world_size, spec.heads_per_rank, spec.head_dim, self.node.size
        T, mine = tokens[spec.rank], self._rail_ranks[self.node.rank]
        S, row = sum(tokens), k * hpr * D
        q, _ = self._order(tokens, B, s)
        rows_in = self._rows_in[:B * S * hpr * D]
        node_scale = None
        with s:  # hop 2's order: its row i is the input's row q[i]
            cupy_take(y.reshape(-1, hpr * D), q, rows_in.reshape(-1, hpr * D))
            if mode:
                c = 1 if mode == 1 else hpr
                node_scale = self._scale_in[:B * S * c]
                cupy_take(scale.reshape(-1, c), q, node_scale.reshape(-1, c))
                node_scale = node_scale.reshape((1, B * S) if mode == 1 else (1, B * S, hpr))
        node_tokens = all2all_tokens(self._rail_ranks, tokens, B)
        xn, xn_scale = self._node_call(True, rows_in.reshape(1, B * S, hpr, D), node_tokens,
                                       node_scale, mode, s)
        # xn [1, R, k * H/W, D]: per rail rank j, the tokens of rail member mine[j] with the
        # head groups of this node's ranks: rail rank j's hop-1 block, sent back.
        sends = self._blocks(xn.reshape(-1), tokens, B, row, mine)
        recvs = self._blocks(self._recv, tokens, B, row)
        self.rail.all_to_all(sends, recvs, s)
        out5 = out.reshape(B, T, W, hpr, D)
        with s:
            for j, heads in enumerate(self._heads):
                src = sends[j] if j == me else recvs[j]
                if src.size:
                    out5[:, :, heads] = src.reshape(B, T, k, hpr, D)
        if mode:
            cols = k if mode == 1 else k * hpr  # a scale per token and node rank's head group
            ssend = self._blocks(xn_scale.reshape(-1), tokens, B, cols, mine)
            srecv = self._blocks(self._recv_scale, tokens, B, cols)
            self.rail.all_to_all(ssend, srecv, s)
            dst = out_scale.reshape(B, T, W, 1 if mode == 1 else hpr)
            with s:
                for j, heads in enumerate(self._heads):
                    src = ssend[j] if j == me else srecv[j]
                    if src.size:
                        dst[:, :, heads] = src.reshape(B, T, k, dst.shape[3])


def cupy_take(src, index, out) -> None:
    """out[i] = src[index[i]] (rows), on the current stream."""
    import cupy

    if out.size:
        cupy.take(src, index, axis=0, out=out)


class AllReduceRMSNormAcrossNodes(_AcrossNodes):
    """cuflux.AllReduceRMSNorm on a World of several nodes: AllReduceAcrossNodes gives every rank
    the whole sum s; then rmsnorm_residual (the W = 1 kernel) normalises s + residual on the rows
    the output mode gives this rank: every row ("replicated"), its token slice
    ("sequence_parallel"), or its slice followed by an AllGatherAcrossNodes of every rank's
    normalised slice ("sharded_residual": out is whole, each residual slice stays with its
    owner). The sum is rounded to dtype once more than in the one-node kernel. Same arguments
    as AllReduceRMSNorm, plus rail."""

    op = "AllReduceRMSNorm"
    _scratch = ("_s", "_mine", "_every")

    @on_world_device
    def __init__(self, world, max_tokens: int, hidden: int, dtype, eps: float = 1e-6,
                 output: str = "replicated", algo: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_blocks: int | None = None,
                 rail: str = "auto"):
        import math

        from cuflux.ops.allreduce import OUTPUTS
        from cuflux.sizes import count

        if output not in OUTPUTS:
            raise ValueError(f"{self.op}: output must be one of {OUTPUTS}, got {output!r}")
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"{self.op}: eps must be a finite number > 0, got {eps!r}")
        self.max_tokens = count(self.op, "max_tokens", max_tokens, what="tokens per call")
        self.hidden = count(self.op, "hidden", hidden, what="elements per token")
        self.eps, self.output, self.world, self.timeout_s = float(eps), output, world, timeout_s
        world.check_same((self.max_tokens, self.hidden, self.eps, output),
                         f"{self.op} arguments (max_tokens, hidden, eps, output)", timeout_s)
        self.sum = AllReduceAcrossNodes(world, self.max_tokens * self.hidden, dtype, algo,
                                        timeout_s, max_blocks, rail)
        self.dtype, self.gather = self.sum.dtype, None
        try:
            import cupy

            self._s = cupy.empty((self.max_tokens, self.hidden), self.dtype.storage)
            if output == "sharded_residual":
                pad = -(-self.max_tokens // world.size)  # the largest slice
                self.gather = AllGatherAcrossNodes(world, pad, self.hidden, dtype,
                                                   timeout_s=timeout_s, rail=rail)
                self._mine = cupy.empty((pad, self.hidden), self.dtype.storage)
                self._every = cupy.empty((world.size * pad, self.hidden), self.dtype.storage)
            self._rows = IndexCache()  # T -> rows of the gather that hold each slice, in order
        except BaseException:
            self.sum.close()
            raise

    def out_rows(self, num_tokens: int) -> int:
        from cuflux.ops.allreduce import AllReduceRMSNorm

        return AllReduceRMSNorm.out_rows(self, num_tokens)

    @on_op_device
    def __call__(self, x, residual, weight, out=None, stream=None, algo: str | None = None):
        import cupy

        from cuflux.ops.allreduce import check_norm_call, rmsnorm_residual, token_slice

        self._check_open()
        x_in, out_in = x, out
        x, residual, weight, out = check_norm_call(self, x, residual, weight, out, algo)
        s = self._stream(stream, x_in)
        T, W, me = x.shape[0], self.world.size, self.world.rank
        if out is None:
            with s:
                out = cupy.empty((self.out_rows(T), self.hidden), self.dtype.storage)
        if T:
            total = self._s[:T]
            self.sum(x, out=total, stream=s, algo=algo)
            lo, hi = token_slice(T, W, me)
            if self.output == "replicated":
                rmsnorm_residual(total, residual, weight, self.eps, out, s)
            elif self.output == "sequence_parallel":
                if hi > lo:
                    rmsnorm_residual(total[lo:hi], residual, weight, self.eps, out, s)
            else:
                self._sharded(total, residual, weight, out, lo, hi, s)
        return to_caller(out, x_in, out_in)

    def _sharded(self, total, residual, weight, out, lo, hi, s) -> None:
        import cupy

        from cuflux.ops.allreduce import rmsnorm_residual, token_slice

        T, W, pad = total.shape[0], self.world.size, -(-total.shape[0] // self.world.size)
        mine = self._mine[:pad]  # this rank's slice, padded to the largest
        if hi > lo:
            rmsnorm_residual(total[lo:hi], residual[lo:hi], weight, self.eps, mine[:hi - lo], s)
        gathered = self._every[:W * pad]  # every rank's padded slice, in rank order
        self.gather(mine, out=gathered, stream=s)
        got = self._rows.get(T)
        if got is None:  # (uploaded on s, which reads it)
            rows = np.concatenate([np.arange(r * pad, r * pad + b - a) for r in range(W)
                                   for a, b in [token_slice(T, W, r)]])
            got = self._rows.put(T, (rows,), s)
        (rows,) = got
        with s:
            cupy.take(gathered, rows, axis=0, out=out)

    def _release(self, abort: bool = False) -> None:
        for op in (self.gather, self.sum):
            if op is not None:
                op.abort() if abort else op.close()
        if not abort:
            self._let_go()

    def synchronize(self, stream=None) -> None:
        self.sum.synchronize(stream)
        if self.gather is not None:
            self.gather.synchronize(stream)


class _GemmAcrossNodes(_AcrossNodes):
    """What the two GEMM ops share across nodes: cuflux.gemm on this rank, the sizes and the
    call's row count agreed across the World."""

    def _gemm_args(self, n: int, k: int, dtype, out_dtype, b_layout: str, impl: str,
                   route: str, config: str | None = None, group_m: int = 8,
                   routes: tuple | None = None) -> None:
        from cuflux import gemm_core as core
        from cuflux.ops.base import ROUTES, check_route
        from cuflux.sizes import count

        check_route(self.op, route, routes or ROUTES)  # the node op's (GemmReduceScatter: more)
        core.check_b_layout(b_layout, self.op)
        core.check_group_m(group_m, self.op)  # else gemm refuses it after the gather
        self.config, self.group_m = config, group_m
        self.n = count(self.op, "n", n, what="output columns")
        self.k = count(self.op, "k", k, what="the inner dimension")
        self.dtype = dtype_info(dtype, core.IN_DTYPES, self.op)
        self.out_dtype = dtype_info(out_dtype if out_dtype is not None else self.dtype.name,
                                    ("bfloat16", "float16", "float32"), self.op)
        self.b_layout, self.impl = b_layout, impl

    def _gemm(self, a, b, bias, out, stream):
        from cuflux.ops.gemm import gemm

        return gemm(a, b, bias=bias, out=out, out_dtype=self.out_dtype.name,
                    b_layout=self.b_layout, impl=self.impl, stream=stream, config=self.config,
                    group_m=self.group_m)

    def _release(self, abort: bool = False) -> None:
        self.inner.abort() if abort else self.inner.close()

    def synchronize(self, stream=None) -> None:
        self.inner.synchronize(stream)


class AllGatherGemmAcrossNodes(_GemmAcrossNodes):
    """cuflux.AllGatherGemm on a World of several nodes: AllGatherAcrossNodes of the A shards
    with cuflux.gemm on the gathered rows as they land (gather_parts: this node's rows while
    the rail gathers across nodes on a side stream, then the other nodes' rows in at most two
    more GEMMs). Arguments as AllGatherGemm's (max_m the gathered rows, or max_rows_per_rank),
    plus rail and overlap (False: the whole gather, then one GEMM)."""

    op = "AllGatherGemm"

    @on_world_device
    def __init__(self, world, max_m: int | None = None, n: int | None = None,
                 k: int | None = None, dtype=None, out_dtype=None, b_layout: str = "kn",
                 mode: str = "pull", chunk_rows: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, impl: str = "auto",
                 config: str | None = None, group_m: int = 8, *,
                 max_rows_per_rank: int | None = None, route: str = "auto",
                 path: str = "copy", rail: str = "auto", overlap: bool = True):
        self.world = world
        if type(overlap) is not bool:
            raise ValueError(f"{self.op}: overlap must be True or False, got {overlap!r}")
        self.overlap = overlap
        from cuflux.ops.ag_gemm import AG_SM90_CONFIGS
        from cuflux.ops.allgather import check_path

        check_path(self.op, path)
        if config is not None and config not in AG_SM90_CONFIGS:  # the fused kernel's: unused
            raise ValueError(f"{self.op}: config must be one of {sorted(AG_SM90_CONFIGS)} or "
                             f"None, got {config!r}")
        self._gemm_args(n, k, dtype, out_dtype, b_layout, impl, route, None, group_m)
        if (max_m is None) == (max_rows_per_rank is None):
            raise ValueError(f"{self.op}: give max_m (rows of the gathered A) or "
                             f"max_rows_per_rank, one of them")
        if max_rows_per_rank is None:
            if max_m % world.size:
                raise ValueError(f"{self.op}: max_m={max_m} must be a multiple of the world "
                                 f"size {world.size}")
            max_rows_per_rank = max_m // world.size
        world.check_same((max_rows_per_rank, self.n, self.out_dtype.name, b_layout, impl, overlap),
                         f"{self.op} arguments (rows per rank, n, out_dtype, b_layout, impl, "
                         f"overlap)", timeout_s)
        self.inner = AllGatherAcrossNodes(world, max_rows_per_rank, self.k, self.dtype.name,
                                          mode, chunk_rows, timeout_s=timeout_s, name=self.op,
                                          path=path, rail=rail)

    @on_op_device
    def __call__(self, a_shard, b, bias=None, return_gathered: bool = False, stream=None,
                 out=None):
        from cuflux.ops import gemm as gemm_op

        self._check_open()
        s = self._stream(stream, a_shard)
        W, out_in = self.world.size, out
        if not self.overlap:
            gathered = as_cupy(self.inner(a_shard, stream=s), "gathered", self.op)
            got = as_cupy(self._gemm(gathered, b, bias, out, s), "out", self.op)
            return to_caller((got, gathered) if return_gathered else got, a_shard,
                             (out, None) if return_gathered else out)  # torch in, torch out
        def check_gemm(x, gathered):
            """b, bias and out against the call, refused before the gather queues anything
            (gemm's own checks, on the first rows of out)."""
            nonlocal out
            rows = x.shape[0]
            out = self._out(out, (W * rows, self.n), self.out_dtype, s)
            n = gemm_op._check_args(x, b, bias, out[:rows], self.out_dtype.name, self.b_layout,
                                    self.impl)[7]
            if n != self.n:
                raise ValueError(f"{self.op}: b must have n={self.n} output columns, got {n}")

        def part(lo, hi, a_rows):
            rows = a_rows.shape[0] // (hi - lo)
            self._gemm(a_rows, b, bias, out[lo * rows:hi * rows], s)

        gathered = self.inner.gather_parts(a_shard, None, s, part, check_gemm)
        return to_caller((out, gathered) if return_gathered else out, a_shard,
                         (out_in, None) if return_gathered else out_in)  # torch in, torch out


class GemmReduceScatterAcrossNodes(_GemmAcrossNodes):
    """cuflux.GemmReduceScatter on a World of several nodes (nodes.gemm_rs_plan): the rows of
    a are put in node-rank order of their owners' rails (block of owner rails[i][j] at i, j),
    so the node's GemmReduceScatter (its fused kernel: the GEMM's tiles pushed to their node
    owner as they finish) leaves node rank i its node's sum of the N blocks its rail owns;
    the rail's reduce-scatter then gives each rank its own block. Each owner's rows cross the
    network once per node, not the whole product. The bias goes in on the node of World rank
    0 only, so the sum holds it once. Arguments as GemmReduceScatter's, plus rail."""

    op = "GemmReduceScatter"
    _scratch = ("_a", "_node_sum")
    _release = _AcrossNodes._release  # the node op and the rail (not a composed op's)
    synchronize = _AcrossNodes.synchronize

    @on_world_device
    def __init__(self, world, max_m: int, n: int, k: int, dtype, out_dtype=None,
                 b_layout: str = "kn", reduce: str = "deterministic",
                 timeout_s: float = DEFAULT_TIMEOUT_S, impl: str = "auto",
                 config: str | None = None, w1: str = "gemm", route: str = "auto",
                 rail: str = "auto"):
        from cuflux.ops.gemm_rs import RS_ROUTES, GemmReduceScatter
        from cuflux.sizes import count

        self._gemm_args(n, k, dtype, out_dtype, b_layout, impl, route, config, routes=RS_ROUTES)
        self.max_m = count(self.op, "max_m", max_m, what="rows of a")
        self._split(world, timeout_s, rail, (self.max_m, self.n, self.k, self.dtype.name,
                                             self.out_dtype.name, b_layout, reduce, impl,
                                             config, w1, route, rail))
        error = None
        try:
            import cupy

            self.inner = GemmReduceScatter(self.node, self.max_m, n, k, self.dtype.name,
                                           self.out_dtype.name, b_layout, reduce, timeout_s,
                                           impl, config, w1, route)
            rails = self._rails()
            # Row blocks of a (one per World rank, M / W rows each) in the node op's order.
            self._blocks = cupy.asarray(np.array([o for members in rails for o in members],
                                                 np.int64))
            self._a = cupy.empty((self.max_m, self.k), self.dtype.storage)
            self._node_sum = cupy.empty(self.max_m // self.node.size * self.n,
                                        self.out_dtype.storage)
            self._adds_bias = world.nodes.node_of(world.rank) == world.nodes.node_of(0)
        except Exception as e:
            error = e
        self._built(error)

    @on_op_device
    def __call__(self, a, b, bias=None, out=None, stream=None):
        import cupy

        self._check_open()
        a_in, out_in = a, out
        a = check_array(as_cupy(a, "a", self.op), name="a", op=self.op, ndim=2,
                        dtype=self.dtype, device=self.world.device)
        M, W = a.shape[0], self.world.size
        if M % W or M > self.max_m:
            raise ValueError(f"{self.op}: a has M={M} rows: it must be a multiple of the world "
                             f"size {W} and <= max_m={self.max_m}")
        if a.shape[1] != self.k:
            raise ValueError(f"{self.op}: a must be [M, k={self.k}], got {tuple(a.shape)}")
        if bias is not None:  # checked on every rank: only one node's reaches its node op,
            bias = check_array(as_cupy(bias, "bias", self.op), name="bias", op=self.op,
                               shape=(self.n,), dtype=self.dtype, device=self.world.device)
            if bias.data.ptr % 16:  # which would refuse it there alone (the rest would wait)
                raise ValueError(f"{self.op}: bias must start at a 16-byte aligned address "
                                 f"(got {bias.data.ptr:#x})")
        s = self._stream(stream, a_in)
        out = self._out(out, (M // W, self.n), self.out_dtype, s)
        self._agree((M, bias is None), "M and bias of the call")
        if M:
            per = M // W
            mine = self._a[:M]
            with s:
                cupy.take(a.reshape(W, per, self.k), self._blocks, axis=0,
                          out=mine.reshape(W, per, self.k))
            node_sum = self._node_sum[:M // self.node.size * self.n].reshape(-1, self.n)
            self.inner(mine, b, bias=bias if self._adds_bias else None, out=node_sum, stream=s)
            self.rail.reduce_scatter(node_sum.reshape(-1), out.reshape(-1), s)
        return to_caller(out, a_in, out_in)
