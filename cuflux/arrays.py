"""Array intake and dtypes: anything CuPy takes without a copy, validated before any launch.

fp8 has no CuPy dtype: fp8 data travels as uint8 storage and the op names the format
("float8_e4m3fn" or "float8_e5m2").
"""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["DType", "dtype_info", "as_cupy", "check_array", "check_rows", "stream_of",
           "framework_of", "is_torch", "to_caller", "zeros_settled", "storage_dtype",
           "torch_empty", "torch_tensor_type", "torch_strided"]


class DType:
    def __init__(self, name: str, storage, cuda_type: str, is_fp8: bool = False):
        self.name, self.storage, self.cuda_type, self.is_fp8 = name, np.dtype(storage), cuda_type, is_fp8

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    def __repr__(self):
        return self.name


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


_DTYPES: dict[str, DType] = {}


def _table() -> dict[str, DType]:
    if not _DTYPES:
        for d in (DType("bfloat16", _bf16(), "__nv_bfloat16"),
                  DType("float16", np.float16, "__half"),
                  DType("float32", np.float32, "float"),
                  DType("float8_e4m3fn", np.uint8, "__nv_fp8_e4m3", True),
                  DType("float8_e5m2", np.uint8, "__nv_fp8_e5m2", True)):
            _DTYPES[d.name] = d
    return _DTYPES


_RESOLVED: dict = {}  # (dtype, allowed names) -> DType: resolved once (runs on every call)


def dtype_info(dtype, allowed=None, op: str = "cuflux") -> DType:
    """Resolve a dtype given as a name, numpy/cupy dtype or torch dtype."""
    try:
        key = (dtype, None if allowed is None else tuple(allowed))
        hit = _RESOLVED.get(key)
    except TypeError:  # an unhashable dtype-like: resolve it the long way
        key = hit = None
    if hit is not None:
        return hit
    hit = _resolve(dtype, allowed, op)
    if key is not None and len(_RESOLVED) < 1024:
        _RESOLVED[key] = hit
    return hit


def _resolve(dtype, allowed, op: str) -> DType:
    table = _table()
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:  # torch.dtype: "torch.bfloat16"
            name = str(dtype).replace("torch.", "")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2",
            "float8_e4m3": "float8_e4m3fn"}.get(name, name)
    if name not in table or (allowed is not None and name not in allowed):
        ok = sorted(allowed) if allowed is not None else sorted(table)
        raise TypeError(f"{op}: dtype {dtype!r} is not supported; expected one of {ok}")
    return table[name]


_NDARRAY = []


def _ndarray():
    """cupy.ndarray, looked up once (an import statement per call costs ~0.4 us)."""
    if not _NDARRAY:
        import cupy

        _NDARRAY.append(cupy.ndarray)
    return _NDARRAY[0]


def as_cupy(x, name: str = "x", op: str = "cuflux"):
    """CuPy view of x without a copy (CuPy array, __cuda_array_interface__ or DLPack)."""
    if type(x) is _ndarray():
        return x
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if _TORCH_TENSOR and type(x) is _TORCH_TENSOR[0]:
        a = _torch_as_cupy(x)
        if a is not None:
            return a
    # DLPack first: it carries bfloat16, which __cuda_array_interface__ cannot name (torch
    # exports bf16 there as opaque 2-byte voids).
    if hasattr(x, "__dlpack__"):
        try:
            return cupy.from_dlpack(x)
        except Exception as e:
            if not hasattr(x, "__cuda_array_interface__"):
                raise TypeError(f"{op}: {name} could not be taken through DLPack without a "
                                f"copy ({e})") from e
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(f"{op}: {name} must be a GPU array (CuPy, or anything exposing "
                    f"__cuda_array_interface__ / __dlpack__), got {type(x).__name__}")


def check_array(x, *, name: str, op: str, shape=None, dtype: DType | None = None,
                device: int | None = None, ndim: int | None = None):
    """Validate a CuPy array; message names the op, the argument, expected and got.

    The common case (everything right) is one expression of attribute reads (~0.6 us: it runs
    for every array of every call); the messages are built only when something is wrong."""
    if ((ndim is None or x.ndim == ndim) and (shape is None or x.shape == shape)
            and (dtype is None or x.dtype == dtype.storage) and x._c_contiguous
            and (device is None or x.data.device_id == device)):
        return x
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype.storage:
        want = f"{dtype.name} (stored as {dtype.storage})" if dtype.is_fp8 else dtype.name
        raise TypeError(f"{op}: {name} must be {want}, got {x.dtype}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{op}: {name} must be C-contiguous (strides {x.strides})")
    if device is not None and x.device.id != device:
        raise ValueError(f"{op}: {name} is on device {x.device.id}, this rank uses device {device}")
    return x


