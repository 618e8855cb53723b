"""FlashAttention problems remembered per call configuration (``build_problem``): a repeated call reuses its problem,
options of every plain type included; a small device bool mask counts by identity (another tensor, or one of another
layout, makes a new problem holding it), a large one is never kept; a CPU mask, read on the host, is never keyed, so
writing it in place is seen by the next call."""
from __future__ import annotations

import torch

from attnops.ops.common import problem as P

META = torch.device("meta")


def _problem(mask=None, device=META, sq=4, skv=6, **options):
    q = torch.empty(1, 2, sq, 8, dtype=torch.float16, device=device)
    k = torch.empty(1, 2, skv, 8, dtype=torch.float16, device=device)
    return P.build_problem(q, k, k, head_num=2, layout="BNSD", scale=0.25, atten_mask=mask,
                           pse_bottom_right=False, **options)


def test_a_repeated_call_reuses_its_problem():
    assert _problem() is _problem()
    assert _problem(pre_tokens=3, next_tokens=0) is _problem(pre_tokens=3, next_tokens=0)
    assert _problem(pre_tokens=3, next_tokens=0) is not _problem()


def test_a_device_mask_counts_by_identity():
    mask = torch.empty(4, 6, dtype=torch.bool, device=META)
    first = _problem(mask)
    assert _problem(mask) is first
    mask.fill_(True)  # written in place: never read on the host, the same problem (the kernels read the mask)
    assert _problem(mask) is first
    other = torch.empty(4, 6, dtype=torch.bool, device=META)
    second = _problem(other)
    assert second is not first and second.mask.explicit._base is other
    assert _problem(mask.t().contiguous().t()) is not first  # another tensor, another layout


def test_a_large_device_mask_is_not_kept():
    mask = torch.empty(300, 300, dtype=torch.bool, device=META)  # a training step's: made afresh at every step
    assert _problem(mask, sq=300, skv=300) is not _problem(mask, sq=300, skv=300)


def test_a_cpu_mask_is_read_at_every_call():
    mask = torch.zeros(4, 6, dtype=torch.bool)
    first = _problem(mask, torch.device("cpu"))
    assert first.mask.explicit is None  # no masked entry: the band covers everything
    mask[1, 2] = True  # written in place
    second = _problem(mask, torch.device("cpu"))
    assert second is not first and second.mask.explicit is not None
