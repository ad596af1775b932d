"""GPU tests of issue 19's reliability work (skipped without a GPU): the World's GPU choice on a
sub-communicator and the caller's current device, close(abort=True) with a peer gone, stream
waits on host-mapped symmetric flags, and the watchdog's CPU release with
CUDA_DEVICE_MAX_CONNECTIONS=1."""
import pytest

from tests.mpi import gpu_available, run_ranks, world_sizes

pytestmark = pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
WS = world_sizes()
SLACK_S = 2.0


@pytest.mark.parametrize("W", WS)
def test_sub_communicator_world_picks_the_same_gpu_and_leaves_the_current_device(W):
    res = run_ranks(W, "tests.cases_reliability:gpu_subcomm_device")
    n = res[0]["devices"]
    assert [r["device"] for r in res] == [r % n for r in range(W)]  # one host: rank = local


@pytest.mark.parametrize("W", [w for w in WS if w > 1])
def test_abort_close_returns_at_once_with_a_peer_gone(W):
    res = run_ranks(W, "tests.cases_reliability:gpu_abort_close", bound_s=2.0)
    assert res[-1]["gone"]
    for out in res[:-1]:
        assert out["abort_s"] < 0.5, out
        close = out["close"]
        assert close["error"] == "CommTimeoutError" and close["peer"] == W - 1, out
        assert 2.0 <= close["seconds"] < 2.0 + SLACK_S, out
        assert out["leaked"] > 0  # the local allocation is kept, not freed under a peer


@pytest.mark.parametrize("W", WS)
def test_stream_waits_on_host_mapped_flags(W):
    res = run_ranks(W, "tests.cases_reliability:gpu_host_flags", bound_s=1.0)
    for me, out in enumerate(res):
        assert out["seen"] == [0 if p == me else 7 for p in range(W)], out
        assert 1.0 <= out["released_s"] < 1.0 + SLACK_S, out
        assert out["check"]["error"] == "CommTimeoutError", out


def test_watchdog_releases_by_cpu_with_one_hardware_queue(monkeypatch):
    # A fresh process: the variable must be set before CUDA starts.
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("CUFLUX_TEST_POOL", "0")
    (out,) = run_ranks(1, "tests.cases_reliability:gpu_watchdog_one_connection", timeout_s=120,
                       bound_s=1.0)
    assert out["ok"], out  # the work queued behind the blocked wait ran, and ran right
    assert 1.0 <= out["elapsed"] < 1.0 + SLACK_S, out
    assert out["check"]["error"] == "CommTimeoutError", out
    assert out["warned"], out
