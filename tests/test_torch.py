"""GPU tests of the PyTorch route (issue 21): cuflux.torch's layers forward and backward
against the unsharded torch layer in float64, torch in / torch out of the ops, and cuflux.init on
a torch.distributed gloo group. Ranks share the GPU under mpiexec (W = 1, 2). Skipped, with the
reason, without a GPU or without torch."""
import importlib.util

import pytest

from tests.mpi import gpu_available, run_ranks

pytestmark = [
    pytest.mark.skipif(not gpu_available(), reason="no CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                       reason="torch is not installed: pip install torch"),
]
WS = [1, 2]


@pytest.mark.parametrize("W", WS)
def test_column_and_row_parallel_linear_forward_backward(W):
    assert run_ranks(W, "tests.cases_torch:linear_layers", timeout_s=300) == [True] * W


@pytest.mark.parametrize("W", WS)
def test_parallel_rmsnorm_forward_backward(W):
    assert run_ranks(W, "tests.cases_torch:norm_layer", timeout_s=300) == [True] * W


@pytest.mark.parametrize("W", WS)
def test_ulysses_attention_forward_backward(W):
    assert run_ranks(W, "tests.cases_torch:ulysses", timeout_s=300) == [True] * W


@pytest.mark.parametrize("W", WS)
def test_torch_in_torch_out_on_torch_current_stream(W):
    assert run_ranks(W, "tests.cases_torch:torch_in_torch_out", timeout_s=300) == [True] * W


@pytest.mark.parametrize("W", WS)
def test_init_on_a_torch_distributed_group(W):
    assert run_ranks(W, "tests.cases_torch:torch_route", timeout_s=300) == [True] * W
