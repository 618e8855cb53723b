"""Test-session settings.

The tests use tiny shapes, where waking PyTorch's intra-op worker threads costs more than the work itself
(several milliseconds per operator on a busy 2-core machine), so the suite runs single-threaded by default.
Set ATTNOPS_TEST_THREADS to change it.
"""
import os
import sys

import torch

# Without a GPU the Triton kernel tests run in Triton's CPU interpreter, which must be on before Triton is first
# imported (TRITON_INTERPRET is read then): switch it on here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ["ATTNOPS_TRITON_INTERPRET"] = "1"
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    torch.set_num_threads(int(os.environ.get("ATTNOPS_TEST_THREADS", "1")))
