"""GPU tests of AllReduce and AllReduceRMSNorm: ranks share the GPU under mpiexec (W from
CUFLUX_TEST_WORLD_SIZES; 8 included on the GPU machine). Skipped without a GPU.
CUFLUX_TEST_FULL=1 sweeps the whole product of dtypes, hidden sizes and token counts."""
import pytest

from tests.mpi import gpu_available, run_ranks, world_sizes

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
WS = world_sizes()


def test_local_rmsnorm_kernel():
    run_ranks(1, "tests.cases_allreduce:local_norm")


@pytest.mark.parametrize("W", [w for w in WS if w > 1][:1] or [1])
def test_bad_input_raises_before_launch(W):
    run_ranks(W, "tests.cases_allreduce:bad_input")


@pytest.mark.parametrize("W", WS)
def test_allreduce_sizes_algorithms_bit_identical(W):
    run_ranks(W, "tests.cases_allreduce:plain_sweep", timeout_s=300)


@pytest.mark.parametrize("W", WS)
def test_cuda_graph_replay(W):
    assert run_ranks(W, "tests.cases_allreduce:graph_replay", timeout_s=300) == [3] * W


@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_timeout_names_the_missing_rank(W):
    res = run_ranks(W, "tests.cases_allreduce:timeout", timeout_s=300)
    assert all(r["waited"] is not None for r in res[:-1]) and res[-1]["waited"] is None


@pytest.mark.parametrize("W", WS)
def test_rmsnorm_every_mode_dtype_and_shape(W):
    calls = run_ranks(W, "tests.cases_allreduce:norm_sweep", timeout_s=600)
    assert all(c == calls[0] and c > 0 for c in calls)


@pytest.mark.parametrize("W", WS)
def test_back_to_back_calls(W):
    issued = run_ranks(W, "tests.cases_allreduce:back_to_back", timeout_s=600)
    assert issued == [1100] * W
