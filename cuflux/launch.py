"""Kernel launches with a short host path: cuLaunchKernel through CuPy's Cython binding,
cuLaunchKernelEx (PDL) through ctypes, with argument blocks packed by `struct`.

Why not CuPy's RawKernel call: on the H200 machine it costs 6.5 us with one argument and 14 us
with 24, most of it converting each argument (scripts/probe_host.py); the driver call itself is
about 5 us. An op call must stay near 10 us of host time in all (issue: host path), so every
launch here packs its arguments with one `struct.Struct.pack_into` into a buffer built once per
argument signature (the tuple of the arguments' Python types), whose parameter pointer array
is built once too, and calls the driver directly: 7 us for 24 arguments, 1 us of it Python.

Arguments, by type (the kernel's C parameter must match; tests/kernel_args.py checks the ops'
tuples against the .cu signatures on the CPU):
  numpy.uint64 / int64 / uint32 / int32 / float32   the scalar, native width
  cupy.ndarray (or anything with .data.ptr)        its device pointer (8 bytes)
  bytes of 128 (TMA descriptors), numpy.void        the bytes, by value
Plain Python ints are refused: their C width is not knowable from the value.

`pdl=True` launches with programmatic stream serialisation (cuLaunchKernelEx, compute
capability >= 9.0; a plain launch below): the kernel's CTAs may become resident before the
kernel ahead of it on the stream has ended, and must run griddepcontrol.wait before touching
memory earlier work writes or reads.

Launches are capturable in CUDA graphs (driver launches on a capturing stream become kernel
nodes with the packed argument values).

`Prepared`: a launch whose arguments are all fixed but a few consecutive device pointers,
packed once; a call writes those pointers and calls the driver. `Bound` (Prepared.bind): the
pointers fixed too, a call is the driver call alone (an op's memo of a call it has seen).
`graph_replay`: such launches captured once into a CUDA graph, a call one cudaGraphLaunch.

The driver call goes through CuPy's Cython binding of cuLaunchKernel
(cupy_backends.cuda.api.driver.launchKernel: plain integers in, no per-argument conversion),
not ctypes, whose argtypes convert each of cuLaunchKernel's eleven arguments on every call
(ctypes stays for PDL's cuLaunchKernelEx, which CuPy does not bind, and where CuPy's backend
module is missing). Measured interleaved on the H200 machine
(scripts/results/probe_launch-h200-2026-12-02e.txt): a bare launch with its block built once
3.7-4.1 us through the binding, 5.6 through ctypes; `kernel` with seven arguments 6.1 us,
CuPy's RawKernel launch 6.2, a `Prepared` launch 4.9; the packing `kernel` does per call
(pointers, pack_into) is 1.1 us.
"""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np

__all__ = ["kernel", "Prepared", "Bound", "bind", "GraphReplay", "graph_replay", "capture_graph",
           "capturing", "driver_lib"]

_FORMATS = {np.uint64: "Q", np.int64: "q", np.uint32: "I", np.int32: "i", np.float32: "f",
            np.uint16: "H", np.int16: "h", np.uint8: "B", bytes: "128s", np.void: "128s"}

_lib = None
_lib_lock = threading.Lock()
_launch_kernel = None  # cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra)


class _CtypesLaunchError(RuntimeError):
    """A failed launch through the ctypes fallback (.status: the CUresult), as CuPy's
    CUDADriverError carries it."""

    def __init__(self, status: int):
        super().__init__(f"CUresult {status}")
        self.status = status


_DriverError = _CtypesLaunchError  # what _launch_kernel raises (CuPy's error once bound)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: 72 bytes, value at 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint8 * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig: 56 bytes (cuda.h, CUDA 12 and 13)
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def driver_lib():
    """libcuda through ctypes, with the prototypes cuflux calls (loaded on first use)."""
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                lib = ctypes.CDLL("libcuda.so.1")
                vp, u = ctypes.c_void_p, ctypes.c_uint
                lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
                lib.cuLaunchKernel.restype = ctypes.c_int
                lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), vp, vp, vp]
                lib.cuLaunchKernelEx.restype = ctypes.c_int
                lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                lib.cuGetErrorName.restype = ctypes.c_int
                lib.cuTensorMapEncodeTiled.argtypes = [
                    vp, ctypes.c_int, u, vp, vp, vp, vp, vp, ctypes.c_int, ctypes.c_int,
                    ctypes.c_int, ctypes.c_int]
                lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
                _lib = lib
    return _lib


