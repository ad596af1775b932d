"""Tests of cuflux.nodes and World.nodes. CPU: nodes found from hosts and P2P rows, and every
cross-node plan played on NumPy arrays over fake layouts (2 x 1, 2 x 2, 2 x 4, 4 x 2, ranks
interleaved over hosts), checked against the op's definition (a plan that sends a row twice,
misses one, uses NCCL inside a node or IPC across nodes fails here); a World on real ranks
learns its nodes (node_size, CUFLUX_NODE_SIZE); symmetric memory refuses a World of several
nodes. GPU (marked gpu, ranks sharing the GPU, so the rails are HostRail): every op built by its
own name on such a World is its cross-node form, and each cross-node op exact against the
references over emulated nodes."""

from types import SimpleNamespace

import numpy as np
import pytest

import cuflux
from cuflux.errors import CufluxError
from tests.mpi import fresh_seed, on_ranks, world_sizes
from cuflux.nodes import (NodeLayout, all2all_plan, allgather_plan, allreduce_plan, gemm_rs_plan,
                          node_layout, require_one_node, row_shards)


def _p2p_by_host(hosts):
    return [[hosts[r] == hosts[p] for p in range(len(hosts))] for r in range(len(hosts))]


def _layout(num_nodes, node_size, interleaved=False):
    W = num_nodes * node_size
    hosts = [f"h{(r % num_nodes) if interleaved else (r // node_size)}" for r in range(W)]
    return node_layout(hosts, _p2p_by_host(hosts))


LAYOUTS = [(2, 1, False), (2, 2, False), (2, 4, False), (4, 2, False), (2, 2, True),
           (4, 2, True), (1, 4, False)]


def _ids(v):
    return "x".join(str(x) for x in v[:2]) + ("-interleaved" if v[2] else "")


# ---- World.nodes on real ranks (no GPU needed: ranks of one host are one node) ----------------
@on_ranks
def world_nodes(world):
    """Node layouts of Worlds on the same ranks: the default, node_size 1, a node size that
    does not divide, different node sizes on different ranks."""
    from mpi4py import MPI

    def outcome(**kw):
        try:
            w = cuflux.World(MPI.COMM_WORLD, timeout_s=20, **kw)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        nodes = [list(n) for n in w.nodes.nodes]
        w.close()
        return nodes

    me = world.rank
    return {"default": outcome(), "one": outcome(node_size=1), "three": outcome(node_size=3),
            "mixed": outcome(node_size=1 if me == 0 else 2)}


def test_world_learns_its_nodes_and_the_node_size_splits_them():
    res = world_nodes.run(2, timeout_s=120)
    for r in res:
        assert r["default"] == [[0, 1]], r  # one host, no GPU: one node
        assert r["one"] == [[0], [1]], r  # node_size=1: two GPUs emulate two nodes
        assert r["three"].startswith("CufluxError") and "does not divide" in r["three"], r
        assert r["mixed"].startswith("CufluxError") and "different node sizes" in r["mixed"], r


@on_ranks
def split_worlds(world):
    """World.split_nodes on node sizes 4 (one node), 2 and 1: what each rank's node World and
    rail group hold (the World ranks each allgather returns), after a rail barrier."""
    from mpi4py import MPI

    from cuflux.ops.base import ranks_on_my_gpu

    out = {}
    for node_size in (4, 2, 1):
        w = cuflux.World(MPI.COMM_WORLD, timeout_s=20, node_size=node_size)
        node, rail = w.split_nodes()
        rail.barrier(what="rail barrier")
        out[f"size{node_size}"] = {
            "node": node.allgather(w.rank), "node_nodes": node.nodes.nodes,
            "node_device": node.device == w.device,
            "sharers": (ranks_on_my_gpu(node), ranks_on_my_gpu(w)),
            "rail": rail.allgather(w.rank, what="rail ranks")}
        rail.free()
        node.close()
        w.close()
    return out


def test_split_nodes_gives_each_rank_its_node_world_and_its_rail():
    res = split_worlds.run(4, timeout_s=120)
    for me, r in enumerate(res):
        one, two, four = r["size4"], r["size2"], r["size1"]
        assert one["node"] == [0, 1, 2, 3] and one["rail"] == [me], r
        assert two["node"] == ([0, 1] if me < 2 else [2, 3]), r
        assert two["rail"] == [me % 2, me % 2 + 2], r  # rank i of node 0, then of node 1
        assert four["node"] == [me] and four["rail"] == [0, 1, 2, 3], r
        for case in (one, two, four):
            assert len(case["node_nodes"]) == 1 and case["node_device"], r  # a one-node World
            # the node's grids count every rank on this GPU (the parent's), not the node's
            assert case["sharers"][0] == case["sharers"][1], r


def test_world_rejects_a_bad_node_size_before_any_collective():
    with pytest.raises(ValueError, match="node_size must be an int >= 1"):
        cuflux.World(node_size=0)


def test_symmetric_memory_refuses_a_world_of_several_nodes():
    two = SimpleNamespace(nodes=NodeLayout(((0,), (1,))))
    with pytest.raises(CufluxError, match=r"AllReduce: this World spans 2 nodes of 1 ranks "
                                          r"\(\[\[0\], \[1\]\]\).*split_nodes"):
        require_one_node(two, "AllReduce")
    require_one_node(SimpleNamespace(nodes=NodeLayout(((0, 1),))), "AllReduce")  # one node
    require_one_node(SimpleNamespace(), "AllReduce")  # a stand-in World without nodes


