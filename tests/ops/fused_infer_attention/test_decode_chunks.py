"""The decode tests again with tiny flash-decoding chunks: every KV length of those tests then spans many chunks
(pages split across chunks, pages larger than a chunk, chunks mixing prefix and cache), so the per-chunk masks,
pse, antiquant, left padding and the merge are judged against the golden on split KV."""
from __future__ import annotations

import pytest

from attnops.ops.fused_infer_attention import decode

from .test_fia_property import test_fia_random_paged_decode_vs_golden  # noqa: F401
from .test_fia_values import (  # noqa: F401
    test_antiquant_separate_decode,
    test_decode_mask_shapes,
    test_empty_kv_gives_zeros_and_inf_lse,
    test_int4_decode,
    test_layouts_gqa_lse,
    test_left_padding_decode,
    test_paged,
    test_paged_int8_antiquant_decode,
    test_paged_managed_antiquant_scales,
    test_paged_with_mask_and_pse,
    test_pse,
    test_shared_prefix_decode_with_mask_and_antiquant,
)


@pytest.fixture(autouse=True, params=[7, 16])
def tiny_chunks(request, monkeypatch):
    monkeypatch.setattr(decode, "CHUNK_TOKENS", request.param)
