"""CPU tests of cuflux.launch: how arguments are packed for cuLaunchKernel (a wrong width or
offset would hand the kernel garbage), which types are refused, and which driver entry a
launch takes. The driver is faked: no GPU needed."""
import ctypes
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from cuflux import launch as L
from cuflux.errors import CudaError


class _Array:
    """Stands for a cupy.ndarray: only .data.ptr is read."""

    def __init__(self, ptr):
        self.data = SimpleNamespace(ptr=ptr)


_Array.__name__ = "ndarray"


class _FakeLib:
    def __init__(self, err=0):
        self.calls, self.err = [], err

    def _params(self, params, n):
        return [params[i] for i in range(n)]

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append(("plain", func, gx, bx, smem, stream, params))
        return self.err

    def cuLaunchKernelEx(self, cfg, func, params, extra):
        c = ctypes.cast(cfg, ctypes.POINTER(L._LaunchConfig)).contents
        self.calls.append(("pdl", func, c.gridDimX, c.blockDimX, c.sharedMemBytes, c.hStream,
                           c.attrs[0].id, c.attrs[0].value[0], params))
        return self.err

    def cuGetErrorName(self, code, out):
        return 1


@pytest.fixture
def fake_driver(monkeypatch):
    """The driver faked behind launch's ctypes fallback (the path taken where CuPy's backend
    module is missing): kernel() and Prepared call _launch_kernel either way."""
    def install(err=0):
        lib = _FakeLib(err)
        monkeypatch.setattr(L, "_lib", lib)
        monkeypatch.setattr(L, "_launch_kernel", L._ctypes_launch)
        monkeypatch.setattr(L, "_DriverError", L._CtypesLaunchError)
        return lib
    return install


def test_plain_launches_go_through_cupy_s_cython_binding():
    """launcher(): cuLaunchKernel through CuPy's binding (plain integers in: no ctypes
    conversion of eleven arguments per call), raising CuPy's driver error with its status."""
    from cupy_backends.cuda.api import driver

    assert L.launcher() is driver.launchKernel
    assert L._DriverError is driver.CUDADriverError


def test_without_cupy_s_backend_launches_go_through_ctypes(monkeypatch):
    """launcher() where CuPy's backend module cannot be imported: the ctypes call, raising
    _CtypesLaunchError with the CUresult, which kernel() turns into CudaError."""
    import sys

    monkeypatch.setattr(L, "_launch_kernel", None)
    monkeypatch.setattr(L, "_DriverError", L._CtypesLaunchError)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.api", None)  # import raises
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.api.driver", None)
    lib = _FakeLib(err=700)
    monkeypatch.setattr(L, "_lib", lib)
    assert L.launcher() is L._ctypes_launch and L._DriverError is L._CtypesLaunchError
    with pytest.raises(CudaError, match="failed: CUresult 700"):
        L.kernel(9, (1,), (32,), (np.int32(1),), 5, op="op", name="k")
    assert lib.calls[-1][:6] == ("plain", 9, 1, 32, 0, 5)


def _values(packer, n):
    """Read back what the packer wrote, argument by argument, through its pointers."""
    base = packer.params[0]
    raw = ctypes.string_at(base, packer.struct.size)
    return packer.struct.unpack(raw), [packer.params[i] - base for i in range(n)]


def test_arguments_packed_at_their_natural_widths_in_order(fake_driver):
    lib = fake_driver()
    tmap = bytes(range(128))
    args = (np.uint64(2**63 + 5), np.int32(-7), tmap, _Array(0xABC0), np.float32(1.5),
            np.uint32(9), np.int64(-2**40), np.void(bytes(128)))
    L.kernel(123, (4,), (256,), args, SimpleNamespace(ptr=77), op="t", name="k", shared_mem=64)
    kind, func, g, b, smem, stream, params = lib.calls[0]
    assert (kind, func, g, b, smem, stream) == ("plain", 123, 4, 256, 64, 77)
    p = L._packer(args)
    assert params == p.params_addr  # the driver reads this signature's block
    vals, offsets = _values(p, len(args))
    assert offsets == [0, 8, 12, 140, 148, 152, 156, 164]
    assert vals == (2**63 + 5, -7, tmap, 0xABC0, 1.5, 9, -2**40, bytes(128))


