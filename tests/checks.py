"""Checks shared by the GPU tests: poisoned outputs, the GEMM family's (plain GEMM,
AllGatherGemm, GemmReduceScatter) tolerance table and float64 comparison, bad calls that must
each raise, and the device-epoch ops' seeded epochs with a late rank."""
import time

import numpy as np

# Relative Frobenius error allowed against the float64 reference, by output dtype; the worst
# single element may be off by 10x that, in units of the reference's rms.
GEMM_TOL = {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-4}


def poison(*arrays) -> None:
    """Every byte of each array 0xFF: NaN in every float dtype cuflux has (fp8 e4m3 included),
    so an element an op fails to write shows, and -1 in integer ones."""
    for a in arrays:
        a.view(np.uint8)[...] = 0xFF


def poisoned(shape, dtype, xp=None):
    """A new poisoned array (CuPy unless xp says otherwise); dtype is a cuflux dtype name
    ("bfloat16", "float8_e4m3fn", ...) or a storage dtype."""
    if xp is None:
        import cupy as xp
    if isinstance(dtype, str):
        from cuflux.arrays import dtype_info

        dtype = dtype_info(dtype).storage
    a = xp.empty(shape, dtype=dtype)
    poison(a)
    return a


def poison_owned(memo, shape, dtype) -> None:
    """Poison every output an op may hand out next for a call that leaves out to it: those
    its memo keeps for reuse (base.CallMemo.output) and a block of this size left free in
    the current stream's pool arena (a new output comes from there). Each call's fresh data
    also tells a block still holding an earlier call's result."""
    import cupy

    for kept in memo.outputs.values():
        for arr, _ in kept:
            poison(arr)
    block = poisoned(shape, dtype)
    cupy.cuda.get_current_stream().synchronize()
    del block


def f64(x) -> np.ndarray:
    """A device array on the host, in float64."""
    import cupy

    return cupy.asnumpy(x).astype(np.float64)


def check_close(got, ref, out_dtype, what) -> float:
    """Every element written (poisoned outputs are NaN), relative error and worst element under
    the dtype's tolerance; returns the relative error."""
    g = f64(got)
    assert np.isfinite(g).all(), f"{what}: {int((~np.isfinite(g)).sum())} elements not written"
    rms = np.sqrt(np.mean(ref ** 2)) + 1e-30
    rel = np.linalg.norm(g - ref) / (np.linalg.norm(ref) + 1e-30)
    worst = np.abs(g - ref).max() / rms
    tol = GEMM_TOL[out_dtype]
    assert rel < tol, f"{what}: relative error {rel:.3g} >= {tol}"
    assert worst < 10 * tol, f"{what}: worst element off by {worst:.3g} x rms"
    return float(rel)


# Device epochs seeded past 2^31 (where an unwritten 32-bit flag, 0, compares as reached) and
# just below 2^32 (the next calls cross it).
EPOCH_SEEDS = ((1 << 31) + 5, (1 << 32) - 2)


def seeded_epoch_calls(world, op, calls: int, late_s: float = 0.2):
    """For each seed of EPOCH_SEEDS: drain the op on every rank, set its device epoch (and the
    host's count) to the seed, then yield (seed, i) for `calls` calls, the last rank sleeping
    `late_s` before each so that a rank passing a flag it should wait for reads stale data.
    After a seed's calls, checks the device epoch advanced by exactly `calls`."""
    for seed in EPOCH_SEEDS:
        op.synchronize()
        world.barrier()  # nothing of the op in flight anywhere before the epoch moves
        op.state[0] = seed
        op.epoch = seed  # All2AllHeads' host count picks the parity of views
        for i in range(calls):
            if world.rank == world.size - 1:
                time.sleep(late_s)
            yield seed, i
        op.synchronize()
        assert int(op.state[0]) == seed + calls, (int(op.state[0]), seed + calls)


def raises_each(cases, op: str) -> None:
    """Each (fn, exc, text) of `cases`: fn() raises exc, whose message holds text and the op's
    name."""
    for fn, exc, text in cases:
        try:
            fn()
        except exc as e:
            assert text in str(e) and op in str(e), str(e)
        else:
            raise AssertionError(f"no {exc.__name__} for {text!r}")


def rail_kind_as_expected(world, rail) -> None:
    """make_rail("auto") falls back to the host rail quietly: on distinct GPUs (no rank of the
    World shares this one, as its topology counts them) it must have picked NCCL, or a
    two-GPU run would pass without NCCL ever running; ranks sharing a GPU get the host rail
    (NCCL refuses two ranks on one GPU)."""
    from cupy.cuda import nccl

    from cuflux.world import ranks_on_my_gpu

    if ranks_on_my_gpu(world) > 1:
        assert rail.kind == "host", rail.kind
        return
    assert nccl.available, "CuPy finds no NCCL runtime (the nccl13 / nccl12 extra)"
    assert rail.kind == "nccl", f"ranks on distinct GPUs got the {rail.kind} rail"


def scratch_let_go(*ops) -> None:
    """Each closed cross-node op holds none of its staging (ops.across._AcrossNodes._let_go):
    every name it lists is None, and it lists some."""
    for op in ops:
        assert op.closed and op._scratch, (type(op).__name__, op._scratch)
        held = [n for n in op._scratch if getattr(op, n, None) is not None]
        assert not held, (type(op).__name__, "kept after close()", held)
