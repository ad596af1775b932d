"""All2All of attention heads for Ulysses sequence parallelism (kernels_cu/all2all.cu).

scatter_heads: x [B, T_r, H, D] on rank r -> y [B, S, H/W, D] on every rank t, holding heads
               [t*H/W, (t+1)*H/W) of every rank's tokens, rank r's at token offset sum(T[:r]).
gather_heads:  the inverse, y [B, S, H/W, D] -> x [B, T_r, H, D].
S = sum(tokens_per_rank); token counts may differ between ranks and may be 0.

Push through CUDA IPC: each rank's kernel writes every peer's rows into that peer's symmetric
receive slot (already in the output's layout) and its own rows straight into its output; after
the peers' flags arrive the receiver copies their rows from the slot into its output, or hands
out a view of the slot (`view=True`, no copy). Two slots alternate between calls, so no start
barrier is needed (the .cu header says why that is safe). fp8 data travels as uint8 storage;
optional float32 scales (per token, or per token and head) travel with their rows.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import math
import operator

import numpy as np

from cuflux import kernels
from cuflux.arrays import (DType, as_cupy, check_array, dtype_info, stream_of, to_caller,
                           zeros_settled)
from cuflux.errors import (EXPECTED, OBSERVED, PEER, RANK, STATUS, STATUS_OK, CaptureError,
                           CommTimeoutError, CufluxError)
from cuflux.launch import capturing as _capturing
from cuflux.launch import graph_replay
from cuflux.ops.base import (CUPY, DEFAULT_TIMEOUT_S, CommOp, check_no_alias, check_timeout,
                             on_op_device)
from cuflux.sizes import count, optional_count
from cuflux.symmetric import Layout

__all__ = ["All2AllHeads", "reference_scatter_heads", "reference_gather_heads"]

_OP = "All2AllHeads"
_VEC_BYTES = (16, 8, 4, 2, 1)
THREADS = 512          # threads per block of the copy kernels
BLOCKS_PER_SM = 2      # num_sms SMs -> num_sms * BLOCKS_PER_SM blocks (1024 threads per SM)
# Of a W > 1 grid, about 1 / (LOCAL_SHARE * W) copies this rank's own rows (HBM to HBM, many
# times the link's rate); the rest push to the peers. An even deal (each target 1 / W of the
# blocks) left half the grid on the local copy at W = 2, which ends early, and the pushes at
# 0.60-0.72 of the peer rate (issue 17).
LOCAL_SHARE = 4
FLAG_BYTES = 128       # one flag slot per (sender, block); kFlagWords in the .cu
STATUS_MISMATCH = 3    # kStatusMismatch in the .cu: a peer's call had other arguments
CACHE_MAX = 1024       # distinct token lists remembered (checked across ranks, uploaded)
MEMCPY_DEFAULT = 4     # cudaMemcpyDefault
MAX_ROWS = 2**31 - 1   # rows per kernel (u32 row indices in the .cu)
W1_PATHS = ("pdl", "memcpy", "kernel")  # All2AllHeads(w1=...): how a W = 1 call copies


def _name_push(vec: int, gather: bool) -> str:
    return f"a2a_push<{vec}, {'true' if gather else 'false'}>"


def _name_recv(vec: int, gather: bool) -> str:
    return f"a2a_recv<{vec}, {'true' if gather else 'false'}>"


FAMILY = kernels.register(
    "all2all.cu",
    [_name_push(v, g) for v in _VEC_BYTES for g in (False, True)]
    + [_name_recv(v, g) for v in _VEC_BYTES for g in (False, True)] + ["a2a_copy_w1"])


# ---- argument checks (pure Python: the CPU tests call them) --------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
    """What one op was built for; the shapes of both directions follow from it."""

    world_size: int
    rank: int
    device: int | None
    max_tokens: int
    num_heads: int
    head_dim: int
    dtype: DType
    batch: int

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world_size

    @property
    def row_bytes(self) -> int:
        """One token's head group on one rank: the unit the kernels move."""
        return self.heads_per_rank * self.head_dim * self.dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        return self.batch * self.max_tokens * self.num_heads * self.head_dim * self.dtype.itemsize


