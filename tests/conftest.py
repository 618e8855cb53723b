"""Test-session settings.

The tests use tiny shapes, where waking PyTorch's intra-op worker threads costs more than the work itself
(several milliseconds per operator on a busy 2-core machine), so the suite runs single-threaded by default.
Set ATTNOPS_TEST_THREADS to change it.
"""
import os

import torch


def pytest_configure(config):
    torch.set_num_threads(int(os.environ.get("ATTNOPS_TEST_THREADS", "1")))
