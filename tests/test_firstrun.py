"""CPU tests of what a new user meets first: the package's contents and metadata (setup.cfg,
MANIFEST.in, LICENSE), .ci/run's clean-up, and the benchmark charts (cuflux.bench.plot)."""
from __future__ import annotations

import configparser
import fnmatch
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results"


def _cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _lines(value: str) -> list[str]:
    return [v.strip() for v in value.strip().splitlines() if v.strip()]


# --- packaging -------------------------------------------------------------------------------

def test_every_subpackage_is_listed_and_kernels_ship_inside_cuflux():
    opts = _cfg()["options"]
    packages = _lines(opts["packages"])
    on_disk = sorted(".".join(p.parent.relative_to(ROOT).parts)
                     for p in (ROOT / "cuflux").rglob("__init__.py"))
    missing = sorted(set(on_disk) - set(packages))
    assert not missing, f"setup.cfg [options] packages misses {missing}"
    assert all(p == "cuflux" or p.startswith("cuflux.") for p in packages), \
        "only the cuflux package may be installed at the top level"
    dirs = dict(line.split("=") for line in _lines(opts["package_dir"]))
    assert {k.strip(): v.strip() for k, v in dirs.items()} == {"cuflux.kernels_cu": "kernels_cu"}
    assert "cuflux.kernels_cu" in packages


def test_package_data_ships_every_kernel_source_and_header():
    patterns = [p.strip() for p in
                _cfg()["options.package_data"]["cuflux.kernels_cu"].split(",")]
    kdir = ROOT / "kernels_cu"
    files = [f.relative_to(kdir).as_posix() for f in kdir.rglob("*")
             if f.is_file() and f.suffix in (".cu", ".cuh", ".h")]
    assert files
    missing = [f for f in files if not any(
        fnmatch.fnmatch(f, p) and f.count("/") == p.count("/") for p in patterns)]
    assert not missing, f"not shipped by setup.cfg package_data: {missing}"


def test_installed_layout_is_where_the_loader_looks(tmp_path):
    """Installed from a wheel, the sources sit at site-packages/cuflux/kernels_cu with no
    repository beside the package: the loader finds them there."""
    import importlib.util
    import shutil

    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "kernels_cu", site / "cuflux" / "kernels_cu")
    shutil.copy(ROOT / "cuflux" / "kernels.py", site / "cuflux" / "kernels.py")
    spec = importlib.util.spec_from_file_location("installed_kernels",
                                                  site / "cuflux" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    assert mod.KERNEL_DIR == site / "cuflux" / "kernels_cu"
    assert (mod.INCLUDE_DIR / "cuflux" / "sync.cuh").is_file()


def test_cuda_extras_bring_curand_and_what_the_quick_start_uses():
    extras = _cfg()["options.extras_require"]
    cuda12, cuda13 = _lines(extras["cuda12"]), _lines(extras["cuda13"])
    assert "nvidia-curand-cu12" in cuda12
    toolkit = next(r for r in cuda13 if r.startswith("cuda-toolkit["))
    components = set(toolkit[len("cuda-toolkit["):toolkit.index("]")].split(","))
    assert {"cudart", "nvrtc", "cublas", "curand"} <= components
    for wanted in ("cupy-cuda12x", "cuda-bindings", "nvidia-cuda-nvrtc-cu12",
                   "nvidia-cuda-runtime-cu12", "nvidia-cublas-cu12"):
        assert any(r.startswith(wanted) for r in cuda12), wanted
    assert any(r.startswith("matplotlib") for r in _lines(extras["plot"]))


def test_metadata_license_urls_classifiers():
    meta = _cfg()["metadata"]
    assert meta["license_expression"] == "Apache-2.0" and meta["license_files"] == "LICENSE"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10000
    urls = dict(line.split("=", 1) for line in _lines(meta["project_urls"]))
    assert {k.strip() for k in urls} >= {"Homepage", "Source", "Issues"}
    classifiers = _lines(meta["classifiers"])
    for v in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {v}" in classifiers
    for c in ("Environment :: GPU :: NVIDIA CUDA", "Operating System :: POSIX :: Linux",
              "Topic :: Scientific/Engineering"):
        assert c in classifiers
    # PEP 639: the SPDX expression replaces License :: classifiers (setuptools refuses both)
    assert not [c for c in classifiers if c.startswith("License ::")]
    assert meta["keywords"].strip()
    build = (ROOT / "pyproject.toml").read_text()
    assert '"setuptools>=77"' in build, "license_expression needs setuptools 77"


def test_sdist_manifest_carries_tests_with_their_helpers_license_and_readme():
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert any(line.split()[:1] == ["include"] and "LICENSE" in line and "README.md" in line
               for line in manifest)
    assert "recursive-include tests *.py *.cu *.cuh" in manifest  # the tests' own kernels too
    assert any(line.startswith("recursive-include kernels_cu") for line in manifest)
    assert any(line.startswith("recursive-include scripts/results") for line in manifest), \
        "the chart test reads scripts/results"


def test_ci_run_uses_a_temporary_directory_it_removes():
    run = (ROOT / ".ci" / "run").read_text()
    assert "mktemp -d" in run and "trap 'rm -rf" in run
    assert "/tmp/cuflux-ci-venv" not in run and "rm -rf \"$VENV\"" not in run
    assert 'pip install -e ".[cuda13,mpi,test]"' in run
    assert run.rstrip().splitlines()[-1] == "pytest"
    assert "CUFLUX_CACHE_DIR=\"$RUN_DIR" in run


# --- benchmark charts ------------------------------------------------------------------------

def test_problem_size_from_columns_and_case_names():
    from cuflux.bench.plot import problem_size

    assert problem_size({"case": "4096x8192x3584 nk"}) == 4096 * 8192 * 3584
    assert problem_size({"case": "pull/stream-wait shard 1024x8192 bf16"}) == 1024 * 8192
    assert problem_size({"case": "scatter B=2 T=4096 H=64 D=80 bfloat16 owned sms=33"}) == \
        2 * 4096 * 64 * 80
    assert problem_size({"case": "T=128 H=4096 bf16 replicated"}) == 128 * 4096
    assert problem_size({"case": "flux 4096x24576x12288 nk pull chunk_rows=128"}) == \
        4096 * 24576 * 12288
    assert problem_size({"case": "x", "num_bytes": 1 << 20}) == 1 << 20
    assert problem_size({"case": "nothing to go by"}) is None
    assert problem_size({}) is None


def test_missing_matplotlib_is_named_with_its_fix(monkeypatch, tmp_path):
    from cuflux.bench import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"cuflux\[plot\]"):
        plot.plot_results([RESULTS], tmp_path)
    assert plot.main([str(RESULTS), "--outdir", str(tmp_path)]) == 1