def check_rows(x, *, name: str, op: str, cols: int, max_rows: int, limit: str,
               dtype: DType, device: int, rows: str = "rows", cols_name: str = "cols"):
    """x (any array as_cupy takes) as a C-contiguous 2-D CuPy array [rows, cols] of `dtype` on
    `device` with at most max_rows rows (`limit`: that bound's name, for the message)."""
    x = check_array(as_cupy(x, name, op), name=name, op=op, ndim=2, dtype=dtype, device=device)
    if x.shape[1] != cols:
        raise ValueError(f"{op}: {name} must be [{rows}, {cols_name}={cols}], got shape "
                         f"{tuple(x.shape)}")
    if x.shape[0] > max_rows:
        raise ValueError(f"{op}: {name} has {x.shape[0]} {rows}, more than {limit}={max_rows}")
    return x


# ---- the caller's framework: torch in, torch out ---------------------------------------------
_TORCH_TENSOR: list = []  # [torch.Tensor] once torch is imported (never imported here)


def is_torch(x) -> bool:
    """x is a torch.Tensor. A type test: torch is looked up in sys.modules (a tensor can only
    exist once the caller imported torch), its Tensor type cached at the first hit."""
    if _TORCH_TENSOR:
        return isinstance(x, _TORCH_TENSOR[0])
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return False
    _TORCH_TENSOR.append(torch.Tensor)
    return isinstance(x, torch.Tensor)


def framework_of(x) -> str:
    """"torch" for a torch.Tensor, else "cupy" (CuPy, or any array taken through DLPack /
    __cuda_array_interface__: its outputs are CuPy arrays)."""
    return "torch" if is_torch(x) else "cupy"


def to_caller(out, like, given=None):
    """out (a CuPy array, a tuple of them, or None) in the framework of `like`, the call's
    input: for a torch tensor, torch tensors sharing out's memory (torch.from_dlpack, no copy),
    or `given` itself, the caller's own out= tensor, when there is one (for a tuple out, a
    tuple of them). Else out as it is."""
    if not is_torch(like):
        return out
    if isinstance(out, tuple):  # given: a tuple of the caller's outputs (None: not given)
        given = given if isinstance(given, tuple) else (given,) + (None,) * (len(out) - 1)
        return tuple(g if g is not None and is_torch(g) else _to_torch(o, like)
                     for o, g in zip(out, given))
    if given is not None and is_torch(given):
        return given
    return _to_torch(out, like)


def torch_tensor_type():
    """torch.Tensor once the caller imported torch (never imported here), else None."""
    if not _TORCH_TENSOR:
        is_torch(None)  # caches torch.Tensor where torch is imported
    return _TORCH_TENSOR[0] if _TORCH_TENSOR else None


_TORCH_NP: dict = {}  # torch dtype -> the NumPy dtype of its storage (fp8: uint8)
_NP_TORCH: dict = {}  # NumPy storage dtype -> torch dtype
_TORCH_FNS: list = []  # [torch.empty, torch.empty_like, torch.strided], set with the tables


def _torch_tables() -> dict:
    """_TORCH_NP, built once: filled aside and published whole (_TORCH_NP last, the flag every
    reader tests), so a thread racing the first call sees empty tables or full ones."""
    if not _TORCH_NP:
        torch = sys.modules["torch"]
        to_np, to_torch = {}, {}
        for t, n in (("bfloat16", _bf16()), ("float16", np.float16), ("float32", np.float32),
                     ("float64", np.float64), ("uint8", np.uint8), ("int8", np.int8),
                     ("int16", np.int16), ("int32", np.int32), ("int64", np.int64)):
            to_np[getattr(torch, t)] = np.dtype(n)
            to_torch[np.dtype(n)] = getattr(torch, t)
        for t in ("float8_e4m3fn", "float8_e5m2"):
            if hasattr(torch, t):
                to_np[getattr(torch, t)] = np.dtype(np.uint8)  # fp8's storage, as ours
        if not _TORCH_FNS:
            _TORCH_FNS.extend((torch.empty, torch.empty_like, torch.strided))
        _NP_TORCH.update(to_torch)
        _TORCH_NP.update(to_np)
    return _TORCH_NP


def torch_strided():
    """torch.strided, the layout of a dense tensor (looked up once, with the tables)."""
    if not _TORCH_FNS:
        _torch_tables()
    return _TORCH_FNS[2]


def storage_dtype(x):
    """x's dtype as CuPy stores it: a CuPy array's own, a torch tensor's NumPy counterpart
    (fp8: uint8; None for a dtype cuflux has no storage for)."""
    if _TORCH_TENSOR and type(x) is _TORCH_TENSOR[0]:
        return (_TORCH_NP or _torch_tables()).get(x.dtype)
    return x.dtype


