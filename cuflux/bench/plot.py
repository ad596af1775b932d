"""PNG charts of benchmark results: speed-up over the baseline against problem size, one per op.

    python -m cuflux.bench.plot scripts/results/*.json --outdir plots/
    python -m cuflux.bench.plot scripts/results --outdir plots/      # every .json in a folder

Reads the JSON that `python -m cuflux.bench` writes, one file per run:
{"op", "machine", "date", "command", "world_size", "rows": [{"case", "cuflux_ms", "baseline",
"baseline_ms", "speedup", ...}]}, and writes <outdir>/<op>-speedup.png for every op found. Each
line is one (run, case variant, baseline): speed-up (baseline_ms / cuflux_ms; above 1 cuflux is
faster) against the case's problem size. The size is a row's own `num_bytes` / `bytes` /
`num_elems` / `size` column where it has one, else the product of the dimensions its case names
("4096x8192x3584" -> M*N*K, "B=1 T=8192 H=32 D=128" -> B*T*H*D). Rows without a speed-up or a
size are left out; so are files that are not benchmark results and runs that measured no speed
(`"speed_measured": false`: ranks time-sliced one GPU), each with a note on stderr.

Needs matplotlib (`pip install "cuflux[plot]"`); it is imported only when a chart is drawn.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import sys
from typing import Iterable

__all__ = ["plot_results", "load_results", "problem_size", "main"]

SIZE_COLUMNS = ("num_bytes", "bytes", "num_elems", "size")
_SHAPE = re.compile(r"\b\d+(?:x\d+)+\b")          # 4096x8192x3584
_DIMS = re.compile(r"\b([A-Z])=(\d+)\b")           # B=1 T=8192 H=32 D=128 (not chunk_rows=512)


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def problem_size(row: dict) -> float | None:
    """A row's problem size: a size column, else the product of the dimensions in its case."""
    for col in SIZE_COLUMNS:
        v = _number(row.get(col))
        if v is not None and v > 0:
            return v
    case = str(row.get("case", ""))
    shape = _SHAPE.search(case)
    if shape:
        return float(math.prod(int(d) for d in shape.group(0).split("x")))
    dims = _DIMS.findall(case)
    if dims:
        return float(math.prod(int(v) for _, v in dims))
    return None


def _speedup(row: dict) -> float | None:
    s = _number(row.get("speedup"))
    if s is None:
        base, ours = _number(row.get("baseline_ms")), _number(row.get("cuflux_ms"))
        s = base / ours if base and ours and base > 0 and ours > 0 else None
    return s if s is not None and s > 0 else None


def _variant(case: str) -> str:
    """The case without its sizes: what stays the same along one line."""
    rest = _DIMS.sub("", _SHAPE.sub("", case))
    return " ".join(rest.split()) or "all"


def load_results(paths: Iterable) -> list[dict]:
    """Benchmark result documents (each with its "path"); a directory stands for its *.json.
    Files that are not benchmark results are skipped with a note on stderr."""
    docs = []
    for p in paths:
        p = pathlib.Path(p)
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        for f in files:
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"cuflux.bench.plot: cannot read {f}: {e}") from e
            if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
                print(f"cuflux.bench.plot: {f}: not a benchmark result (no 'rows' list); "
                      f"skipped", file=sys.stderr)
                continue
            if doc.get("speed_measured") is False:  # ranks time-sliced one GPU (issue 22.10)
                print(f"cuflux.bench.plot: {f}: no speed measured (ranks shared a GPU); "
                      f"skipped", file=sys.stderr)
                continue
            doc = dict(doc, path=str(f))
            doc.setdefault("op", f.name.split("-")[0])
            docs.append(doc)
    return docs


