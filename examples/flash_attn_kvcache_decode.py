"""A flash-attn decode loop, unmodified: run it on the CPU with ``python -m attnops.flash_attn
examples/flash_attn_kvcache_decode.py`` (or call ``attnops.flash_attn.install()`` before ``import flash_attn``).

Two prompts of different lengths are prefilled into a paged KV cache and then decoded token by token with
``flash_attn_with_kvcache``, which writes each step's keys/values (rotated by the rotary tables) into the cache.
The last step's output is checked against plain fp64 causal attention over the whole sequences."""
import torch

from flash_attn import flash_attn_with_kvcache
from flash_attn.bert_padding import pad_input, unpad_input
from flash_attn.layers.rotary import apply_rotary_emb

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.float16 if device == "cuda" else torch.float32
torch.manual_seed(0)
batch, heads, kv_heads, head_dim, page, pages_per_seq, steps = 2, 8, 2, 64, 16, 4, 5
prompt_lens = torch.tensor([21, 9], dtype=torch.int32, device=device)
capacity = page * pages_per_seq

k_cache = torch.zeros(batch * pages_per_seq, page, kv_heads, head_dim, dtype=dtype, device=device)
v_cache = torch.zeros_like(k_cache)
block_table = torch.randperm(batch * pages_per_seq, device=device).view(batch, -1).to(torch.int32)
inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
angles = torch.outer(torch.arange(capacity, device=device, dtype=torch.float32), inv_freq)
cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

# The whole sequences (prompt + decoded tokens), so that the reference can attend to all of them at once.
total = int(prompt_lens.max()) + steps
q_all, k_all, v_all = (torch.randn(batch, total, h, head_dim, dtype=dtype, device=device)
                       for h in (heads, kv_heads, kv_heads))

# Prefill: each prompt's tokens at positions 0 .. len - 1 (padded rows of the shorter prompt write past its end,
# and its decoded tokens overwrite them).
max_prompt = int(prompt_lens.max())
zeros = torch.zeros(batch, dtype=torch.int32, device=device)
flash_attn_with_kvcache(q_all[:, :max_prompt], k_cache, v_cache, k_all[:, :max_prompt], v_all[:, :max_prompt],
                        rotary_cos=cos, rotary_sin=sin, cache_seqlens=zeros, block_table=block_table, causal=True,
                        rotary_interleaved=False)

# Decode: token t of each sequence sits right after what the cache already holds.
seqlens = prompt_lens.clone()
positions = torch.arange(total, device=device)
for step in range(steps):
    index = (seqlens.long() + torch.arange(batch, device=device) * total)
    q, k, v = (x.flatten(0, 1)[index].unsqueeze(1) for x in (q_all, k_all, v_all))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, block_table=block_table, causal=True,
                                       rotary_interleaved=False, return_softmax_lse=True)
    seqlens += 1

# Reference: fp64 causal attention of the last token over each rotated sequence (packed with bert_padding).
lengths = seqlens.long()
valid = positions.unsqueeze(0) < lengths.unsqueeze(1)
q_ro = apply_rotary_emb(q_all.double(), cos.double(), sin.double())
k_ro = apply_rotary_emb(k_all.double(), cos.double(), sin.double())
packed, indices, cu_seqlens, max_len, _ = unpad_input(k_ro, valid)
k_ro = pad_input(packed, indices, batch, total)  # the same keys, zero past each length
for b in range(batch):
    n = int(lengths[b])
    keys = k_ro[b, :n].repeat_interleave(heads // kv_heads, 1)
    values = v_all[b, :n].double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("hd,khd->hk", q_ro[b, n - 1], keys) * head_dim ** -0.5
    want = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), values)
    err = (out[b, 0].double() - want).abs().max().item()
    assert err < (2e-3 if dtype == torch.float16 else 1e-5), err
    assert torch.allclose(lse[b, :, 0].double(), torch.logsumexp(scores, -1), atol=1e-3)
print(f"decoded {steps} tokens for {batch} sequences on {device}: output matches fp64 attention")
