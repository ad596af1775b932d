"""Tests of the AllGather op: exact results in pull and push mode, chunked or not, in every
dtype, with stream or kernel waits; torch arrays; many calls back to back; a timeout that names
the late rank and leaves the GPU usable. (The runtime under it: tests/test_runtime.py.)

GPU tests (marked gpu, skipped with the reason where there is no GPU) run the rank bodies beside
them on W ranks sharing the GPU under mpiexec (@on_ranks, tests/mpi.py); inputs encode the source
rank and the call, so a check proves who sent what.
"""
import time
from types import SimpleNamespace

import numpy as np
import pytest

import cuflux
from cuflux import kernels
from cuflux.errors import CommTimeoutError
from cuflux.ops import allgather as AG
from tests.kernel_args import DeviceArray, check_args
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
                    wait="stream", path="copy"):
    """path "sm": rank 0's shard is a view one element off its allocation (its kernel copies
    bytewise where the others' may move 16-byte vectors: a block must own the same bytes on
    every rank)."""
    import cupy

    W, me = world.size, world.rank
    info = cuflux.arrays.dtype_info(dtype)
    with cuflux.AllGather(world, max_rows, cols, dtype, mode=mode, chunk_rows=chunk_rows,
                          timeout_s=15, wait=wait, path=path) as ag:
        rows_seq = [max_rows, 1, max_rows * 3 // 8 + 1, max_rows - 1, 0,
                    min(64, max_rows)][:calls]
        for call, rows in enumerate(rows_seq):
            x = cupy.asarray(_input(me, call, rows, cols, dtype))
            if path == "sm" and me == 0:
                off = cupy.empty(x.size + 1, dtype=x.dtype)
                off[1:] = x.reshape(-1)
                x = off[1:].reshape(x.shape)
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


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("dtype,cols", [("bfloat16", 777), ("float8_e4m3fn", 4096),
                                        ("float32", 64)])
def test_allgather_sm_path_exact(W, dtype, cols):
    allgather_exact.run(W, mode="pull", chunk_rows=None, dtype=dtype, cols=cols, path="sm")


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
def allgather_back_to_back(world, mode, wait, calls=1000, path="copy"):
    """Many calls with changing row counts and no host sync between them; verify every one."""
    import cupy

    W, me = world.size, world.rank
    cols = 256
    outs, rows_seq = [], []
    with cuflux.AllGather(world, 64, cols, "float32", mode=mode, timeout_s=60, wait=wait,
                          path=path) as ag:
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
@pytest.mark.parametrize("mode,wait,path", [("pull", "stream", "copy"), ("push", "stream", "copy"),
                                            ("pull", "kernel", "copy"), ("pull", "stream", "sm")])
def test_allgather_back_to_back(W, mode, wait, path):
    allgather_back_to_back.run(W, mode=mode, wait=wait, path=path, timeout_s=600)


# ---- timeout, then usable -----------------------------------------------------------------------

@on_ranks
def allgather_timeout(world, mode, wait, timeout_s=2.0, path="copy"):
    """After one good call everywhere, the last rank never calls again: the others' stream or
    kernel waits raise CommTimeoutError naming it within the timeout plus a second; afterwards
    the op closes and a new op runs correctly."""
    import cupy

    W, me = world.size, world.rank
    late = W - 1
    ag = cuflux.AllGather(world, 16, 128, "float32", mode=mode, timeout_s=timeout_s, wait=wait,
                          path=path)
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
    res = allgather_exact(world, mode, None, "float32", cols=33, max_rows=9, calls=3, wait=wait,
                          path=path)
    return {"waited": waited, "after": res}


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1])
@pytest.mark.parametrize("mode,wait,path", [("pull", "stream", "copy"), ("push", "stream", "copy"),
                                            ("pull", "kernel", "copy"), ("push", "kernel", "copy"),
                                            ("pull", "stream", "sm")])
def test_allgather_timeout_then_usable(W, mode, wait, path):
    res = allgather_timeout.run(W, mode=mode, wait=wait, path=path)
    assert all(r["after"] for r in res)
    assert all(r["waited"] is not None for r in res[:-1])


