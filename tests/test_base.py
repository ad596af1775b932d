"""GPU tests of what every op inherits from CommOp (aliasing refused, per-call arguments
compared across ranks, abort after a timeout); ranks share the GPU under mpiexec."""
import pytest

from tests.mpi import gpu_available, run_ranks, world_sizes

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
WS = world_sizes()


@pytest.mark.parametrize("W", WS[:2])
def test_outputs_overlapping_inputs_are_refused(W):
    assert run_ranks(W, "tests.cases_base:aliasing", timeout_s=300) == [3] * W


@pytest.mark.parametrize("W", [w for w in WS if w > 1][:2])
def test_mismatched_m_raises_on_every_rank(W):
    assert run_ranks(W, "tests.cases_base:mismatched_m", timeout_s=300) == [True] * W


@pytest.mark.parametrize("W", [w for w in WS if w > 1][:1])
def test_late_rank_times_out_and_abort_returns_at_once(W):
    res = run_ranks(W, "tests.cases_base:abort_after_timeout", timeout_s=120)
    assert all(r is not None for r in res[:-1]) and res[-1] is None
