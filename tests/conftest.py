import pytest

from tests.harness import close_pools


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    close_pools()
