"""CUDA tests (``pytest -m cuda``): every test here is marked ``cuda`` and skips without a GPU."""
import pytest
import torch


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects on the marker
def pytest_collection_modifyitems(items):
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
