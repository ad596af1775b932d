"""Tests of the AllGather op: exact results in pull and push mode, chunked or not, in every
dtype, with stream or kernel waits; torch arrays; many calls back to back; a timeout that names
the late rank and leaves the GPU usable. (The runtime under it: tests/test_runtime.py.)

GPU tests (marked gpu, skipped with the reason where there is no GPU) run the rank bodies beside
them on W ranks sharing the GPU under mpiexec (@on_ranks, tests/mpi.py); inputs encode the source
rank and the call, so a check proves who sent what.
"""
import time

import numpy as np
import pytest

import cuflux
from cuflux.errors import CommTimeoutError
from tests.mpi import on_ranks, world_sizes

WS = world_sizes()


def _input(rank, call, rows, cols, dtype_name):
    """Deterministic random shard of `rank` for call `call` (numpy, storage dtype)."""
    rng = np.random.default_rng([rank, call, rows, cols])
    if dtype_name.startswith("float8"):
        return rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    info = cuflux.arrays.dtype_info(dtype_name)
    return rng.standard_normal((rows, cols)).astype(np.float32).astype(info.storage)


# ---- exact results ------------------------------------------------------------------------------

@on_ranks
def allgather_exact(world, mode, chunk_rows, dtype, cols=777, max_rows=100, calls=6,
                    wait="stream"):
    import cupy

    W, me = world.size, world.rank
    info = cuflux.arrays.dtype_info(dtype)
    with cuflux.AllGather(world, max_rows, cols, dtype, mode=mode, chunk_rows=chunk_rows,
                          timeout_s=15, wait=wait) as ag:
        rows_seq = [max_rows, 1, max_rows * 3 // 8 + 1, max_rows - 1, 0,
                    min(64, max_rows)][:calls]
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


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("chunk_rows,dtype,wait", [(None, "bfloat16", "stream"),
                                                   (64, "float32", "kernel"),
                                                   (7, "float8_e4m3fn", "stream"),
                                                   (13, "float16", "stream")])
def test_allgather_exact(W, mode, chunk_rows, dtype, wait):
    allgather_exact.run(W, mode=mode, chunk_rows=chunk_rows, dtype=dtype, wait=wait)


# ---- torch arrays -------------------------------------------------------------------------------

@on_ranks
def allgather_torch(world):
    import cupy
    import torch

    W, me = world.size, world.rank
    with cuflux.AllGather(world, 8, 64, "bfloat16") as ag:
        x = torch.full((8, 64), float(me + 1), dtype=torch.bfloat16,
                       device=f"cuda:{world.device}")
        y = ag(x, stream=torch.cuda.current_stream().cuda_stream)
        ag.synchronize(stream=torch.cuda.current_stream().cuda_stream)
        assert isinstance(y, torch.Tensor), f"torch in, {type(y).__name__} out"
        got = cupy.asnumpy(cupy.from_dlpack(y.float()))
        assert all(np.all(got[8 * p:8 * p + 8] == p + 1) for p in range(W))
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_allgather_torch_arrays(W):
    pytest.importorskip("torch", reason="torch is not installed: pip install torch")
    assert allgather_torch.run(W) == [True] * W


# ---- back to back -------------------------------------------------------------------------------

@on_ranks
def allgather_back_to_back(world, mode, wait, calls=1000):
    """Many calls with changing row counts and no host sync between them; verify every one."""
    import cupy

    W, me = world.size, world.rank
    cols = 256
    outs, rows_seq = [], []
    with cuflux.AllGather(world, 64, cols, "float32", mode=mode, timeout_s=60, wait=wait) as ag:
        for i in range(calls):
            rows = 1 + (i * 37) % 64
            x = (me * 1_000_000 + i * 1000) \
                + cupy.arange(rows * cols, dtype=cupy.float32).reshape(rows, cols) % 1000
            outs.append(ag(x))
            rows_seq.append(rows)
        ag.synchronize()
        for i, (rows, y) in enumerate(zip(rows_seq, outs)):
            base = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) % 1000
            want = np.concatenate([p * 1_000_000 + i * 1000 + base for p in range(W)])
            assert np.array_equal(cupy.asnumpy(y), want), f"call {i}"
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode,wait", [("pull", "stream"), ("push", "stream"),
                                       ("pull", "kernel")])
def test_allgather_back_to_back(W, mode, wait):
    allgather_back_to_back.run(W, mode=mode, wait=wait, timeout_s=600)


# ---- timeout, then usable -----------------------------------------------------------------------

@on_ranks
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


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1])
@pytest.mark.parametrize("mode,wait", [("pull", "stream"), ("push", "stream"),
                                       ("pull", "kernel"), ("push", "kernel")])
def test_allgather_timeout_then_usable(W, mode, wait):
    res = allgather_timeout.run(W, mode=mode, wait=wait)
    assert all(r["after"] for r in res)
    assert all(r["waited"] is not None for r in res[:-1])
