"""Every op on a World of several nodes (issue 20) against the plain NCCL (+ cuBLAS) composition.

The World is this run's ranks split into nodes of CUFLUX_NODE_SIZE ranks (default 1: every rank
its own node, so two GPUs of one host stand for two nodes and the rail between them is NCCL over
NVLink; a real network changes the link rate, not the design). Per case, bfloat16:

  allreduce   AllReduce of n elements           vs NCCL all-reduce
  norm        AllReduceRMSNorm, replicated      vs NCCL all-reduce + rmsnorm_residual
  allgather   AllGather of [rows, 8192]         vs NCCL all-gather
  all2all     All2AllHeads.scatter_heads        vs NCCL send/recv all-to-all + 2 permutes
  ag_gemm     AllGatherGemm [W rows, k] x [k, n] vs NCCL all-gather + cupy.matmul; also the
              same op with overlap off (serial_ms: the whole gather, then one GEMM)
  gemm_rs     GemmReduceScatter [M, k] x [k, n] vs cupy.matmul + NCCL reduce-scatter

Regimes (cuflux.bench.__main__.REGIMES_DOC): cuflux_ms / nccl_ms / speedup are GPU-queued (the
two timed in interleaved rounds, the slowest rank's median); user_loop_ms, host_us and their
nccl_ counterparts are back-to-back calls from Python (no graph: the host-staged rail cannot be
captured, and the node All2AllHeads is read through its receive slot). Every case is checked
once against the NCCL composition's result before it is timed (bfloat16 sums: within 2e-2
relative). Ranks sharing one GPU run the ops for correctness only: NCCL refuses two ranks on
one GPU, so the rail is staged through the host, nothing is compared and no speed is measured.
"""
from __future__ import annotations

from cuflux.bench.__main__ import (bench_extra, measure_regimes, on_stream, print_bench_table,
                                   regime_calls, speed_header, speed_measured)
from cuflux.bench.common import nccl_comm, ranks_share_gpu, time_interleaved, write_results

HEADS, HEAD_DIM = 32, 128   # All2AllHeads: a Llama-style attention layer
TOLERANCE = 2e-2  # max relative difference from the NCCL composition (bfloat16 sums)
N_FFN, K_HIDDEN = 8192, 8192  # the GEMM ops: [*, 8192] x [8192, 8192]


def _cases(W: int, quick: bool) -> list[tuple[str, int]]:
    """(op, size): elements (allreduce), tokens (norm, all2all: per rank), rows per rank."""
    sizes = {"allreduce": [1 << 20, 1 << 24] if quick else [1 << 16, 1 << 20, 1 << 22, 1 << 24],
             "norm": [128, 4096] if quick else [16, 128, 1024, 4096],
             "allgather": [1024] if quick else [128, 1024, 4096],
             "all2all": [1024] if quick else [512, 2048, 8192],
             "ag_gemm": [1024] if quick else [256, 1024, 2048],
             "gemm_rs": [1024] if quick else [256, 1024, 2048]}
    return [(op, n) for op, ns in sizes.items() for n in ns]


