"""torch.library.opcheck on the custom ops (schema, fake kernels, autograd registration, AOT dispatch) and
torch.compile(fullgraph=True) of code calling attnops.flash_attention, forward and backward."""
import pytest
import torch

import attnops
from attnops._core.dropout import pack_bits
from attnops.ops.flash_attention import op as fa_op  # noqa: F401  (registers torch.ops.attnops.*)
from tests.helpers import INT_MAX, TRIU2048, make_qkv, random_keep, randn


def _fwd_args(q, k, v, *, pse=None, atten_mask=None, drop_mask=None, head_num, layout, scale=0.4, keep_prob=1.0,
              pre=INT_MAX, nxt=INT_MAX, prefix=None, qlen=None, kvlen=None, sparse_mode=0, pse_type=1,
              softmax_layout="", seed=0, offset=0, lengths=()):
    """Positional arguments of attnops::flash_attention_fwd (after q, k, v), in schema order; ``lengths``: the
    trailing ``backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k`` when given."""
    return (q, k, v, pse, atten_mask, drop_mask, head_num, layout, scale, keep_prob, pre, nxt, prefix, qlen, kvlen,
            sparse_mode, pse_type, 0, 0, softmax_layout, seed, offset, *lengths)


def _cases():
    q, k, v, _ = make_qkv("BNSD", b=1, n1=2, sq=4, skv=5, seed=140)
    yield "bnsd_plain", _fwd_args(q, k, v, head_num=2, layout="BNSD")
    q, k, v, _ = make_qkv("TND", n1=4, n2=2, d=8, dv=4, q_lens=[3, 0, 2], kv_lens=[4, 2, 2], seed=141)
    yield "tnd_causal_gqa_dv", _fwd_args(q, k, v, head_num=4, layout="TND", qlen=[3, 3, 5], kvlen=[4, 6, 8],
                                         atten_mask=TRIU2048, sparse_mode=3, softmax_layout="TND")
    q, k, v, _ = make_qkv("BSH", b=2, n1=2, n2=1, sq=3, skv=3, seed=142)
    yield "bsh_pse_dropout", _fwd_args(q, k, v, head_num=2, layout="BSH", pse=randn(2, 2, 3, 3, seed=143),
                                       keep_prob=0.75, drop_mask=pack_bits(random_keep(36, 0.75, seed=144)))
    q, k, v, _ = make_qkv("TND", n1=2, q_lens=[3, 2], kv_lens=[1, 4], t_extra=1, seed=149)
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 1, 5])
    yield "tnd_cu_seqlens_tensors", _fwd_args(q, k, v, head_num=2, layout="TND", atten_mask=TRIU2048,
                                              sparse_mode=3, lengths=("auto", cu_q, cu_k, 3, 4))


CASES = dict(_cases())


@pytest.mark.parametrize("case", list(CASES))
def test_opcheck_forward(case):
    # default test_utils: test_schema, test_autograd_registration, test_faketensor, test_aot_dispatch_dynamic
    torch.library.opcheck(torch.ops.attnops.flash_attention_fwd.default, CASES[case])


@pytest.mark.parametrize("case", list(CASES))
def test_opcheck_backward(case):
    args = CASES[case]
    out, smax, ssum = torch.ops.attnops.flash_attention_fwd(*args)
    dy = randn(*out.shape, seed=145)
    torch.library.opcheck(torch.ops.attnops.flash_attention_bwd.default, (dy, *args[:3], out, smax, ssum, *args[3:]))


def _compile_case(backend):
    torch._dynamo.reset()
    q, k, v, dy = make_qkv("BSND", b=1, n1=4, n2=2, sq=5, skv=6, seed=146)
    pse = randn(1, 4, 5, 6, seed=147)

    def f(q, k, v, pse):
        out = attnops.flash_attention(q, k, v, layout="BSND", scale=0.3, pse=pse, atten_mask=TRIU2048,
                                      sparse_mode=3)
        return (out * 2).sum(-1)

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    leaves_c = [t.clone().requires_grad_() for t in (q, k, v, pse)]
    leaves_e = [t.clone().requires_grad_() for t in (q, k, v, pse)]
    yc, ye = compiled(*leaves_c), f(*leaves_e)
    g = dy.sum(-1)
    yc.backward(g)
    ye.backward(g)
    torch.testing.assert_close(yc, ye, rtol=0, atol=0)
    for a, b in zip(leaves_c, leaves_e):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph(backend):
    _compile_case(backend)


def test_compile_fullgraph_tnd():
    torch._dynamo.reset()
    q, k, v, dy = make_qkv("TND", n1=2, q_lens=[2, 3], kv_lens=[3, 3], seed=148)

    def f(q, k, v):
        return attnops.flash_attention(q, k, v, layout="TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[3, 6],
                                       atten_mask=TRIU2048, sparse_mode=2, scale=0.5)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    lc = [t.clone().requires_grad_() for t in (q, k, v)]
    le = [t.clone().requires_grad_() for t in (q, k, v)]
    oc, oe = compiled(*lc), f(*le)
    oc.backward(dy)
    oe.backward(dy)
    torch.testing.assert_close(oc, oe, rtol=0, atol=0)
    for a, b in zip(lc, le):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_compile_traces_once_for_every_length_set():
    """cu_seqlens tensors and no host lists: one graph (dynamic shapes) for five length sets, of two, three or one
    sequence, equal to eager forward and backward."""
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v, cu):
        return attnops.flash_attention(q, k, v, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                       scale=0.25)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counting)
    for seed, lens in enumerate(([3, 5], [4, 1, 2], [7], [2, 2, 2, 2], [1, 6, 3])):
        q, k, v, dy = make_qkv("TND", n1=2, d=8, q_lens=lens, kv_lens=lens, t_extra=1, seed=150 + seed)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        lc = [t.clone().requires_grad_() for t in (q, k, v)]
        le = [t.clone().requires_grad_() for t in (q, k, v)]
        oc, oe = compiled(*lc, cu), f(*le, cu)
        oc.backward(dy)
        oe.backward(dy)
        torch.testing.assert_close(oc, oe, rtol=0, atol=0)
        for a, b in zip(lc, le):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert len(graphs) == 1


def test_eager_calls_reach_the_op_where_something_watches():
    """Plain eager calls run the implementation without the dispatcher; under a dispatch mode (fake tensors,
    tracing, FLOP counters, the dry run's guard) the op itself is called, forward and backward, with the same
    results."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=6, skv=5, seed=160)
    direct = [t.clone().requires_grad_() for t in (q, k, v)]
    watched = [t.clone().requires_grad_() for t in (q, k, v)]
    attnops.flash_attention(*direct, scale=0.3).backward(dy)
    with Log():
        attnops.flash_attention(*watched, scale=0.3).backward(dy)
    assert {torch.ops.attnops.flash_attention_fwd.default, torch.ops.attnops.flash_attention_bwd.default} <= set(seen)
    for a, b in zip(direct, watched):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
