"""Tests of cuflux.gemm and of the GEMM hooks, GPU and CPU in one file.

GPU tests (marked gpu; skipped, with the reason, without a GPU): every check draws fresh random
data (seed in the message), poisons outputs with NaN first (every element must be written),
compares with a float64 NumPy reference, relative Frobenius error under a tolerance that fits the
output dtype, plus a bound on the worst element. Most are single-process; the hooks' tests run the
rank bodies beside them (@on_ranks) on W ranks.

CPU tests: both cores compile for their targets and emit the instructions they are built on; the
tile order formula; the ping-pong consumers' protocol; argument checks that need no GPU.
"""
import gc
import math
import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

from cuflux import gemm_core, gemm_tuner, kernels
from cuflux.ops import gemm as G
from tests.checks import check_close, f64, poison_owned
from tests.kernels_cu import GEMM_HOOKS, GEMM_HOOKS_FAMILY
from tests.mpi import fresh_seed, gpu_available, hopper, on_ranks, world_sizes

WS = world_sizes()

# relative Frobenius error allowed per output dtype (bf16 rounding is 2^-9 relative)
SHAPES = [(1000, 1000, 1000), (8, 4096, 4096), (4096, 8, 4096), (777, 1536, 2048), (130, 264, 72)]


@pytest.fixture(autouse=True)
def _no_tuning(monkeypatch):
    monkeypatch.setenv("CUFLUX_GEMM_TUNE", "0")


# ==== GPU tests (the hooks' on W ranks: each rank body beside its test) ===========================
def _rand(shape, dtype, seed, scale=1.0):
    import cupy

    from cuflux.arrays import dtype_info

    rs = cupy.random.RandomState(seed)
    return (rs.standard_normal(shape, dtype=cupy.float32) * scale).astype(dtype_info(dtype).storage)


def _run(impl, M, N, K, layout="kn", dtype="bfloat16", out_dtype=None, bias=False, config=None,
         seed=None, group_m=8):
    import cupy

    import cuflux.ops.gemm as G
    from cuflux.arrays import dtype_info

    seed = fresh_seed() if seed is None else seed
    a = _rand((M, K), dtype, seed)
    b = _rand((K, N) if layout == "kn" else (N, K), dtype, seed + 1)
    bv = _rand((N,), dtype, seed + 2, scale=4.0) if bias else None
    od = out_dtype or dtype
    out = cupy.full((M, N), np.nan, dtype=np.float32).astype(dtype_info(od).storage)
    got = G.gemm(a, b, bias=bv, out=out, b_layout=layout, impl=impl, config=config,
                 group_m=group_m)
    assert got is out
    cupy.cuda.Device().synchronize()
    bm = f64(b) if layout == "kn" else f64(b).T
    ref = f64(a) @ bm
    if bias:
        ref += f64(bv)[None, :]
    check_close(got, ref, od, f"{impl} {layout} {M}x{N}x{K} {dtype}->{od} bias={bias} "
                         f"config={config} seed={seed}")


