"""CPU tests of GemmReduceScatter (no GPU needed): the kernels compile for sm_80 and sm_90a and
use the instructions the protocol relies on; the tile order (every tile once, own tiles last
in L2 groups, no two ranks writing into one owner at a step, no cycle of waits: a simulation of
the protocol); buffer layout; the float64 golden model; argument checks (fake world and fake
arrays); launch arguments against the kernel signatures."""
import re
from types import SimpleNamespace

import numpy as np
import pytest

import cuflux.ops.gemm_rs as R
from cuflux import kernels
from cuflux.arrays import dtype_info
from cuflux.errors import CufluxError
from cuflux import gemm_core as G
from cuflux.ops.gemm_rs import (GemmReduceScatter, make_layout, own_tile_rows, reference_gemm_rs,
                                tile_order)
from cuflux.topology import PeerLink, Topology
from cuflux.world import World
from tests.fakes import FakeArray
from tests.kernel_args import DeviceArray, check_args
from tests.kernel_args import names as kernel_names


# ---- compilation --------------------------------------------------------------------------------
def test_family_registered():
    fam = kernels.families()["gemm_rs.cu"]  # registered when cuflux.ops.gemm_rs is imported
    assert fam == R.FAMILY
    assert fam.min_arch == 80 and len(set(fam.names)) == len(fam.names) == 32
    for dt in ("__nv_bfloat16", "__half"):
        for tr in (False, True):
            for at in (False, True):
                assert R.sm80_kernel(dt, tr, at) in fam.names
                for c in R.SM90_RS_CONFIGS:
                    assert R.sm90_kernel(dt, c, tr, at) in fam.names
            for o in (dt, "float"):
                assert R.copy_kernel(dt, o, tr) in fam.names
    assert R.SM90_RS_DEFAULT in R.SM90_RS_CONFIGS
    for c in R.SM90_RS_CONFIGS:  # the fused kernels instantiate 4 stages, 1-CTA clusters
        cfg = G.SM90_CONFIGS[c]
        assert (cfg.stages, cfg.cluster, cfg.tma_store) == (4, 1, False)
        assert min(cfg.bm, cfg.bn) >= R.MIN_TILE


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernels_compile(arch):
    cubin, lowered = kernels.compile_source(R.FAMILY.source, R.FAMILY.names, arch)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(R.FAMILY.names)


def _ptx(arch: str, names) -> str:
    return kernels.compile_ptx("gemm_rs.cu", names, arch)


def test_hopper_kernels_use_the_protocol_instructions():
    det = _ptx("sm_90a", [R.sm90_kernel("__nv_bfloat16", R.SM90_RS_DEFAULT, False, False)])
    for instr in ("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                  "cp.async.bulk.tensor.2d", "st.relaxed.sys.global.u32",
                  "ld.acquire.sys.global.u32", "fence.acq_rel.sys", "barrier.sync 6, 256",
                  "%globaltimer", "nanosleep"):
        assert instr in det, instr
    # the tile flags are relaxed stores made release stores by the one fence before them
    assert det.index("fence.acq_rel.sys") < det.index("st.relaxed.sys.global.u32")
    assert not re.search(r"\sred\.", det)  # deterministic: plain stores only
    atomic = _ptx("sm_90a", [R.sm90_kernel("__nv_bfloat16", "128x256s4c1", True, True),
                             R.copy_kernel("__half", "float", True)])
    for instr in ("red.relaxed.sys.global.add.noftz.bf16x2", "red.relaxed.sys.global.add.v2.f32",
                  "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
                  "fence.acq_rel.sys", "st.relaxed.sys.global.u32"):
        assert instr in atomic, instr


