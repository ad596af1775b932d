"""pytest hooks for the rank pools that tests/mpi.py keeps between tests."""


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


def pytest_sessionfinish(session, exitstatus):
    from tests.mpi import close_pools

    close_pools()
