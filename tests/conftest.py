"""Test-session settings.

The tests use tiny shapes, where waking PyTorch's intra-op worker threads costs more than the work itself
(several milliseconds per operator on a busy 2-core machine), so the suite runs single-threaded by default, in one
pytest-xdist worker per CPU (``addopts`` in pyproject.toml; ``-n 0`` runs it in one process; on a CUDA machine one
worker runs them all). Set ATTNOPS_TEST_THREADS to change the threads per worker.

Tests that need the compiled CPU decode kernel use the ``cpu_kernel`` fixture: the kernel is found or built once per
worker, when the first such test runs, not while the tests are collected; the build holds a lock per cache key, so
workers starting at once compile it once.
"""
import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

# Without a GPU the Triton kernel tests run in Triton's CPU interpreter, which must be on before Triton is first
# imported (TRITON_INTERPRET is read then): switch it on here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ["ATTNOPS_TRITON_INTERPRET"] = "1"
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


# torch.compile's kernel cache (default /tmp/torchinductor_$USER, shared by every process of the user) is this
# process's own: a kernel another process left there (other flags, another PyTorch) cannot crash the compile tests
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnops-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def pytest_configure(config):
    torch.set_num_threads(int(os.environ.get("ATTNOPS_TEST_THREADS", "1")))


def pytest_xdist_auto_num_workers(config):
    """``-n logical``: one worker per logical CPU, but one in all on a CUDA machine, whose tests share the GPU."""
    return 1 if torch.cuda.is_available() else None  # None: pytest-xdist counts the CPUs


# session fixtures that spawn a process group (tests/distributed/conftest.py): their tests share one worker
SPAWNING_FIXTURES = ("modes_world2", "modes_world4")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        used = [name for name in SPAWNING_FIXTURES if name in item.fixturenames]
        if used:
            item.add_marker(pytest.mark.xdist_group(used[0]))


@pytest.fixture(scope="session")
def cpu_kernel():
    """The compiled CPU decode kernel (loaded once per session); skips the test where it cannot be built."""
    from attnops.ops.common import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip(f"CPU decode: {cpu_kernels.status()}")
    return cpu_kernels.library()