def _pair(world, nodes, op: str, n: int, nccl, stream):
    """(cuflux call, NCCL call or None, check() -> max relative difference or None, label,
    closer) for one case; every call enqueues on `stream`."""
    import cupy

    import cuflux
    from cuflux.arrays import dtype_info
    from cuflux.ops.allreduce import rmsnorm_residual

    W, me = world.size, world.rank
    bf = dtype_info("bfloat16").storage
    rnd = cupy.random.default_rng(1000 * me + n)

    def randn(*shape, scale=1.0):
        return (rnd.standard_normal(shape, dtype=cupy.float32) * scale).astype(bf)

    lib, comm = nccl if nccl is not None else (None, None)
    BF16 = lib.NCCL_BFLOAT16 if lib is not None else None
    if op == "allreduce":
        x, out, ref = randn(n), cupy.empty(n, bf), cupy.empty(n, bf)
        o = cuflux.AllReduce(nodes, n, "bfloat16")
        return (lambda: o(x, out=out, stream=stream),
                comm and (lambda: comm.allReduce(x.data.ptr, ref.data.ptr, n, BF16, lib.NCCL_SUM,
                                                 stream.ptr)),
                lambda: (out, ref), f"AllReduce n={n}", o)
    if op == "norm":
        H = 8192
        x, res, w = randn(n, H), randn(n, H), randn(H)
        res0, out, ref, y = res.copy(), cupy.empty((n, H), bf), cupy.empty((n, H), bf), \
            cupy.empty((n, H), bf)
        o = cuflux.AllReduceRMSNorm(nodes, n, H, "bfloat16")

        def ours():
            with stream:
                res[...] = res0  # the op adds into the residual: each call from the same one
            o(x, res, w, out=out, stream=stream)

        r = cupy.empty_like(res0)

        def theirs():
            comm.allReduce(x.data.ptr, y.data.ptr, x.size, BF16, lib.NCCL_SUM, stream.ptr)
            with stream:
                r[...] = res0
            rmsnorm_residual(y, r, w, eps=o.eps, out=ref, stream=stream)
        return ours, comm and theirs, lambda: (out, ref), f"AllReduceRMSNorm T={n} H={H}", o
    if op == "allgather":
        cols = 8192
        x, out, ref = randn(n, cols), cupy.empty((W * n, cols), bf), cupy.empty((W * n, cols), bf)
        o = cuflux.AllGather(nodes, n, cols, "bfloat16")
        return (lambda: o(x, out=out, stream=stream),
                comm and (lambda: comm.allGather(x.data.ptr, ref.data.ptr, x.nbytes,
                                                 lib.NCCL_UINT8, stream.ptr)),
                lambda: (out, ref), f"AllGather [{n}, {cols}] a rank", o)
    if op == "all2all":
        heads = HEADS if HEADS % W == 0 else 4 * W  # the heads must split over the ranks
        hpr, T = heads // W, n
        x, out, ref = randn(1, T, heads, HEAD_DIM), cupy.empty((1, W * T, hpr, HEAD_DIM), bf), \
            cupy.empty((1, W * T, hpr, HEAD_DIM), bf)
        send, recv = cupy.empty((W, T, hpr, HEAD_DIM), bf), cupy.empty((W, T, hpr, HEAD_DIM), bf)
        tokens = (T,) * W
        o = cuflux.All2AllHeads(nodes, T, heads, HEAD_DIM, "bfloat16")

        def theirs():
            with stream:
                send[...] = x.reshape(T, W, hpr, HEAD_DIM).transpose(1, 0, 2, 3)
            lib.groupStart()
            for p in range(W):
                comm.send(send[p].data.ptr, send[p].nbytes, lib.NCCL_UINT8, p, stream.ptr)
                comm.recv(recv[p].data.ptr, recv[p].nbytes, lib.NCCL_UINT8, p, stream.ptr)
            lib.groupEnd()
            with stream:
                ref.reshape(W, T, hpr, HEAD_DIM)[...] = recv
        return (lambda: o.scatter_heads(x, tokens, out=out, stream=stream), comm and theirs,
                lambda: (out, ref), f"All2AllHeads T={T} a rank, {heads}x{HEAD_DIM}", o)
    rows = n
    if op == "ag_gemm":
        a, b = randn(rows, K_HIDDEN), randn(K_HIDDEN, N_FFN, scale=0.02)
        gathered = cupy.empty((W * rows, K_HIDDEN), bf)
        out, ref = cupy.empty((W * rows, N_FFN), bf), cupy.empty((W * rows, N_FFN), bf)
        o = cuflux.AllGatherGemm(nodes, W * rows, N_FFN, K_HIDDEN, "bfloat16")

        def theirs():
            comm.allGather(a.data.ptr, gathered.data.ptr, a.nbytes, lib.NCCL_UINT8, stream.ptr)
            with stream:
                cupy.matmul(gathered, b, out=ref)
        return (lambda: o(a, b, out=out, stream=stream), comm and theirs, lambda: (out, ref),
                f"AllGatherGemm [{W}x{rows}, {K_HIDDEN}] x [{K_HIDDEN}, {N_FFN}]", o)
    M = W * rows  # gemm_rs: every rank's full [M, k] product, M / W rows out
    a, b = randn(M, K_HIDDEN), randn(K_HIDDEN, N_FFN, scale=0.02)
    partial = cupy.empty((M, N_FFN), bf)
    out, ref = cupy.empty((rows, N_FFN), bf), cupy.empty((rows, N_FFN), bf)
    o = cuflux.GemmReduceScatter(nodes, M, N_FFN, K_HIDDEN, "bfloat16")

    def theirs():
        with stream:
            cupy.matmul(a, b, out=partial)
        comm.reduceScatter(partial.data.ptr, ref.data.ptr, ref.size, BF16, lib.NCCL_SUM,
                           stream.ptr)
    return (lambda: o(a, b, out=out, stream=stream), comm and theirs, lambda: (out, ref),
            f"GemmReduceScatter [{M}, {K_HIDDEN}] x [{K_HIDDEN}, {N_FFN}]", o)


