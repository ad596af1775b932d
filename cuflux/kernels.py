"""Run-time compilation and loading of kernels_cu/*.cu.

One loader for every op. Sources are compiled by NVRTC (through cuda-bindings, so it also
works on a machine without a GPU: `compile_all` checks every kernel for sm_80 and sm_90a in CI)
into cubins cached on disk under a key that covers the .cu, every header in
kernels_cu/include, the options, the target and the NVRTC version (CuPy's own cache key does
not cover headers). Cubins are loaded through cupy.RawModule and every kernel of a module is
fetched at load time: with lazy module loading, loading a module while a stream is blocked on
a flag can deadlock the process.

The cache (CUFLUX_CACHE_DIR, else $XDG_CACHE_HOME/cuflux, else ~/.cache/cuflux) is shared by
every process of the user on the machine:
- a file is compiled once per machine: the ranks that miss the cache queue on a lock file beside
  the cubin (fcntl.flock, bounded by COMPILE_LOCK_TIMEOUT_S); the one that gets it compiles,
  the others find the cubin when they get the lock in turn;
- compiled code is loaded from it, so the directory must be the user's own (or root's: an image
  built as root, run as a user) and writable by its owner alone; cuflux creates it 0700 and
  refuses any other (CacheDirError);
- files are written under unpredictable names created exclusively (mkstemp) in the same
  directory, then renamed into place: a reader sees the old file or the whole new one;
- each cubin's SHA-256 is recorded beside it at write time and checked before it is used; a
  mismatch is recompiled.

`python -m cuflux.compile` fills the cache ahead of time (an image build, a login node).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import json
import os
import pathlib
import stat
import sys
import tempfile
import threading
import time
import warnings
from typing import Iterable, Sequence

from cuflux import knobs
from cuflux.errors import CompileError  # the one class (kernels.CompileError is the same)

__all__ = ["KERNEL_DIR", "KernelFamily", "register", "families", "compile_source", "compile_ptx",
           "compile_all", "compile_family", "cache_dir", "cache_entry", "CacheEntry", "Compiled",
           "load", "launch", "prepare", "bind", "device_arch", "CompileError", "CacheDirError",
           "COMPILE_LOCK_TIMEOUT_S"]

KERNEL_DIR = pathlib.Path(__file__).resolve().parent.parent / "kernels_cu"
if not KERNEL_DIR.is_dir():  # installed without the source tree: kernels ship inside the package
    KERNEL_DIR = pathlib.Path(__file__).resolve().parent / "kernels_cu"
INCLUDE_DIR = KERNEL_DIR / "include"

BASE_OPTIONS = ("--std=c++17", "-default-device", "--use_fast_math", "-lineinfo")

# How long a process waits for another one compiling the same cubin (the slowest file takes
# ~40 s on a 2-core machine; ranks of one machine may queue behind each other's files).
COMPILE_LOCK_TIMEOUT_S = 600.0
# Part of every cache key: a change of the on-disk format leaves old entries unused.
_CACHE_FORMAT = 2


class CacheDirError(CompileError):
    """The kernel cache directory cannot be trusted or used (wrong owner, mode, not a dir)."""


@dataclasses.dataclass(frozen=True)
class KernelFamily:
    """One .cu file and the kernels Python uses from it.

    names: extern "C" names or template name expressions (e.g. "all2all<__nv_bfloat16, 16>").
    min_arch: lowest compute capability (as 80, 90) the file supports (90 for wgmma/TMA code).
    directory: where the .cu lies; None: KERNEL_DIR, the package's kernels (a family registered
      with a directory of its own is not the package's: the tests' kernels, tests/kernels_cu).
      Its headers come from KERNEL_DIR/include all the same.
    """

    source: str
    names: tuple[str, ...]
    min_arch: int = 80
    directory: pathlib.Path | None = None


# Which module registers each kernel family (by calling `register` when it is imported). This
# module imports none of them: a family's module is imported by name, the first time that family
# is asked for, so kernels.py sits below the ops with no import circle. A new .cu needs a line
# here (tests/test_compile.py checks that every kernels_cu/*.cu has one).
_FAMILY_MODULES = {
    "signal.cu": "cuflux.signal",
    "allreduce.cu": "cuflux.ops.allreduce",
    "allgather.cu": "cuflux.ops.allgather",
    "all2all.cu": "cuflux.ops.all2all",
    "gemm.cu": "cuflux.gemm_core",
    "ag_gemm.cu": "cuflux.ops.ag_gemm",
    "gemm_rs.cu": "cuflux.ops.gemm_rs",
}

_REGISTRY: dict[str, KernelFamily] = {}
_LOADED: dict[tuple, "LoadedModule"] = {}
_LOCK = threading.Lock()


def register(source: str, names: Iterable[str], min_arch: int = 80,
             directory: str | os.PathLike | None = None) -> KernelFamily:
    """Register the kernels `names` of `source` (a file of KERNEL_DIR, or of `directory`)."""
    if directory is not None and source in _FAMILY_MODULES:
        raise ValueError(f"kernels.register: {source} is a family of the package (KERNEL_DIR); "
                         f"a family from {directory} needs another file name")
    fam = KernelFamily(source, tuple(names), min_arch,
                       None if directory is None else pathlib.Path(directory).resolve())
    _REGISTRY[source] = fam
    return fam


def _source_path(source: str) -> pathlib.Path:
    """Where the .cu of `source` lies: its registered directory, else KERNEL_DIR."""
    fam = _REGISTRY.get(source)
    return (fam.directory if fam is not None and fam.directory is not None
            else KERNEL_DIR) / source


def _family(source: str) -> KernelFamily | None:
    """The registered family of `source`, importing the module that registers it if need be."""
    fam = _REGISTRY.get(source)
    if fam is None and source in _FAMILY_MODULES:
        module = _FAMILY_MODULES[source]
        importlib.import_module(module)
        fam = _REGISTRY.get(source)
        if fam is None:
            raise RuntimeError(f"kernels._FAMILY_MODULES names {module} as the module that "
                               f"registers {source}, but importing it registered nothing for it")
    return fam


def families() -> dict[str, KernelFamily]:
    """Every kernel family: those of _FAMILY_MODULES and any registered by other code."""
    for source in _FAMILY_MODULES:
        _family(source)
    return dict(_REGISTRY)


def _cuda_include_dirs() -> list[str]:
    dirs = []
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            dirs.append(str(found))
    except Exception:  # no cuda-pathfinder, or no headers package: the fixed places below
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


def cache_dir() -> pathlib.Path:
    """The kernel cache directory, created 0700; refused unless it is private (CacheDirError)."""
    p = pathlib.Path(knobs.cache_dir())
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(p)
    except OSError as e:
        raise CacheDirError(f"cuflux: cannot create the kernel cache directory {p}: {e}. Set "
                            f"CUFLUX_CACHE_DIR to a directory of your own.") from e
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "not a directory"
    elif st.st_uid not in (os.getuid(), 0):
        # root's is accepted: an image whose cache was filled by root at build time
        problem = f"owned by uid {st.st_uid}, not by you (uid {os.getuid()}) or root"
    elif st.st_mode & 0o022:
        problem = f"writable by others than its owner (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem:
        raise CacheDirError(
            f"cuflux: refusing the kernel cache directory {p}: it is {problem}. cuflux loads "
            f"compiled GPU code from it, so only you may write there. Fix: `chmod 700 {p}` if it "
            f"is yours, or set CUFLUX_CACHE_DIR to a directory of your own (cuflux creates it "
            f"with mode 0700).")
    return p




def _options(arch: str, defines: Sequence[str] = ()) -> list[str]:
    options = list(BASE_OPTIONS) + [f"-arch={arch}", f"-I{INCLUDE_DIR}"]
    return options + [f"-I{d}" for d in _cuda_include_dirs()] + [f"-D{d}" for d in defines]


def _compile_program(nvrtc, prog, source: str, arch: str, names, options) -> None:
    for n in names:
        _check(nvrtc, nvrtc.nvrtcAddNameExpression(prog, n.encode()), f"name {n}")
    opts = [o.encode() for o in options]
    res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    # NVRTC writes into the buffers it is given: bytearrays, never bytes (b" " * 1 is CPython's
    # shared one-byte object, and an empty log is one NUL: it would turn every b" " into b"\0")
    log = bytearray(nvrtc.nvrtcGetProgramLogSize(prog)[1])
    nvrtc.nvrtcGetProgramLog(prog, log)
    if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"compiling {source} for {arch} failed:\n"
                           f"{log.decode(errors='replace').rstrip(chr(0))}")


def _run_nvrtc(code: bytes, source: str, names: Sequence[str], arch: str,
               options: Sequence[str]) -> tuple[bytes, dict[str, str]]:
    """One NVRTC compilation to a cubin: (cubin, {name expression: lowered name})."""
    nvrtc = _nvrtc()
    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(code, source.encode(), 0, [], []), "create")[0]
    try:
        _compile_program(nvrtc, prog, source, arch, names, options)
        size = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "cubin size")[0]
        buf = bytearray(size)
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, buf), "cubin")
        cubin = bytes(buf)
        lowered = {}
        for n in names:
            low = _check(nvrtc, nvrtc.nvrtcGetLoweredName(prog, n.encode()), f"lowered {n}")[0]
            lowered[n] = low.decode() if isinstance(low, bytes) else str(low)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, lowered


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """Where one compilation lives in the cache: the cubin, its metadata (lowered names and the
    cubin's SHA-256) and the lock file that processes compiling it queue on."""

    cubin_path: pathlib.Path
    meta_path: pathlib.Path
    lock_path: pathlib.Path


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A cubin from the cache: its bytes, lowered names, path, and whether this call compiled it."""

    cubin: bytes
    lowered: dict
    path: pathlib.Path
    compiled: bool


def _key_parts(source: str, names: Sequence[str], arch: str, defines: Sequence[str]):
    code = _source_path(source).read_bytes()
    options = _options(arch, defines)
    nvrtc = _nvrtc()
    version = _check(nvrtc, nvrtc.nvrtcVersion(), "version")
    # The key names the include dirs by content (our headers' digest) rather than by absolute
    # path, so a cache filled by one checkout serves another.
    key_options = [o for o in options if not o.startswith("-I")]
    key = hashlib.sha256(json.dumps([_CACHE_FORMAT, source, code.hex(), _headers_digest(),
                                     key_options, list(names), list(version)]).encode())
    base = cache_dir() / f"{pathlib.Path(source).stem}-{arch}-{key.hexdigest()[:24]}"
    entry = CacheEntry(base.with_suffix(".cubin"), base.with_suffix(".json"),
                       base.with_suffix(".lock"))
    return code, options, entry


def cache_entry(source: str, names: Sequence[str], arch: str,
                defines: Sequence[str] = ()) -> CacheEntry:
    """The cache paths of kernels_cu/<source> compiled for `arch` (nothing is compiled)."""
    return _key_parts(source, names, arch, defines)[2]


def _read_cached(entry: CacheEntry, warn: bool) -> tuple[bytes, dict] | None:
    """The cached cubin and lowered names, if both are there and the cubin's hash matches."""
    try:
        meta = json.loads(entry.meta_path.read_text())
        cubin = entry.cubin_path.read_bytes()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        meta, cubin = {"error": str(e)}, b""
    ok = (isinstance(meta, dict) and isinstance(meta.get("lowered"), dict)
          and meta.get("cubin_sha256") == hashlib.sha256(cubin).hexdigest())
    if not ok:
        if warn:
            warnings.warn(f"cuflux: cached kernel {entry.cubin_path} does not match the SHA-256 "
                          f"recorded when it was written; recompiling it", RuntimeWarning,
                          stacklevel=3)
        return None
    return cubin, meta["lowered"]


@contextlib.contextmanager
def _compile_lock(entry: CacheEntry, source: str, arch: str):
    """Hold the lock of one cache entry: one process of the machine compiles it at a time."""
    try:
        fd = os.open(entry.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as e:
        raise CacheDirError(
            f"cuflux: {source} for {arch} is not in the kernel cache {entry.lock_path.parent} "
            f"and the lock to compile it cannot be created there ({e}). Compile ahead of time "
            f"where the cache is writable (`python -m cuflux.compile --arch {arch}`), or set "
            f"CUFLUX_CACHE_DIR to a directory of your own.") from e
    try:
        deadline = time.monotonic() + COMPILE_LOCK_TIMEOUT_S
        delay_s = 0.02
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise CompileError(
                        f"cuflux: waited {COMPILE_LOCK_TIMEOUT_S:g} s for another process "
                        f"compiling {source} for {arch} (it holds {entry.lock_path}); it may be "
                        f"stuck: find it with `fuser {entry.lock_path}`, or compile ahead of "
                        f"time with `python -m cuflux.compile`") from None
                time.sleep(min(delay_s, left_s))
                delay_s = min(2 * delay_s, 0.5)
        yield
    finally:
        os.close(fd)  # releases the lock


_NOTICE_LOCK = threading.Lock()
_NOTICE_GIVEN = False


def _notice(source: str, arch: str, directory: pathlib.Path) -> None:
    """Say once per process that kernels are being compiled, and why it is slow."""
    global _NOTICE_GIVEN
    with _NOTICE_LOCK:
        if _NOTICE_GIVEN:
            return
        _NOTICE_GIVEN = True
    print(f"cuflux: compiling kernels_cu/{source} for {arch} with NVRTC: up to ~40 s a file, "
          f"once per machine (cached in {directory}; `python -m cuflux.compile` does it ahead "
          f"of time)", file=sys.stderr, flush=True)


def _compile_cached(source: str, names: Sequence[str], arch: str, defines: Sequence[str] = (),
                    notice: bool = True) -> Compiled:
    code, options, entry = _key_parts(source, names, arch, defines)
    hit = _read_cached(entry, warn=False)
    if hit is not None:
        return Compiled(hit[0], hit[1], entry.cubin_path, False)
    with _compile_lock(entry, source, arch):
        hit = _read_cached(entry, warn=True)  # another process may have compiled it meanwhile
        if hit is not None:
            return Compiled(hit[0], hit[1], entry.cubin_path, False)
        if notice:
            _notice(source, arch, entry.cubin_path.parent)
        cubin, lowered = _run_nvrtc(code, source, names, arch, options)
        # cubin first, then the metadata naming its hash: a reader of the new metadata finds
        # the new cubin
        write_atomically(entry.cubin_path, cubin)
        write_atomically(entry.meta_path, json.dumps(
            {"source": source, "arch": arch, "lowered": lowered,
             "cubin_sha256": hashlib.sha256(cubin).hexdigest()}).encode())
    return Compiled(cubin, lowered, entry.cubin_path, True)


def compile_source(source: str, names: Sequence[str], arch: str,
                   defines: Sequence[str] = ()) -> tuple[bytes, dict[str, str]]:
    """Compile kernels_cu/<source> for `arch` ("sm_80", "sm_90a"); return (cubin, lowered names).

    Needs no GPU. Results are cached on disk, shared by the processes of the machine.
    """
    got = _compile_cached(source, names, arch, defines)
    return got.cubin, got.lowered


def compile_family(family: KernelFamily, arch: str, *, notice: bool = True) -> Compiled:
    """Compile (or find in the cache) one registered family for `arch`."""
    return _compile_cached(family.source, family.names, arch, (), notice)


def write_atomically(path: pathlib.Path, data: bytes) -> None:
    """Write aside, then rename into place: processes sharing the cache (ranks compiling or
    loading the same module at once) never read a file another is still writing. The file
    aside is created exclusively under an unpredictable name in the same directory (mkstemp:
    O_EXCL, so it never follows a planted link). Files are 0644: the directory (0700, or one an
    image's builder opened to its users) is what keeps others out."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def compile_ptx(source: str, names: Sequence[str], arch: str,
                defines: Sequence[str] = ()) -> str:
    """PTX of kernels_cu/<source> for `arch`, compiled with the loader's own options (for tests
    that check which instructions a kernel uses). Needs no GPU; not cached."""
    nvrtc = _nvrtc()
    options = _options(arch, defines)
    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(_source_path(source).read_bytes(),
                                                  source.encode(), 0, [], []), "create")[0]
    try:
        _compile_program(nvrtc, prog, source, arch, names, options)
        size = _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "PTX size")[0]
        buf = bytearray(size)
        _check(nvrtc, nvrtc.nvrtcGetPTX(prog, buf), "PTX")
        return buf.decode(errors="replace").rstrip("\0")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def arch_number(arch: str) -> int:
    """Compute capability of an NVRTC target as an int: "sm_90a" -> 90."""
    return int("".join(c for c in arch if c.isdigit()))


def compile_all(archs: Sequence[str] = ("sm_80", "sm_90a")) -> dict[tuple[str, str], int]:
    """Compile every registered kernel family for every target; return cubin sizes."""
    sizes = {}
    for fam in families().values():
        for arch in archs:
            if arch_number(arch) < fam.min_arch:
                continue
            sizes[(fam.source, arch)] = len(compile_family(fam, arch).cubin)
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

        # loaded from the cache entry whose hash was just checked (a private directory)
        got = compile_family(family, arch)
        self.family, self.arch = family, arch
        self._module = cupy.RawModule(path=str(got.path))
        self.functions = {n: self._module.get_function(got.lowered[n]) for n in family.names}
        # Each kernel's CUfunction resolved now, under this module's device (load() makes it
        # current): launch resolves a kernel once and keeps it, and a first launch made with
        # another GPU current would have resolved (and kept) that GPU's copy.
        for fn in self.functions.values():
            _launch._function(fn)

    def __getitem__(self, name: str):
        try:
            return self.functions[name]
        except KeyError:
            raise KeyError(f"{self.family.source}: kernel {name!r} is not registered; "
                           f"registered: {sorted(self.functions)}") from None


def load(source: str, device_id: int | None = None) -> LoadedModule:
    """The loaded module of a registered family on the current (or given) device, memoised."""
    import cupy

    fam = _family(source)
    if fam is None:
        raise KeyError(f"kernel family {source!r} is not registered")
    # Loaded already: no device queries (ops and baselines call this on their call paths).
    mod = _LOADED.get((source, _launch.current_device() if device_id is None else device_id,
                       fam.names))
    if mod is not None:
        return mod
    dev = cupy.cuda.Device(device_id).id if device_id is not None else cupy.cuda.Device().id
    arch = device_arch(dev)
    if arch_number(arch) < fam.min_arch:
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


from cuflux import launch as _launch  # noqa: E402  (no import of kernels there: no circle)


def launch(kernel, grid, block, args, stream, *, op: str, name: str, shared_mem: int = 0,
           pdl: bool = False) -> None:
    """Launch a loaded kernel: cuflux.launch.kernel (the short host path; its docstring says
    which argument types map to which C parameters). A CUDA error raises CudaError naming the
    op and the kernel."""
    _launch.kernel(kernel, grid, block, args, stream, op=op, name=name, shared_mem=shared_mem,
                   pdl=pdl)


def bind(kernel, grid: int, block: int, args, *, op: str, name: str,
         shared_mem: int = 0, pdl: bool = False) -> "_launch.Bound":
    """launch()'s arguments packed once into a cuflux.launch.Bound, called with the stream
    handle alone (a call an op has seen before: base.CallMemo)."""
    return _launch.bind(kernel, grid, block, args, op=op, name=name, shared_mem=shared_mem,
                        pdl=pdl)


def prepare(kernel, grid, block, args, varying: int, *, op: str, name: str,
            shared_mem: int = 0, first: int = 0) -> "_launch.Prepared":
    """A launch of a loaded kernel whose arguments are all fixed but `varying` device pointers
    from argument `first` on: cuflux.launch.Prepared, called with the stream and those
    pointers (an op's cached plan: its argument block is packed once, not at every call)."""
    return _launch.Prepared(kernel, grid, block, args, varying, op=op, name=name,
                            shared_mem=shared_mem, first=first)
