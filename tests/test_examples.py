"""CPU checks of the PyTorch examples (scripts/examples, issue 21): each one's --help runs and
says how to launch it under mpirun and torchrun, and without a GPU each one stops at once with
NoDeviceError saying why. What they compute is checked on a GPU (scripts/gpu.sh examples).

Needs torch (skipped, with the reason, where it is missing); no GPU."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed: pip install torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(ROOT, "scripts", "examples")
EXAMPLES = sorted(f[:-3] for f in os.listdir(EXAMPLES_DIR)
                  if f.endswith(".py") and f != "common.py")


def _run(name: str, *args: str):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    for k in [k for k in env if k.startswith(("OMPI_", "PMI_", "PMIX_"))
              or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")]:
        del env[k]  # one process, no launcher
    return subprocess.run([sys.executable, os.path.join(EXAMPLES_DIR, name + ".py"), *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_the_issue_21_examples_are_there():
    assert {"mlp_tp_sp", "attention_tp_sp", "ulysses_long", "train_step"} <= set(EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_help_says_how_to_launch_it(name):
    out = _run(name, "--help")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"mpirun -np 2 python scripts/examples/{name}.py" in out.stdout, out.stdout
    assert f"torchrun --nproc-per-node 2 scripts/examples/{name}.py" in out.stdout, out.stdout
    assert "--tokens" in out.stdout and "--iters" in out.stdout


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_without_a_gpu_raises_no_device_error(name):
    out = _run(name)
    assert out.returncode != 0
    assert "NoDeviceError: cuflux example: needs a CUDA device" in out.stderr, out.stderr[-2000:]
