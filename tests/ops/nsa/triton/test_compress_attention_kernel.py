"""nsa_compress_attention on the Triton kernels (FlashAttention forward + importance scores + top-k) and its
backward (FlashAttention backward kernels) vs the fp64 golden, with the project's tolerance rule."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops import ParamInvalidError
from attnops.ops.nsa.compress_attention import build_compress_attention_spec
from attnops.ops.nsa.triton.verify import compress_attention_reason

from ..nsa_helpers import causal_cmp_mask, check_compress_attention, cum, randn
from .conftest import DEVICE

FWD = ["fwd_kernel", "importance_kernel", "topk_kernel"]
BWD = ["preprocess_kernel", "dkdv_kernel", "grad_sum_kernel"]


def _inputs(q_lens, cmp_lens, n1, n2, d, dv, dtype, *, seed=0):
    q = randn(sum(q_lens), n1, d, dtype=dtype, seed=seed).to(DEVICE)
    k = randn(sum(cmp_lens), n2, d, dtype=dtype, seed=seed + 1).to(DEVICE)
    v = randn(sum(cmp_lens), n2, dv, dtype=dtype, seed=seed + 2).to(DEVICE)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_varlen_no_mask_forward_and_backward(triton_backend, dtype):
    q_lens, cmp_lens = [5, 9], [7, 21]
    q, k, v = _inputs(q_lens, cmp_lens, 4, 2, 16, 8, dtype, seed=1)
    check_compress_attention(q, k, v, block=32, stride=16, select_block=64, count=2, q_lens=q_lens,
                             cmp_lens=cmp_lens)
    assert triton_backend == FWD + BWD + ["grad_sum_kernel"] * 2  # GQA: dK and dV summed over the group's heads


@pytest.mark.parametrize("g", [1, 2, 4, 16])
def test_gqa_groups(triton_backend, g):
    q_lens, cmp_lens = [4, 3], [8, 19]
    n2 = 2 if g < 16 else 1
    q, k, v = _inputs(q_lens, cmp_lens, n2 * g, n2, 8, 8, torch.float32, seed=4)
    check_compress_attention(q, k, v, block=32, stride=16, select_block=32, count=3, q_lens=q_lens,
                             cmp_lens=cmp_lens, backward=False)
    assert triton_backend == FWD


def test_head_dims_192_128_causal_mask_and_forced_blocks(triton_backend):
    """The NSA masks (compressed blocks visible once complete; block 0 and the local block forced), D=192/Dv=128,
    rows before the first complete block fully masked."""
    l, d, ls = 32, 16, 64
    seq = [40, 70]
    cmp_lens = [(n - l) // d + 1 for n in seq]
    q, k, v = _inputs(seq, cmp_lens, 2, 1, 192, 128, torch.float16, seed=2)
    mask = causal_cmp_mask(seq, cmp_lens, l, d)
    own = (torch.arange(max(seq)) // ls).unsqueeze(1)
    cols = torch.arange(max(-(-c // (ls // d)) for c in cmp_lens)).unsqueeze(0)
    tmask = (cols == 0) | (cols == own)
    res = check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=1, q_lens=seq,
                                   cmp_lens=cmp_lens, atten_mask=mask.to(DEVICE), topk_mask=tmask.to(DEVICE),
                                   backward=False)
    assert bool((res["out"][:31] == 0).all())
    assert triton_backend == FWD


def test_forced_block_rule_over_two_block_tiles(triton_backend):
    """``local_blocks`` as below on 110 rows at positions 500..569 (17 selection blocks: two tiles of 16), the
    cheap twin of the slow 800-row test."""
    l, d, ls, offset = 32, 16, 32, 500
    seq = [40, 70]
    cmp_lens = [(offset + n - l) // d + 1 for n in seq]
    q, k, v = _inputs(seq, cmp_lens, 2, 1, 16, 8, torch.float16, seed=5)
    check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=4, q_lens=seq, cmp_lens=cmp_lens,
                             causal=True, local_blocks=2, position_offset=offset, backward=False)
    assert triton_backend == FWD


@pytest.mark.slow  # 800 rows in the interpreter; test_forced_block_rule_over_two_block_tiles is its cheap twin
def test_forced_block_rule(triton_backend):
    """``local_blocks``: the kernel computes the layer's forced blocks (block 0 and the local blocks ending at the
    row's own block, no topk_mask), exactly as the dense mask (several row blocks and block tiles)."""
    l, d, ls = 32, 16, 32
    seq = [200, 600]
    cmp_lens = [(n - l) // d + 1 for n in seq]
    q, k, v = _inputs(seq, cmp_lens, 2, 1, 16, 8, torch.float16, seed=5)
    check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=4, q_lens=seq, cmp_lens=cmp_lens,
                             causal=True, local_blocks=2, backward=False)
    assert triton_backend == FWD


