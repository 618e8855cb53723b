"""The validation table of the aclnn FlashAttention operators: one case per documented constraint of the seeds
(aclnnFlashAttentionUnpaddingScoreGrad(V2).md, "约束说明") and of the forward operators.

Every rejected call must raise the status-coded exception before any compute (already in phase 1,
``*_get_workspace_size``): ParamNullptrError (161001) for a missing required tensor, ParamInvalidError /
ParamDtypeError (161002) otherwise, with a message that starts with the argument's name.
"""
import re

import pytest
import torch

from attnops import AclnnError, ParamDtypeError, ParamInvalidError, ParamNullptrError
from attnops._core.dropout import pack_bits
from tests.aclnn.fa_params import (ALIASES, BACKWARD_OPS, DENSE_OPS, OPS, TND_OPS, V2_OPS, base_params, call,
                                   get_param, validate)
from tests.helpers import INT_MAX, PREFIX3072, TRIU2048, to_layout

ALL_OPS = list(OPS)
BIG_T = (1 << 20) + 1


def _names(name):
    return "|".join(re.escape(n) for n in ALIASES.get(name, ()) + (name,))


def expect(op, params, exc, name):
    with pytest.raises(exc) as info:
        validate(op, params)
    err = info.value
    assert isinstance(err, AclnnError)
    assert err.status == (161001 if exc is ParamNullptrError else 161002)
    assert re.match(rf"^({_names(name)})(\[\d+\])?: ", str(err)), str(err)
    return err


def accept(op, params):
    ws, executor = validate(op, params)
    assert isinstance(ws, int) and ws >= 0 and executor is not None


def _tnd_big(op, which):
    """T = 1M + 1 tokens as a zero-stride expanded tensor (no memory)."""
    p = base_params(op)
    t = get_param(p, which)
    big = t[:1].expand(BIG_T, *t.shape[1:])
    p[which if which in p else "key_in"] = big
    if which == "query":
        p["actual_seq_qlen"] = [BIG_T]
    else:
        p["actual_seq_kvlen"] = [BIG_T]
        p["actual_seq_qlen"] = [7]
    return p


# ----------------------------------------------------------------------------------------- required tensors


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_missing_qkv(op, name):
    p = base_params(op)
    p[[n for n in ALIASES.get(name, (name,)) if n in p][0]] = None
    expect(op, p, ParamNullptrError, name)


@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("name", ["dy", "softmax_max", "softmax_sum", "attention_in"])
def test_missing_backward_inputs(op, name):
    expect(op, base_params(op, **{name: None}), ParamNullptrError, name)


@pytest.mark.parametrize("op", ALL_OPS)
def test_missing_drop_mask_with_dropout(op):
    expect(op, base_params(op, keep_prob=0.5), ParamNullptrError, "drop_mask")


# ----------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("op", TND_OPS)
@pytest.mark.parametrize("which", ["query", "key"])
def test_t_at_most_1m(op, which):
    expect(op, _tnd_big(op, which), ParamInvalidError, which)


@pytest.mark.parametrize("op", ["var_len", "unpad_grad"])
def test_t_of_exactly_1m_is_accepted(op):
    p = base_params(op)
    t1m = 1 << 20
    for name in ("query", "dy", "attention_in", "softmax_max", "softmax_sum"):
        if name in p:
            p[name] = p[name][:1].expand(t1m, *p[name].shape[1:])
    p["actual_seq_qlen"] = [3, 7]
    accept(op, p)


@pytest.mark.parametrize("op", TND_OPS)
def test_empty_t_rejected(op):
    p = base_params(op)
    p["query"] = p["query"][:0]
    p["actual_seq_qlen"] = [0, 0]
    expect(op, p, ParamInvalidError, "query")


@pytest.mark.parametrize("op", ALL_OPS)
def test_head_num_at_most_256(op):
    expect(op, base_params(op, n1=257, n2=1, d=4, q_lens=(1, 1), kv_lens=(1, 1), b=1, sq=1, skv=1),
           ParamInvalidError, "head_num")


@pytest.mark.parametrize("op", ALL_OPS)
def test_head_num_at_least_1(op):
    expect(op, base_params(op, head_num=0), ParamInvalidError, "head_num")


@pytest.mark.parametrize("op", ["var_len", "score_grad"])
def test_head_num_256_accepted(op):
    accept(op, base_params(op, n1=256, n2=2, d=4, q_lens=(1,), kv_lens=(1,), b=1, sq=1, skv=1))