def test_ops_built_on_several_nodes_are_their_cross_node_form(monkeypatch):
    """CommOp.__new__: an op built on a World of several nodes is its class's ACROSS form, with
    the same arguments (positional and keyword); a World of one node, and a user's subclass of
    an op (not silently replaced), are not dispatched."""
    from cuflux.ops import across
    from cuflux.ops.allreduce import AllReduce

    class Fake:
        def __init__(self, *args, **kwargs):
            self.args, self.kwargs = args, kwargs

    monkeypatch.setattr(across, "AllReduceAcrossNodes", Fake)
    two = SimpleNamespace(nodes=NodeLayout(((0,), (1,))))
    got = AllReduce(two, 1024, "float32", algo="one_shot")
    assert isinstance(got, Fake) and got.args == (two, 1024, "float32")
    assert got.kwargs == {"algo": "one_shot"}
    assert isinstance(AllReduce(world=two, max_elems=8, dtype="float32"), Fake)

    class Mine(AllReduce):
        pass

    for world in (SimpleNamespace(nodes=NodeLayout(((0, 1),))), two):
        for cls in (AllReduce, Mine) if world is not two else (Mine,):
            try:
                made = cls(world, 1024, "float32")
            except Exception as e:  # the stand-in World is no World: the op's own checks
                made = e
            assert not isinstance(made, Fake), (cls, world)


@on_ranks
def ops_on_two_nodes(world):
    """On a World of two emulated nodes every op, built by its own name with its one-node
    arguments (positional and keyword), is its cross-node form (cuflux.ops.across), and one
    AllReduce call sums every rank; symmetric memory still raises CufluxError before allocating
    anything; the same ranks' one-node World still builds the IPC op."""
    import cupy
    from mpi4py import MPI

    from cuflux import symmetric

    w = cuflux.World(MPI.COMM_WORLD, timeout_s=20, node_size=1)
    W = w.size
    makers = {
        "AllReduce": lambda: cuflux.AllReduce(w, 1024, "float32", "auto", 20.0),
        "AllReduceRMSNorm": lambda: cuflux.AllReduceRMSNorm(w, 8, 256, "float32",
                                                            output="sequence_parallel"),
        "All2AllHeads": lambda: cuflux.All2AllHeads(w, 8, 2 * W, 64, "float16", 2, None, 20.0,
                                                    "memcpy"),
        "AllGather": lambda: cuflux.AllGather(w, 8, 64, "float32", "push", 4, 20.0),
        "AllGatherGemm": lambda: cuflux.AllGatherGemm(w, 8 * W, 64, 64, "float16", None, "nk",
                                                      "pull", None, 20.0, route="unfused"),
        "GemmReduceScatter": lambda: cuflux.GemmReduceScatter(w, 64 * W, 64, 64, "float16",
                                                              None, "kn", "atomic", 20.0),
    }
    out = {}
    for name, make in makers.items():
        with make() as op:
            out[name] = type(op).__name__
            if name == "AllReduce":
                x = cupy.ones(1024, cupy.float32)
                out["sum"] = float(op(x)[7].get())
    allocated, original = [], symmetric.DeviceIpcMemory.alloc
    symmetric.DeviceIpcMemory.alloc = lambda self, n: allocated.append(n) or original(self, n)
    try:
        w.alloc_symmetric((16,), np.float32)
        out["SymmetricBuffer"] = "built"
    except CufluxError as e:
        out["SymmetricBuffer"] = str(e)
    finally:
        symmetric.DeviceIpcMemory.alloc = original
    out["symmetric_bytes"] = sum(allocated)
    w.close()
    with cuflux.AllReduce(world, 1024, "float32") as ar:  # one node: the IPC op
        out["one_node"] = type(ar).__name__
    return out


@pytest.mark.gpu
def test_every_op_is_its_cross_node_form_on_a_world_of_two_nodes():
    res = ops_on_two_nodes.run(2, timeout_s=180)
    for r in res:
        for name in ("AllReduce", "AllReduceRMSNorm", "All2AllHeads", "AllGather",
                     "AllGatherGemm", "GemmReduceScatter"):
            assert r[name] == f"{name}AcrossNodes", (name, r[name])
        assert r["sum"] == 2.0
        assert "spans 2 nodes" in r["SymmetricBuffer"] and r["symmetric_bytes"] == 0, r
        assert r["one_node"] == "AllReduce"


