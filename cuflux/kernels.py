"""Run-time compilation and loading of kernels_cu/*.cu.

One loader for every op. Sources are compiled by NVRTC (through cuda-bindings, so it also
works on a machine without a GPU: `compile_all` checks every kernel for sm_80 and sm_90a in CI)
into cubins cached on disk under a key that covers the .cu, every header in
kernels_cu/include, the options, the target and the NVRTC version (CuPy's own cache key does
not cover headers). Cubins are loaded through cupy.RawModule and every kernel of a module is
fetched at load time: with lazy module loading, loading a module while a stream is blocked on
a flag can deadlock the process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import threading
from typing import Callable, Iterable, Sequence

__all__ = ["KERNEL_DIR", "KernelFamily", "register", "families", "compile_source", "compile_ptx",
           "compile_all",
           "load", "device_arch", "CompileError"]

KERNEL_DIR = pathlib.Path(__file__).resolve().parent.parent / "kernels_cu"
if not KERNEL_DIR.is_dir():  # installed without the source tree: kernels ship inside the package
    KERNEL_DIR = pathlib.Path(__file__).resolve().parent / "kernels_cu"
INCLUDE_DIR = KERNEL_DIR / "include"

BASE_OPTIONS = ("--std=c++17", "-default-device", "--use_fast_math", "-lineinfo")


class CompileError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class KernelFamily:
    """One .cu file and the kernels Python uses from it.

    names: extern "C" names or template name expressions (e.g. "all2all<__nv_bfloat16, 16>").
    min_arch: lowest compute capability (as 80, 90) the file supports (90 for wgmma/TMA code).
    """

    source: str
    names: tuple[str, ...]
    min_arch: int = 80


_REGISTRY: dict[str, KernelFamily] = {}
_LOADED: dict[tuple, "LoadedModule"] = {}
_LOCK = threading.Lock()


def register(source: str, names: Iterable[str], min_arch: int = 80) -> KernelFamily:
    fam = KernelFamily(source, tuple(names), min_arch)
    _REGISTRY[source] = fam
    return fam


def families() -> dict[str, KernelFamily]:
    import cuflux.ops  # noqa: F401  (op modules register their kernels on import)

    return dict(_REGISTRY)


def _cuda_include_dirs() -> list[str]:
    dirs = []
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            dirs.append(str(found))
    except Exception:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    dirs += ["/usr/local/cuda/include"]
    seen, out = set(), []
    for d in dirs:
        if d not in seen and os.path.isfile(os.path.join(d, "cuda_fp16.h")):
            seen.add(d)
            out.append(d)
    return out


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(INCLUDE_DIR.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(INCLUDE_DIR)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _nvrtc():
    from cuda.bindings import nvrtc

    return nvrtc


def _check(nvrtc, result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"NVRTC {what} failed: {err}")
    return result[1:] if isinstance(result, tuple) and len(result) > 1 else None


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("CUFLUX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cuflux")
    p = pathlib.Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def _options(arch: str, defines: Sequence[str] = ()) -> list[str]:
    options = list(BASE_OPTIONS) + [f"-arch={arch}", f"-I{INCLUDE_DIR}"]
    return options + [f"-I{d}" for d in _cuda_include_dirs()] + [f"-D{d}" for d in defines]


def _compile_program(nvrtc, prog, source: str, arch: str, names, options) -> None:
    for n in names:
        _check(nvrtc, nvrtc.nvrtcAddNameExpression(prog, n.encode()), f"name {n}")
    opts = [o.encode() for o in options]
    res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    log_size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
    log = b" " * log_size
    nvrtc.nvrtcGetProgramLog(prog, log)
    if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"compiling {source} for {arch} failed:\n"
                           f"{log.decode(errors='replace').rstrip(chr(0))}")


def compile_source(source: str, names: Sequence[str], arch: str,
                   defines: Sequence[str] = ()) -> tuple[bytes, dict[str, str]]:
    """Compile kernels_cu/<source> for `arch` ("sm_80", "sm_90a"); return (cubin, lowered names).

    Needs no GPU. Results are cached on disk.
    """
    nvrtc = _nvrtc()
    code = (KERNEL_DIR / source).read_bytes()
    options = _options(arch, defines)
    version = _check(nvrtc, nvrtc.nvrtcVersion(), "version")
    # The key names the include dirs by content (our headers' digest) rather than by absolute
    # path, so a cache filled by one checkout serves another.
    key_options = [o for o in options if not o.startswith("-I")]
    key = hashlib.sha256(json.dumps([source, code.hex(), _headers_digest(), key_options,
                                     list(names), list(version)]).encode()).hexdigest()[:24]
    cache = _cache_dir() / f"{pathlib.Path(source).stem}-{arch}-{key}"
    cubin_path, names_path = cache.with_suffix(".cubin"), cache.with_suffix(".json")
    if cubin_path.exists() and names_path.exists():
        return cubin_path.read_bytes(), json.loads(names_path.read_text())

    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(code, source.encode(), 0, [], []), "create")[0]
    try:
        _compile_program(nvrtc, prog, source, arch, names, options)
        size = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "cubin size")[0]
        cubin = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        lowered = {}
        for n in names:
            low = _check(nvrtc, nvrtc.nvrtcGetLoweredName(prog, n.encode()), f"lowered {n}")[0]
            lowered[n] = low.decode() if isinstance(low, bytes) else str(low)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    write_atomically(cubin_path, cubin)
    write_atomically(names_path, json.dumps(lowered).encode())
    return cubin, lowered


def write_atomically(path: pathlib.Path, data: bytes) -> None:
    """Write aside, then rename into place: processes sharing the cache (ranks compiling or
    loading the same module at once) never read a file another is still writing."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def compile_ptx(source: str, names: Sequence[str], arch: str,
                defines: Sequence[str] = ()) -> str:
    """PTX of kernels_cu/<source> for `arch`, compiled with the loader's own options (for tests
    that check which instructions a kernel uses). Needs no GPU; not cached."""
    nvrtc = _nvrtc()
    options = _options(arch, defines)
    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram((KERNEL_DIR / source).read_bytes(),
                                                  source.encode(), 0, [], []), "create")[0]
    try:
        _compile_program(nvrtc, prog, source, arch, names, options)
        size = _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "PTX size")[0]
        buf = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetPTX(prog, buf), "PTX")
        return buf.decode(errors="replace").rstrip("\0")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_all(archs: Sequence[str] = ("sm_80", "sm_90a")) -> dict[tuple[str, str], int]:
    """Compile every registered kernel family for every target; return cubin sizes."""
    sizes = {}
    for fam in families().values():
        for arch in archs:
            if int("".join(c for c in arch if c.isdigit())) < fam.min_arch:
                continue
            cubin, _ = compile_source(fam.source, fam.names, arch)
            sizes[(fam.source, arch)] = len(cubin)
    return sizes


