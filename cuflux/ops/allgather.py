"""AllGather over copy engines, driven from the host (the DMA path of AllGather+GEMM).

x [rows, cols] on every rank -> out [W * rows, cols], rank p's rows at p * rows.

Copies are cudaMemcpyAsync calls (copy engines, no SMs) issued from the host on one stream per
concurrent peer ("lane"), peers visited in the topology's transfer order (full mesh over
NVLink, ring over PCIe, 2-D ring across NUMA domains). After each copied chunk
cuStreamWriteValue32 raises that chunk's flag, so a consumer (the AG+GEMM kernel) can start on a
chunk as soon as it lands. Flags are epochs (call e writes e) in the waiter's own memory,
counted by CommOp (`_next_epoch`), which re-arms them (zeroes the four flag regions between two
bounded barriers) long before a 32-bit compare could wrap.

Symmetric layout (one IPC allocation per op, 128-byte aligned regions):
  data    pull: [max_rows, cols] this rank's shard, staged for peers to read
          push: [W * max_rows, cols] the gathered rows, written by the peers
  chunk   uint32 [W, max_chunks]: chunk (p, c) of the gathered rows has landed (epoch)
  ready   uint32 [W] (pull): ready[p] = e when rank p staged its shard of call e
  done    uint32 [W] (pull): done[p] = e when rank p finished reading our staged shard
  free    uint32 [W] (push): free[p] = e when rank p consumed its gathered rows of call e,
          so our shard of call e+1 may overwrite them
  joined  uint32 [W]: joined[i] = e when guard-holding stream i (push: lane i; pull: the
          stager) has run its part of call e; the call's stream waits for the last one

Pull, call e:  stager: guard done[*] >= e-1; stage x; ready[me] -> every peer.
               S: copy own rows. lane(p): wait ready[p] >= e; copy chunks from p's staging,
               raise chunk[p, c]; done[me] = e -> p.
Push, call e:  S: copy own rows; lane(p): guard free[p] >= e-1; copy chunks of x into p's data,
               raise chunk[me, c] on p.  Then S: wait chunk[*] >= e; copy out; free[me] = e ->
               every peer.

The guards (#19 item 1) come before a copy that overwrites what a peer reads (its gathered
rows, our staged shard): they are stream waits that a timeout never releases, only the peer's
own word or its leaving the op (watchdog.StreamWaiter.wait(guard=True)), so a late but alive
peer never has a call in flight overwritten. A stream holding a guard (push lanes, the pull
stager) may therefore stay held after a failure; S joins it through its `joined` word with a
follower wait, released once the op has failed (x, the copies' source, then belongs to a void
call).

Inside a stage of the transfer order the lanes' copies are queued chunk-major (chunk 0 of every
peer of the stage, then chunk 1, ...), so chunks land in the order `arrival_order` lists; the
fused AllGather+GEMM visits its tiles in that order. It drives the same protocol through
`begin` / `send_peers` / `release`, queuing its GEMM between them and reading the gathered rows
in place (pull: the caller's gathered array; push: this rank's data region).

`CopyGather` (a CommOp) holds the buffer, flags, copy lanes, stream-wait watchdog and the
protocol; `AllGather` and `AllGatherGemm` are built on it, each one op with one communicator,
one error record and one symmetric buffer.

path="sm" (a constructor argument of both ops) replaces all of the above by one kernel
(kernels_cu/allgather.cu): SMs load the peers' staged rows over P2P, one barrier a call, the
epoch counted on the device, so a CUDA graph can capture the op and replay it (the copy-engine
path cannot: its epochs and waits live on the host). It takes SMs (at most `max_blocks` CTAs)
and a stage of 2 * max_rows rows; AllGatherGemm on it runs unfused (the gather, then the GEMM).
"""
from __future__ import annotations

import numpy as np

from cuflux import driver, kernels
from cuflux.arrays import (as_cupy, check_array, check_rows, dtype_info, is_torch, stream_of,
                           to_caller, zeros_settled)
