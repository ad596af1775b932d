"""pytest hooks for the rank pools that tests/mpi.py keeps between tests."""

import os
import signal

import pytest


def _kill_pools_then_die(signum, frame):
    """A pytest ended by `timeout` (SIGTERM) or a closed terminal (SIGHUP) takes its rank pools
    with it: each pool runs in its own session, so without this its ranks outlive pytest and
    hold the GPU (on a reused machine the next run's W = 8 ranks then failed to allocate)."""
    from tests.mpi import kill_pools

    kill_pools()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@pytest.fixture(params=["sm90", "sm80"])
def impl(request):
    """The GEMM core a GPU test runs: the portable one everywhere and Hopper's where the device
    has sm_90a (skipped, with the reason, elsewhere). A test that parametrizes `impl` itself
    (the CPU checks of both cores' kernel arguments) overrides this."""
    from tests.mpi import core_impls

    if request.param not in core_impls():
        pytest.skip("the Hopper core needs an sm_90a device")
    return request.param


def pytest_configure(config):
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _kill_pools_then_die)
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped, with the reason, "
                            "where there is none)")
    config.addinivalue_line("markers", "cpu: runs on any machine (every test not marked gpu)")


def pytest_collection_modifyitems(session, config, items):
    """Within each test module, run the cases of one world size W together (stable otherwise),
    so one pool of ranks serves a run of tests and is the only pool alive (W = 1, 2, 4 and 8
    pools side by side are 15 CUDA contexts on one GPU: the H200 refused new contexts there)."""
    modules = {}
    for item in items:
        modules.setdefault(item.module.__name__ if item.module else "", len(modules))

    def world(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        w = params.get("W", 0)
        return w if isinstance(w, int) else 0

    items.sort(key=lambda it: (modules[it.module.__name__ if it.module else ""], world(it)))
    # GPU / CPU split by markers: `-m gpu` / `-m cpu` (and `-k cpu`) select either half.
    import pytest

    no_gpu = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.cpu)
            continue
        if no_gpu is None:
            from tests.mpi import gpu_available

            no_gpu = not gpu_available()
        if no_gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))


def pytest_sessionfinish(session, exitstatus):
    from tests.mpi import close_pools

    close_pools()