def device_arch(device_id: int | None = None) -> str:
    """NVRTC target for a device: sm_XY, with the arch-specific 'a' suffix on 9.0 and 10.0."""
    import cupy

    dev = cupy.cuda.Device(device_id)
    cc = int(dev.compute_capability)
    return f"sm_{cc}a" if cc in (90, 100) else f"sm_{cc}"


class LoadedModule:
    """A loaded cubin with every registered kernel already fetched (eager loading)."""

    def __init__(self, family: KernelFamily, arch: str):
        import cupy

        cubin, lowered = compile_source(family.source, family.names, arch)
        key = hashlib.sha256(cubin).hexdigest()[:24]
        path = _cache_dir() / f"load-{key}.cubin"
        if not path.exists():
            write_atomically(path, cubin)
        self.family, self.arch = family, arch
        self._module = cupy.RawModule(path=str(path))
        self.functions = {n: self._module.get_function(lowered[n]) for n in family.names}

    def __getitem__(self, name: str):
        try:
            return self.functions[name]
        except KeyError:
            raise KeyError(f"{self.family.source}: kernel {name!r} is not registered; "
                           f"registered: {sorted(self.functions)}") from None


def load(source: str, device_id: int | None = None) -> LoadedModule:
    """The loaded module of a registered family on the current (or given) device, memoised."""
    import cupy

    fam = families().get(source)
    if fam is None:
        raise KeyError(f"kernel family {source!r} is not registered")
    dev = cupy.cuda.Device(device_id).id if device_id is not None else cupy.cuda.Device().id
    arch = device_arch(dev)
    if int("".join(c for c in arch if c.isdigit())) < fam.min_arch:
        raise RuntimeError(f"{source} needs compute capability >= {fam.min_arch}, "
                           f"device {dev} is {arch}")
    key = (source, dev, fam.names)
    with _LOCK:
        mod = _LOADED.get(key)
        if mod is None:
            with cupy.cuda.Device(dev):
                mod = LoadedModule(fam, arch)
            _LOADED[key] = mod
    return mod


