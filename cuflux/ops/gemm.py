"""cuflux.gemm: C = A @ B (+ bias) on the project's own GEMM cores (kernels_cu/gemm.cu).

a [M, K]; b [K, N] (b_layout="kn") or [N, K] ("nk", a Linear layer's weight); bias [N] in the
input dtype; bf16 or fp16 in, fp32 accumulation, out in bf16 / fp16 / fp32. Any M, N, K with
K % 8 == 0 and N % 8 == 0 (16-byte rows: TMA and cp.async move 16-byte pieces).

Two implementations behind one call: "sm90" (Hopper, sm_90a: TMA + mbarrier pipeline, wgmma,
warp-specialised, persistent, optional 2-CTA clusters) and "sm80" (mma.sync + cp.async,
sm_80 and later). impl="auto" takes sm90 where the device is sm_90a.

Tile shape, pipeline depth and cluster size of the Hopper path come from a small tuner: on the
first call of a (GPU, dtype, layout, shape class) it times the candidate configurations for at
most CUFLUX_GEMM_TUNE_BUDGET_S seconds (default 2) on the caller's own operands and keeps the
winner in <cache dir>/gemm_tuner.json (at most 512 entries). CUFLUX_GEMM_TUNE=0 disables it
(a fixed heuristic is used instead).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import threading
import time

import numpy as np

from cuflux import kernels, knobs
from cuflux.arrays import as_cupy, check_array, dtype_info, stream_of
from cuflux.errors import CaptureError
from cuflux.launch import capturing

__all__ = ["gemm", "plan", "tensor_map", "Sm90Config", "SM90_CONFIGS", "SM80_CONFIG", "CUBLAS",
           "tuner_path"]

_OP = "cuflux.gemm"
_IN = ("bfloat16", "float16")
_OUT_KIND = {"bfloat16": 0, "float16": 1, "float32": 2}
_LAYOUTS = ("kn", "nk")


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
# The tuner's candidates: the 1-CTA cooperative tiles with both epilogues, one 2-CTA cluster (B
# multicast; at its 1-CTA twin's speed so far) and the ping-pong 128x128, which wins where tiles
# are few (2048^2, 8x4096x4096, 777x1536x2048). Every entry of SM90_CONFIGS stays callable
# through config=.
TUNER_CANDIDATES = ("256x128s4c1t", "128x256s4c1t", "256x128s4c1", "128x256s4c1", "128x256s4c2",
                    "128x128s6c1", "128x128s7c1p")
SM80_CONFIG = "128x128x32s4"  # fixed in gemm.cu (Sm80Cfg)
_SM80_TILE, _SM80_THREADS, _SM80_SMEM, _SM80_PER_SM = (128, 128), 256, 4 * 2 * 128 * 32 * 2, 2

_CUDA_TYPE = {"bfloat16": "__nv_bfloat16", "float16": "__half"}


def _sm80_kernel(cuda_type: str, transposed: bool) -> str:
    return f"gemm_sm80<{cuda_type}, {'true' if transposed else 'false'}>"


def _names() -> list[str]:
    names = []
    for t in _CUDA_TYPE.values():
        for tr in (False, True):
            names += [c.kernel(t, tr) for c in SM90_CONFIGS.values()]
            names.append(_sm80_kernel(t, tr))
    names += ["gemm_hooks_sm90<__nv_bfloat16>", "gemm_hooks_sm80<__nv_bfloat16>"]
    return names


FAMILY = kernels.register("gemm.cu", _names(), min_arch=80)


# ---- argument checks ------------------------------------------------------------------------------

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


def _check_args(a, b, bias, out, out_dtype, b_layout, impl):
    cupy = _cupy()
    if b_layout not in _LAYOUTS:
        raise ValueError(f"{_OP}: b_layout must be 'kn' (b is [K, N]) or 'nk' (b is [N, K]), "
                         f"got {b_layout!r}")
    if impl not in IMPLS:
        raise ValueError(f"{_OP}: impl must be one of {IMPLS}, got {impl!r}")
    a = as_cupy(a, "a", _OP)
    b = as_cupy(b, "b", _OP)
    dt = dtype_info(a.dtype, _IN, _OP)
    dev = cupy.cuda.runtime.getDevice()
    check_array(a, name="a", op=_OP, ndim=2, dtype=dt, device=dev)
    check_array(b, name="b", op=_OP, ndim=2, dtype=dt, device=dev)
    M, K = a.shape
    if b_layout == "kn":
        if b.shape[0] != K:
            raise ValueError(f"{_OP}: b (layout 'kn') must be [K={K}, N], got {tuple(b.shape)}")
        N = b.shape[1]
    else:
        if b.shape[1] != K:
            raise ValueError(f"{_OP}: b (layout 'nk') must be [N, K={K}], got {tuple(b.shape)}")
        N = b.shape[0]
    if K % 8 or K == 0:
        raise ValueError(f"{_OP}: K must be a positive multiple of 8 (rows of a and b move in "
                         f"16-byte pieces), got K={K}")
    if N % 8 or N == 0:
        raise ValueError(f"{_OP}: N must be a positive multiple of 8 (rows of b and of the output "
                         f"move in 16-byte pieces), got N={N}")
    if max(M, N, K) >= 2**31:
        raise ValueError(f"{_OP}: dimensions must be < 2**31, got M={M}, N={N}, K={K}")
    check_aligned(_OP, a=a, b=b)
    bias = check_bias(_OP, bias, N, dt, dev)
    if out is not None:
        out = as_cupy(out, "out", _OP)
        odt = dtype_info(out_dtype if out_dtype is not None else out.dtype, _OUT_KIND, _OP)
        check_array(out, name="out", op=_OP, shape=(M, N), dtype=odt, device=dev)
        if out.data.ptr % 16:
            raise ValueError(f"{_OP}: out must start at a 16-byte aligned address")
    else:
        odt = dtype_info(out_dtype if out_dtype is not None else dt.name, _OUT_KIND, _OP)
        out = cupy.empty((M, N), dtype=odt.storage)
    return a, b, bias, out, dt, odt, M, N, K


_PROPS: dict[int, tuple] = {}


def _device_props(dev: int | None = None):
    """(device id, NVRTC arch, SM count, GPU name) of the current device, queried once per
    device: getDeviceProperties alone costs 0.7 ms (it was 1.4 ms of every call)."""
    if dev is None:
        from cupy.cuda import runtime

        dev = runtime.getDevice()
    props = _PROPS.get(dev)
    if props is None:
        from cupy.cuda import runtime

        name = runtime.getDeviceProperties(dev)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        props = _PROPS[dev] = (dev, kernels.device_arch(dev), runtime.deviceGetAttribute(
            runtime.cudaDevAttrMultiProcessorCount, dev), name)
    return props


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


def _prepare(fn, smem: int):
    key = id(fn)
    if key not in _FUNC_READY:
        fn.max_dynamic_shared_size_bytes = smem
        _FUNC_READY[key] = True


def _max_ctas(fn, cfg: Sm90Config, sm_count: int) -> int:
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


def _launch_sm90(cfg: Sm90Config, a, b, bias, out, dt, odt, M, N, K, b_layout, stream,
                 group_m: int = 8, grid_cap: int | None = None) -> None:
    sm_count = _device_props()[2]
    transposed = b_layout == "kn"
    name = cfg.kernel(dt.cuda_type, transposed)
    fn = kernels.load("gemm.cu")[name]
    _prepare(fn, cfg.smem_bytes)
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
    grid = min(tiles, _max_ctas(fn, cfg, sm_count))
    if grid_cap is not None:  # benchmarks: a smaller persistent grid (a multiple of the cluster)
        grid = max(cfg.cluster, min(grid, grid_cap // cfg.cluster * cfg.cluster))
    kernels.launch(fn, grid, 384,
                   (tma_a, tma_b, tma_c, np.int32(M), np.int32(N), np.int32(K), out, np.int64(N),
                    _OUT_KIND_ARG[odt.name], bias if bias is not None else _NULL,
                    np.int32(group_m)),
                   stream, op=_OP, name=name, shared_mem=cfg.smem_bytes)


def _launch_sm80(a, b, bias, out, dt, odt, M, N, K, b_layout, stream, group_m: int = 8) -> None:
    sm_count = _device_props()[2]
    name = _sm80_kernel(dt.cuda_type, b_layout == "kn")
    fn = kernels.load("gemm.cu")[name]
    _prepare(fn, _SM80_SMEM)
    tiles = -(-M // _SM80_TILE[0]) * -(-N // _SM80_TILE[1])
    grid = min(tiles, _SM80_PER_SM * sm_count)
    kernels.launch(fn, grid, _SM80_THREADS,
                   (a, b, np.int32(M), np.int32(N), np.int32(K), out, np.int64(N),
                    _OUT_KIND_ARG[odt.name], bias if bias is not None else _NULL,
                    np.int32(group_m)),
                   stream, op=_OP, name=name, shared_mem=_SM80_SMEM)


_NULL = np.uint64(0)
_OUT_KIND_ARG = {k: np.int32(v) for k, v in _OUT_KIND.items()}


# ---- cuBLAS (through CuPy): where our kernel is slower, gemm calls it instead ---------------------
_CUDA_R = {"bfloat16": 14, "float16": 2, "float32": 0}  # cudaDataType
_COMPUTE_32F, _ALGO_DEFAULT, _OP_N, _OP_T = 68, -1, 0, 1
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


_CUPY: list = []


def _cupy():
    """The cupy module and its cuBLAS pieces, imported once (an import statement per call
    costs ~0.5 us; gemm's whole host path is ~10 us)."""
    if not _CUPY:
        import cupy
        from cupy.cuda import cublas
        from cupy.cuda import device as cdev

        _CUPY.extend((cupy, cublas, cdev))
    return _CUPY[0]


WORKSPACE_BYTES = 32 << 20  # cuBLAS workspace per stream (split-K and the like need one)


class _Cublas:
    """cublasGemmEx through ctypes, on a handle of cuflux's own per device with a workspace per
    stream. Why not CuPy's wrapper: it refuses every call while a stream is captured (cuBLAS
    would allocate its workspace inside the graph); with a workspace set beforehand cuBLAS
    captures cleanly, and the direct call is shorter on the host."""

    def __init__(self):
        import ctypes

        _cupy()  # CuPy's cublas module loads libcublas (from the CUDA extra's wheel or the system)
        lib = None
        for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
            try:
                lib = ctypes.CDLL(name)  # the copy already loaded in this process, by its soname
                break
            except OSError:
                continue
        if lib is None:
            raise RuntimeError(f"{_OP}: libcublas could not be loaded (install the cuda12 or "
                               f"cuda13 extra)")
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
        self.workspaces: dict[tuple, object] = {}  # (device, stream) -> cupy array
        self.current: dict[int, int] = {}          # device -> stream its handle is set to

    def handle(self, dev: int, stream_ptr: int, under_capture: bool) -> int:
        h = self.handles.get(dev)
        if h is None:
            hv = self.ctypes.c_void_p()
            err = self.lib.cublasCreate_v2(self.ctypes.byref(hv))
            if err:
                raise RuntimeError(f"{_OP}: cublasCreate failed ({err})")
            h = self.handles[dev] = hv.value
        if self.current.get(dev) != stream_ptr:
            ws = self.workspaces.get((dev, stream_ptr))
            if ws is None:
                if under_capture:  # no allocation inside a capture: the caller takes our core
                    return 0
                ws = self.workspaces[(dev, stream_ptr)] = _CUPY[0].empty(WORKSPACE_BYTES,
                                                                         _CUPY[0].uint8)
            self.lib.cublasSetStream_v2(h, stream_ptr)
            self.lib.cublasSetWorkspace_v2(h, ws.data.ptr, WORKSPACE_BYTES)
            self.current[dev] = stream_ptr
        return h


_CUBLAS: list = []


def _cublas() -> _Cublas:
    if not _CUBLAS:
        _CUBLAS.append(_Cublas())
    return _CUBLAS[0]


def _launch_cublas(a, b, bias, out, dt, odt, M, N, K, b_layout, stream,
                   under_capture: bool = False) -> bool:
    """C = a @ b (+ bias) by cublasGemmEx, fp32 accumulation, any of our output dtypes; False
    (nothing enqueued) when under capture on a stream that has no cuBLAS workspace yet.

    Row-major C [M, N] is column-major C^T [N, M] = op(b) op(a): b "kn" is column-major [N, K]
    (no transpose, ld N), "nk" column-major [K, N] (transposed, ld K); a is column-major
    [K, M] (ld K). A bias is broadcast into C first and kept with beta = 1."""
    cb = _cublas()
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
        handle, _OP_N if kn else _OP_T, _OP_N, N, M, K, _ONE_PTR, b.data.ptr, _CUDA_R[dt.name],
        N if kn else K, a.data.ptr, _CUDA_R[dt.name], K, _ONE_PTR if beta is _ONE else _ZERO_PTR,
        out.data.ptr, _CUDA_R[odt.name], N, _COMPUTE_32F, _ALGO_DEFAULT)
    if err:
        from cuflux.errors import CudaError

        raise CudaError(f"{_OP}: cublasGemmEx failed for {M}x{N}x{K} ({b_layout}): "
                        f"cublasStatus {err}")
    return True