def test_portable_kernels_below_sm90():
    ptx = _ptx("sm_80", [R.sm80_kernel("__nv_bfloat16", True, True),
                         R.sm90_kernel("__half", R.SM90_RS_DEFAULT, False, False),
                         R.copy_kernel("__half", "__half", True)])
    assert "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx  # Hopper kernels: empty
    for instr in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "atom.sys.cas.b32",
                  "red.relaxed.sys.global.add.noftz.f16x2", "fence.acq_rel.sys",
                  "st.relaxed.sys.global.u32"):
        assert instr in ptx, instr


# ---- tile order ---------------------------------------------------------------------------------
def _owners(tm, M, W, bm):
    R_ = M // W
    return range(tm * bm // R_, (min(M, tm * bm + bm) - 1) // R_ + 1)


CASES = [  # (M, N, W, bm, bn): aligned and unaligned rows per rank, remainders, one tile row
    (4096, 12288, 8, 256, 128), (4096, 12288, 8, 128, 256), (8192, 8192, 4, 256, 128),
    (2048, 4160, 2, 128, 128), (8, 1024, 8, 256, 128), (512, 4160, 8, 128, 256),
    (512, 1032, 8, 256, 128), (296, 1032, 8, 128, 128), (3, 264, 3, 128, 128),
    (1000, 136, 1, 256, 128), (4096, 1024, 1, 128, 256), (84, 8, 7, 128, 128),
]


@pytest.mark.parametrize("M,N,W,bm,bn", CASES)
@pytest.mark.parametrize("group_m", [1, 3, 8])
def test_every_tile_once_own_tiles_last_grouped(M, N, W, bm, bn, group_m):
    """Every tile once; own tiles last, in groups of group_m tile rows walked column by column
    (the plain GEMM's L2-friendly order), so each tile row is walked in increasing tn: the
    order the no-deadlock simulation below relies on."""
    tiles_m, tiles_n = -(-M // bm), -(-N // bn)
    everything = sorted((m, n) for m in range(tiles_m) for n in range(tiles_n))
    for rank in range(W):
        order = tile_order(M, N, W, rank, bm, bn, group_m)
        assert sorted(order) == everything
        own = [t for t in order if rank in _owners(t[0], M, W, bm)]
        assert order[len(order) - len(own):] == own, "own tiles must come last"
        lo, hi = own_tile_rows(M, W, rank, bm)
        assert {t[0] for t in own} == set(range(lo, hi + 1))
        want = [(lo + first + i, tn) for first in range(0, hi - lo + 1, group_m)
                for tn in range(tiles_n) for i in range(min(group_m, hi - lo + 1 - first))]
        assert own == want


@pytest.mark.parametrize("M,N,W,bm,bn", [c for c in CASES if (c[0] // c[2]) % c[3] == 0])
def test_no_two_ranks_write_into_one_owner_at_a_step(M, N, W, bm, bn):
    """Rows per rank a multiple of the tile: at every slot the W ranks' tiles belong to W
    different owners; rank r starts with owner r+1 and ends with itself."""
    orders = [tile_order(M, N, W, r, bm, bn) for r in range(W)]
    for slot in range(len(orders[0])):
        owners = [list(_owners(orders[r][slot][0], M, W, bm)) for r in range(W)]
        assert all(len(o) == 1 for o in owners)
        assert len({o[0] for o in owners}) == W, f"slot {slot}: owners {owners}"
    for r in range(W):
        assert list(_owners(orders[r][0][0], M, W, bm)) == [(r + 1) % W]
        assert list(_owners(orders[r][-1][0], M, W, bm)) == [r]


def _simulate(M, N, W, bm, bn, grid, group_m, order_fn=tile_order):
    """Run the protocol's waits on W ranks of `grid` persistent CTAs each, one step at a time
    (a CTA finishes its tile's phase A, then blocks until every peer delivered that tile if it
    holds its rows). Returns True if every CTA of every rank finishes."""
    orders = [order_fn(M, N, W, r, bm, bn, group_m) for r in range(W)]
    seqs = [[[orders[r][s] for s in range(c, len(orders[r]), grid)] for c in range(grid)]
            for r in range(W)]
    pos = [[0] * grid for _ in range(W)]       # next tile index of each CTA
    sent = [[False] * grid for _ in range(W)]  # phase A of the current tile done
    delivered = [set() for _ in range(W)]      # tiles rank r has released to every owner
    progress = True
    while progress:
        progress = False
        for r in range(W):
            for c in range(grid):
                if pos[r][c] == len(seqs[r][c]):
                    continue
                t = seqs[r][c][pos[r][c]]
                if not sent[r][c]:
                    sent[r][c] = True
                    delivered[r].add(t)
                    progress = True
                if r in _owners(t[0], M, W, bm) and not all(
                        t in delivered[p] for p in range(W) if p != r):
                    continue  # waiting for a peer
                pos[r][c] += 1
                sent[r][c] = False
                progress = True
    return all(pos[r][c] == len(seqs[r][c]) for r in range(W) for c in range(grid))


@pytest.mark.parametrize("M,N,W,bm,bn", CASES + [(24, 512, 8, 128, 128), (64, 2048, 4, 128, 256),
                                                 (192, 384, 3, 256, 128)])
@pytest.mark.parametrize("grid", [1, 2, 5, 132])
def test_protocol_never_deadlocks(M, N, W, bm, bn, grid):
    assert _simulate(M, N, W, bm, bn, grid, 8)
    assert _simulate(M, N, W, bm, bn, grid, 1)


def test_a_rank_order_without_own_tiles_last_would_deadlock():
    """The simulation can fail: own tiles first (Flux's literal order) with one CTA per rank."""
    def own_first(M, N, W, rank, bm, bn, group_m):
        order = tile_order(M, N, W, rank, bm, bn, group_m)
        own = [t for t in order if rank in _owners(t[0], M, W, bm)]
        return own + [t for t in order if t not in own]

    assert not _simulate(1024, 256, 4, 128, 128, 1, 8, order_fn=own_first)
    assert _simulate(1024, 256, 4, 128, 128, 1, 8)


# ---- buffers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("W", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("reduce", R.REDUCE_MODES)
def test_layout(W, reduce):
    max_m, n = 1000 * W + 7, 4160
    lay = make_layout(W, max_m, n, "bfloat16", reduce)
    data, flags = lay.regions["data"], lay.regions["flags"]
    rows = max_m // W
    assert data.shape == ((2, W, rows, n) if reduce == "deterministic" else (2, rows, n))
    assert data.dtype == dtype_info("bfloat16").storage and data.offset == 0
    assert flags.offset % 128 == 0 and flags.dtype == np.uint32
    stride = flags.shape[1]
    assert stride >= W and stride % 32 == 0  # one (or more) whole 128-byte lines per tile
    for cfg in list(R.SM90_RS_CONFIGS):
        c = G.SM90_CONFIGS[cfg]
        assert flags.shape[0] >= -(-max_m // c.bm) * -(-n // c.bn)
    assert flags.shape[0] >= -(-max_m // R.COPY_TILE[0]) * -(-n // R.COPY_TILE[1])
    assert flags.shape[0] >= -(-max_m // G.SM80.bm) * -(-n // G.SM80.bn)
    # a slot row stride keeps 16-byte vectors aligned (finish() loads 16 bytes)
    assert n * 2 % 16 == 0 and (data.num_bytes // 2) % 16 == 0


# ---- golden model -------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("W", [1, 2, 3])
def test_reference_matches_a_loop(layout, W):
    rng = np.random.default_rng(W)
    M, n = 2 * W, 5
    ks = [3 + r for r in range(W)]  # k may differ between ranks
    a = [rng.standard_normal((M, k)) for k in ks]
    b = [rng.standard_normal((k, n) if layout == "kn" else (n, k)) for k in ks]
    bias = rng.standard_normal(n)
    got = reference_gemm_rs(a, b, bias, layout)
    for o in range(W):
        for i in range(M // W):
            for j in range(n):
                want = bias[j]  # once, not W times
                for r in range(W):
                    bb = b[r] if layout == "kn" else b[r].T
                    want += sum(a[r][o * (M // W) + i, t] * bb[t, j] for t in range(ks[r]))
                assert abs(got[o][i, j] - want) < 1e-12
        np.testing.assert_array_equal(reference_gemm_rs(a, b, bias, layout, rank=o), got[o])
    if W > 1:
        with pytest.raises(ValueError, match="not divisible"):
            reference_gemm_rs([x[:M - 1] for x in a], b)


# ---- constructor checks (fake world) ------------------------------------------------------------
def _topo(W, rank, kind):
    return Topology(rank, tuple(PeerLink(p, True, kind == "same_gpu", True,
                                         "self" if p == rank else kind) for p in range(W)))


def _fake_world(W=2, rank=0, device=None, kind="nvlink", peer_values=None):
    w = SimpleNamespace(rank=rank, size=W, device=device, topology=_topo(W, rank, kind))
    w.allgather = lambda o: [o] * W if peer_values is None else [o, peer_values(o)]
    w.check_same = lambda value, what: World.check_same(w, value, what)
    return w


@pytest.mark.parametrize("kwargs,exc,text", [
    (dict(dtype="float32"), TypeError, "expected one of"),
    (dict(dtype="float8_e4m3fn"), TypeError, "expected one of"),
    (dict(out_dtype="float16"), TypeError, "expected one of"),   # bf16 in: bf16 or fp32 out
    (dict(b_layout="tn"), ValueError, "b_layout must be"),
    (dict(reduce="ring"), ValueError, "reduce must be one of"),
    (dict(impl="cuda"), ValueError, "impl must be"),
    (dict(config="128x128s6c1"), ValueError, "config must be one of"),
    (dict(w1="plain"), ValueError, r"w1 must be one of \('gemm', 'fused'\)"),
    (dict(route="cublas"), ValueError, r"route must be one of \('auto', 'fused', 'unfused'\)"),
    (dict(timeout_s=0), ValueError, "timeout_s must be a finite number of seconds > 0"),
    (dict(max_m=0), ValueError, "max_m must be an int"),
    (dict(max_m=1.5), ValueError, "max_m must be an int"),
    (dict(n=2**31), ValueError, "n must be an int"),
    (dict(max_m=1), ValueError, r"max_m must be an integer in \[2, \d+\]"),
    (dict(n=1001), ValueError, r"n must be an integer in \[8, \d+\], a multiple of 8"),
    (dict(k=12), ValueError, r"k must be an integer in \[8, \d+\], a multiple of 8"),
    (dict(), CufluxError, "needs a CUDA device"),  # valid arguments reach the device check
])
def test_constructor_checks(kwargs, exc, text):
    args = dict(max_m=64, n=256, k=128, dtype="bfloat16")
    args.update(kwargs)
    with pytest.raises(exc, match=text) as e:
        GemmReduceScatter(_fake_world(), **args)
    assert "GemmReduceScatter" in str(e.value)


@pytest.mark.parametrize("W,w1,route,M,want", [
    (4, "gemm", "auto", 252, "unfused"),  # a GEMM of 252 rows: cuBLAS's side
    (2, "gemm", "auto", 254, "unfused"),
    (2, "gemm", "auto", 256, "fused"),
    (8, "gemm", "auto", 8, "unfused"),
    (8, "gemm", "auto", 4096, "fused"),
    (2, "gemm", "fused", 2, "fused"),
    (2, "gemm", "unfused", 8192, "unfused"),
    (1, "gemm", "fused", 4096, "gemm"),    # W = 1: w1 decides, nothing to reduce
    (1, "fused", "unfused", 8, "fused"),
])
def test_plan_is_a_function_of_m_and_the_agreed_arguments(W, w1, route, M, want):
    """Every rank must take the same route (the two use different flag protocols): plan(M)
    reads nothing but M, the world size, w1 and route (no tuner table, no timing)."""
    op = object.__new__(GemmReduceScatter)
    op.world, op.w1, op.route = SimpleNamespace(size=W), w1, route
    assert op.plan(M) == want


def test_mismatched_arguments_between_ranks_found_at_construction():
    # the peer has another n (World.check_same compares digests, then gathers the values)
    w = _fake_world(device=0, peer_values=lambda v: "another digest" if isinstance(v, str) else
                    (v[0], v[1] + 8) + tuple(v[2:]))
    with pytest.raises(ValueError, match="GemmReduceScatter arguments .* differs between ranks"):
        GemmReduceScatter(w, 64, 256, 128, "bfloat16")


def test_atomic_mode_refused_over_pcie():
    # impl="sm80": no device query (the fake world has no GPU behind device 0)
    with pytest.raises(ValueError, match="reduce='atomic' needs peer atomics.*PCIe"):
        GemmReduceScatter(_fake_world(device=0, kind="pcie"), 64, 256, 128, "bfloat16",
                          reduce="atomic", impl="sm80")


def test_a_problem_on_one_rank_raises_on_every_rank():
    """Rank 0 is fine, its peer reports PCIe links: rank 0 raises too (no one is left waiting
    in the collective allocation)."""
    peer = ("reduce='atomic' needs peer atomics (rank 1)", False)
    w = _fake_world(device=0, kind="nvlink",
                    peer_values=lambda o: peer if isinstance(o, tuple) and len(o) == 2 else o)
    with pytest.raises(ValueError, match=r"GemmReduceScatter: reduce='atomic' .*\(rank 1\)"):
        GemmReduceScatter(w, 64, 256, 128, "bfloat16", reduce="atomic", impl="sm80")


# ---- call checks (fake arrays) ------------------------------------------------------------------


def _fake_op(W=4, rank=1, layout="kn", out_dtype="bfloat16", k=128, n=256, max_m=512):
    op = object.__new__(GemmReduceScatter)
    op.world = SimpleNamespace(size=W, rank=rank, device=0)
    op.dtype, op.out_dtype = dtype_info("bfloat16"), dtype_info(out_dtype)
    op.max_m, op.n, op.k, op.b_layout = max_m, n, k, layout
    return op


A = FakeArray
OUT = A((32, 256))


@pytest.mark.parametrize("layout,a,b,bias,out,exc,text", [
    ("kn", A((128, 128), "float16"), A((128, 256)), None, OUT, TypeError, "a must be bfloat16"),
    ("kn", A((128,)), A((128, 256)), None, OUT, ValueError, "a must have 2 dimensions"),
    ("kn", A((128, 64)), A((128, 256)), None, OUT, ValueError, r"a must be \[M, k=128\]"),
    ("kn", A((128, 128)), A((256, 128)), None, OUT, ValueError,
     r"b \(layout 'kn'\) must be \[k, n\] = \(128, 256\)"),
    ("nk", A((128, 128)), A((128, 256)), None, OUT, ValueError,
     r"b \(layout 'nk'\) must be \[n, k\] = \(256, 128\)"),
    ("kn", A((128, 128)), A((128, 256), "float16"), None, OUT, TypeError, "b must be bfloat16"),
    ("kn", A((130, 128)), A((128, 256)), None, OUT, ValueError,
     "M=130 rows, which is not divisible by the world size 4.*pad it with zero rows"),
    ("kn", A((516, 128)), A((128, 256)), None, OUT, ValueError, "more than max_m=512"),
    ("kn", A((128, 128), device=1), A((128, 256)), None, OUT, ValueError,
     "a is on device 1, this rank uses device 0"),
    ("kn", A((128, 128)), A((128, 256), device=3), None, OUT, ValueError, "b is on device 3"),
    ("kn", A((128, 128), contiguous=False), A((128, 256)), None, OUT, ValueError,
     "a must be C-contiguous"),
    ("kn", A((128, 128), ptr=(1 << 20) + 8), A((128, 256)), None, OUT, ValueError,
     "a must start at a 16-byte aligned address"),
    ("kn", A((128, 128)), A((128, 256)), A((255,)), OUT, ValueError,
     r"bias must have shape \(256,\)"),
    ("kn", A((128, 128)), A((128, 256)), A((256,), "float32"), OUT, TypeError,
     "bias must be bfloat16"),
    ("kn", A((128, 128)), A((128, 256)), A((256,), ptr=(1 << 20) + 4), OUT, ValueError,
     "bias must start at a 16-byte aligned address"),
    ("kn", A((128, 128)), A((128, 256)), None, A((128, 256)), ValueError,
     r"out must have shape \(32, 256\)"),
    ("kn", A((128, 128)), A((128, 256)), None, A((32, 256), "float32"), TypeError,
     "out must be bfloat16"),
    ("kn", A((128, 128)), A((128, 256)), None, A((32, 256), device=2), ValueError,
     "out is on device 2"),
])
def test_call_checks(monkeypatch, layout, a, b, bias, out, exc, text):
    monkeypatch.setattr(R, "as_cupy", lambda x, name, op: x)
    with pytest.raises(exc, match=text) as e:
        _fake_op(layout=layout).check_call(a, b, bias, out)
    assert "GemmReduceScatter" in str(e.value)


def test_call_accepts_good_arguments(monkeypatch):
    monkeypatch.setattr(R, "as_cupy", lambda x, name, op: x)
    op = _fake_op(layout="nk", out_dtype="float32")
    got = op.check_call(A((512, 128)), A((256, 128)), A((256,)), A((128, 256), "float32"))
    assert got[4] == 512
    assert op.check_call(A((0, 128)), A((256, 128)), None, A((0, 256), "float32"))[4] == 0


@pytest.mark.parametrize("partial,out,exc,text", [
    (A((128, 256), "float16"), OUT, TypeError, "partial must be bfloat16"),
    (A((128, 255)), OUT, ValueError, r"partial must be \[M, n=256\]"),
    (A((6, 256)), A((1, 256)), ValueError, "not divisible by the world size 4"),
    (A((128, 256), ptr=(1 << 20) + 2), OUT, ValueError, "partial must start at a 16-byte"),
    (A((128, 256)), A((32, 256), ptr=(1 << 20) + 4), ValueError, "out must start at a 16-byte"),
])
def test_partial_checks(monkeypatch, partial, out, exc, text):
    monkeypatch.setattr(R, "as_cupy", lambda x, name, op: x)
    with pytest.raises(exc, match=text):
        _fake_op().check_partial(partial, None, out)


# ---- launch arguments against the kernel signatures ---------------------------------------------
@pytest.mark.parametrize("impl", ["sm90", "sm80"])
@pytest.mark.parametrize("reduce", R.REDUCE_MODES)
def test_launch_arguments_match_kernel_signatures(monkeypatch, impl, reduce):
    captured = []
    monkeypatch.setattr(R.kernels, "launch", lambda fn, grid, block, args, stream, **kw:
                        captured.append((kw["name"], grid, block, args, kw.get("shared_mem", 0))))
    monkeypatch.setattr(G, "prepare", lambda fn, smem: None)
    monkeypatch.setattr(G, "tensor_map", lambda *a: np.zeros(1, np.dtype((np.void, 128)))[0])
    W, me, M = 4, 2, 1000
    op = _fake_op(W=W, rank=me, layout="nk", max_m=1024)
    op.impl, op.config, op.reduce, op.atomic = impl, R.SM90_RS_DEFAULT, reduce, reduce == "atomic"
    op.module = {n: n for n in R.FAMILY.names}
    op.max_ctas = {"sm90": 132, "sm80": 264, "copy": 132}
    lay = make_layout(W, op.max_m, op.n, "bfloat16", reduce)
    op._data_off, op._flags_off = lay.regions["data"].offset, lay.regions["flags"].offset
    op.flag_stride = lay.regions["flags"].shape[1]
    op._slot_bytes, op._parity_bytes = op.max_m // W * op.n * 2, lay.regions["data"].num_bytes // 2
    op.buf = SimpleNamespace(ptrs_dev=DeviceArray())
    op.err_args = (np.uint64(1 << 40), DeviceArray(), np.uint64(10**9), np.uint32(5))
    op.epoch = 0
    arr = DeviceArray()
    arr.data = SimpleNamespace(ptr=1 << 30)
    op._launch_fused(arr, arr, None, arr, M, None)
    op._launch_fused(arr, arr, arr, arr, M, None)
    name, grid, block, args, smem = captured[0]
    kernel = name.split("<")[0]
    assert kernel == f"gemm_rs_{impl}" and ("true>" in name) == (reduce == "atomic")
    for _, _, _, a, _ in captured:
        check_args("gemm_rs.cu", kernel, a)
    names = ["M", "N", "K", "out", "out_f32", "bias", "bases", "data_off", "slot_bytes",
             "flags_off", "flag_stride", "rows_per_rank", "world_size", "rank", "own_lo",
             "own_hi", "group_m", "epoch", "err", "err_claim", "timeout_ns", "op"]
    assert kernel_names("gemm_rs.cu", kernel)[2:] == names
    calls = [dict(zip(names, c[3][2:])) for c in captured]
    bm = G.SM90_CONFIGS[R.SM90_RS_DEFAULT].bm if impl == "sm90" else G.SM80.bm
    t = calls[0]
    assert (int(t["rows_per_rank"]), int(t["world_size"]), int(t["rank"])) == (250, W, me)
    assert (int(t["own_lo"]), int(t["own_hi"])) == own_tile_rows(M, W, me, bm)
    assert int(t["bias"]) == 0 and calls[1]["bias"] is arr
    # epochs count calls; the data buffer alternates with the epoch's parity
    assert [int(c["epoch"]) for c in calls] == [1, 2]
    assert int(calls[0]["data_off"]) - int(calls[1]["data_off"]) == op._parity_bytes
    assert block == ((384,) if impl == "sm90" else (256,)) and grid[0] <= op.max_ctas[impl]
    assert smem == (G.SM90_CONFIGS[R.SM90_RS_DEFAULT].smem_bytes if impl == "sm90"
                    else G.SM80.smem_bytes)
    # the comm-only kernel takes the same tail after (partial, M, N)
    full = (arr, np.int32(M), np.int32(op.n)) + op._tail(arr, None, M, R.COPY_TILE[0], None)
    check_args("gemm_rs.cu", "rs_tiles", full)
    assert kernel_names("gemm_rs.cu", "rs_tiles")[3:] == names[3:]


# ---- benchmark shapes ---------------------------------------------------------------------------
@pytest.mark.parametrize("W", [1, 2, 3, 4, 6, 8])
def test_bench_cases_are_valid_shapes(W):
    from cuflux.bench import gemm_rs as bench

    full = bench.cases(W, quick=False)
    assert [c[0] for c in full] == [s[0] for s in bench.SHAPES]
    assert {c[0] for c in bench.cases(W, quick=True)} == set(bench.QUICK)
    for name, M, n, K in full:
        k = K // W
        assert M % W == 0 and M >= W and n % 8 == 0 and K % W == 0 and k % 8 == 0 and k > 0, name
    if W in (1, 2, 4, 8):  # the shapes, unchanged
        assert dict((c[0], c[1:]) for c in full)["flux-rs"] == (4096, 12288, 49152)
