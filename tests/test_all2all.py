"""GPU tests of All2AllHeads: several ranks share the GPU under mpiexec (skipped without a GPU).

W comes from CUFLUX_TEST_WORLD_SIZES (default 1,2,4; the GPU machine runs 1,2,4,8). Each test
draws a fresh seed; the rank bodies are in tests/cases_all2all.py.
"""

import pytest

from tests.mpi import gpu_available, run_ranks, world_sizes, fresh_seed

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
WS = world_sizes()


@pytest.mark.parametrize("W", WS)
def test_exact_every_dtype_and_head_dim(W):
    n = run_ranks(W, "tests.cases_all2all:exact", timeout_s=400, seed=fresh_seed())
    assert n == [40] * W


@pytest.mark.parametrize("W", WS)
def test_wide_rows_misaligned_views_streams_torch(W):
    res = run_ranks(W, "tests.cases_all2all:features", timeout_s=300, seed=fresh_seed())
    assert all(r in (True, "torch missing") for r in res)


@pytest.mark.parametrize("W", WS)
def test_bad_input_raises_before_launch(W):
    res = run_ranks(W, "tests.cases_all2all:errors", timeout_s=300, seed=fresh_seed())
    assert len(set(res)) == 1 and res[0] >= 14


@pytest.mark.parametrize("W", WS)
def test_back_to_back_1000_calls(W):
    assert run_ranks(W, "tests.cases_all2all:back_to_back", timeout_s=600,
                     seed=fresh_seed()) == [1000] * W


@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_timeout_names_peer_then_usable(W):
    waited = run_ranks(W, "tests.cases_all2all:timeout", timeout_s=300, seed=fresh_seed())
    assert waited[-1] is None  # the rank that skipped
    assert all(set(w) == {"device", "host"} and max(w.values()) < 3.0 for w in waited[:-1])
