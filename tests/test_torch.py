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


# Each case runs at W = 1 and 2 and returns True on every rank when its checks passed.
CASES = {"column_and_row_parallel_linear_forward_backward": "linear_layers",
         "parallel_rmsnorm_forward_backward": "norm_layer",
         "ulysses_attention_forward_backward": "ulysses",
         "torch_in_torch_out_on_torch_current_stream": "torch_in_torch_out",
         "init_on_a_torch_distributed_group": "torch_route"}


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("what", list(CASES))
def test_torch_route(what, W):
    assert run_ranks(W, f"tests.cases_torch:{CASES[what]}", timeout_s=300) == [True] * W
