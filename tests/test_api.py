"""CPU tests of the public API's rules (issue 22, items 3 and 7): one rule for sizes
(cuflux.sizes.count) in AllGather's and AllGatherGemm's constructors, AllGatherGemm's two
names for its row bound, what cuflux.init accepts, what `stream=` accepts, and the one message
every op gives on a machine without a GPU. Ops are built on stand-in worlds (no GPU, no MPI job)."""
import re
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import cuflux
import cuflux.ops.allgather as AGM
from cuflux import arrays, sizes
from cuflux import world as world_mod
from cuflux.errors import CufluxError
from cuflux.ops.ag_gemm import AllGatherGemm, check_build_args
from cuflux.ops.allgather import AllGather
from tests.test_ag_gemm import _fake_env, _Sim, _world

# Not sizes: floats (integral or not), strings, bools, None, arrays.
NOT_INTS = [4096.0, 4096.7, "4096", True, False, np.bool_(True), np.float64(64), None,
            np.array([64]), 64 + 0j]
BELOW_ONE = [0, -1, np.int64(-5)]


def _ids(values):
    return [f"{type(v).__name__}:{v!r}" for v in values]


class _Stop(Exception):
    """Raised by a stand-in world's check_same: construction got past every argument check."""


def _stub_world(W=4, rank=1, device=0):
    """A world whose first collective stops the constructor (and records what it compared)."""
    seen = []

    def check_same(value, what):
        seen.append((value, what))
        raise _Stop

    return SimpleNamespace(rank=rank, size=W, device=device, check_same=check_same,
                           seen=seen)


# ---- the rule itself ------------------------------------------------------------------------------
def test_count_message_shape():
    with pytest.raises(ValueError) as e:
        sizes.count("AllGather", "max_rows", "4096", what="rows per rank")
    assert str(e.value) == ("AllGather: max_rows must be an integer >= 1 (rows per rank), "
                            "got '4096' (str)")
    with pytest.raises(ValueError) as e:
        sizes.count("Op", "n", 100, 8, 2**31 - 8, "columns", multiple_of=8)
    assert str(e.value) == ("Op: n must be an integer in [8, 2147483640], a multiple of 8 "
                            "(columns), got 100 (int)")
    with pytest.raises(ValueError) as e:
        sizes.optional_count("Op", "chunk_rows", 2.0)
    assert str(e.value) == "Op: chunk_rows must be an integer >= 1 or None, got 2.0 (float)"


@pytest.mark.parametrize("value", NOT_INTS + BELOW_ONE, ids=_ids(NOT_INTS + BELOW_ONE))
def test_count_refuses_what_is_not_a_size(value):
    with pytest.raises(ValueError, match=r"^Op: x must be an integer >= 1, got .* \(\w+\)$"):
        sizes.count("Op", "x", value)


@pytest.mark.parametrize("value", [1, 7, np.int8(7), np.int64(7), np.uint32(7), 2**40],
                         ids=_ids([1, 7, np.int8(7), np.int64(7), np.uint32(7), 2**40]))
def test_count_accepts_ints_and_returns_python_ints(value):
    got = sizes.count("Op", "x", value)
    assert got == value and type(got) is int
    assert sizes.optional_count("Op", "x", value) == value
    assert sizes.optional_count("Op", "x", None) is None


def test_count_bounds_and_multiples():
    assert sizes.count("Op", "x", 0, minimum=0) == 0
    assert sizes.count("Op", "x", 16, maximum=16, multiple_of=8) == 16
    with pytest.raises(ValueError, match=r"in \[1, 16\].*got 17"):
        sizes.count("Op", "x", 17, maximum=16)
    with pytest.raises(ValueError, match="a multiple of 8.*got 12"):
        sizes.count("Op", "x", 12, multiple_of=8)
    with pytest.raises(ValueError, match=r"or None"):
        sizes.optional_count("Op", "x", 0)
    assert not sizes.is_count(True) and sizes.is_count(np.int16(3))


# ---- AllGather ----------------------------------------------------------------------------------
AG_GOOD = dict(max_rows=128, cols=64, dtype="bfloat16")
AG_WHAT = {"max_rows": "rows per rank", "cols": "elements per row",
           "chunk_rows": "rows per flagged chunk"}