def launcher():
    """cuLaunchKernel taking plain integers (CuPy's Cython binding; ctypes where CuPy's
    backend module is not there), bound once; it raises _DriverError on a failed launch."""
    global _launch_kernel, _DriverError
    if _launch_kernel is None:
        try:
            from cupy_backends.cuda.api import driver
            binding = (driver.CUDADriverError, driver.launchKernel)
        except (ImportError, AttributeError):  # no such backend: ctypes, the same contract
            binding = (_CtypesLaunchError, _ctypes_launch)
        _DriverError, _launch_kernel = binding  # the error first: a racing caller reads both
    return _launch_kernel


def _ctypes_launch(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra) -> None:
    err = (_lib or driver_lib()).cuLaunchKernel(func, gx, gy, gz, bx, by, bz, smem, stream,
                                                params, extra or None)
    if err:
        raise _CtypesLaunchError(err)


def error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if driver_lib().cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {code}"


class _Packer:
    """The argument block of one signature: a buffer, its parameter pointers, which arguments
    are device arrays (passed as their pointer) and which are numpy voids (as bytes)."""

    __slots__ = ("struct", "buf", "params", "params_addr", "arrays", "voids", "lock")

    def __init__(self, types: tuple):
        fmt, arrays, voids = "=", [], []
        for i, t in enumerate(types):
            f = _FORMATS.get(t)
            if f is None:
                if hasattr(t, "data") or t.__name__ == "ndarray":  # cupy.ndarray and alikes
                    f = "Q"
                    arrays.append(i)
                else:
                    raise TypeError(f"argument {i}: type {t.__name__} has no fixed C width "
                                    f"(use a numpy scalar, a device array or 128 bytes)")
            if t is np.void:
                voids.append(i)
            fmt += f
        self.struct = struct.Struct(fmt)
        self.buf = ctypes.create_string_buffer(max(self.struct.size, 1))
        base, offsets, off = ctypes.addressof(self.buf), [], 0
        for piece in _pieces(fmt[1:]):
            offsets.append(base + off)
            off += struct.calcsize("=" + piece)
        self.params = (ctypes.c_void_p * max(len(offsets), 1))(*offsets)
        self.params_addr = ctypes.addressof(self.params)  # what the driver call takes
        self.arrays, self.voids = tuple(arrays), tuple(voids)
        self.lock = threading.Lock()


def _pieces(fmt: str) -> list[str]:
    """'QQ128si' -> ['Q', 'Q', '128s', 'i']."""
    out, num = [], ""
    for c in fmt:
        if c.isdigit():
            num += c
        else:
            out.append(num + c)
            num = ""
    return out


_PACKERS: dict = {}
_PDL_OK: dict = {}       # CUfunction -> compute capability >= 9.0 on its device
_PDL_CONFIGS: dict = {}  # (grid, block, smem, stream) -> _LaunchConfig


def _packer(args) -> _Packer:
    types = tuple(map(type, args))
    p = _PACKERS.get(types)
    if p is None:
        p = _PACKERS[types] = _Packer(types)
    return p


def kernel(fn, grid, block, args, stream, *, op: str, name: str, shared_mem: int = 0,
           pdl: bool = False) -> None:
    """Launch a loaded kernel (a cupy RawKernel / Function, or a raw CUfunction int) on
    `stream` (anything with .ptr, or a raw handle); a CUDA error raises CudaError naming the
    op and the kernel."""
    p = _packer(args)
    func = fn if isinstance(fn, int) else _function(fn)
    s = stream if isinstance(stream, int) else stream.ptr
    g = grid if isinstance(grid, int) else _one_dim(grid, "grid", name)
    b = block if isinstance(block, int) else _one_dim(block, "block", name)
    with p.lock:
        _pack(p, args, op, name)
        err = _driver_launch(func, g, b, shared_mem, s, p, pdl and _pdl_capable(func))
    if err:
        _launch_failed(op, name, g, b, shared_mem, err)


def _driver_launch(func: int, grid: int, block: int, shared_mem: int, stream: int,
                   p: _Packer, pdl: bool = False) -> int:
    """The driver call of every launch here, with p's block: cuLaunchKernel through the
    bound binding, or cuLaunchKernelEx (ctypes) with programmatic stream serialisation;
    its CUresult (0: launched)."""
    if pdl:
        return (_lib or driver_lib()).cuLaunchKernelEx(
            _pdl_config(grid, block, shared_mem, stream), func, p.params, None)
    try:
        (_launch_kernel or launcher())(func, grid, 1, 1, block, 1, 1, shared_mem, stream,
                                       p.params_addr, 0)
    except _DriverError as e:
        return e.status
    return 0


