"""What attnops does for ``torch.compile`` when it swaps PyTorch functions for wrappers (the torch_npu shim's
patch, the GPU dry run's guarded constructors)."""
from __future__ import annotations

from .torch_compat import forget_dynamo_torch_functions


def forget_traced_functions() -> None:
    """Drop ``torch.compile``'s table of PyTorch functions (Dynamo builds it once, by identity, from what ``torch.*``
    holds then): built while a wrapper stood in for ``torch.tensor`` and friends, it would keep the wrapper and stop
    tracing the restored functions. Called after restoring them; Dynamo rebuilds it on its next compile."""
    forget_dynamo_torch_functions()
