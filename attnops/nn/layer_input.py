"""The input check the attention layers share: ``x`` in the layer's width, dtype and device, with tokens."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_tensor, fail, require
from .._core.errors import ParamDtypeError


def check_layer_input(x, weight: Tensor, hidden: int, *, packed: bool, empty_steps: bool = False) -> None:
    """``x``: ``[B, T, hidden]`` (or packed ``[T, hidden]`` when ``packed``) with at least one token (``T = 0`` is
    allowed with ``empty_steps``: a decoding step through a cache that adds nothing), in the dtype of ``weight`` (the
    layer's parameters; any floating dtype under autocast) and on its device."""
    check_tensor("x", x)
    shapes = f"[B, T, hidden={hidden}]" + (f" or packed [T, hidden={hidden}]" if packed else "")
    if x.ndim not in ((2, 3) if packed else (3,)) or x.shape[-1] != hidden:
        fail("x", shapes, x)
    tokens = x.shape[0] if empty_steps else x.shape[:-1].numel()
    require(tokens > 0, "x", f"{shapes} with at least one " + ("sequence" if empty_steps else "token"), x)
    if not x.dtype.is_floating_point or (x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type)):
        fail("x", f"dtype {weight.dtype} (the layer's parameters)", x,
             f"convert it with x.to({weight.dtype}) or the layer with layer.to(dtype)", error=ParamDtypeError)
    require(x.device == weight.device, "x", f"a tensor on {weight.device} (the layer's parameters)", x,
            f"move it with x.to({str(weight.device)!r})")