def _pack(p: _Packer, args, op: str, name: str) -> None:
    """Write `args` into p's block: arrays as their device pointers, voids as their bytes."""
    if p.arrays or p.voids:
        args = list(args)
        for i in p.arrays:
            args[i] = args[i].data.ptr
        for i in p.voids:
            args[i] = args[i].tobytes()
    try:
        p.struct.pack_into(p.buf, 0, *args)
    except struct.error as e:
        raise TypeError(f"{op}: arguments of kernel {name} do not fit their types: {e}") \
            from None


def _launch_failed(op: str, name: str, grid: int, block: int, shared_mem: int, err: int):
    from cuflux.errors import CudaError

    raise CudaError(f"{op}: launching kernel {name} (grid {grid}, block {block}, {shared_mem} "
                    f"bytes of shared memory) failed: {error_name(err)}")


class Prepared:
    """One kernel's launch with its argument block packed once: every argument is fixed but
    `varying` consecutive device pointers from argument `first` on, given at each call
    (`prepared(stream, *pointers)`, ints). For an op's cached plan, whose grid, block and
    other arguments do not change between calls. Thread-safe (the block is written under a
    lock); a CUDA error raises CudaError naming the op and the kernel, as `kernel` does."""

    __slots__ = ("func", "grid", "block", "shared_mem", "op", "name", "head", "offset",
                 "packer", "types")

    def __init__(self, fn, grid: int, block: int, args, varying: int, *, op: str, name: str,
                 shared_mem: int = 0, first: int = 0):
        self.types = tuple(map(type, args))
        p = self.packer = _Packer(self.types)  # its own block, never shared
        fmt = "".join("Q" if f == "Q" else "x" for f in _pieces(p.struct.format[1:]))
        if not (0 <= first and first + varying <= len(args)
                and fmt[first:first + varying] == "Q" * varying):
            raise TypeError(f"{op}: arguments {first} to {first + varying - 1} of kernel {name} "
                            f"must be device pointers (arrays or numpy.uint64), got format "
                            f"{p.struct.format!r}")
        _pack(p, args, op, name)
        # consecutive in the block ("=" packs no padding): one pack_into a call
        self.head = struct.Struct("=" + "Q" * varying)
        self.offset = p.params[first] - p.params[0] if args else 0
        self.func = fn if isinstance(fn, int) else _function(fn)
        self.grid, self.block, self.shared_mem = int(grid), int(block), int(shared_mem)
        self.op, self.name = op, name

    def __call__(self, stream, *pointers) -> None:
        p = self.packer
        s = stream if isinstance(stream, int) else stream.ptr
        with p.lock:
            self._write(p.buf, pointers)
            err = _driver_launch(self.func, self.grid, self.block, self.shared_mem, s, p)
        if err:
            _launch_failed(self.op, self.name, self.grid, self.block, self.shared_mem, err)

    def _write(self, buf, pointers) -> None:
        """The call's pointers into `buf` (this launch's block, or a bound copy of it)."""
        try:
            self.head.pack_into(buf, self.offset, *pointers)
        except struct.error as e:  # a count or a value that is not a pointer
            raise TypeError(f"{self.op}: kernel {self.name} takes {self.head.size // 8} "
                            f"pointers a call: {e}") from None

    def bind(self, *pointers) -> "Bound":
        """This launch with its pointers fixed too, in a block of its own that nothing writes
        again: a call is the driver's alone (an op's memo of a call seen before, base.CallMemo)."""
        p, b = self.packer, _Packer(self.types)
        ctypes.memmove(b.buf, p.buf, p.struct.size)
        self._write(b.buf, pointers)
        return Bound(self.func, self.grid, self.block, self.shared_mem, b, op=self.op,
                     name=self.name)


class Bound:
    """A launch with every argument fixed (Prepared.bind, or bind() for kernel()'s
    arguments): `bound(stream_handle)` (an int) calls the driver, nothing else. Its block is
    never written after it is made, so no lock is taken."""

    __slots__ = ("func", "grid", "block", "shared_mem", "params_addr", "packer", "op", "name",
                 "pdl")

    def __init__(self, func: int, grid: int, block: int, shared_mem: int, packer: _Packer, *,
                 op: str, name: str, pdl: bool = False):
        self.packer = packer  # the block lives as long as this
        self.func, self.grid, self.block, self.shared_mem = func, grid, block, shared_mem
        self.params_addr, self.op, self.name = packer.params_addr, op, name
        self.pdl = pdl and _pdl_capable(func)  # as kernel(): a plain launch below sm_90

    def __call__(self, stream: int) -> None:
        err = _driver_launch(self.func, self.grid, self.block, self.shared_mem, stream,
                             self.packer, self.pdl)
        if err:
            _launch_failed(self.op, self.name, self.grid, self.block, self.shared_mem, err)