def test_each_signature_gets_its_own_block_and_blocks_are_reused():
    a = (np.uint64(1), np.int32(2))
    b = (np.uint64(1), np.uint32(2))
    assert L._packer(a) is L._packer((np.uint64(5), np.int32(6)))
    assert L._packer(a) is not L._packer(b)


def test_plain_python_ints_are_refused():
    with pytest.raises(TypeError, match="no fixed C width"):
        L._packer((np.uint64(1), 5))


def test_pdl_launch_uses_launch_kernel_ex_with_the_serialisation_attribute(monkeypatch,
                                                                            fake_driver):
    lib = fake_driver()
    monkeypatch.setattr(L, "_pdl_capable", lambda func: True)
    L.kernel(55, (3,), (128,), (np.uint64(1),), 9, op="t", name="k", pdl=True)
    kind, func, g, b, smem, stream, attr_id, allowed, _ = lib.calls[0]
    assert (kind, func, g, b, smem, stream) == ("pdl", 55, 3, 128, 0, 9)
    assert (attr_id, allowed) == (6, 1)


def test_pdl_falls_back_to_a_plain_launch_below_hopper(monkeypatch, fake_driver):
    lib = fake_driver()
    monkeypatch.setattr(L, "_pdl_capable", lambda func: False)
    L.kernel(55, (3,), (128,), (np.uint64(1),), 9, op="t", name="k", pdl=True)
    assert lib.calls[0][0] == "plain"


def test_driver_error_names_op_kernel_and_launch(fake_driver):
    fake_driver(err=701)
    with pytest.raises(CudaError, match=r"op: launching kernel kern \(grid 2, block 64.*"
                                        r"failed: CUresult 701"):
        L.kernel(1, (2,), (64,), (np.int32(1),), 0, op="op", name="kern")


def test_prepared_launch_packs_once_and_writes_only_the_call_s_pointers(fake_driver):
    """Prepared: the fixed arguments packed at build into a block of its own (kernel()'s
    blocks untouched), each call writes its pointers at the front and launches with the
    plan's grid, block and shared memory on the call's stream; a second call overwrites
    only the pointers."""
    lib = fake_driver()
    args = (np.uint64(0), _Array(0), np.int32(-3), _Array(0xBEEF0), np.float32(0.5),
            np.uint64(2**40))
    shared = L._packer(args)
    before = ctypes.string_at(shared.params[0], shared.struct.size)
    prep = L.Prepared(321, 6, 128, args, 2, op="t", name="k", shared_mem=32)
    prep(SimpleNamespace(ptr=44), 0x1000, 0x2000)
    kind, func, g, b, smem, stream, params = lib.calls[-1]
    assert (kind, func, g, b, smem, stream) == ("plain", 321, 6, 128, 32, 44)
    assert params == prep.packer.params_addr and prep.packer is not shared
    vals, offsets = _values(prep.packer, len(args))
    assert vals == (0x1000, 0x2000, -3, 0xBEEF0, 0.5, 2**40)
    assert offsets == [0, 8, 16, 20, 28, 32]
    prep(9, 0x3000, 0)
    assert _values(prep.packer, len(args))[0] == (0x3000, 0, -3, 0xBEEF0, 0.5, 2**40)
    assert lib.calls[-1][5] == 9
    assert ctypes.string_at(shared.params[0], shared.struct.size) == before


