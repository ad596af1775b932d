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


# ---- epoch re-arm (host-counted ops) --------------------------------------------------------------
class _Stream:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("sync")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Comm:
    def __init__(self, log, silent_peer=None):
        self.log, self.silent_peer = log, silent_peer

    def barrier(self, timeout_s, what):
        from cuflux.errors import CommTimeoutError

        if self.silent_peer is not None:
            raise CommTimeoutError("OpComm", 0, self.silent_peer, timeout_s, what)
        self.log.append("barrier")


class _Record:
    def __init__(self):
        self.failures = []

    def check(self):
        pass

    def record_host_failure(self, code, peer, detail):
        self.failures.append((peer, detail))


def _counting_op(log, silent_peer=None):
    from types import SimpleNamespace

    op = object.__new__(base.CommOp)
    op.op, op.timeout_s, op.world = "GemmReduceScatter", 5.0, SimpleNamespace(rank=0)
    op.comm, op.err = _Comm(log, silent_peer), _Record()
    flags = {"flags": np.full(16, 7, np.uint32), "chunk_flags": np.full(4, 9, np.uint32)}
    op.buf = SimpleNamespace(local=lambda name: flags[name])
    op.epoch, op._epoch_regions = 0, ("flags", "chunk_flags")
    return op, flags


def test_epochs_count_up_then_rearm_before_the_32_bit_wrap():
    """No flag slot can stay unwritten for 2^31 calls: at EPOCH_REARM_AT calls the op drains,
    zeroes its flags between two barriers and counts from 1 again."""
    log = []
    op, flags = _counting_op(log)
    assert [op._next_epoch(_Stream(log)) for _ in range(3)] == [1, 2, 3] and log == []
    op.epoch = base.EPOCH_REARM_AT - 1
    assert op._next_epoch(_Stream(log)) == base.EPOCH_REARM_AT and log == []
    assert base.EPOCH_REARM_AT < 2**31  # distances below 2^31 compare correctly in sync.cuh
    assert op._next_epoch(_Stream(log)) == 1
    assert log == ["sync", "barrier", "sync", "barrier"]
    assert not flags["flags"].any() and not flags["chunk_flags"].any()


def test_a_silent_peer_at_the_rearm_fails_the_op_naming_it():
    from cuflux.errors import CommTimeoutError

    op, flags = _counting_op([], silent_peer=3)
    op.epoch = base.EPOCH_REARM_AT
    with pytest.raises(CommTimeoutError, match="rank 0 timed out .* waiting for rank 3"):
        op._next_epoch(_Stream([]))
    assert op.err.failures and op.err.failures[0][0] == 3
    assert flags["flags"].all()  # nothing zeroed while a peer may still write