def bind(fn, grid: int, block: int, args, *, op: str, name: str, shared_mem: int = 0,
         pdl: bool = False) -> Bound:
    """kernel()'s launch of `args` as a Bound: packed once into a block of its own."""
    p = _Packer(tuple(map(type, args)))
    _pack(p, args, op, name)
    return Bound(fn if isinstance(fn, int) else _function(fn), int(grid), int(block),
                 int(shared_mem), p, op=op, name=name, pdl=pdl)


# ---- CUDA graphs of bound launches (a call an op has seen before) ----------------------------
class GraphReplay:
    """Launches that each take a stream handle and enqueue capturable work (Bound, a
    cudaMemcpyAsync with its arguments fixed, ...), replayed as one CUDA graph: captured at
    the first call (on a private stream of the current device), then one cudaGraphLaunch a
    call on the call's stream (~3 us of host time on the H200 machine, where each kernel
    launch costs 4-5: scripts/results/probe_call_path-h200-2026-12-02e.txt). On a stream the
    caller is capturing, the launches themselves (captured into the caller's graph). Launches
    of one graph exec run in order, whichever streams they are on (cudaGraphLaunch)."""

    __slots__ = ("launches", "exec", "op", "what", "__weakref__")

    def __init__(self, launches, *, op: str, what: str):
        self.launches, self.exec, self.op, self.what = tuple(launches), None, op, what

    def __call__(self, stream: int) -> None:
        if capturing(stream):
            for launch in self.launches:
                launch(stream)
            return
        g = self.exec
        if g is None:
            g = self.exec = self._capture()
        if g is _DIRECT:
            for launch in self.launches:
                launch(stream)
            return
        try:
            with _GRAPH_LOCK:  # graph objects are not thread-safe (torch's backward thread)
                _graph_launch()(g, stream)
        except Exception as e:  # CuPy's CUDARuntimeError: named as every launch failure is
            from cuflux.errors import CudaError

            raise CudaError(f"{self.op}: launching the CUDA graph of {self.what} failed: "
                            f"{e}") from None

    def _capture(self):
        """The graph exec, or _DIRECT where capturing failed (a launch the driver refuses
        to capture, out of memory, ...): said once as a RuntimeWarning, after which the
        launches run themselves, as they would without graphs (CUFLUX_GRAPH_REPLAY=0), and
        raise whatever is wrong with them there."""
        try:
            return capture_graph(self.launches, self, self.op, self.what)
        except Exception as e:  # noqa: BLE001 (said, and the direct launches speak for it)
            import warnings

            warnings.warn(f"{self.op}: could not replay {self.what} as a CUDA graph ({e}); "
                          f"this call's repeats launch directly", RuntimeWarning,
                          stacklevel=4)
            return _DIRECT


_DIRECT = object()  # GraphReplay.exec of launches that could not be captured


def graph_replay(launches, *, op: str, what: str):
    """The replay of `launches` (in order, each taking a stream handle) a memo keeps: a
    GraphReplay where knobs.graph_replay (default) and no launch is a PDL one (its overlap
    with the work ahead would be lost in a graph), else the launches themselves."""
    from cuflux import knobs

    launches = tuple(launches)
    if knobs.graph_replay() and launches and not any(getattr(f, "pdl", False)
                                                     for f in launches):
        return GraphReplay(launches, op=op, what=what)
    if len(launches) == 1:
        return launches[0]
    return _Sequence(launches)


class _Sequence:
    __slots__ = ("launches",)

    def __init__(self, launches):
        self.launches = launches

    def __call__(self, stream: int) -> None:
        for launch in self.launches:
            launch(stream)


def capture_graph(launches, owner, op: str, what: str) -> int:
    """A graph exec of `launches` called on a private stream of the current device under
    thread-local capture, freed when `owner` is (a launch still in flight completes first:
    the driver frees an executing graph exec at its completion)."""
    import weakref

    from cupy.cuda import runtime

    with _CAPTURE_LOCK:  # one capture at a time on a device's private stream
        cap = _capture_stream(current_device())
        runtime.streamBeginCapture(cap, runtime.streamCaptureModeThreadLocal)
        failed = None
        try:
            for launch in launches:
                launch(cap)
        except BaseException as e:  # the capture still ends (below), and its graph is freed
            failed = e
        try:
            graph = runtime.streamEndCapture(cap)
        except Exception:  # an invalidated capture: the launch's own error says more
            if failed is None:
                raise
            graph = None
        if failed is not None:
            if graph:
                runtime.graphDestroy(graph)
            raise failed
        try:
            g = runtime.graphInstantiate(graph)
        except Exception as e:  # noqa: BLE001 (named below)
            from cuflux.errors import CudaError

            raise CudaError(f"{op}: instantiating the CUDA graph of {what} failed: {e}") \
                from None
        finally:
            runtime.graphDestroy(graph)
    weakref.finalize(owner, _destroy_exec, g)
    return g


