"""Lengths as device tensors (``cu_seqlens`` never read on the host): the prepare kernel's metadata equals the one the
host builds from the same lengths, and outputs and gradients equal the host-length path's bit for bit (the golden
judges that path in test_kernels.py), every element written (outputs allocated uninitialised); invalid lengths are
clamped into the tensors. Plus the batch x heads grid fold, judged against the golden on a small fold."""
import pytest
import torch

from attnops._core.dropout import pack_bits
from attnops.ops.common.problem import build_problem
from attnops.ops.common.triton import common, launch
from attnops._core.triton.launch import KernelFamily
from attnops.ops.common.triton import launch_args
from attnops.ops.common.triton.autotune import KERNELS
from tests.helpers import PREFIX3072, TRIU2048, check_fa, cum, make_qkv, random_keep, randn

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp2(-inf) in numpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Q_LENS, KV_LENS = [17, 0, 1, 9, 30], [20, 5, 3, 0, 30]  # empty query / KV batches, one token, Sq > Skv
EQUAL_LENS = [19, 7, 30]  # pse of every kind needs queries in every batch (and Sq == Skv for ALiBi)
COL = {name: i for i, name in enumerate(common.META_FIELDS)}


def _on(*tensors):
    return [t.to(DEVICE) for t in tensors]


def _mask(rows, cols, seed):
    return random_keep(rows * cols, 0.3, seed=seed).reshape(rows, cols)


# name: (query lengths, KV lengths, problem keywords)
CASES = {
    "causal": (Q_LENS, KV_LENS, dict(atten_mask=TRIU2048, sparse_mode=3)),
    "band": (Q_LENS, KV_LENS, dict(atten_mask=TRIU2048, sparse_mode=4, pre_tokens=5, next_tokens=2)),
    "left_top_causal": (Q_LENS, KV_LENS, dict(atten_mask=TRIU2048, sparse_mode=2, softmax_layout="TND")),
    "explicit_tokens": (Q_LENS, KV_LENS, dict(atten_mask=_mask(30, 31, 1), sparse_mode=0, pre_tokens=6,
                                              next_tokens=3)),
    "explicit": (Q_LENS, KV_LENS, dict(atten_mask=_mask(30, 30, 2), sparse_mode=1)),
    "prefix": (Q_LENS, KV_LENS, dict(atten_mask=PREFIX3072, sparse_mode=6, prefix=[10, 5, 2, 0, 12])),
    "split_last": (Q_LENS, KV_LENS, dict(atten_mask=TRIU2048, sparse_mode=7, pre_tokens=4, next_tokens=1)),
    "split_first": (Q_LENS, KV_LENS, dict(atten_mask=TRIU2048, sparse_mode=8, pre_tokens=4, next_tokens=1)),
    "dropout_seed": (Q_LENS, KV_LENS, dict(keep_prob=0.7, seed=2 ** 40 + 7, offset=11)),
    "dropout_mask": (Q_LENS, KV_LENS, dict(keep_prob=0.7, drop_mask=pack_bits(random_keep(2 * 1340, 0.7, seed=3)))),
    "slopes": (EQUAL_LENS, EQUAL_LENS, dict(pse=torch.rand(3, 2), pse_type=2, q_start_idx=3, kv_start_idx=1)),
    "slopes_bottom_right": ([19, 7, 30], [21, 9, 30], dict(pse=torch.rand(2), pse_type=2, pse_bottom_right=True,
                                                            q_start_idx=1, kv_start_idx=2)),
    "softcap": (Q_LENS, KV_LENS, dict(softcap=2.0, atten_mask=TRIU2048, sparse_mode=3)),
    "slopes_split_first": ([19, 7, 30], [21, 7, 30], dict(pse=torch.rand(2), pse_type=3, q_start_idx=2,
                                                           kv_start_idx=0, atten_mask=TRIU2048, sparse_mode=8)),
    "pse_full": (EQUAL_LENS, [20, 9, 31], dict(pse=randn(1, 2, 30, 31, seed=4), pse_type=1)),
    "pse_row": (EQUAL_LENS, [20, 9, 31], dict(pse=randn(3, 2, 1, 31, seed=5), pse_type=0)),
    "alibi": (EQUAL_LENS, EQUAL_LENS, dict(pse=randn(1, 2, 1024, 32, seed=6), atten_mask=TRIU2048, sparse_mode=3)),
}