def _run_label(doc: dict) -> str:
    parts = [str(doc.get("machine", "?"))]
    if doc.get("world_size") is not None:
        parts.append(f"W={doc['world_size']}")
    if doc.get("date"):
        parts.append(str(doc["date"]))
    label = " ".join(parts)
    stem = pathlib.Path(doc["path"]).stem  # variants of one run (gemm-full-...) keep apart
    tag = stem.split("-")[1] if stem.count("-") >= 1 else ""
    if tag and tag not in (str(doc.get("machine")), f"W{doc.get('world_size')}"):
        label = f"{tag} {label}"
    return label


def _series(docs: list[dict]) -> dict[str, dict[tuple, list[tuple[float, float]]]]:
    """op -> (run label, variant, baseline) -> [(size, speed-up)], sorted by size."""
    by_op: dict[str, dict[tuple, list]] = {}
    for doc in docs:
        run = _run_label(doc)
        for row in doc["rows"]:
            if not isinstance(row, dict):
                continue
            size, speedup = problem_size(row), _speedup(row)
            baseline = str(row.get("baseline") or "baseline")
            if size is None or speedup is None or baseline.lower() == "none":
                continue
            key = (run, _variant(str(row.get("case", ""))), baseline)
            by_op.setdefault(str(doc["op"]), {}).setdefault(key, []).append((size, speedup))
    for lines in by_op.values():
        for pts in lines.values():
            pts.sort()
    return by_op


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("cuflux.bench.plot draws with matplotlib, which is not installed: "
                          "pip install \"cuflux[plot]\" (or pip install matplotlib)") from e
    return Figure


def plot_results(json_paths: Iterable, outdir) -> list[pathlib.Path]:
    """Write <outdir>/<op>-speedup.png for every op in the benchmark JSON files (or folders of
    them), one panel per run (machine, world size, date); return the paths written. Raises
    ImportError naming the fix where matplotlib is missing."""
    Figure = _figure_class()  # noqa: N806 (a class)
    by_op = _series(load_results(json_paths))
    outdir = pathlib.Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for op in sorted(by_op):
        lines = by_op[op]
        runs = sorted({k[0] for k in lines})
        ncols = min(3, len(runs))
        nrows = -(-len(runs) // ncols)
        most = max(sum(k[0] == run for k in lines) for run in runs)
        fig = Figure(figsize=(6.5 * ncols, nrows * (4.5 + 0.17 * most)))
        axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False).ravel()
        ys = [y for pts in lines.values() for _, y in pts]
        log_y = max(ys) / min(ys) > 20
        for ax, run in zip(axes, runs):
            mine = sorted((k[1:], pts) for k, pts in lines.items() if k[0] == run)
            for i, ((variant, baseline), pts) in enumerate(mine):
                xs, ys_ = zip(*pts)
                ax.plot(xs, ys_, marker="os^Dv<>"[i // 10 % 7], color=f"C{i % 10}",
                        linestyle="-" if len(pts) > 1 else "none",
                        label=f"{variant} vs {baseline}")
            ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1)
            ax.set_xscale("log")
            if log_y:
                ax.set_yscale("log")
            ax.set_title(run, fontsize="medium")
            ax.set_xlabel("problem size (size column, else product of the case's dims)",
                          fontsize="small")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize="x-small",
                      frameon=False)
        for ax in axes[len(runs):]:
            ax.set_visible(False)
        for ax in axes[::ncols]:
            ax.set_ylabel("speed-up: baseline_ms / cuflux_ms")
        fig.suptitle(f"{op}: speed-up over the baseline (above the dashed line cuflux is "
                     f"faster)")
        path = outdir / f"{op}-speedup.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cuflux.bench.plot",
        description="Draw speed-up vs size PNGs (one per op) from benchmark JSON files.")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="benchmark JSON files, or folders of them (scripts/results)")
    p.add_argument("--outdir", default=".", help="where the PNGs go (default: here)")
    args = p.parse_args(argv)
    try:
        written = plot_results(args.files, args.outdir)
    except (ImportError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    for path in written:
        print(path)
    if not written:
        print("cuflux.bench.plot: no row had both a speed-up and a size: nothing drawn",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
