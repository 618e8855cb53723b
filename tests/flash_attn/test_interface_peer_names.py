"""The flash-attn 2 names its own test file relies on: ``_get_block_size_n`` and the block-scaled ``S_dmask``
encoding it decodes, ``USE_TRITON_ROCM``, ``window_size`` as a 2-element tensor (also in
``flash_attn_with_kvcache``), ``flash_attn_varlen_func(block_table=...)``; against the fp64 ``attention_ref``."""
import pytest
import torch

from attnops._core.errors import ParamInvalidError
from attnops.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from attnops.flash_attn.flash_attn_interface import USE_TRITON_ROCM, _get_block_size_n
from attnops.testing.compare import assert_close_to_golden, attention_reductions
from tests.flash_attn.attention_ref import attention_ref, attention_ref_varlen, keep_matrix
from tests.helpers import randn


def test_block_size_n_is_flash_attn_sm80_table():
    assert not USE_TRITON_ROCM
    table = {(32, False): 128, (64, False): 128, (64, True): 64, (96, True): 64, (128, False): 64,
             (128, True): 32, (160, True): 64, (256, False): 64}
    for (d, dropout), n in table.items():
        assert _get_block_size_n("cpu", d, dropout, False) == n
    with pytest.raises(ParamInvalidError, match="head_dim"):
        _get_block_size_n("cpu", 257, True, False)


def _decode(s_dmask, scores, block_n):
    """flash-attn's decoding (its test helper ``normalize_flash_attn_S``): block j of keys times
    ``exp(m_j - lse)``, ``m_j`` the fp64 score maximum over blocks j and after."""
    lse = torch.logsumexp(scores, -1, keepdim=True)
    block_max = torch.stack([b.amax(-1) for b in scores.split(block_n, -1)], -1)
    running = block_max.flip(-1).cummax(-1).values.flip(-1)
    return torch.cat([a * torch.exp(running[..., j:j + 1] - lse)
                      for j, a in enumerate(s_dmask.double().split(block_n, -1))], -1)


@pytest.mark.parametrize("d", [32, 64])
def test_s_dmask_block_encoding_decodes_to_the_probabilities(d):
    """Several key blocks (150 keys, blocks of 64 at d=64 with dropout): the decoded magnitudes are the fp64
    softmax, the signs the dropout pattern the output was computed with."""
    p_drop, sq, sk = 0.2, 40, 150
    q, k, v = (randn(2, n, 2, d, dtype=torch.float16, seed=s) for s, n in ((0, sq), (1, sk), (2, sk)))
    out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=p_drop, causal=True, return_attn_probs=True)
    assert s_dmask.shape == (2, 2, sq, sk) and s_dmask.dtype == torch.float16
    band = keep_matrix(sq, sk, True, (-1, -1))
    scores = (torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * d ** -0.5).masked_fill(~band, -torch.inf)
    probs = torch.softmax(scores, -1)
    decoded = _decode(s_dmask.abs(), scores, _get_block_size_n("cpu", d, True, True))
    assert_close_to_golden("P", decoded, probs, probs.half(), reduction=4)
    keep = s_dmask >= 0
    gold, _ = attention_ref(q, k, v, causal=True, dropout_p=p_drop, keep=keep)
    base, _ = attention_ref(q, k, v, causal=True, dropout_p=p_drop, keep=keep, dtype=torch.float16)
    assert_close_to_golden("out", out, gold, base, reduction=attention_reductions(d, d, sq, sk)["out"])


def test_window_size_tensor_equals_the_tuple():
    q, k, v = (randn(1, 20, 2, 16, seed=s) for s in range(3))
    want = flash_attn_func(q, k, v, window_size=(3, 1))
    assert torch.equal(flash_attn_func(q, k, v, window_size=torch.tensor([3, 1])), want)
    gold, _ = attention_ref(q, k, v, window_size=(3, 1))
    base, _ = attention_ref(q, k, v, window_size=(3, 1), dtype=torch.float32)
    assert_close_to_golden("out", want, gold, base, reduction=36)
    with pytest.raises(ParamInvalidError, match="window_size"):
        flash_attn_func(q, k, v, window_size=torch.tensor([3.0, 1.0]))
    cache = k.clone(), v.clone()
    assert torch.equal(flash_attn_with_kvcache(q, *cache, window_size=torch.tensor([3, 1])),
                       flash_attn_with_kvcache(q, *cache, window_size=(3, 1)))


def test_varlen_block_table_reads_paged_keys():
    """Keys and values of each sequence gathered through its pages (any page order); gradients reach the caches."""
    page, lens_q, lens_k = 4, [3, 5], [6, 9]
    k_cache, v_cache = (randn(8, page, 1, 16, seed=s).requires_grad_() for s in (1, 2))
    block_table = torch.tensor([[5, 2, 7], [0, 6, 3]], dtype=torch.int32)
    q = randn(sum(lens_q), 2, 16, seed=3)
    cu_q, cu_k = ([0, a[0], a[0] + a[1]] for a in (lens_q, lens_k))
    out = flash_attn_varlen_func(q, k_cache, v_cache, torch.tensor(cu_q, dtype=torch.int32),
                                 torch.tensor(cu_k, dtype=torch.int32), 5, 9, causal=True, block_table=block_table)
    rows = [block_table[b].long().repeat_interleave(page) * page + torch.arange(3 * page) % page
            for b in range(2)]
    k_flat, v_flat = (torch.cat([c.detach().flatten(0, 1)[rows[b][:lens_k[b]]] for b in range(2)])
                      for c in (k_cache, v_cache))
    gold, _ = attention_ref_varlen(q.double(), k_flat.double(), v_flat.double(), cu_q, cu_k, causal=True)
    base, _ = attention_ref_varlen(q, k_flat, v_flat, cu_q, cu_k, causal=True, dtype=torch.float32)
    assert_close_to_golden("out", out, gold, base, reduction=25)
    out.sum().backward()
    unused = torch.ones(8, dtype=torch.bool)
    unused[[5, 2, 0, 6, 3]] = False  # sequence 0's 6 tokens need 2 pages: its page 7 is never read
    assert k_cache.grad[unused].abs().sum() == 0 and k_cache.grad[~unused].abs().sum() > 0
