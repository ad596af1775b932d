"""CPU tests of All2AllHeads: the kernels compile, argument checks (with fake arrays and a fake
world, no GPU), the symmetric layout, and the NumPy reference against hand-worked cases."""
import types

import numpy as np
import pytest

from cuflux import kernels
from cuflux.arrays import dtype_info
from cuflux.ops import all2all as a2a
from cuflux.ops.all2all import (All2AllHeads, Spec, build_layout, call_hash, check_call,
                                check_op_args, check_tokens, io_shapes, reference_gather_heads,
                                reference_scatter_heads, scale_shapes, vec_bytes)
from tests.fakes import FakeArray


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernels_compile(arch):
    cubin, lowered = kernels.compile_source("all2all.cu", a2a.FAMILY.names, arch)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(a2a.FAMILY.names)
    assert "a2a_push<16, true>" in lowered and "a2a_copy_out<1>" in lowered


class FakeWorld:
    def __init__(self, size, rank=0):
        self.size, self.rank, self.device = size, rank, None
        self.checked = []

    def check_same(self, value, what):
        self.checked.append(value)

    def allgather(self, obj):
        return [obj] * self.size

    def alloc_layout(self, layout):
        raise AssertionError("bad arguments must be refused before any allocation")




def _spec(W=4, rank=1, dtype="bfloat16", H=8, D=64, batch=2, max_tokens=16):
    return Spec(W, rank, 0, max_tokens, H, D, dtype_info(dtype), batch)


@pytest.mark.parametrize("args,match", [
    ((4, 16, 6, 64, 1, None, 1.0), "divisible by the world size 4"),
    ((4, 0, 8, 64, 1, None, 1.0), "max_tokens_per_rank must be an integer >= 1"),
    ((4, 16, 8, 0, 1, None, 1.0), "head_dim"),
    ((4, 16, 8, 64, 0, None, 1.0), "batch"),
    ((4, 16, 8, 64, 1, 0, 1.0), "num_sms"),
    ((4, 16, 8, 64, 1, None, 0.0), "timeout_s"),
    ((4, 16, 8.0, 64, 1, None, 1.0), "num_heads"),
    ((2, 2**30, 4, 64, 2, None, 1.0), "2**31 rows"),
])
def test_op_arguments_refused(args, match):
    with pytest.raises(ValueError, match=match.replace("*", r"\*")):
        check_op_args(*args)


def test_constructor_refuses_before_allocating():
    with pytest.raises(ValueError, match="All2AllHeads: num_heads must be divisible"):
        All2AllHeads(FakeWorld(4), 16, 6, 64, "bfloat16")
    with pytest.raises(TypeError, match="All2AllHeads: dtype 'int8' is not supported"):
        All2AllHeads(FakeWorld(2), 16, 4, 64, "int8")
    with pytest.raises(ValueError, match="timeout_s"):
        All2AllHeads(FakeWorld(2), 16, 4, 64, "bfloat16", timeout_s=-1)


def test_tokens_checked():
    assert check_tokens([3, 0, np.int64(5)], 3, 5) == (3, 0, 5)
    with pytest.raises(ValueError, match="one entry per rank \\(3\\), got 2"):
        check_tokens([1, 2], 3, 5)
    msg = r"tokens_per_rank\[1\] must be in \[0, max_tokens_per_rank=5\], got -1"
    with pytest.raises(ValueError, match=msg):
        check_tokens([1, -1, 2], 3, 5)
    with pytest.raises(ValueError, match=r"tokens_per_rank\[2\] .* got 6"):
        check_tokens([1, 1, 6], 3, 5)
    with pytest.raises(TypeError, match="sequence of 3 integers"):
        check_tokens([1, 2.5, 3], 3, 5)
    with pytest.raises(TypeError, match="sequence of 3 integers"):
        check_tokens(7, 3, 5)


def test_shapes_of_both_directions():
    spec = _spec()  # W=4, rank 1, H=8 (2 per rank), D=64
    tokens = (5, 0, 7, 16)
    assert io_shapes(spec, False, 2, tokens) == ((2, 0, 8, 64), (2, 28, 2, 64))
    assert io_shapes(spec, True, 2, tokens) == ((2, 28, 2, 64), (2, 0, 8, 64))
    assert scale_shapes(spec, False, 2, tokens, False) == ((2, 0), (2, 28))
    assert scale_shapes(spec, False, 2, tokens, True) == ((2, 0, 8), (2, 28, 2))
    assert scale_shapes(spec, True, 2, tokens, False) == ((2, 28), (2, 0, 4))
    assert scale_shapes(spec, True, 2, tokens, True) == ((2, 28, 2), (2, 0, 8))


