"""GPU tests of GemmReduceScatter: ranks share the GPU under mpiexec (W from
CUFLUX_TEST_WORLD_SIZES; 8 included on the GPU machine). Skipped without a GPU. The rank bodies
are in tests/cases_gemm_rs.py."""

import pytest

from tests.mpi import gpu_available, run_ranks, world_sizes, core_impls, fresh_seed

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
WS = world_sizes()
MODES = ["deterministic", "atomic"]


@pytest.fixture(autouse=True)
def _no_gemm_tuning(monkeypatch):
    # At W = 1 the op is the plain GEMM; its tuner would time candidates on every new shape.
    monkeypatch.setenv("CUFLUX_GEMM_TUNE", "0")


@pytest.mark.parametrize("W", WS)
def test_exact_routing_every_core_mode_layout(W):
    count = run_ranks(W, "tests.cases_gemm_rs:exact_routing", timeout_s=300, seed=fresh_seed(),
                      impls=core_impls())
    assert count == [count[0]] * W and count[0] >= 20


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("impl", ["sm90", "sm80"])
def test_float_sweep_against_float64_and_ring(W, impl):
    if impl not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
    ratios = run_ranks(W, "tests.cases_gemm_rs:float_sweep", timeout_s=300, seed=fresh_seed(),
                       impl=impl)
    # the bf16 comparison with the ring baseline ran for both modes on every rank
    assert all(r[m] > 0 for r in ratios for m in MODES)


@pytest.mark.parametrize("W", WS)
def test_reduce_scatter_only_matches_rank_order_bits(W):
    assert run_ranks(W, "tests.cases_gemm_rs:reduce_scatter_exact", timeout_s=200,
                     seed=fresh_seed()) == [True] * W


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("reduce", MODES)
def test_back_to_back_calls_with_changing_m(W, reduce):
    issued = run_ranks(W, "tests.cases_gemm_rs:back_to_back", timeout_s=400, seed=fresh_seed(),
                       reduce=reduce)
    assert issued == [1000] * W


@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_epochs_rearm_before_the_32_bit_wrap(W):
    assert run_ranks(W, "tests.cases_gemm_rs:epoch_wrap", timeout_s=120,
                     seed=fresh_seed()) == [True] * W


@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_timeout_names_the_rank_that_never_computes(W):
    res = run_ranks(W, "tests.cases_gemm_rs:timeout", timeout_s=150)
    assert all(set(r["waited"]) == set(MODES) for r in res[:-1]) and res[-1]["waited"] is None


@pytest.mark.parametrize("W", sorted({1} | {w for w in WS if w > 1}))
def test_bad_input_raises_before_launch(W):
    assert run_ranks(W, "tests.cases_gemm_rs:bad_input", timeout_s=150) == [True] * W