def check_op_args(world_size: int, max_tokens_per_rank, num_heads, head_dim, batch, num_sms,
                  timeout_s) -> None:
    for name, v, what in (("max_tokens_per_rank", max_tokens_per_rank, "tokens per rank"),
                          ("num_heads", num_heads, "attention heads"),
                          ("head_dim", head_dim, "elements per head"),
                          ("batch", batch, "largest batch of a call")):
        count(_OP, name, v, what=what)
    if num_heads % world_size:
        raise ValueError(f"{_OP}: num_heads must be divisible by the world size {world_size}, "
                         f"got num_heads={num_heads}")
    optional_count(_OP, "num_sms", num_sms, what="SMs the copy kernels use; None: all")
    check_timeout(_OP, timeout_s)
    if batch * world_size * max_tokens_per_rank * (num_heads // world_size) > MAX_ROWS:
        raise ValueError(f"{_OP}: batch * world size * max_tokens_per_rank * num_heads / world "
                         f"size must stay below 2**31 rows, got {batch}, {world_size}, "
                         f"{max_tokens_per_rank}, {num_heads}")


def check_tokens(tokens_per_rank, world_size: int, max_tokens: int) -> tuple[int, ...]:
    """tokens_per_rank as a tuple of W ints in [0, max_tokens], or a clear error."""
    try:
        tokens = tuple(operator.index(t) for t in tokens_per_rank)
    except TypeError:
        raise TypeError(f"{_OP}: tokens_per_rank must be a sequence of {world_size} integers, "
                        f"got {tokens_per_rank!r}") from None
    if len(tokens) != world_size:
        raise ValueError(f"{_OP}: tokens_per_rank must have one entry per rank ({world_size}), "
                         f"got {len(tokens)}: {list(tokens)}")
    for r, t in enumerate(tokens):
        if t < 0 or t > max_tokens:
            raise ValueError(f"{_OP}: tokens_per_rank[{r}] must be in [0, max_tokens_per_rank="
                             f"{max_tokens}], got {t}")
    return tokens


def io_shapes(spec: Spec, gather: bool, batch: int, tokens) -> tuple[tuple, tuple]:
    """(input shape, output shape) of one call on spec.rank."""
    H, D, hpr = spec.num_heads, spec.head_dim, spec.heads_per_rank
    mine, total = (batch, tokens[spec.rank], H, D), (batch, sum(tokens), hpr, D)
    return (total, mine) if gather else (mine, total)


def scale_shapes(spec: Spec, gather: bool, batch: int, tokens, per_head: bool):
    """(input, output) shapes of the scales. Scatter: [B, T_r] or [B, T_r, H] -> [B, S] or
    [B, S, H/W]. Gather: [B, S] -> [B, T_r, W] (one scale per token and source rank's head
    group) or [B, S, H/W] -> [B, T_r, H]."""
    T, S, W, hpr = tokens[spec.rank], sum(tokens), spec.world_size, spec.heads_per_rank
    if gather:
        return ((batch, S, hpr), (batch, T, W * hpr)) if per_head else ((batch, S), (batch, T, W))
    return ((batch, T, W * hpr), (batch, S, hpr)) if per_head else ((batch, T), (batch, S))


def check_call(spec: Spec, gather: bool, a, tokens, scale=None) -> tuple[int, int]:
    """Validate the input (and its scales) of one call; return (batch, scale mode).

    Scale mode: 0 none, 1 per token, 2 per token and head."""
    name = "y" if gather else "x"
    check_array(a, name=name, op=_OP, ndim=4, dtype=spec.dtype, device=spec.device)
    B = int(a.shape[0])
    if not 1 <= B <= spec.batch:
        raise ValueError(f"{_OP}: {name} has batch {B}; this op was built for batch 1 to "
                         f"{spec.batch}")
    want, _ = io_shapes(spec, gather, B, tokens)
    if tuple(a.shape) != want:
        what = "[B, sum(tokens), H/W, D]" if gather else "[B, tokens_per_rank[rank], H, D]"
        raise ValueError(f"{_OP}: {name} must have shape {what} = {want} on rank {spec.rank}, "
                         f"got {tuple(a.shape)}")
    mode = 0
    if scale is not None:
        f32 = dtype_info("float32")
        per_token, _ = scale_shapes(spec, gather, B, tokens, False)
        per_head, _ = scale_shapes(spec, gather, B, tokens, True)
        if tuple(scale.shape) == per_token:
            mode = 1
        elif tuple(scale.shape) == per_head:
            mode = 2
        else:
            raise ValueError(f"{_OP}: scale must have shape {per_token} (per token) or "
                             f"{per_head} (per token and head), got {tuple(scale.shape)}")
        check_array(scale, name="scale", op=_OP, dtype=f32, device=spec.device)
    return B, mode


def deal_blocks(num_blocks: int, world_size: int) -> tuple[int, int, int]:
    """(grid, L, R) of a2a_push: blocks [0, L) copy this rank's own rows, then R blocks serve
    each peer (kernels_cu/all2all.cu's header), grid = L + R * (W - 1) <= num_blocks. The same
    on every rank (num_blocks is agreed), so each rank waits for R flags from each peer."""
    if world_size == 1:
        return num_blocks, num_blocks, 0
    local = max(1, num_blocks // (LOCAL_SHARE * world_size))
    remote = max(1, (num_blocks - local) // (world_size - 1))
    return local + remote * (world_size - 1), local, remote


def build_layout(spec: Spec, blocks_per_target: int) -> Layout:
    """The symmetric buffer, as the .cu header describes it: two receive slots of data and of
    scales, and the flags [2][W][blocks per target][32 words]."""
    layout = Layout()
    for parity in (0, 1):
        layout.add(f"data{parity}", (spec.slot_bytes,), np.uint8)
    for parity in (0, 1):
        layout.add(f"scale{parity}", (spec.batch * spec.max_tokens * spec.num_heads,), np.float32)
    layout.add("flags", (2, spec.world_size, blocks_per_target, FLAG_BYTES // 4), np.uint32)
    return layout


def vec_bytes(row_bytes: int, *ptrs: int) -> int:
    """Widest vector (16, 8, 4, 2, 1 bytes) that divides the row and every pointer."""
    for v in _VEC_BYTES:
        if row_bytes % v == 0 and all(p % v == 0 for p in ptrs):
            return v
    return 1


def call_hash(key) -> int:
    """32-bit hash of a call's collective arguments, carried beside each flag."""
    return call_digest(key) & 0xFFFFFFFF


def call_digest(key) -> int:
    """64-bit digest of a call's collective arguments, compared across ranks on the host."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


# ---- NumPy golden model --------------------------------------------------------------------------
def reference_scatter_heads(xs, tokens_per_rank, W, scales=None):
    """xs: W arrays [B, T_r, H, D] -> W arrays [B, S, H/W, D] (and the scales, if given: W arrays
    [B, T_r] or [B, T_r, H] -> [B, S] or [B, S, H/W])."""
    assert len(xs) == W and all(x.shape[1] == t for x, t in zip(xs, tokens_per_rank))
    hpr = xs[0].shape[2] // W
    ys = [np.concatenate([x[:, :, t * hpr:(t + 1) * hpr] for x in xs], axis=1) for t in range(W)]
    if scales is None:
        return ys
    if scales[0].ndim == 2:
        y_scales = [np.concatenate(list(scales), axis=1) for _ in range(W)]
    else:
        y_scales = [np.concatenate([s[:, :, t * hpr:(t + 1) * hpr] for s in scales], axis=1)
                    for t in range(W)]
    return ys, y_scales


def reference_gather_heads(ys, tokens_per_rank, W, scales=None):
    """ys: W arrays [B, S, H/W, D] -> W arrays [B, T_r, H, D] (and the scales, if given: W arrays
    [B, S] or [B, S, H/W] -> [B, T_r, W] or [B, T_r, H])."""
    prefix = np.concatenate([[0], np.cumsum(tokens_per_rank)]).astype(int)
    assert len(ys) == W and all(y.shape[1] == prefix[-1] for y in ys)
    xs = [np.concatenate([y[:, prefix[r]:prefix[r + 1]] for y in ys], axis=2) for r in range(W)]
    if scales is None:
        return xs
    if scales[0].ndim == 2:
        x_scales = [np.stack([s[:, prefix[r]:prefix[r + 1]] for s in scales], axis=2)
                    for r in range(W)]
    else:
        x_scales = [np.concatenate([s[:, prefix[r]:prefix[r + 1]] for s in scales], axis=2)
                    for r in range(W)]
    return xs, x_scales


# ---- the op --------------------------------------------------------------------------------------
class All2AllHeads(CommOp):
    """Redistribute attention heads between the ranks of a World (Ulysses sequence parallelism).

    Args:
      world: cuflux.World.
      max_tokens_per_rank: largest token count any rank passes in any call.
      num_heads, head_dim: H and D (H divisible by the world size; any D).
      dtype: bfloat16, float16, float32, float8_e4m3fn or float8_e5m2 (fp8 as uint8 storage).
      batch: largest batch B of any call.
      num_sms: SMs the copy kernels use (num_sms * BLOCKS_PER_SM blocks of THREADS threads);
        None: every SM of the device (the best measured on the H200, see cuflux/bench/all2all.py).
      timeout_s: bound of every wait; on expiry the op raises CommTimeoutError.
      w1: how a call runs at W = 1, where it is one copy (input and output have the same
        layout): "pdl" (default) a copy kernel launched with programmatic dependent launch where
        16-byte vectors fit, so its launch overlaps the end of the kernel ahead of it (0.93-0.95
        of the copy rate on the H200, `python -m cuflux.bench all2all`; cudaMemcpyAsync where
        they do not fit, and for calls with scales, whose two copies then replay as one graph:
        a PDL launch cannot join a graph, and a PDL launch beside a copy cost 18 us of host time
        a call against 11 for the two copies, scripts/results/probe_torch_path-h200-2026-12-02.txt),
        "memcpy" always cudaMemcpyAsync (0.90), "kernel" the general push
        kernel (what W > 1 runs; tests and benchmarks). The attribute `op.w1` may be changed
        between calls.

    Every rank calls scatter_heads / gather_heads in the same order with the same
    tokens_per_rank, batch and kind of scales: checked across ranks the first time a combination
    is seen (bounded by timeout_s), and on every call by a hash the kernels compare. At W = 1 a
    call is one copy (input and output have the same layout): a kernel launched with
    programmatic dependent launch where 16-byte vectors fit, else cudaMemcpyAsync. Each call
    returns at once; a failed wait surfaces at the next call or at `synchronize()`. After any
    failure the op refuses to run: close it (collectively) and build a new one.
    """

    ACROSS = "All2AllHeadsAcrossNodes"  # several nodes: CommOp.__new__

    def __init__(self, world, max_tokens_per_rank: int, num_heads: int, head_dim: int, dtype,
                 batch: int = 1, num_sms: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, w1: str = "pdl"):
        if w1 not in W1_PATHS:
            raise ValueError(f"{_OP}: w1 must be one of {W1_PATHS}, got {w1!r}")
        W = world.size
        check_op_args(W, max_tokens_per_rank, num_heads, head_dim, batch, num_sms, timeout_s)
        info = dtype_info(dtype, op=_OP)
        self._closed = True  # until the buffers exist
        super().__init__(world, _OP, timeout_s)
        self.spec = Spec(W, world.rank, world.device, int(max_tokens_per_rank), int(num_heads),
                         int(head_dim), info, int(batch))
        if num_sms is None:
            num_sms = self.num_sms
        self.num_blocks = max(int(num_sms) * BLOCKS_PER_SM, W)  # every target gets a block
        world.check_same((self.spec.max_tokens, num_heads, head_dim, info.name, batch,
                          self.num_blocks),
                         f"{_OP} arguments (max_tokens_per_rank, num_heads, head_dim, dtype, "
                         f"batch, blocks)")
        self.grid, self.local_blocks, self.blocks_per_target = deal_blocks(self.num_blocks, W)
        flag_rows = max(1, self.blocks_per_target)  # W = 1 raises no flag: one unused row
        # a2a_recv's grid: its blocks wait, so at most the SMs this rank may take (ranks that
        # share a GPU concurrently leave each other room for a2a_push, which never waits), and
        # no more than the SMs the copy kernels were given (num_sms).
        self.recv_grid = max(1, min((W - 1) * self.blocks_per_target, int(num_sms),
                                    self.num_sms // self.sharers))
        self.layout = layout = build_layout(self.spec, flag_rows)
        self._alloc(layout)
        mod = kernels.load("all2all.cu", world.device)  # eager: nothing may load while we spin
        self._push = {(v, g): mod[_name_push(v, g)] for v in _VEC_BYTES for g in (False, True)}
        self._recv = {(v, g): mod[_name_recv(v, g)] for v in _VEC_BYTES for g in (False, True)}
        self._copy_w1 = mod["a2a_copy_w1"]
        # Launch arguments that never change, as the kernels take them (per-call cost matters:
        # at W = 1 a call moves 128 MiB in ~31 us).
        off = {name: reg.offset for name, reg in layout.regions.items()}
        base = self.buf.base_ptrs[world.rank]
        flags_bytes = W * flag_rows * FLAG_BYTES
        # Both parities' slots and flags: the kernels pick call e's (e % 2) from the device
        # epoch, self.state[0] (completed by a2a_recv), so captured graphs replay correctly.
        f0, f1 = off["flags"], off["flags"] + flags_bytes
        u64 = np.uint64
        self._push_slots = (u64(off["data0"]), u64(off["data1"]), u64(off["scale0"]),
                            u64(off["scale1"]), u64(f0), u64(f1))
        self._wait_flags = (u64(base + f0), u64(base + f1))
        self._copy_slots = ((u64(base + off["data0"]), u64(base + off["data1"])),
                            (u64(base + off["scale0"]), u64(base + off["scale1"])))
        with world.device_context():
            # [epoch of the last completed call, a2a_recv blocks finished] (sync.cuh count_out)
            self.state = zeros_settled(2, np.uint64)
        self._captured = False  # once captured, the host no longer knows the device's epoch
        self._row_bytes = self.spec.row_bytes
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._plans_captured = 0  # of them, held by a captured graph when last emptied
        self._hashes: dict = {}
        self._views: dict = {}  # (region, shape, dtype) -> a view of this rank's slot
        self._out_shapes: dict = {}  # (gather, tokens, B, scale ndim) -> owned output shapes
        self.w1 = w1
        self._closed = False

    # ---- public calls ------------------------------------------------------------------------
    def scatter_heads(self, x, tokens_per_rank, scale=None, *, out=None, out_scale=None,
                      view: bool = False, stream=None):
        """x [B, T_r, H, D] -> y [B, S, H/W, D]; with `scale` ([B, T_r] or [B, T_r, H] float32)
        returns (y, y_scale) with y_scale [B, S] or [B, S, H/W].

        out / out_scale: write into the caller's arrays. view=True: return views of the op's
        receive slot instead of a copy; a view stays valid until the next call of this op is
        issued (work enqueued on the same stream before that call reads it safely) and dies
        with close().
        """
        return self._call(False, x, tokens_per_rank, scale, out, out_scale, view, stream)

    def gather_heads(self, y, tokens_per_rank, scale=None, *, out=None, out_scale=None,
                     view: bool = False, stream=None):
        """y [B, S, H/W, D] -> x [B, T_r, H, D]; with `scale` ([B, S] or [B, S, H/W] float32)
        returns (x, x_scale) with x_scale [B, T_r, W] (per source rank's head group) or
        [B, T_r, H]. out / out_scale / view as in scatter_heads."""
        return self._call(True, y, tokens_per_rank, scale, out, out_scale, view, stream)

    __call__ = scatter_heads

    def _call(self, gather, a, tokens_per_rank, scale, out, out_scale, view, stream):
        """A call seen before (CuPy arrays or torch tensors; tokens_per_rank a list or tuple
        of integers; out= given, and out_scale= with scales, or both left to the op, or
        view=True with neither, CuPy arrays only) replays what it launched (base.CallMemo);
        any other call takes the full path (_run). Outputs left to the op are allocated
        first (_owned_outputs), so a loop that drops them hits too."""
        key = None
        tokens = _tokens_key(tokens_per_rank)
        if tokens is not None:
            memo = self._memo
            if view:
                # a view is the receive slot of the call's parity: a key per parity (CuPy
                # views: a torch caller's are converted by the full path)
                if out is None and out_scale is None and memo.owns(a, scale) == CUPY:
                    key = memo.key((a,) if scale is None else (a, scale),
                                   (gather, tokens, self.w1, True, (self.epoch + 1) & 1))
            else:
                if out is None and out_scale is None and memo.owns(a, scale):
                    out, out_scale = self._owned_outputs(gather, a, tokens, scale, stream)
                if out is not None and (scale is None) == (out_scale is None):
                    key = memo.key((a, out) if scale is None else (a, scale, out, out_scale),
                                   (gather, tokens, self.w1, False, 0))
            run = memo.get(key)
            if run is not None and self._replay(run, view, stream, a):
                if view:
                    out, out_scale = run.views
                return (out, out_scale) if scale is not None else out
        return self._run(gather, a, tokens_per_rank, scale, out, out_scale, view, stream, key)

    def _owned_outputs(self, gather, a, tokens, scale, stream) -> tuple:
        """(out, out_scale or None) for a call that leaves them to the op (CuPy arrays or
        torch tensors, as a is): CallMemo.output, or (None, None) where the call's shapes are
        not the op's (the full path then names what is wrong)."""
        spec = self.spec
        if self._closed or a.ndim != 4 or not 1 <= a.shape[0] <= spec.batch:
            return None, None
        if scale is not None and scale.ndim not in (2, 3):
            return None, None
        B = a.shape[0]
        key = (gather, tokens, B, 0 if scale is None else scale.ndim)
        shapes = self._out_shapes.get(key)  # (_plan + io_shapes + scale_shapes: ~1.5 us)
        if shapes is None:
            # checked (bad tokens get the full path's error), then remembered: shapes follow
            # token lists, bounded like plans
            tokens = self._plan(tokens, stream_of(stream, a)).tokens
            shapes = (io_shapes(spec, gather, B, tokens)[1],
                      None if scale is None
                      else scale_shapes(spec, gather, B, tokens, scale.ndim == 3)[1])
            if len(self._out_shapes) >= CACHE_MAX:
                self._out_shapes.clear()
            self._out_shapes[key] = shapes
        memo = self._memo
        out = memo.output(shapes[0], spec.dtype.storage, stream, like=a)
        if scale is None:
            return out, None
        return out, memo.output(shapes[1], _F32, stream, like=a)

    def _replay(self, run: "_Replay", view: bool, stream, like=None) -> bool:
        """A memo hit: enqueue its launches on `stream` (None: the current one of like's
        framework); False (nothing done) where the call takes the full path instead (a view
        under capture, refused there; a view whose shape the caller changed in place)."""
        if self._closed:
            raise CufluxError(f"{_OP}: the op is closed")
        self._raise_if_failed()
        s = stream_of(stream, like)
        captured_now, capturing = self._capture_state(s)
        if view and (capturing or self._captured or run.views[0].shape != run.shape[0]
                     or (run.views[1] is not None and run.views[1].shape != run.shape[1])):
            return False
        self._sequence(s, captured_now, capturing, run.plan)
        if run.moves:
            self.epoch += 1
        for launch in run.launches:
            launch(s.ptr)
        return True

    def _capture_state(self, s) -> tuple[bool, bool]:
        """(captured_now, capturing) of a call on `s`: whether the call is captured where its
        kernels read the plan's device prefix array (every path at W > 1, the copy kernel of
        w1="kernel" at W = 1: the op then counts as captured, so no plan a graph holds is
        evicted), and whether it is captured at W > 1 (views refused, no cross-stream wait)."""
        W = self.spec.world_size
        captured_now = (W > 1 or self.w1 == "kernel") and _capturing(s)
        return captured_now, captured_now and W > 1

    def _sequence(self, s, captured_now: bool, capturing: bool, plan: "_Plan") -> None:
        """Every call of the op in one stream order (double buffering relies on it): a call on
        another stream than the last one's waits for it (not while capturing at W > 1). A
        call captured now marks the op and its plan captured (_capture_state)."""
        if captured_now:
            self._captured = plan.captured = True
        if (self._last_stream is not None and self._last_stream.ptr != s.ptr
                and not capturing):
            import cupy

            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(self._last_stream)
            s.wait_event(ev)
        self._last_stream = s

    # ---- one call ------------------------------------------------------------------------------
    def _plan(self, tokens_per_rank, stream=None):
        """Validated tokens and their device prefix sums, cached per distinct list. A full
        cache is emptied (_forget: a device synchronize) outside a capture on `stream`, but
        for the plans a captured graph holds."""
        key = tokens_per_rank if isinstance(tokens_per_rank, tuple) else None
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            spec = self.spec
            tokens = check_tokens(tokens_per_rank, spec.world_size, spec.max_tokens)
            plan = self._plans.get(tokens)
            if plan is None:
                # (a captured graph holds its plans' device prefix arrays: those stay, and a
                # cache full of them grows)
                if (len(self._plans) >= CACHE_MAX + self._plans_captured
                        and not (stream is not None and _capturing(stream))):
                    self._forget()
                prefix = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)
                plan = _Plan(tokens, prefix)
                self._plans[tokens] = plan
        return plan

    def _forget(self):
        """Drop every cached list but those a captured graph holds (deterministic on every
        rank: same calls, same captures, same moment). A kernel may still read a cached
        prefix array, so wait for the device first."""
        import cupy

        cupy.cuda.Device(self.spec.device).synchronize()
        self._memo.clear()  # its bound launches hold the plans' prefix arrays' pointers
        self._plans = collections.OrderedDict((t, p) for t, p in self._plans.items()
                                              if p.captured)
        self._plans_captured = len(self._plans)
        self._hashes.clear()  # (a key seen again is checked with the peers again)

    def _call_hash(self, key) -> int:
        """The call's hash; the first time a key is seen, check it against every peer.

        Ranks that pass the same calls have the same cache, so either all of them check or none
        does. A rank whose key differs from the others' is caught here when the key is new to
        it and to them; when both are old (each used before), by the kernels, which compare the
        hash each sender stored beside its flag (ValueError at the next call or synchronize).
        When one rank's key is new and another's old, the check times out instead of hanging.
        """
        h = self._hashes.get(key)
        if h is None:
            if self.spec.world_size > 1:
                self._compare_with_peers(key)
            h = self._hashes[key] = call_hash(key)
        return h

    def _compare_with_peers(self, key) -> None:
        """Exchange a 64-bit digest of the key with every peer, bounded by the op's timeout
        (the op's host group: tagged MPI messages, or an allgather on its gloo group)."""
        me = self.spec.rank
        mine = call_digest(key)
        try:
            theirs = self.comm.exchange_digest(mine, self.err.timeout_s, "argument check")
        except CommTimeoutError as e:  # the op is failed: later calls raise it too
            self._host_failure(e, "checking a new tokens_per_rank list (the peer did not make "
                                  "this call, or passed a list it had used before while this one "
                                  "is new here)")
        peers = [p for p in range(self.spec.world_size) if p != me]
        differ = [p for p in peers if theirs[p] != mine]
        if differ:
            direction, tokens, batch, mode = key
            raise ValueError(
                f"{_OP}: the call's tokens_per_rank, batch, direction or scales differs between "
                f"ranks: rank {me} passed {'gather' if direction else 'scatter'}_heads with "
                f"tokens_per_rank={list(tokens)}, batch {batch}, scale mode {mode}; ranks "
                f"{differ} passed something else")

    @on_op_device
    def _run(self, gather, a, tokens_per_rank, scale, out, out_scale, view, stream, key=None):
        if self._closed:
            raise CufluxError(f"{_OP}: the op is closed")
        self._raise_if_failed()
        spec = self.spec
        name = "y" if gather else "x"
        a_in, given = a, (out, out_scale)  # the caller's: torch in, torch out
        a = as_cupy(a, name, _OP)
        s = stream_of(stream, a_in)
        plan = self._plan(tokens_per_rank, s)
        tokens = plan.tokens
        if scale is not None:
            scale = as_cupy(scale, "scale", _OP)
        B, mode = check_call(spec, gather, a, tokens, scale)
        _, out_shape = io_shapes(spec, gather, B, tokens)
        sc_shape = scale_shapes(spec, gather, B, tokens, mode == 2)[1] if mode else None
        if view and (out is not None or out_scale is not None):
            raise ValueError(f"{_OP}: pass either view=True or out=/out_scale=, not both")
        if out_scale is not None and not mode:
            raise ValueError(f"{_OP}: out_scale given without scale")
        h = self._call_hash((gather, tokens, B, mode))
        captured_now, capturing = self._capture_state(s)  # at W > 1 a view is refused:
        if view and (capturing or self._captured):
            raise CaptureError(
                f"{_OP}: view=True hands out the receive slot of the call's parity, which a "
                f"replayed CUDA graph alternates without the host knowing; use out= with an op "
                f"that is captured" + (" (this op was captured before)" if self._captured else ""))
        self._sequence(s, captured_now, capturing, plan)
        parity = (self.epoch + 1) & 1
        if view:
            out = self._slot_view(f"data{parity}", out_shape, spec.dtype.storage)
            out_scale = self._slot_view(f"scale{parity}", sc_shape, np.float32) if mode else None
        else:
            out_given, scale_given = out is not None, out_scale is not None
            out = self._output(out, "out", out_shape, spec.dtype, s)
            if mode:
                out_scale = self._output(out_scale, "out_scale", sc_shape, dtype_info("float32"), s)
            if out_given:
                check_no_alias(_OP, out, input=a, scale=scale)
            if scale_given and mode:
                check_no_alias(_OP, out_scale, input=a, scale=scale)
        S = plan.total
        bind = self._memo.wants(key) and not self._captured
        launches = ()
        if B * S:  # else nothing moves anywhere (every rank knows: the list is the same)
            self.epoch += 1
            launches = self._launch(gather, a, scale, out, out_scale, plan, B, mode, h, parity,
                                    view, s, bind)
        if bind:  # a view: the slot's arrays are handed out again at a hit
            replay = (graph_replay(launches, op=_OP, what="the call's launches"),) \
                if launches else ()
            self._memo.put(key, _Replay(bool(B * S), replay,
                                        (out, out_scale) if view else None,
                                        (out_shape, sc_shape), plan))
        return to_caller((out, out_scale), a_in, given) if mode else to_caller(out, a_in,
                                                                              given[0])

    def _launch(self, gather, a, scale, out, out_scale, plan, B, mode, h, parity, view, s,
                bind: bool = False) -> list:
        """Enqueue the call; with bind, returns its launches bound to the call's pointers
        (each taking the stream handle: the memo's replay), else []."""
        spec, bound = self.spec, []
        if spec.world_size == 1 and self.w1 != "kernel":
            # One rank: input and output have the same layout, the op is one copy:
            # cudaMemcpyAsync, or ("pdl", where 16-byte vectors fit and no scales follow) a
            # copy kernel launched with programmatic dependent launch.
            from cupy.cuda import runtime

            rows = B * plan.total
            nbytes = rows * self._row_bytes
            copies = []
            if (self.w1 == "pdl" and not mode and nbytes % 16 == 0 and a.data.ptr % 16 == 0
                    and out.data.ptr % 16 == 0):
                n_vec = nbytes // 16
                args = (a, out, np.uint64(n_vec))
                if bind:
                    bound.append(kernels.bind(self._copy_w1, -(-n_vec // 256), 256, args,
                                              op=_OP, name="a2a_copy_w1", pdl=True))
                    bound[-1](s.ptr)
                else:
                    kernels.launch(self._copy_w1, -(-n_vec // 256), 256, args, s, op=_OP,
                                   name="a2a_copy_w1", pdl=True)
            else:
                copies.append((out.data.ptr, a.data.ptr, nbytes))
            if mode:
                scale_cols = 1 if mode == 1 else spec.heads_per_rank
                copies.append((out_scale.data.ptr, scale.data.ptr, rows * 4 * scale_cols))
            for dst, src, n in copies:
                runtime.memcpyAsync(dst, src, n, MEMCPY_DEFAULT, s.ptr)
                if bind:
                    bound.append(functools.partial(runtime.memcpyAsync, dst, src, n,
                                                   MEMCPY_DEFAULT))
            return bound
        vec = vec_bytes(self._row_bytes, a.data.ptr, out.data.ptr)
        key = (vec, gather, B, mode, view, h)
        launches = plan.launches.get(key)
        if launches is None:
            launches = plan.launches[key] = self._prepare(gather, plan, B, mode, h, view, vec, s)
        push, recv = launches
        scale_ptr = scale.data.ptr if mode else 0
        out_scale_ptr = out_scale.data.ptr if mode else 0
        ptrs = (a.data.ptr, scale_ptr, out.data.ptr, out_scale_ptr)
        push(s, *ptrs)
        if bind:
            bound.append(push.bind(*ptrs))
        if recv is not None:
            back = (0, 0) if view else (out.data.ptr, out_scale_ptr)
            recv(s, *back)
            if bind:
                bound.append(recv.bind(*back))
        return bound

    def _prepare(self, gather, plan, B, mode, h, view, vec, s) -> tuple:
        """(a2a_push's launch, a2a_recv's or None at W = 1) for calls of `plan` with this
        batch, scale mode, view, vector width and call hash (_launch keeps them on the plan):
        every argument but the call's pointers (input, scales, output, output scales) is fixed
        for them, so it is packed once (kernels.prepare), not at every call."""
        import cupy

        spec, W, me = self.spec, self.spec.world_size, self.spec.rank
        row_bytes = self._row_bytes
        scale_cols = 0 if mode == 0 else (1 if mode == 1 else spec.heads_per_rank)
        if plan.prefix_dev is None:
            with s:
                plan.prefix_dev = cupy.asarray(plan.prefix)
        u64_0, h = np.uint64(0), np.uint32(h)
        push = kernels.prepare(
            self._push[vec, gather], self.grid, THREADS,
            (u64_0,) * 4 + (self.buf.ptrs_dev,) + self._push_slots
            + (self.state, plan.prefix_dev, np.uint32(me), np.uint32(W), np.uint32(B),
               np.uint64(row_bytes), np.uint32(scale_cols), np.uint32(mode == 2), h,
               np.uint32(self.local_blocks), np.uint32(self.blocks_per_target),
               self.err.claim),  # pushes nothing once a wait of the op gave up (#19 item 1)
            4, op=_OP, name="a2a_push")
        recv = None
        if W > 1:
            # Waits for each peer block's flag, then copies that block's rows out of our slot
            # (a view: waits only); completes the call's epoch.
            (d0, d1), (s0, s1) = self._copy_slots
            recv = kernels.prepare(
                self._recv[vec, gather], self.recv_grid, THREADS,
                self._wait_flags + (d0, d1, s0, s1, u64_0, u64_0, self.state,
                                    plan.prefix_dev, np.uint32(me), np.uint32(W),
                                    np.uint32(B), np.uint64(row_bytes), np.uint32(scale_cols),
                                    np.uint32(not view), np.uint32(self.blocks_per_target), h)
                + self.err_args,
                2, op=_OP, name="a2a_recv", first=len(self._wait_flags) + 4)
        return push, recv

    def _output(self, arr, name, shape, dtype, s):
        import cupy

        if arr is None:
            with s:
                return cupy.empty(shape, dtype=dtype.storage)
        arr = as_cupy(arr, name, _OP)
        return check_array(arr, name=name, op=_OP, shape=shape, dtype=dtype,
                           device=self.spec.device)

    def _slot_view(self, region, shape, dtype):
        """A CuPy array over this rank's receive slot `region`, kept per (region, shape,
        dtype): making one (UnownedMemory, MemoryPointer, ndarray) costs the host more than
        the rest of a small call. Handed out again only while its shape is the one asked
        for (a caller may have set .shape in place)."""
        key = (region, shape, dtype)
        view = self._views.get(key)
        if view is not None and view.shape == shape:
            return view
        import cupy

        n = math.prod(shape) * np.dtype(dtype).itemsize
        mem = cupy.cuda.UnownedMemory(self.buf.ptr(self.spec.rank, region), max(n, 1), self.buf,
                                      device_id=self.spec.device)
        view = cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))
        if len(self._views) >= CACHE_MAX:  # shapes follow token lists: bounded like plans
            self._views.clear()
        self._views[key] = view
        return view

    # ---- errors and lifetime -----------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        err = self.err
        if err._status.value == STATUS_OK:  # the status word through ctypes: 0.1 us, not 0.5
            err.check()  # a peer's failure told through the board, a watchdog's fault
            return
        w = err.words
        if int(w[STATUS]) == STATUS_MISMATCH:
            raise ValueError(
                f"{_OP}: rank {int(w[RANK])}: rank {int(w[PEER])} ran the same call with other "
                f"tokens_per_rank, batch, direction or scales (call hash {int(w[OBSERVED]):#x}, "
                f"expected {int(w[EXPECTED]):#x}); every rank must pass the same list")
        self.err.check()

    def synchronize(self, stream=None) -> None:
        """Wait for this op's work (on `stream` and on the stream of its last call) and raise
        CommTimeoutError if a wait failed."""
        if stream is not None:
            stream_of(stream).synchronize()
        if self._last_stream is not None:
            self._last_stream.synchronize()
        self._raise_if_failed()

    def _streams(self) -> tuple:
        return () if self._last_stream is None else (self._last_stream,)

    def _free(self) -> None:
        """Views of the slots die with the buffer (the base closes it after this)."""
        self._plans.clear()
        self._hashes.clear()
        self._views.clear()


_F32 = np.dtype(np.float32)


def _tokens_key(tokens_per_rank):
    """tokens_per_rank as the memo keys it: a tuple of ints (operator.index: a float that
    equals an int is not one, as check_tokens says), or None (the full path)."""
    t = type(tokens_per_rank)
    if t is not tuple and t is not list:
        return None
    try:
        return tuple(map(operator.index, tokens_per_rank))
    except TypeError:
        return None


@dataclasses.dataclass(frozen=True)
class _Replay:
    """A call's memo entry: whether it moves anything (a call of no tokens does not count an
    epoch), its launches bound to the call's pointers, each taking the stream handle, and
    for a view call the views it returns ((out, out_scale) of the slot) and their shapes
    (out_scale's None without scales): a caller may have set a view's .shape in place."""
    moves: bool
    launches: tuple
    views: tuple | None
    shape: tuple
    plan: "_Plan"  # whose device prefix array the launches read


class _Plan:
    __slots__ = ("tokens", "prefix", "total", "prefix_dev", "launches", "captured")

    def __init__(self, tokens, prefix):
        self.tokens, self.prefix, self.total = tokens, prefix, int(prefix[-1])
        self.prefix_dev = None
        self.captured = False  # a captured graph holds prefix_dev: kept for the op's life
        self.launches: dict = {}  # (vec, gather, B, mode, view, hash) -> (push, recv): _prepare
