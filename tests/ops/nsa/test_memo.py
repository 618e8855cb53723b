"""The NSA specs remembered per call configuration (``attnops.ops.nsa.memo``): the same configuration gives the same
spec, anything that changes it (a shape, a length, a mask object) a new one; a failing call raises every time; what
depends on values (CPU masks, CPU indices) is validated on every call."""
from __future__ import annotations

import pytest
import torch

from attnops._core.errors import ParamInvalidError
from attnops.ops.nsa.compress import build_compress_spec
from attnops.ops.nsa.compress_attention import build_compress_attention_spec
from attnops.ops.nsa.selected import build_selected_spec

META = torch.device("meta")


def _compress(t=64, lens=(30, 64)):
    x, w = torch.empty(t, 2, 8, device=META), torch.empty(8, 2, device=META)
    return build_compress_spec(x, w, compress_block_size=8, compress_stride=4, actual_seq_len=list(lens))


def test_the_same_configuration_gives_the_same_spec():
    assert _compress() is _compress()
    assert _compress(lens=(20, 64)) is not _compress()
    assert _compress(t=70) is not _compress()
    assert _compress(lens=(20, 64)).lengths == (20, 44)


def test_a_failing_call_raises_every_time():
    for _ in range(2):
        with pytest.raises(ParamInvalidError, match="actual_seq_len"):
            _compress(lens=(30, 65))


def _attention(atten_mask, topk_mask=None, device=META):
    q, k, v = (torch.empty(t, n, 8, device=device) for t, n in ((12, 2), (5, 1), (5, 1)))
    return build_compress_attention_spec(q, k, v, scale_value=0.5, head_num=2, compress_block_size=8,
                                         compress_stride=4, select_block_size=8, select_block_count=1,
                                         atten_mask=atten_mask, topk_mask=topk_mask, actual_seq_qlen=[4, 12],
                                         actual_cmp_seq_kvlen=[2, 5], actual_sel_seq_kvlen=[1, 3], sparse_mode=1)


def test_masks_count_by_identity_and_only_off_the_cpu():
    mask, forced = torch.empty(8, 5, dtype=torch.bool, device=META), torch.empty(8, 3, dtype=torch.bool, device=META)
    spec = _attention(mask, forced)
    assert _attention(mask, forced) is spec and spec.topk_mask is forced
    assert _attention(torch.empty(8, 5, dtype=torch.bool, device=META), forced) is not spec
    assert _attention(mask, forced[:, :2]) is not spec
    cpu = torch.zeros(8, 5, dtype=torch.bool)
    assert _attention(cpu, device="cpu") is not _attention(cpu, device="cpu")  # read on the host: never remembered
    uint8 = torch.empty(8, 5, dtype=torch.uint8, device=META)
    assert _attention(uint8) is not _attention(uint8)  # converted to bool by the spec: never remembered


def test_cpu_indices_are_checked_on_every_call():
    q, k, v = torch.zeros(4, 2, 8), torch.zeros(16, 1, 8), torch.zeros(16, 1, 8)
    kw = dict(scale_value=0.5, head_num=2, select_block_size=8, select_block_count=1, actual_seq_qlen=[4],
              actual_seq_kvlen=[16])
    spec = build_selected_spec(q, k, v, torch.zeros(4, 1, 1, dtype=torch.int32), **kw)
    assert build_selected_spec(q, k, v, torch.ones(4, 1, 1, dtype=torch.int32), **kw) is spec
    with pytest.raises(ParamInvalidError, match="topk_indices"):
        build_selected_spec(q, k, v, torch.full((4, 1, 1), 2, dtype=torch.int32), **kw)
