"""GPU tests of the runtime: several ranks share the GPU under mpiexec (skipped without a GPU)."""
import pytest

from tests.mpi import gpu_available, run_ranks, world_sizes

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
WS = world_sizes()


@pytest.mark.parametrize("W", WS)
def test_symmetric_buffers_visible_from_every_peer(W):
    run_ranks(W, "tests.cases_runtime:symmetric_visible")


@pytest.mark.parametrize("W", WS)
def test_flags_by_epoch_and_stream_values(W):
    waited = run_ranks(W, "tests.cases_runtime:flags_by_epoch")
    assert all(w < 1.5 for w in waited)


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("chunk_rows,dtype,wait", [(None, "bfloat16", "stream"),
                                                   (64, "float32", "kernel"),
                                                   (7, "float8_e4m3fn", "stream"),
                                                   (13, "float16", "stream")])
def test_allgather_exact(W, mode, chunk_rows, dtype, wait):
    run_ranks(W, "tests.cases_runtime:allgather_exact", mode=mode, chunk_rows=chunk_rows,
              dtype=dtype, wait=wait)


@pytest.mark.parametrize("W", WS)
def test_allgather_torch_arrays(W):
    run_ranks(W, "tests.cases_runtime:allgather_torch")


@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("mode,wait", [("pull", "stream"), ("push", "stream"),
                                       ("pull", "kernel")])
def test_allgather_back_to_back(W, mode, wait):
    run_ranks(W, "tests.cases_runtime:allgather_back_to_back", mode=mode, wait=wait,
              timeout_s=600)


@pytest.mark.parametrize("W", [w for w in WS if w > 1])
@pytest.mark.parametrize("mode,wait", [("pull", "stream"), ("push", "stream"),
                                       ("pull", "kernel"), ("push", "kernel")])
def test_allgather_timeout_then_usable(W, mode, wait):
    res = run_ranks(W, "tests.cases_runtime:allgather_timeout", mode=mode, wait=wait)
    assert all(r["after"] for r in res)
    assert all(r["waited"] is not None for r in res[:-1])
