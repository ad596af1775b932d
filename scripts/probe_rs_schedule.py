"""Probe: what GemmReduceScatter's chunked schedules cost the GPU with the communication taken
away (one GPU, one process, GPU-queued): the SM work one rank of a W-rank call queues, against
the same GEMM in one cuBLAS call. This is the floor of route="chunked"'s time on distinct GPUs
(there the copies run on copy engines, beside these kernels), measurable without a second GPU.

Schedules (R = M / W rows per owner, rows of `a` split the way the route splits them):
  cublas        one cuflux.gemm(impl="cublas") of M rows (the issue's bar: 1.03x this)
  matmul        cupy.matmul of the same (the benchmarks' baseline)
  chunked W     W GEMMs of R rows (W - 1 into a staging, the own one into the data region),
                then rs_sum of the W slots into out (today's route)
  fold S        W = 2: S GEMMs of R / S rows into the staging (the peer's chunk, sent as each
                lands), then S GEMMs of the own rows with the received rows as cublasLt's C
                (out = a b + received, one rounding): no summing kernel
  PYTHONPATH=. python scripts/probe_rs_schedule.py [--json PATH]
Its JSON goes under scripts/results/probes/ (not an op benchmark: the charts of
scripts/results/*.json leave it out).
"""
import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

SHAPES = ((8192, 8192, 14336), (4096, 12288, 24576), (8192, 4096, 7168))


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    s = cupy.cuda.Stream(non_blocking=True)
    rows = []
    for M, N, K in SHAPES:
        rows.append(shape_row(M, N, K, s, args))
        cupy.get_default_memory_pool().free_all_blocks()
    write(rows, args, cupy.cuda.runtime.getDevice())


