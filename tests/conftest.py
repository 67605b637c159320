"""Suite-wide fixtures: shared process worlds, and tests that leave nothing behind."""

import os

import pytest

from tandem import runtime
from tandem.job import settings
from tandem.testing import close_worlds


@pytest.fixture(scope="session", autouse=True)
def _shared_worlds():
    yield
    close_worlds()


@pytest.fixture(autouse=True)
def _leaves_nothing_behind():
    """Fail a test that leaks TANDEM_* variables or a tandem runtime in the test process."""
    before = {k: v for k, v in os.environ.items() if k.startswith("TANDEM_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("TANDEM_")}
    leaked_runtime = runtime.is_initialized()
    if leaked_runtime:
        runtime.shutdown()
    settings.reload()  # a test that changed TANDEM_* read them again; the next reads what is
    assert after == before, f"test leaked environment variables: {set(after) ^ set(before)}"
    assert not leaked_runtime, "test left tandem initialised in the test process"
