"""flash-attn's ``window_size`` in its two accepted forms: a pair ``(left, right)`` or a 2-element integer tensor
(its own tests draw windows with ``torch.randint(0, seqlen, (2,))``)."""
from __future__ import annotations

from torch import Tensor


def as_pair(window_size):
    """A 2-element integer tensor as a tuple of ints; anything else unchanged (the caller validates it)."""
    if isinstance(window_size, Tensor) and window_size.shape == (2,) and not window_size.is_floating_point() \
            and not window_size.is_complex() and window_size.dtype.is_signed:
        return tuple(window_size.tolist())
    return window_size
