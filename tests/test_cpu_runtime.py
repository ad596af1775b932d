"""CPU tests of the runtime: kernels compile for both targets, transfer orders, argument checks."""
import numpy as np
import pytest

from cuflux import kernels, topology
from cuflux.arrays import dtype_info
from cuflux.errors import CommTimeoutError
from cuflux.symmetric import Layout
from cuflux.topology import PeerLink, Topology


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_kernel_compiles(arch):
    fams = kernels.families()
    assert "signal.cu" in fams
    for fam in fams.values():
        if int(arch[3:5]) < fam.min_arch:
            continue
        cubin, lowered = kernels.compile_source(fam.source, fam.names, arch)
        assert cubin[:4] == b"\x7fELF", fam.source
        assert set(lowered) == set(fam.names)


def test_compile_error_is_readable(tmp_path, monkeypatch):
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void k() { undefined_thing(); }')
    monkeypatch.setattr(kernels, "KERNEL_DIR", tmp_path)
    with pytest.raises(kernels.CompileError, match="undefined_thing"):
        kernels.compile_source("bad.cu", ["k"], "sm_80")


def test_header_change_changes_cache_key(tmp_path, monkeypatch):
    inc = tmp_path / "include" / "cuflux"
    inc.mkdir(parents=True)
    (inc / "v.cuh").write_text("#define VALUE 1\n")
    (tmp_path / "k.cu").write_text('#include <cuflux/v.cuh>\nextern "C" __global__ void k(int* x)'
                                   " { *x = VALUE; }")
    monkeypatch.setattr(kernels, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(kernels, "INCLUDE_DIR", tmp_path / "include")
    monkeypatch.setenv("CUFLUX_CACHE_DIR", str(tmp_path / "cache"))
    a, _ = kernels.compile_source("k.cu", ["k"], "sm_80")
    (inc / "v.cuh").write_text("#define VALUE 2\n")
    b, _ = kernels.compile_source("k.cu", ["k"], "sm_80")
    assert a != b, "editing a header must not serve the stale cubin"


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
def test_orders_cover_every_peer_once(W):
    for rank in range(W):
        for order in (topology.full_mesh_order(rank, W), topology.ring_order(rank, W)):
            flat = topology.flatten(order)
            assert sorted(flat) == sorted(set(range(W)) - {rank})
    assert topology.full_mesh_order(1, 4) == [[2, 3, 0]]
    assert topology.ring_order(1, 4) == [[0], [3], [2]]


def test_ring_orders_spread_senders():
    # At each stage, no two ranks fetch from the same peer.
    W = 8
    orders = [topology.flatten(topology.ring_order(r, W)) for r in range(W)]
    for step in range(W - 1):
        assert len({o[step] for o in orders}) == W
    orders = [topology.ring2d_order(r, W, 4) for r in range(W)]
    for r, o in enumerate(orders):
        assert sorted(topology.flatten(o)) == sorted(set(range(W)) - {r})
        assert o[0] == [(r + 4) % 8]  # inter-domain transfer first
    with pytest.raises(ValueError, match="multiple of group_size"):
        topology.ring2d_order(0, 6, 4)


def _topo(rank, kinds, numa=0):
    return Topology(rank, tuple(PeerLink(p, True, k == "same_gpu", k != "none", k)
                                for p, k in enumerate(kinds)), numa)


def test_topology_kind_picks_order():
    t = _topo(0, ["self", "nvlink", "nvlink", "nvlink"])
    assert t.kind == "nvlink" and topology.transfer_order(t, 4) == [[1, 2, 3]]
    t = _topo(0, ["self", "pcie", "pcie", "pcie"])
    assert t.kind == "pcie" and topology.transfer_order(t, 4) == [[3], [2], [1]]
    t = _topo(0, ["self", "pcie", "pcie", "pcie"], numa=2)
    assert t.kind == "pcie_numa" and topology.transfer_order(t, 4) == [[2], [1, 3]]
    t = _topo(0, ["self", "same_gpu"])
    assert topology.transfer_order(t, 2) == [[1]]
    assert _topo(0, ["self", "none"]).unreachable() == [1]


def test_layout_offsets_are_aligned():
    lay = Layout()
    a = lay.add("data", (3, 5), np.uint16)
    b = lay.add("flags", 7, np.uint32)
    c = lay.add("more", (1,), np.uint8)
    assert a.offset == 0 and b.offset == 128 and c.offset == 256
    assert lay.num_bytes == 257
    assert "flags" in lay.describe()
    with pytest.raises(ValueError, match="twice"):
        lay.add("data", 1, np.uint8)


def test_dtype_names():
    assert dtype_info("bf16").name == "bfloat16"
    assert dtype_info("float8_e4m3fn").storage == np.uint8
    assert dtype_info(np.float16).name == "float16"
    with pytest.raises(TypeError, match="not supported"):
        dtype_info("int7")
    with pytest.raises(TypeError, match="expected one of"):
        dtype_info("float32", allowed={"bfloat16"}, op="X")


def test_timeout_error_names_everything():
    e = CommTimeoutError("AllGather", 3, 1, 2.5, "flag 0")
    assert "AllGather" in str(e) and "rank 3" in str(e) and "rank 1" in str(e)
    assert (e.op, e.rank, e.peer, e.seconds) == ("AllGather", 3, 1, 2.5)


def test_reference_models_are_reachable_and_allgather_is_exact():
    from cuflux import reference

    shards = [np.full((2, 3), r, dtype=np.float32) for r in range(3)]
    outs = reference.allgather(shards)
    assert all(np.array_equal(o, np.concatenate(shards)) for o in outs)
    for name in reference.__all__:
        assert callable(getattr(reference, name)), name


def test_closeable_releases_once_and_on_context_exit():
    from cuflux.resource import Closeable

    class Op(Closeable):
        def __init__(self):
            self.released = 0

        def _release(self):
            self.released += 1

    op = Op()
    with op as same:
        assert same is op and not op.closed
    assert op.closed and op.released == 1
    op.close()
    assert op.released == 1
    for cls in ("AllGather", "AllReduce", "AllReduceRMSNorm", "All2AllHeads",
                "GemmReduceScatter", "AllGatherGemm", "SymmetricBuffer"):
        import cuflux

        assert issubclass(getattr(cuflux, cls), Closeable), cls


def test_cache_files_are_written_aside_then_renamed(tmp_path, monkeypatch):
    """A reader racing a writer sees the old file or the whole new one, never a part."""
    import os

    from cuflux import kernels

    seen = []
    real_replace = os.replace

    def replace(src, dst):
        with open(src, "rb") as f:
            seen.append((os.path.dirname(src), os.path.exists(dst), f.read()))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "load-abc.cubin"
    kernels.write_atomically(target, b"x" * 1000)
    assert target.read_bytes() == b"x" * 1000
    assert seen == [(str(tmp_path), False, b"x" * 1000)]  # whole file aside, same directory
    assert [p.name for p in tmp_path.iterdir()] == ["load-abc.cubin"]

