"""Rank bodies of the runtime GPU tests (run under tests/mpi.py, ranks sharing the GPU).

Inputs encode the source rank and the call, so a check proves who sent what.
"""
import time

import numpy as np

import cuflux
from cuflux import driver
from cuflux.errors import CommTimeoutError, ErrorRecord
from cuflux.signal import wait_flags
from cuflux.symmetric import Layout


def _rng(*key):
    return np.random.default_rng(abs(hash(key)) % (2**32))


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
    wait_flags(pad.ptr(me, "flags"), calls + 7, err2, s, op="test", num_groups=1, first_peer=(me + 1) % W)
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


def _input(rank, call, rows, cols, dtype_name):
    """Deterministic random shard of `rank` for call `call` (numpy, storage dtype)."""
    rng = np.random.default_rng([rank, call, rows, cols])
    if dtype_name.startswith("float8"):
        return rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    info = cuflux.arrays.dtype_info(dtype_name)
    return rng.standard_normal((rows, cols)).astype(np.float32).astype(info.storage)


def allgather_exact(world, mode, chunk_rows, dtype, cols=777, max_rows=100, calls=6,
                    wait="stream"):
    import cupy

    W, me = world.size, world.rank
    info = cuflux.arrays.dtype_info(dtype)
    with cuflux.AllGather(world, max_rows, cols, dtype, mode=mode, chunk_rows=chunk_rows,
                          timeout_s=15, wait=wait) as ag:
        rows_seq = [max_rows, 1, max_rows * 3 // 8 + 1, max_rows - 1, 0, min(64, max_rows)][:calls]
        for call, rows in enumerate(rows_seq):
            x = cupy.asarray(_input(me, call, rows, cols, dtype))
            out = cupy.empty((W * rows, cols), dtype=info.storage)
            out.view(np.uint8)[...] = 0xFF  # poison: every byte must be written
            got = ag(x, out=out)
            assert got is out
            ag.synchronize()
            want = np.concatenate([_input(p, call, rows, cols, dtype) for p in range(W)]) \
                if rows else np.empty((0, cols), info.storage)
            assert np.array_equal(cupy.asnumpy(got).view(np.uint8), want.view(np.uint8)), \
                f"mode={mode} chunk_rows={chunk_rows} call={call} rows={rows}"
        # Owned output path, and torch through DLPack when torch is present.
        x = cupy.asarray(_input(me, 99, 5, cols, dtype))
        y = ag(x)
        ag.synchronize()
        want = np.concatenate([_input(p, 99, 5, cols, dtype) for p in range(W)])
        assert np.array_equal(cupy.asnumpy(y).view(np.uint8), want.view(np.uint8))
    return True


def allgather_torch(world):
    try:
        import torch
    except ImportError:
        return "torch missing"
    import cupy

    W, me = world.size, world.rank
    with cuflux.AllGather(world, 8, 64, "bfloat16") as ag:
        x = torch.full((8, 64), float(me + 1), dtype=torch.bfloat16, device=f"cuda:{world.device}")
        y = ag(x, stream=torch.cuda.current_stream().cuda_stream)
        ag.synchronize(stream=torch.cuda.current_stream().cuda_stream)
        assert isinstance(y, torch.Tensor), f"torch in, {type(y).__name__} out"
        got = cupy.asnumpy(cupy.from_dlpack(y.float()))
        assert all(np.all(got[8 * p:8 * p + 8] == p + 1) for p in range(W))
    return True


def allgather_back_to_back(world, mode, wait, calls=1000):
    """Many calls with changing row counts and no host sync between them; verify every one."""
    import cupy

    W, me = world.size, world.rank
    cols = 256
    outs, rows_seq = [], []
    with cuflux.AllGather(world, 64, cols, "float32", mode=mode, timeout_s=60, wait=wait) as ag:
        for i in range(calls):
            rows = 1 + (i * 37) % 64
            x = (me * 1_000_000 + i * 1000) + cupy.arange(rows * cols, dtype=cupy.float32).reshape(rows, cols) % 1000
            outs.append(ag(x))
            rows_seq.append(rows)
        ag.synchronize()
        for i, (rows, y) in enumerate(zip(rows_seq, outs)):
            base = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) % 1000
            want = np.concatenate([p * 1_000_000 + i * 1000 + base for p in range(W)])
            assert np.array_equal(cupy.asnumpy(y), want), f"call {i}"
    return calls


def allgather_timeout(world, mode, wait, timeout_s=2.0):
    """After one good call everywhere, the last rank never calls again: the others' stream or
    kernel waits raise CommTimeoutError naming it within the timeout plus a second; afterwards
    the op closes and a new op runs correctly."""
    import cupy

    W, me = world.size, world.rank
    late = W - 1
    ag = cuflux.AllGather(world, 16, 128, "float32", mode=mode, timeout_s=timeout_s, wait=wait)
    waited = None
    x = cupy.ones((16, 128), dtype=cupy.float32)
    ag(x)  # every rank: the row count is now agreed, so the next call reaches the waits at once
    ag.synchronize()
    if me != late:
        t0 = time.perf_counter()
        try:
            ag(x)
            ag.synchronize()
            raise AssertionError("no CommTimeoutError although a rank never sent")
        except CommTimeoutError as e:
            waited = time.perf_counter() - t0
            assert e.peer == late and e.rank == me and e.op == "AllGather", str(e)
            assert waited < timeout_s + 1.0, waited
        # Later calls of the failed op refuse to run until reset.
        try:
            ag(x)
            raise AssertionError("a failed op ran again")
        except CommTimeoutError:
            pass
    world.barrier()
    ag.close()
    # The CUDA context is not poisoned: a new op works.
    res = allgather_exact(world, mode, None, "float32", cols=33, max_rows=9, calls=3, wait=wait)
    return {"waited": waited, "after": res}
