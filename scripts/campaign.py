"""Reliability campaigns of issue 19; figures for the README's reliability section.

  soak   (under mpirun, any W): every op called back to back N times with the sizes changing
         every call, no host sync between checks; every `--check-every`-th call (and the last)
         is synchronised and compared with the float64 NumPy reference built from every rank's
         input (all-gathered), bit for bit where the op moves data, within fp32 rounding where
         it sums. Writes campaign-soak-<machine>-W<W>-<date>.json.
  kill   (a launcher: starts W ranks itself over torch.distributed gloo, so no MPI runtime
         tears the job down when one dies): the ranks call an op in a loop; the last rank
         SIGKILLs itself right after launching a call. The survivors must raise
         CommTimeoutError within timeout + 2 s of the kill, abort the op and exit 0 within a
         bound. Writes campaign-kill-<machine>-W<W>-<date>.json.
  small  (under mpirun, W = 1 or 2): three small checked calls of each op, of AllGather and
         AllGatherGemm built with path="sm" (SM_PATH_OPS), and of GemmReduceScatter and
         AllGatherGemm with route="fused" (FUSED_OPS), and of GemmReduceScatter with
         route="chunked" (copy engines, rs_sum), each synchronised: the workload
         compute-sanitizer runs (memcheck, racecheck, synccheck).

  mpirun -np 4 python scripts/campaign.py soak --calls 10000 --outdir scripts/results/campaigns
  python scripts/campaign.py kill --world 2 --outdir scripts/results/campaigns
  mpirun -np 2 compute-sanitizer --tool memcheck python scripts/campaign.py small
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

OPS = ("allreduce", "norm", "all2all", "allgather", "gemm_rs", "ag_gemm")
# The same op on its SM-copy path (path="sm": one kernel a call instead of copy engines).
SM_PATH_OPS = ("allgather_sm", "ag_gemm_sm")
# The fused GEMM ops forced onto their fused kernels (route="fused"): the small shapes here
# (M < 256) run unfused under route="auto", so the sanitizer would never see those kernels.
FUSED_OPS = ("gemm_rs_fused", "ag_gemm_fused")
# GemmReduceScatter's cuBLAS chunks moved by copy engines (route="chunked", issue 15).
CHUNKED_OPS = ("gemm_rs_chunked",)
VARIANTS = SM_PATH_OPS + FUSED_OPS + CHUNKED_OPS
H_NORM = 1024  # hidden size of the AllReduceRMSNorm soak
KILL_SLACK_S = 2.0  # issue 19: the survivors raise within timeout + 2 s


# ---- one op: (make, call(i) -> (inputs kept for the check, output), check) -------------------
class Case:
    """An op under soak: `issue(i)` queues call i (sizes from i, the same on every rank) and
    returns what `check(i, state)` needs to compare call i with the reference."""

    def __init__(self, world, kind: str, timeout_s: float):
        import cupy

        import cuflux

        if kind not in OPS + VARIANTS:
            raise ValueError(f"unknown op {kind!r}; known: {', '.join(OPS + VARIANTS)}")
        path = "sm" if kind in SM_PATH_OPS else "copy"
        route = "fused" if kind in FUSED_OPS else "chunked" if kind in CHUNKED_OPS else "auto"
        kind = kind.removesuffix("_sm").removesuffix("_fused").removesuffix("_chunked")
        self.cp, self.world, self.kind = cupy, world, kind
        W = world.size
        self.W, self.me = W, world.rank
        if kind == "allreduce":
            self.op = cuflux.AllReduce(world, 1 << 16, "float32", timeout_s=timeout_s)
        elif kind == "norm":
            self.op = cuflux.AllReduceRMSNorm(world, 64, H_NORM, "float32", timeout_s=timeout_s)
            self.weight = cupy.asarray(self._rng(0, 0).standard_normal(H_NORM, np.float32))
        elif kind == "all2all":
            self.op = cuflux.All2AllHeads(world, 16, 2 * W, 64, "float16", timeout_s=timeout_s)
        elif kind == "allgather":
            self.op = cuflux.AllGather(world, 16, 136, "float32", timeout_s=timeout_s,
                                       path=path)
        elif kind == "gemm_rs":
            self.op = cuflux.GemmReduceScatter(world, 64 * W, 128, 64, "float16",
                                               timeout_s=timeout_s, route=route)
        elif kind == "ag_gemm":
            self.op = cuflux.AllGatherGemm(world, 16 * W, 128, 64, "float16", timeout_s=timeout_s,
                                           path=path, route=route)

    def _rng(self, i, r):
        return np.random.default_rng([i, r, OPS.index(self.kind)])

    def _ints(self, i, r, shape):  # small integers: fp16 GEMMs then sum exactly in fp32
        return self._rng(i, r).integers(-2, 3, shape).astype(np.float16)

    def issue(self, i):
        cp, W, me, op = self.cp, self.W, self.me, self.op
        if self.kind == "allreduce":
            n = 1 + (i * 7919) % (1 << 16)
            x = self._rng(i, me).standard_normal(n, np.float32)
            return x, op(cp.asarray(x), algo=("auto", "one_shot", "two_shot")[i % 3])
        if self.kind == "norm":
            T = 1 + (i * 37) % 64
            x = self._rng(i, me).standard_normal((T, H_NORM), np.float32)
            res = self._rng(i, 99).standard_normal((T, H_NORM), np.float32)  # same on every rank
            residual = cp.asarray(res)
            return (x, res), (op(cp.asarray(x), residual, self.weight), residual)
        if self.kind == "all2all":
            tokens = [(i * 5 + 3 * r) % 17 for r in range(W)]  # 0..16, uneven, some empty
            x = self._rng(i, me).standard_normal((1, tokens[me], 2 * W, 64)).astype(np.float16)
            return (x, tokens), op.scatter_heads(cp.asarray(x), tokens)
        if self.kind == "allgather":
            rows = 1 + (i * 11) % 16
            x = self._rng(i, me).standard_normal((rows, 136), np.float32)
            return x, op(cp.asarray(x))
        if self.kind == "gemm_rs":
            M = W * (1 + (i * 13) % 64)
            a, b = self._ints(i, me, (M, 64)), self._ints(i, 100 + me, (64, 128))
            return (a, b), op(cp.asarray(a), cp.asarray(b))
        rows = 1 + (i * 5) % 16
        a, b = self._ints(i, me, (rows, 64)), self._ints(i, 100 + me, (64, 128))
        return (a, b), op(cp.asarray(a), cp.asarray(b))

    def check(self, i, kept, got) -> None:
        import cuflux

        W, me = self.W, self.me
        every = self.world.allgather(kept)  # every rank's inputs of call i
        if self.kind == "allreduce":
            want = cuflux.reference_allreduce(every)
            _close(got.get(), want, 2e-5, f"allreduce call {i}")
        elif self.kind == "norm":
            xs = [e[0] for e in every]
            out, h = cuflux.reference_allreduce_rmsnorm(xs, kept[1], self.weight.get(), 1e-6,
                                                        "replicated", W)[me]
            _close(got[0].get(), out, 2e-5, f"norm call {i} out")
            _close(got[1].get(), h, 2e-5, f"norm call {i} residual")
        elif self.kind == "all2all":
            want = cuflux.reference_scatter_heads([e[0] for e in every], kept[1], W)[me]
            _exact(got.get(), want, f"all2all call {i}")
        elif self.kind == "allgather":
            _exact(got.get(), np.concatenate(every), f"allgather call {i}")
        elif self.kind == "gemm_rs":
            want = cuflux.reference_gemm_rs([e[0] for e in every], [e[1] for e in every],
                                            rank=me)
            _exact(got.get().astype(np.float64), want, f"gemm_rs call {i}")
        else:
            want = cuflux.reference_ag_gemm([e[0] for e in every], [e[1] for e in every])[me]
            _exact(got.get().astype(np.float64), want, f"ag_gemm call {i}")

    def close(self):
        self.op.close()


def _close(got, want, rtol, what):
    g = np.asarray(got, np.float64)
    bad = ~(np.abs(g - want) <= rtol + rtol * np.abs(want))
    if bad.any():
        j = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} off, first {j}: "
                             f"{g[j]!r} vs {want[j]!r}")


def _exact(got, want, what):
    if got.shape != want.shape or not np.array_equal(np.asarray(got), np.asarray(want, got.dtype)):
        raise AssertionError(f"{what}: differs from the reference (shape {got.shape} vs "
                             f"{want.shape})")


def _machine() -> str:
    from cuflux.bench.common import machine_name

    return machine_name()


def _write(outdir, name, W, doc) -> pathlib.Path:
    date = datetime.date.today().isoformat()
    doc = dict({"campaign": name, "machine": _machine(), "date": date, "world_size": W,
                "command": " ".join(["python scripts/campaign.py"] + sys.argv[1:])}, **doc)
    path = pathlib.Path(outdir) / f"campaign-{name}-{doc['machine']}-W{W}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return path


# ---- soak --------------------------------------------------------------------------------------
def soak(args) -> int:
    import cuflux

    world = cuflux.init(timeout_s=60)
    rows = []
    regime = "user loop (ranks share one GPU: correctness, not speed)"
    with world.device_context():
        for kind in args.ops.split(","):
            case = Case(world, kind, timeout_s=60)
            world.barrier()
            t0 = time.perf_counter()
            checked = i = 0
            try:
                for i in range(args.calls):
                    kept, got = case.issue(i)
                    if i % args.check_every == 0 or i == args.calls - 1:
                        case.op.synchronize()
                        case.check(i, kept, got)
                        checked += 1
                case.op.synchronize()
            except Exception as e:  # every rank that fails says how, in a file of its own
                row = {"op": kind, "failed_at_call": i, "checked": checked,
                       "error": f"{type(e).__name__}: {str(e)[:400]}"}
                print(f"soak W={world.size} rank {world.rank} {kind}: {row['error']}", flush=True)
                if args.outdir:
                    _write(args.outdir, f"soak-rank{world.rank}", world.size,
                           {"regime": regime, "rows": rows + [row]})
                case.op.abort()
                raise
            wall_s = time.perf_counter() - t0
            case.close()
            rows.append({"op": kind, "calls": args.calls, "checked": checked, "wall_s": wall_s,
                         "us_per_call": 1e6 * wall_s / args.calls, "errors": 0})
            if world.rank == 0:
                print(f"soak W={world.size} {kind}: {args.calls} calls, {checked} checked "
                      f"against the reference, {wall_s:.1f} s", flush=True)
                if args.outdir:  # after every op: a run cut short keeps what it finished
                    path = _write(args.outdir, "soak", world.size,
                                  {"regime": regime, "rows": rows})
    if world.rank == 0 and args.outdir:
        print(path)
    world.close()
    return 0


# ---- kill -9 -----------------------------------------------------------------------------------
_KILL_RANK = """# cuflux-campaign-rank (scripts/gpu.sh's sweep finds a stray one by this)
import json, os, signal, sys, time
sys.path.insert(0, os.environ["ROOT"])
import torch.distributed as dist
import cuflux
sys.path.insert(0, os.path.join(os.environ["ROOT"], "scripts"))
from campaign import Case
from cuflux.errors import CommTimeoutError
rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
timeout_s = float(os.environ["TIMEOUT_S"])
dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=W)
world = cuflux.init(dist.group.WORLD, timeout_s=30)
out = {"rank": rank}
with world.device_context():
    case = Case(world, os.environ["OP"], timeout_s=timeout_s)
    for i in range(20):  # warm: arguments agreed, kernels loaded
        case.issue(i)
    case.op.synchronize()
    world.barrier()
    t0 = time.time()
    i = 20
    try:
        while True:
            case.issue(i % 20)  # sizes agreed in the warm-up: the device waits see the kill
            if rank == W - 1 and i == 40:  # mid-call: queued on the GPU, peers waiting on it
                with open(os.environ["KILL_AT"], "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if i % 4 == 0:
                case.op.synchronize()
            i += 1
            if time.time() - t0 > 60:
                raise RuntimeError("no error 60 s after the start")
    except CommTimeoutError as e:
        raised = time.time()
        out.update(error=type(e).__name__, peer=e.peer, first=getattr(e, "first", None),
                   message=str(e)[:300], raised_at=raised)
    t = time.time()
    case.op.abort()
    out["abort_s"] = time.time() - t
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # the gloo group has a dead member: nothing collective is left to do
"""


def kill(args) -> int:
    import socket
    import tempfile

    W = args.world
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = []
    for op in args.ops.split(","):
        kill_at = tempfile.mktemp(prefix="cuflux-kill-")
        env = dict(os.environ, ROOT=str(ROOT), OP=op, TIMEOUT_S=str(args.timeout_s),
                   KILL_AT=kill_at, INIT=f"tcp://127.0.0.1:{port}", WORLD_SIZE=str(W),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
        for k in [k for k in env if k.startswith(("OMPI_", "PMI_", "PMIX_"))]:
            del env[k]
        procs = [subprocess.Popen([sys.executable, "-c", _KILL_RANK],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(W)]
        outs, row = [], {"op": op, "timeout_s": args.timeout_s, "survivors": []}
        bound = 120 + args.timeout_s
        for r, p in enumerate(procs):
            try:
                text, _ = p.communicate(timeout=bound)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
                text += f"\n(rank {r} did not exit within {bound} s: killed)"
            outs.append((r, p.returncode, text))
        killed_at = float(pathlib.Path(kill_at).read_text()) if os.path.exists(kill_at) else None
        ok = killed_at is not None and outs[-1][1] == -signal.SIGKILL
        for r, rc, text in outs[:-1]:
            res = next((json.loads(line[7:]) for line in text.splitlines()
                        if line.startswith("RESULT ")), None)
            s = {"rank": r, "rc": rc, "result": res}
            if res and killed_at is not None and "raised_at" in res:
                s["raised_after_kill_s"] = res["raised_at"] - killed_at
            # CommTimeoutError naming the killed rank, or (W > 2) PeerFailedError: told by the
            # survivor that timed out first
            named = res is not None and (res.get("peer") == W - 1
                                         or res.get("error") == "PeerFailedError")
            good = (rc == 0 and named
                    and s.get("raised_after_kill_s", 1e9) <= args.timeout_s + KILL_SLACK_S)
            s["ok"] = good
            ok = ok and good
            if not good:
                s["output"] = text[-2000:]
            row["survivors"].append(s)
        row["ok"] = ok
        rows.append(row)
        print(json.dumps(row)[:1500], flush=True)
    if args.outdir:
        print(_write(args.outdir, "kill", W, {"rows": rows}))
    return 0 if all(r["ok"] for r in rows) else 1


# ---- small calls for compute-sanitizer ---------------------------------------------------------
def small(args) -> int:
    import cuflux

    world = cuflux.init(timeout_s=120)
    with world.device_context():
        for kind in args.ops.split(","):
            case = Case(world, kind, timeout_s=120)
            for i in range(3):
                kept, got = case.issue(i)
                case.op.synchronize()
                case.check(i, kept, got)
            case.close()
            if world.rank == 0:
                print(f"small W={world.size} {kind}: ok", flush=True)
    world.close()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("soak")
    p.add_argument("--calls", type=int, default=10000)
    p.add_argument("--check-every", type=int, default=97)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--outdir", default="")
    p = sub.add_parser("kill")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=2.0)
    p.add_argument("--ops", default="allreduce,all2all,allgather,gemm_rs")
    p.add_argument("--outdir", default="")
    p = sub.add_parser("small")
    p.add_argument("--ops", default=",".join(OPS + VARIANTS))
    args = ap.parse_args(argv)
    return {"soak": soak, "kill": kill, "small": small}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