def test_call_arguments_checked():
    spec = _spec(rank=2)
    tokens = (5, 0, 7, 16)
    bf16 = dtype_info("bfloat16").storage
    x = FakeArray((2, 7, 8, 64), bf16)
    assert check_call(spec, False, x, tokens) == (2, 0)
    assert check_call(spec, False, FakeArray((1, 7, 8, 64), bf16), tokens) == (1, 0)
    assert check_call(spec, False, x, tokens, FakeArray((2, 7), np.float32)) == (2, 1)
    assert check_call(spec, False, x, tokens, FakeArray((2, 7, 8), np.float32)) == (2, 2)
    assert check_call(spec, True, FakeArray((2, 28, 2, 64), bf16), tokens,
                      FakeArray((2, 28, 2), np.float32)) == (2, 2)
    bad = [
        (FakeArray((2, 6, 8, 64), bf16), None, ValueError,
         r"x must have shape \[B, tokens_per_rank\[rank\], H, D\] = \(2, 7, 8, 64\) on rank 2, "
         r"got \(2, 6, 8, 64\)"),
        (FakeArray((3, 7, 8, 64), bf16), None, ValueError,
         "batch 3; this op was built for batch 1 to 2"),
        (FakeArray((2, 7, 8, 64), np.float16), None, TypeError, "x must be bfloat16, got float16"),
        (FakeArray((2, 7, 8, 64), bf16, contiguous=False), None, ValueError, "C-contiguous"),
        (FakeArray((2, 7, 8, 64), bf16, device=1), None, ValueError,
         "x is on device 1, this rank uses device 0"),
        (FakeArray((7, 8, 64), bf16), None, ValueError, "4 dimensions"),
        (x, FakeArray((2, 8), np.float32), ValueError,
         r"scale must have shape \(2, 7\) \(per token\) or \(2, 7, 8\) \(per token and head\)"),
        (x, FakeArray((2, 7), np.float16), TypeError, "scale must be float32"),
        (x, FakeArray((2, 7), np.float32, device=3), ValueError, "scale is on device 3"),
    ]
    for arr, scale, exc, match in bad:
        with pytest.raises(exc, match=match):
            check_call(spec, False, arr, tokens, scale)
    with pytest.raises(ValueError, match=r"y must have shape \[B, sum\(tokens\), H/W, D\]"):
        check_call(spec, True, x, tokens)


def test_fp8_is_uint8_storage():
    spec = _spec(dtype="float8_e4m3fn")
    x = FakeArray((1, 0, 8, 64), np.uint8)
    assert check_call(spec, False, x, (5, 0, 7, 16)) == (1, 0)
    with pytest.raises(TypeError, match=r"float8_e4m3fn \(stored as uint8\)"):
        check_call(spec, False, FakeArray((1, 0, 8, 64), np.int8), (5, 0, 7, 16))


def test_vector_width_follows_rows_and_pointers():
    assert vec_bytes(8192, 0, 256) == 16
    assert vec_bytes(2 * 67, 256, 512) == 2      # odd head_dim in bf16
    assert vec_bytes(67, 256, 512) == 1          # odd head_dim in fp8
    assert vec_bytes(2 * 80, 258, 512) == 2      # x two bytes past an aligned address
    assert vec_bytes(4 * 3 * 64, 8, 512) == 8


def test_layout_matches_the_kernel_header():
    spec = _spec(W=4, dtype="float16", H=8, D=67, batch=3, max_tokens=5)
    lay = build_layout(spec, blocks_per_target=33)
    regs = lay.regions
    assert [r for r in regs] == ["data0", "data1", "scale0", "scale1", "flags"]
    assert all(r.offset % 128 == 0 for r in regs.values())
    assert regs["data0"].num_bytes == 3 * 5 * 8 * 67 * 2 == spec.slot_bytes
    assert regs["scale1"].num_bytes == 3 * 5 * 8 * 4
    assert regs["flags"].shape == (2, 4, 33, 32) and regs["flags"].num_bytes == 2 * 4 * 33 * 128


def test_call_hash_is_stable_and_distinguishes_calls():
    k = (False, (3, 0, 5), 1, 0)
    assert call_hash(k) == call_hash((False, (3, 0, 5), 1, 0))
    others = [(True, (3, 0, 5), 1, 0), (False, (3, 5, 0), 1, 0), (False, (3, 0, 5), 2, 0),
              (False, (3, 0, 5), 1, 1)]
    assert len({call_hash(k)} | {call_hash(o) for o in others}) == 5
    assert 0 <= call_hash(k) < 2**32