_ONE_PTR, _ZERO_PTR = _ONE.ctypes.data, _ZERO.ctypes.data


# ---- tuner -----------------------------------------------------------------------------------------
_TUNER_LOCK = threading.Lock()
_TUNER_MAX_ENTRIES = 512
_TUNER_TABLE: dict | None = None  # the file's contents, read once per process
CUBLAS = "cublas"  # the tuner's name for cuBLAS among the Hopper configurations


def tuner_path():
    return kernels._cache_dir() / "gemm_tuner.json"


def grouped_tile(r: int, rows: int, tiles_n: int, group_m: int) -> tuple[int, int]:
    """(tile row within the walk, tile column) of position r of a walk over `rows` tile rows in
    L2 groups of group_m rows: mirror of gemm_hooks.cuh grouped_tile, which every tile scheduler
    uses (for the CPU tests of the tile orders)."""
    group, in_group = divmod(r, group_m * tiles_n)
    first = group * group_m
    n = min(group_m, rows - first)
    return first + in_group % n, in_group // n


def _shape_class(M: int, N: int, K: int) -> str:
    return "x".join(str(max(3, math.ceil(math.log2(max(x, 1))))) for x in (M, N, K))


# Below this many rows a 128- or 256-row tile is mostly padding and the grid covers few SMs:
# cuBLAS (split-K, narrow tiles) is the untuned choice there. The tuner measures both.
CUBLAS_BELOW_M = 256


