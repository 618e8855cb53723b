"""The new ATB names and ``npu_scatter_nd_update_`` driven the way their callers drive them, through the shim
(``import torch_npu`` after ``install()``, ``torch.ops.atb.*`` / ``torch.ops.npu.*``), each script in a fresh
interpreter: sglang's Ascend backend (KV written with ``npu_scatter_nd_update_``, prefill with
``_npu_flash_attention_qlens`` on ``[T, N*D]`` queries) and vllm-ascend's 310P attention (prefill with
``_npu_flash_attention`` and its fp16 mask, chunked prefill with ``_npu_paged_attention_splitfuse`` and the mask rows
picked by position), judged against the FA fp64 golden on the dense K/V."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import itertools
import torch
import attnops.torch_npu
assert attnops.torch_npu.install()
import torch_npu
from attnops.testing.golden import fa_forward

N, KVN, D, PAGE = 4, 2, 32, 16
CAUSAL = torch.ones(2048, 2048, dtype=torch.bool).triu(1)

def golden(q, k, v, new, ctx):
    cum = lambda xs: list(itertools.accumulate(xs))
    return fa_forward(q, k, v, head_num=N, input_layout="TND", scale=D ** -0.5, atten_mask=CAUSAL, sparse_mode=3,
                      actual_seq_qlen=cum(new), actual_seq_kvlen=cum(ctx))[0]
"""

SGLANG_EXTEND = """
class TokenToKVPool:                                    # sglang's Ascend pool: [pages, page, N_kv, D] per layer
    def __init__(self, pages):
        self.k_buffer = torch.zeros(pages, PAGE, KVN, D)
        self.v_buffer = torch.zeros(pages, PAGE, KVN, D)

    def set_kv_buffer(self, loc, cache_k, cache_v):
        torch_npu.npu_scatter_nd_update_(self.k_buffer.view(-1, KVN, D), loc.view(-1, 1), cache_k)
        torch_npu.npu_scatter_nd_update_(self.v_buffer.view(-1, KVN, D), loc.view(-1, 1), cache_v)

pool = TokenToKVPool(10)
prefix, extend = [20, 0, 33], [5, 9, 2]
ctx = [p + e for p, e in zip(prefix, extend)]
block_tables = torch.tensor([[3, 7, 0], [5, 0, 0], [1, 8, 9]], dtype=torch.int32)
slot = lambda b, t: int(block_tables[b, t // PAGE]) * PAGE + t % PAGE
k, v = torch.randn(sum(ctx), KVN, D), torch.randn(sum(ctx), KVN, D)
pool.set_kv_buffer(torch.tensor([slot(b, t) for b, n in enumerate(ctx) for t in range(n)]), k, v)
q = torch.randn(sum(extend), N, D)
mask = ~torch.tril(torch.ones(128, 128, dtype=torch.bool))  # sglang's compressed causal mask
query = q.view(-1, N * D)
output = torch.empty(query.shape[0], N * D, dtype=query.dtype)
torch.ops.atb._npu_flash_attention_qlens(
    query=query, key_cache=pool.k_buffer, value_cache=pool.v_buffer, mask=mask, block_table=block_tables,
    seq_len=torch.tensor(extend, dtype=torch.int32), context_lens=torch.tensor(ctx, dtype=torch.int32),
    scale_value=D ** -0.5, num_heads=N, num_kv_heads=KVN, out=output)
err = (output.view(-1, N, D).double() - golden(q, k, v, extend, ctx)).abs().max()
assert err < 1e-5, err
print("ok")
"""

VLLM_310P = """
lens = [11, 6]
max_len = 32
mask = torch.zeros(max_len, max_len, dtype=torch.float16).masked_fill(CAUSAL[:max_len, :max_len], float("-inf"))
q, k, v = (torch.randn(sum(lens), h, D, dtype=torch.float16) for h in (N, KVN, KVN))
output = torch.empty(sum(lens), N, D, dtype=torch.float16)
torch_npu._npu_flash_attention(query=q, key=k, value=v, mask=mask, seq_len=torch.tensor(lens, dtype=torch.int32),
                               scale_value=D ** -0.5, num_heads=N, num_kv_heads=KVN, out=output)
assert (output.double() - golden(q, k, v, lens, lens)).abs().max() < 3e-3

# chunked prefill: the first tokens of each request are cached, the next chunk attends to them and to itself
cached, chunk = [11, 6], [4, 3]
ctx = [c + n for c, n in zip(cached, chunk)]
k, v = torch.randn(sum(ctx), KVN, D, dtype=torch.float16), torch.randn(sum(ctx), KVN, D, dtype=torch.float16)
key_cache, value_cache = torch.zeros(6, PAGE, KVN, D, dtype=torch.float16), torch.zeros(6, PAGE, KVN, D,
                                                                                         dtype=torch.float16)
block_tables = torch.tensor([[4, 1], [2, 0]], dtype=torch.int32)
slots = torch.tensor([int(block_tables[b, t // PAGE]) * PAGE + t % PAGE for b, n in enumerate(ctx) for t in range(n)])
torch_npu._npu_reshape_and_cache(k, v, key_cache, value_cache, slots.int())
position = torch.tensor([c + i for c, n in zip(cached, chunk) for i in range(n)])
splitfuse_mask = mask.index_select(0, position)[:, :max(ctx)]   # vllm-ascend's get_splitfuse_attn_mask
q = torch.randn(sum(chunk), N, D, dtype=torch.float16)
output = torch.empty(sum(chunk), N, D, dtype=torch.float16)
torch_npu._npu_paged_attention_splitfuse(query=q, key_cache=key_cache, value_cache=value_cache, mask=splitfuse_mask,
                                         block_table=block_tables, seq_len=torch.tensor(chunk, dtype=torch.int32),
                                         context_lens=torch.tensor(ctx, dtype=torch.int32), num_kv_heads=KVN,
                                         num_heads=N, scale_value=D ** -0.5, out=output)
assert (output.double() - golden(q, k, v, chunk, ctx)).abs().max() < 3e-3
print("ok")
"""


def _run(body: str) -> None:
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_sglang_extend_writes_with_scatter_nd_update_and_prefills_with_qlens():
    _run(SGLANG_EXTEND)


def test_vllm_ascend_310p_prefill_and_chunked_prefill():
    _run(VLLM_310P)
