"""AllReduce and fused AllReduce + residual add + RMSNorm over P2P pushes (posted stores into
the peers' symmetric memory; every load is local).

The kernel and its protocol (one-shot / two-shot, staging, barriers, why no end barrier) are
described at the top of kernels_cu/allreduce.cu. This module owns, per op: the symmetric
buffer (a stage slot per sender, sized by `stage_slot`; tmp rows; start/mid epoch flags), the
device epoch counter, the error record and the compiled kernels; it checks arguments before
any launch, plans each launch (vector width, block, grid), and holds the one place where
one-shot vs two-shot is decided (`choose_algo`). The NumPy float64 golden models live here too
(`reference_allreduce`, `reference_allreduce_rmsnorm`).

Calls never synchronise the host (the epoch lives in device memory), so they can be captured
in a CUDA graph and replayed. Calls of one op must be ordered on each rank (one stream, or
streams ordered by the caller), and every rank must pass the same number of tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from cuflux import kernels
from cuflux.arrays import (as_cupy, check_array, check_rows, dtype_info, empty_on, is_torch,
                           stream_of, to_caller, zeros_settled)
from cuflux.errors import CufluxError
from cuflux.launch import graph_replay
from cuflux.ops.base import (CUPY, DEFAULT_TIMEOUT_S, CommOp, check_no_alias, check_timeout,
                             on_op_device, sm_count)
from cuflux.sizes import count, optional_count
from cuflux.symmetric import Layout

__all__ = ["AllReduce", "AllReduceRMSNorm", "rmsnorm_residual", "choose_algo", "token_slice",
           "plan_launch", "default_max_blocks", "stage_slot", "plain_share",
           "reference_allreduce", "reference_allreduce_rmsnorm", "MODES"]

_SRC = "allreduce.cu"
DTYPES = ("bfloat16", "float16", "float32")
# The kernel's modes (kernels_cu/allreduce.cu); the last two are a plain two-shot call's halves.
MODES = {"plain": 0, "replicated": 1, "sharded_residual": 2, "sequence_parallel": 3,
         "reduce_scatter": 4, "all_gather": 5}
_SUM_MODES = ("plain", "reduce_scatter", "all_gather")  # no residual, no norm: flat rows
OUTPUTS = ("replicated", "sharded_residual", "sequence_parallel")
ALGOS = ("auto", "one_shot", "two_shot")
MAX_THREADS = 1024
PLAIN_ROW_VECS = 1024       # AllReduce views its flat array as rows of 1024 vectors
# Grid of a call at W > 1. On distinct GPUs: one block per SM. The kernel of 2026-11-29 pulled
# with 32 blocks and moved only ~90 GB/s of the H200 pair's ~395 GB/s peer rate (issue 16:
# ~256 KiB in flight against a ~2.5 us round trip); it now pushes (posted stores, no round trip
# per load) and a block per SM pushes and reduces ~4x as many rows at once. Ranks sharing a GPU
# keep SHARED_GPU_MAX_BLOCKS each: their spinning grids must all stay resident side by side,
# and the slack leaves SMs to whatever else their streams run.
SHARED_GPU_MAX_BLOCKS = 32
MAX_ELEMS = 2**31 - 1       # the kernel's copy loops index vectors with 32-bit ints


def _two_shot_only(mode: str) -> bool:
    # Sharded residual / sequence parallel: only a slice's owner has its residual rows; the
    # halves are a two-shot call's.
    return mode not in ("plain", "replicated")


def _kernel_name(cuda_type: str, vec_bytes: int, mode: str, two_shot: bool) -> str:
    return (f"allreduce_rmsnorm<{cuda_type}, {vec_bytes}, {MODES[mode]}, "
            f"{'true' if two_shot else 'false'}>")


LOCAL_REG_VECS = 4          # rmsnorm_local_reg: vectors of a row each thread holds,
LOCAL_REG_THREADS = 256     # in blocks of at most this many threads


def _local_name(cuda_type: str, vec_bytes: int, in_registers: bool) -> str:
    if in_registers:
        return f"rmsnorm_local_reg<{cuda_type}, {vec_bytes}, {LOCAL_REG_VECS}>"
    return f"rmsnorm_local<{cuda_type}, {vec_bytes}>"


def _all_names() -> list[str]:
    names = []
    for name in DTYPES:
        d = dtype_info(name)
        for vec in sorted({16, d.itemsize}):
            names += [_local_name(d.cuda_type, vec, False), _local_name(d.cuda_type, vec, True)]
            for mode in MODES:
                for two_shot in (False, True):
                    if two_shot or not _two_shot_only(mode):
                        names.append(_kernel_name(d.cuda_type, vec, mode, two_shot))
    return names


FAMILY = kernels.register(_SRC, _all_names())


# ---- token slices and the one-shot / two-shot crossover ---------------------------------------
def token_slice(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) owned by `rank`: contiguous, sizes differ by at most one, the first
    rows % world_size ranks get one more (so rows < world_size leaves the last ranks empty).
    The kernel (kernels_cu/allreduce.cu, token_slice) uses the same formula."""
    base, rem = divmod(rows, world_size)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


