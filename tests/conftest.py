"""pytest hooks: end the pools of ranks that tests/mpi.py keeps between tests."""


def pytest_sessionfinish(session, exitstatus):
    from tests.mpi import close_pools

    close_pools()
