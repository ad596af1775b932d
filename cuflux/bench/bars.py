"""python -m cuflux.bench bars DIR [DIR...] [--outdir OUT]: the open issues' numeric bars,
checked against the JSON files a benchmark run wrote (cuflux.bench.common.write_results).

Reads every *.json in each DIR whose "op" is a benchmark's (gemm, allreduce, all2all, gemm_rs,
ag_gemm, allgather, across; any other JSON is skipped), checks each file on its own, prints one
table grouped by issue and a summary line per issue, and writes
<outdir>/bars-<machine>-W<W>-<date>.json (machine, W and date from the files read, distinct
values joined by "+"; outdir: --outdir, else the first DIR). Needs no GPU and no MPI: it reads
JSON only. Exit status 0 whenever files were read (a missed bar is a finding, not an error), 2
when no file of a known op was found.

The bars (thresholds from the issues' texts; the constants below name them):
  issue 14, host path and user loop, any W:
    gemm, W = 1, table shapes (table_shape): user_loop_speedup >= 0.95 (user loop vs
        cupy.matmul)
    kernel-only ops (gemm table/decode shapes, allreduce, all2all, gemm_rs's default route),
        every row with host_us: host_us <= 10 us a call at W = 1, <= 15 us at W >= 2
    copy ops (allgather, ag_gemm), every row with host_us: host_us <= 5 us per copy issued
        (max(1, W - 1) copies: one per peer, one local copy at W = 1), and host time <= the
        op's GPU time (host_us / (1000 cuflux_ms) <= 1)
  issue 15, W >= 2 on distinct GPUs:
    gemm_rs: cuflux_ms / cublas_ms <= 1.03 (the op's default route); chunked_to_cublas <= 1.03
        (route="chunked", when measured); nccl_ms / cuflux_ms >= 1 and nccl_ms / chunked_ms
        >= 1 (never slower than cuBLAS + NCCL); fused_to_ideal, chunked_to_ideal as info
    ag_gemm, mode "pull" (the default), not the chunk_rows sweep: of_ideal >= 0.97
  issue 16, allreduce, W >= 2 on distinct GPUs:
    kind "norm": rows T in {1, 16, 128, 1024, 8192} x H in {4096, 8192} x each output mode
        (replicated, sharded_residual, sequence_parallel), all present; each row nccl_ms / cuflux_ms >= 1.2 (GPU-queued), nccl_graph_ms /
        graph_ms >= 1.2 (graph), nccl_user_loop_ms / user_loop_ms >= 1.0 (user loop: not
        slower); at T = 8192 fraction_of_link >= 0.85
    kind "plain": from 8 MiB up busbw_gbps / nccl_busbw_gbps >= 0.95; up to 256 KiB
        nccl_graph_ms / graph_ms >= 1.5 (a row of each size class must be present)
  issue 17, all2all, W >= 2 on distinct GPUs:
    T >= 8192, default kernel (no num_sms / kernel override): fraction_of_link >= 0.85, with
        bfloat16 scatter, bfloat16 gather and float8 with scales among the rows
    every row with host_us: host_us <= 15 us (issue 17's own host bar; issue 14's covers the
        same rows at its threshold)
    vs_nccl rows at T = 1024: user_loop_speedup >= 2 (NCCL all-to-all + permutes / ours)
  issue 20, across: every row correct (checked whether or not speed was measured); speedup
      as info

--expect OP,OP names the benchmarks the run meant to write: one that left no JSON (failed, or
cut off by its time cap) is a missed check under its issue (OP_ISSUE), so a lost benchmark
cannot pass for a quiet one.

A check is {"issue", "bar", "file", "case", "value", "threshold", "met", "why"}: met True or
False, or None where the file cannot measure the bar ("not measured here": ranks time-sharing one
GPU measure no speed; a W >= 2 bar in a W = 1 file) or a field it needs is absent. Such a file
gives one record per bar, not one per row. A row a bar requires but the run lacks is met False,
"not in the run". Info records (met None, why "info", threshold None) count in no summary.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass
from typing import NamedTuple

from cuflux.bench.common import print_table
from cuflux.ops.allreduce import OUTPUTS

# ---- thresholds (from the issues' texts) ------------------------------------------------------
# Issue 14: host path and user loop.
GEMM_USER_LOOP_SPEEDUP_MIN = 0.95  # gemm (auto) vs cupy.matmul, called from Python
HOST_US_W1 = 10.0  # host time a call of a kernel-only op at W = 1
HOST_US_W2 = 15.0  # ... at W = 2 (the issue names W = 2; larger W are held to it too)
COPY_HOST_US_PER_COPY = 5.0  # copy-engine ops: host time per copy they issue
COPY_HOST_OF_GPU_MAX = 1.0  # copy ops: host time never more than their GPU time
# Issue 15: fused GEMM + collective on two GPUs.
RS_OF_CUBLAS_MAX = 1.03  # gemm_rs: the op / cuBLAS alone (the transfer all but hidden)
RS_NCCL_SPEEDUP_MIN = 1.0  # gemm_rs: never slower than cuBLAS + NCCL reduce-scatter
AG_OF_IDEAL_MIN = 0.97  # ag_gemm: fused speed-up / the ideal speed-up
# Issue 16: AllReduce(+RMSNorm) against NCCL.
NORM_TOKENS = (1, 16, 128, 1024, 8192)  # T the norm sweep must hold
NORM_MODES = OUTPUTS  # "all three output modes" (AllReduceRMSNorm's)
NORM_HIDDEN = (4096, 8192)  # H the norm sweep must hold
NORM_NCCL_SPEEDUP_MIN = 1.2  # NCCL + norm / fused, GPU-queued and graph
NORM_USER_LOOP_SPEEDUP_MIN = 1.0  # user loop: not slower than NCCL + norm
NORM_LINK_TOKENS = 8192  # T where the fused norm must run near the link's rate
NORM_LINK_FRACTION_MIN = 0.85
PLAIN_LARGE_BYTES = 8 << 20  # plain all-reduce from here up: bus bandwidth near NCCL's
PLAIN_BUSBW_OF_NCCL_MIN = 0.95
PLAIN_SMALL_BYTES = 256 << 10  # ... up to here: latency, graph against graph
PLAIN_GRAPH_SPEEDUP_MIN = 1.5
PLAIN_LARGE = f">= {PLAIN_LARGE_BYTES >> 20} MiB"  # the two size classes, as printed
PLAIN_SMALL = f"<= {PLAIN_SMALL_BYTES >> 10} KiB"
# Issue 17: All2AllHeads on two GPUs.
A2A_LINK_TOKENS = 8192  # T from which the exchange must run near the link's rate
A2A_LINK_FRACTION_MIN = 0.85
A2A_LINK_KINDS = ("bfloat16 scatter", "bfloat16 gather", "float8 with scales")  # each needed
A2A_HOST_US = 15.0  # issue 17's own host bar
A2A_LOOP_TOKENS = 1024  # decode-sized exchange: T where the user-loop bar is read
A2A_LOOP_SPEEDUP_MIN = 2.0  # NCCL all-to-all + permutes / ours, user loop

NOT_IN_RUN = "not in the run"  # a required row or field the run lacks: the bar is missed
INFO = "info"


@dataclass(frozen=True)
class Bar:
    issue: int
    text: str
    threshold: float | None  # None: an info record, no verdict
    at_least: bool = True  # met when value >= threshold (else value <= threshold)
    speed: bool = True  # a speed figure: not measured where ranks share one GPU
    distinct: bool = False  # needs W >= 2 on distinct GPUs
    host: bool = False  # a host-time bar: a miss is shown beside the host's floor


# Issue 14.
GEMM_USER_LOOP = Bar(14, f"user loop >= {GEMM_USER_LOOP_SPEEDUP_MIN}x cupy.matmul",
                     GEMM_USER_LOOP_SPEEDUP_MIN)
COPY_HOST_OF_GPU = Bar(14, "copy op: host time <= its GPU time (host us / GPU us)",
                       COPY_HOST_OF_GPU_MAX, at_least=False, host=True)


def host_bar(world_size: int) -> Bar:
    us = HOST_US_W1 if world_size == 1 else HOST_US_W2
    return Bar(14, f"host <= {us:g} us a call (W = {world_size})", us, at_least=False,
               host=True)


def copy_host_bar(world_size: int) -> Bar:
    copies = max(1, world_size - 1)  # one copy per peer; at W = 1 one local copy
    us = COPY_HOST_US_PER_COPY * copies
    return Bar(14, f"copy op: host <= {us:g} us a call ({copies} x {COPY_HOST_US_PER_COPY:g} "
                   f"us, W = {world_size})", us, at_least=False, host=True)


# Issue 15.
RS_FUSED = Bar(15, f"the op (default route) <= {RS_OF_CUBLAS_MAX}x cuBLAS alone",
               RS_OF_CUBLAS_MAX, at_least=False, distinct=True)
RS_CHUNKED = Bar(15, f"route=chunked <= {RS_OF_CUBLAS_MAX}x cuBLAS alone", RS_OF_CUBLAS_MAX,
                 at_least=False, distinct=True)
RS_NCCL = Bar(15, "the op never slower than cuBLAS + NCCL (nccl_ms / cuflux_ms)",
              RS_NCCL_SPEEDUP_MIN, distinct=True)
RS_NCCL_CHUNKED = Bar(15, "route=chunked never slower than cuBLAS + NCCL (nccl_ms / chunked_ms)",
                      RS_NCCL_SPEEDUP_MIN, distinct=True)
RS_FUSED_IDEAL = Bar(15, "fused_to_ideal", None, distinct=True)
RS_CHUNKED_IDEAL = Bar(15, "chunked_to_ideal", None, distinct=True)
AG_OF_IDEAL = Bar(15, f"fused / ideal speed-up >= {AG_OF_IDEAL_MIN} (pull)", AG_OF_IDEAL_MIN,
                  distinct=True)
# Issue 16.
NORM_QUEUED = Bar(16, f"norm: NCCL + norm / fused >= {NORM_NCCL_SPEEDUP_MIN}x (GPU-queued)",
                  NORM_NCCL_SPEEDUP_MIN, distinct=True)
NORM_GRAPH = Bar(16, f"norm: NCCL + norm / fused >= {NORM_NCCL_SPEEDUP_MIN}x (graph)",
                 NORM_NCCL_SPEEDUP_MIN, distinct=True)
NORM_LOOP = Bar(16, "norm: not slower than NCCL + norm (user loop)",
                NORM_USER_LOOP_SPEEDUP_MIN, distinct=True)
NORM_LINK = Bar(16, f"norm: fraction_of_link >= {NORM_LINK_FRACTION_MIN} at T = "
                    f"{NORM_LINK_TOKENS}", NORM_LINK_FRACTION_MIN, distinct=True)
PLAIN_BUSBW = Bar(16, f"plain {PLAIN_LARGE}: busbw >= {PLAIN_BUSBW_OF_NCCL_MIN}x NCCL's",
                  PLAIN_BUSBW_OF_NCCL_MIN, distinct=True)
PLAIN_GRAPH = Bar(16, f"plain {PLAIN_SMALL}: NCCL / ours >= {PLAIN_GRAPH_SPEEDUP_MIN}x (graph)",
                  PLAIN_GRAPH_SPEEDUP_MIN, distinct=True)
# Issue 17.
A2A_LINK = Bar(17, f"fraction_of_link >= {A2A_LINK_FRACTION_MIN} at T >= {A2A_LINK_TOKENS}",
               A2A_LINK_FRACTION_MIN, distinct=True)
A2A_HOST = Bar(17, f"host <= {A2A_HOST_US:g} us a call", A2A_HOST_US, at_least=False,
               distinct=True, host=True)
A2A_LOOP = Bar(17, f"user loop >= {A2A_LOOP_SPEEDUP_MIN}x NCCL all-to-all + permutes at T = "
                   f"{A2A_LOOP_TOKENS}", A2A_LOOP_SPEEDUP_MIN, distinct=True)
# Issue 20: correctness counts on a shared GPU too.
ACROSS_CORRECT = Bar(20, "correct (matches the NCCL composition)", 1.0, speed=False)
ACROSS_SPEEDUP = Bar(20, "speedup vs NCCL", None)


def op_bars(op: str, world_size: int) -> list[Bar]:
    """The bars (info left out) a file of `op` at W = world_size is held to: a file that cannot
    measure one of them gets one "not measured here" record for it."""
    host = host_bar(world_size)
    copy = [copy_host_bar(world_size), COPY_HOST_OF_GPU]
    return {"gemm": [GEMM_USER_LOOP, host] if world_size == 1 else [host],
            "allreduce": [host, NORM_QUEUED, NORM_GRAPH, NORM_LOOP, NORM_LINK, PLAIN_BUSBW,
                          PLAIN_GRAPH],
            "all2all": [host, A2A_LINK, A2A_HOST, A2A_LOOP],
            "gemm_rs": [host, RS_FUSED, RS_CHUNKED, RS_NCCL, RS_NCCL_CHUNKED],
            "ag_gemm": copy + [AG_OF_IDEAL],
            "allgather": copy,
            "across": [ACROSS_CORRECT]}[op]


# ---- reading a row ----------------------------------------------------------------------------
def field(row: dict, name: str) -> tuple[float | None, str | None]:
    """(value, None), or (None, why) where the field is absent or None."""
    v = row.get(name)
    return (None, f"field {name} absent") if v is None else (float(v), None)


def ratio(row: dict, num: str, den: str) -> tuple[float | None, str | None]:
    """row[num] / row[den], None-safe."""
    a, why = field(row, num)
    b, why_b = field(row, den)
    if why or why_b:
        return None, why or why_b
    return (a / b, None) if b else (None, f"field {den} is 0")


def _case(row: dict) -> str:
    return row.get("case") or ""


def _host_checks(rows, bar: Bar):
    """bar on host_us of every row that has it."""
    for row in rows:
        if "host_us" in row:
            yield bar, _case(row), *field(row, "host_us")


# ---- checks per op: each yields (bar, case, value, why) ---------------------------------------
# Bars a file cannot measure (shared GPU, W = 1) are dropped afterwards (check_file): the
# functions below read every row as if it could.
def check_gemm(rows, world_size):
    for row in rows:
        if world_size == 1 and row.get("table_shape"):
            yield GEMM_USER_LOOP, _case(row), *field(row, "user_loop_speedup")
    yield from _host_checks([r for r in rows if r.get("table_shape") or r.get("decode_shape")],
                            host_bar(world_size))


def check_allreduce(rows, world_size):
    yield from _host_checks(rows, host_bar(world_size))
    norm = [r for r in rows if r.get("kind") == "norm"]
    have = {(r.get("T"), r.get("H"), r.get("mode")) for r in norm}
    for mode in NORM_MODES:
        for t in NORM_TOKENS:
            for h in NORM_HIDDEN:
                if (t, h, mode) not in have:
                    yield NORM_QUEUED, f"norm T={t} H={h} {mode}", None, NOT_IN_RUN
    for row in norm:
        case = _case(row)
        yield NORM_QUEUED, case, *ratio(row, "nccl_ms", "cuflux_ms")
        yield NORM_GRAPH, case, *ratio(row, "nccl_graph_ms", "graph_ms")
        yield NORM_LOOP, case, *ratio(row, "nccl_user_loop_ms", "user_loop_ms")
        if row.get("T") == NORM_LINK_TOKENS:
            yield NORM_LINK, case, *field(row, "fraction_of_link")
    plain = [r for r in rows if r.get("kind") == "plain" and r.get("bytes") is not None]
    for bar, rows_of, size, num, den in (
            (PLAIN_BUSBW, [r for r in plain if r["bytes"] >= PLAIN_LARGE_BYTES], PLAIN_LARGE,
             "busbw_gbps", "nccl_busbw_gbps"),
            (PLAIN_GRAPH, [r for r in plain if r["bytes"] <= PLAIN_SMALL_BYTES], PLAIN_SMALL,
             "nccl_graph_ms", "graph_ms")):
        if not rows_of:
            yield bar, f"plain {size}", None, NOT_IN_RUN
        for row in rows_of:
            yield bar, _case(row), *ratio(row, num, den)


def _default_kernel(row: dict) -> bool:
    """An all2all row of the op as built by default (no SM count or kernel forced: its case
    names them)."""
    case = _case(row)
    return "sms=" not in case and " kernel" not in case


def _a2a_kind(row: dict) -> str | None:
    """Which of A2A_LINK_KINDS an all2all row is, if any."""
    if row.get("dtype") == "bfloat16":
        return f"bfloat16 {row.get('direction')}"
    if str(row.get("dtype") or "").startswith("float8") and row.get("scales") is True:
        return "float8 with scales"
    return None


def check_all2all(rows, world_size):
    ops = [r for r in rows if r.get("direction")]  # not the bare cudaMemcpyAsync row (W = 1)
    yield from _host_checks(ops, host_bar(world_size))
    yield from _host_checks(ops, A2A_HOST)
    linked = [r for r in rows if (r.get("T") or 0) >= A2A_LINK_TOKENS and _default_kernel(r)]
    for row in linked:
        yield A2A_LINK, _case(row), *field(row, "fraction_of_link")
    have = {_a2a_kind(r) for r in linked}
    for what in A2A_LINK_KINDS:
        if what not in have:
            yield A2A_LINK, f"{what}, T >= {A2A_LINK_TOKENS}", None, NOT_IN_RUN
    decode = [r for r in rows if r.get("vs_nccl") is True and r.get("T") == A2A_LOOP_TOKENS]
    if not decode:
        yield A2A_LOOP, f"vs NCCL, T = {A2A_LOOP_TOKENS}", None, NOT_IN_RUN
    for row in decode:
        yield A2A_LOOP, _case(row), *field(row, "user_loop_speedup")


def check_gemm_rs(rows, world_size):
    yield from _host_checks(rows, host_bar(world_size))
    for row in rows:
        case = _case(row)
        yield RS_FUSED, case, *ratio(row, "cuflux_ms", "cublas_ms")
        if "chunked_to_cublas" in row:
            yield RS_CHUNKED, case, *field(row, "chunked_to_cublas")
        routes = [(RS_NCCL, "cuflux_ms")]
        routes += [(RS_NCCL_CHUNKED, "chunked_ms")] if "chunked_ms" in row else []
        for bar, ours in routes:  # no nccl_ms (a CuPy without NCCL): not measured
            yield bar, case, *ratio(row, "nccl_ms", ours)
        for bar, name in ((RS_FUSED_IDEAL, "fused_to_ideal"),
                          (RS_CHUNKED_IDEAL, "chunked_to_ideal")):
            if row.get(name) is not None:
                yield bar, case, float(row[name]), INFO


def check_copy_host(rows, world_size):
    """Issue 14's two bars of a copy op (allgather, ag_gemm)."""
    yield from _host_checks(rows, copy_host_bar(world_size))
    for row in rows:
        if "host_us" in row:
            per_ms, why = ratio(row, "host_us", "cuflux_ms")
            # host us per GPU us: us / (ms * 1000)
            yield COPY_HOST_OF_GPU, _case(row), None if why else per_ms / 1e3, why


