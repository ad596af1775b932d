"""Tests of AllReduce and AllReduceRMSNorm, one file: the GPU tests run the rank bodies beside
them on W ranks (tests.mpi.on_ranks; ranks share the GPU under mpiexec, W from
CUFLUX_TEST_WORLD_SIZES; 8 included on the GPU machine), marked gpu and skipped without a GPU;
the CPU tests (token slices, the golden models, launch plans, the crossover, argument checks with
a fake world and fake arrays, NVRTC compilation, launch arguments) need no GPU.
CUFLUX_TEST_FULL=1 sweeps the whole product of dtypes, hidden sizes and token counts.

Every rank derives every rank's input from one seeded draw (x_r = roll(base, 3r + 1) * (1 +
r / 8): inputs encode their source rank), checks the rows it owns against the float64 NumPy
reference, and all ranks compare hashes of their full outputs, so together the ranks check
every element and prove the outputs bit-identical. Outputs are poisoned (all bits set: NaN)
before each call, so an element nobody wrote fails.
"""
import hashlib
import math
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

import cuflux.arrays as arrays
import cuflux.ops.allreduce as ar
from cuflux import kernels
from cuflux.arrays import dtype_info
from cuflux.errors import CommTimeoutError, CufluxError
from cuflux.ops.allreduce import (AllReduce, AllReduceRMSNorm, choose_algo, plan_launch,
                                  reference_allreduce, reference_allreduce_rmsnorm,
                                  rmsnorm_residual, token_slice)
from tests.checks import poison_owned, poisoned, raises_each, seeded_epoch_calls
from tests.fakes import FakeArray
from tests.kernel_args import DeviceArray, check_args
from tests.mpi import fresh_seed, on_ranks, world_sizes


TOL = {"bfloat16": (2e-2, 2e-2), "float16": (3e-3, 3e-3), "float32": (2e-5, 2e-5)}
HIDDENS = (1024, 4096, 8192, 5128, 1001)  # 5128 = 5120 + 8; 1001: narrow (not a multiple of 8)
WS = world_sizes()


def _full() -> bool:
    return os.environ.get("CUFLUX_TEST_FULL", "") not in ("", "0")


def _rank_x(base, r):
    return np.roll(base, 3 * r + 1, axis=-1) * np.float32(1 + r / 8)


def _draw(seed, T, H):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((T, H), dtype=np.float32)
    res = rng.standard_normal((T, H), dtype=np.float32)
    w = 1 + 0.5 * rng.standard_normal(H, dtype=np.float32)
    return base, res, w


def _q(a, dtype):
    """Round to the dtype's storage (what the GPU sees), as float64 for the reference."""
    return np.asarray(a).astype(dtype_info(dtype).storage)


def _close(got, want, dtype, what):
    rtol, atol = TOL[dtype]
    g = np.asarray(got).astype(np.float64)
    ok = np.abs(g - want) <= atol + rtol * np.abs(want)  # NaN (poison) is never ok
    if not ok.all():
        i = tuple(np.argwhere(~ok)[0])
        raise AssertionError(f"{what}: {(~ok).sum()} of {ok.size} elements off; first {i}: "
                             f"got {g[i]!r}, want {want[i]!r}")


def _hash(cp, a) -> str:
    return hashlib.sha1(cp.asnumpy(a).tobytes()).hexdigest()


def _same_everywhere(world, value, what):
    values = world.allgather(value)
    assert len(set(values)) == 1, f"{what} differs between ranks: {values}"


def _norm_ops(world, max_t, H, dtype, **kw) -> dict:
    """The three outputs' ops, and "one_shot": replicated built algo="one_shot" (an "auto" op's
    stage holds one-shot calls only up to its crossover; this one's holds any)."""
    ops = {o: AllReduceRMSNorm(world, max_t, H, dtype, eps=1e-6, output=o, timeout_s=60, **kw)
           for o in ar.OUTPUTS}
    ops["one_shot"] = AllReduceRMSNorm(world, max_t, H, dtype, eps=1e-6, algo="one_shot",
                                       timeout_s=60, **kw)
    return ops


def _norm_case(cp, world, ops, dtype, T, H, seed):
    """One T for the three outputs (replicated both one-shot and two-shot; ops: _norm_ops)."""
    W, me = world.size, world.rank
    st = dtype_info(dtype).storage
    base, res, w = _draw(seed, T, H)
    a, b = token_slice(T, W, me)
    xs_rows = [_q(_rank_x(base[a:b], r), dtype) for r in range(W)]   # the rows this rank checks
    res_q, w_q = _q(res, dtype), _q(w, dtype)
    x = cp.asarray(_q(_rank_x(base, me), dtype))
    weight = cp.asarray(w_q)
    want = reference_allreduce_rmsnorm(xs_rows, res_q[a:b], w_q, 1e-6, "replicated", W)[0]
    label = f"W={W} rank={me} {dtype} T={T} H={H}"

    outs = {}
    for algo in ("one_shot", "two_shot"):
        residual = cp.asarray(res_q)
        out = poisoned((T, H), dtype)
        got = ops["replicated" if algo == "two_shot" else "one_shot"](x, residual, weight,
                                                                       out=out, algo=algo)
        assert got is out
        ops["replicated"].synchronize()
        _close(cp.asnumpy(out[a:b]), want[0], dtype, f"{label} replicated {algo} out")
        _close(cp.asnumpy(residual[a:b]), want[1], dtype, f"{label} replicated {algo} residual")
        outs[algo] = (_hash(cp, out), _hash(cp, residual))
    assert outs["one_shot"] == outs["two_shot"], f"{label}: one-shot and two-shot differ in bits"
    _same_everywhere(world, outs["two_shot"], f"{label} replicated outputs")

    # TokenWeave: residual rows outside this rank's slice are poison and must stay untouched.
    residual_np = np.full(T * H * st.itemsize, 0xFF, np.uint8).view(st).reshape(T, H)
    residual_np[a:b] = res_q[a:b]
    residual = cp.asarray(residual_np)
    out = ops["sharded_residual"](x, residual, weight, out=poisoned((T, H), dtype))
    ops["sharded_residual"].synchronize()
    _close(cp.asnumpy(out[a:b]), want[0], dtype, f"{label} sharded out")
    got_res = cp.asnumpy(residual)
    _close(got_res[a:b], want[1], dtype, f"{label} sharded residual")
    outside = np.ones(T, bool)
    outside[a:b] = False
    assert got_res[outside].tobytes() == residual_np[outside].tobytes(), \
        f"{label}: sharded_residual wrote residual rows outside its slice"
    _same_everywhere(world, _hash(cp, out), f"{label} sharded_residual out")
    assert _hash(cp, out) == outs["two_shot"][0], f"{label}: sharded out differs from replicated"

    # Megatron SP: out and residual hold this rank's slice only.
    residual = cp.asarray(res_q[a:b])
    out = ops["sequence_parallel"](x, residual, weight, out=poisoned((b - a, H), dtype))
    ops["sequence_parallel"].synchronize()
    _close(cp.asnumpy(out), want[0], dtype, f"{label} sequence_parallel out")
    _close(cp.asnumpy(residual), want[1], dtype, f"{label} sequence_parallel residual")


