"""One training step of a tiny causal self-attention block with attnops.flash_attention (CPU, seconds).

    python examples/training_step.py

The attention is checked against torch.nn.functional.scaled_dot_product_attention on the same inputs.
"""
import torch
import torch.nn.functional as F

import attnops


class SelfAttention(torch.nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)   # [B, S, N, D] each
        o = attnops.flash_attention(q, k, v, layout="BSND", causal=True)
        return self.out(o.reshape(b, s, h))


def main() -> None:
    torch.manual_seed(0)
    model = SelfAttention(hidden=256, heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, target = torch.randn(2, 128, 256), torch.randn(2, 128, 256)

    for step in range(3):
        loss = F.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")

    q, k, v = (torch.randn(2, 4, 128, 64) for _ in range(3))            # BNSD
    err = (attnops.flash_attention(q, k, v, causal=True)
           - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max().item()
    print(f"max |attnops - SDPA| = {err:.2e}")
    assert err < 1e-5


if __name__ == "__main__":
    main()