# The crossover, the one place it lives. One-shot: every rank pushes all its rows to every
# peer, (W - 1) * B bytes out (and in), one barrier; it also needs a stage slot of the whole
# call per sender (stage_slot), so a large one-shot costs (W - 1) x its size in memory.
# Two-shot: (W - 1) / W * B for the reduce-scatter, plus (W - 1) / W * B per gathered tensor
# (out; out and residual when replicated), and a second barrier (~ a few microseconds of
# NVLink round trip). So one-shot always wins for W = 2 (plain)
# and W <= 3 (replicated: two-shot gathers two tensors); above that only below a size where
# the extra barrier costs more than the extra bytes. Byte limits are per rank's x; the values
# follow vLLM's measured custom all-reduce thresholds (512 KiB at W <= 4, 256 KiB at W <= 8)
# and are to be re-measured with `python -m cuflux.bench allreduce` on ranks with their own GPUs
# (ranks sharing one GPU cannot measure a link).
ONE_SHOT_MAX_BYTES = {4: 512 << 10, 8: 256 << 10}
ONE_SHOT_ALWAYS = {"plain": 2, "replicated": 3}


def one_shot_max_bytes(world_size: int, mode: str) -> float:
    """The largest call (bytes of x per rank) choose_algo runs one-shot, for a mode that can
    (not _two_shot_only): math.inf where every size is."""
    if world_size <= ONE_SHOT_ALWAYS[mode]:
        return math.inf
    limit = ONE_SHOT_MAX_BYTES[4] if world_size <= 4 else ONE_SHOT_MAX_BYTES[8]
    return 2 * limit if mode == "replicated" else limit  # two-shot also gathers the residual


def choose_algo(num_bytes: int, world_size: int, mode: str) -> str:
    """'one_shot' or 'two_shot' for a call moving num_bytes of x per rank."""
    if _two_shot_only(mode) or num_bytes > one_shot_max_bytes(world_size, mode):
        return "two_shot"
    return "one_shot"


# ---- launch planning (pure: tested on the CPU) ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    kernel: str        # name expression in kernels_cu/allreduce.cu
    local: bool        # rmsnorm_local (W = 1 norm): no peers, no flags
    vec_bytes: int
    rows: int
    cols: int
    num_elems: int
    grid: int
    block: int
    shared_mem: int
    two_shot: bool