# ==== GPU tests: each rank body (@on_ranks: body.run(W) runs it on W ranks), then its tests =======
# ---- GPU: the unfused baseline's local RMSNorm kernel --------------------------------------------
@on_ranks
def local_norm(world):
    """rmsnorm_residual (the unfused baseline's kernel) against the reference, odd shapes."""
    import cupy as cp

    for dtype in ("bfloat16", "float32"):
        for T, H in ((1, 1001), (37, 4096), (1000, 8192), (5, 5001)):
            base, res, w = _draw([T, H, 3], T, H)
            x, r, wq = _q(base, dtype), _q(res, dtype), _q(w, dtype)
            residual = cp.asarray(r)
            out = rmsnorm_residual(cp.asarray(x), residual, cp.asarray(wq), eps=1e-5,
                                   out=poisoned((T, H), dtype))
            want = reference_allreduce_rmsnorm([x], r, wq, 1e-5, "replicated", 1)[0]
            _close(cp.asnumpy(out), want[0], dtype, f"local {dtype} {T}x{H} out")
            _close(cp.asnumpy(residual), want[1], dtype, f"local {dtype} {T}x{H} residual")
    return True


@pytest.mark.gpu
def test_local_rmsnorm_kernel():
    local_norm.run(1)


# ---- GPU: argument errors before any launch ------------------------------------------------------
@on_ranks
def bad_input(world):
    """Clear errors before any launch (nothing reaches a peer: every rank raises alike)."""
    import cupy as cp

    with AllReduceRMSNorm(world, 16, 64, "bfloat16") as norm:
        st = norm.dtype.storage
        x = cp.zeros((8, 64), st)
        res, w = cp.zeros((8, 64), st), cp.zeros(64, st)
        cases = [
            (lambda: norm(cp.zeros((8, 64), cp.float32), res, w), TypeError, "x must be bfloat16"),
            (lambda: norm(x, cp.zeros((8, 63), st), w), ValueError, "residual must have shape"),
            (lambda: norm(x, res, cp.zeros(63, st)), ValueError, "weight must have shape"),
            (lambda: norm(cp.zeros((17, 64), st), cp.zeros((17, 64), st), w), ValueError,
             "more than max_tokens=16"),
            (lambda: norm(cp.zeros((64, 8), st).T, res, w), ValueError, "C-contiguous"),
            (lambda: norm(x, res, w, out=cp.zeros((8, 64), cp.float16)), TypeError,
             "out must be bfloat16"),
            (lambda: norm(x, res, w, algo="three_shot"), ValueError, "algo must be one of"),
        ]
        raises_each(cases, "AllReduceRMSNorm")
        out = norm(x, res, w)  # still usable: nothing was launched by the bad calls
        norm.synchronize()
        assert not np.isnan(cp.asnumpy(out).astype(np.float32)).any()
    return True


test_bad_input_raises_before_launch = bad_input.test(
    expect=True, sizes=[w for w in WS if w > 1][:1] or [1])


# ---- GPU: AllReduce sizes and algorithms ---------------------------------------------------------
@on_ranks
def plain_sweep(world, dtypes=("bfloat16", "float16", "float32"), max_blocks=None):
    """AllReduce: odd and round sizes, both algorithms, bit-identical on every rank."""
    import cupy as cp

    W, me = world.size, world.rank
    sizes = [(1,), (max(1, W - 1),), (7,), (1000,), (3, 5, 7), (8192 * 3 + 5,), (1 << 20,),
             (4096, 1024)]
    for dtype in dtypes:
        with AllReduce(world, 4096 * 1024, dtype, timeout_s=60, max_blocks=max_blocks) as ar, \
                AllReduce(world, 4096 * 1024, dtype, "one_shot", timeout_s=60,
                          max_blocks=max_blocks) as ar_one:  # any size one-shot
            for shape in sizes:
                n = int(np.prod(shape))
                base = np.random.default_rng([n, len(dtype)]).standard_normal(n, dtype=np.float32)
                xs = [_q(_rank_x(base, r), dtype).reshape(shape) for r in range(W)]
                want = reference_allreduce(xs)
                x = cp.asarray(xs[me])
                hashes = {}
                for algo in ("one_shot", "two_shot"):
                    out = poisoned(shape, dtype)
                    op = ar if algo == "two_shot" else ar_one
                    assert op(x, out=out, algo=algo) is out
                    op.synchronize()
                    _close(cp.asnumpy(out), want, dtype, f"W={W} {dtype} {shape} {algo}")
                    hashes[algo] = _hash(cp, out)
                assert hashes["one_shot"] == hashes["two_shot"], f"{dtype} {shape}: algos differ"
                _same_everywhere(world, hashes["one_shot"], f"AllReduce {dtype} {shape}")
                y = ar(x)  # owned output, auto algorithm
                ar.synchronize()
                assert y.shape == x.shape and _hash(cp, y) == hashes["one_shot"]
                if W == 1:  # a copy, and none in place (AllReduce.__call__)
                    x_in = x.copy()
                    assert ar(x_in, out=x_in) is x_in
                    ar.synchronize()
                    assert _hash(cp, x_in) == hashes["one_shot"]
    return True