@pytest.mark.parametrize("op", ALL_OPS)
def test_head_dim_limit(op):
    limit = 768 if op in V2_OPS else 512
    small = dict(n1=1, n2=1, q_lens=(1,), kv_lens=(1,), b=1, sq=1, skv=1)
    accept(op, base_params(op, d=limit, **small))
    expect(op, base_params(op, d=limit + 1, **small), ParamInvalidError, "query")
    expect(op, base_params(op, d=0, **small), ParamInvalidError, "query")


@pytest.mark.parametrize("op", ["var_len_v2", "unpad_grad_v2"])
def test_v2_computes_with_d_768(op):
    out = call(op, base_params(op, d=768, n1=1, n2=1, q_lens=(2,), kv_lens=(3,)))
    assert all(t is None or torch.isfinite(t).all() for t in out)


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("keep_prob", [0.0, -0.1, 1.5])
def test_keep_prob_range(op, keep_prob):
    expect(op, base_params(op, keep_prob=keep_prob, drop_mask=torch.zeros(64, dtype=torch.uint8)),
           ParamInvalidError, "keep_prob")


@pytest.mark.parametrize("op", ALL_OPS)
def test_head_num_equals_n(op):
    expect(op, base_params(op, head_num=3), ParamInvalidError, "head_num")


@pytest.mark.parametrize("op", TND_OPS)
def test_at_most_2048_batches(op):
    ones = [1] * 2048
    accept(op, base_params(op, q_lens=(1,), kv_lens=(1,), actual_seq_qlen=ones, actual_seq_kvlen=ones))
    expect(op, base_params(op, q_lens=(1,), kv_lens=(1,), actual_seq_qlen=ones + [1], actual_seq_kvlen=ones + [1]),
           ParamInvalidError, "actual_seq_qlen")


@pytest.mark.parametrize("op", TND_OPS)
def test_at_most_1024_batches_with_prefix(op):
    ones = [1] * 1024
    kw = dict(q_lens=(1,), kv_lens=(1,), atten_mask=PREFIX3072, sparse_mode=6)
    accept(op, base_params(op, actual_seq_qlen=ones, actual_seq_kvlen=ones, prefix=[1] + [0] * 1023, **kw))
    expect(op, base_params(op, actual_seq_qlen=ones + [1], actual_seq_kvlen=ones + [1], prefix=[1] + [0] * 1024,
                           **kw), ParamInvalidError, "actual_seq_qlen")


# ----------------------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int8], ids=str)
def test_unsupported_dtypes(op, dtype):
    p = base_params(op)
    for name in ("query", "key", "key_in", "value", "dy", "attention_in"):
        if name in p:
            p[name] = p[name].to(dtype)
    expect(op, p, ParamDtypeError, "query")


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_supported_dtypes(op, dtype):
    accept(op, base_params(op, dtype=dtype))


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("name", ["key", "value"])
def test_qkv_dtypes_must_match(op, name):
    p = base_params(op)
    expect(op, base_params(op, **{name: get_param(p, name).half()}), ParamInvalidError, name)


@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("name", ["dy", "attention_in"])
def test_dy_and_attention_in_dtype_must_match(op, name):
    p = base_params(op)
    expect(op, base_params(op, **{name: p[name].half()}), ParamDtypeError, name)


# ----------------------------------------------------------------------------------------- layouts and shapes


@pytest.mark.parametrize("op", TND_OPS)
@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH", "XYZ"])
def test_tnd_ops_need_tnd(op, layout):
    expect(op, base_params(op, input_layout=layout), ParamInvalidError, "input_layout")


@pytest.mark.parametrize("op", DENSE_OPS)
@pytest.mark.parametrize("layout", ["TND", "NSD"])
def test_score_ops_reject_tnd(op, layout):
    expect(op, base_params(op, input_layout=layout), ParamInvalidError, "input_layout")


@pytest.mark.parametrize("op", DENSE_OPS)
@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_score_ops_accept_dense_layouts(op, layout):
    p = base_params(op)
    for name in ("query", "key", "key_in", "value", "dy", "attention_in"):
        if name in p:
            p[name] = to_layout(p[name].transpose(1, 2), layout)  # BNSD -> BSND -> layout
    p["input_layout"] = layout
    accept(op, p)
    out = call(op, p)
    assert out[3 if op == "score" else 0].shape == p["query"].shape