def plan_launch(mode: str, dtype, num_elems: int, cols: int | None, world_size: int, algo: str,
                aligned: bool, max_blocks: int, num_sms: int) -> LaunchPlan:
    """Kernel, vector width, grid and block of one call.

    mode "plain": num_elems elements, viewed as rows of PLAIN_ROW_VECS 16-byte vectors' worth of
    elements (cols=None), also where this rank's pointers only allow narrow accesses: the rows
    a block stages and reduces must be the same on every rank.
    Norm modes: cols = hidden, num_elems = T * hidden. 16-byte vectors when every row starts
    16-byte aligned and `aligned` (every pointer is), else one element per access (narrow).
    One thread per vector of a row, up to 1024 (then each thread takes several); W = 1 norm
    rows use rmsnorm_local_reg (LOCAL_REG_VECS vectors per thread in registers) where they fit.
    W = 1 never spins: one block per row. W > 1 keeps at most max_blocks blocks (co-resident
    when ranks share a GPU), and two-shot no more than the rows of the largest slice.
    """
    d = dtype_info(dtype)
    flat = mode in _SUM_MODES
    wide = aligned and (num_elems if flat else cols) * d.itemsize % 16 == 0
    vec_bytes = 16 if wide else d.itemsize
    elems_per_vec = vec_bytes // d.itemsize
    if flat:  # rows of a fixed element count, whatever this rank's vector width:
        cols = _plain_cols(d)  # ranks must agree on which rows are whose
    rows = -(-num_elems // cols)
    nvec = cols // elems_per_vec
    block = min(MAX_THREADS, max(32, -(-nvec // 32) * 32))
    h_bytes = 0 if flat else -(-cols * 4 // 16) * 16
    if world_size == 1 and not flat:
        in_registers = nvec <= LOCAL_REG_VECS * LOCAL_REG_THREADS
        if in_registers:  # a row's vectors spread over the block, LOCAL_REG_VECS per thread
            block = max(32, -(-nvec // (32 * LOCAL_REG_VECS)) * 32)
        grid = rows  # one row per block: the hardware keeps every SM full, no tail imbalance
        return LaunchPlan(_local_name(d.cuda_type, vec_bytes, in_registers), True, vec_bytes,
                          rows, cols, num_elems, grid, block, 0 if in_registers else h_bytes,
                          False)
    if world_size == 1:
        grid = rows
    else:
        work = -(-rows // world_size) if algo == "two_shot" else rows
        grid = max(1, min(work, max_blocks))
    two_shot = algo == "two_shot"
    return LaunchPlan(_kernel_name(d.cuda_type, vec_bytes, mode, two_shot), False, vec_bytes,
                      rows, cols, num_elems, grid, block, h_bytes + 16 * world_size, two_shot)


def default_max_blocks(num_sms: int, sharers: int) -> int:
    """The grid cap of an op whose caller gave none: every SM of a GPU this rank has to itself,
    SHARED_GPU_MAX_BLOCKS where ranks share one (CommOp._grid_cap then splits the SMs among
    them and takes the smallest over the ranks)."""
    return num_sms if sharers == 1 else SHARED_GPU_MAX_BLOCKS


def _plain_cols(d) -> int:
    return PLAIN_ROW_VECS * (16 // d.itemsize)


def plain_share(num_elems: int, dtype, world_size: int, rank: int) -> tuple[int, int]:
    """Elements [lo, hi) of a flat num_elems-element AllReduce that rank reduces in two-shot:
    its token slice of the plain rows (plan_launch), cut at num_elems (empty past it)."""
    cols = _plain_cols(dtype_info(dtype))
    start, stop = token_slice(-(-num_elems // cols), world_size, rank)
    return min(num_elems, start * cols), min(num_elems, stop * cols)


def stage_slot(mode: str, algo: str, world_size: int, max_elems: int, hidden: int | None,
               dtype) -> tuple[int, int]:
    """(one-shot elements, slot elements) of an op's stage: the largest call it may run
    one-shot (its algo; "auto": the largest size choose_algo sends one-shot), and the elements
    of one sender's slot, which holds a one-shot call whole or a two-shot call's slice of the
    largest call (kernels_cu/allreduce.cu), 128-byte padded. W = 1 stages nothing: (0, 0)."""
    d = dtype_info(dtype)
    if world_size == 1:
        return 0, 0
    one = 0
    if algo == "one_shot":
        one = max_elems
    elif algo == "auto" and not _two_shot_only(mode):  # choose_algo's last one-shot size
        one = int(min(max_elems, one_shot_max_bytes(world_size, mode) // d.itemsize))
    two = 0
    if algo != "one_shot":  # two-shot: the largest slice of the largest call's rows
        cols = _plain_cols(d) if mode in _SUM_MODES else hidden
        two = min(max_elems, -(-(-(-max_elems // cols)) // world_size) * cols)
    per_128 = 128 // d.itemsize
    return one, max(1, -(-max(one, two) // per_128)) * per_128


def _aligned(*arrays) -> bool:
    return all(a is None or a.data.ptr % 16 == 0 for a in arrays)


# ---- the op ------------------------------------------------------------------------------------
class _P2PReduce(CommOp):
    """Buffers, flags, epoch counter and kernels shared by both public ops."""

    def __init__(self, world, op: str, mode: str, max_elems: int, dtype, algo: str,
                 timeout_s: float, max_blocks: int | None, hidden: int | None = None):
        import cupy

        super().__init__(world, op, timeout_s)
        self.mode, self.algo = mode, algo
        self.max_elems = int(max_elems)
        self.dtype = dtype_info(dtype, DTYPES, op)
        W = world.size
        rt = cupy.cuda.runtime
        self.smem_optin = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                world.device)
        if hidden is not None:  # a row of h in fp32, two u64 per rank, static shared memory
            need = -(-hidden * 4 // 16) * 16 + 16 * W + 1024
            if need > self.smem_optin:
                raise ValueError(f"{op}: hidden={hidden} needs {need} bytes of shared memory "
                                 f"per block, the device allows {self.smem_optin}")
        self.max_blocks = self._grid_cap(max_blocks or default_max_blocks(self.num_sms,
                                                                          self.sharers))
        self.two_shot_ok = algo != "one_shot" and W > 1
        layout = Layout()
        padded = -(-self.max_elems * self.dtype.itemsize // 128) * 128 // self.dtype.itemsize
        self.one_shot_elems, self.slot_elems = stage_slot(mode, algo, W, self.max_elems,
                                                          hidden, self.dtype)
        if W > 1:  # by call parity, then by sender (kernels_cu/allreduce.cu)
            layout.add("stage", (2, W - 1, self.slot_elems), self.dtype.storage)
            if self.two_shot_ok and mode != "sequence_parallel":
                layout.add("tmp_out", (padded,), self.dtype.storage)
            if self.two_shot_ok and mode == "replicated":
                layout.add("tmp_res", (padded,), self.dtype.storage)
        # u64 epochs (the epoch lives on the device: nothing could re-arm 32-bit flags under a
        # replayed graph), a 128-byte slot per block.
        self.flag_stride = -(-W // 16) * 16
        layout.add("start", (self.max_blocks, self.flag_stride), np.uint64)
        layout.add("mid", (self.max_blocks, self.flag_stride), np.uint64)
        self.layout = layout
        self._offsets = {n: r.offset for n, r in layout.regions.items()}
        self._slot_bytes = self.slot_elems * self.dtype.itemsize
        self._stage_parity_bytes = (W - 1) * self._slot_bytes
        self._alloc(layout)
        with world.device_context():
            self.state = zeros_settled(2, np.uint64)  # [epoch, blocks finished this call]
        # eager: nothing may load a module while peers spin
        self.module = kernels.load(_SRC, world.device)
        self._static_args()
        self._plans: dict[tuple, tuple] = {}
        self._closed = False

    def _static_args(self):
        """Kernel arguments that never change, built once (small calls are host-bound)."""
        o = self._offsets
        self._args_mid = (self.buf.ptrs_dev, np.uint64(o.get("stage", 0)),
                          np.uint64(self._stage_parity_bytes), np.uint64(self._slot_bytes),
                          np.uint64(o.get("tmp_out", 0)),
                          np.uint64(o.get("tmp_res", 0)), np.uint64(o["start"]),
                          np.uint64(o["mid"]), np.int32(self.flag_stride), self.state)
        self._args_tail = (np.int32(self.world.size), np.int32(self.world.rank))

    def _plan(self, num_elems, cols, algo, aligned: bool, mode: str | None = None) -> tuple:
        """(LaunchPlan, its prepared launch: _entry), cached per call shape;
        mode: the op's, or one of a plain call's halves (AllReduce.reduce_scatter)."""
        mode = mode or self.mode
        key = (num_elems, algo, aligned, mode)
        hit = self._plans.get(key)
        if hit is not None:
            return hit
        chosen = algo
        if algo == "auto":
            chosen = choose_algo(num_elems * self.dtype.itemsize, self.world.size, mode)
        if chosen == "two_shot" and not self.two_shot_ok and self.world.size > 1:
            raise ValueError(f"{self.op}: this op was built with algo='one_shot'; "
                             f"build it with algo='auto' or 'two_shot' to run two-shot")
        if chosen == "one_shot" and num_elems > self.one_shot_elems and self.world.size > 1:
            raise ValueError(f"{self.op}: a one-shot call of {num_elems} elements does not fit "
                             f"this op's stage (one-shot up to {self.one_shot_elems}, the most "
                             f"its algo={self.algo!r} runs one-shot; a stage slot per sender "
                             f"of the whole call would cost {self.world.size - 1}x its size): "
                             f"build an op with algo='one_shot' for one-shot calls of any size")
        plan = plan_launch(mode, self.dtype, num_elems, cols, self.world.size, chosen,
                           aligned, self.max_blocks, self.num_sms)
        hit = self._entry(plan)
        if len(self._plans) >= 4096:  # shapes that change every call: bounded, and a new one
            self._plans.clear()  # still gets its prepared launch kept (graphs hold copies)
        self._plans[key] = hit
        return hit

    def _entry(self, plan: LaunchPlan) -> tuple:
        """(plan, its launch): every argument but the four pointers of a call (x, out,
        residual, weight) is the plan's or the op's, packed once (kernels.prepare: a call's
        host time is then the driver's and these pointers')."""
        shape_args = (np.int32(plan.rows), np.int32(plan.cols), np.int64(plan.num_elems))
        ptrs = (_NULL,) * 4  # written at each call
        if plan.local:
            args = ptrs + shape_args[:2] + (self._eps,)
        else:
            args = (ptrs + self._args_mid + shape_args + self._args_tail + (self._eps,)
                    + self.err_args)
        return plan, kernels.prepare(_kernel(self.module, plan), plan.grid, plan.block, args, 4,
                                     op=self.op, name=plan.kernel, shared_mem=plan.shared_mem)

    def _replay_of(self, plan_entry, *ptrs):
        """The memo's replay of a call of this plan with these four pointers (fewer: the
        rest null): its launch bound, a CUDA graph from the first repeat on."""
        ptrs += (0,) * (4 - len(ptrs))
        return graph_replay((plan_entry[1].bind(*ptrs),), op=self.op,
                            what=f"kernel {plan_entry[0].kernel}")

    def _launch(self, plan_entry, stream, x_ptr: int, out_ptr: int, residual_ptr: int = 0,
                weight_ptr: int = 0):
        """One call of a cached plan (_plan) on `stream`, the call's device pointers read once
        by the caller (they also decide the plan's alignment); 0: none (null)."""
        self._last_stream = stream
        plan_entry[1](stream, x_ptr, out_ptr, residual_ptr, weight_ptr)


_NULL = np.uint64(0)
_EPS0 = np.float32(0.0)
_D2D = 3  # cudaMemcpyDeviceToDevice


def _nothing(stream: int) -> None:
    """The memo's entry of a call that launches nothing (no tokens, or in place at W = 1)."""


def _memcpy_async():
    """cupy's cudaMemcpyAsync binding (dst, src, bytes, kind, stream), imported once."""
    from cupy.cuda import runtime

    return runtime.memcpyAsync


def _check_common(op, world, dtype, algo, timeout_s, max_blocks):
    if algo not in ALGOS:
        raise ValueError(f"{op}: algo must be one of {ALGOS}, got {algo!r}")
    check_timeout(op, timeout_s)
    optional_count(op, "max_blocks", max_blocks, what="cap on the grid's blocks when W > 1")
    return dtype_info(dtype, DTYPES, op)


class AllReduce(_P2PReduce):
    """Sum of x over the ranks, on every rank: y = ar(x).

    Args:
      world: cuflux.World.
      max_elems: largest x.size any call will use.
      dtype: bfloat16, float16 or float32 (sums in fp32, rank order 0..W-1: bit-identical
        on every rank).
      algo: "auto" (choose_algo per call), "one_shot" or "two_shot".
      timeout_s: bound of every wait; on expiry CommTimeoutError (at synchronize() or the
        next call).
      max_blocks: cap on the grid when W > 1 (default: one block per SM on a GPU of its
        own, SHARED_GPU_MAX_BLOCKS where ranks share one; never more than SMs / ranks on it).
    """

    ACROSS = "AllReduceAcrossNodes"  # several nodes: CommOp.__new__

    def __init__(self, world, max_elems: int, dtype, algo: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_blocks: int | None = None):
        op = "AllReduce"
        d = _check_common(op, world, dtype, algo, timeout_s, max_blocks)
        max_elems = count(op, "max_elems", max_elems, 1, MAX_ELEMS, "elements per call: x.size")
        world.check_same((int(max_elems), d.name, algo, max_blocks),
                         f"{op} arguments (max_elems, dtype, algo, max_blocks)")
        super().__init__(world, op, "plain", max_elems, d, algo, timeout_s, max_blocks)
        self._eps = _EPS0
        self._half = None  # (x.size, stream) of a call between its halves (reduce_scatter)

    def __call__(self, x, out=None, stream=None, algo: str | None = None):
        """x: any shape, C-contiguous, x.size <= max_elems, the same on every rank ->
        out (same shape) = sum over ranks. `algo` overrides the op's choice for this call,
        within what the op's stage holds: "two_shot" unless it was built "one_shot",
        "one_shot" up to `one_shot_elems` (every size when it was built "one_shot").
        A call seen before (CuPy arrays or torch tensors; out= given or left to the op)
        replays its launch (base.CallMemo)."""
        memo = self._memo
        if out is None and not self._closed:
            kind = memo.owns(x)  # (a tensor's size is numel())
            if kind and (x.size if kind == CUPY else x.numel()) <= self.max_elems:
                out = memo.output(x.shape, self.dtype.storage, stream, like=x)  # before the key
        key = memo.key((x, out), algo) if out is not None else None
        run = memo.get(key)
        if run is None:
            return self._call(x, out, stream, algo, key)
        self._check_open()
        self._check_no_half()
        self._replayed(run, stream, x)
        return out

    @on_op_device
    def _call(self, x, out, stream, algo, key):
        self._check_open()
        self._check_no_half()
        x_in, out_in = x, out  # the caller's: torch in, torch out
        x = as_cupy(x, "x", self.op)
        check_array(x, name="x", op=self.op, dtype=self.dtype, device=self.world.device)
        if x.size > self.max_elems:
            raise ValueError(f"{self.op}: x has {x.size} elements, more than "
                             f"max_elems={self.max_elems}")
        if algo is not None and algo not in ALGOS:
            raise ValueError(f"{self.op}: algo must be one of {ALGOS}, got {algo!r}")
        s = stream_of(stream, x_in)
        if out is None:
            out = empty_on(x.shape, self.dtype.storage, s)
        else:
            out = as_cupy(out, "out", self.op)
            check_array(out, name="out", op=self.op, shape=x.shape, dtype=self.dtype,
                        device=self.world.device)
        bind = self._agreed_bind((x.size, algo), "x.size and algo of the call", key)
        run = _nothing
        if x.size and self.world.size == 1:
            # The sum over one rank is x: one device-to-device copy (none in place). The
            # generic kernel ran at a third of a copy's rate here (bench allreduce, W = 1:
            # 3.7 us against 1.2 at 4 KiB, 110 us against 34 at 64 MiB on the H200).
            self._last_stream = s
            xp, outp = x.data.ptr, out.data.ptr
            if outp != xp:  # a memcpy node under capture
                copy = functools.partial(_memcpy_async(), outp, xp, x.nbytes, _D2D)
                copy(s.ptr)
                run = graph_replay((copy,), op=self.op, what="its copy") if bind else None
        elif x.size:
            xp, outp = x.data.ptr, out.data.ptr
            plan = self._plan(x.size, None, algo or self.algo, not (xp | outp) & 15)
            self._launch(plan, s, xp, outp)
            run = self._replay_of(plan, xp, outp) if bind else None
        if bind:
            self._memo.put(key, run)
        return to_caller(out, x_in, out_in)

    # ---- a two-shot call in halves (AllReduceAcrossNodes works on this rank's share between) ---
    @on_op_device
    def reduce_scatter(self, x, stream):
        """First half of a two-shot call on x (flat, C-contiguous, this op's dtype and device,
        1 <= x.size <= max_elems, the same size on every rank; W > 1; the caller checked it):
        returns this rank's share of the sum, elements plain_share(x.size, ...) of it, as a
        flat view of its symmetric memory, once `stream` has run what this queues. `stream`
        may rewrite the share in place; the op's next call must be all_gather(out, stream)."""
        self._check_open()
        self._check_no_half()
        x = check_array(as_cupy(x, "x", self.op), name="x", op=self.op, dtype=self.dtype,
                        device=self.world.device)
        n, W = x.size, self.world.size
        if not 1 <= n <= self.max_elems:
            raise ValueError(f"{self.op}: reduce_scatter takes 1 to max_elems={self.max_elems} "
                             f"elements, got {n}")
        if W == 1 or not self.two_shot_ok:
            raise ValueError(f"{self.op}: reduce_scatter needs W > 1 and an op built with "
                             f"algo 'auto' or 'two_shot' (W = {W}, algo = {self.algo!r})")
        if (n, "halves") not in self._agreed:
            self._agree((n, "halves"), "x.size of a call in halves")
        tmp = self.buf.local("tmp_out")
        xp = x.data.ptr
        plan = self._plan(n, None, "two_shot", not xp & 15, "reduce_scatter")
        self._launch(plan, stream, xp, tmp.data.ptr)
        self._half = (n, stream.ptr)
        lo, hi = plain_share(n, self.dtype, W, self.world.rank)
        return tmp[lo:hi]

    @on_op_device
    def all_gather(self, out, stream) -> None:
        """Second half of the call reduce_scatter started, on the same stream: out (C-contiguous,
        its x.size elements) = every rank's share, once `stream` has run what this queues."""
        self._check_open()
        out = check_array(as_cupy(out, "out", self.op), name="out", op=self.op,
                          dtype=self.dtype, device=self.world.device)
        n, first = self._half or (None, None)
        if n is None or out.size != n:  # (refused before anything changes: the call stays open)
            raise ValueError(f"{self.op}: all_gather must follow reduce_scatter with out of "
                             f"its x.size ({n}), got {out.size} elements")
        if stream.ptr != first:  # the second half reads the epoch the first half counted
            raise ValueError(f"{self.op}: all_gather must run on reduce_scatter's stream")
        self._half = None
        outp = out.data.ptr
        self._launch(self._plan(n, None, "two_shot", not outp & 15, "all_gather"), stream, outp,
                     outp)

    def _check_no_half(self) -> None:
        if self._half is not None:
            raise CufluxError(f"{self.op}: a call is between its halves (reduce_scatter ran, "
                              "all_gather did not; after an error between them, close the op)")


class AllReduceRMSNorm(_P2PReduce):
    """out = RMSNorm(sum_ranks(x) + residual) * weight, residual <- the sum, in one kernel.

    Per token: h = sum_ranks(x) + residual; residual <- h; out = h * rsqrt(mean(h^2) + eps) *
    weight (fp32 inside, dtype outside). x [T, hidden] (T <= max_tokens, the same on every
    rank); weight [hidden]. Rank r owns the token slice token_slice(T, W, r). output:
      "replicated"        residual [T, hidden] updated for every token; out [T, hidden];
      "sharded_residual"  residual [T, hidden], only slice rows read and updated; out [T, hidden];
      "sequence_parallel" residual [n_slice, hidden] (this rank's slice); out [n_slice, hidden].
    The residual is updated in place; out is returned (or written into `out`).
    """

    ACROSS = "AllReduceRMSNormAcrossNodes"  # several nodes: CommOp.__new__

    def __init__(self, world, max_tokens: int, hidden: int, dtype, eps: float = 1e-6,
                 output: str = "replicated", algo: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_blocks: int | None = None):
        op = "AllReduceRMSNorm"
        d = _check_common(op, world, dtype, algo, timeout_s, max_blocks)
        if output not in OUTPUTS:
            raise ValueError(f"{op}: output must be one of {OUTPUTS}, got {output!r}")
        if _two_shot_only(output) and algo == "one_shot":
            raise ValueError(f"{op}: output={output!r} needs the two-shot algorithm (only a "
                             f"slice's owner holds its residual rows); got algo='one_shot'")
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"{op}: eps must be a finite number > 0, got {eps!r}")
        max_tokens = count(op, "max_tokens", max_tokens, 1, MAX_ELEMS,
                           "tokens per call: x.shape[0]")
        hidden = count(op, "hidden", hidden, 1, MAX_ELEMS, "elements per token: x.shape[1]")
        if max_tokens * hidden > MAX_ELEMS:
            raise ValueError(f"{op}: max_tokens * hidden must be <= {MAX_ELEMS}, got "
                             f"{max_tokens * hidden}")
        world.check_same((int(max_tokens), int(hidden), d.name, float(eps), output, algo,
                          max_blocks), f"{op} arguments (max_tokens, hidden, dtype, eps, output, "
                                       f"algo, max_blocks)")
        super().__init__(world, op, output, max_tokens * hidden, d, algo, timeout_s, max_blocks,
                         hidden)
        self.max_tokens, self.hidden, self.eps, self.output = int(max_tokens), int(hidden), \
            float(eps), output
        self._eps = np.float32(eps)

    def out_rows(self, num_tokens: int) -> int:
        """Rows of out (and of residual) this rank holds for a call with num_tokens tokens."""
        if self.output == "sequence_parallel":
            start, stop = token_slice(num_tokens, self.world.size, self.world.rank)
            return stop - start
        return num_tokens

    def __call__(self, x, residual, weight, out=None, stream=None, algo: str | None = None):
        """A call seen before (CuPy arrays or torch tensors; out= given or left to the op)
        replays its launch (base.CallMemo)."""
        memo = self._memo
        if (out is None and not self._closed and memo.owns(x, residual, weight)
                and x.ndim == 2 and x.shape[0] <= self.max_tokens):  # out first: CallMemo
            out = memo.output((self.out_rows(x.shape[0]), self.hidden), self.dtype.storage,
                              stream, like=x)
        key = memo.key((x, residual, weight, out), algo) if out is not None else None
        run = memo.get(key)
        if run is None:
            return self._call(x, residual, weight, out, stream, algo, key)
        self._check_open()
        self._replayed(run, stream, x)
        return out

    @on_op_device
    def _call(self, x, residual, weight, out, stream, algo, key):
        self._check_open()
        x_in, out_in = x, out  # the caller's: torch in, torch out
        x, residual, weight, out = check_norm_call(self, x, residual, weight, out, algo)
        s = stream_of(stream, x_in)
        if out is None:
            out = empty_on((self.out_rows(x.shape[0]), self.hidden), self.dtype.storage, s)
        else:
            check_no_alias(self.op, out, x=x, residual=residual, weight=weight)
        bind = self._agreed_bind((x.shape[0], algo), "token count and algo of the call", key)
        run = _nothing
        if x.shape[0]:
            ptrs = (x.data.ptr, out.data.ptr, residual.data.ptr, weight.data.ptr)
            aligned = not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15
            plan = self._plan(x.size, self.hidden, algo or self.algo, aligned)
            self._launch(plan, s, *ptrs)
            run = self._replay_of(plan, *ptrs) if bind else None
        if bind:
            self._memo.put(key, run)
        return to_caller(out, x_in, out_in)


def check_norm_call(op, x, residual, weight, out, algo):
    """Argument checks of AllReduceRMSNorm.__call__ (before anything is launched)."""
    name, dev, d = op.op, op.world.device, op.dtype
    x = check_rows(x, name="x", op=name, cols=op.hidden, cols_name="hidden",
                   max_rows=op.max_tokens, limit="max_tokens", rows="tokens", dtype=d, device=dev)
    T = x.shape[0]
    rows = op.out_rows(T)
    residual = as_cupy(residual, "residual", name)
    check_array(residual, name="residual", op=name, shape=(rows, op.hidden), dtype=d, device=dev)
    weight = as_cupy(weight, "weight", name)
    check_array(weight, name="weight", op=name, shape=(op.hidden,), dtype=d, device=dev)
    if out is not None:
        out = as_cupy(out, "out", name)
        check_array(out, name="out", op=name, shape=(rows, op.hidden), dtype=d, device=dev)
    if algo is not None and algo not in ALGOS:
        raise ValueError(f"{name}: algo must be one of {ALGOS}, got {algo!r}")
    if algo == "one_shot" and _two_shot_only(op.output):
        raise ValueError(f"{name}: output={op.output!r} needs algo='two_shot', got 'one_shot'")
    return x, residual, weight, out


def _kernel(module, plan: LaunchPlan):
    fn = module[plan.kernel]
    if plan.shared_mem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < plan.shared_mem:
        fn.max_dynamic_shared_size_bytes = plan.shared_mem  # opt in above the 48 KiB default
    return fn


# ---- local fused residual add + RMSNorm (the unfused baseline's second kernel) --------------
def rmsnorm_residual(x, residual, weight, eps: float = 1e-6, out=None, stream=None):
    """residual <- x + residual; out = RMSNorm(residual) * weight, on this GPU only.

    The kernel AllReduceRMSNorm runs at W = 1 (so fused vs unfused differs only by the
    fusion). x, residual, out [T, H]; weight [H]; dtype bfloat16, float16 or float32.
    """
    import cupy

    op = "rmsnorm_residual"
    x_in, out_in = x, out  # the caller's: torch in, torch out
    x = as_cupy(x, "x", op)
    d = dtype_info(x.dtype, DTYPES, op)
    dev = x.device.id
    check_array(x, name="x", op=op, ndim=2, dtype=d, device=dev)
    T, H = x.shape
    residual = check_array(as_cupy(residual, "residual", op), name="residual", op=op,
                           shape=(T, H), dtype=d, device=dev)
    weight = check_array(as_cupy(weight, "weight", op), name="weight", op=op, shape=(H,),
                         dtype=d, device=dev)
    if not eps > 0:
        raise ValueError(f"{op}: eps must be > 0, got {eps}")
    # On x's GPU throughout: its current stream and memory pool, not the caller's GPU's.
    with cupy.cuda.Device(dev):
        s = stream_of(stream, x_in)
        if out is None:
            out = empty_on((T, H), d.storage, s if is_torch(x_in) else None)
        else:
            out = check_array(as_cupy(out, "out", op), name="out", op=op, shape=(T, H),
                              dtype=d, device=dev)
        if T:
            plan = plan_launch("replicated", d, T * H, H, 1, "one_shot",
                               _aligned(x, out, residual, weight), 1, sm_count(dev))
            fn = _kernel(kernels.load(_SRC, dev), plan)
            kernels.launch(fn, plan.grid, plan.block,
                           (x, out, residual, weight, np.int32(plan.rows), np.int32(plan.cols),
                            np.float32(eps)), s, op=op, name=plan.kernel,
                           shared_mem=plan.shared_mem)
    return to_caller(out, x_in, out_in)


# ---- NumPy float64 golden models -----------------------------------------------------------
def reference_allreduce(xs) -> np.ndarray:
    """Sum of the ranks' arrays in float64."""
    xs = [np.asarray(x, dtype=np.float64) for x in xs]
    total = np.zeros_like(xs[0])
    for x in xs:
        total += x
    return total


def reference_allreduce_rmsnorm(xs, residual, weight, eps, mode, W):
    """What each rank holds after AllReduceRMSNorm, in float64.

    xs: W arrays [T, H] (rank r's partial sums); residual [T, H]: the residual stream before
    the call; weight [H]. Returns W pairs (out, residual_after) for ranks 0..W-1:
      replicated:        (out [T, H], h [T, H]);
      sharded_residual:  (out [T, H], residual [T, H] with the rows of rank r's slice set to h,
                          the other rows as given);
      sequence_parallel: (out, h) restricted to rank r's slice, [n_r, H].
    """
    if mode not in OUTPUTS:
        raise ValueError(f"reference_allreduce_rmsnorm: mode must be one of {OUTPUTS}, got {mode!r}")
    if len(xs) != W:
        raise ValueError(f"reference_allreduce_rmsnorm: got {len(xs)} inputs for W={W}")
    res = np.asarray(residual, dtype=np.float64)
    h = reference_allreduce(xs) + res
    w = np.asarray(weight, dtype=np.float64)
    out = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * w
    T = h.shape[0]
    result = []
    for r in range(W):
        a, b = token_slice(T, W, r)
        if mode == "replicated":
            result.append((out, h))
        elif mode == "sharded_residual":
            after = res.copy()
            after[a:b] = h[a:b]
            result.append((out, after))
        else:
            result.append((out[a:b], h[a:b]))
    return result