def _problems(q_lens, kv_lens, kw, t_extra=3, dtype=torch.float32):
    q, k, v, dy = _on(*make_qkv("TND", n1=2, n2=1, d=16, dv=8, q_lens=q_lens, kv_lens=kv_lens, t_extra=t_extra,
                                dtype=dtype, seed=7))
    kw = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in kw.items()}
    if kw.get("pse_type", 1) in (0, 1) and "pse" in kw:  # a bias in the inputs' dtype (ALiBi slopes stay fp32)
        kw["pse"] = kw["pse"].to(dtype)
    common_kw = dict(head_num=2, layout="TND", scale=0.3, **kw)
    host = build_problem(q, k, v, actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens), **common_kw)
    cu_q = torch.tensor([0] + cum(q_lens), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + cum(kv_lens), dtype=torch.int64, device=DEVICE)
    device = build_problem(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **common_kw)
    return host, device, (q, k, v, dy)


def _device_meta(p, device):
    meta, launches = launch_args.device_metadata(p, torch.device(device))
    KERNELS.run_all(launches, torch.device(device))
    return meta


@pytest.mark.parametrize("case", list(CASES))
def test_prepare_kernel_builds_the_host_metadata(case, triton_backend):
    q_lens, kv_lens, kw = CASES[case]
    host, device, (q, *_) = _problems(q_lens, kv_lens, kw)
    expected = launch_args.batch_meta(host, q.device).cpu()
    got = _device_meta(device, DEVICE).cpu()
    if host.dropout is None:  # the host leaves the dropout offsets 0 when nothing reads them
        got[:, COL["drop_off"]] = 0
    assert torch.equal(got[:-1], expected), (got, expected)
    ends = torch.zeros(12, dtype=torch.int64)
    ends[COL["q_start"]], ends[COL["kv_start"]] = sum(q_lens), sum(kv_lens)
    assert torch.equal(got[-1], ends)  # the row the tail fills read


def test_prepare_kernel_steps_through_many_batches(triton_backend):
    """More batches than one step of the prepare kernel (16 in the interpreter): the dropout offsets, the statistics
    offsets and the last batch with queries (sparse_mode 7) carry across the steps."""
    g = torch.Generator().manual_seed(8)
    q_lens = torch.randint(0, 4, (45,), generator=g).tolist()
    kv_lens = torch.randint(0, 4, (45,), generator=g).tolist()
    q_lens[40:] = [0] * 5  # the last batch with queries is in the third step
    kw = dict(atten_mask=TRIU2048, sparse_mode=7, pre_tokens=1, next_tokens=0, keep_prob=0.5, seed=3)
    host, device, (q, *_) = _problems(q_lens, kv_lens, kw)
    assert torch.equal(_device_meta(device, DEVICE).cpu()[:-1], launch_args.batch_meta(host, q.device).cpu())