def shape_row(M, N, K, s, args):
    import cupy

    from cuflux import gemm_core as core
    from cuflux import kernels
    from cuflux.arrays import dtype_info
    from cuflux.ops import gemm_rs
    from cuflux.ops.gemm import gemm

    bf = dtype_info("bfloat16")
    dev = cupy.cuda.runtime.getDevice()
    sum_fn = kernels.load("gemm_rs.cu", dev)[gemm_rs.sum_kernel(bf.cuda_type, bf.cuda_type)]
    sms = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    rng = cupy.random.default_rng(M + N + K)
    with s:
        a = (rng.standard_normal((M, K), dtype=cupy.float32) * 0.1).astype(bf.storage)
        b = (rng.standard_normal((N, K), dtype=cupy.float32) * 0.1).astype(bf.storage)
        full = cupy.empty((M, N), bf.storage)
        data = cupy.empty((8 * (M // 2) * N,), bf.storage)  # slots, up to W = 8
        staging = cupy.empty((M, N), bf.storage)
        out = cupy.empty((M // 2, N), bf.storage)

    def cublas():
        gemm(a, b, out=full, b_layout="nk", impl="cublas", stream=s)

    def matmul():
        with s:
            cupy.matmul(a, b.T, out=full)

    def rs_sum(W, R, dst):  # the W slots of R rows of `data`, as ChunkedRs._sum launches it
        elems = R * N
        grid = max(1, min(-(-(elems * 2 // 16) // gemm_rs.SUM_THREADS),
                          gemm_rs.SUM_BLOCKS_PER_SM * sms))
        kernels.launch(sum_fn, (grid,), (gemm_rs.SUM_THREADS,),
                       (data, np.int64(elems), np.int64(elems), np.int32(W), np.int32(N),
                        np.uint64(0), dst), s, op="probe", name="rs_sum")

    def chunked(W):
        R = M // W
        me = 0
        def run():
            peers = [(me + j) % W for j in range(1, W)]
            for j, p in enumerate(peers):
                gemm(a[p * R:(p + 1) * R], b, out=staging[j * R:(j + 1) * R], b_layout="nk",
                     impl="cublas", stream=s)
            gemm(a[me * R:(me + 1) * R], b, out=data[me * R * N:(me + 1) * R * N]
                 .reshape(R, N), b_layout="nk", impl="cublas", stream=s)
            rs_sum(W, R, out[:R])
        return run

    def fold(S):
        R = M // 2
        r = R // S
        recv = data[R * N:2 * R * N].reshape(R, N)  # the peer's partial of our rows

        def run():
            for i in range(S):
                gemm(a[R + i * r:R + (i + 1) * r], b, out=staging[i * r:(i + 1) * r],
                     b_layout="nk", impl="cublas", stream=s)
            for i in range(S):
                ok = core.launch_cublaslt(a[i * r:(i + 1) * r], b, None,
                                          out[i * r:(i + 1) * r], bf, bf, r, N, K, "nk", s,
                                          addend=recv[i * r:(i + 1) * r])
                assert ok, "cublasLt has no algorithm with an addend"
        return run

    s2 = cupy.cuda.Stream(non_blocking=True)
    forked, joined = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)

    def two_streams(fold_c):
        """W = 2 with the own chunk's GEMM on a second stream: its CTAs fill the SMs the peer
        chunk's last wave leaves idle (in the route it also waits for the peer's rows)."""
        R = M // 2
        recv = data[R * N:2 * R * N].reshape(R, N)

        def run():
            forked.record(s)
            s2.wait_event(forked)
            gemm(a[R:], b, out=staging[:R], b_layout="nk", impl="cublas", stream=s)
            if fold_c:
                core.launch_cublaslt(a[:R], b, None, out, bf, bf, R, N, K, "nk", s2,
                                     addend=recv)
            else:
                gemm(a[:R], b, out=data[:R * N].reshape(R, N), b_layout="nk", impl="cublas",
                     stream=s2)
            joined.record(s2)
            s.wait_event(joined)
            if not fold_c:
                rs_sum(2, R, out)
        return run

    variants = {"cublas": cublas, "matmul": matmul, "chunked2": chunked(2),
                "chunked4": chunked(4), "chunked8": chunked(8), "fold1": fold(1),
                "fold2": fold(2), "fold4": fold(4),
                "chunked2_2s": two_streams(False), "fold1_2s": two_streams(True)}
    # correctness of the fold against chunked2's arithmetic (float64 of the same partials)
    with s:
        data[:] = 0
        rng2 = cupy.random.default_rng(7)
        recv = data[(M // 2) * N:M * N].reshape(M // 2, N)
        recv[...] = (rng2.standard_normal(recv.shape, dtype=cupy.float32)).astype(
            bf.storage)
    fold(2)()
    s.synchronize()
    ref = (a[:M // 2].astype(cupy.float64) @ b.T.astype(cupy.float64)
           + recv.astype(cupy.float64))
    err = float(cupy.abs(out.astype(cupy.float64) - ref).max() / cupy.abs(ref).max())
    with s:  # the same with a bias (cublasLt's bias epilogue), fp32 out
        bias = (rng2.standard_normal((N,), dtype=cupy.float32) * 4).astype(bf.storage)
        r = 256
        out32 = cupy.full((r, N), cupy.nan, cupy.float32)
        add32 = recv[:r].astype(cupy.float32)
    ok = core.launch_cublaslt(a[:r], b, bias, out32, bf, dtype_info("float32"), r, N, K,
                              "nk", s, addend=add32)
    s.synchronize()
    ref = (a[:r].astype(cupy.float64) @ b.T.astype(cupy.float64)
           + recv[:r].astype(cupy.float64) + bias.astype(cupy.float64)[None, :])
    err_bias = (float(cupy.abs(out32 - ref).max() / cupy.abs(ref).max()) if ok
                else None)
    for fn in variants.values():  # warm: plans, tuner, workspace
        fn()
    s.synchronize()
    times = {k: [] for k in variants}
    ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
    for rnd in range(args.rounds):
        order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
        for k in order:
            fn = variants[k]
            ev0.record(s)
            for _ in range(args.reps):
                fn()
            ev1.record(s)
            ev1.synchronize()
            times[k].append(cupy.cuda.get_elapsed_time(ev0, ev1) / args.reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    algos = {}
    for m in (M, M // 2, M // 4):
        try:
            algos[f"{m}x{N}x{K}"] = algo_sweep(core, bf, a[:m], b, full[:m], m, N, K, s, args)
        except Exception as e:  # a probe: report and go on
            print(f"  algo sweep {m}x{N}x{K} failed: {e!r}", flush=True)
    row = {"M": M, "N": N, "K": K, "ms": med,
           "to_cublas": {k: med[k] / med["cublas"] for k in med},
           "fold_rel_err": err, "fold_bias_f32_rel_err": err_bias,
           "cublaslt_algos": algos}
    for shape, al in algos.items():
        t = al["tuned"]
        print(f"  cublasLt algos {shape}: heuristic #0 {al['ms'][0]:.3f} ms, best #{al['best']} "
              f"{min(al['ms']):.3f} ms ({min(al['ms']) / al['ms'][0]:.3f}x), of {len(al['ms'])}; "
              f"tuner's pick #{t}" + (f" {al['ms'][t] / al['ms'][0]:.3f}x" if t is not None
                                       else "") + ("" if al["tuned_done"] else " (untuned)"))
    print(f"{M}x{N}x{K}: " + ", ".join(f"{k} {v:.3f} ms ({v / med['cublas']:.3f}x)"
                                       for k, v in med.items())
          + f"; fold max rel err {err:.2e}, with bias (fp32 out) {err_bias}", flush=True)
    return row


def algo_sweep(core, bf, a, b, out, M, N, K, s, args):
    """The candidates of cuflux.gemm's own cublasLt plan for the shape (the heuristic's first
    ALGO_CANDIDATES, 256-byte alignment), each timed sustained (interleaved rounds of blocks,
    median), beside the one the tuner picked (the plan's algo)."""
    import cupy

    lt = core._cublaslt()
    plan = lt.plan(0, bf, bf, M, N, K, "nk")
    ws = core._cublas().workspace(0, s.ptr, False)

    def run(algo):
        lt._check("matmul", core._matmul(lt, plan, algo, a, b, None, out, ws, s, None))

    for al in plan.algos:
        run(al)
    ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
    times = [[] for _ in plan.algos]
    for _ in range(max(3, args.rounds // 2)):
        for i, al in enumerate(plan.algos):
            ev0.record(s)
            for _ in range(args.reps):
                run(al)
            ev1.record(s)
            ev1.synchronize()
            times[i].append(cupy.cuda.get_elapsed_time(ev0, ev1) / args.reps)
    ms = [statistics.median(t) for t in times]
    picked = next((i for i, al in enumerate(plan.algos) if al is plan.algo), None)
    return {"ms": ms, "best": min(range(len(ms)), key=ms.__getitem__), "tuned": picked,
            "tuned_done": plan.tuned}


def write(rows, args, dev):
    import cupy

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"probe": "rs_schedule", "machine": platform.node(),
                       "gpu": cupy.cuda.runtime.getDeviceProperties(dev)["name"].decode(),
                       "command": " ".join(sys.argv), "regime": "GPU-queued, one GPU, "
                       "no communication (SM work of one rank's call)",
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
