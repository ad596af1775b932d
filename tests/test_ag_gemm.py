"""GPU tests of AllGatherGemm (skipped without a GPU): ranks share the GPU under mpiexec, W from
CUFLUX_TEST_WORLD_SIZES (1, 2, 4 by default; 8 on the GPU machine). The rank bodies are in
tests/cases_ag_gemm.py: float64 reference, poisoned outputs, the gathered A bit for bit, and the
output bit for bit against cuflux.gemm with the same core and configuration."""

import pytest

from tests.mpi import gpu_available, run_ranks, world_sizes, core_impls, fresh_seed

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
WS = world_sizes()


def _skip_push_at_one(W, mode):
    if W == 1 and mode == "push":  # saves GPU time: at W = 1 both modes run the same path
        pytest.skip("W = 1 has no gather: mode='push' runs the pull path")


@pytest.fixture(scope="module", autouse=True)
def _compiled_once():
    """Compile the two families here once, so W rank processes do not all compile at once."""
    if not gpu_available():
        return
    import cuflux.ops  # noqa: F401  (registers every family)
    import cuflux.ops.ag_gemm  # noqa: F401  (until cuflux.ops imports it)
    from cuflux import kernels

    arch = kernels.device_arch()
    for src in ("ag_gemm.cu", "gemm.cu"):
        fam = kernels.families()[src]
        kernels.compile_source(fam.source, fam.names, arch)


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("impl", ["sm90", "sm80"])
def test_matches_float64_and_the_plain_gemm(W, mode, impl):
    if impl not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
    _skip_push_at_one(W, mode)
    run_ranks(W, "tests.cases_ag_gemm:sweep", timeout_s=300, mode=mode, impl=impl, seed=fresh_seed())


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_routes_match_float64(W, mode):
    """route="unfused", "fused" and "auto" (small M: unfused where cuflux.gemm takes cuBLAS)
    against reference_ag_gemm; W = 1 runs the fused kernel on every route."""
    _skip_push_at_one(W, mode)
    res = run_ranks(W, "tests.cases_ag_gemm:routes", timeout_s=300, mode=mode,
                    seed=fresh_seed())
    for taken in res:
        assert set(taken["fused"]) == {"fused"}
        assert set(taken["unfused"]) == {"fused" if W == 1 else "unfused"}
        assert W > 1 or set(taken["auto"]) == {"fused"}


@pytest.mark.parametrize("W", [w for w in WS if w <= 2])
def test_every_configuration(W):
    assert run_ranks(W, "tests.cases_ag_gemm:every_config", timeout_s=300,
                     seed=fresh_seed())[0] >= 1


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_back_to_back_calls_with_changing_rows(W, mode):
    _skip_push_at_one(W, mode)
    assert run_ranks(W, "tests.cases_ag_gemm:back_to_back", timeout_s=300,
                     mode=mode) == [1000] * W


@pytest.mark.parametrize("W", [w for w in WS if w > 1][:1])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("impl", ["sm90", "sm80"])
def test_late_peer_is_waited_for(W, mode, impl):
    if impl not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
    waited = run_ranks(W, "tests.cases_ag_gemm:late_peer", timeout_s=180, mode=mode, impl=impl)
    assert waited[-1] is None and all(w > 0.5 for w in waited[:-1])


@pytest.mark.parametrize("W", [w for w in WS if w > 1])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("route", ["fused", "unfused"])
def test_timeout_names_the_missing_rank(W, mode, route):
    res = run_ranks(W, "tests.cases_ag_gemm:timeout", timeout_s=300, mode=mode, route=route)
    assert all(r["waited"] is not None for r in res[:-1]) and res[-1]["waited"] is None
    assert all(r["after"] < 1e-2 for r in res)


@pytest.mark.parametrize("W", [w for w in WS if w > 1][:1] or [1])
def test_bad_input_raises_before_anything_is_queued(W):
    run_ranks(W, "tests.cases_ag_gemm:bad_input", timeout_s=300)
