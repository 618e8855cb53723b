"""The stand-in NPU's random generator for dropout: torch_npu's Philox ``(seed, offset)`` pair. Fusion attention
without a dropout mask takes its seed and offset from it (advancing the offset, as torch_npu's
``philox_engine_inputs``), so ``torch.npu.manual_seed(s)`` followed by ``npu_fusion_attention(keep_prob<1)`` drops
what ``_npu_dropout_gen_mask(seed=s, offset=0)`` drops, as on the NPU. Until it is seeded (``torch.npu.manual_seed``,
``torch.manual_seed`` once the shim is installed, or ``torch.npu.set_rng_state``) each draw takes a fresh seed from
PyTorch's default generator with offset 0."""
from __future__ import annotations

import numpy as np
import torch

from .._core.dropout import draw_seed

_UINT64 = 1 << 64
_state: dict[str, int] = {}


def manual_seed(seed: int) -> None:
    """Seed the generator (offset 0)."""
    _state.update(seed=int(seed) % _UINT64, offset=0)


def philox_inputs(increment: int) -> tuple[int, int]:
    """``(seed, offset)`` for a kernel drawing ``increment`` counters per thread; the offset then advances by
    ``increment`` rounded up to a multiple of 4."""
    if not _state:
        return draw_seed(), 0
    seed, offset = _state["seed"], _state["offset"]
    _state["offset"] = offset + (increment + 3) // 4 * 4
    return (seed if seed < 1 << 63 else seed - _UINT64), offset


def with_state(base: torch.Tensor) -> torch.Tensor:
    """``base`` (the stand-in device's generator state) followed by the 16 bytes of this generator's seed and
    offset: what ``torch.npu.get_rng_state()`` returns (it seeds the generator first if nobody did)."""
    if not _state:
        manual_seed(draw_seed())
    words = np.array([_state["seed"], _state["offset"]], dtype=np.uint64).view(np.uint8)
    return torch.cat([base.to(torch.uint8).cpu(), torch.from_numpy(words.copy())])


def restore(state: torch.Tensor) -> torch.Tensor:
    """Restore the seed and offset from a :func:`with_state` tensor; returns its ``base`` part."""
    seed, offset = state[-16:].cpu().numpy().copy().view(np.uint64).tolist()
    _state.update(seed=seed, offset=offset)
    return state[:-16]
