"""An unmodified torch_npu-style script running on attnops through the shim (CPU or CUDA).

    python examples/torch_npu_shim.py

Everything after the two shim lines is written as it would be for an Ascend NPU.
"""
import torch

import attnops.torch_npu

attnops.torch_npu.install()   # only where the real torch_npu is absent

import torch_npu  # noqa: E402  (attnops' torch_npu dialect)


def main() -> None:
    torch.manual_seed(0)
    device = "npu"                                             # the shim maps it to cuda if present, else cpu
    b, s, n, d = 2, 256, 8, 64
    q, k, v = (torch.randn(b, s, n * d, device=device, requires_grad=True) for _ in range(3))   # BSH
    mask = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)                  # compressed causal

    out, softmax_max, softmax_sum, _, seed, offset, numels = torch_npu.npu_fusion_attention(
        q, k, v, n, "BSH", atten_mask=mask, scale=d ** -0.5, sparse_mode=2, keep_prob=1.0)
    out.sum().backward()
    print(f"npu_fusion_attention: out {tuple(out.shape)}, dq {tuple(q.grad.shape)}")

    # inference: a decode step with npu_fused_infer_attention_score (BNSD, GQA)
    query = torch.randn(b, n, 1, d, device=device)
    key = torch.randn(b, 2, s, d, device=device)
    value = torch.randn(b, 2, s, d, device=device)
    attn, lse = torch_npu.npu_fused_infer_attention_score(query, key, value, num_heads=n, num_key_value_heads=2,
                                                          input_layout="BNSD", scale=d ** -0.5)
    print(f"npu_fused_infer_attention_score: out {tuple(attn.shape)}")


if __name__ == "__main__":
    main()