def test_prepared_launch_writes_pointers_in_the_middle_of_the_block(fake_driver):
    """first=: the call's pointers are arguments first .. first + varying - 1, after others
    (All2AllHeads' receive kernel: its output pointers follow the op's fixed flags)."""
    fake_driver()
    args = (np.int32(7), _Array(0xF00), np.uint64(0), np.uint64(0), np.float32(2.0))
    prep = L.Prepared(5, 1, 32, args, 2, op="t", name="k", first=2)
    prep(3, 0xA0, 0xB0)
    vals, offsets = _values(prep.packer, len(args))
    assert vals == (7, 0xF00, 0xA0, 0xB0, 2.0) and offsets == [0, 4, 12, 20, 28]
    assert prep.offset == 12


def test_prepared_launch_refuses_non_pointer_slots_and_names_a_driver_error(fake_driver):
    with pytest.raises(TypeError, match="arguments 0 to 1 of kernel k must be device"):
        L.Prepared(1, 1, 32, (np.uint64(0), np.int32(1)), 2, op="t", name="k")
    with pytest.raises(TypeError, match="arguments 1 to 2 of kernel k must be device"):
        L.Prepared(1, 1, 32, (np.uint64(0), np.uint64(1)), 2, op="t", name="k", first=1)
    fake_driver(err=701)
    prep = L.Prepared(1, 2, 64, (np.uint64(0),), 1, op="op", name="kern")
    with pytest.raises(CudaError, match=r"op: launching kernel kern \(grid 2, block 64.*"
                                        r"failed: CUresult 701") as e:
        prep(0, 0x10)
    assert e.value.__context__ is None  # raised after the driver's error was handled
    with pytest.raises(TypeError, match="kernel kern takes 1 pointers a call"):
        prep(0, 0x10, 0x20)


def test_launch_structures_match_cuda_h():
    """CUlaunchConfig / CUlaunchAttribute as cuda.h lays them out (checked with offsetof on
    CUDA 13.0: attribute 72 bytes, value at 8; config 56 bytes, stream at 32, attrs at 40)."""
    assert ctypes.sizeof(L._LaunchAttribute) == 72
    assert L._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(L._LaunchConfig) == 56
    assert L._LaunchConfig.sharedMemBytes.offset == 24
    assert L._LaunchConfig.hStream.offset == 32
    assert L._LaunchConfig.attrs.offset == 40 and L._LaunchConfig.numAttrs.offset == 48
    assert struct.calcsize("=Qi128sQ") == 148


@pytest.mark.gpu
def test_kernels_are_resolved_when_their_module_loads(monkeypatch):
    """Every kernel of a loaded family has its CUfunction before any launch, resolved under the
    module's device (launch keeps the first resolution: a first launch made with another GPU
    current must not be the one that resolves it)."""
    import cupy

    from cuflux import kernels

    # nothing loaded or resolved before (other tests' launches would have resolved them)
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(L, "_FUNCTIONS", {})
    mod = kernels.load("allreduce.cu", cupy.cuda.Device().id)
    assert mod.functions
    for name, fn in mod.functions.items():
        entry = L._FUNCTIONS.get(id(fn))
        assert entry is not None and entry[0] is fn, name
        assert entry[1] == fn.kernel.ptr != 0, name


def test_bound_launch_fixes_the_pointers_in_a_block_of_its_own(fake_driver):
    """Prepared.bind: a copy of the prepared block with the pointers written, never written
    again; calling it launches with the plan's grid on the given stream. The prepared block
    and an earlier bound one are untouched by later binds and calls."""
    lib = fake_driver()
    args = (np.uint64(0), np.uint64(0), np.int32(-3), np.float32(0.5))
    prep = L.Prepared(77, 4, 64, args, 2, op="t", name="k", shared_mem=16)
    one = prep.bind(0x1000, 0x2000)
    two = prep.bind(0x3000, 0x4000)
    prep(0, 0x5000, 0x6000)
    one(11)
    kind, func, g, b, smem, stream, params = lib.calls[-1]
    assert (kind, func, g, b, smem, stream) == ("plain", 77, 4, 64, 16, 11)
    assert params == one.params_addr != prep.packer.params_addr
    assert _values(one.packer, 4)[0] == (0x1000, 0x2000, -3, 0.5)
    assert _values(two.packer, 4)[0] == (0x3000, 0x4000, -3, 0.5)
    assert _values(prep.packer, 4)[0] == (0x5000, 0x6000, -3, 0.5)
    with pytest.raises(TypeError, match="kernel k takes 2 pointers a call"):
        prep.bind(0x1000)
    fake_driver(err=700)
    with pytest.raises(CudaError, match=r"t: launching kernel k \(grid 4, block 64"):
        one(0)


