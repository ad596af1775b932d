"""CPU tests of the op base's shared checks (cuflux/ops/base.py): aliasing, timeouts, capture
refusal. No GPU."""
import math

import numpy as np
import pytest

from cuflux.errors import CaptureError
from cuflux.ops import base
from tests.fakes import FakeArray


def _arr(ptr, nbytes):
    a = FakeArray((nbytes // 2,), "float16", ptr=ptr)
    a.nbytes = nbytes
    return a


@pytest.mark.parametrize("out_ptr,overlap", [(0, True), (100, True), (4094, True),
                                             (4096, False), (8192, False), (-4096, False),
                                             (-4094, True)])
def test_output_overlapping_an_input_is_refused(out_ptr, overlap):
    base_ptr = 1 << 30
    x = _arr(base_ptr, 4096)
    out = _arr(base_ptr + out_ptr, 4096)
    if overlap:
        with pytest.raises(ValueError, match="out overlaps x"):
            base.check_no_alias("Op", out, x=x, w=None)
    else:
        base.check_no_alias("Op", out, x=x, w=None)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), -math.inf, "30", True, None])
def test_timeouts_must_be_finite_positive_numbers(bad):
    with pytest.raises(ValueError, match="finite number of seconds > 0"):
        base.check_timeout("Op", bad)


@pytest.mark.parametrize("good", [1, 0.5, np.float64(2.0), 1e-3])
def test_good_timeouts(good):
    assert base.check_timeout("Op", good) == float(good)


def test_capture_refusal_names_the_op_and_why(monkeypatch):
    from cuflux import launch

    monkeypatch.setattr(launch, "capturing", lambda s: True)
    with pytest.raises(CaptureError, match="Op: cannot be captured in a CUDA graph: because"):
        base.refuse_capture("Op", 0, "because")
    monkeypatch.setattr(launch, "capturing", lambda s: False)
    base.refuse_capture("Op", 0, "because")


def test_unfused_below_m_is_gemms_cublas_boundary():
    """route="auto" runs a fused op unfused exactly where cuflux.gemm's untuned rule takes
    cuBLAS: below that the fused kernel (cuflux's GEMM core) loses to cuBLAS."""
    from cuflux.gemm_tuner import CUBLAS, CUBLAS_BELOW_M, heuristic

    assert base.UNFUSED_BELOW_M == CUBLAS_BELOW_M
    for M in (1, 16, 255, 256, 257, 4096):
        assert (base.fused_route("auto", M) == "unfused") == (heuristic(M, 8192, 8192) == CUBLAS)
    assert base.fused_route("fused", 1) == "fused" and base.fused_route("unfused", 8192) == "unfused"
    with pytest.raises(ValueError, match="Op: route must be one of"):
        base.check_route("Op", "sometimes")