from cuflux.errors import ABORT, OP_CODES, CufluxError
from cuflux.ops.base import (DEFAULT_TIMEOUT_S, CommOp, check_timeout, on_op_device,
                             on_world_device, require_world_device)
from cuflux.signal import wait_flags
from cuflux.sizes import count, optional_count
from cuflux.symmetric import Layout
from cuflux.topology import transfer_order
from cuflux.watchdog import StreamWaiter

__all__ = ["AllGather", "CopyGather", "arrival_order", "arrival_stages", "gather_layout",
           "sm_gather_layout", "sm_plan", "check_path", "PATHS"]

_OP = "AllGather"
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: UVA decides the direction (peer pointers included)
PATHS = ("copy", "sm")  # copy engines driven from the host; SM loads (capturable)

_SRC = "allgather.cu"
SM_KERNELS = {16: "allgather_sm<16>", 1: "allgather_sm<1>"}  # by vector bytes
FAMILY = kernels.register(_SRC, list(SM_KERNELS.values()))
SM_MAX_BLOCKS = 32        # spinning grid: enough loads in flight, few flags per barrier
SM_THREADS = 512
SM_MIN_BLOCK_BYTES = 4096  # a block's span is at least this (small calls: few blocks, flags)


def gather_layout(world_size: int, max_rows: int, row_bytes: int, max_chunks: int,
                  mode: str) -> Layout:
    """The symmetric buffer of the module docstring: data, chunk, ready, done, free."""
    layout = Layout()
    data_rows = max_rows if mode == "pull" else world_size * max_rows
    layout.add("data", (data_rows, row_bytes), np.uint8)
    layout.add("chunk", (world_size, max_chunks), np.uint32)
    for region in ("ready", "done", "free"):
        layout.add(region, (world_size,), np.uint32)
    layout.add("joined", (world_size,), np.uint32)
    return layout


def sm_gather_layout(world_size: int, max_rows: int, row_bytes: int, max_blocks: int) -> Layout:
    """path="sm": stage [2, max_rows * row_bytes] (by call parity), start u64 [max_blocks,
    stride] (kernels_cu/allgather.cu)."""
    layout = Layout()
    layout.add("stage", (2, _stage_bytes(max_rows, row_bytes)), np.uint8)
    layout.add("start", (max_blocks, _flag_stride(world_size)), np.uint64)
    return layout


