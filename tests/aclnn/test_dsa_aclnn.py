"""The DSA / MLA aclnn operators: the two-phase form returns the torch_npu function's outputs, validates in phase 1
with named errors, and its executor runs once (accuracy against the golden: the ``aclnn.*`` check rows)."""
from __future__ import annotations

import pytest
import torch

from attnops import AclnnError, ParamInvalidError, aclnn, torch_npu

INT64_MAX = 2**63 - 1


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_lightning_indexer_two_phase_matches_torch_npu_and_runs_once():
    q, k, w = _r(1, 12, 2, 128, seed=1), _r(1, 12, 1, 128, seed=2), _r(1, 12, 2, seed=3).abs()
    args = (q, k, w, None, None, None, "BSND", "BSND", 6, 3, INT64_MAX, INT64_MAX, True)
    size, executor = aclnn.lightning_indexer_get_workspace_size(*args)
    idx, vals = aclnn.lightning_indexer(None, size, executor, None)
    want_idx, want_vals = torch_npu.npu_lightning_indexer(q, k, w, sparse_count=6, return_value=True)
    assert torch.equal(idx, want_idx) and torch.equal(vals, want_vals)
    with pytest.raises(AclnnError, match="^executor: "):
        aclnn.lightning_indexer(None, size, executor, None)


def test_phase_one_rejects_bad_arguments_by_name():
    q, k, w = _r(1, 4, 2, 128), _r(1, 4, 1, 128), _r(1, 4, 2).abs()
    with pytest.raises(ParamInvalidError, match="^sparse_mode: "):
        aclnn.lightning_indexer_get_workspace_size(q, k, w, None, None, None, "BSND", "BSND", 4, 1, INT64_MAX,
                                                   INT64_MAX, False)
    kv = _r(1, 1, 4, 576)
    with pytest.raises(ParamInvalidError, match="^gamma: "):
        aclnn.kv_rms_norm_rope_cache_get_workspace_size(kv, _r(576), _r(1, 1, 4, 64), _r(1, 1, 4, 64),
                                                        torch.arange(4), torch.zeros(1, 16, 1, 64),
                                                        torch.zeros(1, 16, 1, 512), None, None, None, None, 1e-5,
                                                        "PA", False)


def test_kv_rms_norm_rope_cache_and_interleave_rope_outputs():
    kv, gamma, cos, sin = _r(2, 1, 1, 576, seed=4), _r(512, seed=5), _r(2, 1, 1, 64, seed=6), _r(2, 1, 1, 64, seed=7)
    caches = [torch.zeros(1, 16, 1, 64), torch.zeros(1, 16, 1, 512)]
    k_rope, c_kv = aclnn.kv_rms_norm_rope_cache(kv, gamma, cos, sin, torch.tensor([5, 9]), *caches, None, None, None,
                                                None, 1e-5, "PA", True)
    assert torch.equal(caches[1][0, 9, 0], c_kv[1, 0, 0]) and torch.equal(caches[0][0, 5, 0], k_rope[0, 0, 0])
    x = _r(2, 3, 4, 64, seed=8)
    cs = _r(2, 1, 4, 64, seed=9), _r(2, 1, 4, 64, seed=10)
    assert torch.equal(aclnn.interleave_rope(x, *cs), torch_npu.npu_interleave_rope(x, *cs))
