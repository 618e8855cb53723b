"""NSA Triton kernel tests: CUDA when there is a GPU, else Triton's CPU interpreter (``tests/conftest.py`` switches it
on); every test here forces ``ATTNOPS_BACKEND=triton`` and counts the kernel launches (``triton_backend``), so a
silent fallback to the reference fails."""
from tests.triton_backend import DEVICE, triton_backend  # noqa: F401  (the fixture and the kernels' device)
