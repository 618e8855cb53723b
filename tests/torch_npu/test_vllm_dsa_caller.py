"""vllm-ascend's DeepSeek-V3.2 decode step through the shim, as its SFA backend writes it: the new tokens' latent
KV and rope through ``npu_kv_rmsnorm_rope_cache`` (``cache_mode="PA"``, -1 padded slots), ``q_pe`` through
``npu_interleave_rope``, the indexer on its own paged cache (TND query, ``PA_BSND``), sparse attention through
``torch.ops._C_ascend.npu_sparse_flash_attention`` with the shared block table; checked against dense causal
attention over each request's gathered cache (the indexer keeps every key when ``sparse_count`` exceeds the
context), and the selection against the golden indexer. Runs in a fresh interpreter (the shim changes global
state)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import torch
import attnops.torch_npu
assert attnops.torch_npu.install("cpu")
import torch_npu
from attnops.testing import golden_dsa as G

g = torch.Generator().manual_seed(0)
def r(*s): return torch.randn(*s, generator=g)

heads, idx_heads, block, blocks = 4, 4, 16, 8
seq_lens = torch.tensor([20, 33], dtype=torch.int32)                  # context after this step's token
block_table = torch.tensor([[5, 2, -1], [0, 7, 3]], dtype=torch.int32)
kv_cache = (torch.zeros(blocks, block, 1, 512), torch.zeros(blocks, block, 1, 64))   # (latent, rope)
idx_cache = torch.zeros(blocks, block, 1, 128)
history = {}
for b in range(2):                                                      # earlier tokens already cached
    n = int(seq_lens[b]) - 1
    lat, rope, ik = r(n, 512), r(n, 64), r(n, 128)
    pos = torch.arange(n)
    phys = block_table[b, pos // block].long()
    kv_cache[0][phys, pos % block, 0] = lat
    kv_cache[1][phys, pos % block, 0] = rope
    idx_cache[phys, pos % block, 0] = ik
    history[b] = (lat, rope, ik)

# this step: one token per request plus one padded token (slot -1)
tokens = 3
kv_no_split = r(tokens, 576)
gamma, cos, sin = r(512), r(tokens, 1, 1, 64), r(tokens, 1, 1, 64)
slots = torch.tensor([int(block_table[0, 19 // block]) * block + 19 % block,
                      int(block_table[1, 32 // block]) * block + 32 % block, -1])
k_pe, k_nope, _, _ = torch_npu.npu_kv_rmsnorm_rope_cache(
    kv_no_split.view(tokens, 1, 1, 576), gamma, cos, sin, slots.to(torch.int64), kv_cache[1], kv_cache[0],
    epsilon=1e-6, cache_mode="PA", is_output_kv=False)
new_ik = r(2, 128)                                                      # the indexer's own cache write
idx_cache.view(-1, 128)[slots[:2]] = new_ik
q_nope, q_pe_raw = r(2, heads, 512), r(2, heads, 64)
q_pe = torch_npu.npu_interleave_rope(q_pe_raw.view(2, heads, 1, 64), cos[:2], sin[:2]).view(2, heads, 64)
q_li, weights = r(2, idx_heads, 128), r(2, idx_heads).abs()
cu_q = torch.tensor([1, 2], dtype=torch.int32)
topk = torch_npu.npu_lightning_indexer(q_li, idx_cache, weights, actual_seq_lengths_query=cu_q,
                                       actual_seq_lengths_key=seq_lens, block_table=block_table,
                                       layout_query="TND", layout_key="PA_BSND", sparse_count=2048,
                                       sparse_mode=3)[0]
assert topk.shape == (2, 1, 2048) and topk.dtype == torch.int32
out = torch.ops._C_ascend.npu_sparse_flash_attention(
    query=q_nope, key=kv_cache[0], value=kv_cache[0], sparse_indices=topk, scale_value=0.05, block_table=block_table,
    actual_seq_lengths_query=cu_q, actual_seq_lengths_kv=seq_lens, query_rope=q_pe, key_rope=kv_cache[1],
    sparse_block_size=1, layout_query="TND", layout_kv="PA_BSND", sparse_mode=3, attention_mode=2)[0]
assert out.shape == (2, heads, 512)

for b in range(2):
    lat, rope, ik = history[b]
    y = G.rms_norm(kv_no_split[b, :512], gamma, 1e-6).float()
    kr = G.interleave_rope(kv_no_split[b, 512:], cos[b, 0, 0], sin[b, 0, 0]).float()
    lat, rope, ik = torch.cat([lat, y[None]]), torch.cat([rope, kr[None]]), torch.cat([ik, new_ik[b:b + 1]])
    qr = G.interleave_rope(q_pe_raw[b], cos[b, 0], sin[b, 0])
    want_rows = G.lightning_indexer(q_li[b:b + 1], ik, weights[b:b + 1], 2048, 3)
    assert topk[b, 0].tolist() == want_rows[0], b
    logits = (q_nope[b].double() @ lat.double().T + qr @ rope.double().T) * 0.05
    dense = torch.softmax(logits, -1) @ lat.double()
    assert (out[b].double() - dense).abs().max() < 1e-4, b
assert int((kv_cache[0] != 0).any(-1).sum()) == int(seq_lens.sum())   # the padded token wrote nothing
print("ok")
"""


def test_vllm_ascend_dsa_decode_step():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
