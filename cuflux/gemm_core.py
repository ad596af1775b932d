"""The GEMM cores on the host side: tile configurations, TMA descriptors, launches, cuBLAS.

What cuflux.gemm and the fused ops (GemmReduceScatter, AllGatherGemm) share, under public
names: the Hopper configurations (`Sm90Config`, `SM90_CONFIGS`), the portable core's one tile
(`SM80`, mirror of kernels_cu/include/cuflux/gemm_sm80.cuh `sm80::kTile*`), the operand checks,
`tensor_map` (a CUtensorMap as kernel-argument bytes), `prepare` (a kernel's shared-memory
opt-in), `max_ctas` (co-resident CTAs of a persistent grid), the plain GEMM's launches
(`launch_sm90`, `launch_sm80`) and the cuBLAS route (`launch_cublas`). It registers
kernels_cu/gemm.cu, the plain GEMM's kernels. Which configuration a call takes is the tuner's
business (cuflux/gemm_tuner.py); argument checks and the public call are cuflux/ops/gemm.py.

Per-call host cost matters here (the plain GEMM's whole host path is ~10 us): device
properties, descriptors, shared-memory opt-ins and cluster occupancy are cached at module level
on first use; nothing is imported inside the per-call functions after their first call.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
import weakref

import numpy as np

from cuflux import kernels, knobs
from cuflux.launch import (GraphReplay, capturing, current_device, graph_replay,
                           private_capture_stream)
from cuflux.arrays import as_cupy, check_array

__all__ = ["Sm90Config", "SM90_CONFIGS", "SM90_DEFAULT", "Sm80Config", "SM80", "SM80_CONFIG",
           "IN_DTYPES", "B_LAYOUTS", "check_b_layout", "OUT_KIND", "CUDA_TYPE", "FAMILY",
           "sm80_kernel", "check_aligned", "check_bias", "device_props", "tensor_map", "prepare",
           "max_ctas", "cluster_resident_ctas", "launch_sm90", "launch_sm80", "launch_cublas",
           "launch_cublaslt", "prepare_cublaslt", "LtPlan", "ALGO_CANDIDATES",
           "ALGO_TUNE_MIN_FLOP", "cupy_module", "grouped_tile", "WORKSPACE_BYTES"]

_OP = "cuflux.gemm"
IN_DTYPES = ("bfloat16", "float16")
B_LAYOUTS = ("kn", "nk")  # b is [K, N] (row-major weights as stored) or [N, K] (nn.Linear's)
OUT_KIND = {"bfloat16": 0, "float16": 1, "float32": 2}  # gemm_hooks.cuh out_kind
CUDA_TYPE = {"bfloat16": "__nv_bfloat16", "float16": "__half"}


def check_b_layout(b_layout, op: str) -> None:
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"{op}: b_layout must be 'kn' (b is [K, N]) or 'nk' (b is [N, K]), "
                         f"got {b_layout!r}")


def check_group_m(group_m, op: str) -> None:
    if type(group_m) is not int or group_m < 1:
        raise ValueError(f"{op}: group_m must be an int >= 1, got {group_m!r}")


# ---- tile configurations ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sm90Config:
    """One instantiation of the Hopper core: tile bm x bn (x 64), stages, CTAs per cluster,
    whether bf16/fp16 outputs leave through shared memory and TMA stores (name suffix "t"), and
    whether the two consumer warpgroups take alternate whole tiles instead of sharing each one
    (ping-pong, suffix "p": one warpgroup's epilogue overlaps the other's main loop)."""

    bm: int
    bn: int
    stages: int
    cluster: int
    tma_store: bool = False
    pingpong: bool = False

    def __post_init__(self):
        # Mirrors sm90::Config's static_asserts: one warpgroup holds a whole bm x bn fp32
        # accumulator (bm / 64 * bn / 2 registers a thread, at most 128 of its 232), and the
        # TMA-store staging is sized for two warpgroups sharing a tile.
        if self.pingpong and (self.bm // 64 * self.bn // 2 > 128 or self.tma_store):
            raise ValueError(f"ping-pong needs bm * bn <= 128 * 128 and no TMA store: {self}")

    @property
    def name(self) -> str:
        return (f"{self.bm}x{self.bn}s{self.stages}c{self.cluster}"
                + ("t" if self.tma_store else "") + ("p" if self.pingpong else ""))

    @property
    def smem_bytes(self) -> int:  # mirrors sm90::Config::kSmemBytes
        wg_rows = self.bm // 2
        epi = 2 * (2 if wg_rows == 64 else 1) * wg_rows * 128 if self.tma_store else 0
        return self.stages * (self.bm + self.bn) * 64 * 2 + epi + 2 * self.stages * 8 + 1024

    def kernel(self, cuda_type: str, transposed: bool) -> str:
        # kPingpong is a defaulted template argument: named only where it is set.
        return (f"gemm_sm90<{cuda_type}, {self.bm}, {self.bn}, {self.stages}, {self.cluster}, "
                f"{'true' if transposed else 'false'}, {'true' if self.tma_store else 'false'}"
                + (", true>" if self.pingpong else ">"))


SM90_CONFIGS = {c.name: c for c in (
    Sm90Config(128, 256, 4, 1), Sm90Config(128, 256, 4, 2), Sm90Config(256, 128, 4, 1),
    Sm90Config(256, 128, 4, 2),
    Sm90Config(128, 128, 6, 1), Sm90Config(256, 128, 4, 1, True), Sm90Config(128, 256, 4, 1, True),
    # ping-pong (v4): 7 stages of 32 KB fill shared memory (230,512 bytes of 232,448)
    Sm90Config(128, 128, 7, 1, pingpong=True))}
# The TMA-store 256x128 is the fastest or within 0.01 of it on all ten bar cases, timed
# interleaved with cuBLAS (docs/gemm_notes.md, v5).
SM90_DEFAULT = "256x128s4c1t"


@dataclasses.dataclass(frozen=True)
class Sm80Config:
    """The portable core's tile: bm x bn x bk, stages, a CTA of warps_m x warps_n warps,
    ctas_per_sm resident (the kernels' __launch_bounds__)."""

    bm: int
    bn: int
    bk: int
    stages: int
    warps_m: int
    warps_n: int
    ctas_per_sm: int

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}s{self.stages}"

    @property
    def threads(self) -> int:  # sm80::Config::kThreads
        return 32 * self.warps_m * self.warps_n

    @property
    def smem_bytes(self) -> int:  # sm80::Config::kSmemBytes (2-byte inputs)
        return self.stages * (self.bm + self.bn) * self.bk * 2