def _png_ok(path: pathlib.Path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_one_chart_per_op_from_the_recorded_results(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is absent (pip install 'cuflux[plot]')")
    from cuflux.bench.plot import plot_results

    files = sorted(RESULTS.glob("*.json"))
    docs = [json.loads(f.read_text()) for f in files]
    # charted: the ops whose speed was measured with a GPU-queued speed-up (the torch-caller
    # bench times user loops and host time only: nothing to chart)
    ops = {d["op"] for d in docs if d.get("speed_measured") is not False
           and any("speedup" in r or "cuflux_ms" in r for r in d["rows"])}
    assert "torch" not in ops and "torch" in {d["op"] for d in docs}
    assert any(d.get("speed_measured") is False for d in docs)  # the skip below is exercised
    written = plot_results(files, tmp_path / "charts")
    assert sorted(p.name for p in written) == sorted(f"{op}-speedup.png" for op in ops)
    assert all(_png_ok(p) for p in written)


def test_chart_rows_with_missing_columns(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is absent (pip install 'cuflux[plot]')")
    from cuflux.bench.plot import plot_results

    doc = {"op": "toy", "machine": "m", "world_size": 2, "rows": [
        {"case": "T=1 H=64", "cuflux_ms": 1.0, "baseline_ms": 2.0},      # speed-up computed
        {"case": "T=8 H=64", "speedup": 1.5, "baseline": "NCCL"},
        {"case": "T=64 H=64", "speedup": None, "baseline": "none"},      # not comparable
        {"case": "no size here", "speedup": 2.0},                        # no size
        {"speedup": 3.0},                                                 # no case
        "not a row",
    ]}
    (tmp_path / "toy-m-W2.json").write_text(json.dumps(doc))
    (tmp_path / "other.json").write_text(json.dumps({"not": "a result"}))
    empty = {"op": "empty", "rows": [{"case": "4x4"}]}
    (tmp_path / "empty-m.json").write_text(json.dumps(empty))
    shared = {"op": "shared", "speed_measured": False,  # ranks time-sliced one GPU: no chart
              "rows": [{"case": "T=1 H=64", "speedup": 0.5, "baseline": "NCCL"}]}
    (tmp_path / "shared-m-W2.json").write_text(json.dumps(shared))
    written = plot_results([tmp_path], tmp_path / "out")
    assert [p.name for p in written] == ["toy-speedup.png"] and _png_ok(written[0])
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json"):
        plot_results([tmp_path], tmp_path / "out")


def test_plot_command(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is absent (pip install 'cuflux[plot]')")
    files = [str(f) for f in sorted(RESULTS.glob("allreduce-*.json"))]
    out = subprocess.run([sys.executable, "-m", "cuflux.bench.plot", *files, "--outdir",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(tmp_path / "allreduce-speedup.png")]
    assert _png_ok(tmp_path / "allreduce-speedup.png")


def test_readme_quick_start_is_the_script_the_gpu_checks_run():
    """README's CuPy quick start and scripts/quickstart.py (run on the GPU machine) are one
    text, so the README shows what was run."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    start = readme.index("```python\n# mpiexec -n 2 python scripts/quickstart.py")
    block = readme[start + len("```python\n"):readme.index("```", start + 10)]
    assert block == (root / "scripts" / "quickstart.py").read_text()
