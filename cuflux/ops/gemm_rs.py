"""GemmReduceScatter: a row-parallel GEMM and the reduce-scatter of its output in one kernel
(Flux's GEMM + ReduceScatter, SPEC.md "Seed 000").

On every rank r: C_r = a_r [M, k_r] @ b_r ([k_r, n] for b_layout="kn", [n, k_r] for "nk");
rank o receives out_o [M / W, n] = sum_r C_r[o * M / W : (o + 1) * M / W] (+ bias, once).

Each output tile goes, from the epilogue of the CTA that computed it, straight to the rank
owning its rows; ranks visit tiles in a rank-offset order (owner r+1 first, own rows last) so
that at any moment they write into different ranks; the owner finishes its own tiles once
every peer's flag for the tile has arrived. The protocol, buffers and why it cannot deadlock
are described in kernels_cu/include/cuflux/rs_hooks.cuh; the kernels are in
kernels_cu/gemm_rs.cu. reduce="deterministic" sums the W partials in fp32 in rank order
(bit-identical run to run); reduce="atomic" adds them with vector reductions (red.add) into
the owner's accumulator (NVLink or one shared GPU only: peer atomics fail over PCIe).

At W = 1 nothing moves: the op is the plain GEMM (cuflux.gemm) writing out directly, unless it
was built with w1="fused" (the fused kernel itself, for tests and benchmarks).

Small M runs unfused (route="auto", `op.plan(M)` says which): cuflux.gemm (cuBLAS there) into a
partial, then `reduce_scatter` — the fused kernel is cuflux's GEMM core, which loses to cuBLAS
below UNFUSED_BELOW_M rows (cuflux.ops.base.ROUTES says why the rule depends on M alone).

route="chunked" (W > 1) hides the transfer behind cuBLAS instead of fusing it into our core
(issue 15): the GEMM runs as W row chunks, one per owner, in the copy order (peers first, own
rows last); as each peer chunk is computed, a copy engine moves it into the owner's memory
(ChunkedRs below: AllGather's push protocol, sources per peer) while the next chunk computes,
and one small kernel (rs_sum) sums the W partials in rank order once every chunk has landed; at
W = 2 where that sum would cost more than splitting the GEMMs (small k: fold_route), the chunks
go in two row parts each and the own parts' GEMMs add the received parts as they land (cublasLt's
C), leaving no summing kernel. Its epochs are counted on the host: not capturable (refused under
capture). Its bits are the same run to run for the cuBLAS algorithms it runs, which come from
the machine's algorithm table (gemm_core.ALGO_CANDIDATES; CUFLUX_GEMM_ALGO_TUNE=0 pins them).

`GemmReduceScatter.reduce_scatter(partial)` is the same reduce-scatter on an already computed
partial (e.g. cuBLAS's): the unfused baseline, through the same buffers, flags and order.
`reference_gemm_rs` is the float64 golden model.
"""
from __future__ import annotations

import contextlib

import numpy as np

from cuflux import driver, gemm_core as core
from cuflux import kernels, knobs
from cuflux.arrays import as_cupy, check_array, dtype_info, stream_of, to_caller, zeros_settled
from cuflux.errors import ABORT
from cuflux.ops.allgather import _MEMCPY_DEFAULT, CopyGather
from cuflux.ops.base import (DEFAULT_TIMEOUT_S, ROUTES, CommOp, check_no_alias,
                             check_route, check_timeout, fused_route, max_unfused_m,
                             on_op_device, require_world_device)
from cuflux.ops.gemm import gemm, gemm_replay
from cuflux.sizes import count
from cuflux.symmetric import Layout

__all__ = ["GemmReduceScatter", "reference_gemm_rs", "tile_order", "own_tile_rows",
           "make_layout", "REDUCE_MODES", "SM90_RS_CONFIGS", "W1_MODES", "RS_ROUTES",
           "ChunkedRs", "fold_route", "fold_bounds", "FOLD_SPLITS", "FOLD_BELOW_K_BYTES"]

_OP = "GemmReduceScatter"
_SRC = "gemm_rs.cu"
REDUCE_MODES = ("deterministic", "atomic")
W1_MODES = ("gemm", "fused")  # what a call runs at W = 1 (constructor argument w1)
RS_ROUTES = ROUTES + ("chunked",)  # cuBLAS chunks + copy engines (module docstring)
# Hopper tile configurations compiled into gemm_rs.cu (names of cuflux.gemm_core.SM90_CONFIGS:
# 4 stages, 1-CTA clusters, register epilogue).
SM90_RS_CONFIGS = ("256x128s4c1", "128x256s4c1")
SM90_RS_DEFAULT = "256x128s4c1"  # the plain GEMM's fastest (docs/gemm_notes.md)
COPY_TILE, COPY_THREADS = (128, 128), 512  # rs_tiles
MIN_TILE = 128                   # smallest tile side of any kernel: sizes the flag region
GROUP_M = 8                      # tile rows per L2 group in the peers' part of the tile order
MAX_DIM = 2**31 - 1


def _b(x: bool) -> str:
    return "true" if x else "false"


def sm90_kernel(cuda_type: str, config: str, transposed: bool, atomic: bool) -> str:
    c = core.SM90_CONFIGS[config]
    return f"gemm_rs_sm90<{cuda_type}, {c.bm}, {c.bn}, {_b(transposed)}, {_b(atomic)}>"


def sm80_kernel(cuda_type: str, transposed: bool, atomic: bool) -> str:
    return f"gemm_rs_sm80<{cuda_type}, {_b(transposed)}, {_b(atomic)}>"