def _mapping(got, src, axis):
    """For each output line along `axis`, the index of the source line it equals (-1: none)."""
    g = np.moveaxis(got, axis, 0).reshape(got.shape[axis], -1)
    s = np.moveaxis(src, axis, 0).reshape(src.shape[axis], -1)
    found = []
    for line in g:
        hit = np.nonzero((np.abs(s - line[None, :]) <= 1e-6 * (np.abs(line).max() + 1)).all(1))[0]
        found.append(int(hit[0]) if len(hit) else -1)
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("which", ["a", "b"])
def test_identity_operand_is_exact(impl, layout, which):
    """A @ I == A and I @ B == B bit for bit (products with 1, sums with 0 are exact); on a
    failure the message says where each output column (or row) came from, which points at a
    swizzle or descriptor error."""
    import cupy

    import cuflux.ops.gemm as G
    from cuflux.arrays import dtype_info

    bf = dtype_info("bfloat16").storage
    n, seed = 512, fresh_seed()
    x = _rand((n, n), "bfloat16", seed)
    eye = cupy.eye(n, dtype=cupy.float32).astype(bf)
    if which == "a":  # A = x, B = I: C = x
        a, b, want = x, eye, f64(x)
    else:  # A = I, B = x: C = x ("kn") or x^T ("nk")
        a, b = eye, x
        want = f64(x) if layout == "kn" else f64(x).T
    out = cupy.full((n, n), np.nan, dtype=np.float32)
    G.gemm(a, b, out=out, b_layout=layout, impl=impl)
    got = f64(out)
    if not np.array_equal(got, want):
        cols = _mapping(got, want, 1)[:72]
        rows = _mapping(got, want, 0)[:72]
        pytest.fail(f"{impl} {layout} {which}: {int((got != want).sum())} of {n * n} differ "
                    f"(seed {seed}); output col j equals reference col {cols}; output row i "
                    f"equals reference row {rows}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64(impl, layout, shape):
    _run(impl, *shape, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_bias_and_out_dtypes(impl, layout, dtype, out_dtype):
    _run(impl, 777, 1536, 2048, layout=layout, dtype=dtype, out_dtype=out_dtype, bias=True)


def _hopper_configs():
    import cuflux.ops.gemm as G  # every registered configuration, opt-in ones included

    return list(G.SM90_CONFIGS)


HOPPER_CONFIGS = _hopper_configs()


@pytest.mark.gpu
@pytest.mark.parametrize("config", HOPPER_CONFIGS)
@pytest.mark.parametrize("layout", ["kn", "nk"])
# (4096, 4096, 2048): several tiles per CTA, 32 k-steps each: a ping-pong warpgroup skips the
# other's stages many times over (the mbarrier phase-skip path).
@pytest.mark.parametrize("shape", [(1100, 1000, 1000), (4096, 2048, 512), (8, 264, 8),
                                   (4096, 4096, 2048)], ids=lambda s: "x".join(map(str, s)))
def test_every_hopper_config(config, layout, shape):
    if not hopper():
        pytest.skip("the Hopper core needs an sm_90a device")
    _run("sm90", *shape, layout=layout, config=config, bias=shape[0] == 1100)


@pytest.mark.gpu
@pytest.mark.parametrize("config", HOPPER_CONFIGS)
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_every_hopper_config_out_dtypes(config, out_dtype):
    if not hopper():
        pytest.skip("the Hopper core needs an sm_90a device")
    _run("sm90", 3000, 1032, 520, layout="nk", out_dtype=out_dtype, config=config, bias=True)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("shape", [(1, 8192, 1024), (16, 1000, 264), (255, 2056, 520),
                                   (777, 1536, 2048)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lt", ["gemmex", "cublaslt"])
def test_cublas_path_matches_float64(monkeypatch, layout, shape, out_dtype, lt):
    """gemm's cuBLAS route (impl="cublas", and "auto" below CUBLAS_BELOW_M rows untuned):
    both layouts, bias, fp32 output; through cublasGemmEx and through cublasLtMatmul
    (CUFLUX_GEMM_CUBLASLT=1, its plan made at the first call and reused at the second)."""
    if not gpu_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("CUFLUX_GEMM_CUBLASLT", "1" if lt == "cublaslt" else "0")
    _run("cublas", *shape, layout=layout, out_dtype=out_dtype, bias=True)
    _run("cublas", *shape, layout=layout, out_dtype=out_dtype, bias=False)
    if lt == "cublaslt":
        plans = gemm_core._cublaslt().plans
        assert any(k[4:7] == shape and p is not None for k, p in plans.items()), \
            "cublasLt ran no plan of this shape (GemmEx did)"


@pytest.mark.gpu
def test_cublaslt_route_captures_and_replays(monkeypatch):
    """The cublasLt route in a CUDA graph: one call outside the capture (the plan and the
    stream's workspace), then captured and replayed with new inputs, exact every replay."""
    import cupy

    import cuflux.ops.gemm as G

    if not gpu_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("CUFLUX_GEMM_CUBLASLT", "1")
    M, N, K = 16, 520, 264
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        a, b = _rand((M, K), "bfloat16", 1), _rand((N, K), "bfloat16", 2)
        bias = _rand((N,), "bfloat16", 3, scale=4.0)
        out = cupy.full((M, N), np.nan, dtype=np.float32)
        G.gemm(a, b, bias=bias, out=out, b_layout="nk", impl="cublas", stream=s)
        plans = gemm_core._cublaslt().plans
        assert any(k[4:7] == (M, N, K) and p is not None for k, p in plans.items())
        s.begin_capture()
        G.gemm(a, b, bias=bias, out=out, b_layout="nk", impl="cublas", stream=s)
        graph = s.end_capture()
        for i in range(20):
            a[...] = _rand((M, K), "bfloat16", 100 + i)
            out.fill(np.nan)
            graph.launch(s)
            s.synchronize()
            check_close(out, f64(a) @ f64(b).T + f64(bias), "float32", f"replay {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["plain", "bias", "addend", "addend_bias"])
def test_cublaslt_tunes_its_algorithm_and_stays_exact(monkeypatch, tmp_path, case):
    """A shape past ALGO_TUNE_MIN_FLOP on the cublasLt route, tuning on, fresh plans and an
    empty algorithm table (a generous budget): the first call times every candidate (the table
    gets the shape's entry, every candidate's time, under the epilogue's key with an addend and
    a bias), the plan keeps the table's pick, the poisoned output matches float64 (the timing's
    calls wrote out before the call did: plain, bias broadcast into out, addend as C, addend
    and bias by the epilogue), and a second call takes the same algorithm: the same bits."""
    import json

    import cupy

    from cuflux.arrays import dtype_info

    if not gpu_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("CUFLUX_GEMM_CUBLASLT", "1")
    monkeypatch.setenv("CUFLUX_GEMM_ALGO_TUNE", "1")
    monkeypatch.setenv("CUFLUX_GEMM_TUNE_BUDGET_S", "60")
    monkeypatch.setattr(gemm_tuner, "algo_path", lambda: tmp_path / "algos.json")
    monkeypatch.setattr(gemm_tuner, "_ALGO_TABLE", None)
    monkeypatch.setattr(gemm_core, "_CUBLASLT", [])  # plans made afresh: this test tunes them
    monkeypatch.setattr(gemm_core, "_ALGO_TIMINGS", [0])  # whatever ran before in the process
    monkeypatch.setattr(gemm_core, "_CLASS_WINNERS", {})
    seed = fresh_seed()
    M, N, K = 2000, 4104, 4240  # odd: not a multiple of any tile
    assert 2 * M * N * K >= gemm_core.ALGO_TUNE_MIN_FLOP
    bf, odt = dtype_info("bfloat16"), dtype_info("bfloat16" if "addend" in case else "float32")
    a, b = _rand((M, K), "bfloat16", seed), _rand((N, K), "bfloat16", seed + 1)
    bias = _rand((N,), "bfloat16", seed + 2, scale=4.0) if "bias" in case else None
    add = _rand((M, N), odt.name, seed + 3, scale=8.0) if "addend" in case else None
    s = cupy.cuda.Stream(non_blocking=True)
    outs = []
    for _ in range(2):
        out = cupy.full((M, N), np.nan, dtype=np.float32).astype(odt.storage)
        if add is None:
            G.gemm(a, b, bias=bias, out=out, b_layout="nk", impl="cublas", stream=s)
        else:
            assert gemm_core.launch_cublaslt(a, b, bias, out, bf, odt, M, N, K, "nk", s,
                                             addend=add)
        outs.append(out)
    s.synchronize()
    ac, bc = cupy.asarray(a).astype(cupy.float64), cupy.asarray(b).astype(cupy.float64)
    want = ac @ bc.T  # float64 on the GPU: the CPU would take seconds here
    if bias is not None:
        want += cupy.asarray(bias).astype(cupy.float64)[None, :]
    if add is not None:
        want += cupy.asarray(add).astype(cupy.float64)
    check_close(outs[0], cupy.asnumpy(want), odt.name, f"tuned, {case}")
    assert bool(cupy.array_equal(outs[0], outs[1])), "the tuned algorithm changed"
    table = json.loads((tmp_path / "algos.json").read_text())
    (key,) = [k for k in table if f"|{M}x{N}x{K}|" in k]
    assert f"|bfloat16|{odt.name}|nk|" in key
    assert key.endswith("|bias") == (case == "addend_bias")
    entry = table[key]
    assert len(entry["ms"]) >= 2 and all(t is not None and t > 0 for t in entry["ms"])
    (plan,) = [p for k, p in gemm_core._cublaslt().plans.items() if k[4:7] == (M, N, K)]
    assert plan.tuned and plan.algo is plan.algos[entry["algo"]]
    if case == "plain":  # another M of the class [1024, 2048) (>= ALGO_TUNE_MIN_FLOP too)
        M2 = 1990
        assert 2 * M2 * N * K >= gemm_core.ALGO_TUNE_MIN_FLOP and M2.bit_length() == 11
        out2 = cupy.full((M2, N), np.nan, dtype=np.float32).astype(odt.storage)
        G.gemm(a[:M2], b, out=out2, b_layout="nk", impl="cublas", stream=s)
        s.synchronize()
        check_close(out2, cupy.asnumpy(want[:M2]), odt.name, "the class's winner at M = 1990")
        (plan2,) = [p for k, p in gemm_core._cublaslt().plans.items() if k[4:7] == (M2, N, K)]
        offered = bytes(plan.algo) in [bytes(x) for x in plan2.algos]
        assert plan2.tuned
        if offered:  # the class's winner, untimed
            assert bytes(plan2.algo) == bytes(plan.algo) and gemm_core._ALGO_TIMINGS == [1]
        else:  # not offered at M = 1990: timed as a shape of its own
            assert gemm_core._ALGO_TIMINGS == [2]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_cublaslt_addend_matches_float64(out_dtype):
    """launch_cublaslt's addend: out = a b + addend (+ bias by the epilogue), poisoned out,
    both layouts' reading (nk) at an odd shape; a bias with an fp32 output has no cublasLt
    algorithm (the bias must be in the output's dtype there): False, nothing written."""
    import cupy

    from cuflux.arrays import dtype_info

    if not gpu_available():
        pytest.skip("needs a GPU")
    seed = fresh_seed()
    M, N, K = 300, 520, 264
    bf, odt = dtype_info("bfloat16"), dtype_info(out_dtype)
    a, b = _rand((M, K), "bfloat16", seed), _rand((N, K), "bfloat16", seed + 1)
    add = _rand((M, N), out_dtype, seed + 2, scale=8.0)
    bias = _rand((N,), "bfloat16", seed + 3, scale=4.0)
    s = cupy.cuda.Stream(non_blocking=True)
    want = f64(a) @ f64(b).T + f64(add)
    for with_bias in (False, True):
        out = cupy.full((M, N), np.nan, dtype=np.float32).astype(odt.storage)
        ok = gemm_core.launch_cublaslt(a, b, bias if with_bias else None, out, bf, odt, M, N, K,
                                       "nk", s, addend=add)
        s.synchronize()
        if with_bias and out_dtype == "float32":
            assert not ok and bool(cupy.isnan(out).all()), "fp32 out, bf16 bias: no algorithm"
            continue
        assert ok
        check_close(out, want + (f64(bias) if with_bias else 0), out_dtype,
                    f"addend, bias={with_bias}")


@pytest.mark.gpu
def test_auto_small_m_runs_what_plan_says(monkeypatch):
    import cuflux.ops.gemm as G

    if not gpu_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("CUFLUX_GEMM_TUNE", "0")
    assert G.plan(16, 2048, 1024) == G.CUBLAS
    if hopper():
        assert G.plan(4096, 2048, 1024) in G.SM90_CONFIGS
    _run("auto", 16, 2048, 1024, layout="nk", bias=True)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [16, 1024])
def test_graph_capture_and_replay_with_new_inputs(monkeypatch, M):
    """One gemm call captured in a CUDA graph and replayed 100 times, new inputs copied into
    the captured operands before each replay: exact against a per-replay reference (cuBLAS
    path at M = 16, our core at M = 1024, tuned first: a shape is never timed under capture)."""
    import cupy

    import cuflux.ops.gemm as G

    if not gpu_available():
        pytest.skip("needs a GPU")
    N, K = 520, 264
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        a = _rand((M, K), "bfloat16", 1)
        b = _rand((N, K), "bfloat16", 2)
        out = cupy.full((M, N), np.nan, dtype=np.float32)
        G.gemm(a, b, out=out, b_layout="nk", stream=s)  # tunes this shape class, if tuning
        s.begin_capture()
        G.gemm(a, b, out=out, b_layout="nk", stream=s)
        graph = s.end_capture()
        for i in range(100):
            a[...] = _rand((M, K), "bfloat16", 100 + i)
            b[...] = _rand((N, K), "bfloat16", 300 + i)
            out.fill(np.nan)
            graph.launch(s)
            s.synchronize()
            check_close(out, f64(a) @ f64(b).T, "float32", f"replay {i} M={M}")


@pytest.mark.gpu
@pytest.mark.parametrize("group_m", [1, 3, 64])
def test_tile_orders(impl, group_m):
    _run(impl, 3000, 2056, 256, group_m=group_m)


@pytest.mark.gpu
def test_tuner_caches_its_choice(monkeypatch, tmp_path):
    if not hopper():
        pytest.skip("the tuner serves the Hopper core")
    import json

    import cuflux.ops.gemm as G
    from cuflux import gemm_tuner as T

    monkeypatch.setenv("CUFLUX_GEMM_TUNE", "1")
    monkeypatch.setenv("CUFLUX_GEMM_TUNE_BUDGET_S", "5")
    monkeypatch.setattr(T, "tuner_path", lambda: tmp_path / "gemm_tuner.json")
    monkeypatch.setattr(T, "_TUNER_TABLE", None)  # this process reads the (new) file afresh
    _run("auto", 1536, 2048, 1024)
    table = json.loads((tmp_path / "gemm_tuner.json").read_text())
    (key, entry), = table.items()
    assert (entry["config"] in G.SM90_CONFIGS or entry["config"] == G.CUBLAS) and "|kn|" in key
    assert G.CUBLAS in entry["ms"] and set(entry["ms"]) <= set(G.SM90_CONFIGS) | {G.CUBLAS}
    assert T.fastest(1536, 2048, 1024, "bfloat16", "kn") == entry["config"]
    assert G.plan(1536, 2048, 1024, "bfloat16", "kn") == T.preferred(key, entry["config"])
    entry["config"] = "128x128s6c1"  # a cached choice is used as it is
    (tmp_path / "gemm_tuner.json").write_text(json.dumps(table))
    monkeypatch.setattr(T, "_TUNER_TABLE", None)
    assert T.tuned_config(key, lambda name: (_ for _ in ()).throw(AssertionError(name)),
                          None) == "128x128s6c1"
    _run("auto", 1536, 2048, 1024)


@pytest.mark.gpu
def test_other_stream_and_default_output():
    import cupy

    import cuflux.ops.gemm as G

    s = cupy.cuda.Stream(non_blocking=True)
    seed = fresh_seed()
    a = _rand((300, 512), "bfloat16", seed)
    b = _rand((256, 512), "bfloat16", seed + 1)
    c = G.gemm(a, b, b_layout="nk", stream=s, out_dtype="float32")
    s.synchronize()
    assert c.shape == (300, 256) and c.dtype == np.float32
    check_close(c, f64(a) @ f64(b).T, "float32", f"stream seed={seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl,M", [("auto", 1), ("auto", 300), ("sm80", 100)])
def test_calls_that_leave_out_to_gemm_replay_too(impl, M):
    """gemm(a, b) without out=, its result dropped as a loop drops it: the output is made
    before the memo key (CallMemo.output hands a dropped one back), so the call is bound and
    replayed; each result is exact (every output it may get poisoned first) and in a's
    dtype, and a result still held is never handed out again. The cycle collector is off:
    an output that only a reference cycle keeps alive (gemm's tuner closure once did) fails."""
    import cupy

    from cuflux.arrays import dtype_info

    N, K = 264, 520
    st = dtype_info("bfloat16").storage
    G._memo().clear()
    a, b = cupy.empty((M, K), st), cupy.empty((N, K), st)
    seed = fresh_seed()
    ptrs = []
    gc.disable()  # an output kept alive by a reference cycle must show, not be collected
    try:
        _owned_loop(a, b, M, N, K, st, impl, seed, ptrs)
    finally:
        gc.enable()
    assert any(callable(e) for e in G._memo().entries.values())
    # dropped outputs come back (CallMemo.output): one array, and a second while one is held
    assert len(set(ptrs)) == 2 and ptrs[:4] == [ptrs[0]] * 4 and ptrs[5] == ptrs[0], ptrs


def _owned_loop(a, b, M, N, K, st, impl, seed, ptrs):
    held = None
    for i in range(6):
        a[...] = _rand((M, K), "bfloat16", seed + 2 * i)
        b[...] = _rand((N, K), "bfloat16", seed + 2 * i + 1)
        poison_owned(G._memo(), (M, N), st)
        got = G.gemm(a, b, b_layout="nk", impl=impl)
        ptrs.append(got.data.ptr)
        if held is not None:
            assert got.data.ptr != held.data.ptr
        held = got if i == 3 else None
        assert got.shape == (M, N) and got.dtype == st
        check_close(got, f64(a) @ f64(b).T, "bfloat16", f"owned call {i} {impl} seed={seed}")
        del got


@pytest.mark.gpu
def test_owned_outputs_come_back_only_when_nothing_holds_them():
    """CallMemo.output hands an output out again only where the caller holds nothing of it:
    not while the array, a view of it, an array over its pointer, a pointer made from it, a
    DLPack capsule of it, a list holding it, a weak reference to it or a torch tensor over it
    (where torch is installed) is alive; two are kept per shape (a loop `y = op(x)` holds one
    while it makes the next call); other shapes, dtypes and streams get their own."""
    import cupy

    from cuflux.ops.base import CallMemo

    memo = CallMemo(cupy.cuda.runtime.getDevice())
    shape, f32 = (64, 32), np.dtype(np.float32)
    first = memo.output(shape, f32)
    p0 = first.data.ptr
    del first
    again = memo.output(shape, f32)
    assert again.data.ptr == p0
    import weakref

    holders = [lambda y: y, lambda y: y[1:], lambda y: y.T, lambda y: y.reshape(-1),
               lambda y: cupy.ndarray(y.shape, y.dtype, memptr=y.data),
               lambda y: y.data + 256, lambda y: y.data.mem, lambda y: y.__dlpack__(),
               lambda y: [y], weakref.ref]
    try:  # consumers in another framework (through DLPack, __cuda_array_interface__)
        import torch

        holders += [lambda y: torch.from_dlpack(y), lambda y: torch.as_tensor(y, device="cuda")]
    except ImportError:
        pass
    for i, hold in enumerate(holders):
        held = hold(again)
        del again
        other = memo.output(shape, f32)
        assert other.data.ptr != p0, f"holder {i} did not keep its output"
        del other, held
        again = memo.output(shape, f32)
        assert again.data.ptr == p0, f"holder {i}: the output did not come back"
    y = again
    for _ in range(4):  # y = op(x): the last output held during the call, then dropped
        y = memo.output(shape, f32)
    assert len(memo.outputs[(shape, f32, cupy.cuda.get_current_stream().ptr, 0)]) == 2
    s = cupy.cuda.Stream(non_blocking=True)
    del y
    assert memo.output(shape, f32, s).data.ptr != p0  # another stream: its own
    assert memo.output((64, 16), f32).shape == (64, 16)
    big = memo.output((1 << 20, 80), np.dtype(np.uint8))  # over OUTPUT_KEPT_BYTES: not kept
    assert big.nbytes > (64 << 20) and all(k[0] != big.shape for k in memo.outputs)
    memo.clear()
    assert not memo.outputs


@pytest.mark.gpu
@pytest.mark.parametrize("impl,M", [("auto", 1), ("auto", 130), ("cublas", 64), ("sm90", 257),
                                    ("sm80", 100)])
@pytest.mark.parametrize("lt", ["gemmex", "cublaslt", "cublaslt-graph"])
def test_repeated_calls_replay_their_launch_and_stay_exact(monkeypatch, impl, M, lt):
    """Calls with out= whose arrays repeat (fresh values written in place) replay their bound
    launch from the second call on (ops.base.CallMemo), on every route (the cublasLt one as a
    CUDA graph per stream, or as the bound call): each is exact, out poisoned first. A view of
    the same memory with fewer rows plans anew; a new stream (no cuBLAS workspace there yet)
    falls back to the full path, which makes one; a repeat captured into the caller's graph
    and replayed with new inputs is exact; a dtype view of the same memory is refused before
    any launch."""
    import cupy

    from cuflux.arrays import dtype_info

    if impl == "sm90" and not hopper():
        pytest.skip("sm90 needs an sm_90a GPU")
    monkeypatch.setenv("CUFLUX_GEMM_CUBLASLT", "0" if lt == "gemmex" else "1")
    monkeypatch.setenv("CUFLUX_GRAPH_REPLAY", "1" if lt == "cublaslt-graph" else "0")
    N, K = 264, 520
    st = dtype_info("bfloat16").storage
    G._memo().clear()  # the pool may hand out an earlier case's addresses: its bound calls
    a, b, out = cupy.empty((M, K), st), cupy.empty((N, K), st), cupy.empty((M, N), st)
    seed = fresh_seed()
    streams = [cupy.cuda.Stream(non_blocking=True), None, cupy.cuda.Stream(non_blocking=True)]
    for i in range(6):
        rows = M - 1 if i == 4 and M > 1 else M  # a view: its own key
        a[...] = _rand((M, K), "bfloat16", seed + 2 * i)
        b[...] = _rand((N, K), "bfloat16", seed + 2 * i + 1)
        out[...] = cupy.full((M, N), np.nan, np.float32).astype(st)
        cupy.cuda.Device().synchronize()
        s = streams[(i // 2) % 3]  # the stream changes every second call
        got = G.gemm(a[:rows], b, out=out[:rows], b_layout="nk", impl=impl, stream=s)
        (s or cupy.cuda.get_current_stream()).synchronize()
        assert got.shape == (rows, N) and got.data.ptr == out.data.ptr
        check_close(got, f64(a[:rows]) @ f64(b).T, "bfloat16",
                    f"call {i} {impl} M={M} {lt} seed={seed}")
    memo = G._memo()
    assert any(callable(e) for e in memo.entries.values())
    if lt == "cublaslt-graph" and impl == "cublas":
        assert any(getattr(e, "graphs", None) for e in memo.entries.values())
    cs = cupy.cuda.Stream(non_blocking=True)
    G.gemm(a, b, out=out, b_layout="nk", impl=impl, stream=cs)  # cs's workspace, uncaptured
    cs.synchronize()
    cs.begin_capture()
    try:
        G.gemm(a, b, out=out, b_layout="nk", impl=impl, stream=cs)
    finally:
        graph = cs.end_capture()
    a[...] = _rand((M, K), "bfloat16", seed + 99)
    out[...] = cupy.full((M, N), np.nan, np.float32).astype(st)
    cupy.cuda.Device().synchronize()
    graph.launch(stream=cs)
    cs.synchronize()
    check_close(out, f64(a) @ f64(b).T, "bfloat16", f"captured repeat {impl} M={M} {lt}")
    with pytest.raises((TypeError, ValueError), match="cuflux.gemm"):
        G.gemm(a.view(cupy.float16 if st != np.float16 else cupy.int16), b, out=out,
               b_layout="nk", impl=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("lt", ["gemmex", "cublaslt", "cublaslt-graph"])
def test_many_streams_keep_few_cublas_workspaces(monkeypatch, lt):
    """A caller that keeps 3 x WORKSPACES_KEPT streams alive and calls the cuBLAS route on each
    in turn, three times over (the later rounds' calls replay: bound at their second call,
    each stream's workspace let go and made again in between): every call exact (out
    poisoned first), never more than WORKSPACES_KEPT of those streams keep a workspace, none
    pinned (no capture); then one stream's calls again: made anew, then replayed as a graph.
    Before they were bounded every stream kept 32 MiB for the process."""
    import cupy

    from cuflux.arrays import dtype_info

    monkeypatch.setenv("CUFLUX_GEMM_CUBLASLT", "0" if lt == "gemmex" else "1")
    monkeypatch.setenv("CUFLUX_GRAPH_REPLAY", "1" if lt == "cublaslt-graph" else "0")
    M, N, K = 64, 264, 520
    st = dtype_info("bfloat16").storage
    G._memo().clear()
    spaces = gemm_core._cublas().spaces
    n = gemm_core.WORKSPACES_KEPT
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3 * n)]
    ptrs = {s.ptr for s in streams}
    # an earlier test's capture stream, destroyed since, may have had one of these handles:
    # its workspace is kept for good (the driver hands handles out again)
    pinned = len({k for k in spaces.captured if k[1] in ptrs})
    before = set(spaces.captured)
    a, b, out = cupy.empty((M, K), st), cupy.empty((N, K), st), cupy.empty((M, N), st)
    seed = fresh_seed()
    for i in range(3):
        for j, s in enumerate(streams):
            a[...] = _rand((M, K), "bfloat16", seed + 2 * j + i)
            b[...] = _rand((N, K), "bfloat16", seed + 2 * j + i + 1)
            out[...] = cupy.full((M, N), np.nan, np.float32).astype(st)
            cupy.cuda.Device().synchronize()
            G.gemm(a, b, out=out, b_layout="nk", impl="cublas", stream=s)
            s.synchronize()
            check_close(out, f64(a) @ f64(b).T, "bfloat16", f"round {i} stream {j} {lt}")
            assert len([k for k in spaces.arrays if k[1] in ptrs]) <= n + pinned
    assert spaces.captured == before  # nothing captured here: nothing pinned
    if lt != "gemmex":  # the route taken: cublasLt's plan of the shape
        assert any(k[4:7] == (M, N, K) for k in gemm_core._cublaslt().plans)
    s = streams[0]  # its workspace let go long ago: made again, then its replay captured
    key = (gemm_core.current_device(), s.ptr)
    assert key in before or key not in spaces.arrays  # (before: pinned by an earlier test)
    for i in range(3):
        a[...] = _rand((M, K), "bfloat16", seed + 100 + i)
        out[...] = cupy.full((M, N), np.nan, np.float32).astype(st)
        cupy.cuda.Device().synchronize()
        G.gemm(a, b, out=out, b_layout="nk", impl="cublas", stream=s)
        s.synchronize()
        check_close(out, f64(a) @ f64(b).T, "bfloat16", f"stream 0 again, call {i} {lt}")
        assert key in spaces.arrays
    if lt == "cublaslt-graph":
        graphs = [e.graphs.get(s.ptr) for e in G._memo().entries.values()
                  if getattr(e, "graphs", None)]
        assert any(g is not None and g[1] is not None for g in graphs)


@pytest.mark.gpu
def test_bad_input_is_named():
    import cupy

    import cuflux.ops.gemm as G

    a = _rand((64, 60), "bfloat16", 1)
    with pytest.raises(ValueError, match="K must be a positive multiple of 8"):
        G.gemm(a, _rand((60, 64), "bfloat16", 2))
    a = _rand((64, 64), "bfloat16", 1)
    with pytest.raises(ValueError, match="N must be a positive multiple of 8"):
        G.gemm(a, _rand((64, 60), "bfloat16", 2))
    with pytest.raises(ValueError, match=r"b \(layout 'nk'\) must be \[N, K=64\]"):
        G.gemm(a, _rand((64, 32), "bfloat16", 2), b_layout="nk")
    with pytest.raises(TypeError, match="b must be bfloat16"):
        G.gemm(a, _rand((64, 64), "float16", 2))
    with pytest.raises(TypeError, match="dtype"):
        G.gemm(a.astype(cupy.float32), a.astype(cupy.float32))
    flat = _rand((64 * 64 + 1,), "bfloat16", 3)
    with pytest.raises(ValueError, match="a must start at a 16-byte aligned address"):
        G.gemm(flat[1:].reshape(64, 64), a)
    with pytest.raises(ValueError, match="bias must have shape"):
        G.gemm(a, a, bias=_rand((32,), "bfloat16", 4))
    with pytest.raises(ValueError, match="out must have shape"):
        G.gemm(a, a, out=cupy.empty((64, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        G.gemm(a, a.T)


# ---- hooks: the AllGather+GEMM prologue and the GEMM+ReduceScatter epilogue ---------------------
def _launch_hooks(impl, a, b, M, N, K, order, chunk_tiles_m, chunk_flags_ptr, rows_per_chunk,
                  chunks_per_rank, epoch, err, dst_bases, dst_offset, flag_bases, flag_offset,
                  rows_per_rank, stream):
    import cupy

    from cuflux import gemm_core as core
    from cuflux import kernels
    from cuflux.arrays import dtype_info
    from cuflux.errors import OP_CODES
    from tests.kernels_cu import GEMM_HOOKS, GEMM_HOOKS_SRC

    fn = kernels.load(GEMM_HOOKS_SRC)[GEMM_HOOKS[impl]]
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    tail = (order, np.int32(chunk_tiles_m), np.uint64(chunk_flags_ptr), np.int32(rows_per_chunk),
            np.int32(chunks_per_rank), np.uint32(epoch), np.uint64(err.ptr), err.claim,
            np.uint64(err.timeout_ns), np.uint32(OP_CODES["test"]), np.uint32(err.rank),
            dst_bases, np.uint64(dst_offset), flag_bases, np.uint64(flag_offset),
            np.int32(rows_per_rank), np.int64(N))
    if impl == "sm90":
        cfg = core.SM90_CONFIGS["128x256s4c1"]
        core.prepare(fn, cfg.smem_bytes)
        dt = dtype_info("bfloat16")
        tiles = -(-M // 128) * -(-N // 256)
        args = (core.tensor_map(a.data.ptr, M, K, 64, 128, dt),
                core.tensor_map(b.data.ptr, N, K, 64, 256, dt), np.int32(M), np.int32(N),
                np.int32(K)) + tail
        kernels.launch(fn, (min(tiles, sms),), (384,), args, stream, op="test",
                       name="gemm_hooks_sm90", shared_mem=cfg.smem_bytes)
    else:
        sm80 = core.SM80
        core.prepare(fn, sm80.smem_bytes)
        tiles = -(-M // sm80.bm) * -(-N // sm80.bn)
        args = (a, b, np.int32(M), np.int32(N), np.int32(K)) + tail
        kernels.launch(fn, (min(tiles, sm80.ctas_per_sm * sms),), (sm80.threads,), args, stream,
                       op="test", name="gemm_hooks_sm80", shared_mem=sm80.smem_bytes)


@on_ranks
def hooks_reduce_scatter(world, impl, seed, rows_per_rank=200, N=520, K=264):
    """Rank r computes A_r @ B^T (B [N, K]) and reduces every tile into its owner's rows; tiles
    visited in reversed chunk order after a wait on per-chunk flags (pre-raised)."""
    import cupy

    from cuflux.errors import ErrorRecord
    from cuflux.symmetric import Layout

    W, me = world.size, world.rank
    M = W * rows_per_rank
    bm = 128 if impl == "sm90" else 128
    bn = 256 if impl == "sm90" else 128
    tiles_m, tiles_n = -(-M // bm), -(-N // bn)
    rows_per_chunk = 96
    num_chunks = -(-M // rows_per_chunk)
    lay = Layout()
    lay.add("out", (rows_per_rank, N), np.uint16)  # bf16 bits
    lay.add("tile_flags", (tiles_m * tiles_n * 32,), np.uint32)
    lay.add("chunk_flags", (num_chunks * 32,), np.uint32)
    buf = world.alloc_layout(lay)
    err = ErrorRecord("test", me, timeout_s=20)
    try:
        a = _rand((M, K), "bfloat16", seed + 10 * me)
        b = _rand((N, K), "bfloat16", seed + 1)
        epoch = 7
        buf.local("chunk_flags").fill(epoch)
        order = cupy.asarray(np.arange(tiles_m)[::-1].astype(np.int32))
        cupy.cuda.Device().synchronize()
        world.barrier()
        base = buf.base_ptrs[me]
        _launch_hooks(impl, a, b, M, N, K, order, 1, buf.ptr(me, "chunk_flags"), rows_per_chunk,
                      num_chunks, epoch, err, buf.ptrs_dev, buf.ptr(me, "out") - base,
                      buf.ptrs_dev, buf.ptr(me, "tile_flags") - base, rows_per_rank,
                      cupy.cuda.get_current_stream())
        cupy.cuda.Device().synchronize()
        err.check()
        world.barrier()  # every rank's tiles have landed
        import ml_dtypes

        got = cupy.asnumpy(buf.local("out")).view(ml_dtypes.bfloat16).astype(np.float64)
        ref = np.zeros((rows_per_rank, N))
        bt = f64(b).T
        for r in range(W):
            ar = f64(_rand((M, K), "bfloat16", seed + 10 * r))
            ref += ar[me * rows_per_rank:(me + 1) * rows_per_rank] @ bt
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel < 1.5e-2, f"rank {me}: reduce-scatter relative error {rel:.3g} (seed {seed})"
        flags = cupy.asnumpy(buf.local("tile_flags")).reshape(tiles_m, tiles_n, 32)[:, :, 0]
        for tm in range(tiles_m):
            touches = tm * bm < (me + 1) * rows_per_rank and (tm + 1) * bm > me * rows_per_rank
            want = epoch if touches else 0
            assert (flags[tm] == want).all(), f"rank {me}: tile row {tm} flags {flags[tm]}"
        world.barrier()
        return float(rel)
    finally:
        err.close()
        buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_hooks_reduce_scatter(W, impl):
    hooks_reduce_scatter.run(W, timeout_s=240, impl=impl, seed=fresh_seed())


@on_ranks
def hooks_timeout(world, impl):
    """One chunk flag never comes: the prologue gives up after the op's timeout, the kernel
    still finishes, and the error record names the chunk."""
    import time

    import cupy

    from cuflux.errors import CommTimeoutError, ErrorRecord

    M, N, K, rows_per_chunk = 512, 256, 64, 256
    flags = cupy.zeros(2 * 32, dtype=cupy.uint32)
    flags[0] = 1  # chunk 0 ready, chunk 1 (rows 256..511) never
    out = cupy.zeros((M, N), dtype=cupy.uint16)
    tflags = cupy.zeros(-(-M // 128) * -(-N // 128) * 32, dtype=cupy.uint32)
    bases = cupy.asarray(np.array([out.data.ptr], dtype=np.uint64))
    fbases = cupy.asarray(np.array([tflags.data.ptr], dtype=np.uint64))
    err = ErrorRecord("test", world.rank, timeout_s=0.5)
    a = _rand((M, K), "bfloat16", 1)
    b = _rand((N, K), "bfloat16", 2)
    order = cupy.arange(-(-M // 128), dtype=cupy.int32)
    from cuflux import kernels
    from tests.kernels_cu import GEMM_HOOKS_SRC

    kernels.load(GEMM_HOOKS_SRC)  # compiled and loaded before the clock starts
    t0 = time.monotonic()
    _launch_hooks(impl, a, b, M, N, K, order, 1, flags.data.ptr, rows_per_chunk, 1, 1, err,
                  bases, 0, fbases, 0, M, cupy.cuda.get_current_stream())
    cupy.cuda.Device().synchronize()
    took = time.monotonic() - t0
    with pytest.raises(CommTimeoutError, match="rank 1") as info:
        err.check()
    assert "flag 1" in str(info.value)
    err.close()
    return took


@pytest.mark.gpu
def test_hooks_wait_is_bounded(impl):
    took, = hooks_timeout.run(1, timeout_s=120, impl=impl)
    assert took < 10


# ==== CPU tests (no GPU needed) ===================================================================
def _ptx(arch: str, names) -> str:
    return kernels.compile_ptx("gemm.cu", names, arch)


def _cuobjdump():
    exe = shutil.which("cuobjdump")
    if exe is None:
        try:
            import nvidia

            cand = pathlib.Path(nvidia.__path__[0]) / "cu13" / "bin" / "cuobjdump"
            exe = str(cand) if cand.exists() else None
        except Exception:
            exe = None
    return exe


def test_family_registered_for_both_targets():
    fam = kernels.families()["gemm.cu"]
    assert fam.min_arch == 80 and fam.directory is None  # the package's own
    assert any(n.startswith("gemm_sm90<") for n in fam.names)
    assert any(n.startswith("gemm_sm80<") for n in fam.names)
    assert not any("hooks" in n for n in fam.names)


def test_test_kernels_live_under_tests_not_in_the_package():
    """The hook-exercising kernels are the tests' (tests/kernels_cu/gemm_hooks.cu, registered
    with that directory); nothing of the package's kernels_cu defines them."""
    fam = kernels.families()["gemm_hooks.cu"]
    assert fam is GEMM_HOOKS_FAMILY and set(fam.names) == set(GEMM_HOOKS.values())
    assert fam.directory == pathlib.Path(__file__).resolve().parent / "kernels_cu"
    assert (fam.directory / fam.source).is_file()
    assert not (kernels.KERNEL_DIR / fam.source).exists()
    for path in kernels.KERNEL_DIR.rglob("*.cu*"):
        assert "gemm_hooks_sm" not in path.read_text(), path
    with pytest.raises(ValueError, match="family of the package"):
        kernels.register("gemm.cu", ["x"], directory=fam.directory)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("source", ["gemm.cu", "gemm_hooks.cu"])
def test_both_cores_compile(arch, source):
    fam = kernels.families()[source]
    cubin, lowered = kernels.compile_source(fam.source, fam.names, arch)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(fam.names)


def test_portable_tile_is_defined_once_and_python_agrees():
    """gemm_sm80.cuh defines the portable core's one tile (sm80::kTile*, TileConfig); every
    kernel on that core (gemm.cu, gemm_rs.cu, ag_gemm.cu, the tests' hooks) takes it from there,
    and cuflux.gemm_core.SM80 holds the same numbers."""
    header = (kernels.INCLUDE_DIR / "cuflux" / "gemm_sm80.cuh").read_text()
    got = {m.group(1): int(m.group(2))
           for m in re.finditer(r"\bk(Tile\w+) = (\d+)\s*[,;]", header)}
    sm80 = gemm_core.SM80
    assert got == {"TileM": sm80.bm, "TileN": sm80.bn, "TileK": sm80.bk,
                   "TileStages": sm80.stages, "TileWarpsM": sm80.warps_m,
                   "TileWarpsN": sm80.warps_n, "TileCtasPerSm": sm80.ctas_per_sm}
    assert "kTileThreads = 32 * kTileWarpsM * kTileWarpsN" in header
    assert sm80.threads == 256 and sm80.smem_bytes == 64 << 10 and G.SM80_CONFIG == sm80.name
    users = [kernels.KERNEL_DIR / s for s in ("gemm.cu", "gemm_rs.cu", "ag_gemm.cu")]
    for path in users + [GEMM_HOOKS_FAMILY.directory / GEMM_HOOKS_FAMILY.source]:
        text = path.read_text()
        assert "sm80::TileConfig<" in text, path
        assert "sm80::Config<" not in text, f"{path} spells out a tile of its own"
        assert "__launch_bounds__(sm80::kTileThreads, sm80::kTileCtasPerSm)" in text, path


def test_hopper_core_emits_wgmma_tma_setmaxnreg():
    cfg = G.SM90_CONFIGS[G.SM90_DEFAULT]
    names = [cfg.kernel("__nv_bfloat16", t) for t in (False, True)]
    ptx = _ptx("sm_90a", names)
    for instr in (f"wgmma.mma_async.sync.aligned.m64n{cfg.bn}k16.f32.bf16.bf16",
                  "cp.async.bulk.tensor.2d", "mbarrier.try_wait.parity", "setmaxnreg.inc",
                  "setmaxnreg.dec", "wgmma.wait_group"):
        assert instr in ptx, instr


def test_tma_store_epilogue_emits_bulk_stores():
    cfg = G.SM90_CONFIGS["256x128s4c1t"]
    ptx = _ptx("sm_90a", [cfg.kernel("__nv_bfloat16", False)])
    for instr in ("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group",
                  "cp.async.bulk.wait_group.read", "fence.proxy.async.shared::cta"):
        assert instr in ptx, instr


def test_hopper_core_is_empty_below_sm90a():
    ptx = _ptx("sm_80", [G.SM90_CONFIGS[G.SM90_DEFAULT].kernel("__nv_bfloat16", False),
                         "gemm_sm80<__nv_bfloat16, true>"])
    assert "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx
    for instr in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                  "cp.async.cg.shared.global", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"):
        assert instr in ptx, instr


def test_sass_has_hgmma_when_cuobjdump_is_present(tmp_path):
    fam = kernels.families()["gemm.cu"]
    cubin, _ = kernels.compile_source(fam.source, fam.names, "sm_90a")
    exe = _cuobjdump()
    path = tmp_path / "gemm.cubin"
    path.write_bytes(cubin)
    if exe is None:  # CI image without the disassembler: the PTX test above still holds
        assert b"gemm_sm90" in cubin
        return
    env = dict(os.environ, PATH=os.path.dirname(exe) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([exe, "-sass", str(path)], capture_output=True, text=True, env=env)
    if "nvdisasm" in out.stderr:  # cuobjdump without nvdisasm beside it
        assert b"gemm_sm90" in cubin
        return
    assert "HGMMA.64x256x16.F32.BF16" in out.stdout
    assert "UTMALDG.2D" in out.stdout


# ---- the tile order (mirror of gemm_hooks.cuh ChunkedScheduler::tile) ---------------------------
def _tile(slot, tiles_m, tiles_n, chunk_tiles_m, group_m, order):
    per_chunk = chunk_tiles_m * tiles_n
    visit, r = divmod(slot, per_chunk)
    row, tn = G.grouped_tile(r, chunk_tiles_m, tiles_n, group_m)
    tm = order(visit) * chunk_tiles_m + row
    return (tm, tn) if tm < tiles_m else None


@pytest.mark.parametrize("tiles_m,tiles_n,chunk,group", [(9, 5, 9, 4), (64, 32, 64, 8),
                                                          (7, 3, 2, 3), (13, 1, 4, 16),
                                                          (1, 40, 1, 8)])
def test_tile_order_visits_every_tile_once(tiles_m, tiles_n, chunk, group):
    num_chunks = -(-tiles_m // chunk)
    for rank in range(3):
        order = lambda i: (i + rank) % num_chunks  # noqa: E731  rank-offset
        got = [_tile(s, tiles_m, tiles_n, chunk, group, order)
               for s in range(num_chunks * chunk * tiles_n)]
        got = [t for t in got if t is not None]
        assert sorted(got) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]
        first_chunk = got[0][0] // chunk
        assert first_chunk == rank % num_chunks  # rank r starts on chunk r


def test_listed_chunk_order_is_followed():
    order = [3, 0, 2, 1]
    tiles = [_tile(s, 8, 3, 2, 1, lambda i: order[i]) for s in range(8 * 3)]
    chunks_in_visit_order = [t[0] // 2 for t in tiles]
    assert chunks_in_visit_order == [c for c in order for _ in range(2 * 3)]


# ---- arguments -----------------------------------------------------------------------------------
def test_bad_layout_and_impl_are_named():
    a = np.zeros((8, 8), np.float32)
    with pytest.raises(ValueError, match="b_layout"):
        G.gemm(a, a, b_layout="tn")
    with pytest.raises(ValueError, match="impl"):
        G.gemm(a, a, impl="cuda")


def test_host_arrays_are_refused():
    a = np.zeros((8, 8), np.float32)
    with pytest.raises(TypeError, match=r"cuflux\.gemm: a "):
        G.gemm(a, a)


def test_config_smem_fits_one_sm():
    for cfg in G.SM90_CONFIGS.values():
        assert cfg.smem_bytes <= 227 * 1024, cfg.name
        assert cfg.bm in (128, 256) and cfg.bn in (128, 256) and cfg.cluster in (1, 2)
    assert set(G.TUNER_CANDIDATES) <= set(G.SM90_CONFIGS) and G.SM90_DEFAULT in G.SM90_CONFIGS


def test_pingpong_config_compiles_its_schedule():
    cfg = G.SM90_CONFIGS["128x128s7c1p"]
    assert cfg.pingpong and not cfg.tma_store and cfg.cluster == 1
    assert cfg.kernel("__half", True) == "gemm_sm90<__half, 128, 128, 7, 1, true, false, true>"
    assert G.SM90_CONFIGS["256x128s4c1"].kernel("__half", True).endswith("true, false>")
    for bad in (dict(bm=256, bn=128), dict(bm=128, bn=256), dict(bm=128, bn=128, tma_store=True)):
        with pytest.raises(ValueError, match="ping-pong"):
            G.Sm90Config(stages=4, cluster=1, pingpong=True, **bad)
    ptx = _ptx("sm_90a", [cfg.kernel("__nv_bfloat16", False)])
    for instr in ("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "bar.arrive",
                  "bar.sync", "mbarrier.try_wait.parity", "setmaxnreg.inc"):
        assert instr in ptx, instr


def test_shape_class_and_heuristic():
    T = gemm_tuner
    assert T.shape_class(8192, 8192, 8192) == "13x13x13"
    assert T.shape_class(777, 1536, 2048) == "10x11x11"
    assert T.heuristic(4096, 8, 4096) in G.SM90_CONFIGS
    assert T.heuristic(4096, 4096, 4096) in G.SM90_CONFIGS
    assert T.heuristic(G.CUBLAS_BELOW_M - 1, 4096, 4096) == G.CUBLAS  # small M: cuBLAS
    assert G.core_heuristic(16, 4096, 4096) in G.SM90_CONFIGS  # the fused ops' core: never cuBLAS


# ---- the ping-pong consumers' protocol (mirror of gemm_sm90.cuh consume() with kPingpong) ------
def _pingpong_run(tiles, k_tiles, stages, seed, ordered=True):
    """Random interleavings of the producer and the two consumer warpgroups on a model of the
    ring: mbarrier parity waits (true once the phase of that parity completed, i.e. the current
    phase's parity differs), one reader per stage use, the ordering barriers as bar.sync (the
    owner) + bar.arrive (the other). Returns the (warpgroup, tile, k-step, data) reads; raises
    TimeoutError when the actors stop making progress (a deadlock), AssertionError on a barrier
    that two arrivals would complete."""
    import random

    rnd = random.Random(seed)
    full, empty, data = [0] * stages, [0] * stages, [None] * stages  # completed phases, contents
    bar = [[0, 0], [0, 0]]  # per order barrier: [arrivals pending, syncs waiting]
    reads = []

    def wait(phases, s, parity):
        while (phases[s] & 1) == parity:  # parity of the current (incomplete) phase
            yield

    def producer():
        for i in range(tiles * k_tiles):
            s = i % stages
            yield from wait(empty, s, ((i // stages) & 1) ^ 1)
            data[s] = i
            full[s] += 1

    def bar_sync(b):
        bar[b][1] += 1
        while bar[b][0] + bar[b][1] < 2:
            yield
        if bar[b][1]:  # the first of the two to see it complete resets it
            bar[b] = [0, 0]

    def bar_arrive(b):
        assert bar[b][0] == 0, "two arrivals before the sync: the barrier completes wrongly"
        bar[b][0] += 1  # a waiting sync completes on its next poll

    def consumer(wg):
        stage, phase, seq = 0, 0, 0
        for j in range(tiles):
            owner, seq = seq & 1, seq + 1
            if owner != wg:
                stage += k_tiles
                phase ^= (stage // stages) & 1
                stage %= stages
                continue
            if ordered and seq > 1:
                yield from bar_sync(wg)
            prev = 0
            for kb in range(k_tiles):
                yield from wait(full, stage, phase)
                reads.append((wg, j, kb, data[stage]))
                yield  # the wgmma are in flight
                if kb > 0:
                    empty[prev] += 1  # release (one reader per use)
                prev = stage
                stage += 1
                if stage == stages:
                    stage, phase = 0, phase ^ 1
            if ordered:
                bar_arrive(1 - wg)
            empty[prev] += 1
            yield  # the epilogue
        if ordered and seq > 0 and ((seq - 1) & 1) != wg:
            yield from bar_sync(wg)

    actors = [producer(), consumer(0), consumer(1)]
    for _ in range(200 * (tiles * k_tiles + 10)):  # far more steps than a live run needs
        if not actors:
            break
        a = rnd.choice(actors)
        try:
            next(a)
        except StopIteration:
            actors.remove(a)
    else:
        raise TimeoutError("no progress: deadlock", reads)
    assert bar == [[0, 0], [0, 0]], bar  # every arrival met its sync
    return reads


@pytest.mark.parametrize("tiles,k_tiles,stages", [(1, 3, 7), (2, 1, 7), (5, 16, 7), (7, 3, 2),
                                                  (6, 7, 7), (9, 2, 3), (4, 8, 3)])
def test_pingpong_protocol_reads_each_stage_in_order(tiles, k_tiles, stages):
    for seed in range(30):
        reads = _pingpong_run(tiles, k_tiles, stages, seed)
        want = [(j % 2, j, kb, j * k_tiles + kb) for j in range(tiles) for kb in range(k_tiles)]
        assert sorted(reads, key=lambda r: (r[1], r[2])) == want


def test_pingpong_protocol_needs_the_order_barrier():
    # Without it a warpgroup that skipped the other's tile may pass a parity wait one phase
    # early (the stage still holds the other's data) and then hang the ring: the barrier is a
    # correctness condition, not only a performance one.
    bad = 0
    for seed in range(20):
        try:
            reads = _pingpong_run(4, 8, 3, seed, ordered=False)
        except TimeoutError as e:  # the early pass also releases a wrong phase: a hang follows
            reads = e.args[1]
        bad += any(d != j * 8 + kb for _, j, kb, d in reads)
    assert bad > 0


# ==== CPU: the tuner's table -> what gemm runs ====================================================
def _hopper_table(monkeypatch, table):
    from cuflux import gemm_tuner as T

    monkeypatch.setenv("CUFLUX_GEMM_TUNE", "1")
    monkeypatch.setattr(T, "device_props", lambda dev=None: (0, "sm_90a", 132, "H200"))
    monkeypatch.setattr(T, "_TUNER_TABLE", table)
    monkeypatch.setattr(T, "_CHOICES", {})
    return T


@pytest.mark.parametrize("core_ms,want", [(0.60, "core"), (0.90, "core"), (0.92, "cublas"),
                                          (0.975, "cublas"), (1.05, "cublas")])
def test_gemm_takes_our_core_only_past_the_margin(monkeypatch, core_ms, want):
    """gemm's plan and its per-call choice take the tuner's winner when it is one of ours only
    if its timing beat cuBLAS's by CORE_MARGIN; a near-tie goes to cuBLAS. The tuner's plain
    winner (fastest: AllGatherGemm's route) is unchanged."""
    from cuflux.arrays import dtype_info

    T = _hopper_table(monkeypatch, {})
    dt = dtype_info("bfloat16")
    key = T.tune_key(dt, "kn", 4096, 12288, 6144)
    winner = "128x256s4c1t" if core_ms < 1.0 else T.CUBLAS
    T._TUNER_TABLE[key] = {"config": winner, "ms": {T.CUBLAS: 1.0, "128x256s4c1t": core_ms}}
    expect = "128x256s4c1t" if want == "core" else T.CUBLAS
    assert T.CORE_MARGIN == 0.10
    assert T.fastest(4096, 12288, 6144, "bfloat16", "kn") == winner
    assert T.plan(4096, 12288, 6144, "bfloat16", "kn") == expect
    ran = []
    got = T.choice(dt, "kn", 4096, 12288, 6144, lambda name: ran.append(name), None, False)
    assert got == expect and ran == []  # the table answered: nothing timed
    monkeypatch.setattr(T, "tuned_config", lambda *a, **k: pytest.fail("asked the table again"))
    assert T.choice(dt, "kn", 4096, 12288, 6144, None, None, False) == expect  # remembered


def test_a_winner_without_a_cublas_time_is_kept(monkeypatch):
    """An entry whose budget ran out before cuBLAS was timed (or an older table) keeps its
    winner; without a tuned entry the untuned heuristic decides, margin or not."""
    from cuflux.arrays import dtype_info

    T = _hopper_table(monkeypatch, {})
    key = T.tune_key(dtype_info("bfloat16"), "nk", 4096, 4096, 4096)
    T._TUNER_TABLE[key] = {"config": "256x128s4c1t", "ms": {"256x128s4c1t": 1.0}}
    assert T.plan(4096, 4096, 4096, "bfloat16", "nk") == "256x128s4c1t"
    T._TUNER_TABLE[key] = {"config": "256x128s4c1t"}
    assert T.plan(4096, 4096, 4096, "bfloat16", "nk") == "256x128s4c1t"
    assert T.plan(300, 4096, 4096, "bfloat16", "kn") == T.heuristic(300, 4096, 4096)
    assert T.plan(16, 4096, 4096, "bfloat16", "kn") == T.CUBLAS


def test_tuner_times_every_candidate_in_rounds_of_reversed_order(monkeypatch, tmp_path):
    """The tuner warms each candidate once, then times it in TUNE_ROUNDS rounds, the order
    reversed every other round (cuBLAS first, then last: the clock's climb through the first
    round does not count against it), and keeps each candidate's best call."""
    import cupy

    T = _hopper_table(monkeypatch, {})
    monkeypatch.setattr(T, "tuner_path", lambda: tmp_path / "gemm_tuner.json")
    monkeypatch.setenv("CUFLUX_GEMM_TUNE_BUDGET_S", "60")
    calls, marks = [], []

    class Ev:
        def record(self, stream):
            self.at = len(calls)
            marks.append(self)

        def synchronize(self):
            pass

    # cuBLAS is slow while the clock climbs (its first round), fast after; ours steady at 1.0
    def elapsed(a, b):
        name, rnd = calls[b.at - 1]
        return (1.2 if rnd == 0 else 0.95) if name == T.CUBLAS else 1.0

    monkeypatch.setattr(cupy.cuda, "Event", Ev)
    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", elapsed)
    names = (T.CUBLAS,) + T.TUNER_CANDIDATES
    rnd = {"n": 0}

    def run(name):
        calls.append((name, rnd["n"]))
        if len([c for c in calls if c[0] == name]) == 4 and name == names[-1]:
            rnd["n"] = 1  # the last of round 0 (warm-up + 3 timed) ends the round

    got = T.tuned_config("key", run, None)
    assert T.TUNE_ROUNDS == 2
    seq = [n for i, (n, _) in enumerate(calls) if i == 0 or calls[i - 1][0] != n]
    assert seq == list(names) + list(names[-2::-1])  # the last of round 0 runs on into round 1
    assert sum(1 for n, _ in calls if n == T.CUBLAS) == 1 + 3 * T.TUNE_ROUNDS
    assert got == T.CUBLAS  # its best call (0.95) is the fastest
    entry = T.load_tuner()["key"]
    assert entry["config"] == T.CUBLAS and entry["ms"][T.CUBLAS] == 0.95


# ==== CPU: the cublasLt route's plan, on a stand-in libcublasLt ==================================
class _FakeLt:
    """libcublasLt as the plan sees it: every create hands out a new address and is logged
    with its arguments; the heuristic finds an algorithm unless told not to."""

    def __init__(self, finds=True, candidates=1):
        self.log, self.next, self.finds, self.candidates = [], 0x1000, finds, candidates

    def _out(self, ref):
        self.next += 0x10
        ref._obj.value = self.next
        return self.next

    def __getattr__(self, name):
        def call(*args):
            if name.endswith("Create"):
                made = self._out(args[0])
                self.log.append((name, made) + tuple(args[1:]))
            elif name.endswith("SetAttribute"):
                self.log.append((name, args[0], args[1], args[2]._obj.value))
            elif name == "cublasLtMatmulAlgoGetHeuristic":  # candidate i: algo word 77 + i
                results, found = args[8], args[9]._obj
                found.value = min(self.candidates, args[7]) if self.finds else 0
                for i in range(found.value):
                    results[i].state = 0
                    results[i].algo.data[0] = 77 + i
                self.log.append((name,) + args[:8])
            elif name == "cublasLtMatmul":  # the algorithm by its word, not its address
                self.log.append((name,) + args[:12] + (args[12]._obj.data[0],) + args[13:])
            else:
                self.log.append((name,) + args)
            return 0
        return call


def _fake_lt(monkeypatch, finds=True, candidates=1):
    import ctypes
    import threading

    lt = gemm_core._CublasLt.__new__(gemm_core._CublasLt)

    class Algo(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint64 * 8)]

    class Heuristic(ctypes.Structure):
        _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                    ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]

    lt.lib, lt.ctypes, lt.Heuristic = _FakeLt(finds, candidates), ctypes, Heuristic
    lt.handles, lt.plans, lt.lock, lt.version = {}, {}, threading.Lock(), 130400
    monkeypatch.setattr(gemm_core, "_CUBLASLT", [lt])
    return lt


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_cublaslt_plan_reads_row_major_as_column_major(monkeypatch, layout):
    """The plan's descriptors: fp32 compute and scale; A = b as stored ([N, K] ld N for kn,
    [K, N] ld K transposed for nk), B = a ([K, M] ld K), C = D = out ([N, M] ld N, out's
    dtype); the heuristic asked for ALGO_CANDIDATES algorithms with the workspace's size, the
    first one used until tuned. Made once per shape: the second call reuses it."""
    from cuflux.arrays import dtype_info

    lt = _fake_lt(monkeypatch)
    bf, f32 = dtype_info("bfloat16"), dtype_info("float32")
    M, N, K = 16, 520, 264
    plan = lt.plan(0, bf, f32, M, N, K, layout)
    made = {e[1]: e for e in lt.lib.log if e[0].endswith("Create")}
    log = lt.lib.log
    (desc,) = [e for e in log if e[0] == "cublasLtMatmulDescCreate"]
    assert desc[2:] == (68, 0)  # CUBLAS_COMPUTE_32F, CUDA_R_32F
    (trans,) = [e for e in log if e[0] == "cublasLtMatmulDescSetAttribute"]
    assert trans[2:] == (3, 0 if layout == "kn" else 1)  # TRANSA: N or T
    prefs = [e[2:] for e in log if e[0] == "cublasLtMatmulPreferenceSetAttribute"]
    assert prefs == [(1, gemm_core.WORKSPACE_BYTES), (5, 256), (6, 256), (7, 256), (8, 256)]
    h, d, a_lay, b_lay, c_lay = plan.h, plan.desc, plan.a_lay, plan.b_lay, plan.c_lay
    assert made[a_lay][2:] == ((14, N, K, N) if layout == "kn" else (14, K, N, K))
    assert made[b_lay][2:] == (14, K, M, K)
    assert made[c_lay][2:] == (0, N, M, N)
    (heur,) = [e for e in log if e[0] == "cublasLtMatmulAlgoGetHeuristic"]
    assert heur[1:7] == (h, d, a_lay, b_lay, c_lay, c_lay)
    assert heur[8] == gemm_core.ALGO_CANDIDATES
    assert plan.algo.data[0] == 77 and len(plan.algos) == 1 and not plan.tuned
    assert [e[0] for e in log].count("cublasLtMatmulPreferenceDestroy") == 1  # not kept
    n = len(log)
    assert lt.plan(0, bf, f32, M, N, K, layout) is plan and len(log) == n
    lt.plan(0, bf, f32, M + 1, N, K, layout)  # another shape: a plan of its own
    lt.plan(0, bf, f32, M, N, K, layout, 16)  # operands 16-byte aligned only: another
    assert lt.plan(0, bf, f32, M, N, K, layout, 16) is not plan
    assert [e[2:] for e in lt.lib.log if e[0] == "cublasLtMatmulPreferenceSetAttribute"][-1] == (8, 16)
    assert len(lt.plans) == 3 and len(lt.handles) == 1


def test_cublaslt_plans_let_go_destroy_their_descriptors(monkeypatch):
    """A table of plans emptied past _MAX_PLANS (shapes that change every call) destroys the
    descriptor and three layouts of each plan it dropped once nothing else holds the plan,
    and not before: a bound call (_LtCall) keeps its plan's descriptors alive."""
    import gc

    from cuflux.arrays import dtype_info

    lt = _fake_lt(monkeypatch)
    monkeypatch.setattr(gemm_core._CublasLt, "_MAX_PLANS", 2)
    bf = dtype_info("bfloat16")

    def destroyed():
        return {e[1] for e in lt.lib.log if e[0].endswith("Destroy") and "Preference" not in e[0]}

    p1 = lt.plan(0, bf, bf, 16, 64, 64, "nk")
    held = gemm_core._LtCall(lt, p1, 0xA0, 0xB0, 0xC0, 0, "a call", set())
    d1 = {p1.desc, p1.a_lay, p1.b_lay, p1.c_lay}
    p2 = lt.plan(0, bf, bf, 17, 64, 64, "nk")
    d2 = {p2.desc, p2.a_lay, p2.b_lay, p2.c_lay}
    del p1, p2
    lt.plan(0, bf, bf, 18, 64, 64, "nk")  # the table was full: emptied, then this one
    gc.collect()
    assert len(lt.plans) == 1 and d2 <= destroyed() and not d1 & destroyed()
    del held
    gc.collect()
    assert d1 <= destroyed()


def test_cublaslt_without_an_algorithm_falls_back_to_gemmex(monkeypatch):
    """No algorithm for the shape: the plan is None (its descriptors destroyed, remembered so
    the heuristic is not asked again), launch_cublaslt enqueues nothing and says False, and
    launch_cublas goes on through cublasGemmEx."""
    from types import SimpleNamespace

    from cuflux.arrays import dtype_info

    lt = _fake_lt(monkeypatch, finds=False)
    bf = dtype_info("bfloat16")
    assert lt.plan(0, bf, bf, 8, 64, 64, "nk") is None
    names = [e[0] for e in lt.lib.log]
    assert names.count("cublasLtMatrixLayoutDestroy") == 3
    assert names.count("cublasLtMatmulDescDestroy") == 1
    assert names.count("cublasLtMatmulPreferenceDestroy") == 1
    arr = SimpleNamespace(data=SimpleNamespace(device_id=0, ptr=0x100))  # 256-byte aligned
    stream = SimpleNamespace(ptr=0x20)
    assert not gemm_core.launch_cublaslt(arr, arr, None, arr, bf, bf, 8, 64, 64, "nk", stream)
    assert names == [e[0] for e in lt.lib.log]  # asked nothing more, enqueued nothing

    monkeypatch.setenv("CUFLUX_GEMM_CUBLASLT", "1")
    gemmex = []

    class Cb:
        lib = SimpleNamespace(cublasGemmEx=lambda *a: gemmex.append(a) or 0)

        def handle(self, dev, stream_ptr, under_capture):
            return 0x99

    monkeypatch.setattr(gemm_core, "_CUBLAS", [Cb()])
    assert gemm_core.launch_cublas(arr, arr, None, arr, bf, bf, 8, 64, 64, "nk", stream)
    assert len(gemmex) == 1 and gemmex[0][0] == 0x99


class _Ws:
    """A stand-in cuBLAS workspace: a pointer of its own, weakly referenceable."""
    ptrs = iter(range(0x1000, 1 << 40, 0x1000))

    def __init__(self, stream):
        from types import SimpleNamespace

        self.stream, self.data = stream, SimpleNamespace(ptr=next(_Ws.ptrs))

    def __eq__(self, other):  # as a CuPy array's: elementwise, no truth value of its own
        return np.array([self is other] * 2)

    __hash__ = object.__hash__


def test_cublas_workspaces_kept_for_the_streams_used_last(monkeypatch):
    """cuBLAS workspaces (gemm_core._Workspaces): one per (device, stream) made at its first
    GEMM, the WORKSPACES_KEPT streams used last keep theirs; a new stream past them lets go the
    one used longest ago (nothing else holds it then), never one a capture used (get under
    capture, or pin); under capture or without allocate none is made; a stream let go gets a
    new one."""
    import weakref

    monkeypatch.setattr(gemm_core, "WORKSPACES_KEPT", 3)
    made = []
    spaces = gemm_core._Workspaces(lambda s: made.append(_Ws(s)) or made[-1])
    first = {s: spaces.get(0, s, False) for s in (10, 11, 12)}
    assert [w.stream for w in made] == [10, 11, 12] and spaces.get(0, 10, False) is first[10]
    refs = {s: weakref.ref(w) for s, w in first.items()}
    made.clear()
    first.clear()
    assert spaces.get(0, 13, False).stream == 13  # 11 is the one used longest ago (10 was used)
    assert refs[11]() is None and refs[10]() is not None and refs[12]() is not None
    assert spaces.kept((0, 11)) is None
    assert spaces.get(0, 11, True) is None  # under capture none is made
    assert spaces.get(0, 11, False, allocate=False) is None  # nor for a replay
    assert len(made) == 1 and list(spaces.arrays) == [(0, 12), (0, 10), (0, 13)]  # used last: end
    assert spaces.get(0, 12, True) is refs[12]()  # a capture used it: kept from now on
    spaces.pin((0, 10))  # a caller's graph captured a replay on 10
    spaces.pin((0, 99))  # (no workspace there: nothing to keep)
    assert spaces.captured == {(0, 12), (0, 10)}
    assert spaces.get(0, 14, False).stream == 14  # 10 and 12 stay
    assert refs[10]() is not None and refs[12]() is not None
    assert sorted(spaces.arrays) == [(0, 10), (0, 12), (0, 14)]
    assert spaces.get(1, 10, False).stream == 10 and (0, 10) in spaces.arrays  # per device
    assert spaces.get(0, 11, False) is not None and len(made) == 4  # let go: a new one


def test_cublas_handle_sets_its_stream_and_holds_its_workspace(monkeypatch):
    """The GemmEx route's handle (_Cublas.handle): set to a stream and its workspace once
    (not again while calls stay on it); a replay (allocate=False) makes no workspace and pins
    none; under capture the stream's kept workspace is pinned; the handle holds the workspace
    it is set to even after _Workspaces let it go, until it moves to another stream."""
    import weakref
    from types import SimpleNamespace

    monkeypatch.setattr(gemm_core, "WORKSPACES_KEPT", 2)
    log = []
    cb = gemm_core._Cublas.__new__(gemm_core._Cublas)
    cb.lib = SimpleNamespace(cublasSetStream_v2=lambda h, s: log.append(("stream", s)) or 0,
                             cublasSetWorkspace_v2=lambda h, p, n: log.append(("ws", p)) or 0)
    cb.handles, cb.set_to = {0: 0x99}, {}
    cb.spaces = spaces = gemm_core._Workspaces(_Ws)
    assert cb.handle(0, 7, False) == 0x99
    ws7 = spaces.kept((0, 7))
    assert log == [("stream", 7), ("ws", ws7.data.ptr)]
    for _ in range(2):
        assert cb.handle(0, 7, False, allocate=False) == 0x99  # a replay: as set
    assert cb.handle(0, 8, False, allocate=False) == 0  # a replay on a stream without one
    assert len(log) == 2 and not spaces.captured and (0, 8) not in spaces.arrays
    assert cb.handle(0, 7, True) == 0x99 and len(log) == 2  # under capture: pinned, as set
    assert spaces.captured == {(0, 7)}
    cb.handle(0, 10, False)
    held = weakref.ref(spaces.kept((0, 10)))
    spaces.get(0, 11, False)  # 7 is pinned: 10 is let go by _Workspaces ...
    assert (0, 10) not in spaces.arrays and held() is not None  # ... but the handle holds it
    n = len(log)
    assert cb.handle(0, 10, True) == 0 and (0, 10) not in spaces.captured  # none in capture
    assert cb.handle(0, 10, False, allocate=False) == 0 and len(log) == n  # a replay: none
    assert cb.handle(0, 10, False) == 0x99 and held() is None  # a call: made anew, set
    assert log[n:] == [("stream", 10), ("ws", spaces.kept((0, 10)).data.ptr)]
    assert cb.handle(0, 10, True) == 0x99 and (0, 10) in spaces.captured and len(log) == n + 2
    held = weakref.ref(spaces.kept((0, 10)))
    cb.handle(0, 11, False)
    assert held() is not None  # pinned: kept although the handle moved on
    assert log[-2:] == [("stream", 11), ("ws", spaces.kept((0, 11)).data.ptr)]


def test_lt_replay_follows_its_streams_workspace(monkeypatch):
    """_LtReplay: False on a stream without a workspace (the full path makes one); with graphs,
    a stream's first call with a workspace calls cublasLtMatmul directly and its second
    captures a graph, replayed after; a workspace let go and made again (another pointer) is
    called directly once, then captured anew with its pointer. The call run under the
    caller's capture pins the stream's workspace; under the graph's own capture (the private
    stream) it pins nothing."""
    import ctypes
    from types import SimpleNamespace

    monkeypatch.setattr(gemm_core, "WORKSPACES_KEPT", 1)
    monkeypatch.setenv("CUFLUX_GRAPH_REPLAY", "1")
    captured_now = set()  # streams a capture is under way on
    monkeypatch.setattr(gemm_core, "capturing", lambda s: s in captured_now)
    spaces = gemm_core._Workspaces(_Ws)
    monkeypatch.setattr(gemm_core, "_CUBLAS", [SimpleNamespace(spaces=spaces)])
    graphs = []

    class Graph:  # a stand-in launch.GraphReplay: its launches, and the streams replayed on
        def __init__(self, launches, op, what):
            self.launches, self.on = launches, []
            graphs.append(self)

        def __call__(self, stream):
            self.on.append(stream)

    monkeypatch.setattr(gemm_core, "GraphReplay", Graph)
    calls = []
    lt = SimpleNamespace(ctypes=ctypes, lib=SimpleNamespace(
        cublasLtMatmul=lambda *a: calls.append((a[13], a[15])) or 0))
    plan = SimpleNamespace(h=1, desc=2, a_lay=3, b_lay=4, c_lay=5, algo=ctypes.c_int(0))
    replay = gemm_core._LtReplay(lt, plan, 0xA0, 0xB0, 0xC0, 0, "a call")
    assert replay(7) is False and not calls
    ws = spaces.get(0, 7, False)
    assert replay(7) is None and calls == [(ws.data.ptr, 7)] and not graphs
    replay(7)
    replay(7)
    (g,) = graphs
    assert g.on == [7, 7] and len(calls) == 1
    g.launches[0](7)  # what the graph captures: the call with that workspace
    assert calls[-1] == (ws.data.ptr, 7)
    spaces.get(0, 8, False)  # 7's workspace let go (one kept)
    assert replay(7) is False
    ws2 = spaces.get(0, 7, False)
    replay(7)
    assert calls[-1] == (ws2.data.ptr, 7) and len(graphs) == 1
    replay(7)
    assert len(graphs) == 2 and graphs[1].on == [7] and g.on == [7, 7]
    assert not spaces.captured
    monkeypatch.setattr(gemm_core, "private_capture_stream", lambda dev: 5)
    captured_now.update((5, 7))
    graphs[1].launches[0](5)  # the graph's own capture, on the private stream: no pin
    assert not spaces.captured
    graphs[1].launches[0](7)  # the caller's capture on 7 takes the call itself: pinned
    assert spaces.captured == {(0, 7)}


def test_cublaslt_call_takes_b_then_a_and_writes_out(monkeypatch):
    """cublasLtMatmul's operands: A = b, B = a, C = D = out, beta 0 without a bias (1 with
    one, the bias broadcast into out first), the stream's workspace, the call's stream."""
    from types import SimpleNamespace

    from cuflux.arrays import dtype_info

    lt = _fake_lt(monkeypatch)
    bf = dtype_info("bfloat16")
    ws = SimpleNamespace(data=SimpleNamespace(ptr=0x5000))
    monkeypatch.setattr(gemm_core, "_CUBLAS", [SimpleNamespace(workspace=lambda d, s, c: ws)])
    a = SimpleNamespace(data=SimpleNamespace(device_id=0, ptr=0xA0))
    b = SimpleNamespace(data=SimpleNamespace(device_id=0, ptr=0xB0))
    out = SimpleNamespace(data=SimpleNamespace(device_id=0, ptr=0xC0))
    stream = SimpleNamespace(ptr=0x20)
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, 8, 64, 64, "kn", stream)
    (call,) = [e for e in lt.lib.log if e[0] == "cublasLtMatmul"]
    p = lt.plans[(0, "bfloat16", "bfloat16", "kn", 8, 64, 64, 16, False)]
    assert call[1:3] == (p.h, p.desc) and call[4:8] == (0xB0, p.a_lay, 0xA0, p.b_lay)
    assert call[8] == gemm_core._ZERO_PTR and call[9:13] == (0xC0, p.c_lay, 0xC0, p.c_lay)
    assert call[13] == 77 and call[14:] == (0x5000, gemm_core.WORKSPACE_BYTES, 0x20)
    monkeypatch.setattr(gemm_core, "_CUBLAS", [SimpleNamespace(workspace=lambda d, s, c: None)])
    n = len(lt.lib.log)
    assert not gemm_core.launch_cublaslt(a, b, None, out, bf, bf, 8, 64, 64, "kn", stream, True)
    assert len(lt.lib.log) == n  # under capture without a workspace: nothing enqueued


def _lt_operands(monkeypatch):
    """Stand-in operands, workspace and stream for launch_cublaslt on the CPU."""
    from types import SimpleNamespace

    ws = SimpleNamespace(data=SimpleNamespace(ptr=0x5000))
    monkeypatch.setattr(gemm_core, "_CUBLAS", [SimpleNamespace(workspace=lambda d, s, c: ws)])

    def arr(ptr):
        return SimpleNamespace(data=SimpleNamespace(device_id=0, ptr=ptr))

    return arr, SimpleNamespace(ptr=0x20)


def _fresh_algo_tuning(monkeypatch, tmp_path):
    """A fake cublasLt of 3 candidates, an empty algorithm table in tmp_path, no timings or
    class winners yet in this process, tuning on, a GPU named "GPU X"."""
    lt = _fake_lt(monkeypatch, candidates=3)
    monkeypatch.setattr(gemm_tuner, "algo_path", lambda: tmp_path / "algos.json")
    monkeypatch.setattr(gemm_tuner, "_ALGO_TABLE", None)
    monkeypatch.setattr(gemm_core, "_ALGO_TIMINGS", [0])
    monkeypatch.setattr(gemm_core, "_CLASS_WINNERS", {})
    monkeypatch.setattr(gemm_core, "device_props", lambda dev=None: (0, "sm_90a", 132, "GPU X"))
    monkeypatch.delenv("CUFLUX_GEMM_ALGO_TUNE", raising=False)
    return lt


def test_cublaslt_tunes_a_big_shape_once_and_remembers_it(monkeypatch, tmp_path):
    """A shape of at least ALGO_TUNE_MIN_FLOP: its first call times every candidate on its own
    operands (beta 0 into out, before the call) and runs on the fastest, as every later call
    does; the choice is kept in the algorithm table (its own file) under GPU, cublasLt version,
    dtypes, layout, exact shape, alignment and epilogue, and a fresh plan (another process)
    takes it from there without timing (CUFLUX_GEMM_TUNE=0 does not stop it). A small shape,
    CUFLUX_GEMM_ALGO_TUNE=0 and a call under capture time nothing (the capture's plan is tuned
    at its next call outside); a timing the budget cut short is used but not kept;
    prepare_cublaslt tunes without a call of its own; tune=False leaves a new plan untuned;
    past ALGO_TUNE_MAX_PER_PROCESS timings a new shape takes the heuristic's first."""
    import json

    from cuflux.arrays import dtype_info

    lt = _fresh_algo_tuning(monkeypatch, tmp_path)
    monkeypatch.setenv("CUFLUX_GEMM_TUNE", "0")  # the Hopper tuner's switch is not this one
    timed = []

    complete = [True]

    def fake_timing(run, count, stream, budget_s):
        assert stream.ptr == 0x20 and budget_s > 0 and stream.synced  # earlier work run first
        timed.append(count)
        assert [run(i) for i in range(count)] == [0] * count
        return {0: 3.0, 1: 1.0, 2: 2.0}, complete[0]

    monkeypatch.setattr(gemm_core, "_time_candidates", fake_timing)
    arr, stream = _lt_operands(monkeypatch)
    stream.synced = False
    stream.synchronize = lambda: setattr(stream, "synced", True)
    a, b, out = arr(0x10000), arr(0x20000), arr(0x30000)
    bf = dtype_info("bfloat16")
    M, N, K = 4096, 4096, 4096
    assert 2 * M * N * K >= gemm_core.ALGO_TUNE_MIN_FLOP

    def words(log):
        return [e[13] for e in log if e[0] == "cublasLtMatmul"]

    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, N, K, "nk", stream)
    assert timed == [3] and words(lt.lib.log) == [77, 78, 79, 78]
    calls = [e for e in lt.lib.log if e[0] == "cublasLtMatmul"]
    assert all(c[8] == gemm_core._ZERO_PTR and c[9] == c[11] == 0x30000 for c in calls)
    key = "GPU X|cublasLt 130400|bfloat16|bfloat16|nk|4096x4096x4096|256|-"
    saved = json.loads((tmp_path / "algos.json").read_text())
    assert saved[key]["algo"] == 1 and saved[key]["ms"] == [3.0, 1.0, 2.0]
    assert gemm_tuner.recall_algo(key) == 1
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, N, K, "nk", stream)
    assert timed == [3] and words(lt.lib.log)[-1] == 78  # the plan keeps it

    lt = _fake_lt(monkeypatch, candidates=3)  # another process: the table from the file
    monkeypatch.setattr(gemm_tuner, "_ALGO_TABLE", None)
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, N, K, "nk", stream)
    assert timed == [3] and words(lt.lib.log) == [78]

    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, 8, N, K, "nk", stream)
    assert timed == [3] and words(lt.lib.log)[-1] == 77  # small: the heuristic's first
    monkeypatch.setenv("CUFLUX_GEMM_ALGO_TUNE", "0")
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, N, 2 * K, "nk", stream)
    assert timed == [3] and words(lt.lib.log)[-1] == 77
    monkeypatch.delenv("CUFLUX_GEMM_ALGO_TUNE")
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, N, 4 * K, "nk", stream, True)
    assert timed == [3] and words(lt.lib.log)[-1] == 77
    assert not lt.plans[(0, "bfloat16", "bfloat16", "nk", M, N, 4 * K, 256, False)].tuned
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, N, 4 * K, "nk", stream)
    assert timed == [3, 3] and words(lt.lib.log)[-1] == 78
    complete[0] = False  # the budget cut the timing short: used here, not kept in the table
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, N, 8 * K, "nk", stream)
    assert timed == [3, 3, 3] and words(lt.lib.log)[-1] == 78
    assert not any(f"|{M}x{N}x{8 * K}|" in k
                   for k in json.loads((tmp_path / "algos.json").read_text()))
    assert gemm_core.prepare_cublaslt(a, b, None, out, bf, bf, M, 2 * N, K, "nk", stream)
    assert timed == [3, 3, 3, 3] and words(lt.lib.log)[-1] == 79  # timed, no call of its own
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, 4 * N, K, "nk", stream,
                                     tune=False)
    assert timed == [3, 3, 3, 3] and words(lt.lib.log)[-1] == 77  # tune=False: untuned
    assert gemm_core._ALGO_TIMINGS == [4]
    monkeypatch.setattr(gemm_core, "ALGO_TUNE_MAX_PER_PROCESS", 4)  # the process's cap reached
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, 8 * N, K, "nk", stream)
    assert timed == [3, 3, 3, 3] and words(lt.lib.log)[-1] == 77  # a new shape: untimed


def test_cublaslt_shape_class_takes_its_winner_without_timing(monkeypatch, tmp_path):
    """A new M of a timed shape's class (the same GEMM, M in the same power-of-two range)
    takes the class's winner without timing where the heuristic offers that algorithm for the
    new M too; where it does not, the new M is timed as a shape of its own; an M of another
    range is timed; a shape read from the table gives its class its choice; a timing the
    budget cut short names no class winner (a later M of that class is timed)."""
    import ctypes
    import json

    from cuflux.arrays import dtype_info

    lt = _fresh_algo_tuning(monkeypatch, tmp_path)
    timed, complete = [], [True]

    def fake_timing(run, count, stream, budget_s):
        timed.append(count)
        return {i: t for i, t in enumerate((3.0, 1.0, 2.0)[:count])}, complete[0]

    monkeypatch.setattr(gemm_core, "_time_candidates", fake_timing)
    arr, stream = _lt_operands(monkeypatch)
    stream.synchronize = lambda: None
    a, b, out = arr(0x10000), arr(0x20000), arr(0x30000)
    bf = dtype_info("bfloat16")
    N, K = 4096, 4096

    def last_word():
        return [e[13] for e in lt.lib.log if e[0] == "cublasLtMatmul"][-1]

    def call(M):
        assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, M, N, K, "nk", stream)
        return last_word()

    assert call(4000) == 78 and timed == [3]  # timed: candidate 1 wins
    assert call(3000) == 78 and timed == [3]  # same range [2048, 4096): its winner, untimed
    assert call(2048) == 78 and timed == [3]
    assert call(4096) == 78 and timed == [3, 3]  # [4096, 8192): a class of its own, timed
    # the winner not among a new M's candidates: that M is timed as a shape of its own
    plan = lt.plan(0, bf, bf, 2500, N, K, "nk")
    algo_type = type(plan.algos[0])
    plan.algos = [algo_type(), algo_type()]
    plan.algos[0].data[0], plan.algos[1].data[0] = 90, 91
    plan.algo = plan.algos[0]
    assert call(2500) == 91 and timed == [3, 3, 2]
    assert ctypes.sizeof(algo_type) == 64
    # another process: the table's exact shape gives its class the choice, untimed
    table = json.loads((tmp_path / "algos.json").read_text())
    assert any("|4000x4096x4096|" in k for k in table)
    lt = _fake_lt(monkeypatch, candidates=3)
    monkeypatch.setattr(gemm_tuner, "_ALGO_TABLE", None)
    monkeypatch.setattr(gemm_core, "_CLASS_WINNERS", {})
    assert call(4000) == 78 and call(3500) == 78 and timed == [3, 3, 2]
    complete[0] = False  # [8192, 16384): cut short, so used by 9000 alone; 10000 is timed
    assert call(9000) == 78 and call(10000) == 78 and timed == [3, 3, 2, 3, 3]


def test_time_candidates_judges_sustained_blocks(monkeypatch):
    """_time_candidates on a simulated GPU clock (each call of candidate i takes cost[i] ms, the
    first two calls of every candidate run at a boost that favours candidate 0): each
    candidate's warm-up and 2-call estimate in order, then blocks of ~TUNE_BLOCK_MS (2 to 64
    calls) in reverse then forward order; the times are the blocks' means, so the sustained
    fastest (candidate 2) wins where the estimate would have picked candidate 0; a refusing
    candidate is dropped; with no budget left after the estimates, the estimates decide."""
    import cupy

    clock = {"t": 0.0, "calls": {}}
    cost = {0: 1.0, 1: 0.9, 2: 0.8, 3: 5.0}
    calls = []

    def run(i):
        if i == 3:
            return 7  # refuses
        n = clock["calls"][i] = clock["calls"].get(i, 0) + 1
        boost = 0.5 if (i == 0 and n <= 3) else 1.0
        clock["t"] += cost[i] * boost
        calls.append(i)
        return 0

    class Ev:
        def record(self, stream):
            assert stream == "S"
            self.t = clock["t"]

        def synchronize(self):
            pass

    monkeypatch.setattr(cupy.cuda, "Event", Ev)
    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", lambda a, b: b.t - a.t)
    times, complete = gemm_core._time_candidates(run, 4, "S", 60.0)
    assert complete and set(times) == {0, 1, 2} and min(times, key=times.get) == 2
    assert times[2] == pytest.approx(0.8) and times[1] == pytest.approx(0.9)
    assert calls[:9] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # warm-up + 2 each, in order
    blocks = calls[9:]  # reverse order, then forward: candidate 2 first and last
    assert blocks[0] == 2 and blocks[-1] == 2 and set(blocks) == {0, 1, 2}
    assert blocks.count(2) == 2 * math.ceil(gemm_core.TUNE_BLOCK_MS / 0.8)

    clock.update(t=0.0, calls={})
    calls.clear()
    import time

    real, asked = time.monotonic, [0]

    def monotonic():  # the deadline, then 3 checks before the estimates; then it has passed
        asked[0] += 1
        return real() + (0 if asked[0] <= 4 else 1e6)

    monkeypatch.setattr(time, "monotonic", monotonic)
    times, complete = gemm_core._time_candidates(run, 3, "S", 5.0)
    assert not complete  # cut short: not for the table
    assert min(times, key=times.get) == 0  # boosted estimates only: candidate 0 looks fastest
    assert calls == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_cublaslt_addend_and_bias_epilogue(monkeypatch):
    """addend: cublasLt's C is the addend (beta 1) and D is out, on the shape's plain plan;
    with a bias too, a plan of its own whose descriptor has the bias epilogue (EPILOGUE_BIAS,
    the bias in the input dtype, which is what cublasLt takes for a bf16 output) and the
    bias's pointer set on it right before each call. An addend overlapping out is refused (the
    tuning's calls would add onto their own results)."""
    from cuflux.arrays import dtype_info

    lt = _fake_lt(monkeypatch)
    arr, stream = _lt_operands(monkeypatch)
    a, b, out, add, bias = arr(0x1000), arr(0x2000), arr(0x3000), arr(0x4000), arr(0x6010)
    bf = dtype_info("bfloat16")
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, 8, 64, 64, "nk", stream,
                                     addend=add)
    (call,) = [e for e in lt.lib.log if e[0] == "cublasLtMatmul"]
    assert call[8] == gemm_core._ONE_PTR and call[9] == 0x4000 and call[11] == 0x3000
    assert list(lt.plans) == [(0, "bfloat16", "bfloat16", "nk", 8, 64, 64, 256, False)]
    n = len(lt.lib.log)
    assert gemm_core.launch_cublaslt(a, b, bias, out, bf, bf, 8, 64, 64, "nk", stream,
                                     addend=add)
    p = lt.plans[(0, "bfloat16", "bfloat16", "nk", 8, 64, 64, 256, True)]
    sets = [e[2:] for e in lt.lib.log[n:] if e[0] == "cublasLtMatmulDescSetAttribute"
            and e[1] == p.desc]
    assert sets == [(3, 1), (7, 4), (26, 14), (8, 16), (8, 0x6010)]
    assert lt.lib.log[-2][0] == "cublasLtMatmulDescSetAttribute" and lt.lib.log[-2][3] == 0x6010
    call = lt.lib.log[-1]
    assert call[0] == "cublasLtMatmul" and call[1:3] == (p.h, p.desc)
    assert call[8] == gemm_core._ONE_PTR and call[9] == 0x4000 and call[11] == 0x3000
    n = len(lt.lib.log)
    for overlapping in (arr(0x3000), arr(0x3000 + 8 * 64 * 2 - 16), arr(0x3000 - 8 * 64 * 2 + 16)):
        with pytest.raises(ValueError, match="addend overlaps out"):
            gemm_core.launch_cublaslt(a, b, None, out, bf, bf, 8, 64, 64, "nk", stream,
                                      addend=overlapping)
    assert len(lt.lib.log) == n  # refused before anything
    assert gemm_core.launch_cublaslt(a, b, None, out, bf, bf, 8, 64, 64, "nk", stream,
                                     addend=arr(0x3000 + 8 * 64 * 2))  # right after out: fine


def test_real_libcublaslt_takes_the_plans_descriptors():
    """The ctypes signatures against the real libcublasLt (its host-only calls need no GPU):
    every descriptor and preference the plan sets is accepted (a wrong attribute size or
    enum would be CUBLAS_STATUS_INVALID_VALUE), and the heuristic result is the header's 96
    bytes."""
    import ctypes

    try:
        lt = gemm_core._CublasLt()
    except Exception as e:  # noqa: BLE001 (the reason is the skip's)
        pytest.skip(f"libcublasLt not loadable here: {type(e).__name__}: {e}")
    ct = ctypes
    assert ct.sizeof(lt.Heuristic) == 96
    desc = lt._new("cublasLtMatmulDescCreate", gemm_core._COMPUTE_32F, 0)
    trans = ct.c_int32(gemm_core._OP_T)
    assert lt.lib.cublasLtMatmulDescSetAttribute(desc, lt._TRANSA, ct.byref(trans), 4) == 0
    for attr, v in ((lt._EPILOGUE, ct.c_int32(lt._EPILOGUE_BIAS)),  # the addend's bias plan
                    (lt._BIAS_TYPE, ct.c_int32(14)), (lt._BIAS_POINTER, ct.c_void_p(16))):
        assert lt.lib.cublasLtMatmulDescSetAttribute(desc, attr, ct.byref(v),
                                                     ct.sizeof(v)) == 0, attr
    assert lt.version >= 100000  # cublasLtGetVersion: major * 10000 + ...
    lay = lt._new("cublasLtMatrixLayoutCreate", 14, 520, 264, 520)
    pref = lt._new("cublasLtMatmulPreferenceCreate")
    values = [(lt._PREF_MAX_WORKSPACE, ct.c_uint64(gemm_core.WORKSPACE_BYTES))]
    values += [(attr, ct.c_uint32(16)) for attr in lt._PREF_MIN_ALIGNMENT]
    for attr, v in values:
        assert lt.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ct.byref(v),
                                                           ct.sizeof(v)) == 0, attr
    assert lt.lib.cublasLtMatmulPreferenceDestroy(pref) == 0
    assert lt.lib.cublasLtMatrixLayoutDestroy(lay) == 0
    assert lt.lib.cublasLtMatmulDescDestroy(desc) == 0


def test_memo_is_never_asked_for_a_bias_or_a_group_m_that_is_not_an_int(monkeypatch):
    """gemm keys a call only without bias, with an int group_m and with CuPy arrays: True
    equals 1 as a key, but the full path refuses it (check_group_m), so it must never hit a
    bound call; host arrays never reach the memo (nor ask for the current device)."""
    class Nd:  # stands for cupy.ndarray
        pass

    class Memo:
        def owns(self, *arrays):
            return False

        def key(self, arrays, extra):
            asked.append(extra)

        def get(self, key):
            return None

    asked, full = [], []
    monkeypatch.setattr(G, "_ndarray", lambda: Nd)
    monkeypatch.setattr(G, "_memo", Memo)
    monkeypatch.setattr(G, "_gemm", lambda *args: full.append(args[-1]))
    for kw in ({"group_m": True}, {"group_m": 8.0}, {"bias": object()}):
        G.gemm(Nd(), Nd(), out=Nd(), **kw)
    G.gemm(np.zeros((8, 8)), Nd(), out=Nd())
    assert not asked and full == [None] * 4
    G.gemm(Nd(), Nd(), out=Nd(), group_m=4)  # the control: this one is keyed
    assert asked == [(None, "kn", "auto", None, 4)]
