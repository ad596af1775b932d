"""World bootstrap under mpiexec -n 4 (runs on a machine without a GPU too)."""
from tests.mpi import run_ranks


def test_bootstrap_four_ranks():
    results = run_ranks(4, "tests.cases_world:bootstrap", timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert results[1]["order"] == [[2, 3, 0]]
