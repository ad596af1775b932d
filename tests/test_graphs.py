"""GPU tests of CUDA-graph capture for every op: capture once, replay 100 times with new inputs,
exact against the reference; ops or paths that cannot be captured raise CaptureError (ranks
share the GPU under mpiexec; W from CUFLUX_TEST_WORLD_SIZES). Skipped without a GPU."""
import pytest

from tests.mpi import gpu_available, run_ranks, world_sizes

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
WS = world_sizes()


@pytest.mark.parametrize("W", WS)
def test_rmsnorm_every_mode_captured_and_replayed(W):
    assert run_ranks(W, "tests.cases_graphs:rmsnorm_modes", timeout_s=600) == [100] * W


@pytest.mark.parametrize("W", WS)
def test_all2all_capture(W):
    assert run_ranks(W, "tests.cases_graphs:all2all", timeout_s=300) == [100] * W


@pytest.mark.parametrize("W", WS)
def test_gemm_rs_capture(W):
    assert run_ranks(W, "tests.cases_graphs:gemm_rs", timeout_s=300) == [100] * W


@pytest.mark.parametrize("W", WS)
def test_host_driven_ops_refuse_capture(W):
    assert run_ranks(W, "tests.cases_graphs:host_driven", timeout_s=300) == [
        (2 if W > 1 else 1)] * W