def check_ag_gemm(rows, world_size):
    yield from check_copy_host(rows, world_size)
    for row in rows:
        if "chunk_rows" not in _case(row) and row.get("mode") == "pull":
            yield AG_OF_IDEAL, _case(row), *field(row, "of_ideal")


def check_across(rows, world_size):
    for row in rows:
        case, correct = _case(row), row.get("correct")
        if isinstance(correct, bool):
            yield ACROSS_CORRECT, case, float(correct), None
        else:
            yield ACROSS_CORRECT, case, None, "field correct absent (no reference ran)"
        if row.get("speedup") is not None:
            yield ACROSS_SPEEDUP, case, float(row["speedup"]), INFO


CHECKS = {"gemm": check_gemm, "allreduce": check_allreduce, "all2all": check_all2all,
          "gemm_rs": check_gemm_rs, "ag_gemm": check_ag_gemm, "allgather": check_copy_host,
          "across": check_across}


# ---- a file -----------------------------------------------------------------------------------
class RunFile(NamedTuple):
    path: pathlib.Path
    doc: dict

    @property
    def world_size(self) -> int:
        return self.doc["world_size"]

    @property
    def speed_measured(self) -> bool:
        """As the file says; a file older than the flag: measured only by one rank alone."""
        if "speed_measured" in self.doc:
            return bool(self.doc["speed_measured"])
        return not self.doc.get("ranks_share_gpu") and self.world_size == 1

    @property
    def shared_gpu(self) -> bool:
        return self.doc.get("ranks_share_gpu") is True or self.doc.get("distinct_gpus") is False