def _torch_as_cupy(t):
    """A CuPy array over a CUDA torch tensor's memory, made directly (UnownedMemory holding
    the tensor; ~4-6 us against ~24-26 for cupy.from_dlpack, whose stream handshake a call on
    torch's current stream does not need: scripts/results/probe_torch_path-h200-2026-12-02.txt;
    a call given another stream= orders its inputs itself, as with CuPy arrays). None where
    DLPack should decide (a tensor that requires grad, off the GPU, empty, not strided, a
    negated or conjugated view, or of a dtype without a storage here): its errors name the
    problem."""
    dt = (_TORCH_NP or _torch_tables()).get(t.dtype)
    if (dt is None or t.requires_grad or not t.is_cuda or t.layout is not torch_strided()
            or t.is_neg() or t.is_conj()):
        return None
    n = t.numel()
    if not n:
        return None
    import cupy

    item = dt.itemsize
    if t.is_contiguous():
        nbytes, strides = n * item, None
    else:
        shape, st = t.shape, t.stride()
        nbytes = (sum((d - 1) * s for d, s in zip(shape, st)) + 1) * item
        strides = tuple(s * item for s in st)
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, device_id=t.get_device())
    return cupy.ndarray(tuple(t.shape), dt, cupy.cuda.MemoryPointer(mem, 0), strides=strides)


def torch_empty(shape, dtype, stream, like):
    """A new torch tensor on like's device for an output the op owns when the caller's
    arrays are torch tensors: from torch's caching allocator (2-3 us; a loop that drops its
    outputs gets the same blocks back, so the op's memo keys repeat), of NumPy storage
    `dtype` (like's own torch dtype where that is its storage: fp8 stays fp8). From the pool
    of the stream the op writes it on (`stream`: anything stream_of takes; None: torch's
    current one), as CuPy's pool would: a block torch hands out there was last used in that
    stream's order. Another stream than torch's current one costs a stream switch (~5 us)."""
    tables = _TORCH_NP or _torch_tables()
    empty, empty_like, _ = _TORCH_FNS
    mine = tables.get(like.dtype)
    if stream is not None:
        s = stream_of(stream)
        if s.ptr != _torch_stream_handle(like.get_device()):
            torch = sys.modules["torch"]
            with torch.cuda.stream(_torch_stream_object(s.ptr, like.device)):
                return torch_empty(shape, dtype, None, like)
    if mine is not None and mine == dtype:  # (None == np.dtype("float64") is True)
        if like.shape == shape and like.is_contiguous():  # 1.7 us; torch.empty 3.5 us
            return empty_like(like)
        return empty(shape, dtype=like.dtype, device=like.device)
    return empty(shape, dtype=_NP_TORCH[np.dtype(dtype)], device=like.device)


_TORCH_STREAM_OBJECTS: dict = {}  # (handle, device) -> torch.cuda.ExternalStream


def _torch_stream_object(handle: int, device):
    return _stream_wrapper(_TORCH_STREAM_OBJECTS, _torch_external, handle, device)


def _torch_external(handle: int, device):
    return sys.modules["torch"].cuda.ExternalStream(handle, device=device)


def _stream_wrapper(cache: dict, make, handle: int, device):
    """cache[(handle, device)], make(handle, device) the first time: a stream object over a
    raw handle, one per handle (a bounded cache: emptied past 256)."""
    s = cache.get((handle, device))
    if s is None:
        if len(cache) > 256:
            cache.clear()
        s = cache[handle, device] = make(handle, device)
    return s


_NO_SYNC: list = []  # [False] once CuPy refused __dlpack__(stream=-1)


def _to_torch(a, like):
    """a (a CuPy array the op wrote on the call's stream) as a torch tensor over the same
    memory. Its DLPack capsule is taken with stream=-1 (no handshake: torch.from_dlpack(a)
    would make torch's current stream wait on CuPy's current one, which is not the call's
    stream anyway; 15 us of host time); the call's stream is torch's current one unless the
    caller named another, whose order is then the caller's, as with CuPy arrays."""
    if a is None:
        return None
    torch = sys.modules["torch"]
    t = None
    if not _NO_SYNC:
        try:
            capsule = a.__dlpack__(stream=-1)
        except (TypeError, ValueError, BufferError):
            _NO_SYNC.append(False)  # this CuPy takes no stream=-1: the handshake from now on
        else:
            try:
                t = torch.from_dlpack(capsule)
            except Exception:  # a dtype torch cannot take: the ways below
                pass
    if t is None:
        try:
            t = torch.from_dlpack(a)
        except Exception:
            # A dtype DLPack cannot name on one side: the same bytes, viewed.
            if a.dtype.itemsize != like.element_size():
                raise
            return torch.from_dlpack(a.view(f"u{a.dtype.itemsize}")).view(like.dtype)
    # fp8 in, fp8 out: an output stored as the input is (uint8) takes the input's torch dtype
    mine = (_TORCH_NP or _torch_tables()).get(like.dtype)
    if t.dtype != like.dtype and mine is not None and mine == a.dtype:
        return t.view(like.dtype)
    return t