def _destroy_exec(g: int) -> None:
    from cupy.cuda import runtime

    try:
        runtime.graphExecDestroy(g)
    except Exception:  # noqa: BLE001 (interpreter exit: the driver may be gone)
        pass


_CAPTURE_LOCK = threading.Lock()
_GRAPH_LOCK = threading.Lock()
_CAPTURE_STREAMS: dict = {}  # device -> a private non-blocking stream (kept)
_GRAPH_LAUNCH: list = []


def private_capture_stream(dev: int):
    """The handle of the private stream GraphReplay captures on for device dev (None before
    its first capture there): a launch run under that capture is not the caller's."""
    s = _CAPTURE_STREAMS.get(dev)
    return None if s is None else s.ptr


def _capture_stream(dev: int) -> int:
    s = _CAPTURE_STREAMS.get(dev)
    if s is None:
        import cupy

        with cupy.cuda.Device(dev):
            s = _CAPTURE_STREAMS[dev] = cupy.cuda.Stream(non_blocking=True)
    return s.ptr


def _graph_launch():
    """cudaGraphLaunch(exec, stream) through CuPy's runtime binding, looked up once."""
    if not _GRAPH_LAUNCH:
        from cupy.cuda import runtime

        _GRAPH_LAUNCH.append(runtime.graphLaunch)
    return _GRAPH_LAUNCH[0]


def _one_dim(dims, what: str, name: str) -> int:
    """cuflux's kernels are launched on 1-D grids and blocks; anything else is a caller bug."""
    if len(dims) != 1:
        raise ValueError(f"launching {name}: {what} must be one-dimensional, got {tuple(dims)}")
    return dims[0]


_FUNCTIONS: dict = {}  # id(kernel object) -> (the object, its CUfunction)


def _function(fn) -> int:
    """The CUfunction of a loaded kernel, resolved once: CuPy's `.kernel` asks the current
    device and looks its module up on every access. A kernel object is used on the device it
    was loaded for (kernels.load is per device); the entry keeps the object, so its id cannot
    be reused by another."""
    entry = _FUNCTIONS.get(id(fn))
    if entry is None or entry[0] is not fn:
        entry = _FUNCTIONS[id(fn)] = (fn, fn.kernel.ptr)
    return entry[1]


def _pdl_capable(func: int) -> bool:
    ok = _PDL_OK.get(func)
    if ok is None:
        import cupy

        dev = cupy.cuda.runtime.getDevice()
        ok = _PDL_OK[func] = int(cupy.cuda.Device(dev).compute_capability) >= 90
    return ok


def _pdl_config(grid: int, block: int, shared_mem: int, stream: int):
    key = (grid, block, shared_mem, stream)
    cfg = _PDL_CONFIGS.get(key)
    if cfg is None:
        attr = _LaunchAttribute()
        attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value[0] = 1  # programmaticStreamSerializationAllowed (int, first in the union)
        cfg = _LaunchConfig(grid, 1, 1, block, 1, 1, shared_mem, stream,
                            ctypes.pointer(attr), 1)
        cfg._attr = attr  # keep alive
        if len(_PDL_CONFIGS) >= 256:  # grids follow token counts: bounded
            _PDL_CONFIGS.clear()
        _PDL_CONFIGS[key] = cfg
    return ctypes.byref(cfg)


_IS_CAPTURING: list = []
_GET_DEVICE: list = []


def current_device() -> int:
    """The calling thread's current CUDA device (cudaGetDevice, bound once: 0.1 us a call)."""
    if not _GET_DEVICE:
        from cupy.cuda import runtime

        _GET_DEVICE.append(runtime.getDevice)
    return _GET_DEVICE[0]()



def capturing(stream) -> bool:
    """True while `stream` is being captured into a CUDA graph (0.3 us)."""
    if not _IS_CAPTURING:
        from cupy.cuda import runtime

        _IS_CAPTURING.append(runtime.streamIsCapturing)
    s = stream if isinstance(stream, int) else stream.ptr
    return _IS_CAPTURING[0](s) != 0