test_allreduce_sizes_algorithms_bit_identical = plain_sweep.test(expect=True, timeout_s=300)


# ---- GPU: CUDA graph capture and replay ----------------------------------------------------------
@on_ranks
def graph_replay(world, replays=3, H=1000):
    """Capture a one-shot fused call, a two-shot fused call and an AllReduce in one CUDA graph;
    replay it with new input contents each time and check every result."""
    import cupy as cp

    W, me = world.size, world.rank
    dtype = "bfloat16"
    T1, T2 = 5, 300
    s = cp.cuda.Stream(non_blocking=True)
    with AllReduceRMSNorm(world, 512, H, dtype, timeout_s=60) as norm, \
            AllReduce(world, 512 * H, dtype, timeout_s=60) as ar, s:
        st = dtype_info(dtype).storage
        x1, x2 = cp.zeros((T1, H), st), cp.zeros((T2, H), st)
        r1, r2 = cp.zeros_like(x1), cp.zeros_like(x2)
        weight = cp.zeros(H, x1.dtype)
        o1, o2, o3 = cp.empty_like(x1), cp.empty_like(x2), cp.empty_like(x2)
        s.synchronize()
        world.barrier()
        s.begin_capture()
        norm(x1, r1, weight, out=o1, stream=s, algo="one_shot")
        norm(x2, r2, weight, out=o2, stream=s, algo="two_shot")
        ar(x2, out=o3, stream=s, algo="two_shot")
        graph = s.end_capture()
        for rep in range(replays):
            b1, q1, w = _draw([rep, 1], T1, H)
            b2, q2, _ = _draw([rep, 2], T2, H)
            for dst, src in ((x1, _rank_x(b1, me)), (x2, _rank_x(b2, me)), (r1, q1), (r2, q2),
                             (weight, w)):
                dst[...] = cp.asarray(_q(src, dtype))
            for o in (o1, o2, o3):
                o.view(cp.uint8)[...] = 0xFF
            graph.launch(stream=s)
            norm.synchronize(stream=s)
            ar.synchronize(stream=s)
            wq = _q(w, dtype)
            for (b, q, o, r, T) in ((b1, q1, o1, r1, T1), (b2, q2, o2, r2, T2)):
                xs = [_q(_rank_x(b, p), dtype) for p in range(W)]
                want = reference_allreduce_rmsnorm(xs, _q(q, dtype), wq, 1e-6, "replicated", W)[me]
                _close(cp.asnumpy(o), want[0], dtype, f"replay {rep} T={T} out")
                _close(cp.asnumpy(r), want[1], dtype, f"replay {rep} T={T} residual")
            xs = [_q(_rank_x(b2, p), dtype) for p in range(W)]
            _close(cp.asnumpy(o3), reference_allreduce(xs), dtype, f"replay {rep} AllReduce")
            world.barrier()  # host writes of the next replay's inputs wait for every rank
    return replays


test_cuda_graph_replay = graph_replay.test(expect=3, timeout_s=300)


# ---- GPU: timeouts -------------------------------------------------------------------------------
@on_ranks
def timeout(world, timeout_s=2.0):
    """The last rank never calls: the others raise CommTimeoutError naming it within the
    timeout plus a second; the failed op refuses to run again; a new op runs correctly."""
    import cupy as cp

    W, me = world.size, world.rank
    late = W - 1
    norm = AllReduceRMSNorm(world, 64, 512, "float32", timeout_s=timeout_s)
    waited = None
    if me != late:
        x, res, w = (cp.ones((64, 512), cp.float32), cp.ones((64, 512), cp.float32),
                     cp.ones(512, cp.float32))
        t0 = time.perf_counter()
        try:
            norm(x, res, w, algo="two_shot")
            norm.synchronize()
            raise AssertionError("no CommTimeoutError although a rank never called")
        except CommTimeoutError as e:
            waited = time.perf_counter() - t0
            assert e.op == "AllReduceRMSNorm" and e.rank == me and e.peer == late, str(e)
            assert waited < timeout_s + 1.5, waited
        try:
            norm(x, res, w)
            raise AssertionError("a failed op ran again")
        except CommTimeoutError:
            pass
    world.barrier()
    norm.close()
    ops = _norm_ops(world, 9, 1001, "float32")  # a new op works after the failed one
    try:
        _norm_case(cp, world, ops, "float32", 9, 1001, seed=[5])
    finally:
        for op in ops.values():
            op.close()
    return {"waited": waited}


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_timeout_names_the_missing_rank(W):
    res = timeout.run(W, timeout_s=300)
    assert all(r["waited"] is not None for r in res[:-1]) and res[-1]["waited"] is None


# ---- GPU: AllReduceRMSNorm in every mode, dtype and shape ----------------------------------------
def _ts_for(W, dtype, H):
    small = sorted({1, max(1, W - 1), 7, 128})
    if _full():
        return small + [1000, 4096]
    if dtype == "bfloat16":
        return small + [1000] + ([4096] if H in (8192, 1001) else [])
    return small + ([1000] if H in (5128, 1001) else [])


