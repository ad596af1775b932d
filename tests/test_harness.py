"""The test harness itself (tests/mpi.py, tests/conftest.py): rank bodies found by the ranks,
GPU tests skipped with a reason where there is no GPU."""
import glob
import importlib
import os

import numpy as np
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


@on_ranks
def _same(world, value):
    return value


def test_a_body_test_is_a_gpu_test_over_the_sizes_that_checks_every_rank():
    """body.test(expect=, sizes=) builds the whole test: marked gpu, one case per W, and it
    fails when a rank returns anything but `expect`."""
    test = _same.test(expect=5, sizes=[2], timeout_s=120, value=5)
    marks = {m.name: m for m in test.pytestmark}
    assert "gpu" in marks and marks["parametrize"].args == ("W", [2])
    test(2)  # run here on two CPU ranks (the mark only matters to collection)
    with pytest.raises(AssertionError, match=r"the ranks returned \[5, 5\], each should return 6"):
        _same.test(expect=6, sizes=[2], timeout_s=120, value=5)(2)
    _same.test(sizes=[1], timeout_s=120, value=None)(1)  # no expect: the run alone


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn",
                                   np.float32, np.uint8])
def test_poisoned_outputs_are_nan_in_every_float_dtype(dtype):
    from tests.checks import poisoned

    a = poisoned((3, 5), dtype, xp=np)
    assert a.shape == (3, 5) and (a.view(np.uint8) == 0xFF).all()
    if isinstance(dtype, str):
        from cuflux.arrays import dtype_info

        assert a.dtype == dtype_info(dtype).storage
        if dtype in ("float32", "float16"):
            assert np.isnan(a).all()