# The one tile of the portable core, in gemm.cu, gemm_rs.cu and ag_gemm.cu alike: the mirror
# of gemm_sm80.cuh's kTileM, kTileN, kTileK, kTileStages, kTileWarpsM, kTileWarpsN,
# kTileCtasPerSm (tests/test_gemm.py reads the header and compares).
SM80 = Sm80Config(bm=128, bn=128, bk=32, stages=4, warps_m=2, warps_n=4, ctas_per_sm=2)
SM80_CONFIG = SM80.name  # "128x128x32s4"


def sm80_kernel(cuda_type: str, transposed: bool) -> str:
    return f"gemm_sm80<{cuda_type}, {'true' if transposed else 'false'}>"


def _names() -> list[str]:
    names = []
    for t in CUDA_TYPE.values():
        for tr in (False, True):
            names += [c.kernel(t, tr) for c in SM90_CONFIGS.values()]
            names.append(sm80_kernel(t, tr))
    return names


FAMILY = kernels.register("gemm.cu", _names(), min_arch=80)


# ---- operand checks -----------------------------------------------------------------------------
def check_aligned(op: str, **arrays) -> None:
    """Operands move in 16-byte pieces (TMA, cp.async): each must start 16-byte aligned."""
    for name, x in arrays.items():
        if x.data.ptr % 16:
            raise ValueError(f"{op}: {name} must start at a 16-byte aligned address "
                             f"(got {x.data.ptr:#x})")


def check_bias(op: str, bias, n: int, dtype, device):
    """bias [n] of the input dtype, read in pairs: 4-byte aligned. Returns it as CuPy (or None)."""
    if bias is None:
        return None
    bias = as_cupy(bias, "bias", op)
    check_array(bias, name="bias", op=op, shape=(n,), dtype=dtype, device=device)
    if bias.data.ptr % 4:
        raise ValueError(f"{op}: bias must start at a 4-byte aligned address")
    return bias


_PROPS: dict[int, tuple] = {}



_GEMM_FNS: dict = {}


def _gemm_fn(name: str):
    """gemm.cu's kernel `name` on the current device (kernels.load once per device)."""
    dev = current_device()
    fn = _GEMM_FNS.get((dev, name))
    if fn is None:
        fn = _GEMM_FNS[(dev, name)] = kernels.load("gemm.cu", dev)[name]
    return fn


def device_props(dev: int | None = None):
    """(device id, NVRTC arch, SM count, GPU name) of the current device, queried once per
    device: getDeviceProperties alone costs 0.7 ms (it was 1.4 ms of every call)."""
    if dev is None:
        dev = current_device()
    props = _PROPS.get(dev)
    if props is None:
        from cupy.cuda import runtime

        name = runtime.getDeviceProperties(dev)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        props = _PROPS[dev] = (dev, kernels.device_arch(dev), runtime.deviceGetAttribute(
            runtime.cudaDevAttrMultiProcessorCount, dev), name)
    return props


def grouped_tile(r: int, rows: int, tiles_n: int, group_m: int) -> tuple[int, int]:
    """(tile row within the walk, tile column) of position r of a walk over `rows` tile rows in
    L2 groups of group_m rows: mirror of gemm_hooks.cuh grouped_tile, which every tile scheduler
    uses (for the CPU tests of the tile orders)."""
    group, in_group = divmod(r, group_m * tiles_n)
    first = group * group_m
    n = min(group_m, rows - first)
    return first + in_group % n, in_group // n


# ---- TMA descriptors -------------------------------------------------------------------------------
_TMAP_CACHE: "collections.OrderedDict[tuple, bytes]" = collections.OrderedDict()
_TMAP_LOCK = threading.Lock()


