"""GPU tests of cuflux.gemm and of the GEMM hooks (skipped without a GPU).

Every check: fresh random data (seed in the message), outputs poisoned with NaN first (every
element must be written), float64 NumPy reference, relative Frobenius error under a tolerance
that fits the output dtype, plus a bound on the worst element.
"""

import numpy as np
import pytest

from tests.checks import check_close, f64
from tests.mpi import gpu_available, run_ranks, world_sizes, hopper, core_impls, fresh_seed

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
WS = world_sizes()

# relative Frobenius error allowed per output dtype (bf16 rounding is 2^-9 relative)
SHAPES = [(1000, 1000, 1000), (8, 4096, 4096), (4096, 8, 4096), (777, 1536, 2048), (130, 264, 72)]


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


@pytest.fixture(autouse=True)
def _no_tuning(monkeypatch):
    monkeypatch.setenv("CUFLUX_GEMM_TUNE", "0")


def _mapping(got, src, axis):
    """For each output line along `axis`, the index of the source line it equals (-1: none)."""
    g = np.moveaxis(got, axis, 0).reshape(got.shape[axis], -1)
    s = np.moveaxis(src, axis, 0).reshape(src.shape[axis], -1)
    found = []
    for line in g:
        hit = np.nonzero((np.abs(s - line[None, :]) <= 1e-6 * (np.abs(line).max() + 1)).all(1))[0]
        found.append(int(hit[0]) if len(hit) else -1)
    return found


@pytest.mark.parametrize("impl", ["sm90", "sm80"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("which", ["a", "b"])
def test_identity_operand_is_exact(impl, layout, which):
    """A @ I == A and I @ B == B bit for bit (products with 1, sums with 0 are exact); on a
    failure the message says where each output column (or row) came from, which points at a
    swizzle or descriptor error."""
    if impl not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
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


@pytest.mark.parametrize("impl", ["sm90", "sm80"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64(impl, layout, shape):
    if impl not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
    _run(impl, *shape, layout=layout)


@pytest.mark.parametrize("impl", ["sm90", "sm80"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_bias_and_out_dtypes(impl, layout, dtype, out_dtype):
    if impl not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
    _run(impl, 777, 1536, 2048, layout=layout, dtype=dtype, out_dtype=out_dtype, bias=True)


def _hopper_configs():
    import cuflux.ops.gemm as G  # every registered configuration, opt-in ones included

    return list(G.SM90_CONFIGS)


HOPPER_CONFIGS = _hopper_configs()


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


@pytest.mark.parametrize("config", HOPPER_CONFIGS)
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_every_hopper_config_out_dtypes(config, out_dtype):
    if not hopper():
        pytest.skip("the Hopper core needs an sm_90a device")
    _run("sm90", 3000, 1032, 520, layout="nk", out_dtype=out_dtype, config=config, bias=True)


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("shape", [(1, 8192, 1024), (16, 1000, 264), (255, 2056, 520),
                                   (777, 1536, 2048)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_cublas_path_matches_float64(layout, shape, out_dtype):
    """gemm's cuBLAS route (impl="cublas", and "auto" below CUBLAS_BELOW_M rows untuned):
    both layouts, bias, fp32 output."""
    if not gpu_available():
        pytest.skip("needs a GPU")
    _run("cublas", *shape, layout=layout, out_dtype=out_dtype, bias=True)


def test_auto_small_m_runs_what_plan_says(monkeypatch):
    import cuflux.ops.gemm as G

    if not gpu_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("CUFLUX_GEMM_TUNE", "0")
    assert G.plan(16, 2048, 1024) == G.CUBLAS
    if hopper():
        assert G.plan(4096, 2048, 1024) in G.SM90_CONFIGS
    _run("auto", 16, 2048, 1024, layout="nk", bias=True)


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


@pytest.mark.parametrize("impl", ["sm90", "sm80"])
@pytest.mark.parametrize("group_m", [1, 3, 64])
def test_tile_orders(impl, group_m):
    if impl not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
    _run(impl, 3000, 2056, 256, group_m=group_m)


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
    assert G.plan(1536, 2048, 1024, "bfloat16", "kn") == entry["config"]
    entry["config"] = "128x128s6c1"  # a cached choice is used as it is
    (tmp_path / "gemm_tuner.json").write_text(json.dumps(table))
    monkeypatch.setattr(T, "_TUNER_TABLE", None)
    assert T.tuned_config(key, lambda name: (_ for _ in ()).throw(AssertionError(name)),
                          None) == "128x128s6c1"
    _run("auto", 1536, 2048, 1024)


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


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("impl", ["sm90", "sm80"])
def test_hooks_reduce_scatter(W, impl):
    if impl not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
    run_ranks(W, "tests.test_gemm:hooks_reduce_scatter", timeout_s=240, impl=impl, seed=fresh_seed())


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


@pytest.mark.parametrize("impl", ["sm90", "sm80"])
def test_hooks_wait_is_bounded(impl):
    if impl not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
    took, = run_ranks(1, "tests.test_gemm:hooks_timeout", timeout_s=120, impl=impl)
    assert took < 10