def not_measured(bar: Bar, f: RunFile) -> str | None:
    """Why `f` cannot measure `bar`, or None where it can."""
    if not bar.speed:
        return None
    if not f.speed_measured:
        if "speed_measured" in f.doc:
            return "ranks share one GPU, no speed measured"
        return f"older file without speed_measured, W = {f.world_size}"
    if bar.distinct and f.world_size == 1:
        return "W = 1, the bar needs W >= 2 on distinct GPUs"
    if bar.distinct and f.shared_gpu:
        return "ranks share one GPU"
    return None


def record(bar: Bar, name: str, case: str, value, why: str | None = None) -> dict:
    if bar.threshold is None:
        met, why = None, INFO
    elif value is None:
        met = False if why == NOT_IN_RUN else None
    else:
        met = value >= bar.threshold if bar.at_least else value <= bar.threshold
    rec = {"issue": bar.issue, "bar": bar.text, "file": name, "case": case, "value": value,
           "threshold": bar.threshold, "met": met}
    if why is not None:
        rec["why"] = why
    return rec


def host_floor_note(doc: dict) -> str | None:
    """The host's own floor the file's run measured (common.measure_host_floor), in words."""
    floor = doc.get("host_floor_us")
    if not isinstance(floor, dict) or floor.get("launch_us") is None:
        return None
    via = " (ctypes)" if floor.get("launch_binding", "ctypes") == "ctypes" else ""
    return (f"this host: a bare kernel launch{via} {floor['launch_us']:.1f} us, a bare copy "
            f"{floor.get('copy_us', float('nan')):.1f} us")


