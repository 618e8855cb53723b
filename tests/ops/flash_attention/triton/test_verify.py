"""The Triton verifier's fallback reasons and the dispatch around them: ``auto`` runs the reference (with a one-time
PerformanceWarning saying why), an explicit ``backend="triton"`` raises with the reason."""
import warnings

import pytest
import torch

import attnops
from attnops import ParamInvalidError
from attnops._core.dispatch import choose_backend, triton_unavailable_reason
from attnops.ops.common.problem import build_problem
from attnops.ops.common.triton.verify import unsupported_reason
from attnops.testing import gpu_dry_run
from tests.helpers import TRIU2048, make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(dtype=torch.float32, d=16):
    return [t.to(DEVICE) for t in make_qkv("BNSD", b=1, n1=2, sq=4, skv=4, d=d, dtype=dtype)[:3]]


@pytest.mark.parametrize("dtype,d,reason", [
    (torch.float64, 16, "float16/bfloat16/float32 inputs"),
    (torch.float32, 264, "head dims up to 256"),
] + ([(torch.bfloat16, 16, "interpreter has no bfloat16")] if DEVICE == "cpu" else []))
def test_explicit_triton_raises_with_the_reason(dtype, d, reason):
    q, k, v = _qkv(dtype, d)
    with pytest.raises(ParamInvalidError, match=reason):
        attnops.flash_attention(q, k, v, backend="triton")


def test_auto_on_cpu_runs_the_reference():
    q, k, v = make_qkv("BNSD", b=1, n1=2, sq=4, skv=4, d=264)[:3]
    out = attnops.flash_attention(q, k, v)  # D > 256 and CPU: the reference, no error
    assert out.shape == q.shape


def test_alibi_compressed_pse_is_accepted_forward_and_backward():
    s = 1100  # the compressed [.., 1024, Skv] form needs Sq > 1024
    q, k, v = make_qkv("BNSD", b=1, n1=1, sq=s, skv=s, d=16)[:3]
    kw = dict(head_num=1, layout="BNSD", scale=0.3, pse=torch.zeros(1, 1, 1024, s), pse_type=1,
              atten_mask=TRIU2048, sparse_mode=2)
    p = build_problem(q, k, v, **kw)
    assert unsupported_reason(p, q) is None  # the forward reads the compressed pse in-kernel
    assert unsupported_reason(p, q, backward=True) is None  # the diagonal sums of the dQ kernel's score gradient


def test_device_without_triton_support():
    assert "need a CUDA device" in triton_unavailable_reason(torch.device("meta"))


def test_auto_falls_back_with_a_one_time_performance_warning():
    with pytest.warns(attnops.PerformanceWarning, match="a test reason"):
        assert choose_backend("auto", torch.device("cuda"), lambda: "a test reason") == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: no second warning
        assert choose_backend("auto", torch.device("cuda"), lambda: "a test reason") == "reference"
    with pytest.warns(attnops.PerformanceWarning, match="another reason"):
        choose_backend("auto", torch.device("cuda"), lambda: "another reason")
    assert choose_backend("auto", torch.device("cuda"), lambda: None) == "triton"
    with pytest.raises(ParamInvalidError, match="a test reason"):
        choose_backend("triton", torch.device("cuda"), lambda: "a test reason")


def test_batch_times_heads_beyond_one_grid_axis_is_folded():
    """Batch x heads beyond CUDA's 65535 programs per grid axis folds into axes 1 and 2: accepted, planned."""
    q_lens = [1] * 16384  # 16384 one-token batches x 4 heads
    q = torch.zeros(len(q_lens), 4, 16, device="meta")
    cum = list(range(1, len(q_lens) + 1))
    p = build_problem(q, q, q, head_num=4, layout="TND", scale=0.3, actual_seq_qlen=cum, actual_seq_kvlen=cum)
    with gpu_dry_run() as launches:
        assert unsupported_reason(p, q) is None
        attnops.flash_attention(q.requires_grad_(), q, q, layout="TND", actual_seq_qlen=cum, actual_seq_kvlen=cum,
                                scale=0.3).sum().backward()
    grids = {r.kernel: r.grid for r in launches}
    assert grids["fwd_kernel"][1:] == grids["dkdv_kernel"][1:] == (65535, 2)  # 65536 pairs: 65535 + 1
    # the kernels' fold arithmetic only where it is needed (the grad-sum kernel has no batch x heads axis)
    assert all(r.constexprs["FOLD"] for r in launches if r.kernel != "grad_sum_kernel")
    with gpu_dry_run() as launches:
        attnops.flash_attention(q[:4], q[:4], q[:4], layout="TND", actual_seq_qlen=cum[:4], actual_seq_kvlen=cum[:4],
                                scale=0.3)
    assert [(r.grid[1:], r.constexprs["FOLD"]) for r in launches] == [((16, 1), False)]
