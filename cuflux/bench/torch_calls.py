"""Torch-caller benchmark: the memoized ops called with torch tensors, as cuflux.torch and a
PyTorch user call them (outputs left to the op, torch's current stream), beside the same op
with torch out=, the same op with CuPy arrays, and torch's own kernels for the same work on
one GPU. What it answers: does a torch caller pay more host time than a CuPy caller (torch in,
torch out: no DLPack handshake, outputs from torch's allocator, calls replayed by the memo)?

One rank measures (W = 1 is the case: the host path does not depend on W; the collectives'
rows at W > 1 need ranks on distinct GPUs and are left to the other benches). Needs torch:
without it the bench says so and writes nothing.

Columns, per variant prefix ("" cuflux with torch tensors, owned output; "out_" the same with
out=; "cupy_" the same op with CuPy arrays, owned output, stream=; "baseline_" torch's own
kernels for the work on one GPU, named in `baseline`):
  user_loop_ms  back-to-back calls from Python, nothing held, wall time per call
  host_us       host time per call alone (issued while the GPU is held)
No graph regime: torch callers capture with torch.cuda.graph, whose allocator pool this
bench does not set up (the CuPy benches report graph_ms). No GPU-queued column either, so
`--plot` draws no chart of it.
"""
from __future__ import annotations

from cuflux.arrays import external_stream
from cuflux.bench.__main__ import (add_note, add_speedups, bench_extra, measure_regimes,
                                   print_bench_table, speed_header)
from cuflux.bench.common import write_results

NORM_CASES = ((1, 4096), (128, 4096), (1, 8192), (128, 8192))  # (T, H) bf16
PLAIN_ELEMS = (2048, 1 << 19)  # bf16 elements: 4 KiB, 1 MiB
GEMM_CASES = ((1, 8192, 8192), (16, 8192, 8192), (128, 8192, 8192))  # M, N, K, b "nk"
A2A_CASES = ((1024, 32, 128),)  # T, heads, head_dim, bf16
QUICK = {"norm": NORM_CASES[:2], "plain": PLAIN_ELEMS[:1], "gemm": GEMM_CASES[::2],
         "a2a": A2A_CASES}