_TORCH_STREAMS: dict = {}  # (torch stream handle, device) -> a CuPy stream over it


_RAW_STREAM: list = []  # [torch's raw current-stream getter (device index -> handle)]


def _torch_stream_handle(dev: int) -> int:
    """The handle of torch's current stream on device `dev`: torch._C's raw getter where
    torch has it (0.2 us; torch.cuda.current_stream builds a Stream object: 4.8 us)."""
    if not _RAW_STREAM:
        torch = sys.modules["torch"]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _RAW_STREAM.append(raw if raw is not None
                           else lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _RAW_STREAM[0](dev)


def _torch_current_stream(like):
    """torch's current stream on like's device, as a CuPy stream (cached by handle)."""
    dev = like.get_device()
    handle = _torch_stream_handle(dev)
    return _stream_wrapper(_TORCH_STREAMS, external_stream, handle, dev)


class _RawStream:
    """A raw stream handle under the CUDA stream protocol (what CuPy's Stream.from_external
    takes; the stream stays its owner's: CuPy never destroys a stream it was handed)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def external_stream(handle: int, device: int = -1):
    """A CuPy stream over a raw handle created elsewhere (torch, the caller), on `device`
    (-1: unknown, used on the current device). CuPy >= 14 through Stream.from_external:
    its ExternalStream warns (DeprecationWarning) on every construction, which a caller
    running with warnings as errors would get from every call naming a stream; CuPy 13
    has only ExternalStream."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(handle, device)
    s = from_external(_RawStream(handle))
    s.device_id = device  # from_external leaves it unknown; CuPy checks it on `with s:`
    return s


def empty_on(shape, dtype, stream=None):
    """cupy.empty on the current device from the pool arena of the stream that will write it
    (`stream`: anything stream_of takes; None: the current one), so its block is reused only
    in that stream's order (2.8-5 us of host time on the H200 machine)."""
    import cupy

    if stream is None:
        return cupy.empty(shape, dtype=dtype)
    with stream_of(stream):
        return cupy.empty(shape, dtype=dtype)


def zeros_settled(shape, dtype):
    """A new CuPy array of zeros on the current device, zeroed before this returns: a word a
    kernel on any stream may read first (a non-blocking stream does not wait for the stream
    the zeros were queued on; a private stream's pool arena holds no caller's queued work)."""
    import cupy

    private = cupy.cuda.Stream(non_blocking=True)
    with private:
        a = cupy.zeros(shape, dtype=dtype)
    private.synchronize()
    return a


_STREAMS = None  # (cupy.cuda.get_current_stream, (Stream, ExternalStream)), looked up once
_RAW_STREAMS: dict = {}  # (handle, -1) -> a CuPy stream over a handle or torch stream passed


def _streams():
    global _STREAMS
    if _STREAMS is None:  # one assignment: threads racing here set the same tuple
        import cupy

        # ExternalStream: what CuPy 13 (and a caller's own code) makes; gone in a later CuPy
        kinds = (cupy.cuda.Stream,) + tuple(
            k for k in (getattr(cupy.cuda, "ExternalStream", None),) if k is not None)
        _STREAMS = (cupy.cuda.get_current_stream, kinds)
    return _STREAMS


def stream_of(stream, like=None):
    """A CuPy stream for `stream=` (a CuPy stream, a raw handle, a torch stream, an object
    with __cuda_stream__, or None).

    None: the current stream of the caller's framework: torch's (torch.cuda.current_stream)
    when `like` (the call's input) is a torch tensor, else CuPy's. Runs on every call of
    every op: CuPy's names are looked up once."""
    current, kinds = _STREAMS or _streams()
    if stream is None:
        if like is not None and is_torch(like):
            return _torch_current_stream(like)
        return current()
    if isinstance(stream, kinds):
        return stream
    if isinstance(stream, int):
        handle = stream
    elif hasattr(stream, "__cuda_stream__"):  # the CUDA stream protocol: (version, handle)
        version, handle = stream.__cuda_stream__()
        if version != 0:
            raise TypeError(f"stream: __cuda_stream__ version {version} of a "
                            f"{type(stream).__name__}; only 0 is known")
        handle = int(handle)
    elif hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        handle = int(stream.cuda_stream)
    elif hasattr(stream, "ptr"):
        handle = int(stream.ptr)
    else:
        raise TypeError(f"stream must be a CuPy stream, a raw handle, a torch stream or an "
                        f"object with __cuda_stream__, got {type(stream).__name__}")
    return _stream_wrapper(_RAW_STREAMS, external_stream, handle, -1)
