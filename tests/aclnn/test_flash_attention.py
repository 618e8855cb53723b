"""aclnn FlashAttention operators: outputs vs the fp64 golden (parameter mapping of every operator) and the
two-phase calling convention (get_workspace_size -> executor, run once)."""
import pytest
import torch

from attnops import ParamInvalidError, aclnn
from attnops._core.dropout import pack_bits
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import fa_backward, fa_forward
from tests.aclnn.fa_params import OPS, base_params, call, param_names, positional, validate
from tests.helpers import F64, PREFIX3072, TRIU2048, cum, make_qkv, random_keep, randn


def _reductions(golden_args, golden_kw) -> dict[str, int]:
    """The reduction lengths of the golden call's outputs."""
    return fa_reductions(*golden_args[:3], layout=golden_kw["input_layout"], head_num=golden_kw["head_num"],
                         actual_seq_qlen=golden_kw.get("actual_seq_qlen"),
                         actual_seq_kvlen=golden_kw.get("actual_seq_kvlen"))


def _check_forward(res, golden_args, golden_kw, dtype):
    smax, ssum, softmax_out, out = res
    assert softmax_out.numel() == 0  # reserved output
    g = fa_forward(*golden_args, dtype=F64, **golden_kw)
    b = fa_forward(*golden_args, dtype=dtype, **golden_kw)
    red = _reductions(golden_args, golden_kw)
    for name, a, gg, bb in zip(("out", "softmax_max", "softmax_sum"), (out, smax, ssum), g, b):
        assert_close_to_golden(name, a, gg, bb, factor=2, reduction=red[name])


