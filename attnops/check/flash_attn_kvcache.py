"""Built-in check cases of ``attnops.flash_attn``'s kv-cache and helper names: ``flash_attn_with_kvcache`` (output,
lse and the cache it appends to) against ``attnops.testing.golden_flash_attn_kvcache``; ``layers.rotary`` against the
complex-number rotary golden; ``bert_padding`` against packing written out token by token (exact)."""
from __future__ import annotations

import math

import torch

from ..flash_attn import bert_padding, fa3, flash_attn_with_kvcache
from ..flash_attn.layers import rotary
from ..testing.golden_flash_attn_kvcache import CAPACITY, kvcache_golden, kvcache_inputs, rotary_golden
from .case import CheckCase, Comparison, input_device, moved, on_cpu, triton_runs_on_cuda

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
KVCACHE = "attnops.flash_attn.flash_attn_with_kvcache"

KVCACHE_CASES = [
    ("decode fp16, paged, append + interleaved rotary, causal, GQA 2",
     dict(dtype=F16, paged=True, rotary="interleaved", causal=True)),
    ("3 rows bf16, cache_batch_idx + leftpad, NeoX rotary (16 of 32 dims)",
     dict(dtype=BF16, sq=3, new=3, d=32, batch_idx=True, leftpad=True, rotary="neox", rotary_dim=16)),
    ("decode fp32, window (5, 0), ALiBi per batch, no new k/v", dict(new=0, window=(5, 0), alibi="batch")),
    ("2 rows fp16, softcap 0.5, paged, window (4, 1), ALiBi",
     dict(dtype=F16, sq=2, new=2, paged=True, softcap=0.5, window=(4, 1), alibi="heads")),
]


def _fa3_call(block_table=None, **kw):
    """FA3's ``flash_attn_with_kvcache``, which names the block table ``page_table``."""
    return fa3.flash_attn_with_kvcache(page_table=block_table, **kw)


def _kvcache_case(options: dict, call=flash_attn_with_kvcache):
    def run(backend):
        kw = kvcache_inputs(seed=3, **options)
        tensors = {n: kw.pop(n, None) for n in ("q", "k_cache", "v_cache", "k", "v")}
        golden = kvcache_golden(*tensors.values(), **kw)
        base = kvcache_golden(*tensors.values(), **kw, dtype=tensors["q"].dtype)
        dev = input_device(backend)
        moved_in = {n: moved(dev, x.clone() if isinstance(x, torch.Tensor) else x) for n, x in tensors.items()}
        out, lse = on_cpu(call(**moved_in, **{n: moved(dev, x) for n, x in kw.items()}, return_softmax_lse=True))
        k_cache, v_cache = on_cpu([moved_in["k_cache"], moved_in["v_cache"]])
        red = tensors["q"].shape[-1] + CAPACITY  # the scores over D, then P V over at most the cache's capacity
        # the appended keys: a rotated element sums two products
        return [Comparison("out", out, golden.out, base.out, reduction=red),
                Comparison("softmax_lse", lse, golden.lse, base.lse, reduction=red),
                Comparison("k_cache", k_cache, golden.k_cache, base.k_cache, reduction=2),
                Comparison("v_cache", v_cache, golden.v_cache, base.v_cache)]
    return run