@on_ranks
def norm_sweep(world, dtypes=("bfloat16", "float16", "float32")):
    """Every output mode and dtype, T in {1, W-1, 7, 128, 1000, 4096}, hidden in HIDDENS
    (by default the whole product for bfloat16 and the wide, odd-wide and narrow hidden sizes
    for the others; CUFLUX_TEST_FULL=1: everything)."""
    import cupy as cp

    calls = 0
    for dtype in dtypes:
        hiddens = HIDDENS if _full() or dtype == "bfloat16" else (1024, 5128, 1001)
        for H in hiddens:
            Ts = _ts_for(world.size, dtype, H)
            ops = _norm_ops(world, max(Ts), H, dtype)
            try:
                for T in Ts:
                    _norm_case(cp, world, ops, dtype, T, H, seed=[T, H, len(dtype)])
                    calls += 4
            finally:
                for op in ops.values():
                    op.close()
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_rmsnorm_every_mode_dtype_and_shape(W):
    calls = norm_sweep.run(W, timeout_s=600)
    assert all(c == calls[0] and c > 0 for c in calls)


# ---- GPU: the grid a rank with a GPU of its own runs ---------------------------------------------
@on_ranks
def wide_grid(world, T=1000, H=4096):
    """Grids past SHARED_GPU_MAX_BLOCKS, as ranks on GPUs of their own run them (a block per
    SM): max_blocks asks for more than the GPU has, so each rank gets its share of the SMs
    (CommOp._grid_cap). Every output mode, and AllReduce at every size of plain_sweep, exact
    and bit-identical. Returns whether the grid passed SHARED_GPU_MAX_BLOCKS (W <= 4 on 132
    SMs)."""
    import cupy as cp

    ops = _norm_ops(world, T, H, "bfloat16", max_blocks=1 << 20)
    try:
        op = ops["replicated"]
        share = max(1, op.num_sms // op.sharers)
        assert all(o.max_blocks == share for o in ops.values()), \
            f"grid cap {[o.max_blocks for o in ops.values()]}, the SM share is {share}"
        _norm_case(cp, world, ops, "bfloat16", T, H, seed=[T, H, 11])
    finally:
        for o in ops.values():
            o.close()
    plain_sweep(world, dtypes=("bfloat16",), max_blocks=1 << 20)
    return share > ar.SHARED_GPU_MAX_BLOCKS


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_grid_of_a_block_per_sm(W):
    wide = wide_grid.run(W, timeout_s=300)
    assert len(set(wide)) == 1


# ---- GPU: back-to-back calls ---------------------------------------------------------------------
@on_ranks
def back_to_back(world, calls=1000, H=256):
    """`calls` fused calls (one-shot and two-shot alternating, T changing, residual arrays
    distinct), an AllReduce call interleaved every 10th, no host sync; verify every call."""
    import cupy as cp

    W, me = world.size, world.rank
    dtype = "float32"
    _, res_all, w = _draw(7, 64, H)
    weight = cp.asarray(w)
    issued = []
    with AllReduceRMSNorm(world, 64, H, dtype, output="replicated", timeout_s=120) as norm, \
            AllReduce(world, 64 * H, dtype, timeout_s=120) as ar:
        for i in range(calls):
            T = 1 + (i * 37) % 64
            base = np.random.default_rng([i, 1]).standard_normal((T, H), dtype=np.float32)
            residual = cp.asarray(res_all[:T])
            out = norm(cp.asarray(_rank_x(base, me)), residual, weight,
                       algo="one_shot" if i % 2 else "two_shot")
            issued.append((T, base, out, residual, None))
            if i % 10 == 0:
                issued.append((T, base, ar(cp.asarray(_rank_x(base, me))), None, None))
        norm.synchronize()
        ar.synchronize()
    for i, (T, base, out, residual, _) in enumerate(issued):
        xs = [_rank_x(base, r) for r in range(W)]
        if residual is None:
            _close(cp.asnumpy(out), reference_allreduce(xs), dtype, f"call {i} (AllReduce)")
            continue
        want = reference_allreduce_rmsnorm(xs, res_all[:T], w, 1e-6, "replicated", W)[me]
        _close(cp.asnumpy(out), want[0], dtype, f"call {i} out")
        _close(cp.asnumpy(residual), want[1], dtype, f"call {i} residual")
    return len(issued)


@pytest.mark.gpu
@pytest.mark.parametrize("W", WS)
def test_back_to_back_calls(W):
    issued = back_to_back.run(W, timeout_s=600)
    assert issued == [1100] * W


@on_ranks
def memo_replays(world, seed, H=1000, rounds=4):
    """Calls with out= whose arrays repeat (the same addresses, fresh values written in place)
    replay their bound launch (base.CallMemo) from the second repeat on: every such call is
    still exact, outputs poisoned first. Then what a memo must not hide: a view of the same
    memory with fewer tokens runs its own plan; a dtype view of the same memory (float16 over
    float32 storage has another shape, the same pointer) and an out overlapping the residual
    are refused before any launch; a closed op refuses a call it has bound."""
    import cupy as cp

    W, me = world.size, world.rank
    dtype, T = "float32", 37
    with AllReduceRMSNorm(world, 64, H, dtype, output="replicated", timeout_s=60) as norm, \
            AllReduce(world, 64 * H, dtype, timeout_s=60) as plain:
        sets = [{"x": cp.empty((T, H), cp.float32), "res": cp.empty((T, H), cp.float32),
                 "out": cp.empty((T, H), cp.float32), "y": cp.empty((T, H), cp.float32)}
                for _ in range(2)]
        weight = cp.asarray(1 + 0.5 * np.random.default_rng(seed).standard_normal(H)
                            .astype(np.float32))
        w = cp.asnumpy(weight).astype(np.float64)
        calls = 0
        for i in range(rounds * len(sets)):
            v = sets[i % len(sets)]
            n = T - (i // len(sets) == rounds - 1) * 5  # the last round: fewer tokens, views
            base, res, _ = _draw([seed, i], n, H)
            v["x"][:n] = cp.asarray(_rank_x(base, me))
            v["res"][:n] = cp.asarray(res)
            cp.cuda.runtime.memset(v["out"].data.ptr, 0xFF, v["out"].nbytes)
            cp.cuda.runtime.memset(v["y"].data.ptr, 0xFF, v["y"].nbytes)
            x, r, o, y = (v[k][:n] if n < T else v[k] for k in ("x", "res", "out", "y"))
            algo = "one_shot" if W > 1 and i % 2 else None
            assert norm(x, r, weight, out=o, algo=algo) is o
            assert plain(x, out=y, algo=algo) is y
            bound = sum(1 for e in norm._memo.entries.values() if callable(e))
            xs = [_rank_x(base, q) for q in range(W)]
            want = reference_allreduce_rmsnorm(xs, res, w, 1e-6, "replicated", W)[me]
            _close(cp.asnumpy(o), want[0], dtype, f"call {i} out")
            _close(cp.asnumpy(r), want[1], dtype, f"call {i} residual")
            _close(cp.asnumpy(y), reference_allreduce(xs), dtype, f"call {i} plain")
            calls += 1
        # each set's key seen in rounds 0 and 1: bound from round 1 on (the views' own keys
        # are two more, seen once)
        assert bound == len(sets), bound
        v = sets[0]
        raises_each([
            (lambda: norm(v["x"].view(cp.float16), v["res"], weight, out=v["out"]), TypeError,
             "x must be float32"),
            (lambda: norm(v["x"], v["res"], weight, out=v["res"]), ValueError, "overlaps"),
        ], "AllReduceRMSNorm")
        norm.synchronize()
        plain.synchronize()
    with pytest.raises(CufluxError, match="closed"):
        norm(v["x"], v["res"], weight, out=v["out"])
    with pytest.raises(CufluxError, match="closed"):
        plain(v["x"], out=v["y"])
    return calls


test_repeated_calls_replay_their_launch_and_stay_checked = memo_replays.test(
    expect=8, seed=fresh_seed, timeout_s=300)


@on_ranks
def owned_outputs(world, seed, H=1000, calls=8):
    """Calls that leave out to the op (CuPy arrays), their outputs dropped as a loop drops
    them: the op makes each output before its memo key (CallMemo.output hands dropped ones
    back), so the calls are bound and replayed; each is exact (every output it may get
    poisoned first), and an output still held is never handed out again. Both outputs of
    AllReduceRMSNorm that change the rows a rank holds (replicated, sequence_parallel)."""
    import cupy as cp

    W, me = world.size, world.rank
    dtype, T = "float32", 37
    done = 0
    for output in ("replicated", "sequence_parallel"):
        with AllReduceRMSNorm(world, 64, H, dtype, output=output, timeout_s=60) as norm, \
                AllReduce(world, 64 * H, dtype, timeout_s=60) as plain:
            x, res_full = cp.empty((T, H), cp.float32), cp.empty((T, H), cp.float32)
            weight = cp.asarray(1 + 0.5 * np.random.default_rng(seed).standard_normal(H)
                                .astype(np.float32))
            w = cp.asnumpy(weight).astype(np.float64)
            start, stop = ar.token_slice(T, W, me) if output == "sequence_parallel" else (0, T)
            res = res_full[start:stop]
            held = None
            for i in range(calls):
                base, r, _ = _draw([seed, i, int(output == "replicated")], T, H)
                x[...] = cp.asarray(_rank_x(base, me))
                res[...] = cp.asarray(r[start:stop])
                poison_owned(norm._memo, (stop - start, H), cp.float32)
                poison_owned(plain._memo, (T, H), cp.float32)
                out = norm(x, res, weight)
                y = plain(x)
                if i == calls - 1:  # a held output: the next call's is another block
                    held = y
                    y2 = plain(x)
                    assert y2.data.ptr != held.data.ptr
                xs = [_rank_x(base, q) for q in range(W)]
                want = reference_allreduce_rmsnorm(xs, r, w, 1e-6, output, W)[me]
                assert out.shape == (stop - start, H)
                _close(cp.asnumpy(out), want[0], dtype, f"{output} call {i} out")
                _close(cp.asnumpy(res), want[1], dtype, f"{output} call {i} residual")
                _close(cp.asnumpy(y), reference_allreduce(xs), dtype, f"call {i} plain")
                if i == calls - 1:
                    _close(cp.asnumpy(y2), reference_allreduce(xs), dtype, "held call")
                done += 1
                del out, y
            for op in (norm, plain):
                assert any(callable(e) for e in op._memo.entries.values()), op.op
    return done


test_calls_that_leave_out_to_the_op_replay_too = owned_outputs.test(
    expect=16, seed=fresh_seed, timeout_s=300)


@on_ranks
def epochs_past_32_bits(world, H=1000):
    """The device epoch seeded past 2^31 and just below 2^32 (#19 item 6), the flags fresh (0):
    with 32-bit flags a slot still 0 compares as reached once the epoch is past 2^31, so an early
    rank would pass its barrier before a late peer staged its rows and sum stale ones. The last
    rank comes late to every call (tests/checks.py seeded_epoch_calls); every result is checked."""
    import cupy as cp

    W, me = world.size, world.rank
    done = 0
    with AllReduce(world, 128 * H, "float32", timeout_s=60) as ar:
        for seed, i in seeded_epoch_calls(world, ar, 4):  # one- and two-shot
            T = 7 + 29 * i
            base = np.random.default_rng([seed, i]).standard_normal((T, H), dtype=np.float32)
            out = ar(cp.asarray(_rank_x(base, me)), algo=("one_shot", "two_shot")[i % 2])
            _close(cp.asnumpy(out), reference_allreduce([_rank_x(base, r) for r in range(W)]),
                   "float32", f"rank {me} epoch {seed + i + 1}")
            done += 1
    return done


test_epochs_past_32_bits_never_pass_an_unwritten_flag = epochs_past_32_bits.test(
    expect=8, sizes=[w for w in WS if w > 1], timeout_s=300)


@on_ranks
def halves(world, seed):
    """A two-shot call in its halves (AllReduce.reduce_scatter, all_gather: what
    AllReduceAcrossNodes runs around its rail). Each rank's share is plain_share of the float64
    reference sum; each rank rewrites its share in place on the stream between the halves
    (flips low bits by rank: the rail's all-reduce stands there), and all_gather gives every rank
    exactly every rewritten share. Sizes: under a row, odd, several rows, uneven shares, shares
    empty past n; float32 and bfloat16; out poisoned; a whole call and an all_gather of the
    wrong size between the halves are refused (locally: the call goes on)."""
    import cupy as cp

    W, me = world.size, world.rank
    done = 0
    # A stream of the test's own: everything of a call is queued on it (inputs, poison and all:
    # it does not wait for the legacy default stream).
    s = cp.cuda.Stream(non_blocking=True)
    for dtype in ("float32", "bfloat16"):
        d = dtype_info(dtype)
        bits = np.uint32 if d.itemsize == 4 else np.uint16
        cols = ar._plain_cols(d)

        def in_halves(op, xs, flip, between=None):
            """Queue one call in halves on s, this rank's share rewritten (bits ^ flip) between
            them; returns what check() needs."""
            n = xs[me].size
            lo, hi = ar.plain_share(n, dtype, W, me)
            with s:
                x = cp.asarray(xs[me])
                share = op.reduce_scatter(x, s)
                assert share.size == hi - lo, (n, share.size, lo, hi)
                summed = share.copy()  # in stream order: after the first half
                share.view(bits)[...] ^= bits(flip)  # in place, before the second half
                mine = share.copy()
                if between is not None:
                    between(op, x, n)
                out = poisoned((n,), dtype)
                op.all_gather(out, s)
            return xs, (lo, hi), summed, mine, out

        def check(runs, label):
            """Each run's share against the float64 sum; its out, bit for bit, against every
            rank's rewritten share."""
            s.synchronize()
            everyone = world.allgather([cp.asnumpy(mine) for _, _, _, mine, _ in runs])
            for i, (xs, (lo, hi), summed, _, out) in enumerate(runs):
                _close(cp.asnumpy(summed), reference_allreduce(xs)[lo:hi], dtype,
                       f"{label(i)}: share")
                every = np.concatenate([everyone[r][i] for r in range(W)])
                assert np.array_equal(cp.asnumpy(out).view(bits), every.view(bits)), label(i)

        def refused(op, x, n):
            with pytest.raises(CufluxError, match="between its halves"):
                op(x)
            with pytest.raises(ValueError, match="must follow reduce_scatter"):
                op.all_gather(poisoned((n + 1,), dtype), s)

        def draw(key, n):
            base = np.random.default_rng(key).standard_normal(n, dtype=np.float32)
            return [_q(_rank_x(base, r), dtype) for r in range(W)]

        with AllReduce(world, 7 * cols + 3, dtype, timeout_s=60) as op:
            for n in (1, 5, cols - 1, cols + 1, 3 * cols, 7 * cols + 3):
                check([in_halves(op, draw([seed, n], n), me + 1, refused)],
                      lambda i: f"W={W} rank={me} {dtype} n={n}")
                done += 1
        # Calls in halves back to back, no host sync between them: a first half's tmp write
        # must wait for the slowest peer's second half of the call before.
        with AllReduce(world, 3 * cols + 5, dtype, timeout_s=60) as op:
            runs = [in_halves(op, draw([seed, i, 9], 3 * cols + 5 - 7 * (i % 3)), i + me + 1)
                    for i in range(40)]
            check(runs, lambda i: f"W={W} rank={me} {dtype} back-to-back call {i}")
            done += 1
    return done


test_a_call_in_halves_rewritten_between_them = halves.test(
    expect=14, sizes=[w for w in WS if w > 1], timeout_s=300, seed=fresh_seed)


# ==== CPU tests (no GPU needed) ===================================================================
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


# ---- a call in halves (AllReduce.reduce_scatter / all_gather) --------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("W", [2, 3, 4, 8])
def test_plain_shares_cover_every_element_once_on_whole_rows(dtype, W):
    cols = ar._plain_cols(dtype_info(dtype))
    for n in (1, 5, cols - 1, cols, cols + 1, 3 * cols, 7 * cols + 3, 100 * cols - 1):
        shares = [ar.plain_share(n, dtype, W, r) for r in range(W)]
        assert shares[0][0] == 0 and shares[-1][1] == n, (n, shares)
        for (a0, b0), (a1, b1) in zip(shares, shares[1:]):
            assert b0 == a1 and a1 <= b1  # contiguous, in rank order
        rows = [token_slice(-(-n // cols), W, r) for r in range(W)]
        # a share is the rows the two-shot kernel's rank reduces: whole rows, cut at n (the
        # last row short; past n, empty)
        assert all(a == min(n, r0 * cols) and b == min(n, r1 * cols)
                   for (a, b), (r0, r1) in zip(shares, rows)), (n, shares, rows)


def test_the_halves_plan_as_a_plain_two_shot_call():
    for n in (7, 5000, 3 * 8192 + 1):
        whole = plan_launch("plain", "bfloat16", n, None, 4, "two_shot", True, 16, 132)
        for mode, code in (("reduce_scatter", 4), ("all_gather", 5)):
            half = plan_launch(mode, "bfloat16", n, None, 4, "two_shot", True, 16, 132)
            assert (half.grid, half.block, half.rows, half.cols, half.vec_bytes,
                    half.shared_mem) == (whole.grid, whole.block, whole.rows, whole.cols,
                                         whole.vec_bytes, whole.shared_mem)
            assert half.kernel == whole.kernel.replace(", 0, true>", f", {code}, true>")
            assert half.kernel in ar.FAMILY.names


def test_halves_are_refused_before_any_launch(monkeypatch):
    for mod in (ar, arrays):
        monkeypatch.setattr(mod, "as_cupy", lambda a, name, op: a)
    op = object.__new__(AllReduce)
    op.op, op._closed, op._half = "AllReduce", False, None
    op.dtype, op.max_elems = dtype_info("float32"), 1000
    monkeypatch.setattr(op, "_check_open", lambda: None, raising=False)
    s1, s2 = SimpleNamespace(ptr=1), SimpleNamespace(ptr=2)
    for W, algo in ((1, "auto"), (4, "one_shot")):
        op.world, op.algo, op.two_shot_ok = SimpleNamespace(size=W, rank=0, device=0), algo, False
        with pytest.raises(ValueError, match="reduce_scatter needs W > 1"):
            op.reduce_scatter(A((100,), "float32"), s1)
    op.two_shot_ok = True
    for x, err, text in ((A((1001,), "float32"), ValueError, "1 to max_elems=1000"),
                         (A((0,), "float32"), ValueError, "1 to max_elems=1000"),
                         (A((100,), "bfloat16"), TypeError, "x must be float32"),
                         (A((100,), "float32", device=1), ValueError, "x is on device 1")):
        with pytest.raises(err, match=text):
            op.reduce_scatter(x, s1)
    with pytest.raises(ValueError, match="all_gather must follow reduce_scatter"):
        op.all_gather(A((100,), "float32"), s1)
    op._half = (100, s1.ptr)
    with pytest.raises(ValueError, match=r"out of its x.size \(100\), got 99"):
        op.all_gather(A((99,), "float32"), s1)
    with pytest.raises(ValueError, match="on reduce_scatter's stream"):
        op.all_gather(A((100,), "float32"), s2)
    assert op._half == (100, s1.ptr)  # refused before anything changed
    with pytest.raises(CufluxError, match="between its halves"):
        op.reduce_scatter(A((100,), "float32"), s1)


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
def test_default_grid_is_every_sm_on_a_gpu_of_its_own():
    assert ar.default_max_blocks(132, 1) == 132
    assert ar.default_max_blocks(132, 2) == ar.SHARED_GPU_MAX_BLOCKS == 32
    assert ar.default_max_blocks(78, 8) == 32  # CommOp._grid_cap then splits the SMs: 9 each


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("mode,algo", [("plain", "auto"), ("plain", "two_shot"),
                                       ("replicated", "auto"), ("replicated", "one_shot"),
                                       ("sharded_residual", "auto"),
                                       ("sequence_parallel", "two_shot")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_stage_slot_holds_every_call_it_may_run(W, mode, algo, dtype):
    """A sender's stage slot (kernels_cu/allreduce.cu) takes every one-shot call the op may run
    whole, and every rank's two-shot slice of every call up to max_elems; one_shot_elems is
    exactly where choose_algo stops sending auto calls one-shot."""
    d = dtype_info(dtype)
    flat = mode == "plain"
    for max_elems, hidden in ((1, 8), (1000, 8), (8192 * 5 + 3, 1000), (1 << 22, 4096),
                              (1 << 24, 8192)):
        hidden = None if flat else hidden
        one, slot = ar.stage_slot(mode, algo, W, max_elems, hidden, d)
        assert slot * d.itemsize % 128 == 0 and slot >= one
        if algo == "one_shot":
            assert one == max_elems
        elif algo == "two_shot" or mode in ("sharded_residual", "sequence_parallel"):
            assert one == 0
        else:
            assert choose_algo(one * d.itemsize, W, mode) == "one_shot" or one == 0
            assert one == max_elems or choose_algo((one + 1) * d.itemsize, W, mode) == "two_shot"
        if algo == "one_shot":
            continue
        cols = ar._plain_cols(d) if flat else hidden
        for n in sorted({1, max_elems // 3 + 1, max_elems - 1, max_elems} - {0}):
            rows = -(-n // cols)
            for q in range(W):
                a, b = token_slice(rows, W, q)
                assert max(0, min(b * cols, n) - a * cols) <= slot, (n, q, slot)
    assert ar.stage_slot("plain", "auto", 1, 1000, None, "bfloat16") == (0, 0)


@pytest.mark.parametrize("W", [2, 3, 5, 8])
@pytest.mark.parametrize("two_shot", [False, True])
def test_pushed_rows_land_where_their_reducer_reads_them(W, two_shot):
    """The push protocol's index arithmetic, restated from kernels_cu/allreduce.cu and run on
    the host: sender p's block b stores each element of the rows q's block b reduces at slot
    (p - q - 1) mod W of q's stage, at (element - shift) with shift = the first element of q's
    slice (two-shot) or 0; receiver q's block b reads it back from the same place. Every
    element lands inside the slot stage_slot sizes, exactly once, and is read by the block that
    reduces its row."""
    d = dtype_info("float32")
    for num_elems, cols, grid in ((1, 4, 1), (37, 4, 3), (1000, 8, 7), (4096, 64, 5),
                                  (999, 10, 16)):
        mode, hidden = "replicated", cols
        _, slot_elems = ar.stage_slot(mode, "two_shot" if two_shot else "one_shot", W,
                                      num_elems + cols, hidden, d)
        rows = -(-num_elems // cols)
        slices = [token_slice(rows, W, q) if two_shot else (0, rows) for q in range(W)]
        stage = {}  # (receiver, slot, index) -> (sender, element)
        for p in range(W):
            for i in range(1, W):
                q = (p + i) % W
                start, stop = slices[q]
                j = (p - q - 1 + W) % W
                for b in range(grid):
                    for t in range(start + b, stop, grid):
                        for off in range(t * cols, min((t + 1) * cols, num_elems)):
                            idx = off - start * cols
                            assert 0 <= idx < slot_elems, (p, q, off, idx, slot_elems)
                            assert (q, j, idx) not in stage, "two stores to one place"
                            stage[(q, j, idx)] = (p, off, b)
        reads = 0
        for q in range(W):
            start, stop = slices[q]
            for b in range(grid):
                for t in range(start + b, stop, grid):
                    for off in range(t * cols, min((t + 1) * cols, num_elems)):
                        for p in range(W):
                            if p == q:
                                continue
                            got = stage[(q, (p - q - 1 + W) % W, off - start * cols)]
                            assert got == (p, off, b), (q, p, off, got)
                            reads += 1
        assert reads == len(stage)  # every pushed element is read, once


@pytest.mark.parametrize("W", [1, 2, 3, 8])
@pytest.mark.parametrize("two_shot", [False, True])
def test_start_chunks_cover_every_row_of_every_block_once(W, two_shot):
    """The pipelined START (kernels_cu/allreduce.cu, kChunkSlots / kRowsPerChunk restated):
    chunk c of a block is iterations [c * ipc, (c + 1) * ipc) of its rows in a slice; every row
    of every slice falls in exactly one chunk below `chunks` <= 8, the same on every rank."""
    slots, per_chunk = 8, 4
    for rows in (1, 2, 7, 33, 100, 1000, 8192):
        for G in (1, 3, 32, 132):
            slice_rows = -(-rows // W) if two_shot else rows
            n_iter = -(-slice_rows // G)
            ipc = max(per_chunk, -(-n_iter // slots))
            chunks = max(1, -(-n_iter // ipc))
            assert chunks <= slots and chunks * ipc >= n_iter
            assert n_iter == 0 or (chunks - 1) * ipc < n_iter  # no empty trailing chunk
            for q in range(W):
                start, stop = token_slice(rows, W, q) if two_shot else (0, rows)
                seen = []
                for b in range(G):
                    for c in range(chunks):
                        for i in range(c * ipc, (c + 1) * ipc):
                            t = start + b + i * G
                            if t < stop:
                                seen.append(t)
                assert sorted(seen) == list(range(start, stop)), (rows, G, q)


def test_a_one_shot_override_past_the_stage_is_refused():
    op = object.__new__(AllReduce)
    op.op, op.world = "AllReduce", SimpleNamespace(size=4, rank=0)
    op.mode, op.algo, op.dtype, op._plans, op.two_shot_ok = "plain", "auto", \
        dtype_info("bfloat16"), {}, True
    op.one_shot_elems, _ = ar.stage_slot("plain", "auto", 4, 1 << 24, None, op.dtype)
    assert 0 < op.one_shot_elems < 1 << 24
    with pytest.raises(ValueError, match="does not fit this op's stage"):
        op._plan(op.one_shot_elems + 1, None, "one_shot", True)


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
            assert p.shared_mem >= 4 * H + 16 * W
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
        assert p.block == 1024 and p.shared_mem == 16 * W


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
    ("replicated", A((8, 32)), A((8, 32)), A((64,)), None, None, ValueError,
     r"x must be \[tokens, hidden=64\]"),
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
    for mod in (ar, arrays):
        monkeypatch.setattr(mod, "as_cupy", lambda a, name, op: a)
    with pytest.raises(exc, match=text) as e:
        ar.check_norm_call(_fake_norm(output), x, res, w, out, algo)
    assert "AllReduceRMSNorm" in str(e.value)


def test_norm_call_accepts_good_shapes(monkeypatch):
    for mod in (ar, arrays):
        monkeypatch.setattr(mod, "as_cupy", lambda a, name, op: a)
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
    """A plan's launch is prepared once (kernels.prepare) with every argument of the kernel's
    signature, the call's four pointers first as placeholders; a call passes x, out,
    residual and weight (null: none) and nothing else."""
    prepared, calls = [], []

    def prepare(fn, grid, block, args, varying, **kw):
        prepared.append((fn, args, varying))
        return lambda stream, *ptrs: calls.append((fn, stream, ptrs))

    monkeypatch.setattr(ar, "_kernel", lambda module, plan: plan.kernel)
    monkeypatch.setattr(ar.kernels, "prepare", prepare)
    op = object.__new__(AllReduceRMSNorm)
    op.op, op.world = "AllReduceRMSNorm", SimpleNamespace(size=W, rank=W - 1, device=0)
    op.mode, op.dtype, op.module = "replicated", dtype_info("bfloat16"), None
    op._offsets, op._stage_parity_bytes, op.flag_stride = {"stage": 0, "start": 4096,
                                                           "mid": 8192}, 1 << 20, 32
    op._slot_bytes = 1 << 19
    op.buf, op.state = SimpleNamespace(ptrs_dev=DeviceArray()), DeviceArray()
    op.err_args = (np.uint64(1 << 40), DeviceArray(), np.uint64(10**9), np.uint32(4))
    op._eps = np.float32(1e-6)
    op._static_args()
    for H in (4096, 1001, 8192 * 4):
        plan = plan_launch("replicated", "bfloat16", T * H, H, W, "two_shot", True, 16, 132)
        op._launch(op._entry(plan), "stream", 0x1000, 0x2000, 0x3000, 0x4000)
        name = plan.kernel.split("<")[0]
        expected = ("allreduce_rmsnorm" if W > 1 else
                    "rmsnorm_local_reg" if H <= 8192 else "rmsnorm_local")
        assert prepared[-1][0] == plan.kernel and name == expected and prepared[-1][2] == 4
        _check_args(name, prepared[-1][1])
        assert calls[-1] == (plan.kernel, "stream", (0x1000, 0x2000, 0x3000, 0x4000))
    if W > 1:
        plan = plan_launch("plain", "float32", 1000, None, W, "one_shot", True, 16, 132)
        op._launch(op._entry(plan), "stream", 0x1000, 0x2000)
        _check_args("allreduce_rmsnorm", prepared[-1][1])
        assert calls[-1][2] == (0x1000, 0x2000, 0, 0)
