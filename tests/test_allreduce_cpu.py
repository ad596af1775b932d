"""CPU tests of AllReduce / AllReduceRMSNorm: token slices, the golden models, launch plans,
the crossover, argument checks (fake world and fake arrays), NVRTC compilation. No GPU needed."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

import cuflux.ops.allreduce as ar
from cuflux import kernels
from cuflux.arrays import dtype_info
from cuflux.errors import CufluxError
from cuflux.ops.allreduce import (AllReduce, AllReduceRMSNorm, choose_algo, plan_launch,
                                  reference_allreduce, reference_allreduce_rmsnorm, token_slice)
from tests.fakes import FakeArray
from tests.kernel_args import DeviceArray, check_args


# ---- token slices ---------------------------------------------------------------------------
@pytest.mark.parametrize("W", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("T", [0, 1, 2, 5, 7, 8, 9, 128, 1000, 4097])
def test_token_slices_cover_every_row_once(T, W):
    slices = [token_slice(T, W, r) for r in range(W)]
    assert slices[0][0] == 0 and slices[-1][1] == T
    for (a0, b0), (a1, b1) in zip(slices, slices[1:]):
        assert b0 == a1  # contiguous, in rank order
    sizes = [b - a for a, b in slices]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert max(sizes) == -(-T // W)  # the two-shot grid bound


def test_token_slices_with_fewer_tokens_than_ranks():
    assert [token_slice(3, 8, r) for r in range(8)] == \
        [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3), (3, 3), (3, 3), (3, 3)]
    assert [token_slice(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


# ---- golden models ----------------------------------------------------------------------------
def _manual_rmsnorm(xs, residual, weight, eps):
    """Element by element, independent of the vectorised reference."""
    T, H = residual.shape
    out, h = np.zeros((T, H)), np.zeros((T, H))
    for t in range(T):
        for j in range(H):
            h[t, j] = sum(float(x[t, j]) for x in xs) + float(residual[t, j])
        ms = sum(v * v for v in h[t]) / H
        for j in range(H):
            out[t, j] = h[t, j] / math.sqrt(ms + eps) * float(weight[j])
    return out, h


@pytest.mark.parametrize("W", [1, 2, 3])
def test_reference_matches_manual_and_modes_agree(W):
    rng = np.random.default_rng(W)
    T, H = 5, 6
    xs = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(W)]
    residual = rng.standard_normal((T, H)).astype(np.float32)
    weight = rng.standard_normal(H).astype(np.float32)
    out, h = _manual_rmsnorm(xs, residual, weight, 1e-3)
    rep = reference_allreduce_rmsnorm(xs, residual, weight, 1e-3, "replicated", W)
    shd = reference_allreduce_rmsnorm(xs, residual, weight, 1e-3, "sharded_residual", W)
    sp = reference_allreduce_rmsnorm(xs, residual, weight, 1e-3, "sequence_parallel", W)
    for r in range(W):
        a, b = token_slice(T, W, r)
        np.testing.assert_allclose(rep[r][0], out, rtol=1e-12)
        np.testing.assert_allclose(rep[r][1], h, rtol=1e-12)
        np.testing.assert_allclose(shd[r][0], out, rtol=1e-12)
        np.testing.assert_allclose(shd[r][1][a:b], h[a:b], rtol=1e-12)
        outside = np.r_[0:a, b:T]
        assert np.array_equal(shd[r][1][outside], residual[outside].astype(np.float64))
        np.testing.assert_allclose(sp[r][0], out[a:b], rtol=1e-12)
        np.testing.assert_allclose(sp[r][1], h[a:b], rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([s[0] for s in sp]), out, rtol=1e-12)
    np.testing.assert_allclose(reference_allreduce(xs), sum(x.astype(np.float64) for x in xs))


def test_reference_rejects_bad_arguments():
    xs = [np.ones((2, 3))] * 2
    with pytest.raises(ValueError, match="mode must be one of"):
        reference_allreduce_rmsnorm(xs, np.ones((2, 3)), np.ones(3), 1e-6, "plain", 2)
    with pytest.raises(ValueError, match="2 inputs for W=3"):
        reference_allreduce_rmsnorm(xs, np.ones((2, 3)), np.ones(3), 1e-6, "replicated", 3)


# ---- crossover and launch plans --------------------------------------------------------------
def test_crossover():
    for mode in ("sharded_residual", "sequence_parallel"):
        assert all(choose_algo(n, W, mode) == "two_shot" for n in (2, 1 << 30) for W in (1, 2, 8))
    assert choose_algo(1 << 30, 2, "plain") == "one_shot"       # W = 2: never fewer bytes
    assert choose_algo(1 << 30, 3, "replicated") == "one_shot"
    for W in (4, 8):
        for mode in ("plain", "replicated"):
            algos = [choose_algo(n, W, mode) for n in (1 << 10, 1 << 16, 1 << 20, 1 << 26)]
            assert algos[0] == "one_shot" and algos[-1] == "two_shot"
            assert algos == sorted(algos)  # one threshold: "one_shot" < "two_shot"


ALL_NAMES = set(ar.FAMILY.names)


@pytest.mark.parametrize("dtype", ar.DTYPES)
@pytest.mark.parametrize("mode", ["replicated", "sharded_residual", "sequence_parallel"])
@pytest.mark.parametrize("W", [1, 2, 8])
@pytest.mark.parametrize("T,H", [(1, 1024), (7, 5128), (1000, 8192), (3, 1001), (4096, 4096)])
def test_norm_plans(dtype, mode, W, T, H):
    d = dtype_info(dtype)
    for algo in (["two_shot"] if mode != "replicated" else ["one_shot", "two_shot"]):
        p = plan_launch(mode, dtype, T * H, H, W, algo, True, 16, 132)
        assert p.kernel in ALL_NAMES
        assert p.vec_bytes == (16 if H * d.itemsize % 16 == 0 else d.itemsize)
        nvec = H // (p.vec_bytes // d.itemsize)
        assert p.rows == T and p.cols == H and p.num_elems == T * H
        in_registers = "rmsnorm_local_reg" in p.kernel
        per_thread = ar.LOCAL_REG_VECS if in_registers else -(-nvec // 1024)
        assert p.block % 32 == 0 and p.block * per_thread >= nvec
        assert p.block <= (ar.LOCAL_REG_THREADS if in_registers else 1024)
        assert p.shared_mem == 0 if in_registers else p.shared_mem >= 4 * H
        if W == 1:
            assert p.local and p.kernel.startswith("rmsnorm_local") and p.grid == T
            assert in_registers == (nvec <= ar.LOCAL_REG_VECS * ar.LOCAL_REG_THREADS)
        else:
            assert not p.local and not in_registers and p.grid <= 16
            assert p.shared_mem >= 4 * H + 8 * W
            assert p.grid <= (-(-T // W) if algo == "two_shot" else T)
        assert plan_launch(mode, dtype, T * H, H, W, algo, False, 16, 132).vec_bytes == d.itemsize


@pytest.mark.parametrize("dtype", ar.DTYPES)
@pytest.mark.parametrize("n", [8, 1000 * 8, 8192 * 3, 1 << 22])
@pytest.mark.parametrize("W", [2, 4, 8])
def test_plain_row_geometry_does_not_depend_on_pointer_alignment(dtype, n, W):
    """One rank passing a misaligned view (narrow accesses) must stage and reduce the same rows
    in the same blocks as its aligned peers: rows, cols and grid agree, only the vector width
    differs."""
    for algo in ("one_shot", "two_shot"):
        wide = plan_launch("plain", dtype, n, None, W, algo, True, 32, 132)
        narrow = plan_launch("plain", dtype, n, None, W, algo, False, 32, 132)
        assert narrow.vec_bytes < wide.vec_bytes == 16
        assert (narrow.rows, narrow.cols, narrow.grid) == (wide.rows, wide.cols, wide.grid)


@pytest.mark.parametrize("dtype", ar.DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 8192 * 3 + 5, 1 << 22])
def test_plain_plans(dtype, n):
    d = dtype_info(dtype)
    for W, algo in ((1, "one_shot"), (4, "one_shot"), (4, "two_shot")):
        p = plan_launch("plain", dtype, n, None, W, algo, True, 32, 132)
        assert p.kernel in ALL_NAMES and not p.local
        assert p.vec_bytes == (16 if n * d.itemsize % 16 == 0 else d.itemsize)
        assert p.cols == ar.PLAIN_ROW_VECS * 16 // d.itemsize
        assert (p.rows - 1) * p.cols < n <= p.rows * p.cols
        assert p.block == 1024 and p.shared_mem == 8 * W


# ---- argument checks --------------------------------------------------------------------------
def _fake_world(W=2, rank=0):
    return SimpleNamespace(rank=rank, size=W, device=None, check_same=lambda v, what: None,
                           allgather=lambda o: [o] * W, topology=None)


@pytest.mark.parametrize("kwargs,exc,text", [
    (dict(output="tensor_parallel"), ValueError, "output must be one of"),
    (dict(algo="three_shot"), ValueError, "algo must be one of"),
    (dict(eps=0.0), ValueError, "eps must be a finite number > 0"),
    (dict(eps=-1e-6), ValueError, "eps must be a finite number > 0"),
    (dict(eps=float("nan")), ValueError, "eps must be a finite number > 0"),
    (dict(dtype="int8"), TypeError, "not supported"),
    (dict(dtype="float8_e4m3fn"), TypeError, "expected one of"),
    (dict(max_tokens=0), ValueError, r"(max_tokens|hidden) must be an integer in \[1, "),
    (dict(hidden=0), ValueError, r"(max_tokens|hidden) must be an integer in \[1, "),
    (dict(max_tokens=1 << 20, hidden=1 << 12), ValueError, r"max_tokens \* hidden must be"),
    (dict(timeout_s=0), ValueError, "timeout_s must be a finite number of seconds > 0"),
    (dict(timeout_s=float("nan")), ValueError, "timeout_s must be a finite number"),
    (dict(timeout_s=float("inf")), ValueError, "timeout_s must be a finite number"),
    (dict(timeout_s="30"), ValueError, "timeout_s must be a finite number"),
    (dict(max_blocks=0), ValueError, r"max_blocks must be an integer >= 1 or None"),
    (dict(output="sharded_residual", algo="one_shot"), ValueError, "needs the two-shot"),
    (dict(output="sequence_parallel", algo="one_shot"), ValueError, "needs the two-shot"),
    (dict(), CufluxError, "needs a CUDA device"),  # valid arguments reach the allocation
])
def test_norm_constructor_checks(kwargs, exc, text):
    args = dict(max_tokens=16, hidden=64, dtype="bfloat16")
    args.update(kwargs)
    with pytest.raises(exc, match=text) as e:
        AllReduceRMSNorm(_fake_world(), **args)
    assert "AllReduceRMSNorm" in str(e.value)


@pytest.mark.parametrize("kwargs,exc,text", [
    (dict(max_elems=0), ValueError, r"max_elems must be an integer in \[1, "),
    (dict(max_elems=1 << 31), ValueError, r"max_elems must be an integer in \[1, "),
    (dict(algo="ring"), ValueError, "algo must be one of"),
    (dict(dtype="float64"), TypeError, "not supported"),
    (dict(), CufluxError, "needs a CUDA device"),
])
def test_allreduce_constructor_checks(kwargs, exc, text):
    args = dict(max_elems=1000, dtype="float16")
    args.update(kwargs)
    with pytest.raises(exc, match=text) as e:
        AllReduce(_fake_world(), **args)
    assert "AllReduce" in str(e.value)




def _fake_norm(output, W=4, rank=3):
    op = object.__new__(AllReduceRMSNorm)
    op.op, op.world = "AllReduceRMSNorm", SimpleNamespace(size=W, rank=rank, device=0)
    op.dtype, op.hidden, op.max_tokens, op.output = dtype_info("bfloat16"), 64, 16, output
    return op


A = FakeArray


@pytest.mark.parametrize("output,x,res,w,out,algo,exc,text", [
    ("replicated", A((8, 64), "float16"), A((8, 64)), A((64,)), None, None, TypeError,
     "x must be bfloat16"),
    ("replicated", A((8, 64, 1)), A((8, 64)), A((64,)), None, None, ValueError,
     "x must have 2 dimensions"),
    ("replicated", A((8, 32)), A((8, 32)), A((64,)), None, None, ValueError, r"x must be \[T, 64\]"),
    ("replicated", A((17, 64)), A((17, 64)), A((64,)), None, None, ValueError,
     "17 tokens, more than max_tokens=16"),
    ("replicated", A((8, 64)), A((7, 64)), A((64,)), None, None, ValueError,
     r"residual must have shape \(8, 64\)"),
    ("replicated", A((8, 64)), A((8, 64)), A((64, 1)), None, None, ValueError,
     r"weight must have shape \(64,\)"),
    ("replicated", A((8, 64)), A((8, 64)), A((64,), "float32"), None, None, TypeError,
     "weight must be bfloat16"),
    ("replicated", A((8, 64), contiguous=False), A((8, 64)), A((64,)), None, None, ValueError,
     "x must be C-contiguous"),
    ("replicated", A((8, 64)), A((8, 64), device=1), A((64,)), None, None, ValueError,
     "residual is on device 1"),
    ("replicated", A((8, 64)), A((8, 64)), A((64,)), A((8, 63)), None, ValueError,
     r"out must have shape \(8, 64\)"),
    # W = 4, rank 3, T = 10: this rank's slice is rows [8, 10).
    ("sequence_parallel", A((10, 64)), A((10, 64)), A((64,)), None, None, ValueError,
     r"residual must have shape \(2, 64\)"),
    ("sequence_parallel", A((10, 64)), A((2, 64)), A((64,)), A((10, 64)), None, ValueError,
     r"out must have shape \(2, 64\)"),
    ("sharded_residual", A((10, 64)), A((2, 64)), A((64,)), None, None, ValueError,
     r"residual must have shape \(10, 64\)"),
    ("sharded_residual", A((10, 64)), A((10, 64)), A((64,)), None, "one_shot", ValueError,
     "needs algo='two_shot'"),
    ("replicated", A((10, 64)), A((10, 64)), A((64,)), None, "fast", ValueError,
     "algo must be one of"),
])
def test_norm_call_checks(monkeypatch, output, x, res, w, out, algo, exc, text):
    monkeypatch.setattr(ar, "as_cupy", lambda a, name, op: a)
    with pytest.raises(exc, match=text) as e:
        ar.check_norm_call(_fake_norm(output), x, res, w, out, algo)
    assert "AllReduceRMSNorm" in str(e.value)


def test_norm_call_accepts_good_shapes(monkeypatch):
    monkeypatch.setattr(ar, "as_cupy", lambda a, name, op: a)
    ar.check_norm_call(_fake_norm("sequence_parallel"), A((10, 64)), A((2, 64)), A((64,)),
                       A((2, 64)), "two_shot")
    ar.check_norm_call(_fake_norm("sequence_parallel", rank=3, W=8), A((3, 64)), A((0, 64)),
                       A((64,)), None, None)  # T < W: an empty slice
    ar.check_norm_call(_fake_norm("replicated"), A((16, 64)), A((16, 64)), A((64,)), None,
                       "one_shot")


# ---- compilation --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_allreduce_kernels_compile(arch):
    cubin, lowered = kernels.compile_source("allreduce.cu", ar.FAMILY.names, arch)
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(ar.FAMILY.names)


# ---- launch arguments against the kernel signatures (no GPU: a wrong order would corrupt) ----
def _check_args(kernel, args):
    check_args("allreduce.cu", kernel, args)


@pytest.mark.parametrize("W,T", [(1, 5), (4, 300)])
def test_launch_arguments_match_kernel_signatures(monkeypatch, W, T):
    captured = []
    monkeypatch.setattr(ar, "_kernel", lambda module, plan: plan.kernel)
    monkeypatch.setattr(ar.kernels, "launch",
                        lambda fn, grid, block, args, stream, **kw: captured.append((fn, args)))
    op = object.__new__(AllReduceRMSNorm)
    op.op, op.world = "AllReduceRMSNorm", SimpleNamespace(size=W, rank=W - 1, device=0)
    op.mode, op.dtype, op.module = "replicated", dtype_info("bfloat16"), None
    op._offsets, op._stage_parity_bytes, op.flag_stride = {"stage": 0, "start": 4096,
                                                           "mid": 8192}, 1 << 20, 32
    op.buf, op.state = SimpleNamespace(ptrs_dev=DeviceArray()), DeviceArray()
    op.err_args = (np.uint64(1 << 40), DeviceArray(), np.uint64(10**9), np.uint32(4))
    op._static_args()
    arr = DeviceArray()
    for H in (4096, 1001, 8192 * 4):
        plan = plan_launch("replicated", "bfloat16", T * H, H, W, "two_shot", True, 16, 132)
        op._launch(op._entry(plan), arr, arr, arr, arr, np.float32(1e-6), None)
        name = plan.kernel.split("<")[0]
        expected = ("allreduce_rmsnorm" if W > 1 else
                    "rmsnorm_local_reg" if H <= 8192 else "rmsnorm_local")
        assert captured[-1][0] == plan.kernel and name == expected
        _check_args(name, captured[-1][1])
    if W > 1:
        plan = plan_launch("plain", "float32", 1000, None, W, "one_shot", True, 16, 132)
        op._launch(op._entry(plan), arr, arr, None, None, np.float32(0.0), None)
        _check_args("allreduce_rmsnorm", captured[-1][1])