def _stage_bytes(max_rows: int, row_bytes: int) -> int:
    return -(-max_rows * row_bytes // 128) * 128  # each parity's stage 128-byte aligned


def _flag_stride(world_size: int) -> int:
    return -(-world_size // 16) * 16  # u64 slots: a 128-byte line per block


def sm_plan(nbytes: int, max_blocks: int) -> tuple[int, int]:
    """(grid, span_bytes) of a path="sm" call moving nbytes per rank: block b owns bytes
    [b * span, (b + 1) * span). From nbytes alone, never from a rank's alignment, so every rank
    stages and reads the same bytes per block; span is a multiple of 16 (a block's vectors)."""
    span = max(SM_MIN_BLOCK_BYTES, -(-nbytes // max_blocks))
    span = -(-span // 16) * 16
    return -(-nbytes // span), span


def arrival_stages(rank: int, orders, mode: str) -> list[list[int]]:
    """The stages in which the peers' rows reach `rank`, given orders[p] = rank p's transfer
    order (topology.transfer_order). Pull: rank's own order (it fetches). Push: stage i holds
    the senders whose stage i writes into rank (on a PCIe ring, rank+1 first: every sender
    serves rank-1 first), by the lane they use for it."""
    if mode == "pull":
        return [list(stage) for stage in orders[rank]]
    num_stages = max((len(o) for o in orders), default=0)
    stages = []
    for i in range(num_stages):
        senders = [(orders[p][i].index(rank), p) for p in range(len(orders))
                   if p != rank and i < len(orders[p]) and rank in orders[p][i]]
        if senders:
            stages.append([p for _, p in sorted(senders)])
    return stages


def arrival_order(rank: int, stages, num_chunks: int) -> list[tuple[int, int]]:
    """(source rank, chunk) of every chunk of a call, in the order they are queued and expected
    to land on `rank`: its own chunks first (raised at once after one copy), then `stages`
    (arrival_stages) one after another, chunk-major across the peers of a stage (they are
    copied at the same time, one lane each)."""
    seq = [(rank, c) for c in range(num_chunks)]
    for stage in stages:
        seq += [(p, c) for c in range(num_chunks) for p in stage]
    return seq


# Why the host-driven copy path cannot be captured: its waits are stream memory operations
# whose deadlines a host watchdog tracks per call; a replayed graph would wait with no watchdog.
_NO_CAPTURE = ("its copy-engine path's peer waits are bounded by a host watchdog per call "
               "(cuStreamWaitValue32), which a graph replay would bypass; build the op with "
               "path='sm' to capture it (W = 1 is capturable on either path)")


def check_path(op: str, path) -> None:
    if path not in PATHS:
        raise ValueError(f"{op}: path must be one of {PATHS}, got {path!r}")


class CopyGather(CommOp):
    """The copy-engine gather that AllGather and AllGatherGemm are built on: the symmetric
    buffer and its flags (gather_layout), the copy lanes, the stream-wait watchdog, the transfer
    order and the protocol of the module docstring (begin / send_peers / release, or the whole
    gather: gather_into). CommOp owns the communicator, the error record, the open/closed state
    and close() / abort(); this class frees the watchdog and waits for its own streams.

    Collective; the op checks its arguments (and agrees them with check_same) first: max_rows,
    cols and chunk_rows are ints >= 1, dtype a dtype_info, mode "pull" or "push", wait "stream"
    (cuStreamWaitValue32 watched by a host thread: no SM used) or "kernel" (a one-block bounded
    spin kernel per wait, cuflux.signal); path "copy" (all of the above) or "sm" (the module
    docstring's last paragraph: one kernel a call; mode, chunk_rows and wait then do nothing).
    """

    def __init__(self, world, op: str, timeout_s: float, max_rows: int, cols: int, dtype,
                 mode: str, chunk_rows: int, wait: str, path: str = "copy"):
        import cupy

        super().__init__(world, op, timeout_s)
        W = world.size
        self.mode, self.cols, self.max_rows, self.dtype = mode, cols, max_rows, dtype
        self.chunk_rows, self.path = chunk_rows, path
        # W = 1 gathers nothing: one local copy on either path (AllGatherGemm's fused kernel
        # then reads the copy path's chunk flags, all at epoch 0)
        self._sm = path == "sm" and W > 1
        self.max_chunks = -(-max_rows // chunk_rows)
        self.row_bytes = cols * dtype.itemsize
        if self._sm:
            self.sm_max_blocks = self._grid_cap(SM_MAX_BLOCKS)
            self.layout = sm_gather_layout(W, max_rows, self.row_bytes, self.sm_max_blocks)
        else:
            self.layout = gather_layout(W, max_rows, self.row_bytes, self.max_chunks, mode)
        self._alloc(self.layout)
        # zeroed on a re-arm (path "sm": epochs on the device, u64, never re-armed)
        self._epoch_regions = () if self._sm else ("chunk", "ready", "done", "free", "joined")
        self.wait_mode = wait
        # Path "sm" waits inside its kernel (bounded): no stream waits, no watchdog, no signal.cu.
        self.waiter = None if self._sm else StreamWaiter(self.err, world.device, OP_CODES[op])
        # The copy path's transfer order, and where the chunks come from, stage by stage (push:
        # as the senders' orders deliver); path "sm" has neither (and so no copy lanes).
        self.order = [] if self._sm else transfer_order(world.topology, W)
        self.arrival_stages = [] if self._sm else arrival_stages(
            world.rank, self.comm.allgather(self.order, what=f"{op} transfer orders"), mode)
        num_lanes = max([len(stage) for stage in self.order], default=0)
        self.lanes = [cupy.cuda.Stream(non_blocking=True) for _ in range(num_lanes)]
        # Pull: the staging copy and its guard run here, so a held guard holds no caller stream.
        self.stager = (cupy.cuda.Stream(non_blocking=True)
                       if mode == "pull" and W > 1 and not self._sm else None)
        if not self._sm:  # eager: nothing may load while a stream spins
            kernels.load("signal.cu", world.device)
        else:
            self.sm_module = kernels.load(_SRC, world.device)
            with world.device_context():
                self.state = zeros_settled(2, np.uint64)  # [epoch, blocks finished]
            o = {n: r.offset for n, r in self.layout.regions.items()}
            # Kernel arguments that never change, built once (small calls are host-bound).
            self._sm_args_mid = (self.buf.ptrs_dev, np.uint64(o["stage"]),
                                 np.uint64(self.layout.regions["stage"].shape[1]),
                                 np.uint64(o["start"]), np.int32(_flag_stride(W)), self.state)
            self._sm_args_tail = (np.int32(W), np.int32(world.rank)) + self.err_args

    # ---- addresses ---------------------------------------------------------------------------
    def _flag(self, rank: int, name: str, index: int = 0) -> int:
        return self.buf.ptr(rank, name, 4 * index)

    def _chunk_flag(self, rank: int, src: int, chunk: int) -> int:
        return self.buf.ptr(rank, "chunk", 4 * (src * self.max_chunks + chunk))

    def _chunks(self, rows: int):
        for c, r0 in enumerate(range(0, rows, self.chunk_rows)):
            yield c, r0, min(self.chunk_rows, rows - r0)

    def _wait(self, stream, rank_flag_name: str, expected: int, first_peer: int, num_groups: int = 1,
              per_group: int = 1, group_stride: int | None = None, index0: int = 0) -> None:
        """Bounded wait of `stream` on flags in this rank's memory (group g written by rank
        first_peer + g): a stream wait watched by the host, or the spinning wait kernel."""
        me = self.world.rank
        stride = per_group if group_stride is None else group_stride
        if self.wait_mode == "kernel":
            wait_flags(self._flag(me, rank_flag_name, index0), expected, self.err, stream,
                       op=self.op, num_groups=num_groups, per_group=per_group,
                       group_stride_words=stride, first_peer=first_peer)
            return
        for g in range(num_groups):
            for j in range(per_group):
                i = index0 + g * stride + j
                self.waiter.wait(stream, self._flag(me, rank_flag_name, i), expected,
                                 first_peer + g, i)

    def _guard(self, stream, flag_name: str, expected: int, peer: int) -> None:
        """A guard (module docstring): `stream` waits for peer's word flag_name[peer] of this
        rank; a timeout records and tells but never releases it (a stream wait in either wait
        mode: a waiting kernel gives up)."""
        me = self.world.rank
        self.waiter.wait(stream, self._flag(me, flag_name, peer), expected, peer, peer,
                         guard=True)

    def _fork(self, s, streams):
        import cupy

        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(s)
        for st in streams:
            st.wait_event(ev)

    def _join(self, s, streams):
        """`s` waits for what `streams` queued so far (events: they hold no guard)."""
        import cupy

        for st in streams:
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(st)
            s.wait_event(ev)

    def _join_guarded(self, s, streams) -> None:
        """`s` waits for what `streams` (which may hold a guard) queued so far, through a
        follower wait (watchdog: no clock of its own, released once the op failed, so a held
        guard never holds `s` and the error names the late peer). The streams end in a chain:
        stream i raises joined[i] = epoch once stream i-1 raised its word (a plain stream wait,
        bounded as the guards before it are), so `s` waits for the last word only: one watched
        wait per call."""
        me, e = self.world.rank, self.epoch
        for i, st in enumerate(streams):
            if i > 0:
                driver.stream_wait_value32(st, self._flag(me, "joined", i - 1), e, "geq")
            driver.stream_write_value32(st, self._flag(me, "joined", i), e)
        if streams:  # a follower (either wait mode): the lanes' waits name the peer
            last = len(streams) - 1
            self.waiter.wait(s, self._flag(me, "joined", last), e, me, last, follow=True)

    # ---- the halves of a call (AllGatherGemm queues its GEMM between them) --------------------
    # A consumer that reads the gathered rows as they land calls begin(), queues its kernel on
    # the same stream (it waits on the chunk flags itself), then send_peers(), and in push mode
    # release() once everything that reads the gathered rows is queued. x must be validated
    # (rows >= 1, the same on every rank) and stay unchanged until the stream has run the call.
    def chunk_flags_ptr(self) -> int:
        """This rank's chunk flags: uint32 [W, max_chunks]; (p, c) = epoch once chunk c of rank
        p's rows is in the gathered buffer."""
        return self.buf.ptr(self.world.rank, "chunk")

    def push_gathered_ptr(self) -> int:
        """Push mode: where this rank's gathered rows land (rank p's at p * rows * row_bytes)."""
        return self.buf.ptr(self.world.rank, "data")

    def begin(self, x, gathered_ptr: int, stream) -> int:
        """Start call e (returned) on `stream` with this rank's own rows.

        pull: wait until every peer finished reading our staging slot (call e-1), stage x, tell
          every peer, copy x to rows [me * rows, (me + 1) * rows) at gathered_ptr, raise our
          own chunk flags.
        push: copy x into our rows of this rank's data region (push_gathered_ptr(); gathered_ptr
          is not used), raise our own chunk flags.
        W = 1: copy x to gathered_ptr (nothing when it is x itself); no flags: whatever is
          queued on `stream` next runs after the copy.
        The copy lanes fork from `stream` here, so what is queued on `stream` afterwards runs
        alongside the peer copies send_peers() queues.
        """
        from cupy.cuda import runtime

        W, me = self.world.size, self.world.rank
        s = stream
        # Every call of the op starts here. A re-arm (CommOp._next_epoch) drains the last call's
        # stream, which waited for its copy lanes.
        e = self._next_epoch(s if self._last_stream is None else self._last_stream)
        self._last_stream = s  # abort() and close() look at it
        rows = x.shape[0]
        nbytes = rows * self.row_bytes
        if W == 1:
            if gathered_ptr != x.data.ptr:
                runtime.memcpyAsync(gathered_ptr, x.data.ptr, nbytes, _MEMCPY_DEFAULT, s.ptr)
            return e
        if self.mode == "pull":
            staging, st = self.buf.ptr(me, "data"), self.stager
            self._fork(s, [st])
            # Peers may still be reading our staging slot from call e-1 (guards: a late peer's
            # read is never overwritten).
            if e > 1:
                for p in range(W):
                    if p != me:
                        self._guard(st, "done", e - 1, p)
            runtime.memcpyAsync(staging, x.data.ptr, nbytes, _MEMCPY_DEFAULT, st.ptr)
            for p in range(W):
                if p != me:
                    driver.stream_write_value32(st, self._flag(p, "ready", me), e)
        dst = (self.push_gathered_ptr() if self.mode == "push" else gathered_ptr) + me * nbytes
        runtime.memcpyAsync(dst, x.data.ptr, nbytes, _MEMCPY_DEFAULT, s.ptr)
        for c, _, _ in self._chunks(rows):
            driver.stream_write_value32(s, self._chunk_flag(me, me, c), e)
        driver.stream_write_value32(s, self._flag(me, "done" if self.mode == "pull" else "free",
                                                  me), e)
        self._fork(s, self.lanes)
        return e

    def send_peers(self, x, gathered_ptr: int, stream) -> None:
        """Queue the peers' rows of the call begin() started: lane streams, stage by stage of
        the transfer order, chunk-major inside a stage (chunk 0 of every peer of the stage,
        then chunk 1, ...: the order of arrival_order()), each chunk followed by its flag.
        `stream` waits for the lanes at the end."""
        from cupy.cuda import runtime

        W, me, e = self.world.size, self.world.rank, self.epoch
        if W == 1:
            return
        rows = x.shape[0]
        nbytes = rows * self.row_bytes
        chunks = list(self._chunks(rows))
        for stage in self.order:
            pairs = list(zip(self.lanes, stage))
            if self.mode == "pull":
                for lane, p in pairs:
                    self._wait(lane, "ready", e, p, index0=p)
                for c, r0, n in chunks:
                    off = r0 * self.row_bytes
                    for lane, p in pairs:
                        runtime.memcpyAsync(gathered_ptr + p * nbytes + off,
                                            self.buf.ptr(p, "data") + off, n * self.row_bytes,
                                            _MEMCPY_DEFAULT, lane.ptr)
                        driver.stream_write_value32(lane, self._chunk_flag(me, p, c), e)
                for lane, p in pairs:
                    driver.stream_write_value32(lane, self._flag(p, "done", me), e)
            else:
                # Rank p's gathered rows of call e-1 must be consumed before we overwrite them
                # (guards: a late peer's rows are never overwritten).
                if e > 1:
                    for lane, p in pairs:
                        self._guard(lane, "free", e - 1, p)
                for c, r0, n in chunks:
                    off = r0 * self.row_bytes
                    for lane, p in pairs:
                        runtime.memcpyAsync(self.buf.ptr(p, "data", me * nbytes + off),
                                            x.data.ptr + off, n * self.row_bytes,
                                            _MEMCPY_DEFAULT, lane.ptr)
                        driver.stream_write_value32(lane, self._chunk_flag(p, me, c), e)
        holders = self._guard_holders()
        self._join(stream, [lane for lane in self.lanes if lane not in holders])
        self._join_guarded(stream, holders)

    def release(self, stream) -> None:
        """Push mode: once `stream` has run everything that reads this call's gathered rows,
        tell every peer it may overwrite its rows in our data region (free[me] = e on it)."""
        if self.mode != "push":
            return
        me = self.world.rank
        for p in range(self.world.size):
            if p != me:
                driver.stream_write_value32(stream, self._flag(p, "free", me), self.epoch)

    def gather_into(self, x, out_ptr: int, stream) -> int:
        """One whole gather (x validated, rows >= 1, the same on every rank): every rank's rows
        at out_ptr in rank order once `stream` has run what this queues; returns the call's
        epoch (path "sm": 0, the epoch is on the device). AllGather's call, and
        AllGatherGemm's unfused route."""
        from cupy.cuda import runtime

        if self._sm:
            self._sm_gather(x, out_ptr, stream)
            return 0
        e = self.begin(x, out_ptr, stream)
        self.send_peers(x, out_ptr, stream)
        W = self.world.size
        if self.mode == "push" and W > 1:  # the gathered rows are in our data region
            rows = x.shape[0]
            self._wait(stream, "chunk", e, 0, num_groups=W, per_group=-(-rows // self.chunk_rows),
                       group_stride=self.max_chunks)
            runtime.memcpyAsync(out_ptr, self.push_gathered_ptr(), W * rows * self.row_bytes,
                                _MEMCPY_DEFAULT, stream.ptr)
            self.release(stream)
        return e

    def _sm_gather(self, x, out_ptr: int, stream) -> None:
        """path "sm", W > 1: one allgather_sm kernel (kernels_cu/allgather.cu) on `stream`."""
        nbytes = x.shape[0] * self.row_bytes
        grid, span = sm_plan(nbytes, self.sm_max_blocks)
        vec = 16 if (x.data.ptr | out_ptr | nbytes) % 16 == 0 else 1
        name = SM_KERNELS[vec]
        self._last_stream = stream  # abort() and close() look at it
        args = ((x, np.uint64(out_ptr)) + self._sm_args_mid + (np.int64(nbytes), np.int64(span))
                + self._sm_args_tail)
        kernels.launch(self.sm_module[name], (grid,), (SM_THREADS,), args, stream, op=self.op,
                       name=name, shared_mem=8 * self.world.size)

    # ---- lifetime (CommOp: close, abort; here: the op's own streams and its watchdog) ---------
    def _own_streams(self) -> list:
        """Streams of the op's own that calls queue work on (the copy lanes, the stager)."""
        return list(self.lanes) + ([self.stager] if self.stager is not None else [])

    def _streams(self):
        """Every stream this op's work may still be queued on: the last call's and its own."""
        last = self._last_stream
        return tuple(([] if last is None else [last]) + self._own_streams())

    @on_op_device
    def synchronize(self, stream=None) -> None:
        """Wait for this rank's work on `stream` (default: the current stream) and on the op's
        own streams; raise CommTimeoutError if a wait of this op failed (then at once: a
        stream holding a guard, or one sharing its hardware queue, may stay held until the
        guard's peer leaves the op)."""
        s = stream_of(stream)
        if not self._drain([s] + self._own_streams()):
            # Failed (here, or told): the call stream's waits are being released; let them
            # record whom they waited for, so the error names the late peer rather than the
            # rank that told this one (bounded: the stream may share its hardware queue with a
            # held guard).
            self._drain([s], self.timeout_s, stop_on_failure=False)
        self.err.check()

    def _quiet(self) -> bool:
        """True once none of this rank's streams can still reach a wait of this op or read its
        memory. close() (every rank came, so every flag comes): after waiting for them, while
        the watchdog still releases a wait that expires. abort() (the error record's abort word
        is set; it returns at once): only where they are idle already."""
        streams = self._streams()
        if int(self.err.words[ABORT]) == 0:
            with self.world.device_context():
                # close() (every rank came): first this rank's reads (of its memory, which a
                # peer's held guarded copy would overwrite once we leave, and of the peers'
                # staging), then leave the op, then the streams that may hold a guard until
                # their peers leave; each bounded by the op's timeout.
                holders = self._guard_holders()
                self._drain([st for st in streams if st not in holders], self.timeout_s,
                            stop_on_failure=False)
                self.err.leave()
                if self._drain(streams, self.timeout_s, stop_on_failure=False):
                    return True
            self.err.words[ABORT] = 1  # still held: close() goes on as abort() does
            return False
        return all(st.done for st in streams)

    def _guard_holders(self) -> list:
        """The streams whose guards wait for peers: push lanes, the pull stager (path "sm": none,
        its kernel's waits are bounded and give up)."""
        if self.world.size == 1 or self._sm:
            return []
        return list(self.lanes) if self.mode == "push" else [self.stager]

    def _free(self) -> None:
        """Stop the stream-wait watchdog once no stream can reach one of its waits. After an
        abort() with work still queued it keeps running (leaked, as the error record is): the
        abort word makes it release each remaining wait as its stream reaches it, a guard once
        its peer leaves. close() with a stream still held past the bound raises (CommOp then
        closes this rank's side as abort() does, memory kept)."""
        closing = int(self.err.words[ABORT]) == 0
        if self._quiet():
            if self.waiter is not None:
                self.waiter.close()
        elif closing:
            raise CufluxError(f"{self.op}: a copy stream of rank {self.world.rank} is still held "
                              f"by a guarded copy {self.timeout_s} s after the op failed (its "
                              "peer neither got there nor left the op)")


class AllGather(CopyGather):
    """Gather each rank's [rows, cols] shard into [W * rows, cols] on every rank.

    Args:
      world: cuflux.World (with a CUDA device: without one the constructor raises
        NoDeviceError "AllGather: needs a CUDA device; ..." before anything else).
      max_rows: largest rows per rank any call will use: the bound of x.shape[0] (the
        gathered output has up to W * max_rows rows). AllGatherGemm takes the same bound as
        max_rows_per_rank (or as max_m = W * rows, the GEMM's M).
      cols: elements per row.
      dtype: any cuflux dtype (the copy moves bytes).
      mode: "pull" (read peers' staged shards) or "push" (write into peers).
      chunk_rows: rows per flagged chunk (None: one chunk per shard).
      Sizes (max_rows, cols, chunk_rows) are ints (Python or NumPy integers; no bools, floats or
      strings) >= 1, checked by cuflux.sizes.count.
      timeout_s: bound of every wait; on expiry the op raises CommTimeoutError.
      wait: "stream" (cuStreamWaitValue32 watched by a host thread: no SM used) or "kernel"
        (a one-block bounded spin kernel per wait).
      name: the op named in errors and timeouts (a key of cuflux.errors.OP_CODES).
      path: "copy" (copy engines driven from the host: no SM used; CUDA-graph capture refused
        at W > 1, CaptureError) or "sm" (one kernel a call, SMs loading the peers' staged rows
        over P2P, its epoch on the device: capturable; mode, chunk_rows and wait do nothing;
        the op holds a stage of 2 * max_rows rows at W > 1). Its calls must be ordered on each
        rank (one stream, or streams the caller orders): their epochs and stages are the op's.

    Every rank must make the same calls with the same rows (compared across ranks, bounded,
    the first time a row count is seen). Errors of device-side waits surface at the next call
    or at `synchronize()`; a failed op refuses to run: close() or abort() it and build a new
    one. CUDA-graph capturable at W = 1, and at any W with path="sm".
    """

    ACROSS = "AllGatherAcrossNodes"  # several nodes: CommOp.__new__

    @on_world_device
    def __init__(self, world, max_rows: int, cols: int, dtype, mode: str = "pull",
                 chunk_rows: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, wait: str = "stream",
                 name: str = _OP, path: str = "copy"):
        require_world_device(world, name)  # first: without a GPU, this is the one error to see
        if mode not in ("pull", "push"):
            raise ValueError(f"{_OP}: mode must be 'pull' or 'push', got {mode!r}")
        max_rows = count(_OP, "max_rows", max_rows, what="rows per rank")
        cols = count(_OP, "cols", cols, what="elements per row")
        chunk_rows = optional_count(_OP, "chunk_rows", chunk_rows,
                                    what="rows per flagged chunk; None: the whole shard")
        check_timeout(_OP, timeout_s)
        if wait not in ("stream", "kernel"):
            raise ValueError(f"{_OP}: wait must be 'stream' or 'kernel', got {wait!r}")
        check_path(_OP, path)
        info = dtype_info(dtype, op=_OP)
        chunk_rows = chunk_rows if chunk_rows is not None else max_rows
        world.check_same((max_rows, cols, info.name, mode, chunk_rows, path),
                         f"{_OP} arguments (max_rows, cols, dtype, mode, chunk_rows, path)")
        self._closed = True  # until the buffers exist
        super().__init__(world, name, timeout_s, max_rows, cols, info, mode, chunk_rows, wait,
                         path)
        self._closed = False

    @on_op_device
    def __call__(self, x, out=None, stream=None):
        """x [rows, cols] (rows <= max_rows, the same on every rank) -> [W * rows, cols]."""
        import cupy

        self._check_open()
        x_in, out_in = x, out  # the caller's: torch in, torch out
        x, rows, s = self._check_call(x, stream)
        W = self.world.size
        if W > 1:
            if self.path == "copy":
                self._no_capture(s, _NO_CAPTURE)
            if rows not in self._agreed:
                self._agree(rows, "rows of the call")
        if out is None:
            if is_torch(x_in):  # from the pool of the call's stream (torch's): reused in order
                with s:
                    out = cupy.empty((W * rows, self.cols), dtype=self.dtype.storage)
            else:
                out = cupy.empty((W * rows, self.cols), dtype=self.dtype.storage)
        else:
            out = as_cupy(out, "out", self.op)
            check_array(out, name="out", op=self.op, shape=(W * rows, self.cols),
                        dtype=self.dtype, device=self.world.device)
        if rows:  # 0 rows on every rank (rows agree): no exchange, no epoch
            self.gather_into(x, out.data.ptr, s)  # W = 1: one copy, no flags
        return to_caller(out, x_in, out_in)

    def _check_call(self, x, stream):
        """Validate x (before anything is queued); returns (x, rows, stream)."""
        x_in, x = x, check_rows(x, name="x", op=self.op, cols=self.cols, max_rows=self.max_rows,
                                limit="max_rows", dtype=self.dtype, device=self.world.device)
        return x, x.shape[0], stream_of(stream, x_in)