def _check_backward(res, dy, golden_args, golden_kw, dtype):
    g = fa_backward(dy, *golden_args, dtype=F64, **golden_kw)
    b = fa_backward(dy, *golden_args, dtype=dtype, **golden_kw)
    red = _reductions(golden_args, golden_kw)
    for name, a, gg, bb in zip(("dq", "dk", "dv", "dpse"), res, g, b):
        assert_close_to_golden(name, a, gg, bb, factor=3, reduction=red[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_score_and_score_grad_vs_golden(dtype):
    """BSH, GQA, Dv < D, pse (type 1), causal mode 3 and an explicit dropout mask."""
    b, n1, n2, sq, skv = 2, 4, 2, 5, 7
    q, k, v, dy = make_qkv("BSH", b=b, n1=n1, n2=n2, sq=sq, skv=skv, d=8, dv=4, dtype=dtype, seed=150)
    pse = randn(b, n1, sq, skv, dtype=dtype, seed=151)
    keep = random_keep(b * n1 * sq * skv, 0.8, seed=152)
    drop_mask = pack_bits(keep)
    scale = 0.3
    fwd = aclnn.flash_attention_score(q, k, v, pse, drop_mask, None, TRIU2048, None, scale, 0.8, 65536, 0, n1, "BSH",
                                      0, 3)
    gkw = dict(head_num=n1, input_layout="BSH", pse=pse, atten_mask=TRIU2048, scale=scale, keep_prob=0.8,
               drop_keep=keep, sparse_mode=3)
    _check_forward(fwd, (q, k, v), gkw, dtype)
    smax, ssum, _, out = fwd
    grads = aclnn.flash_attention_score_grad(q, k, v, dy, pse, drop_mask, None, TRIU2048, smax, ssum, None, out,
                                             None, scale, 0.8, 65536, 0, n1, "BSH", 0, 3)
    assert grads[3] is not None and grads[3].shape == pse.shape
    _check_backward(grads, dy, (q, k, v), gkw, dtype)


def test_var_len_and_unpadding_grad_vs_golden():
    """TND, mode 6 with prefix, GQA; V1 always uses pse_type 1 (add, then scale)."""
    q_lens, kv_lens = [3, 5, 2], [4, 5, 1]
    n1, n2 = 2, 1
    q, k, v, dy = make_qkv("TND", n1=n1, n2=n2, q_lens=q_lens, kv_lens=kv_lens, seed=153)
    pse = randn(3, n1, 5, 5, seed=154)
    prefix = [2, 3, 0]
    aq, akv = cum(q_lens), cum(kv_lens)
    fwd = aclnn.flash_attention_var_len_score(q, k, v, pse, None, None, PREFIX3072, prefix, aq, akv, 0.4, 1.0,
                                              2147483647, 2147483647, n1, "TND", 0, 6)
    gkw = dict(head_num=n1, input_layout="TND", pse=pse, pse_type=1, atten_mask=PREFIX3072, prefix=prefix,
               actual_seq_qlen=aq, actual_seq_kvlen=akv, scale=0.4, sparse_mode=6)
    _check_forward(fwd, (q, k, v), gkw, torch.float32)
    smax, ssum, _, out = fwd
    grads = aclnn.flash_attention_unpadding_score_grad(q, k, v, dy, pse, None, None, PREFIX3072, smax, ssum, None,
                                                       out, prefix, aq, akv, 0.4, 1.0, 2147483647, 2147483647, n1,
                                                       "TND", 0, 6)
    _check_backward(grads, dy, (q, k, v), gkw, torch.float32)


@pytest.mark.parametrize("pse_type,slopes", [(0, False), (2, True), (3, True)])
def test_v2_vs_golden(pse_type, slopes):
    """V2: pse_type 0-3 and q/kv_start_idx (IntArrays, element [0] used), mode 8 band on the first batch."""
    q_lens, kv_lens = [3, 4, 2], [5, 4, 2]
    n1, n2 = 4, 2
    q, k, v, dy = make_qkv("TND", n1=n1, n2=n2, q_lens=q_lens, kv_lens=kv_lens, seed=155)
    pse = randn(n1, seed=156).abs() if slopes else randn(1, n1, 4, 5, seed=156)
    aq, akv = cum(q_lens), cum(kv_lens)
    qs, ks = [2], [0]  # mode 8 split first batch: 3 - 5 + 2 - 0 == 0
    fwd = aclnn.flash_attention_var_len_score_v2(q, k, v, pse, None, None, TRIU2048, None, aq, akv, qs, ks, 0.4, 1.0,
                                                 5, 2, n1, "TND", 0, 8, pse_type)
    gkw = dict(head_num=n1, input_layout="TND", pse=pse, pse_type=pse_type, atten_mask=TRIU2048,
               actual_seq_qlen=aq, actual_seq_kvlen=akv, scale=0.4, sparse_mode=8, pre_tokens=5, next_tokens=2,
               q_start_idx=2, kv_start_idx=0)
    _check_forward(fwd, (q, k, v), gkw, torch.float32)
    smax, ssum, _, out = fwd
    grads = aclnn.flash_attention_unpadding_score_grad_v2(q, k, v, dy, pse, None, None, TRIU2048, smax, ssum, None,
                                                          out, None, aq, akv, qs, ks, 0.4, 1.0, 5, 2, n1, "TND", 0,
                                                          8, pse_type)
    assert (grads[3] is None) == slopes
    _check_backward(grads, dy, (q, k, v), gkw, torch.float32)


@pytest.mark.parametrize("version,form", [(1, "row"), (1, "full"), (2, "row"), (2, "full")])
def test_var_len_flattened_pse_vs_golden(version, form):
    """The 1-D TND pse: per-batch [N1, 1, Skv_b] (N1*sum(Skv_b)) or [N1, Sq_b, Skv_b] (N1*sum(Sq_b*Skv_b)), dpse
    in the same flattened shape; V2 with pse_type 0, V1 with its fixed type 1."""
    q_lens, kv_lens = [3, 5, 2], [4, 5, 6]
    n1, n2 = 2, 1
    q, k, v, dy = make_qkv("TND", n1=n1, n2=n2, q_lens=q_lens, kv_lens=kv_lens, seed=157)
    rows = [1] * 3 if form == "row" else q_lens
    pse = randn(n1 * sum(r * c for r, c in zip(rows, kv_lens)), seed=158)
    aq, akv = cum(q_lens), cum(kv_lens)
    pse_type = 1 if version == 1 else 0
    if version == 1:
        fwd = aclnn.flash_attention_var_len_score(q, k, v, pse, None, None, TRIU2048, None, aq, akv, 0.4, 1.0,
                                                  2147483647, 2147483647, n1, "TND", 0, 3)
    else:
        fwd = aclnn.flash_attention_var_len_score_v2(q, k, v, pse, None, None, TRIU2048, None, aq, akv, None, None,
                                                     0.4, 1.0, 2147483647, 2147483647, n1, "TND", 0, 3, pse_type)
    gkw = dict(head_num=n1, input_layout="TND", pse=pse, pse_type=pse_type, atten_mask=TRIU2048,
               actual_seq_qlen=aq, actual_seq_kvlen=akv, scale=0.4, sparse_mode=3)
    _check_forward(fwd, (q, k, v), gkw, torch.float32)
    smax, ssum, _, out = fwd
    if version == 1:
        grads = aclnn.flash_attention_unpadding_score_grad(q, k, v, dy, pse, None, None, TRIU2048, smax, ssum, None,
                                                           out, None, aq, akv, 0.4, 1.0, 2147483647, 2147483647, n1,
                                                           "TND", 0, 3)
    else:
        grads = aclnn.flash_attention_unpadding_score_grad_v2(q, k, v, dy, pse, None, None, TRIU2048, smax, ssum,
                                                              None, out, None, aq, akv, None, None, 0.4, 1.0,
                                                              2147483647, 2147483647, n1, "TND", 0, 3, pse_type)
    assert grads[3].shape == pse.shape
    _check_backward(grads, dy, (q, k, v), gkw, torch.float32)


# ----------------------------------------------------------------------------------------- two-phase form


def _params_with_forward_results(op):
    """Valid parameters; backward operators get the real forward results of the same inputs."""
    kw = dict(atten_mask=TRIU2048, sparse_mode=3)
    p = base_params(op, **kw)
    if OPS[op][3]:
        fwd = {"score_grad": "score", "unpad_grad": "var_len", "unpad_grad_v2": "var_len_v2"}[op]
        smax, ssum, _, out = call(fwd, base_params(fwd, **kw))
        p.update(softmax_max=smax, softmax_sum=ssum, attention_in=out)
    return p


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("op", list(OPS))
def test_two_phase_equals_direct_call(op):
    p = _params_with_forward_results(op)
    workspace_size, executor = validate(op, p)
    assert isinstance(workspace_size, int) and workspace_size >= 0
    assert isinstance(executor, aclnn.AclnnExecutor)
    two_phase = OPS[op][0](None, workspace_size, executor, None)
    direct = call(op, p)
    _same(two_phase, direct)
    assert all(t is None or torch.isfinite(t).all() for t in direct)


@pytest.mark.parametrize("op", list(OPS))
def test_executor_runs_once(op):
    workspace_size, executor = validate(op, _params_with_forward_results(op))
    OPS[op][0](None, workspace_size, executor, None)
    with pytest.raises(ParamInvalidError, match="^executor") as e:
        OPS[op][0](None, workspace_size, executor, None)
    assert e.value.status == 161002


@pytest.mark.parametrize("op", ["var_len", "unpad_grad_v2"])
def test_bad_workspace_size(op):
    _, executor = validate(op, _params_with_forward_results(op))
    with pytest.raises(ParamInvalidError, match="^workspace_size"):
        OPS[op][0](None, -1, executor, None)


@pytest.mark.parametrize("op", list(OPS))
def test_phase_one_takes_keywords_and_positions_alike(op):
    p = _params_with_forward_results(op)
    _, ex_pos = validate(op, p)
    _, ex_kw = OPS[op][1](**p)
    _same(OPS[op][0](None, 0, ex_pos, None), OPS[op][0](None, 0, ex_kw, None))
    assert param_names(op) == list(p) and len(positional(op, p)) == len(p)
