"""The Triton kernel tests here run on CUDA when there is a GPU, else through Triton's CPU interpreter."""
from tests.triton_backend import triton_backend  # noqa: E402,F401  (the fixture)