@on_ranks
def across_nodes(world, node_size, seed):
    """AllReduce and AllGather on a World of emulated nodes (the ranks share the GPU: the rail
    is HostRail) against float64 / exact references, outputs poisoned, sizes changing; every
    rank holds the same sum bits."""
    import hashlib

    import cupy
    from mpi4py import MPI

    from cuflux.arrays import dtype_info
    from cuflux.ops.across import AllGatherAcrossNodes, AllReduceAcrossNodes
    from cuflux.rail import to_float
    from tests.checks import poisoned, rail_kind_as_expected, scratch_let_go

    w = cuflux.World(MPI.COMM_WORLD, timeout_s=60, node_size=node_size)
    W, me = w.size, w.rank
    calls = 0
    with w.device_context():
        for dtype, unit in (("float32", 2.0 ** -24), ("bfloat16", 2.0 ** -8)):
            st = dtype_info(dtype).storage
            with AllReduceAcrossNodes(w, 45_001, dtype, timeout_s=60) as ar, \
                    AllGatherAcrossNodes(w, 8, 24, dtype, timeout_s=60) as ag:
                rail_kind_as_expected(w, ar.rail)  # NCCL between distinct GPUs (gpu.sh multi)
                rail_kind_as_expected(w, ag.rail)
                # under a plain row (8192 bfloat16, 4096 float32 elements) the node's first
                # rank holds the only share; the last two give every node rank a share of
                # whole rows, uneven, the last row short
                for n in (1, 7, 4999, 1000, 5000, 3 * 8192 + 5, 45_001):
                    rng = [np.random.default_rng((seed, p, n)) for p in range(W)]
                    # bfloat16: random bits with the exponent's top bit clear (finite, |x| < 2)
                    # and its lowest set (normal: kernels flush float32 subnormals, the
                    # README's numerics note)
                    xs = [((r.integers(0, 1 << 16, n).astype(np.uint16) & np.uint16(0xBFFF))
                           | np.uint16(0x0080)).view(st)
                          if dtype == "bfloat16" else r.standard_normal(n).astype(np.float32)
                          for r in rng]
                    out = poisoned((n,), dtype)
                    ar(cupy.asarray(xs[me]), out=out)
                    ar.synchronize()
                    host = cupy.asnumpy(out)
                    got = to_float(host, dtype).astype(np.float64)
                    parts = np.stack([to_float(x, dtype).astype(np.float64) for x in xs])
                    # fp32 sums, rounded to dtype after the node sum and after the rail sum
                    bound = (W + 2) * unit * np.abs(parts).sum(axis=0)
                    off = np.abs(got - parts.sum(axis=0)) - bound
                    assert np.isfinite(got).all() and (off <= 0).all(), \
                        (dtype, n, f"seed {seed}", int(off.argmax()))
                    digests = w.allgather(hashlib.sha1(host.tobytes()).hexdigest())
                    assert len(set(digests)) == 1, ("ranks hold different sums", dtype, n)
                    calls += 1
                for rows in (3, 8, 1):
                    shards = [np.random.default_rng((seed, p, rows, 9)).integers(
                        0, 1 << 8, (rows, 24)).astype(st) for p in range(W)]
                    out = poisoned((W * rows, 24), dtype)
                    ag(cupy.asarray(shards[me]), out=out)
                    ag.synchronize()
                    assert np.array_equal(cupy.asnumpy(out).view(np.uint8),
                                          np.concatenate(shards).view(np.uint8)), (dtype, rows)
                    calls += 1
            scratch_let_go(ag)
    w.close()
    return calls


ACROSS = [(W, k) for W, k in ((2, 1), (4, 1), (4, 2), (8, 2), (8, 4)) if W in world_sizes()]


def across_test(body, expect):
    """The GPU test of a cross-node rank body: every (W, node size) of ACROSS, a fresh seed a
    run, every rank returning `expect`."""
    @pytest.mark.gpu
    @pytest.mark.parametrize("W,node_size", ACROSS or [(2, 1)])
    def check(W, node_size):
        assert body.run(W, timeout_s=600, node_size=node_size,
                        seed=fresh_seed()) == [expect] * W

    check.__doc__ = body.__doc__
    return check


test_allreduce_and_allgather_run_across_emulated_nodes = across_test(across_nodes, 20)


@on_ranks
def across_all2all(world, node_size, seed):
    """All2AllHeadsAcrossNodes (two hops: the rail, then the node's All2AllHeads) on a World of
    emulated nodes (HostRail: the ranks share the GPU): scatter_heads and gather_heads, bfloat16
    and fp8 (uint8 storage), no / per-token / per-head scales, batch 1 and 2, uneven token
    counts with a rank of none, out poisoned: exactly the World's reference, every call."""
    import cupy
    from mpi4py import MPI

    from cuflux.arrays import dtype_info
    from cuflux.ops.across import All2AllHeadsAcrossNodes
    from cuflux.ops.all2all import reference_gather_heads, reference_scatter_heads
    from tests.checks import poisoned, rail_kind_as_expected, scratch_let_go

    w = cuflux.World(MPI.COMM_WORLD, timeout_s=60, node_size=node_size)
    W, me = w.size, w.rank
    hpr, D, max_t = 2, 24, 9
    checked = 0

    def same(got, want, what):
        got = cupy.asnumpy(got)
        assert got.shape == want.shape, (what, got.shape, want.shape)
        assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8)), \
            (what, f"seed {seed}")

    with w.device_context():
        for dtype in ("bfloat16", "float8_e4m3fn"):
            st = dtype_info(dtype).storage
            with All2AllHeadsAcrossNodes(w, max_t, W * hpr, D, dtype, batch=2,
                                         timeout_s=60) as op:
                rail_kind_as_expected(w, op.rail)
                for call, (B, mode) in enumerate(((1, 0), (2, 1), (2, 2), (1, 1))):
                    rng = np.random.default_rng((seed, call, len(dtype)))
                    tokens = tuple(int(t) for t in rng.integers(0, max_t + 1, W))
                    if W > 1:
                        tokens = tokens[:1] + (0,) + tokens[2:]  # rank 1 has no tokens
                    xs = [rng.integers(0, 0x3F, (B, t, W * hpr, D)).astype(np.uint8).view(st)
                          if dtype != "bfloat16" else
                          rng.integers(0, 0x3F80, (B, t, W * hpr, D)).astype(np.uint16).view(st)
                          for t in tokens]
                    scales = ([rng.standard_normal((B, t) if mode == 1 else (B, t, W * hpr))
                               .astype(np.float32) for t in tokens] if mode else None)
                    want = reference_scatter_heads(xs, tokens, W, scales)
                    want_y, want_ys = want if mode else (want, None)
                    out = poisoned(want_y[me].shape, dtype)
                    kw = {}
                    if mode:
                        kw = dict(scale=cupy.asarray(scales[me]),
                                  out_scale=poisoned(want_ys[me].shape, "float32"))
                    got = op.scatter_heads(cupy.asarray(xs[me]), tokens, out=out, **kw)
                    op.synchronize()
                    same(out, want_y[me], ("scatter", dtype, B, mode, tokens))
                    if mode:
                        assert got[1] is kw["out_scale"]
                        same(got[1], want_ys[me], ("scatter scale", dtype, B, mode))
                    # and back: gather_heads of the reference's y gives every rank's x
                    back = reference_gather_heads(want_y, tokens, W, want_ys if mode else None)
                    back_x, back_s = back if mode else (back, None)
                    gs = cupy.asarray(want_ys[me]) if mode else None
                    got = op.gather_heads(cupy.asarray(want_y[me]), tokens, gs)
                    op.synchronize()
                    same(got[0] if mode else got, back_x[me], ("gather", dtype, B, mode))
                    if mode:
                        same(got[1], back_s[me], ("gather scale", dtype, B, mode))
                    checked += 1
            scratch_let_go(op)
    w.close()
    return checked


