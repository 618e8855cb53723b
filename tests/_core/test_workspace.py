"""The CPU references' per-thread workspaces outlive the call that made them, in or out of inference mode."""
import torch

from attnops._core.workspace import Buffers


def test_buffers_made_in_inference_mode_serve_later_calls():
    buf = Buffers(torch.float32, "cpu")
    with torch.inference_mode():  # e.g. a decoding step under torch.inference_mode()
        buf.get("x", 4, 4).fill_(1.0)
    buf.get("x", 4, 4).fill_(2.0)  # a later training call writes the same buffer in place
    buf.get("x", 2, 8).add_(1.0)
    assert torch.equal(buf.get("x", 16), torch.full((16,), 3.0))
    with torch.inference_mode():
        buf.get("x", 4, 4).mul_(2.0)
    assert torch.equal(buf.get("x", 16), torch.full((16,), 6.0))


def test_drop_cached_workspaces_frees_every_threads_buffers():
    import threading

    from attnops._core.workspace import drop_cached_workspaces

    held = []
    worker = threading.Thread(target=lambda: held.append(Buffers.acquire(torch.float64, "cpu")))
    worker.start()
    worker.join()
    held[0].get("x", 64, 64).fill_(1.0)
    mine = Buffers.acquire(torch.float64, "cpu")
    mine.get("y", 8).fill_(1.0)
    drop_cached_workspaces()
    assert not held[0]._bufs and not mine._bufs
    assert mine.get("y", 8).shape == (8,)  # allocated again on demand