def copy_kernel(cuda_type: str, out_cuda_type: str, atomic: bool) -> str:
    return f"rs_tiles<{cuda_type}, {out_cuda_type}, {_b(atomic)}>"


def sum_kernel(cuda_type: str, out_cuda_type: str) -> str:
    return f"rs_sum<{cuda_type}, {out_cuda_type}>"


def _names() -> list[str]:
    names = []
    for t in ("__nv_bfloat16", "__half"):
        for atomic in (False, True):
            for tr in (False, True):
                names += [sm90_kernel(t, c, tr, atomic) for c in SM90_RS_CONFIGS]
                names.append(sm80_kernel(t, tr, atomic))
            names += [copy_kernel(t, o, atomic) for o in (t, "float")]
        names += [sum_kernel(t, o) for o in (t, "float")]
    return names


FAMILY = kernels.register(_SRC, _names(), min_arch=80)


# ---- tile order and buffers (pure: tested on the CPU) -------------------------------------------
def own_tile_rows(M: int, world_size: int, rank: int, bm: int) -> tuple[int, int]:
    """First and last tile rows (of bm rows) that hold rows of `rank` (M % world_size == 0)."""
    R = M // world_size
    return rank * R // bm, ((rank + 1) * R - 1) // bm


def tile_order(M: int, N: int, world_size: int, rank: int, bm: int, bn: int,
               group_m: int = GROUP_M) -> list[tuple[int, int]]:
    """(tm, tn) of slot 0, 1, ... on `rank`: mirror of rs_hooks.cuh RsScheduler (and of the
    own_lo / own_hi arguments the kernels get)."""
    tiles_m, tiles_n = -(-M // bm), -(-N // bn)
    own_lo, own_hi = own_tile_rows(M, world_size, rank, bm)
    rot, num_own = (own_hi + 1) % tiles_m, own_hi - own_lo + 1
    peer_rows = tiles_m - num_own
    order = []
    for slot in range(tiles_m * tiles_n):
        if slot < peer_rows * tiles_n:
            pos, tn = core.grouped_tile(slot, peer_rows, tiles_n, group_m)
        else:  # own tile rows, grouped the same way (each tile row still walked in tn order)
            pos, tn = core.grouped_tile(slot - peer_rows * tiles_n, num_own, tiles_n, group_m)
            pos += peer_rows
        order.append(((pos + rot) % tiles_m, tn))
    return order


def make_layout(world_size: int, max_m: int, n: int, out_dtype, reduce: str) -> Layout:
    """The op's symmetric buffer: data[parity] (deterministic: a slot per source rank,
    [2, W, R_max, n]; atomic: one accumulator, [2, R_max, n]) in the output dtype, then the
    per-tile flags, u64 epochs [tiles, flag_stride] (flag_stride >= W words: one 128-byte line
    per tile for W <= 16, word p written by source rank p)."""
    odt = dtype_info(out_dtype)
    rows = max_m // world_size
    shape = (2, world_size, rows, n) if reduce == "deterministic" else (2, rows, n)
    lay = Layout()
    lay.add("data", shape, odt.storage)
    tiles = -(-max_m // MIN_TILE) * -(-n // MIN_TILE)
    lay.add("flags", (tiles, -(-world_size // 16) * 16), np.uint64)
    return lay


# ---- golden model -------------------------------------------------------------------------------
def reference_gemm_rs(a_list, b_list, bias=None, b_layout: str = "kn", rank: int | None = None,
                      xp=np):
    """What each rank holds after GemmReduceScatter, in float64.

    a_list[r] [M, k_r], b_list[r] [k_r, n] ("kn") or [n, k_r] ("nk"); bias [n] or None.
    Returns the W outputs [M / W, n], or only rank `rank`'s (computing only its rows).
    xp: numpy, or cupy to compute on the GPU (same arithmetic, float64).
    """
    W = len(a_list)
    if W == 0 or len(b_list) != W:
        raise ValueError(f"reference_gemm_rs: need one a and one b per rank, got {len(a_list)} "
                         f"and {len(b_list)}")
    core.check_b_layout(b_layout, "reference_gemm_rs")
    M = a_list[0].shape[0]
    if M % W:
        raise ValueError(f"reference_gemm_rs: M={M} is not divisible by W={W}")
    R = M // W
    ranks = range(W) if rank is None else [rank]
    outs = []
    for o in ranks:
        total = None
        for a, b in zip(a_list, b_list):
            bm = xp.asarray(b).astype(xp.float64)
            part = xp.asarray(a)[o * R:(o + 1) * R].astype(xp.float64) @ (
                bm if b_layout == "kn" else bm.T)
            total = part if total is None else total + part
        if bias is not None:
            total = total + xp.asarray(bias).astype(xp.float64)[None, :]
        outs.append(total)
    return outs if rank is None else outs[0]


# ---- route="chunked": cuBLAS chunks, copy engines, one summing kernel (or none) ----------------
SUM_THREADS = 256
SUM_BLOCKS_PER_SM = 8
# W = 2, the fold: each chunk in FOLD_SPLITS row parts, the own parts computed by cublasLt with
# the peer's received part as C (out = a b + received (+ bias), one rounding), so no summing
# kernel is left at the end. Splitting costs: 2 x FOLD_SPLITS GEMMs instead of 2. The summing
# kernel costs a pass over 3 R x n outputs against the GEMM's 2 M n k flops: 3 b / (2 W k) of
# the GEMM's time times the GPU's flop-to-byte rate (~206 on an H200: 700 TFLOP/s, 3.4 TB/s),
# i.e. 4.3 % at k = 7168 (W = 2, bf16), 2.2 % at 14336, 1.3 % at 24576. Measured on one H200
# without the communication (scripts/results/probes/probe_rs_schedule-h200-2026-12-02b.json,
# the SM work of one rank's call against cupy.matmul of the whole GEMM): summing 1.033x / 0.974x /
# 1.000x, folding 1.016x / 1.028x / 1.044x at k = 7168 / 14336 / 24576 (8192x4096, 8192x8192,
# 4096x12288 outputs). So the fold runs where the sum would cost more than ~3 % of the GEMM:
# k * out itemsize < FOLD_BELOW_K_BYTES.
FOLD_SPLITS = 2
FOLD_BELOW_K_BYTES = 2 * 10240  # k < 10240 for bf16 / fp16 partials, k < 5120 for fp32


def fold_route(world_size: int, ks, out_itemsize: int, impl: str, cublaslt: bool,
               fold: bool | None = None) -> bool:
    """Whether route="chunked" folds. It can at W = 2 with impl "auto" (the fold's own parts
    are cuBLAS) and the cublasLt route on (knobs.gemm_cublaslt); fold None: it does where
    every rank's k (the largest decides) is under FOLD_BELOW_K_BYTES; True / False: the
    caller's choice (True where it cannot: ValueError). The same on every rank given the same
    arguments (GemmReduceScatter agrees them)."""
    possible = world_size == 2 and impl == "auto" and cublaslt
    if fold is None:
        return possible and max(ks) * out_itemsize < FOLD_BELOW_K_BYTES
    if fold and not possible:
        raise ValueError(f"{_OP}: fold=True needs W = 2 (got {world_size}), impl='auto' (got "
                         f"{impl!r}) and the cublasLt route (CUFLUX_GEMM_CUBLASLT=1) on every "
                         f"rank")
    return bool(fold)


def fold_bounds(rows: int, splits: int) -> list[tuple[int, int]]:
    """The row parts [r0, r1) of a chunk of `rows` rows: min(splits, rows) parts, sizes within
    one row of each other."""
    parts = max(1, min(splits, rows))
    return [(c * rows // parts, (c + 1) * rows // parts) for c in range(parts)]


class ChunkedRs(CopyGather):
    """The chunked route of GemmReduceScatter (W > 1), an op of its own inside it (its own
    communicator, error record, symmetric buffer, copy lanes and stream-wait watchdog).

    AllGather's push protocol (allgather.py, module docstring) with a different source for each
    peer: rank p's data region holds, at q * R rows, rank q's partial of p's rows. Call e, each
    chunk in `splits` row parts (fold_bounds; 1 unless folding), part c with chunk flag c, every
    GEMM cuflux.gemm(impl="cublas") unless the op's impl forces one of our cores:
      S: for each peer p in the copy order, for each part: cuflux.gemm(a's rows of it) ->
         staging (this op's private memory); lane(p) follows it (event), guard free[p] >= e-1
         before p's first part (p has summed call e-1, so its rows of us may be overwritten;
         a timeout never releases a guard), copies the part into p's data at me * R + r0 rows,
         raises chunk[me][c] on p;
      S, not folding: cuflux.gemm(a[me*R:(me+1)*R]) straight into our data at me * R rows;
         waits (bounded, watched) for chunk[q][c] >= e of every peer q and part c; rs_sum;
      S, folding (W = 2, fold_route): for each part c: waits for chunk[p][c] >= e, then
         out[r0:r1] = a's own rows of it @ b + the received part (+ bias) by cublasLt
         (launch_cublaslt's addend; where cublasLt has no algorithm for it, e.g. an fp32 output
         with a bias: cuflux.gemm into our data and rs_sum of the part);
      S: free[me] = e on every peer; joins the lanes (their staging is rewritten next call).
    The chunk GEMM for a peer runs while the previous chunk is on the link, and the own chunk,
    last, while the last peer chunk is: only the summing kernel (a read of W partials of R rows,
    a write of one) is not hidden; folding, nothing is but the last part's own GEMM waiting for
    its rows (sent while this rank computed its first own part). Chunks are whole owners' rows
    (one flag a part), so a GEMM never gets fewer than M / (W splits) rows.
    """

    _scratch = ("staging",)  # let go at close() (CommOp._release)

    def __init__(self, world, timeout_s: float, max_rows: int, n: int, dtype, out_dtype,
                 fold: bool = False):
        import cupy

        self.fold = bool(fold) and world.size == 2
        self.splits = FOLD_SPLITS if self.fold else 1
        super().__init__(world, _OP, timeout_s, max_rows, n, out_dtype, mode="push",
                         chunk_rows=-(-max_rows // self.splits), wait="stream")
        assert self.max_chunks >= min(self.splits, max_rows)  # a flag per part
        W = world.size
        self.in_dtype, self.out_dtype, self.n = dtype, out_dtype, n
        self.module = kernels.load(_SRC, world.device)
        kernels.load("gemm.cu", world.device)
        # peers in the copy order (stage by stage), the lane that carries each one
        self.peers = [p for stage in self.order for p in stage]
        self.lane_of = {p: lane for stage in self.order for lane, p in zip(self.lanes, stage)}
        self.ready = {(p, c): cupy.cuda.Event(disable_timing=True)
                      for p in self.peers for c in range(self.splits)}
        with world.device_context():
            self.staging = cupy.empty(((W - 1) * max_rows, n), out_dtype.storage)
        self.data = self.buf.local("data").view(out_dtype.storage).reshape(-1)
        self.sum_name = sum_kernel(dtype.cuda_type, out_dtype.cuda_type)
        self.sum_blocks = SUM_BLOCKS_PER_SM * self.num_sms

    def refuse_capture(self, s) -> None:
        """Before anything of a call is queued or allocated on `s` (GemmReduceScatter calls it
        first): the route cannot run inside a CUDA graph."""
        self._no_capture(s, "route='chunked' counts its call epochs on the host (copy engines "
                            "gated by stream waits); build the op with route='auto' to capture")

    def _sum(self, first_row: int, rows: int, R: int, bias, out, s) -> None:
        """rs_sum of rows [first_row, first_row + rows) of this rank's R: the W slots of our
        data region (R rows apart) into out."""
        n = self.n
        elems = rows * n
        vecs = elems * self.out_dtype.itemsize // 16
        grid = max(1, min(-(-vecs // SUM_THREADS), self.sum_blocks))
        data = self.data if first_row == 0 else self.data[first_row * n:]
        kernels.launch(self.module[self.sum_name], (grid,), (SUM_THREADS,),
                       (data, np.int64(elems), np.int64(R * n), np.int32(self.world.size),
                        np.int32(n), bias if bias is not None else np.uint64(0), out),
                       s, op=_OP, name=self.sum_name)

    def _slot(self, q: int, R: int, r0: int, r1: int):
        """Rows [r0, r1) of rank q's partial of our R rows, in our data region (slot q)."""
        n = self.n
        return self.data[(q * R + r0) * n:(q * R + r1) * n].reshape(r1 - r0, n)

    def run(self, a, b, bias, out, M: int, s, b_layout: str, impl: str) -> None:
        """One call (arguments checked by GemmReduceScatter, M agreed, 1 <= M <= max_m, the
        stream not capturing: refuse_capture)."""
        from cupy.cuda import runtime

        W, me, n, k = self.world.size, self.world.rank, self.n, a.shape[1]
        R = M // W
        parts = fold_bounds(R, self.splits)
        e = self._next_epoch(s if self._last_stream is None else self._last_stream)
        self._last_stream = s  # abort() and close() look at it
        rb = self.row_bytes
        impl = "cublas" if impl == "auto" else impl  # the route hides the links behind cuBLAS
        # An fp32 output with a bias has no cublasLt algorithm (the bias would have to be fp32)
        folds = self.fold and (bias is None or self.out_dtype.name != "float32")

        # each own part: its rows of a, of out, the peer's received part (views made once)
        # and its row count
        own = [(a[me * R + r0:me * R + r1], out[r0:r1], self._slot(self.peers[0], R, r0, r1),
                r1 - r0) for r0, r1 in parts] if folds else []

        def fold_part(c, launch, **kw):  # own rows of part c @ b + peer's part, into out
            a_own, out_own, received, rows = own[c]
            return launch(a_own, b, bias, out_own, self.in_dtype, self.out_dtype, rows, n, k,
                          b_layout, s, addend=received, **kw)

        # the own parts' plans made and tuned now, while nothing waits for a peer (a timing
        # reads the received rows before they land: no use)
        for c in range(len(own)):
            fold_part(c, core.prepare_cublaslt)
        for j, p in enumerate(self.peers):
            lane = self.lane_of[p]
            for c, (r0, r1) in enumerate(parts):
                chunk = self.staging[j * R + r0:j * R + r1]
                gemm(a[p * R + r0:p * R + r1], b, out=chunk, b_layout=b_layout, impl=impl,
                     stream=s)
                ready = self.ready[p, c]
                ready.record(s)
                lane.wait_event(ready)
                if e > 1 and c == 0:  # p's sum of call e-1 read its rows of us: a late p's
                    self._guard(lane, "free", e - 1, p)  # are never overwritten
                runtime.memcpyAsync(self.buf.ptr(p, "data", (me * R + r0) * rb), chunk.data.ptr,
                                    (r1 - r0) * rb, _MEMCPY_DEFAULT, lane.ptr)
                driver.stream_write_value32(lane, self._chunk_flag(p, me, c), e)
        if folds:
            (p,) = self.peers
            for c, (r0, r1) in enumerate(parts):
                self._wait(s, "chunk", e, p, index0=p * self.max_chunks + c)
                # tuned before the call's first wait (above): never behind a peer
                if not fold_part(c, core.launch_cublaslt, tune=False):
                    gemm(a[me * R + r0:me * R + r1], b, out=self._slot(me, R, r0, r1),
                         b_layout=b_layout, impl=impl, stream=s)
                    self._sum(r0, r1 - r0, R, bias, out[r0:r1], s)
        else:
            gemm(a[me * R:(me + 1) * R], b, out=self._slot(me, R, 0, R), b_layout=b_layout,
                 impl=impl, stream=s)
            for p in self.peers:  # the own chunk is ordered by the stream: no flag, no wait
                for c in range(len(parts)):
                    self._wait(s, "chunk", e, p, index0=p * self.max_chunks + c)
            self._sum(0, R, R, bias, out, s)
        self.release(s)
        self._join_guarded(s, self.lanes)


# ---- the op -------------------------------------------------------------------------------------
class GemmReduceScatter(CommOp):
    """out [M / W, n] = rows [r * M / W, (r + 1) * M / W) of sum over ranks of a @ b (+ bias).

    Args:
      world: cuflux.World.
      max_m: largest M any call will use (M <= max_m, M % world.size == 0).
      n: columns of b and of the output (multiple of 8).
      k: this rank's slice of K (multiple of 8; may differ between ranks).
      dtype: bfloat16 or float16 (a, b, bias).
      out_dtype: dtype (default) or float32; partials travel in it.
      b_layout: "kn" (b is [k, n]) or "nk" (b is [n, k], a Linear weight).
      reduce: "deterministic" (per-source slots, fp32 sum in rank order, bit-identical run to
        run) or "atomic" (red.add into one accumulator; NVLink / one shared GPU only).
      timeout_s: bound of every wait; on expiry CommTimeoutError (at synchronize() or the next
        call), after which the op must be closed (its buffers may hold a partial call).
      impl: "auto" (Hopper core on sm_90a, else portable), "sm90" or "sm80".
      config: Hopper tile configuration, one of SM90_RS_CONFIGS (default SM90_RS_DEFAULT).
      w1: what a call runs at W = 1, where nothing moves: "gemm" (default: the plain GEMM,
        cuflux.gemm, with the tuner's choice unless config is given) or "fused" (the fused
        kernel itself, flags and all; tests and benchmarks compare it with the plain GEMM).
        Ignored at W > 1.
      route: at W > 1, "auto" (default: unfused below UNFUSED_BELOW_M rows, fused from
        there), "fused" (always the fused kernel), "unfused" (always cuflux.gemm into a
        partial, then reduce_scatter) or "chunked" (cuflux.gemm, i.e. cuBLAS unless impl
        forces one of our cores, in owner chunks, each peer's sent by copy engines while the next
        computes: ChunkedRs; reduce="deterministic" only, not capturable; beside the fused
        route's buffer of 2 max_m rows, which reduce_scatter() keeps using, it holds a data
        region of max_m rows and a staging of (W-1) max_m / W rows). At W = 2 with a small k
        it folds the sum into its own GEMMs (op.fold; fold_route says when).
      fold: route="chunked" only: None (default: by k, fold_route), True (fold; W = 2,
        impl="auto" and the cublasLt route only) or False (the summing kernel).
        `plan(M)` says what a call with M rows runs.

    Calls of one op must be ordered on each rank (one stream, or streams the caller orders),
    and every rank must make the same calls with the same M. The call epoch lives on the
    device (rs_hooks.cuh), so calls can be captured in a CUDA graph and replayed (every rank
    replaying its graph as it would make the calls); an M not seen before is compared across
    ranks at capture time. A graph holds the op's buffers: replay it only while the op is open,
    and on the stream it was captured on (close() and abort() look at that stream, not at one a
    replay was launched on). The constructor is collective; close() too.
    """

    ACROSS = "GemmReduceScatterAcrossNodes"  # several nodes: CommOp.__new__
    _scratch = ("_partial",)  # the unfused route's partial (up to max_m x n): let go at close()

    def __init__(self, world, max_m: int, n: int, k: int, dtype, out_dtype=None,
                 b_layout: str = "kn", reduce: str = "deterministic",
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 impl: str = "auto", config: str | None = None, w1: str = "gemm",
                 route: str = "auto", fold: bool | None = None):
        dt = dtype_info(dtype, core.IN_DTYPES, _OP)
        odt = dtype_info(out_dtype if out_dtype is not None else dt.name,
                         (dt.name, "float32"), _OP)
        W = world.size
        core.check_b_layout(b_layout, _OP)
        if reduce not in REDUCE_MODES:
            raise ValueError(f"{_OP}: reduce must be one of {REDUCE_MODES}, got {reduce!r}")
        if impl not in ("auto", "sm90", "sm80"):
            raise ValueError(f"{_OP}: impl must be 'auto', 'sm90' or 'sm80', got {impl!r}")
        if config is not None and config not in SM90_RS_CONFIGS:
            raise ValueError(f"{_OP}: config must be one of {SM90_RS_CONFIGS}, got {config!r}")
        if w1 not in W1_MODES:
            raise ValueError(f"{_OP}: w1 must be one of {W1_MODES}, got {w1!r}")
        check_route(_OP, route, RS_ROUTES)
        if route == "chunked" and reduce != "deterministic":
            raise ValueError(f"{_OP}: route='chunked' sums the partials in rank order "
                             f"(reduce='deterministic'); got reduce={reduce!r}")
        if not (fold is None or isinstance(fold, (bool, np.bool_))):
            raise ValueError(f"{_OP}: fold must be None, True or False, got {fold!r}")
        fold = None if fold is None else bool(fold)
        if fold is not None and route != "chunked":
            raise ValueError(f"{_OP}: fold is route='chunked''s choice; got route={route!r}")
        check_timeout(_OP, timeout_s)
        max_m = count(_OP, "max_m", max_m, W, MAX_DIM,
                      f"the GEMM's M: world size {W} * the rows each rank receives")
        n = count(_OP, "n", n, 8, MAX_DIM // 8 * 8, "output columns; rows move in 16-byte pieces",
                  8)
        k = count(_OP, "k", k, 8, MAX_DIM // 8 * 8,
                  "this rank's slice of K; rows move in 16-byte pieces", 8)
        require_world_device(world, _OP)
        world.check_same((int(max_m), int(n), dt.name, odt.name, b_layout, reduce, impl, config,
                          route, fold),
                         f"{_OP} arguments (max_m, n, dtype, out_dtype, b_layout, reduce, impl, "
                         f"config, route, fold)")
        # Decided together, so that every rank raises (or none does) before the collective
        # allocation, and every rank runs kernels of one tile geometry (tile flags are indexed
        # by it): the Hopper core only where every rank is on sm_90a.
        links = world.topology.links
        hopper = impl != "sm80" and kernels.device_arch(world.device) == "sm_90a"
        problem = None
        if impl == "sm90" and not hopper:
            problem = "impl='sm90' needs an sm_90a device (Hopper) on every rank"
        over_pcie = [l.peer for l in links if l.link == "pcie"]
        if reduce == "atomic" and over_pcie:
            problem = (f"reduce='atomic' needs peer atomics, which PCIe links do not carry (rank "
                       f"{world.rank} reaches {over_pcie} over PCIe); use reduce='deterministic'")
        everyone = world.allgather((problem, hopper, int(k), knobs.gemm_cublaslt()))
        problems = sorted({p for p, *_ in everyone if p})
        if problems:
            raise ValueError(f"{_OP}: " + "; ".join(problems))
        self.world, self.dtype, self.out_dtype = world, dt, odt
        self.max_m, self.n, self.k = int(max_m), int(n), int(k)
        self.b_layout, self.reduce, self.atomic = b_layout, reduce, reduce == "atomic"
        self.impl = "sm90" if all(h for _, h, *_ in everyone) else "sm80"
        # route="chunked" at W = 2: whether its chunks fold (fold_route), from every rank's k
        self.fold = route == "chunked" and fold_route(  # (every rank raises alike: the same
            W, [kk for _, _, kk, _ in everyone], odt.itemsize, impl,  # agreed arguments)
            all(lt for *_, lt in everyone), fold)
        self._impl_arg = impl  # the unfused route's GEMM: "auto" lets cuflux.gemm take cuBLAS
        self.config = config or SM90_RS_DEFAULT
        self._config_given = config is not None  # W = 1: else the GEMM's tuner picks
        self.w1, self.route = w1, route
        self._closed = True  # until the buffers exist
        super().__init__(world, _OP, timeout_s)
        sms, sharing = self.num_sms, self.sharers
        # Waiting CTAs must not keep a peer's CTAs from running: the persistent grids stay
        # co-resident even when the ranks sharing this GPU run side by side (MPS).
        self.max_ctas = {"sm90": max(1, sms // sharing),
                         "sm80": max(1, core.SM80.ctas_per_sm * sms // sharing),
                         "copy": max(1, sms // sharing)}
        self.layout = make_layout(W, self.max_m, self.n, odt, reduce)
        regions = self.layout.regions
        self._data_off, self._flags_off = regions["data"].offset, regions["flags"].offset
        self.flag_stride = regions["flags"].shape[1]
        rows_max = self.max_m // W
        self._slot_bytes = rows_max * self.n * odt.itemsize  # one source rank's slot
        self._parity_bytes = regions["data"].num_bytes // 2
        self._alloc(self.layout)
        # Eager: nothing may load a module while a peer's kernel waits on this rank.
        self.module = kernels.load(_SRC, world.device)
        if W == 1 or route != "fused":
            kernels.load("gemm.cu", world.device)
        # The call epoch: [calls completed, CTAs finished this call] (rs_hooks.cuh), u64 epochs
        # that never wrap (no re-arm). Zeroed before any stream can read it (zeros_settled): a
        # pooled block still holding a count would make the first call wait for an epoch never
        # sent.
        # The unfused route's partial: one buffer of the op's (calls are ordered on a rank, and
        # only this rank reads it), never a per-call temporary, which a captured graph would
        # keep using after the pool handed it to someone else. Rows: every M the route can
        # take unfused (auto: below UNFUSED_BELOW_M).
        partial_rows = (max_unfused_m(route, self.max_m) if W > 1 and route != "chunked"
                        else 0)
        with world.device_context():
            self.state = zeros_settled(2, np.uint64)
            self._partial = zeros_settled((partial_rows, self.n), odt.storage)
        self._static_args()
        # Last (a constructor failing in it leaves nothing of its own): collective, every rank
        # agreed the route above.
        if route == "chunked" and W > 1:  # its copy lanes and events on the op's device
            with world.device_context():
                self._chunked = ChunkedRs(world, timeout_s, self.max_m // W, self.n, dt, odt,
                                          fold=self.fold)
        self._closed = False

    _chunked = None  # route="chunked" at W > 1: its ChunkedRs

    def plan(self, M: int) -> str:
        """What a call whose a has M rows runs: "gemm" (W = 1, w1="gemm": the plain GEMM),
        "fused" (the fused kernel), "unfused" (cuflux.gemm into a partial, then
        reduce_scatter) or "chunked" (ChunkedRs). The same on every rank (a function of M and
        the agreed route)."""
        if self.world.size == 1:
            return "fused" if self.w1 == "fused" else "gemm"
        return "chunked" if self.route == "chunked" else fused_route(self.route, M)

    # ---- checks -------------------------------------------------------------------------------
    def _check_rows(self, M: int, what: str) -> None:
        W = self.world.size
        if M % W:
            raise ValueError(f"{_OP}: {what} has M={M} rows, which is not divisible by the world "
                             f"size {W} (rank r receives rows [r*M/{W}, (r+1)*M/{W})); pad it "
                             f"with zero rows to a multiple of {W}")
        if M > self.max_m:
            raise ValueError(f"{_OP}: {what} has M={M} rows, more than max_m={self.max_m}")

    def _check_common(self, M, bias, out, stream=None):
        op, dev, W = _OP, self.world.device, self.world.size
        if bias is not None:
            bias = as_cupy(bias, "bias", op)
            check_array(bias, name="bias", op=op, shape=(self.n,), dtype=self.dtype, device=dev)
            if bias.data.ptr % 16:
                raise ValueError(f"{op}: bias must start at a 16-byte aligned address "
                                 f"(got {bias.data.ptr:#x})")
        if out is None:
            import cupy

            # From the pool arena of the stream that writes it (see gemm._check_args).
            with stream if stream is not None else contextlib.nullcontext():
                out = cupy.empty((M // W, self.n), dtype=self.out_dtype.storage)
        else:
            out = as_cupy(out, "out", op)
            check_array(out, name="out", op=op, shape=(M // W, self.n), dtype=self.out_dtype,
                        device=dev)
            if out.data.ptr % 16:
                raise ValueError(f"{op}: out must start at a 16-byte aligned address "
                                 f"(got {out.data.ptr:#x})")
        return bias, out

    def check_call(self, a, b, bias=None, out=None, stream=None):
        """Validate a call's arguments (before any launch); return (a, b, bias, out, M)."""
        op, dev = _OP, self.world.device
        a = as_cupy(a, "a", op)
        check_array(a, name="a", op=op, ndim=2, dtype=self.dtype, device=dev)
        M = a.shape[0]
        if a.shape[1] != self.k:
            raise ValueError(f"{op}: a must be [M, k={self.k}], got {tuple(a.shape)}")
        b = as_cupy(b, "b", op)
        want = (self.k, self.n) if self.b_layout == "kn" else (self.n, self.k)
        check_array(b, name="b", op=op, ndim=2, dtype=self.dtype, device=dev)
        if tuple(b.shape) != want:
            lay = "[k, n]" if self.b_layout == "kn" else "[n, k]"
            raise ValueError(f"{op}: b (layout {self.b_layout!r}) must be {lay} = {want}, got "
                             f"{tuple(b.shape)}")
        self._check_rows(M, "a")
        core.check_aligned(op, a=a, b=b)
        bias, out = self._check_common(M, bias, out, stream)
        return a, b, bias, out, M

    def check_partial(self, partial, bias=None, out=None, stream=None):
        """Validate reduce_scatter's arguments; return (partial, bias, out, M)."""
        partial = as_cupy(partial, "partial", _OP)
        check_array(partial, name="partial", op=_OP, ndim=2, dtype=self.out_dtype,
                    device=self.world.device)
        M = partial.shape[0]
        if partial.shape[1] != self.n:
            raise ValueError(f"{_OP}: partial must be [M, n={self.n}], got {tuple(partial.shape)}")
        self._check_rows(M, "partial")
        if partial.data.ptr % 16:
            raise ValueError(f"{_OP}: partial must start at a 16-byte aligned address")
        bias, out = self._check_common(M, bias, out, stream)
        return partial, bias, out, M

    # ---- launches -------------------------------------------------------------------------------
    def _static_args(self) -> None:
        """The parts of _tail that never change (no epoch among them: the kernels read it from
        self.state), built once: small calls are host-bound."""
        self._args_f32 = np.int32(self.out_dtype.name == "float32")
        self._args_buf = (self.buf.ptrs_dev, np.uint64(self._data_off),
                          np.uint64(self._parity_bytes), np.uint64(self._slot_bytes),
                          np.uint64(self._flags_off), np.int32(self.flag_stride))
        self._args_ranks = (np.int32(self.world.size), np.int32(self.world.rank))
        self._args_end = (np.int32(GROUP_M), self.state) + self.err_args

    def _tail(self, out, bias, M: int, bm: int) -> tuple:
        """The kernels' trailing arguments (gemm_rs.cu RsArgs) for the next call."""
        W, me = self.world.size, self.world.rank
        own_lo, own_hi = own_tile_rows(M, W, me, bm)
        return ((out, self._args_f32, bias if bias is not None else np.uint64(0))
                + self._args_buf + (np.int32(M // W),) + self._args_ranks
                + (np.int32(own_lo), np.int32(own_hi)) + self._args_end)

    def _launch_fused(self, a, b, bias, out, M: int, stream) -> None:
        dt, n, k = self.dtype, self.n, self.k
        transposed = self.b_layout == "kn"
        if self.impl == "sm90":
            cfg = core.SM90_CONFIGS[self.config]
            name = sm90_kernel(dt.cuda_type, self.config, transposed, self.atomic)
            fn = self.module[name]
            core.prepare(fn, cfg.smem_bytes)
            tma_a = core.tensor_map(a.data.ptr, M, k, 64, cfg.bm, dt)
            tma_b = (core.tensor_map(b.data.ptr, k, n, 64, 64, dt) if transposed
                     else core.tensor_map(b.data.ptr, n, k, 64, cfg.bn, dt))
            tiles = -(-M // cfg.bm) * -(-n // cfg.bn)
            args = (tma_a, tma_b, np.int32(M), np.int32(n), np.int32(k)) + \
                self._tail(out, bias, M, cfg.bm)
            kernels.launch(fn, (min(tiles, self.max_ctas["sm90"]),), (384,), args, stream,
                           op=_OP, name=name, shared_mem=cfg.smem_bytes)
        else:
            name = sm80_kernel(dt.cuda_type, transposed, self.atomic)
            fn = self.module[name]
            sm80 = core.SM80
            core.prepare(fn, sm80.smem_bytes)
            tiles = -(-M // sm80.bm) * -(-n // sm80.bn)
            args = (a, b, np.int32(M), np.int32(n), np.int32(k)) + \
                self._tail(out, bias, M, sm80.bm)
            kernels.launch(fn, (min(tiles, self.max_ctas["sm80"]),), (sm80.threads,), args,
                           stream, op=_OP, name=name, shared_mem=sm80.smem_bytes)

    # ---- calls ------------------------------------------------------------------------------
    def __call__(self, a, b, bias=None, out=None, stream=None):
        """a [M, k], b [k, n] ("kn") or [n, k] ("nk"), bias [n] or None -> out [M / W, n].

        out: optional output array (else allocated). stream: CuPy stream, raw handle or torch
        stream (default: the current stream of a's framework, CuPy's or torch's). Returns out
        (a torch tensor for a torch a, else a CuPy array). At W = 1 (the plain GEMM) a call
        with no bias seen before (CuPy arrays or torch tensors; out= given or left to the op)
        replays cuflux.gemm's launch (base.CallMemo).
        """
        key = None
        if bias is None and self.world.size == 1:
            memo = self._memo
            if (out is None and not self._closed and memo.owns(a, b) and a.ndim == 2
                    and a.shape[0] <= self.max_m):  # out before the key: see CallMemo
                out = memo.output((a.shape[0], self.n), self.out_dtype.storage, stream, like=a)
            key = memo.key((a, b, out), self.w1) if out is not None else None
            run = memo.get(key)
            if run is not None:
                self._check_open()
                if self._replayed(run, stream, a):  # False: no cuBLAS workspace there yet
                    return out
        return self._call(a, b, bias, out, stream, key)

    def _gemm_args(self):
        """(impl, config) of the plain GEMM this op runs (route "gemm")."""
        return self.impl, self.config if self.impl == "sm90" and self._config_given else None

    @on_op_device
    def _call(self, a, b, bias, out, stream, key):
        self._check_open()
        a_in, out_in = a, out  # the caller's: torch in, torch out
        given = out is not None
        s = stream_of(stream, a_in)
        if self._chunked is not None:  # every call of the op takes the route (W > 1)
            self._chunked.err.check()
            self._chunked.refuse_capture(s)
        a, b, bias, out, M = self.check_call(a, b, bias, out, s)
        if given:
            check_no_alias(_OP, out, a=a, b=b, bias=bias)
        if self.world.size > 1 and M not in self._agreed:
            self._agree(M, "M of the call")
        if M == 0:  # every rank has M = 0 (M must agree): nothing to do, no epoch
            return to_caller(out, a_in, out_in)
        self._last_stream = s
        route = self.plan(M)
        if route == "gemm":
            impl, config = self._gemm_args()
            gemm(a, b, bias=bias, out=out, b_layout=self.b_layout, impl=impl, stream=s,
                 config=config)
            if self._memo.wants(key):  # gemm's memo bound the same call at its second, too
                replay = gemm_replay(a, b, out, self.b_layout, impl, config)
                if replay is not None:
                    self._memo.put(key, replay)
            return to_caller(out, a_in, out_in)
        if route == "fused":
            self._launch_fused(a, b, bias, out, M, s)
        elif route == "chunked":
            self._chunked.run(a, b, bias, out, M, s, self.b_layout, self._impl_arg)
        else:  # cuflux.gemm's own choice (cuBLAS at small M), then the op's reduce-scatter
            partial = gemm(a, b, out=self._partial[:M], b_layout=self.b_layout,
                           impl=self._impl_arg, stream=s)
            self._reduce_scatter(partial, bias, out, M, s)
        return to_caller(out, a_in, out_in)

    @on_op_device
    def reduce_scatter(self, partial, bias=None, out=None, stream=None):
        """The comm-only reduce-scatter: partial [M, n] (this rank's C, in out_dtype, e.g. from
        cuBLAS) -> out [M / W, n] = sum over ranks of their partials' rows of this rank
        (+ bias), with this op's reduce mode, buffers and flags. The unfused baseline."""
        self._check_open()
        p_in, out_in = partial, out  # the caller's: torch in, torch out
        given = out is not None
        s = stream_of(stream, p_in)
        partial, bias, out, M = self.check_partial(partial, bias, out, s)
        if given:
            check_no_alias(_OP, out, partial=partial, bias=bias)
        if self.world.size > 1 and M not in self._agreed:
            self._agree(M, "M of the call")
        if M == 0:
            return to_caller(out, p_in, out_in)
        self._last_stream = s
        self._reduce_scatter(partial, bias, out, M, s)
        return to_caller(out, p_in, out_in)

    # ---- lifetime (route="chunked": its ChunkedRs too) -----------------------------------------
    @on_op_device
    def synchronize(self, stream=None) -> None:
        if self._chunked is not None:  # its lanes, and its failed waits
            self._chunked.synchronize(stream)
        super().synchronize(stream)

    def _free(self) -> None:
        """close() closes the chunked route's op with it (collective, bounded); abort() (the
        abort word set) aborts it."""
        inner = self._chunked
        if inner is not None:
            if int(self.err.words[ABORT]):
                inner.abort()
            else:
                inner.close()

    def _reduce_scatter(self, partial, bias, out, M: int, s) -> None:
        name = copy_kernel(self.dtype.cuda_type, self.out_dtype.cuda_type, self.atomic)
        tiles = -(-M // COPY_TILE[0]) * -(-self.n // COPY_TILE[1])
        args = (partial, np.int32(M), np.int32(self.n)) + self._tail(out, bias, M, COPY_TILE[0])
        kernels.launch(self.module[name], (min(tiles, self.max_ctas["copy"]),), (COPY_THREADS,),
                       args, s, op=_OP, name=name)