def test_causal_rule_forward_and_backward_short(triton_backend):
    """The cheap twin of the slow test below (one tile of selection blocks; the twin above crosses two): rows
    before the first complete block fully masked, forward and backward."""
    l, d, ls = 32, 16, 32
    seq = [60, 130]
    cmp_lens = [(n - l) // d + 1 for n in seq]
    q, k, v = _inputs(seq, cmp_lens, 2, 1, 16, 8, torch.float16, seed=7)
    res = check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=1, q_lens=seq,
                                   cmp_lens=cmp_lens, causal=True)
    assert bool((res["out"][:l - 1] == 0).all())
    assert triton_backend == FWD + BWD + ["grad_sum_kernel"] * 2


@pytest.mark.slow  # 660 rows forward and backward in the interpreter; the short twin above runs instead
def test_causal_rule_forward_and_backward(triton_backend):
    """``causal=True``: the kernels compute the NSA mask (no mask tensor); rows before the first complete block are
    fully masked, and score tiles past the causal edge load nothing (several row blocks and block tiles)."""
    l, d, ls = 32, 16, 32
    seq = [60, 600]  # 2 and 36 compressed keys; 1 and 18 selection blocks (two tiles of 16)
    cmp_lens = [(n - l) // d + 1 for n in seq]
    q, k, v = _inputs(seq, cmp_lens, 2, 1, 16, 8, torch.float16, seed=7)
    res = check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=1, q_lens=seq,
                                   cmp_lens=cmp_lens, causal=True)
    assert bool((res["out"][:l - 1] == 0).all())
    assert triton_backend == FWD + BWD + ["grad_sum_kernel"] * 2  # GQA: dK and dV summed over the group's heads


def test_rules_from_a_position_offset(triton_backend):
    """``position_offset`` (a prefill chunk after cached tokens): both rules in the kernels at positions
    ``offset + i``, forward and backward."""
    l, d, ls = 32, 16, 32
    seq, offset = [40, 70], 300
    cmp_lens = [(offset + n - l) // d + 1 for n in seq]
    q, k, v = _inputs(seq, cmp_lens, 2, 1, 16, 8, torch.float16, seed=9)
    check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=2, q_lens=seq, cmp_lens=cmp_lens,
                             causal=True, local_blocks=2, position_offset=offset)
    assert triton_backend == FWD + BWD + ["grad_sum_kernel"] * 2


def test_causal_rule_excludes_a_mask(triton_backend):
    q, k, v = _inputs([4], [3], 2, 1, 16, 16, torch.float32)
    with pytest.raises(ParamInvalidError, match="atten_mask"):
        attnops.nsa_compress_attention(q, k, v, compress_block_size=32, compress_stride=16, select_block_size=32,
                                       select_block_count=1, atten_mask=torch.zeros(4, 3, dtype=torch.bool,
                                                                                    device=DEVICE),
                                       causal=True, actual_seq_qlen=[4], actual_cmp_seq_kvlen=[3])


