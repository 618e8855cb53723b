"""torch.library.opcheck on the DSA and MLA custom ops (schemas, fake kernels, autograd registration), and
torch.compile(fullgraph=True) of the Pythonic sparse attention with its backward."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops._core import hifloat8
from attnops.ops.dsa import op as _dsa_ops  # noqa: F401  (registers attnops::dsa_*)
from attnops.ops.dsa.quant_cache import pack_rows, quantize
from attnops.ops.mla import op as _mla_ops  # noqa: F401  (registers attnops::mla_*)

from .dsa_helpers import randn

OPS = torch.ops.attnops


def _sfa_args():
    q, qr = randn(1, 4, 2, 16, seed=1), randn(1, 4, 2, 4, seed=2)
    kv, kr = randn(1, 5, 1, 16, seed=3), randn(1, 5, 1, 4, seed=4)
    idx = torch.tensor([[[[1, 0, -1]], [[2, 1, 0]], [[3, -1, -1]], [[4, 2, 0]]]], dtype=torch.int32)
    lens = torch.tensor([4], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    return (q, kv, kv, idx, qr, kr, None, None, *lens, 0.3, 1, "BSND", "BSND", 3)


def test_opcheck_sparse_flash_attention_and_grad():
    args = _sfa_args()
    torch.library.opcheck(OPS.dsa_sparse_flash_attention.default, args)
    out, m, l = OPS.dsa_sparse_flash_attention(*args)
    q, kv, _, idx, qr, kr, _, table, lq, lk = args[:10]
    torch.library.opcheck(OPS.dsa_sparse_flash_attention_grad.default,
                          (torch.ones_like(out), q, kv, kv, idx, qr, kr, table, lq, lk, out, m, l, *args[10:]),
                          test_utils=("test_schema", "test_faketensor"))  # no autograd of its own


def test_opcheck_indexer_quant_and_kl_loss():
    q, k, w = randn(2, 6, 2, 8, seed=5), randn(2, 6, 1, 8, seed=6), randn(2, 6, 2, seed=7).abs()
    torch.library.opcheck(OPS.dsa_lightning_indexer.default, (q, k, w, None, None, None, "BSND", "BSND", 4, 3, True))
    query = randn(1, 3, 2, 576, seed=8).to(torch.bfloat16)
    packed = quantize(randn(1, 4, 1, 512, seed=9), randn(1, 4, 1, 64, seed=10).to(torch.bfloat16))
    idx = torch.tensor([[[[1, 0]], [[2, 1]], [[3, 0]]]], dtype=torch.int32)
    torch.library.opcheck(OPS.dsa_kv_quant_sparse_flash_attention.default,
                          (query, packed, packed, idx, None, None, None, None, 0.1, 1, "BSND", "BSND", 3, 64))
    rope = randn(1, 4, 1, 64, seed=15).to(torch.bfloat16)
    hif8_rows = pack_rows(hifloat8.encode(randn(1, 4, 1, 512, seed=14)), rope, torch.full((1, 4, 1, 4), 0.5))
    torch.library.opcheck(OPS.dsa_kv_quant_sparse_flash_attention.default,
                          (query, hif8_rows, hif8_rows, idx, None, None, None, None, 0.1, 1, "BSND", "BSND", 3, 64,
                           True))
    args = _sfa_args()
    _, m, l = OPS.dsa_sparse_flash_attention(*args)
    qi, ki, wi = randn(1, 4, 2, 8, seed=11), randn(1, 5, 1, 8, seed=12), randn(1, 4, 2, seed=13)
    torch.library.opcheck(OPS.dsa_indexer_kl_loss_grad.default,
                          (args[0], args[1], qi, ki, wi, args[3], m, l, args[4], args[5], 0.3, None, None, "BSND", 3))


def test_opcheck_mla_helpers():
    x, cos, sin = randn(1, 2, 3, 8, seed=14), randn(1, 1, 3, 8, seed=15), randn(1, 1, 3, 8, seed=16)
    torch.library.opcheck(OPS.mla_interleave_rope.default, (x, cos, sin))
    kv, gamma = randn(2, 1, 1, 24, seed=17), randn(16, seed=18)
    c8, s8 = randn(2, 1, 1, 8, seed=19), randn(2, 1, 1, 8, seed=20)
    caches = (torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 16))
    torch.library.opcheck(OPS.mla_kv_rmsnorm_rope_cache.default,
                          (kv, gamma, c8, s8, torch.tensor([3, 20]), *caches, None, None, None, None, 1e-5, "PA"))
    kv2, v2 = randn(2, 2, 1, 16, seed=30), randn(2, 2, 1, 8, seed=31)  # V2: N=2 heads, Dk=16, Dv=8
    torch.library.opcheck(OPS.mla_kv_rmsnorm_rope_cache.default,
                          (kv2, gamma, c8, s8, torch.tensor([3, 20]), torch.zeros(2, 16, 2, 16),
                           torch.zeros(2, 16, 2, 8), None, None, None, None, 1e-5, "PA_NZ", v2))
    he, hcq, n, d, hckv, dr = 16, 8, 2, 4, 8, 4
    w = (randn(he, hcq, seed=21), randn(hcq, n * (d + dr), seed=22), randn(n, d, hckv, seed=23),
         randn(he, hckv + dr, seed=24), randn(hcq, seed=25), randn(hckv, seed=26), randn(3, dr, seed=27),
         randn(3, dr, seed=28))
    torch.library.opcheck(OPS.mla_prolog.default,
                          (randn(3, he, seed=29), *w, torch.zeros(1, 16, 1, hckv), torch.zeros(1, 16, 1, dr),
                           torch.tensor([0, 5, 9]), None, 1e-5, 1e-5, "PA_BSND", 1.0, 1.0))
    i8 = [torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(40 + i), dtype=torch.int8)
          for i, shape in enumerate(((3, he), (he, hcq), (hcq, n * (d + dr)), (he, hckv + dr)))]
    scales = [torch.rand(*shape, generator=torch.Generator().manual_seed(50 + i)) + 0.01
              for i, shape in enumerate(((3, 1), (1, hcq), (1, n * (d + dr)), (1, hckv + dr), (1,)))]
    torch.library.opcheck(OPS.mla_prolog.default,  # W8A8, int8 KV cache, int8 query
                          (i8[0], i8[1], i8[2], w[2], i8[3], *w[4:], torch.zeros(1, 16, 1, hckv, dtype=torch.int8),
                           torch.zeros(1, 16, 1, dr), torch.tensor([0, 5, 9]), None, 1e-5, 1e-5, "PA_BSND", 1.0, 1.0,
                           *scales, None, 2, 1, 1))


@pytest.mark.slow
def test_compile_fullgraph_forward_and_backward():
    q, kv, _, idx, qr, kr = _sfa_args()[:6]
    leaves = [t.clone().requires_grad_() for t in (q, qr, kv, kr)]

    def f(q, qr, kv, kr):
        return attnops.sparse_flash_attention(q, kv, kv, idx, scale=0.3, query_rope=qr, key_rope=kr).attention_out

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    out.sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, qr, kv, kr)]
    f(*ref).sum().backward()
    torch.testing.assert_close(out, f(*ref))
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad)
