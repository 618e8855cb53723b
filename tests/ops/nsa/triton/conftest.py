"""NSA Triton kernel tests: CUDA when there is a GPU, else Triton's CPU interpreter (``tests/conftest.py`` switches it
on); every test here forces ``ATTNOPS_BACKEND=triton`` and counts the kernel launches, so a silent fallback to the
reference fails."""
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
