"""Tests of the runtime, everything that is not the AllGather op (tests/test_allgather.py): World
bootstrap, symmetric memory, flags and stream values, kernels compile for both targets, topology
and transfer orders, layouts, dtypes, errors, resources and the kernel cache.

GPU tests (marked gpu, skipped with the reason where there is no GPU) run the rank bodies beside
them on W ranks sharing the GPU under mpiexec (@on_ranks, tests/mpi.py); inputs encode the source
rank and the call, so a check proves who sent what. CPU tests run anywhere, the World bootstrap's
under mpiexec -n 4 without a GPU.
"""
import time

import numpy as np
import pytest

import cuflux
from cuflux import driver, kernels, topology
from cuflux.arrays import dtype_info
from cuflux.errors import CommTimeoutError, ErrorRecord
from cuflux.signal import wait_flags
from cuflux.symmetric import Layout
from cuflux.topology import PeerLink, Topology, full_mesh_order
from tests.mpi import on_ranks, world_sizes

WS = world_sizes()


def _rng(*key):
    return np.random.default_rng(abs(hash(key)) % (2**32))


# ---- symmetric memory ---------------------------------------------------------------------------

@on_ranks
def symmetric_visible(world):
    import cupy

    W, me = world.size, world.rank
    buf = world.alloc_symmetric((W, 1001), np.float32)
    mine = np.random.default_rng(1000 + me).standard_normal((W, 1001)).astype(np.float32)
    buf.local()[...] = cupy.asarray(mine)
    cupy.cuda.Device().synchronize()
    world.barrier()
    for p in range(W):  # every peer's memory, read through its IPC mapping
        want = np.random.default_rng(1000 + p).standard_normal((W, 1001)).astype(np.float32)
        assert np.array_equal(cupy.asnumpy(buf.peer(p)), want), f"rank {me} reading peer {p}"
    world.barrier()
    for p in range(W):  # write row `me` of every peer
        buf.peer(p)[me] = cupy.full(1001, 100.0 * me + p, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    world.barrier()
    got = cupy.asnumpy(buf.local())
    for p in range(W):
        assert np.all(got[p] == 100.0 * p + me), f"row {p} on rank {me}"
    ptrs = cupy.asnumpy(buf.ptrs_dev)
    assert list(ptrs) == buf.base_ptrs and ptrs[me] == buf.ptr(me)
    buf.close()
    buf.close()  # idempotent
    assert buf.closed
    with world.alloc_symmetric((3,), np.uint32) as b2:
        assert int(b2.local().sum()) == 0  # zeroed at set-up
    return True


test_symmetric_buffers_visible_from_every_peer = symmetric_visible.test(expect=True)


# ---- flags by epoch and stream values -----------------------------------------------------------

@on_ranks
def flags_by_epoch(world, calls=200):
    import cupy

    W, me = world.size, world.rank
    lay = Layout()
    lay.add("flags", (W,), np.uint32)
    lay.add("wide", (W,), np.uint64)
    pad = world.alloc_layout(lay)
    err = ErrorRecord("test", me, timeout_s=20)
    s = cupy.cuda.Stream(non_blocking=True)
    for e in range(1, calls + 1):
        for p in range(W):  # signal peer p: "rank me reached epoch e"
            driver.stream_write_value32(s, pad.ptr(p, "flags", 4 * me), e)
        wait_flags(pad.ptr(me, "flags"), e, err, s, op="test", num_groups=W)
    s.synchronize()
    err.check()
    assert np.all(cupy.asnumpy(pad.local("flags")) == calls)
    world.barrier()
    # 64-bit write, and the driver's (unbounded) stream wait on a value already reached.
    big = (1 << 40) + me
    for p in range(W):
        driver.stream_write_value64(s, pad.ptr(p, "wide", 8 * me), big - me + p)
    s.synchronize()
    world.barrier()
    for p in range(W):
        driver.stream_wait_value64(s, pad.ptr(me, "wide", 8 * p), (1 << 40) + me, "geq")
        driver.stream_wait_value32(s, pad.ptr(me, "flags", 4 * p), calls, "geq")
    s.synchronize()
    assert list(cupy.asnumpy(pad.local("wide"))) == [(1 << 40) + me] * W
    # A flag nobody writes: the bounded wait gives up and names the peer.
    err2 = ErrorRecord("test", me, timeout_s=0.5)
    t0 = time.perf_counter()
    wait_flags(pad.ptr(me, "flags"), calls + 7, err2, s, op="test", num_groups=1,
               first_peer=(me + 1) % W)
    s.synchronize()
    waited = time.perf_counter() - t0
    try:
        err2.check()
        raise AssertionError("a wait on a flag nobody writes did not time out")
    except CommTimeoutError as e:
        assert e.rank == me and e.peer == (me + 1) % W and "expected %d" % (calls + 7) in str(e)
    assert waited < 0.5 + 1.0, waited
    err.close(); err2.close()
    pad.close()
    return waited


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_flags_by_epoch_and_stream_values(W):
    waited = flags_by_epoch.run(W)
    assert all(w < 1.5 for w in waited)


# ==== CPU tests ==================================================================================

# ---- World bootstrap under mpiexec (no GPU needed) ----------------------------------------------

@on_ranks
def bootstrap(world):
    assert world.size >= 1 and 0 <= world.rank < world.size
    assert world.local_rank == world.rank  # one host in tests
    got = world.allgather(world.rank * 10)
    assert got == [r * 10 for r in range(world.size)], got
    world.check_same(("shape", 128), "a value equal on every rank")
    try:
        world.check_same(world.rank, "the rank")
    except ValueError as e:
        assert "differs between ranks" in str(e) and "rank 1: 1" in str(e), e
    else:
        if world.size > 1:
            raise AssertionError("check_same accepted values that differ")
    links = world.topology.links
    assert len(links) == world.size and links[world.rank].link == "self"
    if world.device is None:
        assert all(l.peer == i for i, l in enumerate(links))
    world.barrier()
    # A sub-communicator (a TP group of two) works as a world of its own.
    sub = world.comm.Split(world.rank // 2, world.rank)
    tp = cuflux.init(sub)
    assert tp.size == min(2, world.size - (world.rank // 2) * 2) and tp.rank == world.rank % 2
    return {"rank": world.rank, "device": world.device,
            "order": full_mesh_order(world.rank, world.size)}


def test_bootstrap_four_ranks():
    results = bootstrap.run(4, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert results[1]["order"] == [[2, 3, 0]]


@on_ranks
def identity(world, fail_rank=None, hang_rank=None):
    """The rank's process id and the CUFLUX_* setting it sees; fails or hangs on request
    (for the tests of the rank pool in tests/mpi.py)."""
    import os
    import time

    if world.rank == fail_rank:
        raise RuntimeError(f"rank {world.rank} fails on purpose")
    if world.rank == hang_rank:
        time.sleep(3600)
    world.barrier()
    return {"pid": os.getpid(), "setting": os.environ.get("CUFLUX_POOL_PROBE")}


def test_rank_pool_reuses_ranks_passes_settings_and_survives_failures(monkeypatch):
    import pytest

    from tests import mpi

    monkeypatch.setenv("CUFLUX_TEST_POOL", "1")
    monkeypatch.setenv("CUFLUX_POOL_PROBE", "a")
    first = identity.run(3, timeout_s=120)
    monkeypatch.setenv("CUFLUX_POOL_PROBE", "b")
    second = identity.run(3, timeout_s=120)
    assert [r["pid"] for r in first] == [r["pid"] for r in second]  # same processes
    assert {r["setting"] for r in first} == {"a"} and {r["setting"] for r in second} == {"b"}
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        identity.run(3, timeout_s=120, fail_rank=1)
    with pytest.raises(AssertionError, match="TIMED OUT"):
        identity.run(3, timeout_s=5, hang_rank=2)
    third = identity.run(3, timeout_s=120)
    assert not {r["pid"] for r in third} & {r["pid"] for r in first}  # a new pool
    mpi.close_pools()


# ---- kernels, topology, layouts, dtypes, errors, resources, cache -------------------------------

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


def test_a_peer_gpu_this_process_cannot_see_is_no_p2p_link(monkeypatch):
    """A rank whose peer's GPU is not visible here (a CUDA_VISIBLE_DEVICES per rank): the
    peer's bus id names no device of this process, so the link is no P2P (the ranks become
    different nodes, reached by the rail) instead of World set-up raising."""
    from cupy.cuda import runtime

    from cuflux.world import World

    def unknown_bus(bus):
        raise runtime.CUDARuntimeError(101)  # cudaErrorInvalidDevice

    monkeypatch.setattr(runtime, "deviceGetByPCIBusId", unknown_bus)
    w = World.__new__(World)
    w.device = 0
    assert w._probe_link(1, "0000:99:00.0") == PeerLink(1, True, False, False, "none")