def test_reference_by_hand():
    # W=2, H=2 (one head per rank), D=1, tokens [1, 2]: values name (rank, token, head).
    x0 = np.array([[[[0.0], [1.0]]]])                       # rank 0: token 0, heads 0/1
    x1 = np.array([[[[10.0], [11.0]], [[20.0], [21.0]]]])   # rank 1: tokens 0 and 1
    y0, y1 = reference_scatter_heads([x0, x1], [1, 2], 2)
    assert y0[0, :, 0, 0].tolist() == [0.0, 10.0, 20.0]     # head 0 of every token, in rank order
    assert y1[0, :, 0, 0].tolist() == [1.0, 11.0, 21.0]
    b0, b1 = reference_gather_heads([y0, y1], [1, 2], 2)
    assert np.array_equal(b0, x0) and np.array_equal(b1, x1)
    # scales: per token [B, T_r] -> [B, S] on every rank, back as [B, T_r, W]
    (_, _), (s0, s1) = reference_scatter_heads([x0, x1], [1, 2], 2,
                                               [np.array([[5.0]]), np.array([[6.0, 7.0]])])
    assert s0.tolist() == s1.tolist() == [[5.0, 6.0, 7.0]]
    _, (g0, g1) = reference_gather_heads([y0, y1], [1, 2], 2, [s0, s1 + 100])
    assert g0.tolist() == [[[5.0, 105.0]]] and g1.tolist() == [[[6.0, 106.0], [7.0, 107.0]]]


@pytest.mark.parametrize("W,tokens", [(1, [5]), (3, [4, 0, 7]), (4, [0, 0, 3, 1]), (8, [2] * 8)])
def test_reference_round_trip(W, tokens):
    rng = np.random.default_rng(W)
    B, H, D = 3, 2 * W, 5
    xs = [rng.standard_normal((B, t, H, D)) for t in tokens]
    scales = [rng.standard_normal((B, t, H)) for t in tokens]
    ys, y_scales = reference_scatter_heads(xs, tokens, W, scales)
    S = sum(tokens)
    for t, y in enumerate(ys):
        assert y.shape == (B, S, 2, D)
        off = 0
        for r, T in enumerate(tokens):  # rank r's tokens at offset sum(T[:r]), heads of rank t
            assert np.array_equal(y[:, off:off + T], xs[r][:, :, 2 * t:2 * t + 2])
            assert np.array_equal(y_scales[t][:, off:off + T], scales[r][:, :, 2 * t:2 * t + 2])
            off += T
    back, back_scales = reference_gather_heads(ys, tokens, W, y_scales)
    for r in range(W):
        assert np.array_equal(back[r], xs[r]) and np.array_equal(back_scales[r], scales[r])


# ---- launch arguments against the kernel signatures (a wrong order would corrupt peers) -------
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_launch_arguments_match_kernel_signatures(monkeypatch, gather, mode):
    from types import SimpleNamespace

    import cuflux.ops.all2all as A
    from tests.kernel_args import DeviceArray, check_args

    captured = []
    monkeypatch.setattr(A.kernels, "launch", lambda fn, grid, block, args, stream, **kw:
                        captured.append((kw["name"], args)))
    W, me = 4, 1
    op = object.__new__(A.All2AllHeads)
    op.spec = A.Spec(W, me, 0, 16, 8, 64, dtype_info("bfloat16"), 2)
    op._row_bytes, op.num_blocks, op.w1 = op.spec.row_bytes, 264, "pdl"
    op.buf = SimpleNamespace(ptrs_dev=DeviceArray())
    u = np.uint64
    op._push_slots = tuple(u(i) for i in range(6))
    op._wait_flags = (u(1 << 30), u(2 << 30))
    op._copy_slots = ((u(3 << 30), u(4 << 30)), (u(5 << 30), u(6 << 30)))
    op.state = DeviceArray()
    op.err_args = (u(1 << 40), DeviceArray(), u(10**9), np.uint32(2))
    op._push = {(v, g): f"push{v}{g}" for v in A._VEC_BYTES for g in (False, True)}
    op._copy_out = {v: f"copy{v}" for v in A._VEC_BYTES}
    op._wait = "wait"
    tokens = (16, 5, 0, 9)
    plan = A._Plan(tokens, np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32))
    plan.prefix_dev = DeviceArray()
    arr = DeviceArray()
    arr.data = SimpleNamespace(ptr=1 << 20)
    op._launch(gather, arr, arr if mode else None, arr, arr if mode else None, plan, 2, mode,
               12345, 0, False, None)
    names = [n for n, _ in captured]
    assert names == ["a2a_push", "a2a_wait", "a2a_copy_out"]
    for (name, args), kernel in zip(captured, ("a2a_push", "a2a_wait", "a2a_copy_out")):
        check_args("all2all.cu", kernel, args)
