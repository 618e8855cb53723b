"""attnops operators under torch.compile(fullgraph=True): forward and backward, checked against eager (CPU).

    python examples/compile.py
"""
import torch

import attnops


def attention(q, k, v):
    return attnops.flash_attention(q, k, v, causal=True)


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 128, 64, requires_grad=True) for _ in range(3))
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")

    out = compiled(q, k, v)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    ref = attention(q, k, v)
    ref.sum().backward()
    err = max([(out - ref).abs().max().item()] + [(g - t.grad).abs().max().item() for g, t in zip(grads, (q, k, v))])
    print(f"compiled vs eager: max difference {err:.2e}")
    assert err == 0.0


if __name__ == "__main__":
    main()