test_all2all_heads_runs_across_emulated_nodes = across_test(across_all2all, 8)


@on_ranks
def across_composed(world, node_size, seed):
    """AllReduceRMSNorm (every output mode), AllGatherGemm and GemmReduceScatter (its node
    op's unfused and fused routes) on a World of emulated nodes (ops/across.py; HostRail: the
    ranks share the GPU) against the float64 references, outputs poisoned."""
    import cupy
    from mpi4py import MPI

    from cuflux.ops.across import (AllGatherGemmAcrossNodes, AllReduceRMSNormAcrossNodes,
                                   GemmReduceScatterAcrossNodes)
    from cuflux.ops.ag_gemm import reference_ag_gemm
    from cuflux.ops.allreduce import reference_allreduce_rmsnorm, token_slice
    from cuflux.ops.gemm_rs import reference_gemm_rs
    from cuflux.arrays import dtype_info
    from cuflux.rail import from_float, to_float
    from tests.checks import check_close, poisoned, rail_kind_as_expected, scratch_let_go

    w = cuflux.World(MPI.COMM_WORLD, timeout_s=60, node_size=node_size)
    W, me = w.size, w.rank

    def bf16(key, shape, scale=1.0):  # (bits, float64 values) the same on every rank
        v = np.random.default_rng((seed, *key)).standard_normal(shape).astype(np.float32)
        bits = from_float(v * np.float32(scale), "bfloat16").view(dtype_info("bfloat16").storage)
        return bits, to_float(bits, "bfloat16").astype(np.float64)

    checked = 0
    with w.device_context():
        for mode in ("replicated", "sequence_parallel", "sharded_residual"):
            with AllReduceRMSNormAcrossNodes(w, 40, 256, "bfloat16", output=mode,
                                             timeout_s=60) as norm:
                for T in (1, 37, 40):
                    xs = [bf16((1, T, p), (T, 256)) for p in range(W)]
                    res_bits, res = bf16((2, T), (T, 256))
                    wt_bits, wt = bf16((3, T), (256,))
                    want_out, want_res = reference_allreduce_rmsnorm(
                        [x for _, x in xs], res, wt, 1e-6, mode, W)[me]
                    lo, hi = token_slice(T, W, me)
                    mine = res_bits[lo:hi] if mode == "sequence_parallel" else res_bits
                    residual = cupy.asarray(mine)
                    out = poisoned(want_out.shape, "bfloat16")
                    norm(cupy.asarray(xs[me][0]), residual, cupy.asarray(wt_bits), out=out)
                    norm.synchronize()
                    for got, want, what in ((out, want_out, "out"), (residual, want_res, "res")):
                        assert got.shape == want.shape, (mode, T, what, got.shape)
                        if not want.size:  # a rank without tokens (sequence_parallel, T < W)
                            continue
                        g = to_float(cupy.asnumpy(got), "bfloat16").astype(np.float64)
                        err = np.abs(g - want).max() / (np.abs(want).max() + 1e-30)
                        assert np.isfinite(g).all() and err < 2e-2, (mode, T, what, err)
                    checked += 1
            scratch_let_go(norm)
        rows, n, k = 24, 64, 96
        # overlap (default): the GEMM of this node's rows while the rail gathers, then the
        # rest; twice per op (its staging reused), with a bias, the gathered A bit for bit.
        for overlap in (True, False):
            with AllGatherGemmAcrossNodes(w, max_rows_per_rank=rows, n=n, k=k,
                                          dtype="bfloat16", out_dtype="float32", b_layout="nk",
                                          timeout_s=60, overlap=overlap) as agg:
                for call, r in enumerate((rows, 5)):
                    shards = [bf16((4, call, p), (r, k)) for p in range(W)]
                    b_bits, b = bf16((5, call), (n, k), 0.1)
                    bias_bits, bias = bf16((9, call), (n,))
                    out = poisoned((W * r, n), "float32")
                    got, gathered = agg(cupy.asarray(shards[me][0]), cupy.asarray(b_bits),
                                        bias=cupy.asarray(bias_bits), out=out,
                                        return_gathered=True)
                    agg.synchronize()
                    assert got is out
                    want = reference_ag_gemm([x for _, x in shards], [b] * W, [bias] * W,
                                             b_layout="nk")[me]
                    what = f"AllGatherGemm across nodes (overlap={overlap}, rows {r})"
                    check_close(out, want, "float32", what)
                    np.testing.assert_array_equal(
                        cupy.asnumpy(gathered), np.concatenate([x for x, _ in shards]), what)
                    checked += 1
        M = 8 * W
        a_list = [bf16((6, p), (M, k)) for p in range(W)]
        b_list = [bf16((7, p), (n, k), 0.1) for p in range(W)]
        bias_bits, bias = bf16((8,), (n,))
        want = reference_gemm_rs([a for _, a in a_list], [b for _, b in b_list], bias,
                                 b_layout="nk", rank=me)
        # auto: M < 256 runs the node's unfused route; fused: the node's fused kernel
        for route in ("auto", "fused"):
            with GemmReduceScatterAcrossNodes(w, M, n, k, "bfloat16", out_dtype="float32",
                                              b_layout="nk", timeout_s=60, route=route) as grs:
                rail_kind_as_expected(w, grs.rail)
                out = poisoned((M // W, n), "float32")
                grs(cupy.asarray(a_list[me][0]), cupy.asarray(b_list[me][0]),
                    bias=cupy.asarray(bias_bits), out=out)
                grs.synchronize()
                check_close(out, want, "float32", f"GemmReduceScatter across nodes ({route})")
                checked += 1
            scratch_let_go(grs)
    w.close()
    return checked


test_the_fused_ops_composed_across_emulated_nodes = across_test(across_composed, 15)


# ---- node discovery ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", LAYOUTS, ids=_ids)
def test_nodes_follow_hosts(shape):
    n, k, inter = shape
    lay = _layout(n, k, inter)
    assert lay.num_nodes == n and lay.node_size == k and lay.world_size == n * k
    for r in range(n * k):
        assert r in lay.node_peers(r)
        rail = lay.rail(r)
        assert r in rail and len(rail) == n
        assert len({lay.node_of(p) for p in rail}) == n            # one per node
        assert {lay.local_index(p) for p in rail} == {lay.local_index(r)}


def test_node_size_splits_one_host_into_emulated_nodes():
    hosts = ["a"] * 8
    lay = node_layout(hosts, _p2p_by_host(hosts), node_size=4)
    assert lay.nodes == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert node_layout(hosts[:2], _p2p_by_host(hosts[:2]), node_size=1).nodes == ((0,), (1,))


@pytest.mark.parametrize("hosts,node_size,text", [
    (["a", "a", "a", "b"], None, "same number of ranks"),
    (["a", "a", "b", "b", "b", "b"], None, "same number of ranks"),
    (["a"] * 4, 3, "node_size=3 does not divide"),
    (["a"] * 4, 0, "node_size must be an int >= 1"),
])
def test_uneven_nodes_are_refused(hosts, node_size, text):
    with pytest.raises((CufluxError, ValueError), match=text):
        node_layout(hosts, _p2p_by_host(hosts), node_size)


def test_p2p_islands_inside_one_host():
    # two PCIe switches without P2P between them: two nodes on one host
    hosts = ["a"] * 4
    p2p = [[(r < 2) == (p < 2) for p in range(4)] for r in range(4)]
    assert node_layout(hosts, p2p).nodes == ((0, 1), (2, 3))
    # 0 reaches 1 and 2, but 1 and 2 do not reach each other: no node holds all three
    p2p = [[True, True, True], [True, True, False], [True, False, True]]
    with pytest.raises(CufluxError, match="not each other"):
        node_layout(["a"] * 3, p2p)


def test_a_layout_must_hold_every_rank_once():
    with pytest.raises(CufluxError, match="every rank once"):
        NodeLayout(((0, 1), (1, 2)))


def test_row_shards_cover_rows_once():
    for rows in (0, 1, 7, 8, 1023):
        for parts in (1, 2, 3, 8):
            sh = row_shards(rows, parts)
            assert sh[0][0] == 0 and sh[-1][1] == rows and len(sh) == parts
            assert all(a[1] == b[0] for a, b in zip(sh, sh[1:]))
            assert max(h - l for l, h in sh) - min(h - l for l, h in sh) <= 1


# ---- plans played on arrays ----------------------------------------------------------------------
def _check_groups(lay, rank, steps):
    """IPC only inside the node, NCCL only across the rail."""
    for st in steps:
        if st.via == "ipc":
            assert set(st.group) <= set(lay.node_peers(rank)), (rank, st)
        else:
            assert st.via == "nccl" and st.group == lay.rail(rank), (rank, st)


@pytest.mark.parametrize("shape", LAYOUTS, ids=_ids)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_allreduce_plan_sums_every_rank(shape, rows):
    lay = _layout(*shape)
    W = lay.world_size
    rng = np.random.default_rng(rows * 31 + W)
    x = [rng.standard_normal((rows, 3)) for _ in range(W)]
    plans = [allreduce_plan(lay, r, rows) for r in range(W)]
    for r in range(W):
        _check_groups(lay, r, plans[r])
    want = sum(x)
    if lay.num_nodes == 1:
        assert all(p[0].what == "allreduce" and p[0].group == lay.nodes[0] for p in plans)
        return
    shards = row_shards(rows, lay.node_size)
    # step 1: local rank i gets its node's sum of shard i
    node_sum = {}
    for r in range(W):
        lo, hi = shards[lay.local_index(r)]
        assert plans[r][1].rows == (lo, hi)
        node_sum[r] = sum(x[p][lo:hi] for p in plans[r][0].group)
    # step 2: across the rail, the node sums of shard i are summed
    full = {r: sum(node_sum[p] for p in plans[r][1].group) for r in range(W)}
    # step 3: every rank gathers the shards of its node peers
    for r in range(W):
        got = np.zeros_like(want)
        for p in plans[r][2].group:
            lo, hi = shards[lay.local_index(p)]
            got[lo:hi] = full[p]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", LAYOUTS, ids=_ids)
@pytest.mark.parametrize("rows_per_rank", [1, 3])
def test_gemm_rs_plan_gives_each_owner_its_rows_summed(shape, rows_per_rank):
    lay = _layout(*shape)
    W = lay.world_size
    M = rows_per_rank * W
    rng = np.random.default_rng(M)
    c = [rng.standard_normal((M, 4)) for _ in range(W)]
    plans = [gemm_rs_plan(lay, r, M) for r in range(W)]
    partial = {}  # (rank, owner) -> the rank's node sum of the owner's rows
    for r in range(W):
        _check_groups(lay, r, plans[r])
        node_steps = [s for s in plans[r] if s.what == "reduce_node_rows"]
        assert len(node_steps) == lay.num_nodes
        for st, owner in zip(node_steps, lay.rail(r)):
            assert st.rows == (owner * rows_per_rank, (owner + 1) * rows_per_rank)
            partial[r, owner] = sum(c[p][slice(*st.rows)] for p in st.group)
    for o in range(W):  # the reduce-scatter across o's rail: every rail member's partial of o
        got = sum(partial[p, o] for p in lay.rail(o))
        want = sum(c[p][o * rows_per_rank:(o + 1) * rows_per_rank] for p in range(W))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # every owner's rows are summed by exactly one rank per node (no row twice, none missed)
    for o in range(W):
        assert sorted(lay.node_of(r) for r in range(W) if (r, o) in partial) == \
            list(range(lay.num_nodes))
    with pytest.raises(ValueError, match="not divisible"):
        gemm_rs_plan(lay, 0, M + 1)  # every layout here has W > 1


@pytest.mark.parametrize("shape", LAYOUTS, ids=_ids)
def test_allgather_plan_brings_every_block_once_from_a_rank_that_has_it(shape):
    lay = _layout(*shape)
    W = lay.world_size
    plans = [allgather_plan(lay, r) for r in range(W)]
    have = {r: {r} for r in range(W)}
    copied = {r: [] for r in range(W)}

    def copies(r, phase):
        steps = plans[r]
        cut = next((i for i, s in enumerate(steps) if s.via == "nccl"), len(steps))
        return steps[:cut] if phase == 0 else steps[cut + 1:]

    for r in range(W):
        _check_groups(lay, r, plans[r])
    for phase in (0, 1):
        if phase == 1:  # NCCL all-gather across each rail (all ranks reach it first)
            for r in range(W):
                have[r] |= set(lay.rail(r))
        for r in range(W):
            for st in copies(r, phase):
                (p,), (src, _) = st.group, st.rows
                assert src in have[p], f"rank {r} copies block {src} from {p} before it is there"
                copied[r].append(src)
        for r in range(W):
            have[r] |= set(copied[r])
    for r in range(W):
        assert have[r] == set(range(W))
        received = copied[r] + ([p for p in lay.rail(r) if p != r] if lay.num_nodes > 1 else [])
        assert sorted(received) == sorted(set(range(W)) - {r}), (r, received)  # each once
        # node-local blocks are copied before any remote one (a GEMM starts on them)
        local = [s for s in copied[r] if lay.node_of(s) == lay.node_of(r)]
        assert copied[r][:len(local)] == local


def _rails(lay, reverse):
    """rails[a]: node-local index a's rail, in World-rank order (how split_nodes orders it), or
    reversed (the plan must not depend on it)."""
    rails = [sorted(lay.rail(n[a])) for a, n in zip(range(lay.node_size), [lay.nodes[0]] * 9)]
    return tuple(tuple(m[::-1] if reverse else m) for m in rails)


@pytest.mark.parametrize("shape", LAYOUTS, ids=_ids)
@pytest.mark.parametrize("reverse", [False, True], ids=["rail-order", "rail-reversed"])
@pytest.mark.parametrize("batch", [1, 2])
def test_all2all_plan_two_hops_give_every_rank_its_heads(shape, reverse, batch):
    """All2AllHeadsAcrossNodes' two hops played on NumPy (hop 1: the rail's blocks of the
    peer node's head groups; hop 2: the node's All2AllHeads reference on the rail's blocks;
    then all2all_rows' order), scatter and gather with both kinds of scales, uneven and zero
    token counts: exactly the World's reference."""
    from cuflux.nodes import all2all_rows, all2all_tokens
    from cuflux.ops.all2all import reference_gather_heads, reference_scatter_heads

    lay = _layout(*shape)
    W, k = lay.world_size, lay.node_size
    rails = _rails(lay, reverse)
    hpr, D = 2, 3
    rng = np.random.default_rng(W * 7 + k + batch)
    tokens = tuple(int(t) for t in rng.integers(0, 4, W))
    tokens = tokens[:-1] + (0,) if W > 1 else (2,)  # a rank without tokens
    a_of = {r: lay.local_index(r) for r in range(W)}
    jm = {r: rails[a_of[r]].index(r) for r in range(W)}  # rail rank of each World rank
    heads = {r: all2all_plan(lay, rails, r) for r in range(W)}
    for r in range(W):  # hop 1 goes to a rail peer; its block holds that peer's node, in order
        assert [list(h) for h in heads[r]] == [list(lay.node_peers(m)) for m in rails[a_of[r]]]
    xs = [rng.standard_normal((batch, tokens[r], W * hpr, D)) for r in range(W)]
    sc_tok = [rng.standard_normal((batch, tokens[r])) for r in range(W)]
    sc_head = [rng.standard_normal((batch, tokens[r], W * hpr)) for r in range(W)]
    node_tokens = all2all_tokens(rails, tokens, batch)
    q = all2all_rows(rails, tokens, batch)
    S = sum(tokens)
    assert sorted(q.tolist()) == list(range(batch * S))  # a permutation of the output's rows

    def hop1(r, a, cols):  # rank r's block for each rail rank: the peer node's head groups
        return [a.reshape(batch, tokens[r], W, cols)[:, :, list(h)].reshape(
            batch * tokens[r], k * cols) for h in heads[r]]

    def scatter(arrays, cols):
        """arrays[r] [B, T_r, W * cols] -> per rank [B * S, cols] in World order."""
        blocks = {r: hop1(r, arrays[r], cols) for r in range(W)}
        node_in = {}
        for t in range(W):  # rank t's hop-2 input: its rail's blocks for it, in rail order
            node_in[t] = np.concatenate([blocks[m][jm[t]] for m in rails[a_of[t]]])
        got = {}
        for n in lay.nodes:
            ys = reference_scatter_heads([node_in[t][None, :, :, None] for t in n],
                                         node_tokens, k)
            for b, t in enumerate(n):
                flat = np.empty((batch * S, cols))
                flat[q] = ys[b][0, :, :, 0]
                got[t] = flat
        return got

    want = reference_scatter_heads(xs, tokens, W, sc_head)
    want_tok = reference_scatter_heads(xs, tokens, W, sc_tok)[1]
    got = scatter([x.reshape(batch, tokens[r], W * hpr * D) for r, x in enumerate(xs)], hpr * D)
    got_sh = scatter(sc_head, hpr)
    got_st = scatter([np.repeat(s[..., None], W, 2) for s in sc_tok], 1)
    for t in range(W):
        assert np.array_equal(got[t].reshape(want[0][t].shape), want[0][t]), t
        assert np.array_equal(got_sh[t].reshape(want[1][t].shape), want[1][t]), t
        assert np.array_equal(got_st[t].reshape(want_tok[t].shape), want_tok[t]), t

    # gather: the same hops backwards, back to every rank's [B, T_r, H, D]
    ys = want[0]
    back = reference_gather_heads(ys, tokens, W)
    node_out = {}
    for n in lay.nodes:
        ins = [ys[t].reshape(batch * S, hpr * D)[q][None, :, :, None] for t in n]
        for b, xn in zip(n, reference_gather_heads(ins, node_tokens, k)):
            node_out[b] = xn[0, :, :, 0]  # [R_b, k * hpr * D]: rail rank j's block, in order
    for r in range(W):
        x = np.empty((batch, tokens[r], W, hpr * D))
        for j, m in enumerate(rails[a_of[r]]):  # rail peer m sends back rank r's block
            offs = np.cumsum([0] + [batch * tokens[w] for w in rails[a_of[m]]])
            i = rails[a_of[m]].index(r)
            blk = node_out[m][offs[i]:offs[i + 1]]
            x[:, :, list(heads[r][j])] = blk.reshape(batch, tokens[r], k, hpr * D)
        assert np.array_equal(x.reshape(back[r].shape), back[r]), r


# ---- AllGatherAcrossNodes.gather_parts: what the GEMM may read, and when -----------------------
class _Log:
    """A stand-in for streams, events, the rail and the node op: every step appended in host
    order as (what, stream); an event recorded on one stream and waited on another orders
    them."""

    def __init__(self):
        self.steps = []

    def stream(self, name):
        log = self

        class S:
            def wait_event(self, ev):
                log.steps.append(("wait " + ev.on, name))

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False
        S.name = name
        return S()

    def event(self):
        log = self

        class Ev:
            on = None

            def __init__(self, *a, **k):
                pass

            def record(self, stream):
                self.on = stream.name
                log.steps.append(("record", stream.name))
        return Ev


@pytest.mark.parametrize("span,direct", [((2, 4), False), ((3, 4), True), ((0, 1), True),
                                         (None, False)], ids=["node", "one", "first", "none"])
def test_gather_parts_hand_this_nodes_blocks_first_then_the_rest_once(monkeypatch, span,
                                                                      direct):
    """The GEMM's parts cover World blocks 0..W-1 once: this node's span first, on the call's
    stream, while the rail gathers on the side stream (queued after the call's stream is
    recorded: x is there); the rest only after the call's stream waits for the rail. Without
    a span one part, after the whole gather, all on the call's stream."""
    import cupy

    from cuflux.ops.across import AllGatherAcrossNodes

    log, W, rows, cols = _Log(), 4, 3, 8
    monkeypatch.setattr(cupy.cuda, "Event", log.event())
    op = AllGatherAcrossNodes.__new__(AllGatherAcrossNodes)
    k = 1 if span is None else span[1] - span[0]
    op.world = SimpleNamespace(size=W, nodes=SimpleNamespace(num_nodes=W // max(k, 1)))
    op.node = SimpleNamespace(size=k)
    op._span, op._direct, op._side = span, direct, log.stream("side")
    op._rail_rows = np.zeros((W * rows, cols))
    op._own_rows = np.zeros((W * rows, cols))
    s = log.stream("s")
    x, out = np.ones((rows, cols)), np.zeros((W * rows, cols))
    op._checked = lambda x_, out_, stream, more: (x_, out_, s)
    op.rail = SimpleNamespace(all_gather=lambda x_, o, st: log.steps.append(("rail", st.name)))
    op.inner = lambda x_, out, stream: log.steps.append(("node", stream.name))
    op._node_gather = lambda mates, o, st: log.steps.append(("node+order", st.name))
    parts = []

    def part(lo, hi, a):
        assert a.shape == ((hi - lo) * rows, cols), (lo, hi, a.shape)
        parts.append((lo, hi))
        log.steps.append((f"part {lo}:{hi}", "s"))

    assert op.gather_parts(x, out, s, part) is out
    covered = sorted(b for lo, hi in parts for b in range(lo, hi))
    assert covered == list(range(W)), parts
    steps = log.steps
    if span is None:
        assert parts == [(0, W)] and all(st == "s" for _, st in steps)
        return
    assert parts[0] == span
    first, rail = steps.index((f"part {span[0]}:{span[1]}", "s")), steps.index(("rail", "side"))
    assert steps[:2] == [("record", "s"), ("wait s", "side")]  # the rail after x is there
    joined = steps.index(("wait side", "s"))
    assert first < joined and rail < joined  # both queued before the call's stream waits
    later = [steps.index((f"part {lo}:{hi}", "s")) for lo, hi in parts[1:]]
    assert all(i > joined for i in later)
    if not direct:  # this node's own gather before its part; every rank's after the rail
        assert steps.index(("node", "s")) < first
        assert joined < steps.index(("node+order", "s")) < min(later, default=len(steps))


@pytest.mark.parametrize("group_m", [0, -1, 8.0, "8", None])
def test_allgather_gemm_across_nodes_refuses_a_bad_group_m_before_any_collective(group_m):
    """group_m reaches only cuflux.gemm, which would refuse it after the gather was queued:
    the cross-node op refuses it first, before it asks any rank anything."""
    from cuflux.ops.across import AllGatherGemmAcrossNodes

    asked = []
    world = SimpleNamespace(rank=0, size=2, device=0,
                            check_same=lambda *a, **k: asked.append(a))
    with pytest.raises(ValueError, match=r"^AllGatherGemm: group_m must be an int >= 1"):
        AllGatherGemmAcrossNodes(world, max_rows_per_rank=8, n=64, k=64, dtype="bfloat16",
                                 group_m=group_m)
    assert not asked


# ---- a closed cross-node op lets go of its staging ---------------------------------------------
@pytest.mark.parametrize("done_after_polls", [0, 3, None], ids=["idle", "busy", "never"])
def test_close_lets_go_of_the_staging_once_the_last_calls_stream_is_done(monkeypatch,
                                                                         done_after_polls):
    """_let_go records an event behind the last call's stream and drops every _scratch name
    once it is done; work that never finishes within timeout_s keeps them, with a warning
    (CuPy's pool would hand the memory out in another stream's order)."""
    import contextlib
    import warnings

    import cupy

    from cuflux.ops.across import All2AllHeadsAcrossNodes

    recorded = []

    class Ev:
        def __init__(self, *a, **k):
            self.polls = 0

        def record(self, stream):
            recorded.append(stream)

        @property
        def done(self):
            self.polls += 1
            return done_after_polls is not None and self.polls > done_after_polls

    monkeypatch.setattr(cupy.cuda, "Event", Ev)
    op = All2AllHeadsAcrossNodes.__new__(All2AllHeadsAcrossNodes)
    op.world = SimpleNamespace(device_context=contextlib.nullcontext)
    op.timeout_s, op._last_stream = 0.05, object()
    for name in op._scratch:
        setattr(op, name, np.zeros(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        op._let_go()
    assert recorded == [op._last_stream]
    kept = [n for n in op._scratch if getattr(op, n) is not None]
    if done_after_polls is None:
        assert kept == list(op._scratch)
        assert any("still running" in str(w.message) for w in caught), caught
    else:
        assert kept == [] and not caught, (kept, caught)


def test_close_lets_go_of_the_staging_of_an_op_never_called():
    """No call, no stream to wait for: the staging goes at once."""
    from cuflux.ops.across import GemmReduceScatterAcrossNodes

    op = GemmReduceScatterAcrossNodes.__new__(GemmReduceScatterAcrossNodes)
    op._a, op._node_sum = np.zeros(2), np.zeros(2)
    op._let_go()
    assert op._a is None and op._node_sum is None and op._scratch == ("_a", "_node_sum")