# ==== CPU tests (no GPU needed): path="sm" ========================================================


@pytest.mark.parametrize("max_blocks", [1, 3, 8, 32])
def test_sm_plan_gives_each_block_the_same_bytes_on_every_rank(max_blocks):
    for nbytes in (1, 15, 16, 17, 4095, 4096, 4097, 14800, 777 * 2 * 37, 1 << 20, (1 << 27) + 3):
        grid, span = AG.sm_plan(nbytes, max_blocks)
        # from nbytes alone (never a rank's alignment); 16-byte spans: a 16-byte-vector rank
        # and a bytewise rank cut the same bytes per block
        assert span % 16 == 0 and span >= AG.SM_MIN_BLOCK_BYTES, (nbytes, span)
        assert 1 <= grid <= max_blocks, (nbytes, grid)
        assert (grid - 1) * span < nbytes <= grid * span, (nbytes, grid, span)


def test_sm_layout_holds_two_stages_and_a_flag_line_per_block():
    lay = AG.sm_gather_layout(world_size=3, max_rows=37, row_bytes=400, max_blocks=5)
    assert set(lay.regions) == {"stage", "start"}
    assert lay.regions["stage"].shape == (2, 37 * 400 // 128 * 128 + 128)  # 128-byte parities
    assert lay.regions["start"].shape == (5, 16) and lay.regions["start"].dtype == np.uint64
    assert all(r.offset % 128 == 0 for r in lay.regions.values())


def test_path_is_checked_and_sm_runs_allgather_gemm_unfused():
    AG.check_path("AllGather", "copy")
    AG.check_path("AllGather", "sm")
    with pytest.raises(ValueError, match=r"AllGather: path must be one of \('copy', 'sm'\)"):
        AG.check_path("AllGather", "dma")
    from cuflux.ops.ag_gemm import check_build_args

    args = (4, 512, 256, 128, "bfloat16", None, "kn", "pull", None, 30.0, "auto", None, 8)
    check_build_args(*args, path="sm", route="unfused")
    with pytest.raises(ValueError, match="path='sm' runs unfused"):
        check_build_args(*args, path="sm", route="fused")
    with pytest.raises(ValueError, match="path must be one of"):
        check_build_args(*args, path="nvlink")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_allgather_sm_kernels_compile(arch):
    cubin, lowered = kernels.compile_source("allgather.cu", AG.FAMILY.names, arch)
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(AG.FAMILY.names)


@pytest.mark.parametrize("x_ptr,vec", [(1 << 20, 16), ((1 << 20) + 2, 1)])
def test_sm_launch_arguments_match_the_kernel(monkeypatch, x_ptr, vec):
    captured = []
    monkeypatch.setattr(AG.kernels, "launch",
                        lambda fn, grid, block, args, stream, **kw: captured.append(
                            (fn, grid, block, args, kw)))
    op = object.__new__(AG.CopyGather)
    op.op, op.world, op.row_bytes, op.sm_max_blocks = "AllGather", \
        SimpleNamespace(size=4, rank=1), 400, 8
    op.sm_module = {name: name for name in AG.SM_KERNELS.values()}
    op._sm_args_mid = (DeviceArray(), np.uint64(0), np.uint64(1 << 16), np.uint64(1 << 17),
                       np.int32(16), DeviceArray())
    op._sm_args_tail = (np.int32(4), np.int32(1), np.uint64(1 << 40), DeviceArray(),
                        np.uint64(10**9), np.uint32(3))
    x = SimpleNamespace(shape=(37, 200), data=SimpleNamespace(ptr=x_ptr))  # bf16 rows
    op._sm_gather(x, 1 << 22, None)
    fn, grid, block, args, kw = captured[-1]
    assert fn == AG.SM_KERNELS[vec] and kw["shared_mem"] == 8 * 4
    assert grid == (AG.sm_plan(37 * 400, 8)[0],) and block == (AG.SM_THREADS,)
    assert args[0] is x  # the array itself: a device pointer
    check_args("allgather.cu", "allgather_sm", (DeviceArray(),) + args[1:])
    assert args[-8:-6] == (np.int64(37 * 400), np.int64(AG.sm_plan(37 * 400, 8)[1]))
