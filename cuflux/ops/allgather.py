"""AllGather over copy engines, driven from the host (the DMA path of AllGather+GEMM).

x [rows, cols] on every rank -> out [W * rows, cols], rank p's rows at p * rows.

Copies are cudaMemcpyAsync calls (copy engines, no SMs) issued from the host on one stream per
concurrent peer ("lane"), peers visited in the topology's transfer order (full mesh over
NVLink, ring over PCIe, 2-D ring across NUMA domains). After each copied chunk
cuStreamWriteValue32 raises that chunk's flag, so a consumer (the AG+GEMM kernel) can start on a
chunk as soon as it lands. Flags are epochs (call e writes e) in the waiter's own memory.

Symmetric layout (one IPC allocation per op, 128-byte aligned regions):
  data    pull: [max_rows, cols] this rank's shard, staged for peers to read
          push: [W * max_rows, cols] the gathered rows, written by the peers
  chunk   uint32 [W, max_chunks]: chunk (p, c) of the gathered rows has landed (epoch)
  ready   uint32 [W] (pull): ready[p] = e when rank p staged its shard of call e
  done    uint32 [W] (pull): done[p] = e when rank p finished reading our staged shard
  free    uint32 [W] (push): free[p] = e when rank p consumed its gathered rows of call e,
          so our shard of call e+1 may overwrite them

Pull, call e:  S: wait done[*] >= e-1; stage x; ready[me] -> every peer; copy own rows.
               lane(p): wait ready[p] >= e; copy chunks from p's staging, raise chunk[p, c];
               done[me] = e -> p.
Push, call e:  S: copy own rows; lane(p): wait free[p] >= e-1; copy chunks of x into p's data,
               raise chunk[me, c] on p.  Then S: wait chunk[*] >= e; copy out; free[me] = e ->
               every peer.
"""
from __future__ import annotations

import numpy as np

from cuflux import driver
from cuflux.arrays import as_cupy, check_array, dtype_info, stream_of
from cuflux.errors import OP_CODES, CufluxError, ErrorRecord
from cuflux.ops.signal import wait_flags
from cuflux.symmetric import Layout
from cuflux.topology import transfer_order
from cuflux.watchdog import StreamWaiter

__all__ = ["AllGather"]

_OP = "AllGather"
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: UVA decides the direction (peer pointers included)