def launch(kernel, grid, block, args, stream, *, op: str, name: str, shared_mem: int = 0,
           pdl: bool = False, arg_types=None) -> None:
    """Launch a loaded kernel; a CUDA error raises CudaError naming the op and kernel.

    pdl=True (compute capability >= 9.0; a plain launch below): programmatic stream
    serialisation, so the kernel's CTAs may become resident before the kernel ahead of it on the
    stream has ended. The kernel must execute griddepcontrol.wait before it touches memory
    earlier work writes or reads. A PDL launch takes its arguments as plain Python ints with
    arg_types (ctypes types, one per argument): the short host path for ops that launch tens of
    thousands of times a second."""
    from cuflux.errors import CudaError

    if pdl and arg_types is None:
        raise TypeError(f"{op}: a PDL launch of {name} needs arg_types")
    try:
        if pdl and _pdl_capable():
            _launch_pdl(kernel, grid, block, args, stream, shared_mem, arg_types)
        else:
            if arg_types is not None:  # plain ints as the kernel's integer / pointer types
                import ctypes

                import numpy as np

                args = tuple(np.dtype(ctypes.c_uint64 if t is ctypes.c_void_p else t).type(v)
                             for v, t in zip(args, arg_types))
            kernel(grid, block, args, stream=stream, shared_mem=shared_mem)
    except Exception as e:  # CuPy raises CUDADriverError / CUDARuntimeError
        raise CudaError(f"{op}: launching kernel {name} failed: {e}") from e


_PDL_DEVICES: dict = {}  # device id -> compute capability >= 9.0


def _pdl_capable() -> bool:
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    ok = _PDL_DEVICES.get(dev)
    if ok is None:
        ok = _PDL_DEVICES[dev] = int(cupy.cuda.Device(dev).compute_capability) >= 90
    return ok


_PDL_CONFIGS: dict = {}  # (function, grid, block, smem, stream) -> (CUlaunchConfig, CUfunction)


def _launch_pdl(kernel, grid, block, args, stream, shared_mem: int, arg_types) -> None:
    """cuLaunchKernelEx with programmatic stream serialisation. The host path is kept short
    (configurations cached, arguments typed by the caller): at W = 1 All2AllHeads moves 128 MiB
    in ~33 us and the host must stay ahead of that."""
    from cuda.bindings import driver as cu

    key = (kernel.kernel.ptr, tuple(grid), tuple(block), shared_mem, stream.ptr)
    entry = _PDL_CONFIGS.get(key)
    if entry is None:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        g, b = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        lc = cu.CUlaunchConfig()
        lc.gridDimX, lc.gridDimY, lc.gridDimZ = g
        lc.blockDimX, lc.blockDimY, lc.blockDimZ = b
        lc.sharedMemBytes = shared_mem
        lc.hStream = cu.CUstream(stream.ptr)
        lc.attrs = [attr]
        lc.numAttrs = 1
        if len(_PDL_CONFIGS) >= 256:  # grids follow token counts: bounded
            _PDL_CONFIGS.clear()
        entry = _PDL_CONFIGS[key] = (lc, cu.CUfunction(kernel.kernel.ptr))
    err, = cu.cuLaunchKernelEx(entry[0], entry[1], (tuple(args), tuple(arg_types)), 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx: {err}")