@pytest.mark.parametrize("name", ["max_rows", "cols", "chunk_rows"])
@pytest.mark.parametrize("value", NOT_INTS + BELOW_ONE, ids=_ids(NOT_INTS + BELOW_ONE))
def test_allgather_sizes_follow_the_rule(name, value):
    if name == "chunk_rows" and value is None:
        return  # None is chunk_rows' default (one chunk per shard)
    world = _stub_world()
    with pytest.raises(ValueError) as e:
        AllGather(world, **{**AG_GOOD, name: value})
    msg = str(e.value)
    assert msg.startswith(f"AllGather: {name} must be an integer >= 1")
    assert AG_WHAT[name] in msg and msg.endswith(f"got {value!r} ({type(value).__name__})")
    assert not world.seen  # refused before any collective


def test_allgather_string_size_is_named_not_a_comparison_error():
    with pytest.raises(ValueError, match=re.escape(
            "AllGather: max_rows must be an integer >= 1 (rows per rank), got '4096' (str)")):
        AllGather(_stub_world(), "4096", 64, "bfloat16")


def test_allgather_numpy_sizes_reach_check_same_as_ints():
    world = _stub_world()
    with pytest.raises(_Stop):
        AllGather(world, np.int64(128), np.int32(64), "bfloat16", chunk_rows=np.uint16(32))
    (value, what), = world.seen
    assert value == (128, 64, "bfloat16", "pull", 32, "copy")
    assert all(type(v) is int for v in (value[0], value[1], value[4]))  # same pickle everywhere


def test_allgather_builds_with_numpy_sizes(monkeypatch):
    sim = _Sim(0)
    _fake_env(monkeypatch, sim)
    ag = AGM.AllGather(_world(sim, 2, 0, "nvlink"), np.int64(130), np.int64(8), "bfloat16",
                       chunk_rows=np.int32(37), timeout_s=1)
    assert (ag.max_rows, ag.cols, ag.chunk_rows, ag.max_chunks) == (130, 8, 37, 4)
    assert type(ag.max_rows) is int and type(ag.chunk_rows) is int


# ---- AllGatherGemm -------------------------------------------------------------------------------
GG_GOOD = dict(max_m=512, n=256, k=128, dtype="bfloat16")


@pytest.mark.parametrize("name", ["max_m", "n", "k", "chunk_rows", "group_m"])
@pytest.mark.parametrize("value", NOT_INTS + BELOW_ONE, ids=_ids(NOT_INTS + BELOW_ONE))
def test_allgather_gemm_sizes_follow_the_rule(name, value):
    if value is None and name in ("max_m", "chunk_rows", "n", "k"):
        return  # None: max_m left out, chunk_rows' default, n / k missing (tests below)
    world = _stub_world()
    with pytest.raises(ValueError) as e:
        AllGatherGemm(world, **{**GG_GOOD, name: value})
    msg = str(e.value)
    assert re.match(rf"AllGatherGemm: {name} must be an integer (>= |in \[)", msg), msg
    assert msg.endswith(f"got {value!r} ({type(value).__name__})"), msg
    assert not world.seen


