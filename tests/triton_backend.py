"""The ``triton_backend`` fixture of the Triton kernel tests: CUDA when there is a GPU, else Triton's CPU interpreter
(``tests/conftest.py`` switches it on). It forces ``ATTNOPS_BACKEND=triton`` and yields the list of kernel names
launched, so a silent fallback to the reference fails the test."""
import pytest
import torch

from attnops._core.triton.launch import KernelFamily

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_backend(monkeypatch):
    """Forces the Triton backend (interpreter on CPU) and yields the list of kernel names launched."""
    monkeypatch.setenv("ATTNOPS_BACKEND", "triton")
    monkeypatch.setenv("ATTNOPS_TRITON_INTERPRET", "1")
    launched = []
    run = KernelFamily.run

    def counting(self, launch, device):
        launched.append(launch.kernel)
        return run(self, launch, device)

    monkeypatch.setattr(KernelFamily, "run", counting)
    return launched