def _tables(n: int, rotary_dim: int, dtype):
    angles = torch.rand(n, rotary_dim // 2, generator=torch.Generator().manual_seed(1), dtype=F64) * 2 * math.pi
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _x(*shape, dtype=F32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=F64).to(dtype)


def _apply_rotary_emb(backend):
    x, (cos, sin) = _x(2, 5, 3, 16, dtype=F16), _tables(12, 12, F16)
    offsets = torch.tensor([0, 9])  # the second sequence runs past the table
    positions = torch.arange(5) + offsets.unsqueeze(1)
    out = rotary.apply_rotary_emb(x, cos, sin, interleaved=True, seqlen_offsets=offsets)
    return [Comparison("out", out, rotary_golden(x, cos, sin, positions, True, F64),
                       rotary_golden(x, cos, sin, positions, True, F16), reduction=2)]  # x1*cos - x2*sin


def _apply_rotary_emb_qkv(backend):
    qkv, (cos, sin) = _x(1, 6, 3, 2, 8), _tables(6, 8, F32)
    before, positions = qkv.clone(), torch.arange(6).unsqueeze(0)
    rotary.apply_rotary_emb_qkv_(qkv, cos, sin)
    return [Comparison(name, qkv[:, :, i], rotary_golden(before[:, :, i], cos, sin, positions, False, F64),
                       rotary_golden(before[:, :, i], cos, sin, positions, False, F32), reduction=2)
            for i, name in enumerate("qk")]


def _rotary_embedding(backend):
    dim, qkv = 8, _x(2, 5, 3, 2, 8)
    before, positions = qkv.clone(), torch.arange(2, 7).unsqueeze(0)
    rotary.RotaryEmbedding(dim, interleaved=True)(qkv, seqlen_offset=2)
    angles = torch.arange(7, dtype=F64).unsqueeze(1) * 10000.0 ** (-torch.arange(0, dim, 2, dtype=F64) / dim)
    cos, sin = angles.cos(), angles.sin()
    return [Comparison(name, qkv[:, :, i], rotary_golden(before[:, :, i], cos, sin, positions, True, F64),
                       rotary_golden(before[:, :, i], cos, sin, positions, True, F32), reduction=2)
            for i, name in enumerate("qk")]


_MASK = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)


def _unpad_pad(backend):
    x = _x(3, 4, 2, 5)
    packed, indices, cu, _, used = bert_padding.unpad_input(x, _MASK)
    rows = [x[b, s] for b in range(3) for s in range(4) if _MASK[b, s]]
    want_cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    return [Comparison("hidden_states", packed, torch.stack(rows).double(), None),
            Comparison("cu_seqlens", cu.double(), want_cu.double(), None),
            Comparison("seqused", used.double(), torch.tensor([2.0, 0.0, 3.0], dtype=F64), None),
            Comparison("pad_input", bert_padding.pad_input(packed, indices, 3, 4),
                       (x * _MASK[..., None, None]).double(), None),
            Comparison("index_first_axis", bert_padding.index_first_axis(x.flatten(0, 1), indices),
                       torch.stack(rows).double(), None)]


def _backends(options: dict) -> tuple[str, ...]:
    """FusedInferAttention's decode kernels (FlashAttention's with softcap) serve every case; bf16 ones run on
    CUDA only (Triton's CPU interpreter has no bf16)."""
    if options.get("dtype") == BF16 and not triton_runs_on_cuda():
        return ("reference",)
    return ("reference", "triton")


def cases() -> list[CheckCase]:
    kvcache = [CheckCase(KVCACHE, name, _kvcache_case(options), _backends(options))
               for name, options in KVCACHE_CASES]
    fa3_options = dict(dtype=F16, paged=True, sq=2, new=2, causal=True)
    kvcache.append(CheckCase("attnops.flash_attn.fa3.flash_attn_with_kvcache", "2 rows fp16, page_table, causal",
                             _kvcache_case(fa3_options, _fa3_call), _backends(fa3_options)))
    return kvcache + [
        CheckCase("attnops.flash_attn.layers.rotary.apply_rotary_emb",
                  "fp16 GPT-J pairs, per-batch offsets past the table", _apply_rotary_emb),
        CheckCase("attnops.flash_attn.layers.rotary.apply_rotary_emb_qkv_", "fp32 packed qkv, GPT-NeoX pairs",
                  _apply_rotary_emb_qkv),
        CheckCase("attnops.flash_attn.layers.rotary.RotaryEmbedding", "fp32 packed qkv, offset 2", _rotary_embedding),
        CheckCase("attnops.flash_attn.bert_padding", "unpad_input / pad_input / index_first_axis, an empty row",
                  _unpad_pad),
    ]