def core_heuristic(M: int, N: int, K: int) -> str:
    """Our Hopper core's configuration without tuning, from the H200 measurements in
    docs/gemm_notes.md (v5: the TMA-store epilogue wins at every K)."""
    if N <= 128:
        return "128x128s6c1"
    return SM90_DEFAULT


def _heuristic(M: int, N: int, K: int) -> str:
    """gemm's choice without tuning: cuBLAS for small M, else core_heuristic."""
    return CUBLAS if M < CUBLAS_BELOW_M else core_heuristic(M, N, K)


def load_tuner() -> dict:
    """The tuner table (in memory after the first read)."""
    global _TUNER_TABLE
    if _TUNER_TABLE is None:
        try:
            _TUNER_TABLE = json.loads(tuner_path().read_text())
        except Exception:
            _TUNER_TABLE = {}
    return _TUNER_TABLE


def _valid(name) -> bool:
    return name == CUBLAS or name in SM90_CONFIGS


def _tuned_config(key: str, run_candidate, stream, tune: bool = True) -> str | None:
    """The cached choice for `key`, or (tune) time the candidates (bounded) and remember the
    winner."""
    entry = load_tuner().get(key)
    if entry is not None and _valid(entry.get("config")):
        return entry["config"]
    if not tune:
        return None
    import cupy

    budget_s = knobs.gemm_tune_budget_s()
    t_end = time.monotonic() + budget_s
    times = {}
    for name in (CUBLAS,) + TUNER_CANDIDATES:
        if time.monotonic() > t_end:
            break
        run_candidate(name)  # warm-up (first launch of the kernel)
        ev = [cupy.cuda.Event() for _ in range(4)]
        ev[0].record(stream)
        for i in range(1, 4):
            run_candidate(name)
            ev[i].record(stream)
        ev[3].synchronize()
        times[name] = min(cupy.cuda.get_elapsed_time(ev[i - 1], ev[i]) for i in range(1, 4))
    if not times:
        return None
    best = min(times, key=times.get)
    with _TUNER_LOCK:
        table = load_tuner()
        try:  # merge what other processes wrote since this one read the file
            table.update(json.loads(tuner_path().read_text()))
        except Exception:
            pass
        table.pop(key, None)
        table[key] = {"config": best, "ms": times, "when": time.strftime("%Y-%m-%d")}
        while len(table) > _TUNER_MAX_ENTRIES:
            table.pop(next(iter(table)))
        path = tuner_path()
        kernels.write_atomically(path, json.dumps(table, indent=0).encode())
    return best


