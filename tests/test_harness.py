"""The test harness itself (tests/mpi.py, tests/conftest.py): rank bodies found by the ranks,
GPU tests skipped with a reason where there is no GPU."""
import glob
import importlib
import os

import pytest

from tests.mpi import on_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


@on_ranks
def _echo(world, value):
    return [world.rank, world.size, value]


def test_every_rank_body_is_found_by_its_target():
    """A rank imports `module:function` from a body's target: each must name the body itself
    (a body moved or renamed without its decorator's target following would run nothing)."""
    seen = 0
    for path in sorted(glob.glob(os.path.join(HERE, "test_*.py"))):
        name = "tests." + os.path.basename(path)[:-3]
        try:
            module = importlib.import_module(name)
        except pytest.skip.Exception:  # an optional dependency is missing (torch)
            continue
        for value in vars(module).values():
            if callable(value) and hasattr(value, "target") and hasattr(value, "run"):
                mod, fn = value.target.split(":")
                assert getattr(importlib.import_module(mod), fn) is value, value.target
                seen += 1
    assert seen >= 40, seen  # the GPU tests' bodies (59 when torch is importable)


def test_a_rank_body_runs_on_two_ranks():
    assert _echo.run(2, timeout_s=120, value=7) == [[0, 2, 7], [1, 2, 7]]


@pytest.mark.gpu
def test_gpu_marker_skips_with_the_reason_without_a_gpu(request):
    from tests.mpi import gpu_available

    assert gpu_available()  # conftest skipped this test otherwise ("no CUDA device")
    assert request.node.get_closest_marker("cpu") is None
