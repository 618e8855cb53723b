"""The custom ops behind the torch_npu functions: opcheck on the ops the per-family tests do not cover, the full
list of registered ops, and torch.compile(fullgraph=True) of modules written against torch_npu."""
from __future__ import annotations

import importlib

import pytest
import torch

from attnops import torch_npu
from tests.helpers import TRIU2048, randn

# every attnops custom op and the test that runs opcheck on it (inference_only_backward always raises: its own tests
# check its fake kernel and the error)
OPCHECKED = {
    "flash_attention_fwd": "tests/ops/flash_attention/test_custom_ops.py",
    "flash_attention_bwd": "tests/ops/flash_attention/test_custom_ops.py",
    "nsa_compress": "tests/ops/nsa/test_opcheck.py",
    "nsa_compress_attention": "tests/ops/nsa/test_opcheck.py",
    "nsa_compress_attention_grad": "tests/ops/nsa/test_opcheck.py",
    "nsa_selected_attention": "tests/ops/nsa/test_opcheck.py",
    "nsa_compress_grad": __name__,
    "nsa_selected_attention_grad": __name__,
    "nsa_selected_attention_infer": "tests/torch_npu/test_nsa_select_infer.py",
    "nsa_compress_attention_infer": "tests/torch_npu/test_nsa_compress_infer.py",
    "nsa_compress_infer": "tests/torch_npu/test_nsa_compress_infer.py",
    "fused_infer_attention": __name__,
    "native_sparse_attention": "tests/ops/nsa/test_layer_compile.py",
    "native_sparse_attention_backward": "tests/ops/nsa/test_layer_compile.py",
    "nsa_window_attention": "tests/ops/nsa/test_opcheck.py",
    "nsa_window_attention_grad": "tests/ops/nsa/test_opcheck.py",
    "inference_only_backward": "tests/_core/test_inference_only.py",
    "dsa_lightning_indexer": "tests/ops/dsa/test_opcheck.py",
    "dsa_sparse_flash_attention": "tests/ops/dsa/test_opcheck.py",
    "dsa_sparse_flash_attention_grad": "tests/ops/dsa/test_opcheck.py",
    "dsa_kv_quant_sparse_flash_attention": "tests/ops/dsa/test_opcheck.py",
    "dsa_indexer_kl_loss_grad": "tests/ops/dsa/test_opcheck.py",
    "mla_interleave_rope": "tests/ops/dsa/test_opcheck.py",
    "mla_kv_rmsnorm_rope_cache": "tests/ops/dsa/test_opcheck.py",
    "mla_prolog": "tests/ops/dsa/test_opcheck.py",
    "dsv4_sparse_flash_mla": "tests/ops/dsv4/test_opcheck.py",
    "dsv4_sparse_flash_mla_grad": "tests/ops/dsv4/test_opcheck.py",
    "flash_attn_lse_from_stats": __name__,
    "dsv4_compressor": "tests/ops/dsv4/test_compressor.py",
    "dsv4_lightning_indexer_v2": "tests/ops/dsv4/test_indexer_v2.py",
}


def test_every_custom_op_is_opchecked():
    importlib.import_module("attnops.ops.nsa.layer_op")  # the NSA layer registers its ops on first use
    importlib.import_module("attnops.flash_attn.outputs")  # and the flash-attn interface on import
    registered = {name for name in dir(torch.ops.attnops) if isinstance(getattr(torch.ops.attnops, name),
                                                                          torch._ops.OpOverloadPacket)}
    assert registered == set(OPCHECKED)


def test_opcheck_flash_attn_lse_from_stats():
    importlib.import_module("attnops.flash_attn.outputs")  # registers the op
    from attnops._core.softmax_stats import FLT_LOWEST

    m, total = randn(2, 3, 5, seed=7), randn(2, 3, 5, seed=8).abs() + 1
    m[0, 1, 2] = FLT_LOWEST
    torch.library.opcheck(torch.ops.attnops.flash_attn_lse_from_stats.default, (m, total))
    lse = torch.ops.attnops.flash_attn_lse_from_stats(m, total)
    assert lse[0, 1, 2] == float("inf") and torch.equal(lse[1], m[1] + total[1].log())


def test_opcheck_nsa_compress_grad():
    x, w, g = randn(40, 2, 16, seed=1), randn(16, 2, seed=2), randn(3, 2, 16, seed=3)
    torch.library.opcheck(torch.ops.attnops.nsa_compress_grad.default, (g, x, w, 16, 8, [16, 40], 0))


