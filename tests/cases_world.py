"""Rank bodies for the World bootstrap tests (no GPU needed)."""
import cuflux
from cuflux.topology import full_mesh_order


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
    return {"rank": world.rank, "device": world.device, "order": full_mesh_order(world.rank, world.size)}


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