@pytest.mark.parametrize("value", NOT_INTS[:-1] + BELOW_ONE + [2**31 // 4],
                         ids=_ids(NOT_INTS[:-1] + BELOW_ONE + [2**31 // 4]))
def test_max_rows_per_rank_follows_the_rule(value):
    if value is None:
        return
    with pytest.raises(ValueError, match=r"^AllGatherGemm: max_rows_per_rank must be an integer "
                                         r"in \[1, 536870911\] \(the largest a_shard rows"):
        AllGatherGemm(_stub_world(), n=256, k=128, dtype="bfloat16", max_rows_per_rank=value)


def test_max_m_bounds_name_the_world_size():
    with pytest.raises(ValueError, match=re.escape(
            "AllGatherGemm: max_m must be an integer in [4, 2147483647] (the largest gathered "
            "M = world size 4 * rows per rank), got 4096.0 (float)")):
        AllGatherGemm(_stub_world(), 4096.0, 256, 128, "bfloat16")
    with pytest.raises(ValueError, match=r"got 2147483648 \(int\)"):
        AllGatherGemm(_stub_world(), 2**31, 256, 128, "bfloat16")


def test_max_m_and_max_rows_per_rank_are_one_bound():
    """Positional max_m (the old way), max_m by keyword and max_rows_per_rank all reach the
    same per-rank bound, which is what the ranks compare."""
    seen = []
    for kwargs in (dict(max_m=512), dict(max_m=515), dict(max_m=np.int64(512)),
                   dict(max_rows_per_rank=128), dict(max_rows_per_rank=np.int32(128))):
        world = _stub_world()
        with pytest.raises(_Stop):
            AllGatherGemm(world, n=256, k=128, dtype="bfloat16", **kwargs)
        (value, what), = world.seen
        assert what.startswith("AllGatherGemm arguments (max_rows_per_rank, n, k")
        seen.append(value)
    world = _stub_world()
    with pytest.raises(_Stop):
        AllGatherGemm(world, 512, 256, 128, "bfloat16", None, "kn", "pull", None, 30.0, "auto",
                      None, 8)  # every argument positional, as before
    seen.append(world.seen[0][0])
    assert len(set(seen)) == 1 and seen[0][0] == 128 and type(seen[0][0]) is int


@pytest.mark.parametrize("kwargs,text", [
    (dict(max_m=512, max_rows_per_rank=128), "got both"),
    (dict(), "got neither"),
])
def test_exactly_one_row_bound(kwargs, text):
    with pytest.raises(TypeError, match=r"AllGatherGemm: give exactly one of max_m .* and "
                                        rf"max_rows_per_rank .*{text}"):
        AllGatherGemm(_stub_world(), n=256, k=128, dtype="bfloat16", **kwargs)
    with pytest.raises(TypeError, match="give exactly one"):
        check_build_args(4, kwargs.get("max_m"), 256, 128, "bfloat16", None, "kn", "pull", None,
                         5.0, "auto", None, 8, max_rows_per_rank=kwargs.get("max_rows_per_rank"))


def test_missing_dimensions_are_named():
    with pytest.raises(TypeError, match="AllGatherGemm: missing required argument.*: n, dtype"):
        AllGatherGemm(_stub_world(), k=128, max_rows_per_rank=128)


def test_check_build_args_returns_rows_per_rank_either_way():
    common = ("bfloat16", None, "kn", "pull", None, 5.0, "auto", None, 8)
    assert check_build_args(4, 515, 256, 128, *common)[2] == 128
    assert check_build_args(4, None, 256, 128, *common, max_rows_per_rank=np.int64(128))[2] == 128


# ---- no GPU: one message, before anything else ----------------------------------------------------
@pytest.fixture
def no_gpu_here(monkeypatch):
    monkeypatch.setattr(world_mod, "_device_count_and_reason",
                        lambda: (0, "CUDA sees no device (CUDA_VISIBLE_DEVICES='')"))


@pytest.mark.parametrize("build,op", [
    (lambda w: AllGather(w, "not even a size", 64, "bfloat16"), "AllGather"),
    (lambda w: AllGather(w, 128, 64, "bfloat16", name="AllGatherGemm"), "AllGatherGemm"),
    (lambda w: AllGatherGemm(w, 4096.0, 100, 0, "float32"), "AllGatherGemm"),
    (lambda w: AllGatherGemm(w, max_rows_per_rank=128), "AllGatherGemm"),
])
def test_no_device_is_the_first_and_only_error(no_gpu_here, build, op):
    world = _stub_world(device=None)
    with pytest.raises(world_mod.NoDeviceError) as e:
        build(world)
    assert str(e.value) == f"{op}: needs a CUDA device; CUDA sees no device (CUDA_VISIBLE_DEVICES='')"
    assert isinstance(e.value, CufluxError) and not world.seen


def test_world_without_device_on_a_machine_with_one(monkeypatch):
    """A World built when CUDA saw no device (or a stand-in): the op still says it plainly."""
    monkeypatch.setattr(world_mod, "_device_count_and_reason", lambda: (2, ""))
    for build, op in ((lambda w: AllGather(w, 128, 64, "bfloat16"), "AllGather"),
                      (lambda w: AllGatherGemm(w, 512, 256, 128, "bfloat16"), "AllGatherGemm")):
        with pytest.raises(world_mod.NoDeviceError,
                           match=rf"^{op}: needs a CUDA device; rank 3's World has none"):
            build(_stub_world(rank=3, device=None))


def test_require_device_message_on_this_machine():
    """Unpatched: on a machine without an NVIDIA driver (this CPU machine) the reason is the
    driver; on a GPU machine require_device returns the device count."""
    present, _ = world_mod._driver_probe()
    if present:
        assert world_mod.require_device("AllGather") >= 1
        return
    with pytest.raises(world_mod.NoDeviceError,
                       match="^AllGatherGemm: needs a CUDA device; no NVIDIA driver"):
        AllGatherGemm(_stub_world(device=None), 512, 256, 128, "bfloat16")


# ---- cuflux.init ---------------------------------------------------------------------------------
class _FakeProcessGroup:  # what torch.distributed hands out, without importing torch
    pass


_FakeProcessGroup.__module__ = "torch._C._distributed_c10d"
_FakeProcessGroup.__qualname__ = "ProcessGroup"


@pytest.mark.parametrize("comm,exc,text", [
    ("COMM_WORLD", TypeError, r"got 'COMM_WORLD' \(str\) \(pass the communicator itself: from "
                              r"mpi4py import MPI; MPI.COMM_WORLD\)"),
    ("world", TypeError, r"got 'world' \(str\)$"),
    (0, TypeError, r"got 0 \(int\)"),
    (object(), TypeError, r"\(object\)"),
    (_FakeProcessGroup(), TypeError, r"comm is a torch object "
                                     r"\(torch._C._distributed_c10d.ProcessGroup\) but not a "
                                     r"torch.distributed ProcessGroup"),
])
def test_init_refuses_what_is_not_a_communicator(comm, exc, text):
    with pytest.raises(exc, match=text) as e:
        cuflux.init(comm)
    assert str(e.value).startswith("cuflux.init: ")
    assert "an mpi4py intracommunicator" in str(e.value) and "or None" in str(e.value)


def test_init_refuses_comm_null_and_accepts_intracommunicators():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="cuflux.init: comm is MPI.COMM_NULL"):
        cuflux.init(MPI.COMM_NULL)
    assert world_mod._check_comm(None) is MPI.COMM_WORLD
    assert world_mod._check_comm(MPI.COMM_SELF) is MPI.COMM_SELF
    assert world_mod._check_comm(MPI.COMM_WORLD) is MPI.COMM_WORLD


# ---- stream= ---------------------------------------------------------------------------------
class _ProtocolStream:
    """A stream of another library under the CUDA stream protocol (cuda.core's, say)."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@pytest.mark.parametrize("given,handle", [
    (0x5eed, 0x5eed),
    (SimpleNamespace(cuda_stream=0x7a11), 0x7a11),  # torch.cuda.Stream's attribute
    (SimpleNamespace(ptr=0xb0b), 0xb0b),
    (_ProtocolStream(0xc0de), 0xc0de),
], ids=["raw_handle", "cuda_stream", "ptr", "cuda_stream_protocol"])
def test_stream_of_wraps_a_foreign_stream_without_deprecation_warnings(given, handle):
    """CuPy >= 14 warns (DeprecationWarning) on every ExternalStream built: a caller running
    with warnings as errors would have had every call naming a stream fail."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = arrays.stream_of(given)
        again = arrays.stream_of(given)
    assert isinstance(s, arrays._streams()[1]) and s.ptr == handle  # (CuPy 13: ExternalStream)
    assert again is s  # one wrapper a handle (bounded cache), none built per call
    assert arrays.stream_of(s) is s


def test_stream_of_refuses_what_is_not_a_stream():
    with pytest.raises(TypeError, match=r"stream must be .* got str"):
        arrays.stream_of("stream 0")
    later = SimpleNamespace(__cuda_stream__=lambda: (1, 0xfeed))
    with pytest.raises(TypeError, match=r"__cuda_stream__ version 1 .* only 0"):
        arrays.stream_of(later)


def test_external_stream_names_its_device_and_falls_back_to_external_stream(monkeypatch):
    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = arrays.external_stream(0xd00d, 3)
    assert isinstance(s, arrays._streams()[1]) and (s.ptr, s.device_id) == (0xd00d, 3)
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 13 has only ExternalStream
        monkeypatch.delattr(cupy.cuda.Stream, "from_external")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = arrays.external_stream(0xd00d, 3)
    assert isinstance(old, cupy.cuda.ExternalStream) and (old.ptr, old.device_id) == (0xd00d, 3)
