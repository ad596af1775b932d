"""GPU tests of the PyTorch route (issue 21): cuflux.torch's layers forward and backward
against the unsharded torch layer in float64, torch in / torch out of the ops, and cuflux.init on
a torch.distributed gloo group. Ranks share the GPU under mpiexec (W from
CUFLUX_TEST_WORLD_SIZES, default 1, 2, 4). Skipped, with the reason, without a GPU or without
torch."""
import importlib.util

import pytest

from tests.mpi import fresh_seed, gpu_available, run_ranks, world_sizes

pytestmark = [
    pytest.mark.skipif(not gpu_available(), reason="no CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                       reason="torch is not installed: pip install torch"),
]
WS = world_sizes()


# Each case runs at every W on fresh random data and returns True on every rank when its checks
# passed (a failure names the seed).
CASES = {"column_and_row_parallel_linear_forward_backward": "linear_layers",
         "parallel_rmsnorm_every_output_forward_backward": "norm_layer",
         "ulysses_attention_forward_backward": "ulysses",
         "torch_in_torch_out_on_torch_current_stream": "torch_in_torch_out",
         "init_on_a_torch_distributed_group": "torch_route"}


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("what", list(CASES))
def test_torch_route(what, W):
    seed = fresh_seed()
    try:
        result = run_ranks(W, f"tests.cases_torch:{CASES[what]}", timeout_s=300, seed=seed)
    except AssertionError as e:
        raise AssertionError(f"seed={seed}: {e}") from None
    assert result == [True] * W, f"seed={seed}"
