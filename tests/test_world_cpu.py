"""World bootstrap under mpiexec -n 4 (runs on a machine without a GPU too)."""
from tests.mpi import run_ranks


def test_bootstrap_four_ranks():
    results = run_ranks(4, "tests.cases_world:bootstrap", timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert results[1]["order"] == [[2, 3, 0]]


def test_rank_pool_reuses_ranks_passes_settings_and_survives_failures(monkeypatch):
    import pytest

    from tests import mpi

    monkeypatch.setenv("CUFLUX_TEST_POOL", "1")
    monkeypatch.setenv("CUFLUX_POOL_PROBE", "a")
    first = run_ranks(3, "tests.cases_world:identity", timeout_s=120)
    monkeypatch.setenv("CUFLUX_POOL_PROBE", "b")
    second = run_ranks(3, "tests.cases_world:identity", timeout_s=120)
    assert [r["pid"] for r in first] == [r["pid"] for r in second]  # same processes
    assert {r["setting"] for r in first} == {"a"} and {r["setting"] for r in second} == {"b"}
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        run_ranks(3, "tests.cases_world:identity", timeout_s=120, fail_rank=1)
    with pytest.raises(AssertionError, match="TIMED OUT"):
        run_ranks(3, "tests.cases_world:identity", timeout_s=5, hang_rank=2)
    third = run_ranks(3, "tests.cases_world:identity", timeout_s=120)
    assert not {r["pid"] for r in third} & {r["pid"] for r in first}  # a new pool
    mpi.close_pools()
