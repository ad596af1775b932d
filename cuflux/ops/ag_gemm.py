"""AllGather + GEMM (tensor parallelism, column-parallel layer): out = gather(A) @ B (+ bias).

Each rank holds a_shard [rows, k] (rows = M / W, the same on every rank in a call) and B with
its own n output columns; every rank computes out [M, n] = A_gathered @ B, where A_gathered
[M, k] stacks the ranks' shards in rank order. The gather runs on copy engines, queued from the
host by cuflux.ops.allgather.AllGather (own shard first, then the peers in the topology's
transfer order, each chunk of chunk_rows rows followed by its flag, cuStreamWriteValue32); the
GEMM (kernels_cu/ag_gemm.cu) is queued right after this rank's own rows, runs alongside the
copies, visits its tiles in the order their chunks are expected to land (`visit_order`) and
waits (bounded, acquire) on a tile's chunk flags before it loads its A rows. Where the GEMM
reads A: pull mode, a fresh [M, k] array the copies fill (returned with return_gathered=True);
push mode, this rank's symmetric data region the peers' copies fill (copied out, alongside the
GEMM, when return_gathered=True). W = 1: A_gathered is a_shard itself (no copy unless it is
asked back), and the same kernel runs with epoch 0 (nothing to wait for, no flag written).

Routes (W > 1): "fused" is the above; "unfused" is the op's own gather (AllGather's call, the
same buffers, flags and protocol) into a gathered A, then cuflux.gemm on it. route="auto" (the
default) runs unfused exactly where cuflux.gemm's plan takes cuBLAS: the fused kernel is
cuflux's own GEMM core, which loses to cuBLAS there. `plan(M)` says which route a call takes.
Both routes run one protocol, so ranks may differ in their choice (their tuner tables may).

Per call, on the caller's stream s:
  s:        [pull: wait until peers read our staging of the last call; stage a_shard; ready ->
            peers] copy own rows into the gathered buffer, raise own chunk flags; fork lanes;
            GEMM (waits per tile on chunk flags);
  lanes:    [push: wait until peer p consumed the last call] copy chunks, raise their flags;
            join into s;  [push: s, after the GEMM (and the copy-out): free -> every peer].

Calls of one op must be ordered on each rank (one stream, or streams the caller orders) and
every rank must make the same calls with the same rows. A failed wait (a peer that never
comes) raises CommTimeoutError at synchronize() or at the next call; the op then refuses to
run: close it (collective) and build a new one.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cuflux import gemm_core as core
from cuflux import gemm_tuner as tuner
from cuflux import kernels
from cuflux.arrays import as_cupy, check_array, check_rows, dtype_info, stream_of, to_caller
from cuflux.ops import gemm as gemm_op
from cuflux.ops.allgather import _MEMCPY_DEFAULT, CopyGather, arrival_order, check_path
from cuflux.ops.base import (DEFAULT_TIMEOUT_S, check_route, check_timeout, on_op_device,
                             on_world_device, require_world_device)
from cuflux.sizes import count, optional_count

__all__ = ["AllGatherGemm", "reference_ag_gemm", "visit_order", "chunks_for_rows",
           "default_chunk_rows", "block_tiles_for", "check_build_args", "AG_SM90_CONFIGS"]

_OP = "AllGatherGemm"
_SRC = "ag_gemm.cu"
# Hopper configurations instantiated here: every single-CTA cooperative one of the plain GEMM
# (ag_gemm_sm90 has neither cluster multicast nor the ping-pong schedule); a tuner choice outside
# these falls back to the heuristic (_sm90_config).
AG_SM90_CONFIGS = {name: c for name, c in core.SM90_CONFIGS.items()
                   if c.cluster == 1 and not c.pingpong}

# chunk_rows default. Few copy engines and a host that issues every copy make small chunks slow;
# a few chunks per shard let the GEMM start on a peer's rows before the whole shard has landed.
# `python -m cuflux.bench ag_gemm` sweeps it at W > 1: on the Flux shape this default (512 rows)
# beat 128 rows by 5-6 % with two ranks sharing one GPU and by 8-9 % on two H200s
# (scripts/results/ag_gemm-h200-W2- and ag_gemm-h200x2-W2-2026-11-29.json).
DEFAULT_CHUNKS_PER_SHARD = 4
DEFAULT_MIN_CHUNK_BYTES = 2 << 20
_CHUNK_ALIGN_ROWS = 128  # whole tile rows of every core


# The chunk flags the GEMM waits on carry a host-counted epoch, and the gather's peer waits are
# bounded by a host watchdog per call: neither survives a graph replay.
_NO_CAPTURE_AG = ("the GEMM waits on chunk flags of a host-counted epoch and the gather's waits "
                  "are watched per call from the host; call it outside the capture")


def _sm90_kernel(cfg, cuda_type: str, transposed: bool) -> str:
    return (f"ag_gemm_sm90<{cuda_type}, {cfg.bm}, {cfg.bn}, {cfg.stages}, "
            f"{'true' if transposed else 'false'}, {'true' if cfg.tma_store else 'false'}>")


def _sm80_kernel(cuda_type: str, transposed: bool) -> str:
    return f"ag_gemm_sm80<{cuda_type}, {'true' if transposed else 'false'}>"


def _names() -> list[str]:
    names = []
    for dt in core.IN_DTYPES:
        t = dtype_info(dt).cuda_type
        for tr in (False, True):
            names += [_sm90_kernel(c, t, tr) for c in AG_SM90_CONFIGS.values()]
            names.append(_sm80_kernel(t, tr))
    return names


FAMILY = kernels.register(_SRC, _names(), min_arch=80)


# ---- pure helpers (mirrored by the kernel; tested on the CPU) ----------------------------------
def default_chunk_rows(max_rows: int, row_bytes: int, world_size: int) -> int:
    """Rows per flagged chunk when the caller gives none: the whole shard at W = 1 (nothing is
    copied), else about DEFAULT_CHUNKS_PER_SHARD chunks per shard of at least
    DEFAULT_MIN_CHUNK_BYTES each, in whole 128-row tiles."""
    if world_size == 1:
        return max_rows
    align = _CHUNK_ALIGN_ROWS
    rows = -(-max_rows // DEFAULT_CHUNKS_PER_SHARD)
    rows = max(rows, -(-DEFAULT_MIN_CHUNK_BYTES // row_bytes))
    return min(max_rows, -(-rows // align) * align)


def chunks_for_rows(row_begin: int, row_end: int, rows_per_rank: int,
                    chunk_rows: int) -> list[tuple[int, int]]:
    """(source rank, chunk) of every chunk that rows [row_begin, row_end) of the gathered A come
    from: the flags a tile's prologue waits on (include/cuflux/ag_hooks.cuh, same loops)."""
    if row_end <= row_begin:
        return []
    out = []
    for src in range(row_begin // rows_per_rank, (row_end - 1) // rows_per_rank + 1):
        base = src * rows_per_rank
        lo = max(row_begin, base) - base
        hi = min(row_end, base + rows_per_rank) - base
        out += [(src, c) for c in range(lo // chunk_rows, (hi - 1) // chunk_rows + 1)]
    return out


def block_tiles_for(world_size: int, rows_per_rank: int, chunk_rows: int, tile_rows: int) -> int:
    """Tile rows per scheduling block. W = 1: all of them (one block: the plain GEMM's order).
    Else as many whole tile rows as one chunk holds (at least one), so a block becomes ready
    about when one chunk lands and the L2 grouping stays inside it."""
    tiles_m = -(-world_size * rows_per_rank // tile_rows)
    if world_size == 1:
        return max(1, tiles_m)
    return max(1, min(tiles_m, min(chunk_rows, rows_per_rank) // tile_rows))


def visit_order(world_size: int, rank: int, stages, rows_per_rank: int, chunk_rows: int,
                tile_rows: int, block_tiles: int) -> list[int]:
    """The order in which the GEMM visits its blocks of block_tiles tile rows: by the expected
    landing of the last chunk a block needs (allgather.arrival_order: own shard, then the
    arrival stages, chunk-major), ties in row order. A permutation of the blocks.
    stages: allgather.arrival_stages (AllGather.arrival_stages of the op)."""
    R = rows_per_rank
    num_chunks = -(-R // chunk_rows)
    when = {sc: i for i, sc in enumerate(arrival_order(rank, stages, num_chunks))}
    M = world_size * R
    block_rows = block_tiles * tile_rows
    num_blocks = -(-(-(-M // tile_rows)) // block_tiles)
    keys = [max(when[sc] for sc in chunks_for_rows(b * block_rows, min(M, (b + 1) * block_rows),
                                                   R, chunk_rows))
            for b in range(num_blocks)]
    return sorted(range(num_blocks), key=lambda b: (keys[b], b))


_MAX_DIM = 2**31 - 1  # M, n and k travel to the kernel as int32


def check_build_args(world_size: int, max_m, n, k, dtype, out_dtype, b_layout, mode, chunk_rows,
                     timeout_s, impl, config, group_m, *, max_rows_per_rank=None,
                     route: str = "auto", path: str = "copy"):
    """Constructor checks that need no GPU; returns (dtype, out dtype, max rows per rank).

    The row bound comes as exactly one of max_m (the largest gathered M, the GEMM's M: rows
    per rank = max_m // world_size) or max_rows_per_rank (AllGather's max_rows)."""
    dt = dtype_info(dtype, core.IN_DTYPES, _OP)
    odt = dtype_info(out_dtype if out_dtype is not None else dt.name, core.OUT_KIND, _OP)
    core.check_b_layout(b_layout, _OP)
    if mode not in ("pull", "push"):
        raise ValueError(f"{_OP}: mode must be 'pull' or 'push', got {mode!r}")
    check_route(_OP, route)
    check_path(_OP, path)
    if path == "sm" and route == "fused" and world_size > 1:
        raise ValueError(f"{_OP}: path='sm' runs unfused at W > 1 (the fused kernel reads the "
                         "copy engines' chunk flags): route must be 'auto' or 'unfused'")
    why8 = "rows move in 16-byte pieces"
    count(_OP, "n", n, 8, _MAX_DIM // 8 * 8, f"this rank's output columns; {why8}", 8)
    count(_OP, "k", k, 8, _MAX_DIM // 8 * 8, f"the inner dimension; {why8}", 8)
    if (max_m is None) == (max_rows_per_rank is None):
        raise TypeError(f"{_OP}: give exactly one of max_m (the largest gathered M = world size "
                        "* rows per rank) and max_rows_per_rank (the largest a_shard rows), got "
                        + ("both" if max_m is not None else "neither"))
    if max_m is not None:
        max_rows = count(_OP, "max_m", max_m, world_size, _MAX_DIM,
                         f"the largest gathered M = world size {world_size} * rows per rank")
        max_rows //= world_size
    else:
        max_rows = count(_OP, "max_rows_per_rank", max_rows_per_rank, 1, _MAX_DIM // world_size,
                         f"the largest a_shard rows; world size {world_size} * it is the "
                         "gathered M, below 2**31")
    optional_count(_OP, "chunk_rows", chunk_rows, what="rows per flagged chunk; None: "
                   "default_chunk_rows")
    check_timeout(_OP, timeout_s)
    if impl not in ("auto", "sm90", "sm80"):
        raise ValueError(f"{_OP}: impl must be 'auto', 'sm90' or 'sm80', got {impl!r}")
    if config is not None:
        if config not in AG_SM90_CONFIGS:
            raise ValueError(f"{_OP}: config must be one of {sorted(AG_SM90_CONFIGS)} or None, "
                             f"got {config!r}")
        if impl == "sm80":
            raise ValueError(f"{_OP}: config names a Hopper configuration; impl='sm80' has one "
                             f"fixed tile ({core.SM80_CONFIG})")
    count(_OP, "group_m", group_m, what="tile rows per L2 group")
    return dt, odt, max_rows


def reference_ag_gemm(a_shards, bs, biases=None, b_layout: str = "kn") -> list[np.ndarray]:
    """What each rank's out holds, in float64: concat(a_shards) @ B_r (+ bias_r).

    a_shards: W arrays [rows, k] (rank order); bs: W weights, [k, n] ("kn") or [n, k] ("nk");
    biases: W arrays [n] or None. The gathered A is np.concatenate(a_shards) on every rank.
    """
    core.check_b_layout(b_layout, "reference_ag_gemm")
    if len(bs) != len(a_shards) or (biases is not None and len(biases) != len(a_shards)):
        raise ValueError(f"reference_ag_gemm: {len(a_shards)} shards but {len(bs)} weights"
                         + ("" if biases is None else f" and {len(biases)} biases"))
    a = np.concatenate([np.asarray(x, dtype=np.float64) for x in a_shards])
    outs = []
    for r, b in enumerate(bs):
        b = np.asarray(b, dtype=np.float64)
        o = a @ (b if b_layout == "kn" else b.T)
        if biases is not None:
            o = o + np.asarray(biases[r], dtype=np.float64)[None, :]
        outs.append(o)
    return outs


# ---- the op --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    impl: str          # "sm90" / "sm80"
    config: str        # Hopper configuration name, or gemm_core.SM80_CONFIG
    kernel: str        # name expression in kernels_cu/ag_gemm.cu
    tile_rows: int
    block_tiles: int
    grid: int
    threads: int
    smem: int


class AllGatherGemm(CopyGather):
    """out [M, n] = gather_ranks(a_shard) @ b (+ bias), the gather hidden behind the GEMM.

    Args:
      world: cuflux.World (with a CUDA device: without one the constructor raises
        NoDeviceError "AllGatherGemm: needs a CUDA device; ..." before anything else).
      max_m: largest gathered M = W * rows any call uses: the GEMM's M, the bound of out's
        rows, as GemmReduceScatter's max_m (rows per rank <= max_m // W). Or, instead:
      max_rows_per_rank (keyword): largest a_shard rows any call uses, as AllGather's
        max_rows (max_m = W * max_rows_per_rank). Give exactly one of the two.
      n: this rank's output columns; k: the inner dimension (both multiples of 8).
      dtype: bfloat16 or float16 (a_shard, b, bias); out_dtype: bfloat16 / float16 / float32
        (default: dtype). fp32 accumulation.
      b_layout: "kn" (b is [k, n]) or "nk" (b is [n, k], a Linear weight).
      mode: "pull" (each rank reads the peers' staged shards) or "push" (each rank writes its
        shard into every peer).
      chunk_rows: rows per flagged communication chunk (None: default_chunk_rows).
      timeout_s: bound of every wait; on expiry CommTimeoutError.
      impl: the fused kernel's core: "auto" (Hopper core on sm_90a, else the portable core),
        "sm90" or "sm80".
      config: the fused kernel's Hopper configuration (AG_SM90_CONFIGS); None: the plain GEMM
        tuner's cached choice for the shape, else its heuristic.
      group_m: tile rows per L2 group inside a scheduling block.
      route (keyword): at W > 1, "auto" (default: `plan(M)`, unfused exactly where
        cuflux.gemm_tuner.fastest(M, n, k, dtype, b_layout) is "cublas", else fused), "fused"
        (always the fused kernel) or "unfused" (always the op's own gather into a gathered A,
        then cuflux.gemm(impl="auto") on it; impl and config do not apply). At W = 1 every
        route runs the fused kernel (nothing is gathered). Both routes run the same gather
        protocol, so ranks whose tuner tables differ may take different routes.
      path (keyword): the gather's, as AllGather's: "copy" (copy engines, default) or "sm"
        (one SM kernel a call, its epoch on the device: the op can be captured in a CUDA graph;
        at W > 1 every call runs unfused, its gathered A in a buffer the op holds, [max_m, k];
        route must then be "auto" or "unfused"; mode and chunk_rows do nothing).
    Sizes (max_m / max_rows_per_rank, n, k, chunk_rows, group_m) are ints (Python or NumPy
    integers; no bools, floats or strings), checked by cuflux.sizes.count with one message:
    "AllGatherGemm: max_m must be an integer in [2, 2147483647] (...), got 4096.0 (float)".

    `plan(M)` is "fused" or "unfused": the route of a call whose gathered A has M rows
    (decided once per M and kept). Every rank must make the same calls with the same rows
    (compared across ranks, bounded, the first time a row count is seen). With path="copy"
    the op cannot be captured in a CUDA graph (CaptureError); with path="sm" it can (calls
    then ordered on each rank: one stream, or streams the caller orders).
    """

    ACROSS = "AllGatherGemmAcrossNodes"  # several nodes: CommOp.__new__
    _scratch = ("_gathered",)  # pull mode's gathered A: let go at close()

    @on_world_device
    def __init__(self, world, max_m: int | None = None, n: int | None = None,
                 k: int | None = None, dtype=None, out_dtype=None, b_layout: str = "kn",
                 mode: str = "pull", chunk_rows: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, impl: str = "auto",
                 config: str | None = None, group_m: int = 8, *,
                 max_rows_per_rank: int | None = None, route: str = "auto",
                 path: str = "copy"):
        require_world_device(world, _OP)  # first: without a GPU, this is the one error to see
        missing = [name for name, v in (("n", n), ("k", k), ("dtype", dtype)) if v is None]
        if missing:  # None defaults only so that max_m may be left out for max_rows_per_rank
            raise TypeError(f"{_OP}: missing required argument(s): {', '.join(missing)}")
        dt, odt, max_rows = check_build_args(world.size, max_m, n, k, dtype, out_dtype, b_layout,
                                             mode, chunk_rows, timeout_s, impl, config, group_m,
                                             max_rows_per_rank=max_rows_per_rank, route=route,
                                             path=path)
        import cupy

        n, k, group_m = int(n), int(k), int(group_m)
        chunk_rows = int(chunk_rows) if chunk_rows is not None else \
            default_chunk_rows(max_rows, k * dt.itemsize, world.size)
        # Per rank: max_m = 515 on one rank and max_rows_per_rank = 128 on another agree (W = 4).
        world.check_same((max_rows, n, k, dt.name, odt.name, b_layout, mode, chunk_rows,
                          float(timeout_s), impl, config, group_m, route, path),
                         f"{_OP} arguments (max_rows_per_rank, n, k, dtype, out_dtype, b_layout, "
                         f"mode, chunk_rows, timeout_s, impl, config, group_m, route, path)")
        arch = kernels.device_arch(world.device)
        if impl == "sm90" and arch != "sm_90a":
            raise RuntimeError(f"{_OP}: impl='sm90' needs an sm_90a device (Hopper), device "
                               f"{world.device} is {arch}")
        # Eager: nothing may load while a stream waits (the unfused route's GEMM included).
        module = kernels.load(_SRC, world.device)
        if world.size > 1 and route != "fused":
            kernels.load("gemm.cu", world.device)
        self._closed = True  # until the buffers exist
        # The collective part: the op's communicator, error record, buffer, flags, copy lanes.
        super().__init__(world, _OP, timeout_s, max_rows, k, dt, mode, chunk_rows, "stream", path)
        self.n, self.k, self.out_dtype, self.b_layout = n, k, odt, b_layout
        self.group_m, self.config, self.route, self.arch = group_m, config, route, arch
        self.max_m = world.size * max_rows  # the largest M a call can have
        self.impl = impl if impl != "auto" else ("sm90" if arch == "sm_90a" else "sm80")
        # Ranks sharing this GPU run their GEMMs side by side (under MPS): split the SMs, so that
        # no rank's grid waits for SMs another rank's waiting grid holds.
        self.max_ctas = max(1, self.num_sms // self.sharers)
        self.module = module
        self._side = cupy.cuda.Stream(non_blocking=True)    # push: copy-out of the gathered A
        self._upload = cupy.cuda.Stream(non_blocking=True)  # visit orders, once per shape
        self._plans: dict[int, _Plan] = {}
        self._orders: dict[tuple, object] = {}
        self._routes: dict[int, str] = {}
        # path "sm": the unfused route's gathered A is the op's own (a CUDA graph keeps the
        # address it captured: a per-call temporary would go back to the pool under it)
        self._gathered = None
        if self._sm:
            with world.device_context():
                self._gathered = cupy.empty((self.max_m, k), dtype=dt.storage)
        self._closed = False

    # ---- planning --------------------------------------------------------------------------------
    @on_op_device
    def plan(self, M: int) -> str:
        """"fused" or "unfused": what a call whose gathered A has M rows runs (see route).
        Decided once per M (auto: from cuflux.gemm_tuner.fastest, the tuner's table or its
        heuristic) and kept for the op's life."""
        return self._route(count(_OP, "M", M, 1, self.max_m, "the gathered rows of a call"))

    def _route(self, M: int) -> str:
        """plan(M) for a checked M, on the op's device."""
        route = self._routes.get(M)
        if route is not None:
            return route
        if self.world.size == 1 or self.route == "fused":
            route = "fused"
        elif self.route == "unfused" or self._sm:
            route = "unfused"
        else:  # where cuflux.gemm takes cuBLAS, our core (the fused kernel's) loses to it
            winner = tuner.fastest(M, self.n, self.k, self.dtype.name, self.b_layout)
            route = "unfused" if winner == tuner.CUBLAS else "fused"
        if len(self._routes) < 4096:
            self._routes[M] = route
        return route

    def _sm90_config(self, M: int) -> str:
        if self.config is not None:
            return self.config
        key = tuner.tune_key(self.dtype, self.b_layout, M, self.n, self.k)
        cached = tuner.load_tuner().get(key, {}).get("config")  # read only: never tunes here
        if cached in AG_SM90_CONFIGS:
            return cached
        return tuner.core_heuristic(M, self.n, self.k)

    def plan_for(self, rows: int) -> _Plan:
        """The fused kernel, tile and grid a call with `rows` rows per rank runs."""
        plan = self._plans.get(rows)
        if plan is not None:
            return plan
        W, M = self.world.size, self.world.size * rows
        transposed = self.b_layout == "kn"
        t = self.dtype.cuda_type
        if self.impl == "sm90":
            name = self._sm90_config(M)
            cfg = AG_SM90_CONFIGS[name]
            tiles = -(-M // cfg.bm) * -(-self.n // cfg.bn)
            plan = _Plan("sm90", name, _sm90_kernel(cfg, t, transposed), cfg.bm,
                         block_tiles_for(W, rows, self.chunk_rows, cfg.bm),
                         min(tiles, self.max_ctas), 384, cfg.smem_bytes)
        else:
            sm80 = core.SM80  # ag_gemm_sm80: the portable core's one tile
            tiles = -(-M // sm80.bm) * -(-self.n // sm80.bn)
            plan = _Plan("sm80", core.SM80_CONFIG, _sm80_kernel(t, transposed), sm80.bm,
                         block_tiles_for(W, rows, self.chunk_rows, sm80.bm),
                         min(tiles, sm80.ctas_per_sm * self.max_ctas), sm80.threads,
                         sm80.smem_bytes)
        core.prepare(self.module[plan.kernel], plan.smem)
        self._plans[rows] = plan
        return plan

    def _order(self, rows: int, plan: _Plan):
        """Device copy of visit_order for this shape (made once, kept for the op's life: a
        kernel still queued may read it)."""
        key = (rows, plan.tile_rows, plan.block_tiles)
        dev = self._orders.get(key)
        if dev is None:
            import cupy

            host = np.asarray(visit_order(self.world.size, self.world.rank,
                                          self.arrival_stages, rows, self.chunk_rows,
                                          plan.tile_rows, plan.block_tiles), dtype=np.int32)
            with self._upload:  # a private stream: never behind a flag wait
                dev = cupy.asarray(host)
            self._upload.synchronize()
            self._orders[key] = dev
        return dev

    # ---- call ------------------------------------------------------------------------------------
    def _check_call(self, a_shard, b, bias, out):
        """Every argument check, before anything is queued (nothing touches a peer)."""
        dev, dt = self.world.device, self.dtype
        a = check_rows(a_shard, name="a_shard", op=_OP, cols=self.k, cols_name="k",
                       max_rows=self.max_rows, limit="max_m // W", dtype=dt, device=dev)
        rows = a.shape[0]
        b = as_cupy(b, "b", _OP)
        check_array(b, name="b", op=_OP, ndim=2, dtype=dt, device=dev)
        want = (self.k, self.n) if self.b_layout == "kn" else (self.n, self.k)
        if tuple(b.shape) != want:
            dims = "[k={}, n={}]" if self.b_layout == "kn" else "[n={1}, k={0}]"
            raise ValueError(f"{_OP}: b (layout {self.b_layout!r}) must be "
                             f"{dims.format(self.k, self.n)}, got {tuple(b.shape)}")
        core.check_aligned(_OP, a_shard=a, b=b)
        bias = core.check_bias(_OP, bias, self.n, dt, dev)
        if out is not None:
            out = as_cupy(out, "out", _OP)
            check_array(out, name="out", op=_OP, shape=(self.world.size * rows, self.n),
                        dtype=self.out_dtype, device=dev)
            if out.data.ptr % 16:
                raise ValueError(f"{_OP}: out must start at a 16-byte aligned address")
        return a, b, bias, out, rows

    @on_op_device
    def __call__(self, a_shard, b, bias=None, return_gathered: bool = False, stream=None,
                 out=None):
        """a_shard [rows, k] (rows <= max_m // W, the same on every rank), b [k, n] / [n, k],
        bias [n] or None -> out [W * rows, n] (into `out` when given), and with
        return_gathered=True also the gathered A [W * rows, k] (a new array): (out, gathered)."""
        import cupy

        self._check_open()
        a_in, out_in = a_shard, out  # the caller's: torch in, torch out
        a, b, bias, out, rows = self._check_call(a_shard, b, bias, out)
        s = stream_of(stream, a_in)
        W, M = self.world.size, self.world.size * rows
        if self.path == "copy":
            self._no_capture(s, _NO_CAPTURE_AG)
        if W > 1 and rows not in self._agreed:
            self._agree(rows, "rows of the call")
        route = self._route(M) if rows else "fused"
        pull = self.mode == "pull" or W == 1
        # Allocations come from s's pool arena: their blocks were last used by work queued on s,
        # which runs before everything below (the lanes fork from s).
        with s:
            if out is None:
                out = cupy.empty((M, self.n), dtype=self.out_dtype.storage)
            gathered = None
            if return_gathered or (W > 1 and (pull or route == "unfused")):
                gathered = (self._gathered[:M] if self._gathered is not None and not
                            return_gathered else cupy.empty((M, self.k), dtype=self.dtype.storage))
        if rows:  # 0 rows on every rank (rows agree): nothing to do, no epoch
            if route == "unfused":
                self._issue_unfused(a, gathered, b, bias, out, s)
            else:
                if pull and gathered is None:  # W = 1, nothing asked back: the GEMM reads a
                    gathered = a
                self._issue(a, rows, gathered, b, bias, out, s)
        return (to_caller((out, gathered), a_in, (out_in, None)) if return_gathered
                else to_caller(out, a_in, out_in))

    def _issue_unfused(self, a, gathered, b, bias, out, s) -> int:
        """Queue one unfused call (W > 1, arguments checked, rows >= 1): the op's gather into
        `gathered` [M, k], then cuflux.gemm on it (its own choice: cuBLAS where plan() picks
        this route). Returns the call's epoch."""
        e = self.gather_into(a, gathered.data.ptr, s)
        gemm_op.gemm(gathered, b, bias=bias, out=out, out_dtype=self.out_dtype.name,
                     b_layout=self.b_layout, stream=s)
        return e

    def _issue(self, a, rows: int, gathered, b, bias, out, s) -> int:
        """Queue one fused call (arguments checked, rows >= 1); returns its epoch. gathered:
        where the GEMM reads A (pull, W = 1), or the copy-out target (push, return_gathered),
        or None (push)."""
        import cupy

        plan = self.plan_for(rows)
        order = self._order(rows, plan)
        pull = self.mode == "pull" or self.world.size == 1
        a_ptr = gathered.data.ptr if pull else self.push_gathered_ptr()
        e = self.begin(a, a_ptr, s)
        fork = None
        if not pull and gathered is not None:  # the copy-out forks here: beside the GEMM
            fork = cupy.cuda.Event(disable_timing=True)
            fork.record(s)
        # W = 1: nothing to wait for (the stream orders the copy, if any, before the GEMM); the
        # same kernel runs with epoch 0, which every flag has reached.
        self._launch(plan, a_ptr, b, bias, out, rows, e if self.world.size > 1 else 0, order, s)
        self.send_peers(a, a_ptr, s)
        if not pull:
            if gathered is not None:
                self._copy_out(gathered, rows, e, fork, s)
            self.release(s)  # after the GEMM and the copy-out on s
        return e

    def _launch(self, plan: _Plan, a_ptr: int, b, bias, out, rows: int, e: int, order, s):
        M, N, K = self.world.size * rows, self.n, self.k
        tail = (order, np.int32(plan.block_tiles), np.int32(self.group_m),
                np.uint64(self.chunk_flags_ptr()), np.int32(self.max_chunks),
                np.int32(rows), np.int32(self.chunk_rows), np.uint32(e & 0xFFFFFFFF)) \
            + self.err_args + (np.uint32(self.world.rank),)
        head = (np.int32(M), np.int32(N), np.int32(K), out, np.int64(N),
                np.int32(core.OUT_KIND[self.out_dtype.name]),
                bias if bias is not None else np.uint64(0))
        if plan.impl == "sm90":
            cfg, dt = AG_SM90_CONFIGS[plan.config], self.dtype
            tma_a = core.tensor_map(a_ptr, M, K, 64, cfg.bm, dt)
            if self.b_layout == "kn":
                tma_b = core.tensor_map(b.data.ptr, K, N, 64, 64, dt)
            else:
                tma_b = core.tensor_map(b.data.ptr, N, K, 64, cfg.bn, dt)
            if cfg.tma_store and self.out_dtype.itemsize == 2:
                tma_c = core.tensor_map(out.data.ptr, M, N, 64, cfg.bm // 2, self.out_dtype)
            else:
                tma_c = tma_a  # not read by the kernel
            args = (tma_a, tma_b, tma_c) + head + tail
        else:
            args = (np.uint64(a_ptr), b) + head + tail
        kernels.launch(self.module[plan.kernel], (plan.grid,), (plan.threads,), args, s, op=_OP,
                       name=plan.kernel, shared_mem=plan.smem)

    def _copy_out(self, gathered, rows: int, e: int, fork, s) -> None:
        """Push mode: copy this call's gathered rows out of the data region (which the next call
        overwrites) on a side stream forked from s before the GEMM, so it runs alongside. A
        source's chunks land in order on one copy stream, so its last chunk's flag covers its
        whole shard. s waits for the copy."""
        import cupy
        from cupy.cuda import runtime

        self._side.wait_event(fork)
        last = -(-rows // self.chunk_rows) - 1
        self._wait(self._side, "chunk", e, 0, num_groups=self.world.size, per_group=1,
                   group_stride=self.max_chunks, index0=last)
        runtime.memcpyAsync(gathered.data.ptr, self.push_gathered_ptr(),
                            self.world.size * rows * self.row_bytes, _MEMCPY_DEFAULT,
                            self._side.ptr)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self._side)
        s.wait_event(done)

    # ---- lifetime (CopyGather / CommOp: synchronize, close, abort) --------------------------------
    def _own_streams(self) -> list:
        return super()._own_streams() + [self._side]

    def _free(self) -> None:
        """The visit orders live as long as a kernel may still read them: CopyGather._free
        stops the watchdog once every stream is quiet, and raises (they stay) where close()
        finds a stream still held; after an abort() with work queued they stay too."""
        super()._free()
        if all(st.done for st in self._streams()):
            self._orders.clear()