def test_opcheck_nsa_selected_attention_grad():
    q, k, v = randn(7, 4, 8, seed=4), randn(20, 2, 8, seed=5), randn(20, 2, 4, seed=6)
    topk = torch.zeros(7, 2, 2, dtype=torch.int32)
    topk[..., 1] = 1
    mask = torch.ones(1, 1, dtype=torch.bool)
    out, smax, ssum = torch.ops.attnops.nsa_selected_attention(q, k, v, topk, mask, 0.5, 4, 4, 2, [3, 7], [8, 20], 2)
    torch.library.opcheck(torch.ops.attnops.nsa_selected_attention_grad.default,
                          (torch.ones_like(out), q, k, v, out, smax, ssum, topk, mask, 0.5, 4, 4, 2, [3, 7], [8, 20],
                           2))


def _fia_args(query, key, value, **kw):
    names = ("pse_shift", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "deq_scale1", "quant_scale1",
             "deq_scale2", "quant_scale2", "quant_offset2", "antiquant_scale", "antiquant_offset",
             "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset",
             "block_table", "query_padding_size", "kv_padding_size", "key_shared_prefix", "value_shared_prefix",
             "actual_shared_prefix_len")
    scalars = dict(num_heads=1, scale=1.0, pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                   num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0, antiquant_mode=0,
                   key_antiquant_mode=0, value_antiquant_mode=0)
    scalars.update({k: v for k, v in kw.items() if k in scalars})
    return (query, key, value, *(kw.get(n) for n in names), *scalars.values())


@pytest.mark.parametrize("case", ["bnsd_bsnd_prefill", "paged_tnd", "int8_kv_decode", "bsh_dv", "paged_nz_dv"])
def test_opcheck_fused_infer_attention(case):
    if case == "bsh_dv":  # value head dim 8, key 16: the output takes Dv
        args = _fia_args(randn(2, 3, 64), randn(2, 7, 32, seed=1), randn(2, 7, 16, seed=2), num_heads=4,
                         num_key_value_heads=2, scale=0.25)
    elif case == "paged_nz_dv":  # NZ caches (blocknum, KV_N, D/x, blocksize, x), K 32 / V 16
        args = _fia_args(randn(2, 1, 2, 32).half(), randn(4, 2, 2, 16, 16, seed=1).half(),
                         randn(4, 2, 1, 16, 16, seed=2).half(), num_heads=2, input_layout="BSND",
                         actual_seq_lengths_kv=[20, 9], block_size=16,
                         block_table=torch.tensor([[0, 2], [3, -1]], dtype=torch.int32))
    elif case == "bnsd_bsnd_prefill":
        args = _fia_args(randn(2, 4, 5, 16), randn(2, 2, 7, 16, seed=1), randn(2, 2, 7, 16, seed=2), num_heads=4,
                         num_key_value_heads=2, input_layout="BNSD_BSND", atten_mask=TRIU2048, sparse_mode=3,
                         scale=0.25, actual_seq_lengths_kv=[7, 4])
    elif case == "paged_tnd":
        args = _fia_args(randn(5, 2, 16), randn(4, 16, 32, seed=1), randn(4, 16, 32, seed=2), num_heads=2,
                         input_layout="TND", actual_seq_lengths=[2, 5], actual_seq_lengths_kv=[20, 9],
                         block_table=torch.tensor([[0, 2], [3, -1]], dtype=torch.int32), block_size=16)
    else:
        k8 = torch.randint(-8, 8, (2, 9, 32), dtype=torch.int8)
        args = _fia_args(randn(2, 1, 32), k8, k8.clone(), num_heads=2, antiquant_scale=randn(2, 32, seed=3),
                         antiquant_offset=randn(2, 32, seed=4))
    torch.library.opcheck(torch.ops.attnops.fused_infer_attention.default, args)


class TinyAttention(torch.nn.Module):
    """A causal self-attention block written against torch_npu (BSND, GQA)."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.d)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, self.d).split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        out = torch_npu.npu_fusion_attention(q, k, v, self.heads, "BSND", atten_mask=TRIU2048, sparse_mode=2,
                                             scale=self.d ** -0.5)[0]
        return out.reshape(b, s, -1)


def test_compile_fullgraph_of_a_torch_npu_module_forward_and_backward():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyAttention()
    x = randn(2, 6, 32, seed=7)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    eager_out = model(x)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_compile_fullgraph_of_fused_infer_attention():
    torch._dynamo.reset()
    q, k = randn(2, 1, 32), randn(2, 9, 32, seed=1)

    def decode(q, k, v):
        return torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, scale=0.25,
                                                         actual_seq_lengths_kv=[9, 4], softmax_lse_flag=True)

    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(q, k, k), decode(q, k, k)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