def check_file(f: RunFile) -> list[dict]:
    """Every check of one file: one "not measured here" record per bar it cannot measure, and
    the rows' checks of the bars it can; a missed host bar says the host's floor where the
    run measured it."""
    name, op, W = f.path.name, f.doc["op"], f.world_size
    out = [record(bar, name, "", None, why) for bar in op_bars(op, W)
           if (why := not_measured(bar, f))]
    floor = host_floor_note(f.doc)
    for bar, case, value, why in CHECKS[op](f.doc["rows"], W):
        if not not_measured(bar, f):
            rec = record(bar, name, case, value, why)
            if bar.host and rec["met"] is False and floor and "why" not in rec:
                rec["why"] = floor
            out.append(rec)
    return out


def read_runs(dirs) -> list[RunFile]:
    """Every *.json of a known op in `dirs` (other JSON skipped silently)."""
    runs = []
    for d in dirs:
        for path in sorted(pathlib.Path(d).glob("*.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                print(f"bars: skipped {path}: {e}", file=sys.stderr)
                continue
            if (isinstance(doc, dict) and doc.get("op") in CHECKS
                    and isinstance(doc.get("rows"), list)
                    and isinstance(doc.get("world_size"), int)):
                runs.append(RunFile(path, doc))
    return runs


def summary(checks: list[dict]) -> dict:
    out: dict[int, dict] = {}
    for c in checks:
        if c.get("why") == INFO:
            continue
        s = out.setdefault(c["issue"], {"met": 0, "missed": 0, "not_measured": 0})
        s["met" if c["met"] else "missed" if c["met"] is False else "not_measured"] += 1
    return dict(sorted(out.items()))


def verdict(c: dict) -> str:
    if c.get("why") == INFO:
        return INFO
    if c["met"] is None:
        return f"not measured here: {c['why']}"
    return "met" if c["met"] else "MISSED" + (f" ({c['why']})" if c.get("why") else "")


def _joined(values) -> str:
    """The distinct values, sorted, joined by "+" (one run: its one value)."""
    return "+".join(str(v) for v in sorted(set(values))) or "unknown"


# --expect: the issue each op's benchmark measures, for a run that wrote no JSON of the op
OP_ISSUE = {"gemm": 14, "allgather": 14, "gemm_rs": 15, "ag_gemm": 15, "allreduce": 16,
            "all2all": 17, "across": 20}


def missing_ops(expect: list[str], runs: list[RunFile]) -> list[dict]:
    """A missed record for each expected op no file of the run holds (its benchmark failed or
    was cut off before it wrote its JSON: every bar it measures goes unchecked)."""
    have = {f.doc["op"] for f in runs}
    return [record(Bar(OP_ISSUE[op], f"the {op} benchmark wrote its JSON", 1.0, speed=False),
                   "", op, None, NOT_IN_RUN) for op in expect if op not in have]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuflux.bench bars",
                                description="Check the open issues' bars against a run's JSON.")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="folders of a run's JSON files")
    p.add_argument("--outdir", default=None, help="where bars-*.json goes (default: first DIR)")
    p.add_argument("--expect", default="", metavar="OP,OP",
                   help="ops whose benchmark the run meant to write (each one missing: a missed "
                        f"check under its issue); of {', '.join(OP_ISSUE)}")
    return p