def _rows(world, args, torch, cs):
    import cupy

    import cuflux

    dev = torch.device("cuda", world.device)
    bf16 = torch.bfloat16
    quick = args.quick
    rows = []

    def measure(case, variants, baseline, **fields):
        row = {"case": case, "baseline": baseline, **fields}
        notes = []
        row.update(measure_regimes(variants, cs, calls=100, graph=False, notes=notes))
        add_note(row, *notes)
        for p in ("out_", "cupy_", "baseline_"):
            if row.get(p + "user_loop_ms") and row.get("user_loop_ms"):
                row[p + "over_torch_owned"] = row[p + "user_loop_ms"] / row["user_loop_ms"]
        rows.append(add_speedups(row))  # user_loop_speedup: torch's kernels over cuflux's
        print(f"{case}: user loop {row['user_loop_ms'] * 1e3:.1f} us (torch owned), host "
              f"{row['host_us']:.1f} us; cupy host {row.get('cupy_host_us') or 0:.1f} us; "
              f"torch baseline host {row.get('baseline_host_us') or 0:.1f} us", flush=True)

    cu = cupy.from_dlpack  # the same data as CuPy (outside the timed calls)

    with cuflux.AllReduceRMSNorm(world, 128, 8192, "bfloat16") as n8, \
            cuflux.AllReduceRMSNorm(world, 128, 4096, "bfloat16") as n4:
        for T, H in (QUICK["norm"] if quick else NORM_CASES):
            norm = n4 if H == 4096 else n8
            x, res, out = (torch.randn(T, H, dtype=bf16, device=dev) for _ in range(3))
            w = torch.randn(H, dtype=bf16, device=dev)
            cx, cres, cw = cu(x.clone()), cu(res.clone()), cu(w)
            measure(f"AllReduceRMSNorm T={T} H={H} bf16", [
                ("", lambda: norm(x, res, w), "cuflux torch owned"),
                ("out_", lambda: norm(x, res, w, out=out), "cuflux torch out="),
                ("cupy_", lambda: norm(cx, cres, cw, stream=cs), "cuflux cupy owned"),
                ("baseline_", lambda: torch.nn.functional.rms_norm(res.add_(x), (H,), w, 1e-6),
                 "torch res.add_ + F.rms_norm")],
                "torch: res.add_(x), F.rms_norm (one GPU: no all-reduce)", op="norm", T=T, H=H)
    with cuflux.AllReduce(world, 1 << 20, "bfloat16") as ar:
        for n in (QUICK["plain"] if quick else PLAIN_ELEMS):
            x, out = (torch.randn(n, dtype=bf16, device=dev) for _ in range(2))
            cx = cu(x.clone())
            measure(f"AllReduce {2 * n // 1024} KiB bf16", [
                ("", lambda: ar(x), "cuflux torch owned"),
                ("out_", lambda: ar(x, out=out), "cuflux torch out="),
                ("cupy_", lambda: ar(cx, stream=cs), "cuflux cupy owned"),
                ("baseline_", lambda: x.clone(), "torch x.clone()")],
                "torch: x.clone() (one GPU: the sum over one rank is a copy)", op="allreduce",
                bytes=2 * n)
    for M, N, K in (QUICK["gemm"] if quick else GEMM_CASES):
        a = torch.randn(M, K, dtype=bf16, device=dev)
        b = torch.randn(N, K, dtype=bf16, device=dev) * K ** -0.5
        out = torch.empty(M, N, dtype=bf16, device=dev)
        ca, cb = cu(a), cu(b)
        measure(f"gemm {M}x{N}x{K} nk bf16", [
            ("", lambda: cuflux.gemm(a, b, b_layout="nk"), "cuflux torch owned"),
            ("out_", lambda: cuflux.gemm(a, b, out=out, b_layout="nk"), "cuflux torch out="),
            ("cupy_", lambda: cuflux.gemm(ca, cb, b_layout="nk", stream=cs),
             "cuflux cupy owned"),
            ("baseline_", lambda: torch.nn.functional.linear(a, b), "torch F.linear")],
            "torch: F.linear(a, b)", op="gemm", M=M, N=N, K=K)
    for T, NH, D in (QUICK["a2a"] if quick else A2A_CASES):
        with cuflux.All2AllHeads(world, T, NH, D, "bfloat16") as op:
            tokens = (T,) * world.size
            x = torch.randn(1, T, NH, D, dtype=bf16, device=dev)
            out = torch.empty(1, T * world.size, NH // world.size, D, dtype=bf16, device=dev)
            cx = cu(x.clone())
            measure(f"All2AllHeads scatter T={T} H={NH} D={D} bf16", [
                ("", lambda: op.scatter_heads(x, tokens), "cuflux torch owned"),
                ("out_", lambda: op.scatter_heads(x, tokens, out=out), "cuflux torch out="),
                ("cupy_", lambda: op.scatter_heads(cx, tokens, stream=cs), "cuflux cupy owned"),
                ("baseline_", lambda: x.clone(), "torch x.clone()")],
                "torch: x.clone() (one GPU: scatter over one rank is a copy)", op="a2a", T=T)
    return rows


def run(world, args):
    try:
        import torch
    except ImportError:
        if world.rank == 0:
            print("torch: not installed, nothing measured (pip install torch)")
        return None

    if world.size > 1:
        if world.rank == 0:
            print("torch: one rank measures the torch caller's host path; run it at W = 1 "
                  "(the collectives' rows at W > 1 are the other benches')")
        return None
    torch.cuda.set_device(world.device)
    ts = torch.cuda.Stream(device=world.device)
    cs = external_stream(ts.cuda_stream, world.device)
    prev = torch.cuda.current_stream(world.device)
    torch.cuda.set_stream(ts)  # torch's current stream, once (a `with` per call is not ours)
    try:
        rows = _rows(world, args, torch, cs)
    finally:
        ts.synchronize()
        torch.cuda.set_stream(prev)
    print(speed_header("torch", 1, False))
    cols = ["case", "user_loop_ms", "out_user_loop_ms", "cupy_user_loop_ms",
            "baseline_user_loop_ms", "user_loop_speedup", "host_us", "out_host_us",
            "cupy_host_us", "baseline_host_us", "baseline"]
    print_bench_table(rows, cols, set(cols) - {"case", "baseline"}, True)
    path = write_results("torch", 1, rows, bench_extra(
        args, True, torch_version=torch.__version__,
        variants={"": "cuflux, torch tensors, output left to the op, torch's current stream",
                  "out_": "cuflux, torch tensors, out= given",
                  "cupy_": "cuflux, the same op with CuPy arrays, stream=",
                  "baseline_": "torch's own kernels for the work on one GPU (row's baseline)"}),
        outdir=args.outdir)
    print("wrote", path)
    return path
