"""Triton kernel tests run on CUDA when there is a GPU, else through Triton's CPU interpreter, switched on by the
suite's top-level ``tests/conftest.py`` before any test module (some import Triton) is collected."""
from tests.triton_backend import triton_backend  # noqa: E402,F401  (the fixture)
