"""The shim's torch.npu stand-in as MindSpeed and vllm-ascend touch it at import, in graph capture and when they
build masks on ``torch.npu.current_device()``; ``torch_npu.contrib.transfer_to_npu``; the opt-in
``patch_tensor_npu``. Each script runs in a fresh interpreter (the shim changes global state)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

IMPORTS = """
import numpy as np
import torch
import attnops.torch_npu
assert attnops.torch_npu.install({args})
import torch_npu
from attnops.testing.golden import fa_forward
"""

MINDSPEED_MASK = """
import torch_npu.contrib.transfer_to_npu  # MindSpeed's entry point imports it
device = torch.npu.current_device()
assert device == 0 and int(device) == 0 and f"npu:{device}" == "npu:0"
torch.npu.set_device(device)
mask = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)      # MindSpeed's causal mask
q, k, v = (torch.randn(1, 2, 64, 16, device=torch.npu.current_device()) for _ in range(3))
out = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=mask, scale=0.25, sparse_mode=2,
                                     actual_seq_qlen=np.array([64]), actual_seq_kvlen=np.array([64]))[0]
gold = fa_forward(q, k, v, head_num=2, input_layout="BNSD", atten_mask=mask, sparse_mode=2, scale=0.25)[0]
assert (out.double() - gold).abs().max() < 1e-5
print("ok")
"""

GRAPH_CAPTURE = """
class Metadata:                          # vllm-ascend annotates torch.npu classes in class bodies
    event: torch.npu.Event
    external: torch.npu.ExternalEvent
    stream: torch.npu.Stream

stream = torch.npu.Stream()
start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
start.record()
with torch.npu.stream(stream):
    torch.npu.graph_task_group_begin(stream)
    x = torch.ones(4, device=torch.npu.current_device()) * 2
    handle = torch.npu.graph_task_group_end(stream)
torch.npu.current_stream().wait_stream(stream)
torch.npu.graph_task_update_begin(stream, handle)
torch.npu.graph_task_update_end(stream)
end.record()
end.synchronize()
assert start.elapsed_time(end) >= 0 and start.query() and torch.npu.default_stream() is not None
ext = torch.npu.ExternalEvent()
ext.record(stream)
ext.wait(stream)
ext.reset(stream)
assert float(x.sum()) == 8.0
print("ok")
"""

PATCH_TENSOR_NPU = """
x = torch.randn(3).npu()
y = torch.zeros(2, device="npu").to("npu:0")
assert x.device == torch.npu.device and y.device == torch.npu.device and x.is_npu
print("ok")
"""

NO_PATCH = """
try:
    torch.zeros(2, device="npu")
except RuntimeError:
    print("ok")
"""


def _run(body: str, args: str = "") -> None:
    script = IMPORTS.format(args=args) + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_mindspeed_mask_on_current_device_and_numpy_lengths():
    _run(MINDSPEED_MASK, 'device="cpu"')


def test_graph_capture_names_and_events():
    _run(GRAPH_CAPTURE, 'device="cpu"')


def test_patch_tensor_npu_is_opt_in():
    _run(PATCH_TENSOR_NPU, 'device="cpu", patch_tensor_npu=True')
    _run(NO_PATCH, 'device="cpu"')