def _poisoned_empty(monkeypatch):
    """``torch.empty`` returning NaN (or -7) filled tensors: an element a plan leaves unwritten shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("case", ["causal", "explicit_tokens", "prefix", "split_first", "dropout_mask",
                                  "slopes_split_first", "slopes_bottom_right", "softcap", "pse_full", "alibi"])
def test_forward_and_backward_equal_the_host_lengths(case, triton_backend, monkeypatch):
    q_lens, kv_lens, kw = CASES[case]
    host, device, (q, k, v, dy) = _problems(q_lens, kv_lens, kw, dtype=torch.float16)
    expected = launch.forward(host, q, k, v)
    expected_grads = launch.backward(host, q, k, v, dy, *expected)
    _poisoned_empty(monkeypatch)
    got = launch.forward(device, q, k, v)
    grads = launch.backward(device, q, k, v, dy, *got)
    monkeypatch.undo()
    for name, a, b in zip(("out", "softmax_max", "softmax_sum", "dq", "dk", "dv", "dpse"), (*got, *grads),
                          (*expected, *expected_grads)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    tail = sum(q_lens)
    assert bool((got[0][tail:] == 0).all()) and bool((grads[0][tail:] == 0).all())
    assert bool((grads[1][sum(kv_lens):] == 0).all()) and bool((grads[2][sum(kv_lens):] == 0).all())


def test_invalid_lengths_are_clamped_into_the_tensors(triton_backend):
    """Values the host never checks (out of order, negative, past T, longer than max_seqlen) become sequences
    inside the packed tensors and within the bounds, so the kernels address nothing outside them."""
    q, k, v, dy = _on(*make_qkv("TND", n1=2, d=16, q_lens=[10, 10], kv_lens=[12, 12], seed=9))  # T = 20 / 24
    cu_q = torch.tensor([0, 25, -3, 14, 40], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([5, 2, 9, 30, 30], dtype=torch.int64, device=DEVICE)
    p = build_problem(q, k, v, head_num=2, layout="TND", scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                      max_seqlen_q=8, max_seqlen_k=16, atten_mask=TRIU2048, sparse_mode=3)
    meta = _device_meta(p, DEVICE).cpu()[:-1]
    qs, ks = meta[:, COL["q_start"]], meta[:, COL["kv_start"]]
    sq, skv = meta[:, COL["q_len"]], meta[:, COL["kv_len"]]
    assert bool(((qs >= 0) & (qs + sq <= 20) & (sq >= 0) & (sq <= 8)).all())
    assert bool(((ks >= 0) & (ks + skv <= 24) & (skv >= 0) & (skv <= 16)).all())
    out, smax, ssum = launch.forward(p, q, k, v)  # rows no clamped sequence covers are undefined, not an error
    launch.backward(p, q, k, v, dy, out, smax, ssum)


@pytest.mark.parametrize("layout,b,n1,n2,q_lens,folds", [("BNSD", 2, 4, 2, None, 3),
                                                          ("TND", 5, 2, 1, [7, 0, 3, 18, 1], 4)])
def test_batch_times_heads_fold_into_two_grid_axes(layout, b, n1, n2, q_lens, folds, triton_backend,
                                                   monkeypatch):
    """With at most 3 programs per grid axis, the batch x head pairs fold into axes 1 and 2 (programs past the last
    pair return at once): every output and gradient still equals the golden's."""
    monkeypatch.setattr(launch, "MAX_GRID_Y", 3)
    grids = {}
    run = KernelFamily.run

    def recording(self, launch_, device):
        grids[launch_.kernel] = launch_.grid[1:]
        return run(self, launch_, device)

    monkeypatch.setattr(KernelFamily, "run", recording)
    kw = dict(layout=layout, head_num=n1, scale=0.3, atten_mask=TRIU2048.to(DEVICE), sparse_mode=3)
    if layout == "TND":
        q, k, v, dy = make_qkv("TND", n1=n1, n2=n2, d=16, q_lens=q_lens, kv_lens=q_lens, seed=10)
        kw.update(actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(q_lens))
    else:
        q, k, v, dy = make_qkv(layout, b=b, n1=n1, n2=n2, sq=19, skv=19, d=16, seed=10)
    check_fa(*_on(q, k, v, dy), backend="triton", **kw)
    assert grids == {"fwd_kernel": (3, folds), "preprocess_kernel": (3, folds), "dkdv_kernel": (3, folds),
                     "grad_sum_kernel": ()}  # the dK/dV pass runs over the query heads too
