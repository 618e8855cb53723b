"""One spawn per world size for the ring, Ulysses, hybrid, KV all-gather and PyTorch ``context_parallel()`` tests
(``_modes``)."""
import pytest

from tests.distributed._modes import modes_worker
from tests.distributed.test_context_parallel import _spawn


@pytest.fixture(scope="session")
def modes_world2(tmp_path_factory):
    return _spawn(modes_worker, 2, tmp_path_factory.mktemp("modes2"))


@pytest.fixture(scope="session")
def modes_world4(tmp_path_factory):
    return _spawn(modes_worker, 4, tmp_path_factory.mktemp("modes4"))
