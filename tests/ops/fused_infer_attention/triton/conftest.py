from tests.triton_backend import triton_backend  # noqa: F401  (the fixture)