@pytest.mark.parametrize("op", ALL_OPS)
def test_nq_multiple_of_nkv(op):
    expect(op, base_params(op, n1=3, n2=2), ParamInvalidError, "key")


@pytest.mark.parametrize("op", ALL_OPS)
def test_dk_equals_dq(op):
    p = base_params(op)
    k = get_param(p, "key")
    expect(op, base_params(op, key=torch.zeros(*k.shape[:-1], 4)), ParamInvalidError, "key")


@pytest.mark.parametrize("op", ALL_OPS)
def test_dv_at_most_dk(op):
    p = base_params(op)
    v = p["value"]
    expect(op, base_params(op, value=torch.zeros(*v.shape[:-1], 16)), ParamInvalidError, "value")


@pytest.mark.parametrize("op", ALL_OPS)
def test_dv_less_than_dk_accepted(op):
    accept(op, base_params(op, d=8, dv=4))


@pytest.mark.parametrize("op", ALL_OPS)
def test_key_value_shapes_agree(op):
    p = base_params(op)
    v = p["value"]
    bad = torch.zeros(v.shape[0] + 1, *v.shape[1:]) if op in TND_OPS else torch.zeros(*v.shape[:2], 6, v.shape[3])
    expect(op, base_params(op, value=bad), ParamInvalidError, "value")


@pytest.mark.parametrize("op", DENSE_OPS)
def test_batch_sizes_agree(op):
    p = base_params(op)
    k = get_param(p, "key")
    expect(op, base_params(op, key=torch.zeros(3, *k.shape[1:]), value=torch.zeros(3, *p["value"].shape[1:])),
           ParamInvalidError, "key")


@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("name", ["dy", "attention_in"])
def test_dy_and_attention_in_shapes(op, name):
    p = base_params(op)
    t = p[name]
    expect(op, base_params(op, **{name: torch.zeros(*t.shape[:-1], t.shape[-1] + 1)}), ParamInvalidError, name)


@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("name", ["softmax_max", "softmax_sum"])
@pytest.mark.parametrize("bad", ["lanes", "rank", "rows", "dtype"])
def test_softmax_stats_shapes(op, name, bad):
    t = base_params(op)[name]
    value = {"lanes": lambda: t[..., :1].contiguous(), "rank": lambda: t[..., 0].contiguous(),
             "rows": lambda: torch.cat([t, t[:1]]), "dtype": lambda: t.half()}[bad]()
    expect(op, base_params(op, **{name: value}), ParamDtypeError if bad == "dtype" else ParamInvalidError, name)


@pytest.mark.parametrize("op", ALL_OPS)
def test_padding_mask_must_be_none(op):
    expect(op, base_params(op, padding_mask=torch.zeros(2, 2, dtype=torch.bool)), ParamInvalidError, "padding_mask")


# ----------------------------------------------------------------------------------------- sparse modes and masks


@pytest.mark.parametrize("op", ALL_OPS)
def test_sparse_mode_range(op):
    tnd = op in TND_OPS
    allowed = (0, 1, 2, 3, 4, 6, 7, 8) if tnd else (0, 1, 2, 3, 4, 5, 6)
    p0 = base_params(op)
    sq, skv = (4, 4) if tnd else (4, 5)
    for mode in range(-1, 10):
        mask = {0: torch.zeros(sq, skv, dtype=torch.bool), 1: torch.zeros(sq, skv, dtype=torch.bool),
                5: torch.zeros(2, 1, sq, skv, dtype=torch.bool), 6: PREFIX3072}.get(mode, TRIU2048)
        prefix = ([1, 1] if tnd else [1, 5]) if mode in (5, 6) else None
        p = dict(p0, atten_mask=mask, sparse_mode=mode, prefix=prefix, pre_tokens=INT_MAX, next_tokens=0)
        if mode in allowed:
            accept(op, p)
        else:
            expect(op, p, ParamInvalidError, "sparse_mode")


@pytest.mark.parametrize("op", TND_OPS)
@pytest.mark.parametrize("prefix,bad_index", [([1, 0], None), ([4, 2], None), ([0, 1], 0), ([5, 1], 0),
                                              ([2, 3], 1), ([2, -1], 1)])
def test_prefix_range_mode6_tnd(op, prefix, bad_index):
    # batch 0: Sq=3 <= Skv=4 -> prefix in [Skv-Sq, Skv] = [1, 4]; batch 1: Sq=5 > Skv=2 -> [0, Skv] = [0, 2]
    p = base_params(op, q_lens=(3, 5), kv_lens=(4, 2), atten_mask=PREFIX3072, sparse_mode=6, prefix=prefix)
    if bad_index is None:
        accept(op, p)
    else:
        expect(op, p, ParamInvalidError, f"prefix[{bad_index}]")