_TMAP_DTYPE = {"float16": 6, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / BFLOAT16
_SWIZZLE_128B, _L2_PROMOTION_256B = 3, 3


def tensor_map(ptr: int, rows: int, cols: int, box_cols: int, box_rows: int, dt) -> bytes:
    """128-byte CUtensorMap of a row-major [rows, cols] matrix, 128-byte swizzle, zero fill,
    as the bytes a kernel takes by value. Cached per (pointer, geometry); a miss encodes it
    through libcuda directly (~2 us)."""
    key = (ptr, rows, cols, box_cols, box_rows, dt.name)
    hit = _TMAP_CACHE.get(key)
    if hit is not None:
        return hit
    import ctypes

    from cuflux.launch import driver_lib, error_name

    u64x2, u32x2 = ctypes.c_uint64 * 2, ctypes.c_uint32 * 2
    tmap = (ctypes.c_uint64 * 16)()
    err = driver_lib().cuTensorMapEncodeTiled(
        tmap, _TMAP_DTYPE[dt.name], 2, ptr, u64x2(cols, rows), u64x2(cols * 2, 0),
        u32x2(box_cols, box_rows), u32x2(1, 1), 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    if err:
        raise RuntimeError(f"{_OP}: cuTensorMapEncodeTiled failed ({error_name(err)}) for a "
                           f"[{rows}, {cols}] matrix at {ptr:#x}, box [{box_rows}, {box_cols}]")
    raw = bytes(tmap)
    with _TMAP_LOCK:
        _TMAP_CACHE[key] = raw
        while len(_TMAP_CACHE) > 1024:
            _TMAP_CACHE.popitem(last=False)
    return raw


# ---- launches --------------------------------------------------------------------------------------
_FUNC_READY: dict = {}
_CLUSTERS: dict = {}


def prepare(fn, smem: int) -> None:
    """Opt a loaded kernel into `smem` bytes of dynamic shared memory (once per kernel)."""
    key = id(fn)
    if key not in _FUNC_READY:
        fn.max_dynamic_shared_size_bytes = smem
        _FUNC_READY[key] = True


def max_ctas(fn, cfg: Sm90Config, sm_count: int) -> int:
    """CTAs that are resident at once: one per SM, or whole clusters of cfg.cluster."""
    if cfg.cluster == 1:
        return sm_count
    key = (id(fn), sm_count)
    if key not in _CLUSTERS:
        n = sm_count // cfg.cluster
        try:
            from cuda.bindings import driver as cu

            lc = cu.CUlaunchConfig()
            lc.gridDimX, lc.gridDimY, lc.gridDimZ = n * cfg.cluster, 1, 1
            lc.blockDimX, lc.blockDimY, lc.blockDimZ = 384, 1, 1
            lc.sharedMemBytes = cfg.smem_bytes
            err, got = cu.cuOccupancyMaxActiveClusters(cu.CUfunction(fn.kernel.ptr), lc)
            if err == cu.CUresult.CUDA_SUCCESS and got > 0:
                n = min(n, int(got))
        except Exception:
            pass
        _CLUSTERS[key] = n
    return _CLUSTERS[key] * cfg.cluster


def cluster_resident_ctas(cluster: int = 2) -> list[int]:
    """Resident CTAs max_ctas has assumed so far for clusters of `cluster` CTAs (the benchmark
    records them): cuOccupancyMaxActiveClusters x cluster, per kernel and SM count seen."""
    return sorted(set(v * cluster for v in _CLUSTERS.values()))


def launch_sm90(cfg: Sm90Config, a, b, bias, out, dt, odt, M, N, K, b_layout, stream,
                group_m: int = 8, grid_cap: int | None = None, bind: bool = False):
    """The plain GEMM on the Hopper core in configuration cfg (arguments already checked);
    bind: returns the launch as a kernels.bind Bound (gemm's memo of a call seen before)."""
    sm_count = device_props()[2]
    transposed = b_layout == "kn"
    name = cfg.kernel(dt.cuda_type, transposed)
    fn = _gemm_fn(name)
    prepare(fn, cfg.smem_bytes)
    tma_a = tensor_map(a.data.ptr, M, K, 64, cfg.bm, dt)
    if transposed:
        tma_b = tensor_map(b.data.ptr, K, N, 64, 64, dt)
    else:
        tma_b = tensor_map(b.data.ptr, N, K, 64, cfg.bn // cfg.cluster, dt)
    if cfg.tma_store and odt.itemsize == 2:
        tma_c = tensor_map(out.data.ptr, M, N, 64, cfg.bm // 2, odt)
    else:
        tma_c = tma_a  # not read by the kernel
    tiles_m = -(-M // cfg.bm)
    rows = -(-tiles_m // cfg.cluster)  # the scheduler's rows: clusters of tiles stacked along M
    tiles = rows * cfg.cluster * -(-N // cfg.bn)
    grid = min(tiles, max_ctas(fn, cfg, sm_count))
    if grid_cap is not None:  # benchmarks: a smaller persistent grid (a multiple of the cluster)
        grid = max(cfg.cluster, min(grid, grid_cap // cfg.cluster * cfg.cluster))
    args = (tma_a, tma_b, tma_c, np.int32(M), np.int32(N), np.int32(K), out, np.int64(N),
            _OUT_KIND_ARG[odt.name], bias if bias is not None else _NULL, np.int32(group_m))
    return _launch_or_bind(fn, grid, 384, args, stream, name, cfg.smem_bytes, bind)


def _launch_or_bind(fn, grid, block, args, stream, name, smem, bind):
    """kernels.launch; with bind, the launch bound (kernels.bind) and called, returned as
    its replay (launch.graph_replay: a CUDA graph from the first repeat on)."""
    if not bind:
        kernels.launch(fn, grid, block, args, stream, op=_OP, name=name, shared_mem=smem)
        return None
    bound = kernels.bind(fn, grid, block, args, op=_OP, name=name, shared_mem=smem)
    bound(stream.ptr)
    return graph_replay((bound,), op=_OP, what=f"kernel {name}")


def launch_sm80(a, b, bias, out, dt, odt, M, N, K, b_layout, stream, group_m: int = 8,
                bind: bool = False):
    """The plain GEMM on the portable core (arguments already checked; bind: launch_sm90's)."""
    sm_count = device_props()[2]
    name = sm80_kernel(dt.cuda_type, b_layout == "kn")
    fn = _gemm_fn(name)
    prepare(fn, SM80.smem_bytes)
    tiles = -(-M // SM80.bm) * -(-N // SM80.bn)
    grid = min(tiles, SM80.ctas_per_sm * sm_count)
    args = (a, b, np.int32(M), np.int32(N), np.int32(K), out, np.int64(N),
            _OUT_KIND_ARG[odt.name], bias if bias is not None else _NULL, np.int32(group_m))
    return _launch_or_bind(fn, grid, SM80.threads, args, stream, name, SM80.smem_bytes, bind)


_NULL = np.uint64(0)
_OUT_KIND_ARG = {k: np.int32(v) for k, v in OUT_KIND.items()}


# ---- cuBLAS: where our kernel is slower, gemm calls it instead ------------------------------------
_CUDA_R = {"bfloat16": 14, "float16": 2, "float32": 0}  # cudaDataType
_COMPUTE_32F, _ALGO_DEFAULT, _OP_N, _OP_T = 68, -1, 0, 1
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


_CUPY: list = []


def cupy_module():
    """The cupy module, with its cuBLAS pieces, imported once (an import statement per call
    costs ~0.5 us; gemm's whole host path is ~10 us)."""
    if not _CUPY:
        import cupy
        from cupy.cuda import cublas  # loads libcublas (the ctypes calls below need it)

        _CUPY.extend((cupy, cublas))
    return _CUPY[0]


WORKSPACE_BYTES = 32 << 20  # cuBLAS workspace per stream (split-K and the like need one)
# Streams whose workspace is kept (the ones used last; _Workspaces): a caller that makes a
# new stream per step (or cycles torch's 32 pooled streams) must not pin 32 MiB for each.
WORKSPACES_KEPT = 8


def _loaded_lib(stem: str):
    """ctypes handle of a cuBLAS library by its soname: the copy CuPy's cublas module loaded
    into this process (the CUDA extra's wheel or the system's; libcublasLt comes with
    libcublas)."""
    import ctypes

    cupy_module()
    for name in (f"{stem}.so.13", f"{stem}.so.12", f"{stem}.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError(f"{_OP}: {stem} could not be loaded (install the cuda12 or cuda13 "
                       f"extra)")


def _new_workspace(stream_ptr: int):
    from cuflux.arrays import empty_on

    return empty_on(WORKSPACE_BYTES, _CUPY[0].uint8, stream_ptr)


class _Cublas:
    """cublasGemmEx through ctypes, on a handle of cuflux's own per device with a workspace per
    stream. Why not CuPy's wrapper: it refuses every call while a stream is captured (cuBLAS
    would allocate its workspace inside the graph); with a workspace set beforehand cuBLAS
    captures cleanly, and the direct call is shorter on the host."""

    def __init__(self):
        import ctypes

        lib = _loaded_lib("libcublas")
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32,
                                     vp, vp, i32, i32, i32, i32]
        for f in (lib.cublasCreate_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
                  lib.cublasGemmEx):
            f.restype = i32
        self.lib, self.ctypes = lib, ctypes
        self.handles: dict[int, int] = {}
        # device -> (the stream its handle is set to, that workspace), the workspace held here:
        # never back in the pool while the handle may write it, whatever _Workspaces lets go
        self.set_to: dict[int, tuple] = {}
        self.spaces = _Workspaces(_new_workspace)

    def handle(self, dev: int, stream_ptr: int, under_capture: bool,
               allocate: bool = True) -> int:
        """The device's cuBLAS handle set to stream_ptr and its workspace; 0 where the stream
        has none and none may be made (under capture, or not `allocate`: a replay)."""
        h = self.handles.get(dev)
        if h is None:
            hv = self.ctypes.c_void_p()
            err = self.lib.cublasCreate_v2(self.ctypes.byref(hv))
            if err:
                raise RuntimeError(f"{_OP}: cublasCreate failed ({err})")
            h = self.handles[dev] = hv.value
        # (under capture: the workspace the caller's graph will hold is the kept one, pinned;
        # a stream whose kept workspace is not the one the handle holds, let go meanwhile
        # by the cublasLt route, looks again: made anew, or none under capture)
        on = self.set_to.get(dev)
        if (on is None or on[0] != stream_ptr or under_capture
                or self.spaces.kept((dev, stream_ptr)) is not on[1]):
            ws = self.spaces.get(dev, stream_ptr, under_capture, allocate)
            if ws is None:
                return 0
            if on is not None and on[0] == stream_ptr and on[1] is ws:  # (arrays: no ==)
                return h
            self.set_to.pop(dev, None)
            for what, err in (("cublasSetStream", self.lib.cublasSetStream_v2(h, stream_ptr)),
                              ("cublasSetWorkspace", self.lib.cublasSetWorkspace_v2(
                                  h, ws.data.ptr, WORKSPACE_BYTES))):
                if err:
                    from cuflux.errors import CudaError

                    raise CudaError(f"{_OP}: {what} failed (cublasStatus {err})")
            self.set_to[dev] = (stream_ptr, ws)
        return h

    def workspace(self, dev: int, stream_ptr: int, under_capture: bool):
        """The cuBLAS workspace of (device, stream) (_Workspaces.get). Shared by the GemmEx and
        cublasLt routes (one stream runs one call at a time)."""
        return self.spaces.get(dev, stream_ptr, under_capture)


class _Workspaces:
    """cuBLAS workspaces per (device, stream), each allocated at the stream's first GEMM from
    that stream's pool arena, kept for the WORKSPACES_KEPT streams used last.

    A new stream past them lets go the workspace of the one used longest ago, unless a
    capture used it (a caller's graph holds its pointer: kept for the process). It goes back
    to its own stream's arena (the GemmEx handle's own reference aside, _Cublas.set_to), so
    its memory is reused only in that stream's order, after the GEMMs queued there; that
    stream's next GEMM makes a new one, and its replays (_LtReplay) see the new pointer and
    capture again. A stream let go gets no cuBLAS call under capture until a call outside
    one made it a workspace again."""

    def __init__(self, make):
        self.arrays: collections.OrderedDict = collections.OrderedDict()  # used last: at the end
        self.last = None            # the key used last
        self.captured: set = set()  # keys a capture used: never let go
        self.lock = threading.Lock()  # a new workspace, the one let go
        self.make = make            # stream handle -> a new workspace on the current device

    def get(self, dev: int, stream_ptr: int, under_capture: bool, allocate: bool = True):
        """The workspace of (dev, stream_ptr), made where the stream has none; None where it
        has none under capture (no allocation inside a capture: the caller takes our core)
        or without `allocate`. Under capture the one returned is kept for good (pin)."""
        k = (dev, stream_ptr)
        if under_capture:
            return self.pin(k)
        ws = self.kept(k)
        if ws is None and allocate:
            ws = self._new(k)
        return ws

    def pin(self, k):
        """Keep k's workspace for good (a caller's graph captured it) and return it, where one
        is kept (else None); never let go between the lookup and the pin."""
        with self.lock:
            ws = self.arrays.get(k)
            if ws is not None:
                self.captured.add(k)
            return ws

    def kept(self, k):
        """The workspace kept for k = (device, stream), marked used last; None where none is."""
        ws = self.arrays.get(k)
        if ws is not None and k != self.last:  # (the stream used last, the usual call: as is)
            try:
                self.arrays.move_to_end(k)
            except KeyError:  # another thread let it go just now: `ws` stays valid for this call
                pass
            self.last = k
        return ws

    def _new(self, k):
        with self.lock:
            ws = self.arrays.get(k)
            if ws is not None:  # another thread's first call on the stream made it
                return ws
            if len(self.arrays) >= WORKSPACES_KEPT:
                for old in list(self.arrays):  # the stream used longest ago, first
                    if old not in self.captured:
                        self.arrays.pop(old, None)  # (dropped: CuPy frees it to its arena)
                        break
            ws = self.arrays[k] = self.make(k[1])
            self.last = k
        return ws


_CUBLAS: list = []
_CUBLAS_LOCK = threading.Lock()


def _once(store: list, make):
    """The one instance kept in `store`, made at the first call (locked: torch runs backward on
    a thread of its own, and two threads' first GEMMs must not each load the library)."""
    if not store:
        with _CUBLAS_LOCK:
            if not store:
                store.append(make())
    return store[0]


def _cublas() -> _Cublas:
    return _once(_CUBLAS, _Cublas)


# cublasLt's algorithm for a shape: its heuristic's first pick is often not its fastest (H200,
# bf16, scripts/results/probes/probe_rs_schedule-h200-2026-12-02a.json and ...b.json: among
# its first 8 candidates one ran in 0.94-0.96x the first one's time at 8192x8192x14336,
# 4096x12288x24576 and 4096x4096x7168, sustained; GemmReduceScatter's chunks are such shapes).
# So a plan keeps the first ALGO_CANDIDATES and, at the shape's first call, where the GEMM is at
# least ALGO_TUNE_MIN_FLOP and tuning is on (knobs.gemm_algo_tune), times them on the call's
# own operands and keeps the fastest, remembered per exact shape in
# <cache dir>/cublaslt_algos.json (gemm_tuner.recall_algo).
ALGO_CANDIDATES = 8
# ~100 us on an H200. Below it a call's timing is as much the host's launch as the GPU's (a
# tuned 128 x 8192 x 8192 read 0.90x cupy.matmul GPU-queued in scripts/results/
# gemm-h200-W1-2026-12-02-tuned.log, 1.01x untuned), and the gain is a few microseconds.
ALGO_TUNE_MIN_FLOP = 2**36
# Timings per process at most: a shape is timed once per machine (the table keeps it), but a
# server that meets many new M (dynamic batches) would otherwise stall ~0.1-0.5 s at each; past
# the cap new shapes take the heuristic's first (the table's choices are still read).
ALGO_TUNE_MAX_PER_PROCESS = 64
_ALGO_TIMINGS = [0]  # timings run in this process
# A shape class: the same GEMM (device, dtypes, layout, N, K, alignment, epilogue) with M in the
# same power-of-two range [2^(b-1), 2^b). A server whose batches change M every call would time
# each new M; once one M of a class is timed (or read from the table), a new M of the class
# takes that winner without timing where the heuristic offers it for the new M too (the same
# algorithm struct, so valid there), and is timed as a shape of its own only where it does not.
# In memory only: the table keeps exact shapes. {class key (a plan key with M's power-of-two
# range, M.bit_length(), in M's place): the winning algorithm's bytes}
_CLASS_WINNERS: dict[tuple, bytes] = {}


class LtPlan:
    """A shape's cublasLt plan: handle, descriptor, the A / B / C(= D) layouts, the heuristic's
    candidate algorithms (best first by its estimate), the one calls use, whether it was
    tuned (or tuning was declined), and its key among _CublasLt.plans (_tune_algo makes its
    key in the algorithm table from it)."""

    __slots__ = ("h", "desc", "a_lay", "b_lay", "c_lay", "algos", "algo", "tuned", "key",
                 "__weakref__")

    def __init__(self, h, desc, a_lay, b_lay, c_lay, algos, key):
        self.h, self.desc, self.a_lay, self.b_lay, self.c_lay = h, desc, a_lay, b_lay, c_lay
        self.algos, self.algo, self.tuned, self.key = algos, algos[0], False, key


class _CublasLt:
    """cublasLtMatmul through ctypes with a plan per shape (LtPlan: matmul descriptor, the
    three layouts, the heuristic's candidate algorithms and the tuned one), made at the shape's
    first call and reused: GemmEx picks its kernel on every call, 14-19 us of host time on the
    H200's host. The same column-major reading as launch_cublas (its docstring); no stream
    state, so no lock around the call (but one around a bias epilogue's pointer)."""

    _TRANSA, _EPILOGUE, _BIAS_POINTER, _BIAS_TYPE = 3, 7, 8, 26  # ...MatmulDescAttributes_t
    _EPILOGUE_BIAS = 4  # cublasLtEpilogue_t: D = A B + beta C + bias (a vector per D row)
    _PREF_MAX_WORKSPACE, _PREF_MIN_ALIGNMENT = 1, (5, 6, 7, 8)  # ...PreferenceAttributes_t: A-D
    _MAX_PLANS = 4096

    def __init__(self):
        import ctypes

        lib = _loaded_lib("libcublasLt")
        vp, i32, u64, i64, sz = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64,
                                 ctypes.c_size_t)

        class Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t
            _fields_ = [("data", ctypes.c_uint64 * 8)]

        class Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t (96 bytes)
            _fields_ = [("algo", Algo), ("workspaceSize", sz), ("state", i32),
                        ("wavesCount", ctypes.c_float), ("reserved", i32 * 4)]

        sigs = {"cublasLtCreate": [ctypes.POINTER(vp)],
                "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
                "cublasLtMatmulDescDestroy": [vp],
                "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
                "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, u64, u64, i64],
                "cublasLtMatrixLayoutDestroy": [vp],
                "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
                "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
                "cublasLtMatmulPreferenceDestroy": [vp],
                "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32,
                                                   ctypes.POINTER(Heuristic),
                                                   ctypes.POINTER(i32)],
                "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                   ctypes.POINTER(Algo), vp, sz, vp],
                "cublasLtGetVersion": []}
        for fname, argtypes in sigs.items():
            f = getattr(lib, fname)
            f.argtypes, f.restype = argtypes, (sz if fname == "cublasLtGetVersion" else i32)
        self.lib, self.ctypes, self.Heuristic = lib, ctypes, Heuristic
        self.handles: dict[int, int] = {}
        self.plans: dict[tuple, LtPlan | None] = {}
        self.lock = threading.Lock()
        self.version = int(lib.cublasLtGetVersion())

    def _check(self, what: str, err: int) -> None:
        if err:
            from cuflux.errors import CudaError

            raise CudaError(f"{_OP}: {what} failed (cublasStatus {err})")

    def _new(self, create, *args) -> int:
        h = self.ctypes.c_void_p()
        self._check(create, getattr(self.lib, create)(self.ctypes.byref(h), *args))
        return h.value

    def plan(self, dev: int, dt, odt, M: int, N: int, K: int, b_layout: str, align: int = 256,
             bias_epilogue: bool = False) -> LtPlan | None:
        """The LtPlan of this shape (untuned when new: launch_cublaslt tunes it), or None where
        cublasLt has no algorithm for it (then GemmEx runs it). align: the bytes every operand's
        address is a multiple of (256, cublasLt's default, or 16: gemm's own rule), so the
        heuristic picks an algorithm that can read them. bias_epilogue: the bias (input dtype)
        added by the epilogue, its pointer set on the descriptor at each call (under the lock):
        for calls whose C is not the output (launch_cublaslt's addend)."""
        key = (dev, dt.name, odt.name, b_layout, M, N, K, align, bias_epilogue)
        plan = self.plans.get(key, _NO_PLAN)  # one read: another thread may clear the dict
        if plan is not _NO_PLAN:
            return plan
        with self.lock:
            if key in self.plans:
                return self.plans[key]
            ct, lib = self.ctypes, self.lib
            h = self.handles.get(dev)
            if h is None:
                h = self.handles[dev] = self._new("cublasLtCreate")
            kn = b_layout == "kn"
            desc = self._new("cublasLtMatmulDescCreate", _COMPUTE_32F, _CUDA_R["float32"])
            trans = ct.c_int32(_OP_N if kn else _OP_T)
            self._check("cublasLtMatmulDescSetAttribute", lib.cublasLtMatmulDescSetAttribute(
                desc, self._TRANSA, ct.byref(trans), ct.sizeof(trans)))
            if bias_epilogue:
                for attr, v in ((self._EPILOGUE, ct.c_int32(self._EPILOGUE_BIAS)),
                                (self._BIAS_TYPE, ct.c_int32(_CUDA_R[dt.name])),
                                # alignment the heuristic assumes for the bias (16 bytes)
                                (self._BIAS_POINTER, ct.c_void_p(16))):
                    self._check("cublasLtMatmulDescSetAttribute",
                                lib.cublasLtMatmulDescSetAttribute(desc, attr, ct.byref(v),
                                                                   ct.sizeof(v)))
            # A = b as stored: [N, K] column-major (kn, ld N) or [K, N] (nk, ld K); B = a,
            # [K, M] ld K; C = D = out, [N, M] ld N (the transposes of the row-major arrays).
            a_lay = (self._new("cublasLtMatrixLayoutCreate", _CUDA_R[dt.name], N, K, N) if kn
                     else self._new("cublasLtMatrixLayoutCreate", _CUDA_R[dt.name], K, N, K))
            b_lay = self._new("cublasLtMatrixLayoutCreate", _CUDA_R[dt.name], K, M, K)
            c_lay = self._new("cublasLtMatrixLayoutCreate", _CUDA_R[odt.name], N, M, N)
            pref = self._new("cublasLtMatmulPreferenceCreate")
            values = [(self._PREF_MAX_WORKSPACE, ct.c_uint64(WORKSPACE_BYTES))]
            values += [(attr, ct.c_uint32(align)) for attr in self._PREF_MIN_ALIGNMENT]
            for attr, v in values:
                self._check("cublasLtMatmulPreferenceSetAttribute",
                            lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ct.byref(v),
                                                                     ct.sizeof(v)))
            results, found = (self.Heuristic * ALGO_CANDIDATES)(), ct.c_int(0)
            err = lib.cublasLtMatmulAlgoGetHeuristic(h, desc, a_lay, b_lay, c_lay, c_lay, pref,
                                                     ALGO_CANDIDATES, results, ct.byref(found))
            lib.cublasLtMatmulPreferenceDestroy(pref)
            algos = ([results[i].algo for i in range(min(found.value, ALGO_CANDIDATES))
                      if results[i].state == 0] if err == 0 else [])
            plan = None
            if algos:
                plan = LtPlan(h, desc, a_lay, b_lay, c_lay, algos, key)
                # its descriptors go with the last holder of the plan (this table, a call
                # under way, an _LtCall), not before
                done = weakref.finalize(plan, _destroy_plan, lib, desc, a_lay, b_lay, c_lay)
                done.atexit = False  # (at exit cuBLAS may be gone)
            else:
                _destroy_plan(lib, desc, a_lay, b_lay, c_lay)
            if len(self.plans) >= self._MAX_PLANS:  # shapes that change every call: bounded
                self.plans.clear()
            self.plans[key] = plan
            return plan


def _destroy_plan(lib, desc, *layouts) -> None:
    lib.cublasLtMatmulDescDestroy(desc)
    for lay in layouts:
        lib.cublasLtMatrixLayoutDestroy(lay)


_CUBLASLT: list = []
_NO_PLAN = object()  # _CublasLt.plans: not asked yet (None: asked, no algorithm)


def _cublaslt() -> _CublasLt:
    return _once(_CUBLASLT, _CublasLt)


def _lt_ready(a, b, bias, out, dt, odt, M, N, K, b_layout, stream, under_capture, addend,
              tune):
    """(cublasLt, the shape's plan, the stream's workspace), the plan tuned first where it is
    new and `tune` (not under capture); None where cublasLt has no algorithm for the shape, or
    under capture on a stream without a cuBLAS workspace yet. Refuses an addend overlapping out
    (the tuning's calls would add onto their own results)."""
    if addend is not None:
        out_end = out.data.ptr + M * N * odt.itemsize
        add_end = addend.data.ptr + M * N * odt.itemsize
        if addend.data.ptr < out_end and out.data.ptr < add_end:
            raise ValueError(f"{_OP}: the addend overlaps out; give it its own memory")
    ptrs = a.data.ptr | b.data.ptr | out.data.ptr | (0 if addend is None else addend.data.ptr)
    align = 256 if ptrs % 256 == 0 else 16
    lt = _cublaslt()
    epilogue = addend is not None and bias is not None
    plan = lt.plan(a.data.device_id, dt, odt, M, N, K, b_layout, align, epilogue)
    if plan is None:
        return None
    ws = _cublas().workspace(a.data.device_id, stream.ptr, under_capture)
    if ws is None:
        return None
    if tune and not plan.tuned and not under_capture:
        _tune_algo(lt, plan, a, b, bias if epilogue else None, out, addend, ws, stream, M, N, K)
    return lt, plan, ws


def prepare_cublaslt(a, b, bias, out, dt, odt, M, N, K, b_layout, stream, addend=None) -> bool:
    """What launch_cublaslt does before its call: the shape's plan made and its algorithm
    tuned (the timing's calls write out), nothing else enqueued; False where there is no
    plan. For a caller that must not time later, e.g. behind a wait for a peer (ChunkedRs)."""
    return _lt_ready(a, b, bias, out, dt, odt, M, N, K, b_layout, stream, False, addend,
                     True) is not None


def launch_cublaslt(a, b, bias, out, dt, odt, M, N, K, b_layout, stream,
                    under_capture: bool = False, addend=None, tune: bool = True,
                    bind: bool = False):
    """launch_cublas's call by cublasLtMatmul on the shape's cached plan; False (nothing
    enqueued) where cublasLt has no algorithm for the shape, or under capture on a stream
    without a cuBLAS workspace yet. A new plan's algorithm is tuned first (tune=False: the
    heuristic's first until a call that tunes, or prepare_cublaslt).

    addend: [M, N] in out's dtype (checked by the caller, 16-byte aligned; overlapping out is
    refused) or None: out = a @ b + addend (+ bias), summed in fp32 and rounded once
    (cublasLt's C, beta = 1; the bias then comes from the epilogue, C being taken).

    bind (no bias, no addend): once enqueued, returns the call as a replay (_LtReplay)
    instead of True."""
    ready = _lt_ready(a, b, bias, out, dt, odt, M, N, K, b_layout, stream, under_capture,
                      addend, tune)
    if ready is None:
        return False
    lt, plan, ws = ready
    c = addend
    if bias is not None and addend is None:
        with stream:
            out[...] = bias
        c = out
    err = _matmul(lt, plan, plan.algo, a, b, c, out, ws, stream,
                  bias if addend is not None else None)
    if err:  # (the message is built only then: this runs on every call)
        lt._check(f"cublasLtMatmul for {M}x{N}x{K} ({b_layout})", err)
    if bind and bias is None and addend is None:
        return _LtReplay(lt, plan, a.data.ptr, b.data.ptr, out.data.ptr, a.data.device_id,
                         f"cublasLtMatmul for {M}x{N}x{K} ({b_layout})")
    return True


class _LtReplay:
    """A cublasLtMatmul call (beta 0, no bias) with its pointers and algorithm fixed, called
    with a stream handle; False (nothing enqueued) where that stream has no cuBLAS workspace
    yet: the caller takes the full path, which makes one outside a capture.

    With graphs (knobs.graph_replay, read at bind), the call on a stream is a launch.GraphReplay
    of its own with that stream's workspace, captured at its second call with that workspace
    (a caller that cycles more streams than keep a workspace, _Workspaces, calls directly
    rather than capture each call): cublasLtMatmul costs the host 10-15 us a call on the H200
    machine (its own checks, every call), a graph launch ~3. The stream's own workspace keeps
    graphs of calls on other streams from sharing one."""

    __slots__ = ("call", "kept", "dev", "graphs")

    def __init__(self, lt, plan: "LtPlan", a_ptr, b_ptr, out_ptr, dev, what):
        spaces = _cublas().spaces
        self.call = _LtCall(lt, plan, a_ptr, b_ptr, out_ptr, dev, what, spaces.pin)
        self.kept, self.dev = spaces.kept, dev
        # stream -> (its workspace's pointer, its GraphReplay: None until that pointer's second
        # call); the GraphReplay holds the _LtCall, never this (no reference cycle)
        self.graphs = {} if knobs.graph_replay() else None

    def __call__(self, stream: int):
        ws = self.kept((self.dev, stream))
        if ws is None:
            return False
        ptr = ws.data.ptr
        graphs = self.graphs
        if graphs is not None:
            made = graphs.get(stream)
            if made is not None and made[0] == ptr:
                replay = made[1]
                if replay is None:
                    replay = GraphReplay((functools.partial(self.call, ptr),), op=_OP,
                                         what=self.call.what)
                    graphs[stream] = (ptr, replay)
                replay(stream)
                return None
            if len(graphs) >= WORKSPACES_KEPT:
                graphs.clear()  # (streams come and go: bounded)
            graphs[stream] = (ptr, None)  # a new stream, or its workspace was let go
        self.call(ptr, stream)
        return None


class _LtCall:
    """The call an _LtReplay makes: cublasLtMatmul on its plan (held, so its descriptors
    live as long as the call) with the workspace and stream given."""

    __slots__ = ("plan", "head", "matmul", "lt", "what", "dev", "pin")

    def __init__(self, lt, plan, a_ptr, b_ptr, out_ptr, dev, what, pin):
        self.plan, self.lt, self.what, self.dev, self.pin = plan, lt, what, dev, pin
        self.head = (plan.h, plan.desc, _ONE_PTR, b_ptr, plan.a_lay, a_ptr, plan.b_lay,
                     _ZERO_PTR, out_ptr, plan.c_lay, out_ptr, plan.c_lay,
                     lt.ctypes.byref(plan.algo))
        self.matmul = lt.lib.cublasLtMatmul

    def __call__(self, ws_ptr: int, stream: int) -> None:
        # With graphs this runs under a capture (its GraphReplay's, on the private stream,
        # or the caller's graph, which then holds the stream's workspace for good: pinned)
        # or at a stream's first call with a workspace
        if capturing(stream) and stream != private_capture_stream(self.dev):
            self.pin((self.dev, stream))
        err = self.matmul(*self.head, ws_ptr, WORKSPACE_BYTES, stream)
        if err:
            self.lt._check(self.what, err)


def _matmul(lt, plan: LtPlan, algo, a, b, c, out, ws, stream, epilogue_bias) -> int:
    """Enqueue out = a @ b (+ c: beta 1, None: beta 0) with `algo`; its cublasStatus.
    epilogue_bias: the bias of a bias-epilogue plan, whose pointer lives on the descriptor
    every call of the shape shares: set and used at once, under the lock."""
    args = (plan.h, plan.desc, _ONE_PTR, b.data.ptr, plan.a_lay, a.data.ptr, plan.b_lay,
            _ZERO_PTR if c is None else _ONE_PTR, out.data.ptr if c is None else c.data.ptr,
            plan.c_lay, out.data.ptr, plan.c_lay, lt.ctypes.byref(algo), ws.data.ptr,
            WORKSPACE_BYTES, stream.ptr)
    if epilogue_bias is None:
        return lt.lib.cublasLtMatmul(*args)
    ptr = lt.ctypes.c_void_p(epilogue_bias.data.ptr)
    with lt.lock:
        lt._check("cublasLtMatmulDescSetAttribute (bias)",
                  lt.lib.cublasLtMatmulDescSetAttribute(plan.desc, lt._BIAS_POINTER,
                                                        lt.ctypes.byref(ptr),
                                                        lt.ctypes.sizeof(ptr)))
        return lt.lib.cublasLtMatmul(*args)


def _tune_algo(lt, plan: LtPlan, a, b, bias, out, addend, ws, stream, M, N, K) -> None:
    """Pick plan.algo among plan.algos (ALGO_CANDIDATES' comment): the table's choice for the
    shape, else its class's winner where offered (_CLASS_WINNERS), else (tuning on, the GEMM
    big enough) the fastest by timing each on this call's
    operands, on its stream, before the call itself (_time_candidates), once the stream has run
    its earlier work. The timing calls write `out` (beta 0, or + addend, never + out: the call
    that follows overwrites it). Only a complete timing (every candidate's blocks within the
    budget) goes to the table and names its class's winner; a cut-short one is used by this
    shape in this process alone. bias: the
    epilogue's (plans with a bias epilogue), else None. At most ALGO_TUNE_MAX_PER_PROCESS
    timings a process."""
    plan.tuned = True  # decided now, whatever happens below (one attempt per plan)
    if len(plan.algos) < 2 or 2 * M * N * K < ALGO_TUNE_MIN_FLOP or not knobs.gemm_algo_tune():
        return
    from cuflux import gemm_tuner

    dev, dt_name, odt_name, b_layout, _, _, _, align, epilogue = plan.key
    table_key = (f"{device_props(dev)[3]}|cublasLt {lt.version}|{dt_name}|{odt_name}|"
                 f"{b_layout}|{M}x{N}x{K}|{align}|{'bias' if epilogue else '-'}")
    cls = (dev, dt_name, odt_name, b_layout, M.bit_length(), N, K, align, epilogue)
    chosen = gemm_tuner.recall_algo(table_key)
    if chosen is not None:
        if 0 <= chosen < len(plan.algos):
            plan.algo = plan.algos[chosen]
            _CLASS_WINNERS.setdefault(cls, bytes(plan.algo))
        return
    won = _CLASS_WINNERS.get(cls)
    if won is not None:  # another M of the class was timed: its winner, where offered here
        for algo in plan.algos:
            if bytes(algo) == won:
                plan.algo = algo
                return
    with lt.lock:  # torch's backward thread may tune beside the main one
        if _ALGO_TIMINGS[0] >= ALGO_TUNE_MAX_PER_PROCESS:
            return
        _ALGO_TIMINGS[0] += 1
    def run(i: int) -> int:
        return _matmul(lt, plan, plan.algos[i], a, b, addend, out, ws, stream, bias)

    stream.synchronize()  # the budget is for the timing, not for work queued before it
    times, complete = _time_candidates(run, len(plan.algos), stream,
                                       knobs.gemm_tune_budget_s())
    if times:
        fastest = min(times, key=times.get)
        plan.algo = plan.algos[fastest]
        if complete:  # a cut-short timing is this shape's guess, not its class's
            _CLASS_WINNERS.setdefault(cls, bytes(plan.algo))
            gemm_tuner.remember_algo(table_key, fastest,
                                     [times.get(i) for i in range(len(plan.algos))])


TUNE_BLOCK_MS = 10.0  # GPU time of one timed block of one candidate (_time_candidates)


def _time_candidates(run, count: int, stream,
                     budget_s: float) -> tuple[dict[int, float], bool]:
    """({candidate: ms per call}, complete) within budget_s. run(i) enqueues one call of
    candidate i on `stream` and returns its status (nonzero: the candidate is dropped). First,
    in order, each candidate's warm-up call and an estimate from 2 calls; then two rounds
    (reverse order, then forward) of one block each of ~TUNE_BLOCK_MS of calls (2 to 64)
    between two events. A candidate's time is the mean of its blocks: the clock a loop of calls
    runs at, not the boost of a first burst, under which the candidates rank differently
    (their sustained times: scripts/results/probes/probe_rs_schedule-h200-2026-12-02a.json,
    cublaslt_algos). Candidates whose blocks the budget cut short are judged by their
    estimates only if no candidate completed its blocks; complete: every candidate that did
    not refuse has both blocks."""
    import time

    import cupy

    t_end = time.monotonic() + budget_s
    ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()

    def block(i: int, calls: int) -> float:
        ev0.record(stream)
        for _ in range(calls):
            run(i)
        ev1.record(stream)
        ev1.synchronize()
        return cupy.cuda.get_elapsed_time(ev0, ev1) / calls

    estimate: dict[int, float] = {}
    refused = 0
    for i in range(count):
        if time.monotonic() > t_end:
            break
        if run(i):  # warm-up; a candidate that refuses is dropped
            refused += 1
            continue
        estimate[i] = block(i, 2)
    blocks: dict[int, list[float]] = {i: [] for i in estimate}
    order = list(estimate)
    for rnd in range(2):
        for i in (order[::-1] if rnd == 0 else order):
            if time.monotonic() > t_end:
                break
            calls = min(64, max(2, math.ceil(TUNE_BLOCK_MS / max(estimate[i], 1e-3))))
            blocks[i].append(block(i, calls))
    done = {i: sum(b) / len(b) for i, b in blocks.items() if len(b) == 2}
    complete = bool(done) and len(done) == len(estimate) and len(estimate) + refused == count
    return (done or estimate), complete


def launch_cublas(a, b, bias, out, dt, odt, M, N, K, b_layout, stream,
                  under_capture: bool = False, bind: bool = False):
    """C = a @ b (+ bias) by cublasGemmEx (or cublasLtMatmul: knobs.gemm_cublaslt), fp32
    accumulation, any of our output dtypes; False (nothing enqueued) when under capture on a
    stream that has no cuBLAS workspace yet.

    Row-major C [M, N] is column-major C^T [N, M] = op(b) op(a): b "kn" is column-major [N, K]
    (no transpose, ld N), "nk" column-major [K, N] (transposed, ld K); a is column-major
    [K, M] (ld K). A bias is broadcast into C first and kept with beta = 1.

    bind (no bias): once enqueued, returns the call as a replay taking a stream handle
    (_LtReplay, _GemmExReplay) instead of True."""
    if knobs.gemm_cublaslt():
        done = launch_cublaslt(a, b, bias, out, dt, odt, M, N, K, b_layout, stream,
                               under_capture, bind=bind)
        if done:
            return done
    cb = _cublas()
    # One handle per device, shared by every thread (torch runs backward on a thread of its
    # own): setting its stream and calling it is one critical section.
    with _CUBLAS_LOCK:
        handle = cb.handle(a.data.device_id, stream.ptr, under_capture)
        if not handle:
            return False
        beta = _ZERO
        if bias is not None:
            with stream:
                out[...] = bias
            beta = _ONE
        kn = b_layout == "kn"
        err = cb.lib.cublasGemmEx(
            handle, _OP_N if kn else _OP_T, _OP_N, N, M, K, _ONE_PTR, b.data.ptr,
            _CUDA_R[dt.name], N if kn else K, a.data.ptr, _CUDA_R[dt.name], K,
            _ONE_PTR if beta is _ONE else _ZERO_PTR, out.data.ptr, _CUDA_R[odt.name], N,
            _COMPUTE_32F, _ALGO_DEFAULT)
    if err:
        from cuflux.errors import CudaError

        raise CudaError(f"{_OP}: cublasGemmEx failed for {M}x{N}x{K} ({b_layout}): "
                        f"cublasStatus {err}")
    if bind and bias is None:
        return _GemmExReplay(cb, a.data.device_id, (
            _OP_N if kn else _OP_T, _OP_N, N, M, K, _ONE_PTR, b.data.ptr, _CUDA_R[dt.name],
            N if kn else K, a.data.ptr, _CUDA_R[dt.name], K, _ZERO_PTR, out.data.ptr,
            _CUDA_R[odt.name], N, _COMPUTE_32F, _ALGO_DEFAULT),
            f"cublasGemmEx failed for {M}x{N}x{K} ({b_layout})")
    return True


class _GemmExReplay:
    """A cublasGemmEx call (beta 0) with its arguments fixed, called with a stream handle;
    False (nothing enqueued) where that stream has no cuBLAS workspace yet (the caller takes
    the full path)."""

    __slots__ = ("cb", "dev", "tail", "what")

    def __init__(self, cb, dev, tail, what):
        self.cb, self.dev, self.tail, self.what = cb, dev, tail, what

    def __call__(self, stream: int):
        cb = self.cb
        with _CUBLAS_LOCK:  # (under the caller's capture: its graph holds the workspace)
            handle = cb.handle(self.dev, stream, capturing(stream), allocate=False)
            if not handle:
                return False
            err = cb.lib.cublasGemmEx(handle, *self.tail)
        if err:
            from cuflux.errors import CudaError

            raise CudaError(f"{_OP}: {self.what}: cublasStatus {err}")
        return None


_ONE_PTR, _ZERO_PTR = _ONE.ctypes.data, _ZERO.ctypes.data
