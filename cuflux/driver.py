"""The few CUDA driver calls CuPy lacks, through cuda-bindings; every CUresult is checked.

Stream memory operations: `stream_write_value32/64` store a value to a device address (local
or a peer's, through an IPC pointer) once all earlier work on the stream is done, with a
memory barrier first, so data copied earlier on the stream is visible before the flag;
`stream_wait_value32/64` hold the stream until a word reaches a value, using no SM. A stream
wait is unbounded, so cuflux's own paths use the bounded wait kernel (signal.py) and keep
these for callers who want them.

Host-mapped memory (`host_register`, `host_device_pointer`, `host_address`): pinned host pages
that kernels and stream memory operations address like device memory. A stream wait on a word
there can be released by a plain CPU store (watchdog.py), which needs no GPU queue.

Module loading is not here: kernels.load fetches every function of a module when an op is built
(cuModuleGetFunction loads the kernel it returns, under lazy loading too).
"""
from __future__ import annotations

__all__ = ["stream_write_value32", "stream_write_value64", "stream_wait_value32",
           "stream_wait_value64", "stream_handle", "host_register", "host_unregister",
           "host_device_pointer", "host_address", "DriverError"]


class DriverError(RuntimeError):
    pass


def _drv():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    drv = _drv()
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        name = drv.cuGetErrorName(err)[1] if hasattr(drv, "cuGetErrorName") else b""
        raise DriverError(f"{what} failed: {err} {name.decode() if isinstance(name, bytes) else name}")
    return result


def stream_handle(stream) -> int:
    """Raw handle of a CuPy stream, an object with .ptr / .cuda_stream, or an int (0: legacy)."""
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return stream
    for attr in ("ptr", "cuda_stream"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"cannot get a CUDA stream handle from {type(stream).__name__}")


def _wait_flag(cmp: str):
    drv = _drv()
    return {"geq": drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
            "eq": drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ,
            "and": drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_AND,
            "nor": drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_NOR}[cmp]


def _stream_write_value(stream, address: int, value: int, bits: int) -> None:
    drv = _drv()
    write = drv.cuStreamWriteValue64 if bits == 64 else drv.cuStreamWriteValue32
    _check(write(drv.CUstream(stream_handle(stream)), drv.CUdeviceptr(address),
                 value & ((1 << bits) - 1),
                 drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
           f"cuStreamWriteValue{bits}(0x{address:x}, {value})")


def stream_write_value32(stream, address: int, value: int) -> None:
    _stream_write_value(stream, address, value, 32)


def stream_write_value64(stream, address: int, value: int) -> None:
    _stream_write_value(stream, address, value, 64)


def stream_wait_value32(stream, address: int, value: int, cmp: str = "geq") -> None:
    """Unbounded: the stream waits until the word compares true (GEQ is wrap-around aware)."""
    drv = _drv()
    _check(drv.cuStreamWaitValue32(drv.CUstream(stream_handle(stream)), drv.CUdeviceptr(address),
                                   value & 0xFFFFFFFF, _wait_flag(cmp)),
           f"cuStreamWaitValue32(0x{address:x}, {value})")


def stream_wait_value64(stream, address: int, value: int, cmp: str = "geq") -> None:
    drv = _drv()
    _check(drv.cuStreamWaitValue64(drv.CUstream(stream_handle(stream)), drv.CUdeviceptr(address),
                                   value & 0xFFFFFFFFFFFFFFFF, _wait_flag(cmp)),
           f"cuStreamWaitValue64(0x{address:x}, {value})")


# ---- host-mapped memory ------------------------------------------------------------------------
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost


def host_register(host_ptr: int, num_bytes: int) -> int:
    """Pin host pages (page-aligned, e.g. an mmap) for every context and map them into the
    device address space; returns the device pointer kernels and stream memory ops use."""
    from cupy.cuda import runtime

    runtime.hostRegister(host_ptr, num_bytes, _HOST_REGISTER_PORTABLE_MAPPED)
    try:
        return host_device_pointer(host_ptr)
    except Exception:
        runtime.hostUnregister(host_ptr)
        raise


def host_unregister(host_ptr: int) -> None:
    from cupy.cuda import runtime

    runtime.hostUnregister(host_ptr)


def host_device_pointer(host_ptr: int) -> int:
    """Device address of registered or cudaHostAlloc'ed mapped host memory."""
    from cuda.bindings import runtime as rt

    err, dev_ptr = rt.cudaHostGetDevicePointer(host_ptr, 0)
    if err != rt.cudaError_t.cudaSuccess:
        raise DriverError(f"cudaHostGetDevicePointer(0x{host_ptr:x}) failed: {err}")
    return int(dev_ptr)


def host_address(ptr: int) -> int | None:
    """The CPU address of `ptr` when it points into pinned host-mapped memory (so the CPU can
    store into it directly); None for device memory or anything CUDA does not know."""
    try:
        from cupy.cuda import runtime

        attrs = runtime.pointerGetAttributes(ptr)
    except Exception:
        return None
    # hostPointer is the CPU address of ptr itself (not of the allocation's base).
    if int(attrs.type) != _MEMORY_TYPE_HOST or not attrs.hostPointer:
        return None
    return int(attrs.hostPointer)