def main(argv: list[str]) -> int:
    """argv: what follows "bars" on the command line."""
    p = parser()
    args = p.parse_args(argv)
    expect = [op for op in args.expect.split(",") if op]
    unknown = [op for op in expect if op not in OP_ISSUE]
    if unknown:
        p.error(f"--expect: unknown op(s) {', '.join(unknown)}; known: {', '.join(OP_ISSUE)}")
    runs = read_runs(args.dirs)
    if not runs:
        print(f"bars: no JSON of a known op ({', '.join(sorted(CHECKS))}) in "
              f"{', '.join(args.dirs)}")
        for c in missing_ops(expect, runs):
            print(f"issue {c['issue']}: MISSED: {c['bar']}")
        return 2
    checks = sorted([c for f in runs for c in check_file(f)] + missing_ops(expect, runs),
                    key=lambda c: c["issue"])
    print_table([{**c, "verdict": verdict(c)} for c in checks],
                ["issue", "bar", "file", "case", "value", "threshold", "verdict"])
    counts = summary(checks)
    for issue, s in counts.items():
        print(f"issue {issue}: {s['met']} met, {s['missed']} missed, "
              f"{s['not_measured']} not measured here")
    docs = [f.doc for f in runs]
    machine = _joined(d.get("machine") or "unknown" for d in docs)
    world = _joined(d["world_size"] for d in docs)
    date = _joined(d.get("date") or "unknown" for d in docs)
    outdir = pathlib.Path(args.outdir or args.dirs[0])
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"bars-{machine}-W{world}-{date}.json"
    path.write_text(json.dumps({
        "command": " ".join(["python -m cuflux.bench bars"] + argv), "date": date,
        "files": [str(f.path) for f in runs], "checks": checks, "summary": counts}, indent=1))
    print("wrote", path)
    return 0