@pytest.mark.parametrize("op", DENSE_OPS)
@pytest.mark.parametrize("mode", [5, 6])
@pytest.mark.parametrize("sq,skv,good,bad", [(4, 5, [1, 5], [0, 6]), (5, 3, [0, 3], [-1, 4])])
def test_prefix_range_dense(op, mode, sq, skv, good, bad):
    mask = PREFIX3072 if mode == 6 else torch.zeros(2, 2, sq, skv, dtype=torch.bool)
    for value in good:
        accept(op, base_params(op, sq=sq, skv=skv, atten_mask=mask, sparse_mode=mode, prefix=[value, value]))
    for value in bad:
        expect(op, base_params(op, sq=sq, skv=skv, atten_mask=mask, sparse_mode=mode, prefix=[good[0], value]),
               ParamInvalidError, "prefix[1]")


@pytest.mark.parametrize("op", ALL_OPS)
def test_prefix_needs_one_value_per_batch(op):
    expect(op, base_params(op, atten_mask=PREFIX3072, sparse_mode=6, prefix=[1]), ParamInvalidError, "prefix")


NOT_CANONICAL = {
    "triu0": torch.ones(2048, 2048, dtype=torch.bool).triu(0),
    "tril": TRIU2048.T.contiguous(),
    "one_flip": TRIU2048.clone().index_put_((torch.tensor([5]), torch.tensor([700])), torch.tensor(False)),
    "small": torch.ones(512, 512, dtype=torch.bool).triu(1),
    "batched": TRIU2048.expand(2, 2048, 2048),
    "prefix_form": PREFIX3072,
}


@pytest.mark.parametrize("op,mode", [(op, mode) for op in ALL_OPS for mode in (2, 3, 4, 7, 8)
                                     if op in TND_OPS or mode < 7])  # modes 7/8 are TND-only
@pytest.mark.parametrize("kind", list(NOT_CANONICAL))
def test_compressed_mask_must_be_canonical(op, mode, kind):
    expect(op, base_params(op, atten_mask=NOT_CANONICAL[kind], sparse_mode=mode, pre_tokens=INT_MAX, next_tokens=0),
           ParamInvalidError, "atten_mask")


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("kind", ["no_rectangle", "wrong_rectangle", "triu_only"])
def test_compressed_prefix_mask_must_be_canonical(op, kind):
    mask = {"no_rectangle": torch.cat([TRIU2048, torch.zeros(1024, 2048, dtype=torch.bool)]),
            "wrong_rectangle": torch.cat([TRIU2048, ~PREFIX3072[2048:]]), "triu_only": TRIU2048}[kind]
    expect(op, base_params(op, atten_mask=mask, sparse_mode=6, prefix=[1, 1]), ParamInvalidError, "atten_mask")


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("mode", [0, 1])
def test_atten_mask_dtype(op, mode):
    shape = (4, 4) if op in TND_OPS else (4, 5)
    accept(op, base_params(op, atten_mask=torch.zeros(shape, dtype=torch.uint8), sparse_mode=mode))
    for dtype in (torch.float32, torch.int32, torch.float16):
        expect(op, base_params(op, atten_mask=torch.zeros(shape, dtype=dtype), sparse_mode=mode), ParamDtypeError,
               "atten_mask")


@pytest.mark.parametrize("op", DENSE_OPS)
@pytest.mark.parametrize("shape,ok", [((2, 2, 4, 5), True), ((2, 1, 4, 5), True), ((1, 1, 4, 5), True),
                                      ((4, 5), True), ((2, 2, 4, 6), False), ((2, 4, 5), False),
                                      ((3, 1, 4, 5), False), ((1, 2, 4, 5), False), ((5, 4), False)])
def test_atten_mask_shapes_dense(op, shape, ok):
    p = base_params(op, atten_mask=torch.zeros(shape, dtype=torch.bool), sparse_mode=1)
    accept(op, p) if ok else expect(op, p, ParamInvalidError, "atten_mask")


