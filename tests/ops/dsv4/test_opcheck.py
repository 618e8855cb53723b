"""torch.library.opcheck on the sparse_flash_mla custom ops (schemas, fake kernels, autograd registration),
torch.compile(fullgraph=True) with tensor lengths, and the docstring examples."""
from __future__ import annotations

import doctest

import pytest
import torch

import attnops
from attnops.ops.dsv4 import api, metadata
from attnops.ops.dsv4 import op as dsv4_op

from .helpers import call, hca, make_parts, pack

OPS = torch.ops.attnops


def _args(layout_q="TND", layout_kv="PA_BBND", dtype=torch.float32):
    case = hca([3, 5], [7, 9], ratio=2, topk=3, dtype=dtype, dim=8, heads=2)
    kw, _ = pack(case, make_parts(case), layout_q, layout_kv)
    values = {**kw}
    return tuple(values.get(name) for name in dsv4_op.ARG_NAMES)


@pytest.mark.parametrize("layouts", [("TND", "PA_BBND"), ("BSND", "BSND")])
def test_opcheck_forward_and_grad(layouts):
    args = _args(*layouts)
    torch.library.opcheck(OPS.dsv4_sparse_flash_mla.default, args)
    out, lse = OPS.dsv4_sparse_flash_mla(*args)
    torch.library.opcheck(OPS.dsv4_sparse_flash_mla_grad.default,
                          (torch.ones_like(out), torch.ones_like(lse), out, lse, *args),
                          test_utils=("test_schema", "test_faketensor"))  # no autograd of its own
    sliding = tuple(None if name in ("cmp_kv", "cmp_sparse_indices", "cmp_block_table", "cu_seqlens_cmp_kv",
                                     "seqused_cmp_kv", "sinks") else a for name, a in zip(dsv4_op.ARG_NAMES, args))
    torch.library.opcheck(OPS.dsv4_sparse_flash_mla_grad.default,
                          (torch.ones_like(out), None, out, lse, *sliding), test_utils=("test_schema",
                                                                                       "test_faketensor"))


def test_compile_fullgraph_with_tensor_lengths():
    """Lengths, tables and indices are tensors: one graph, forward and backward, same values as eager."""
    case = hca([3, 5], [7, 9], ratio=2, topk=3, dtype=torch.float32, dim=8, heads=2)
    kw, _ = pack(case, make_parts(case), "TND", "PA_BBND", requires_grad=True)
    q, ori, cmp, sinks = kw.pop("q"), kw.pop("ori_kv"), kw.pop("cmp_kv"), kw.pop("sinks")

    def step(q, ori, cmp, sinks):
        out, lse = attnops.sparse_flash_mla(q, ori, cmp_kv=cmp, sinks=sinks, **kw)
        return out.square().sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_loss = step(q, ori, cmp, sinks)
    eager = torch.autograd.grad(eager_loss, (q, ori, cmp, sinks))
    loss = compiled(q, ori, cmp, sinks)
    grads = torch.autograd.grad(loss, (q, ori, cmp, sinks))
    torch.testing.assert_close(loss, eager_loss)
    for a, b in zip(grads, eager):
        torch.testing.assert_close(a, b)


def test_custom_op_is_the_pythonic_result():
    args = _args("BSND", "BSND")
    case = hca([3, 5], [7, 9], ratio=2, topk=3, dtype=torch.float32, dim=8, heads=2)
    kw, _ = pack(case, make_parts(case), "BSND", "BSND")
    for a, b in zip(OPS.dsv4_sparse_flash_mla(*args), call(kw)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("module", [api, metadata])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