def _serial(op, call):
    """`call` with the op's overlap off for that call (every rank runs the same sequence of
    variants, so all switch together)."""
    def serial():
        op.overlap = False
        try:
            call()
        finally:
            op.overlap = True
    return serial


def _rail_kind(op) -> str:
    """"nccl" or "host": the rail of a cross-node op (its own, or its parts')."""
    for holder in (op, getattr(op, "sum", None), getattr(op, "inner", None)):
        rail = getattr(holder, "rail", None)
        if rail is not None:
            return rail.kind
    return "none (one node)"


def _rel(pair) -> float:
    import cupy

    got, want = (p.astype(cupy.float32) for p in pair)
    return float(cupy.abs(got - want).max() / (cupy.abs(want).max() + 1e-30))


def run(world, args):
    import cupy
    from mpi4py import MPI

    import cuflux

    W = world.size
    if W == 1:
        if world.rank == 0:
            print("across: one rank is one node; run it under mpirun -np W (W > 1)")
        return None
    from cuflux import knobs

    node_size = knobs.node_size() or 1  # CUFLUX_NODE_SIZE; unset: every rank its own node
    shared_gpu = ranks_share_gpu(world)
    measured = speed_measured(W, shared_gpu)
    nccl = nccl_comm(world, shared_gpu)
    nodes = cuflux.World(MPI.COMM_WORLD, device=world.device, timeout_s=60, node_size=node_size)
    stream = cupy.cuda.Stream(non_blocking=True)
    iters = args.iters if measured else 2
    rows = []
    with nodes.device_context():
        for op, n in _cases(W, args.quick):
            ours, theirs, outputs, label, closer = _pair(world, nodes, op, n, nccl, stream)
            cupy.cuda.Device().synchronize()  # inputs made on the default stream: landed
            with closer:
                row = {"case": label, "op": op, "nodes": nodes.nodes.num_nodes,
                       "node_size": nodes.nodes.node_size, "rail": _rail_kind(closer),
                       "baseline": ("NCCL" + (" + cuBLAS" if "gemm" in op else ""))
                       if theirs else None}
                ours()
                if theirs:
                    theirs()
                closer.synchronize(stream)
                stream.synchronize()
                row["max_rel_diff"] = max(world.allgather(_rel(outputs()))) if theirs else None
                row["correct"] = None if not theirs else row["max_rel_diff"] < TOLERANCE
                if row["correct"] is False and world.rank == 0:
                    print(f"across: {label}: WRONG, max relative difference "
                          f"{row['max_rel_diff']:.3g} from the NCCL composition")
                fns = {"cuflux_ms": ours} | ({"nccl_ms": theirs} if theirs else {})
                if hasattr(closer, "overlap"):  # AllGatherGemm across nodes: what overlap buys
                    fns["serial_ms"] = _serial(closer, ours)
                world.barrier()
                ms = time_interleaved(fns, rounds=3 if measured else 1, iters=iters,
                                      stream=stream, before=world.barrier)
                closer.synchronize(stream)
                row.update({k: max(world.allgather(v)) for k, v in ms.items()})
                if theirs:
                    row["speedup"] = row["nccl_ms"] / row["cuflux_ms"]
                if "serial_ms" in row:
                    row["overlap_speedup"] = row["serial_ms"] / row["cuflux_ms"]
                calls = regime_calls(row["cuflux_ms"], args.quick, measured)
                row.update({k: v for k, v in measure_regimes(
                    [("", on_stream(ours, stream), "cuflux"),
                     ("nccl_", on_stream(theirs, stream) if theirs else None, "NCCL")],
                    stream, calls=calls, world=world, graph=False).items()
                    if not k.endswith("graph_ms")})
                closer.synchronize(stream)
                rows.append(row)
    nodes.close()
    if world.rank != 0:
        return None
    print(speed_header("across", W, shared_gpu))
    cols = ["case", "rail", "correct", "cuflux_ms", "nccl_ms", "speedup", "serial_ms",
            "overlap_speedup", "max_rel_diff",
            "user_loop_ms",
            "nccl_user_loop_ms", "host_us", "nccl_host_us"]
    print_bench_table(rows, cols, set(cols) - {"case", "rail", "correct", "max_rel_diff"},
                      measured)
    return write_results("across", W, rows, bench_extra(args, measured, node_size=node_size,
                                                        ranks_share_gpu=shared_gpu),
                         outdir=args.outdir)