def tune_key(dt, b_layout: str, M: int, N: int, K: int) -> str:
    """The tuner table's key of a shape class on the current device."""
    return f"{_device_props()[3]}|{dt.name}|{b_layout}|{_shape_class(M, N, K)}"


def plan(M: int, N: int, K: int, dtype="bfloat16", b_layout: str = "kn") -> str:
    """What `gemm(impl="auto")` runs for this shape on the current device, without running
    anything: "cublas", a Hopper configuration name (SM90_CONFIGS), or "sm80" (the portable
    core, on GPUs without the Hopper path). The tuner's choice where it has measured this
    shape class, else the untuned heuristic."""
    dt = dtype_info(dtype, _IN, _OP)
    if _device_props()[1] != "sm_90a":
        return CUBLAS if M < CUBLAS_BELOW_M else "sm80"
    chosen = None
    if knobs.gemm_tune():
        chosen = _tuned_config(tune_key(dt, b_layout, M, N, K), None, None, tune=False)
    return chosen or _heuristic(M, N, K)


# ---- public API ------------------------------------------------------------------------------------
IMPLS = ("auto", "sm90", "sm80", CUBLAS)


def gemm(a, b, bias=None, out=None, out_dtype=None, b_layout: str = "kn", impl: str = "auto",
         stream=None, config: str | None = None, group_m: int = 8):
    """C = a @ b (+ bias) with fp32 accumulation; returns C (a CuPy array).

    Args:
      a: [M, K], bfloat16 or float16 (any array CuPy takes without a copy), C-contiguous.
      b: [K, N] for b_layout="kn", [N, K] for "nk" (a Linear weight), a's dtype.
      bias: [N] in a's dtype, added to every row, or None.
      out: [M, N] output to write, or None (allocated). out_dtype: bfloat16 / float16 /
        float32 (default: out's dtype, else a's dtype).
      impl: "auto" (the faster of our Hopper core and cuBLAS for this shape class, as the tuner
        measured it, on sm_90a; elsewhere the portable core, or cuBLAS below CUBLAS_BELOW_M
        rows), "sm90", "sm80" or "cublas". `plan(M, N, K, ...)` says what "auto" runs.
      stream: CuPy stream, raw handle or torch stream (default: CuPy's current stream).
      config: a Hopper configuration name from SM90_CONFIGS (skips the tuner).
      group_m: tile rows per L2 group of the tile order (1: row-major order).
    K and N must be multiples of 8 (16-byte rows). Capturable in a CUDA graph once the shape
    class has been tuned (under capture an untuned shape takes the heuristic: no timing).
    """
    a, b, bias, out, dt, odt, M, N, K = _check_args(a, b, bias, out, out_dtype, b_layout, impl)
    if M == 0:
        return out
    s = stream_of(stream)
    under_capture = capturing(s)
    arch = _device_props()[1]
    hopper = arch == "sm_90a"
    if impl == "sm90" and not hopper:
        raise RuntimeError(f"{_OP}: impl='sm90' needs an sm_90a device (Hopper), this one is "
                           f"{arch}")
    if type(group_m) is not int or group_m < 1:
        raise ValueError(f"{_OP}: group_m must be an int >= 1, got {group_m!r}")
    if config is not None and config not in SM90_CONFIGS:
        raise ValueError(f"{_OP}: config must be one of {sorted(SM90_CONFIGS)}, got {config!r}")
    if impl == CUBLAS or (impl == "auto" and not hopper and config is None
                          and M < CUBLAS_BELOW_M):
        if _launch_cublas(a, b, bias, out, dt, odt, M, N, K, b_layout, s, under_capture):
            return out
        if impl == CUBLAS:
            raise CaptureError(f"{_OP}: impl='cublas' under capture needs one call on this "
                               f"stream outside the capture first (it sets up cuBLAS's "
                               f"workspace for the stream)")
    if impl == "sm80" or (impl == "auto" and not hopper):
        _launch_sm80(a, b, bias, out, dt, odt, M, N, K, b_layout, s, group_m)
        return out

    def run(name):
        if name == CUBLAS:
            if not _launch_cublas(a, b, bias, out, dt, odt, M, N, K, b_layout, s, under_capture):
                run(core_heuristic(M, N, K))  # first cuBLAS use of this stream is a capture
        else:
            _launch_sm90(SM90_CONFIGS[name], a, b, bias, out, dt, odt, M, N, K, b_layout, s,
                         group_m)

    if config is None:
        config = _choice(dt, b_layout, M, N, K, run, s, under_capture)
        if config == CUBLAS and impl == "sm90":  # the caller asked for our core
            config = core_heuristic(M, N, K)
    run(config)
    return out


_CHOICES: dict = {}  # (dtype, layout, M, N, K) -> (tuner table it came from, choice)


def _choice(dt, b_layout, M, N, K, run, s, under_capture) -> str:
    """What auto runs for this exact shape: remembered per shape while the tuner table it came
    from is the current one (tests and other processes may replace the table)."""
    key = (dt.name, b_layout, M, N, K)
    hit = _CHOICES.get(key)
    tuning = knobs.gemm_tune()
    if hit is not None and hit[0] is (_TUNER_TABLE if tuning else None):
        return hit[1]
    config = None
    if tuning:
        config = _tuned_config(tune_key(dt, b_layout, M, N, K), run, s, tune=not under_capture)
    decided = config is not None or not tuning
    config = config or _heuristic(M, N, K)
    if decided and len(_CHOICES) < 4096:
        _CHOICES[key] = (_TUNER_TABLE if tuning else None, config)
    return config


def hooks_kernel(impl: str) -> str:
    """Name of the hook-exercising kernel of gemm.cu (tests)."""
    return "gemm_hooks_sm90<__nv_bfloat16>" if impl == "sm90" else "gemm_hooks_sm80<__nv_bfloat16>"
