"""torch_npu's graph-friendly ``npu_fusion_attention_v3`` / ``_grad_v3`` with the cumulative lengths as CUDA tensors
(read by the kernels) give what host lists give."""
import torch

from attnops import torch_npu as tnpu

TRIU = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _run(lengths):
    g = torch.Generator(device="cpu").manual_seed(4)
    q, k, v, dy = (torch.randn(300, 4, 64, generator=g).to("cuda", torch.float16) for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    lens = dict(actual_seq_qlen=lengths, actual_seq_kvlen=lengths)
    out, *_ = tnpu.npu_fusion_attention_v3(*leaves, 4, "TND", atten_mask=TRIU.cuda(), scale=0.125, sparse_mode=3,
                                           **lens)
    out.backward(dy)
    return [out.detach(), *(x.grad for x in leaves)]


def test_device_lengths_equal_host_lists():
    host = _run([120, 300])
    device = _run(torch.tensor([120, 300], dtype=torch.int64, device="cuda"))
    for a, b in zip(device, host):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
