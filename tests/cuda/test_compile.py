"""``torch.compile(fullgraph=True)`` of attnops on CUDA: forward and backward through the custom ops."""
import torch

import attnops
from tests.helpers import TRIU2048, make_qkv


def test_fullgraph_compile_fwd_bwd():
    q, k, v, dy = (t.cuda() for t in make_qkv("BNSD", b=1, n1=2, sq=128, skv=128, d=64, dtype=torch.float16,
                                              seed=8))
    mask = TRIU2048.cuda()

    def attention(q, k, v):
        out = attnops.flash_attention(q, k, v, layout="BNSD", head_num=2, scale=0.125, atten_mask=mask,
                                      sparse_mode=3)
        return out[0] if isinstance(out, tuple) else out

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = attention(*leaves)
    eager.backward(dy)
    compiled_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(attention, fullgraph=True)(*compiled_leaves)
    compiled.backward(dy)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_leaves, leaves):
        torch.testing.assert_close(a.grad, b.grad)