def test_geometry_with_overlapping_blocks(triton_backend):
    """l > d and l_sel > l: a compressed column feeds several selection blocks with weights 1..nn; more than one
    tile of selection blocks."""
    q_lens, cmp_lens = [3, 6], [30, 81]
    q, k, v = _inputs(q_lens, cmp_lens, 2, 1, 16, 16, torch.float32, seed=5)
    check_compress_attention(q, k, v, block=48, stride=16, select_block=64, count=4, q_lens=q_lens,
                             cmp_lens=cmp_lens, backward=False)
    assert triton_backend == FWD


def test_ties_go_to_the_lower_block(triton_backend):
    """A zero query gives uniform probabilities: every full selection block scores the same, the lower wins."""
    q_lens, cmp_lens = [4], [32]
    q, k, v = _inputs(q_lens, cmp_lens, 2, 2, 16, 16, torch.float32, seed=6)
    q = torch.zeros_like(q)
    res = check_compress_attention(q, k, v, block=16, stride=16, select_block=32, count=5, q_lens=q_lens,
                                   cmp_lens=cmp_lens, backward=False)
    assert res["topk"][0, 0].tolist() == [0, 1, 2, 3, 4]
    assert triton_backend == FWD


def test_padding_tokens_past_the_batches(triton_backend):
    q_lens, cmp_lens = [3, 2], [6, 5]
    q, k, v = _inputs([7], cmp_lens, 2, 1, 16, 16, torch.float32, seed=7)
    out = attnops.nsa_compress_attention(q, k, v, compress_block_size=16, compress_stride=16, select_block_size=32,
                                         select_block_count=2, scale=0.25, actual_seq_qlen=cum(q_lens),
                                         actual_cmp_seq_kvlen=cum(cmp_lens))
    assert out.topk_indices[5:].eq(0).all() and out.out[5:].eq(0).all()
    assert triton_backend == FWD


def test_the_spec_is_built_once_on_the_kernel_path(triton_backend, monkeypatch):
    """The verifier and the launcher share one spec (built once per call, the masks converted once)."""
    from attnops.ops.nsa import backends

    built = []
    build = backends.build_compress_attention_spec
    monkeypatch.setattr(backends, "build_compress_attention_spec", lambda *a, **kw: built.append(1) or build(*a, **kw))
    q, k, v = _inputs([4, 5], [8, 12], 2, 1, 16, 16, torch.float32, seed=8)
    attnops.nsa_compress_attention(q, k, v, compress_block_size=16, compress_stride=16, select_block_size=32,
                                   select_block_count=2, scale=0.25, actual_seq_qlen=cum([4, 5]),
                                   actual_cmp_seq_kvlen=cum([8, 12]))
    assert triton_backend == FWD and len(built) == 1


def test_verifier_reasons():
    q, k, v = _inputs([4], [8], 2, 1, 264, 16, torch.float32)
    spec = build_compress_attention_spec(q, k, v, scale_value=0.1, head_num=2, compress_block_size=16,
                                         compress_stride=16, select_block_size=32, select_block_count=2,
                                         actual_seq_qlen=[4], actual_cmp_seq_kvlen=[8], actual_sel_seq_kvlen=[4])
    assert "head dims up to 256" in compress_attention_reason(spec, q)
    assert "float16/bfloat16/float32" in compress_attention_reason(spec, q.double())


def test_explicit_triton_raises_with_the_reason(monkeypatch):
    monkeypatch.setenv("ATTNOPS_BACKEND", "triton")
    monkeypatch.setenv("ATTNOPS_TRITON_INTERPRET", "1")
    q, k, v = _inputs([4], [8], 2, 1, 264, 16, torch.float32)
    with pytest.raises(ParamInvalidError, match="head dims up to 256"):
        attnops.nsa_compress_attention(q, k, v, compress_block_size=16, compress_stride=16, select_block_size=32,
                                       select_block_count=2, scale=0.1, actual_seq_qlen=[4], actual_cmp_seq_kvlen=[8])