@pytest.mark.parametrize("op", DENSE_OPS)
def test_mode5_mask_shapes(op):
    # mode 5: BNSS or B1SS only (the broadcast forms only when B == 1)
    kw = dict(sparse_mode=5, prefix=[1, 1])
    accept(op, base_params(op, atten_mask=torch.zeros(2, 1, 4, 5, dtype=torch.bool), **kw))
    expect(op, base_params(op, atten_mask=torch.zeros(4, 5, dtype=torch.bool), **kw), ParamInvalidError,
           "atten_mask")
    expect(op, base_params(op, atten_mask=torch.zeros(1, 1, 4, 5, dtype=torch.bool), **kw), ParamInvalidError,
           "atten_mask")


@pytest.mark.parametrize("op", TND_OPS)
@pytest.mark.parametrize("shape,ok", [((4, 4), True), ((1, 1, 4, 4), True), ((6, 9), True), ((3, 4), False),
                                      ((4, 3), False), ((2, 1, 4, 4), False), ((1, 4, 4), False)])
def test_atten_mask_shapes_tnd(op, shape, ok):
    p = base_params(op, atten_mask=torch.zeros(shape, dtype=torch.bool), sparse_mode=0)
    accept(op, p) if ok else expect(op, p, ParamInvalidError, "atten_mask")


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("pre,nxt,name", [
    (2, -1, None), (-1, 2, None), (0, -1, "next_tokens"), (INT_MAX, -4, "next_tokens"), (INT_MAX, -5, "next_tokens"),
    (-1, 0, "pre_tokens"), (-4, INT_MAX, "pre_tokens"), (1, -2, "next_tokens")])
def test_negative_tokens_mode0(op, pre, nxt, name):
    # next < 0 needs pre >= |next| and |next| < Skv; pre < 0 needs next >= |pre| and |pre| < Sq (Sq = Skv = 4 in TND;
    # Sq = 4, Skv = 5 dense, hence -4 is fine there for next)
    if op in DENSE_OPS and nxt == -4:
        nxt = -5
    p = base_params(op, atten_mask=torch.zeros(4, 4 if op in TND_OPS else 5, dtype=torch.bool), sparse_mode=0,
                    pre_tokens=pre, next_tokens=nxt)
    accept(op, p) if name is None else expect(op, p, ParamInvalidError, name)


@pytest.mark.parametrize("op", ALL_OPS)
def test_band_mode4_needs_nonnegative_width(op):
    kw = dict(atten_mask=TRIU2048, sparse_mode=4)
    accept(op, base_params(op, pre_tokens=1, next_tokens=-1, **kw))
    accept(op, base_params(op, pre_tokens=-2, next_tokens=3, **kw))
    expect(op, base_params(op, pre_tokens=1, next_tokens=-2, **kw), ParamInvalidError, "next_tokens")
    expect(op, base_params(op, pre_tokens=-3, next_tokens=2, **kw), ParamInvalidError, "next_tokens")


# ----------------------------------------------------------------------------------------- pse


@pytest.mark.parametrize("op", ALL_OPS)
def test_pse_dtype_equals_query(op):
    shape = (2, 2, 4, 4) if op in TND_OPS else (2, 2, 4, 5)
    accept(op, base_params(op, pse=torch.zeros(shape)))
    expect(op, base_params(op, pse=torch.zeros(shape, dtype=torch.float16)), ParamInvalidError, "pse")


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("shape,ok", [
    ((2, 2, 4, 5), True), ((1, 2, 4, 5), True), ((2, 2, 1, 5), True), ((2, 2, 4), False), ((2, 3, 4, 5), False),
    ((3, 2, 4, 5), False), ((2, 2, 3, 5), False), ((2, 2, 4, 4), False), ((2, 2, 2, 5), False)])
def test_pse_shapes_types_0_1(op, shape, ok):
    if op in TND_OPS:  # TND: [B|1, N, >= maxSq, >= maxSkv] or [B|1, N, 1, >= maxSkv]; maxSq = maxSkv = 4 here
        shape = {(2, 2, 4, 4): (2, 2, 3, 4), (2, 2, 2, 5): (2, 2, 2, 3)}.get(shape, shape)
    pse = torch.zeros(shape)
    for kw in ([dict(pse_type=0), dict(pse_type=1)] if op in V2_OPS else [{}]):
        p = base_params(op, pse=pse, **kw)
        accept(op, p) if ok else expect(op, p, ParamInvalidError, "pse")