def test_graph_replay_is_a_graph_unless_off_or_programmatic(monkeypatch):
    """graph_replay: a GraphReplay of the launches by default; with CUFLUX_GRAPH_REPLAY=0 the
    launch itself (one) or all of them in order; never a graph where a launch uses PDL (its
    overlap with the work ahead would be lost)."""
    calls = []
    one = lambda s: calls.append(("one", s))  # noqa: E731
    two = lambda s: calls.append(("two", s))  # noqa: E731
    pdl = SimpleNamespace(pdl=True, __call__=None)
    monkeypatch.delenv("CUFLUX_GRAPH_REPLAY", raising=False)
    g = L.graph_replay((one, two), op="t", what="w")
    assert isinstance(g, L.GraphReplay) and g.launches == (one, two) and g.exec is None
    assert not isinstance(L.graph_replay((pdl,), op="t", what="w"), L.GraphReplay)
    monkeypatch.setenv("CUFLUX_GRAPH_REPLAY", "0")
    assert L.graph_replay((one,), op="t", what="w") is one
    seq = L.graph_replay((one, two), op="t", what="w")
    seq(7)
    assert calls == [("one", 7), ("two", 7)]


def test_graph_replay_that_cannot_be_captured_warns_once_and_launches_directly(monkeypatch):
    """A GraphReplay whose capture fails says so once (RuntimeWarning) and from then on runs
    its launches on the call's stream, as without graphs: nothing is lost or run twice."""
    calls = []
    one = lambda s: calls.append(("one", s))  # noqa: E731
    monkeypatch.setattr(L, "capturing", lambda stream: False)
    tries = []

    def refuse(launches, owner, op, what):
        tries.append(what)
        raise RuntimeError("cudaErrorStreamCaptureUnsupported")

    monkeypatch.setattr(L, "capture_graph", refuse)
    g = L.GraphReplay((one,), op="t", what="w")
    with pytest.warns(RuntimeWarning, match=r"t: could not replay w as a CUDA graph"):
        g(5)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(6)
    assert calls == [("one", 5), ("one", 6)] and tries == ["w"]


def test_capture_graph_ends_the_capture_and_frees_its_graph_when_a_launch_fails(monkeypatch):
    """A launch raising under capture: the capture still ends, the partial graph is
    destroyed, and the launch's own error goes up (not the invalidated capture's)."""
    from cupy.cuda import runtime

    log = []
    monkeypatch.setattr(L, "_capture_stream", lambda dev: 77)
    monkeypatch.setattr(L, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "streamBeginCapture", lambda s, mode: log.append(("begin", s)))
    monkeypatch.setattr(runtime, "streamEndCapture", lambda s: log.append(("end", s)) or 1234)
    monkeypatch.setattr(runtime, "graphDestroy", lambda g: log.append(("destroy", g)))
    monkeypatch.setattr(runtime, "graphInstantiate", lambda g: log.append(("inst", g)) or 99)

    def bad(stream):
        raise ValueError("launch refused")

    with pytest.raises(ValueError, match="launch refused"):
        L.capture_graph((bad,), object, "t", "w")
    assert log == [("begin", 77), ("end", 77), ("destroy", 1234)]

    def invalidated(s):
        raise RuntimeError("cudaErrorStreamCaptureInvalidated")

    log.clear()
    monkeypatch.setattr(runtime, "streamEndCapture", invalidated)
    with pytest.raises(ValueError, match="launch refused"):
        L.capture_graph((bad,), object, "t", "w")
    assert log == [("begin", 77)]