class AllGather:
    """Gather each rank's [rows, cols] shard into [W * rows, cols] on every rank.

    Args:
      world: cuflux.World.
      max_rows: largest rows per rank any call will use.
      cols: elements per row.
      dtype: any cuflux dtype (the copy moves bytes).
      mode: "pull" (read peers' staged shards) or "push" (write into peers).
      chunk_rows: rows per flagged chunk (None: one chunk per shard).
      timeout_s: bound of every wait; on expiry the op raises CommTimeoutError.
      wait: "stream" (cuStreamWaitValue32 watched by a host thread: no SM used) or "kernel"
        (a one-block bounded spin kernel per wait).

    Errors of device-side waits surface at the next call or at `synchronize()`.
    """

    def __init__(self, world, max_rows: int, cols: int, dtype, mode: str = "pull",
                 chunk_rows: int | None = None, timeout_s: float = 30.0, wait: str = "stream"):
        if mode not in ("pull", "push"):
            raise ValueError(f"{_OP}: mode must be 'pull' or 'push', got {mode!r}")
        if max_rows < 1 or cols < 1:
            raise ValueError(f"{_OP}: max_rows and cols must be >= 1, got {max_rows}, {cols}")
        if chunk_rows is not None and chunk_rows < 1:
            raise ValueError(f"{_OP}: chunk_rows must be >= 1 or None, got {chunk_rows}")
        if timeout_s <= 0:
            raise ValueError(f"{_OP}: timeout_s must be > 0, got {timeout_s}")
        if wait not in ("stream", "kernel"):
            raise ValueError(f"{_OP}: wait must be 'stream' or 'kernel', got {wait!r}")
        import cupy

        self.world, self.mode, self.cols = world, mode, int(cols)
        self.max_rows = int(max_rows)
        self.dtype = dtype_info(dtype, op=_OP)
        self.chunk_rows = int(chunk_rows) if chunk_rows else self.max_rows
        self.max_chunks = -(-self.max_rows // self.chunk_rows)
        world.check_same((self.max_rows, self.cols, self.dtype.name, mode, self.chunk_rows),
                         f"{_OP} arguments (max_rows, cols, dtype, mode, chunk_rows)")
        W = world.size
        self.row_bytes = self.cols * self.dtype.itemsize
        layout = Layout()
        data_rows = self.max_rows if mode == "pull" else W * self.max_rows
        layout.add("data", (data_rows, self.row_bytes), np.uint8)
        layout.add("chunk", (W, self.max_chunks), np.uint32)
        for name in ("ready", "done", "free"):
            layout.add(name, (W,), np.uint32)
        self.layout = layout
        self.err = ErrorRecord(_OP, world.rank, timeout_s)
        self.wait_mode = wait
        self.waiter = StreamWaiter(self.err, world.device, OP_CODES[_OP])
        self.buf = world.alloc_layout(layout)
        self.order = transfer_order(world.topology, W)
        num_lanes = max([len(stage) for stage in self.order], default=0)
        self.lanes = [cupy.cuda.Stream(non_blocking=True) for _ in range(num_lanes)]
        self.epoch = 0
        from cuflux import kernels

        kernels.load("signal.cu")  # eager: nothing may load a module while a stream spins
        self._closed = False

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
            wait_flags(self._flag(me, rank_flag_name, index0), expected, self.err, stream, op=_OP,
                       num_groups=num_groups, per_group=per_group, group_stride_words=stride,
                       first_peer=first_peer)
            return
        for g in range(num_groups):
            for j in range(per_group):
                i = index0 + g * stride + j
                self.waiter.wait(stream, self._flag(me, rank_flag_name, i), expected,
                                 first_peer + g, i)

    # ---- call ----------------------------------------------------------------------------------
    def __call__(self, x, out=None, stream=None):
        """x [rows, cols] (rows <= max_rows, the same on every rank) -> [W * rows, cols]."""
        import cupy
        from cupy.cuda import runtime

        if self._closed:
            raise CufluxError(f"{_OP}: the op is closed")
        self.err.check()
        x = as_cupy(x, "x", _OP)
        check_array(x, name="x", op=_OP, ndim=2, dtype=self.dtype, device=self.world.device)
        rows = x.shape[0]
        if x.shape[1] != self.cols:
            raise ValueError(f"{_OP}: x must have {self.cols} columns, got shape {tuple(x.shape)}")
        if rows > self.max_rows:
            raise ValueError(f"{_OP}: x has {rows} rows, more than max_rows={self.max_rows}")
        W, me = self.world.size, self.world.rank
        if out is None:
            out = cupy.empty((W * rows, self.cols), dtype=self.dtype.storage)
        else:
            out = as_cupy(out, "out", _OP)
            check_array(out, name="out", op=_OP, shape=(W * rows, self.cols), dtype=self.dtype,
                        device=self.world.device)
        s = stream_of(stream)
        nbytes = rows * self.row_bytes
        if rows == 0:  # every rank has 0 rows (rows must agree): no exchange, no epoch
            return out
        self.epoch += 1
        e = self.epoch
        if W == 1:  # nothing to exchange: one copy, no flags
            runtime.memcpyAsync(out.data.ptr, x.data.ptr, nbytes, _MEMCPY_DEFAULT, s.ptr)
            return out
        if self.mode == "pull":
            self._pull(x, out, rows, nbytes, e, s, runtime)
        else:
            self._push(x, out, rows, nbytes, e, s, runtime)
        return out

    def _fork(self, s):
        import cupy

        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(s)
        for lane in self.lanes:
            lane.wait_event(ev)

    def _join(self, s):
        import cupy

        for lane in self.lanes:
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(lane)
            s.wait_event(ev)

    def _pull(self, x, out, rows, nbytes, e, s, runtime):
        W, me = self.world.size, self.world.rank
        staging = self.buf.ptr(me, "data")
        # Peers may still be reading our staging slot from call e-1.
        if e > 1:
            self._wait(s, "done", e - 1, 0, num_groups=W)
        runtime.memcpyAsync(staging, x.data.ptr, nbytes, _MEMCPY_DEFAULT, s.ptr)
        for p in range(W):
            if p != me:
                driver.stream_write_value32(s, self._flag(p, "ready", me), e)
        runtime.memcpyAsync(out.data.ptr + me * nbytes, x.data.ptr, nbytes, _MEMCPY_DEFAULT, s.ptr)
        for c, _, _ in self._chunks(rows):
            driver.stream_write_value32(s, self._chunk_flag(me, me, c), e)
        driver.stream_write_value32(s, self._flag(me, "done", me), e)
        self._fork(s)
        for stage in self.order:
            for lane, p in zip(self.lanes, stage):
                self._wait(lane, "ready", e, p, index0=p)
                src = self.buf.ptr(p, "data")
                for c, r0, n in self._chunks(rows):
                    off = r0 * self.row_bytes
                    runtime.memcpyAsync(out.data.ptr + p * nbytes + off, src + off,
                                        n * self.row_bytes, _MEMCPY_DEFAULT, lane.ptr)
                    driver.stream_write_value32(lane, self._chunk_flag(me, p, c), e)
                driver.stream_write_value32(lane, self._flag(p, "done", me), e)
        self._join(s)

    def _push(self, x, out, rows, nbytes, e, s, runtime):
        W, me = self.world.size, self.world.rank
        runtime.memcpyAsync(self.buf.ptr(me, "data", me * nbytes), x.data.ptr, nbytes,
                            _MEMCPY_DEFAULT, s.ptr)
        for c, _, _ in self._chunks(rows):
            driver.stream_write_value32(s, self._chunk_flag(me, me, c), e)
        driver.stream_write_value32(s, self._flag(me, "free", me), e)
        self._fork(s)
        for stage in self.order:
            for lane, p in zip(self.lanes, stage):
                # Rank p's gathered rows of call e-1 must be consumed before we overwrite them.
                if e > 1:
                    self._wait(lane, "free", e - 1, p, index0=p)
                dst = self.buf.ptr(p, "data", me * nbytes)
                for c, r0, n in self._chunks(rows):
                    off = r0 * self.row_bytes
                    runtime.memcpyAsync(dst + off, x.data.ptr + off, n * self.row_bytes,
                                        _MEMCPY_DEFAULT, lane.ptr)
                    driver.stream_write_value32(lane, self._chunk_flag(p, me, c), e)
        self._join(s)
        nchunks = -(-rows // self.chunk_rows)
        self._wait(s, "chunk", e, 0, num_groups=W, per_group=nchunks,
                   group_stride=self.max_chunks)
        runtime.memcpyAsync(out.data.ptr, self.buf.ptr(me, "data"), W * nbytes, _MEMCPY_DEFAULT,
                            s.ptr)
        for p in range(W):
            if p != me:
                driver.stream_write_value32(s, self._flag(p, "free", me), e)

    # ---- lifetime ------------------------------------------------------------------------------
    def synchronize(self, stream=None) -> None:
        """Wait for this rank's work on `stream` and raise CommTimeoutError if a wait failed."""
        stream_of(stream).synchronize()
        for lane in self.lanes:
            lane.synchronize()
        self.err.check()

    def close(self) -> None:
        """Collective and idempotent: every rank must call it."""
        if self._closed:
            return
        self._closed = True
        self.buf.close()
        self.waiter.close()
        self.err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