@pytest.mark.parametrize("op", V2_OPS)
@pytest.mark.parametrize("pse_type", [2, 3])
def test_pse_slopes(op, pse_type):
    kw = dict(q_lens=(3, 4), kv_lens=(3, 4), pse_type=pse_type)
    accept(op, base_params(op, pse=torch.ones(2, 2), **kw))
    accept(op, base_params(op, pse=torch.ones(2), q_start_idx=[3], kv_start_idx=[1], **kw))
    expect(op, base_params(op, pse=torch.ones(2, 2, dtype=torch.float16), **kw), ParamInvalidError, "pse")
    expect(op, base_params(op, pse=torch.ones(2, 3), **kw), ParamInvalidError, "pse")
    expect(op, base_params(op, pse=torch.ones(3), **kw), ParamInvalidError, "pse")
    expect(op, base_params(op, pse=torch.ones(1, 2, 3, 3), **kw), ParamInvalidError, "pse")
    # generated ALiBi needs Sq == Skv
    expect(op, base_params(op, pse=torch.ones(2, 2), pse_type=pse_type), ParamInvalidError, "pse")


@pytest.mark.parametrize("op", V2_OPS)
def test_pse_type_range(op):
    for bad in (-1, 4):
        expect(op, base_params(op, pse=torch.zeros(2, 2, 4, 4), pse_type=bad), ParamInvalidError, "pse_type")


@pytest.mark.parametrize("op", V2_OPS)
def test_mode8_split_alibi_start_rule(op):
    # q-split first batch: actual_seq_qlen[0] - actual_seq_kvlen[0] + q_start_idx - kv_start_idx == 0
    kw = dict(q_lens=(2, 3), kv_lens=(4, 3), atten_mask=TRIU2048, sparse_mode=8, pre_tokens=4, next_tokens=2,
              pse=torch.ones(2), pse_type=2)
    accept(op, base_params(op, q_start_idx=[2], kv_start_idx=[0], **kw))
    expect(op, base_params(op, q_start_idx=[1], kv_start_idx=[0], **kw), ParamInvalidError, "q_start_idx")


@pytest.mark.parametrize("op", TND_OPS)
def test_no_pse_with_a_zero_length_batch(op):
    kw = dict(q_lens=(3, 0, 4), kv_lens=(4, 2, 4))
    accept(op, base_params(op, **kw))
    expect(op, base_params(op, pse=torch.zeros(3, 2, 4, 4), **kw), ParamInvalidError, "pse")


@pytest.mark.parametrize("op", TND_OPS)
def test_no_pse_with_sparse_mode_7(op):
    kw = dict(atten_mask=TRIU2048, sparse_mode=7, pre_tokens=4, next_tokens=0)
    accept(op, base_params(op, **kw))
    expect(op, base_params(op, pse=torch.zeros(2, 2, 4, 4), **kw), ParamInvalidError, "pse")


@pytest.mark.parametrize("op", ALL_OPS)
def test_drop_mask_size_and_dtype(op):
    numel = 2 * (3 * 4 + 4 * 4) if op in TND_OPS else 2 * 2 * 4 * 5
    accept(op, base_params(op, keep_prob=0.5, drop_mask=pack_bits(torch.ones(numel, dtype=torch.bool))))
    expect(op, base_params(op, keep_prob=0.5, drop_mask=torch.zeros(numel // 8 - 1, dtype=torch.uint8)),
           ParamInvalidError, "drop_mask")
    expect(op, base_params(op, keep_prob=0.5, drop_mask=torch.ones(numel, dtype=torch.bool)), ParamDtypeError,
           "drop_mask")


@pytest.mark.parametrize("op", TND_OPS)
def test_actual_seq_lengths(op):
    expect(op, base_params(op, actual_seq_qlen=None), ParamInvalidError, "actual_seq_qlen")
    expect(op, base_params(op, actual_seq_kvlen=[4]), ParamInvalidError, "actual_seq_kvlen")
    expect(op, base_params(op, actual_seq_qlen=[4, 3]), ParamInvalidError, "actual_seq_qlen")
    expect(op, base_params(op, actual_seq_qlen=[3, 9]), ParamInvalidError, "actual_seq_qlen")  # beyond T = 7
    accept(op, base_params(op, actual_seq_qlen=[3, 7, 0], actual_seq_kvlen=[4, 8, 0]))


def test_validation_happens_before_compute_and_in_both_forms():
    """A rejected call raises in phase 1 and from the direct call alike."""
    for op in ALL_OPS:
        p = base_params(op, head_num=3)
        with pytest.raises(ParamInvalidError, match="^head_num"):
            validate(op, p)
        with pytest.raises(ParamInvalidError, match="^head_num"):
            call(op, p)

