"""The shim as Ascend callers use it with the default ``install()``: the torch.npu stand-in as MindSpeed and
vllm-ascend touch it at import, in graph capture and when they build masks on ``torch.npu.current_device()``;
``torch_npu.contrib.transfer_to_npu``; ``"npu"`` devices and ``pin_memory`` in sglang's, MindSpeed's and
vllm-ascend's own code; the opt-outs and ``unpatch``. Each script runs in a fresh interpreter (the shim changes
global state)."""
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
y = torch.zeros(2, device="npu").to("npu:0").to(device=torch.device("npu", 0))
z = x.new_zeros(2, device=torch.device("npu")) + torch.ones(2, device="npu:0", dtype=torch.int32)
m = torch.nn.Linear(2, 2).npu().to("npu")
assert x.device == y.device == z.device == next(m.parameters()).device == torch.npu.device and x.is_npu
p = torch.empty(4, pin_memory=True).pin_memory()
compiled = torch.compile(lambda t: t + torch.tensor([1.0, 0.0], device="npu") + torch.zeros(2, device="npu:0"),
                         fullgraph=True)             # torch.compile still traces and compiles with "npu" named
assert torch.equal(compiled(torch.ones(2, device=torch.device("npu"))), torch.tensor([2.0, 1.0]))
with torch.random.fork_rng():                       # "npu" is PyTorch's accelerator now, as with torch_npu
    torch.randn(2)
import warnings
with warnings.catch_warnings():
    warnings.simplefilter("error")                 # torch.manual_seed seeds the named npu device without a warning
    torch.manual_seed(3)
    drawn = torch.randn(2)
    torch.npu.manual_seed(3)
    assert torch.equal(drawn, torch.randn(2))
print("ok")
"""

OPTED_OUT = """
for make in (lambda: torch.zeros(2, device="npu"), lambda: torch.zeros(2).pin_memory(),
             lambda: torch.empty(2, pin_memory=True)):
    try:
        make()
    except RuntimeError:
        continue
    raise AssertionError("patched although opted out")
print("ok")
"""

UNPATCH = """
from attnops.torch_npu import tensor_patch
tensor_patch.unpatch()
plain = {name: getattr(torch, name) for name in tensor_patch.FACTORIES}
assert all(getattr(f, "__module__", "") != "attnops.torch_npu.tensor_patch" for f in plain.values())
for owner, names in ((torch.Tensor, tensor_patch.TENSOR_NEW + ("to", "pin_memory", "npu", "is_npu")),
                     (torch.nn.Module, ("to", "npu"))):
    for name in names:
        value = owner.__dict__.get(name)
        assert value is None or getattr(value, "__module__", "") != "attnops.torch_npu.tensor_patch", name
assert "to" not in torch.Tensor.__dict__ and not hasattr(torch.Tensor, "npu")
try:
    torch.zeros(2, device="npu")
except RuntimeError:
    print("ok")
"""

SGLANG_BACKEND = """
# sglang's Ascend backend: device "npu" from the server args; masks built on the host and moved with .to(device);
# graph buffers allocated on the device; paged decode through torch.ops.npu.npu_fused_infer_attention_score (BSH)
N, KVN, D, PAGE = 4, 2, 16, 4

class ModelRunner:
    device, page_size, dtype = "npu", PAGE, torch.float32

class MaskBuilder:
    def __init__(self, model_runner, device):
        self.device = device
        flag = ~torch.ones((2048, 2048), dtype=torch.bool).tril_()
        self.fia_mask = flag.to(self.device)
        self.mask = torch.zeros(size=(128, 128)).masked_fill_(flag[:128, :128], 1).to(model_runner.dtype).to(device)

class Backend:
    def __init__(self, model_runner):
        self.device = model_runner.device
        self.page_size = model_runner.page_size
        self.mask_builder = MaskBuilder(model_runner, self.device)
        self.block_tables = torch.empty((2, 4), dtype=torch.int32, device=self.device)

    def forward_decode(self, q, k_cache, v_cache, seq_lens):
        return torch.ops.npu.npu_fused_infer_attention_score(
            q.view(q.shape[0], 1, -1), k_cache.view(-1, self.page_size, KVN * D),
            v_cache.view(-1, self.page_size, KVN * D), num_heads=N, num_key_value_heads=KVN, input_layout="BSH",
            atten_mask=None, block_size=self.page_size, block_table=self.block_tables,
            actual_seq_lengths_kv=seq_lens, scale=D ** -0.5)[0]

backend = Backend(ModelRunner())
assert backend.mask_builder.fia_mask.device == backend.mask_builder.mask.device == torch.npu.device
backend.block_tables.copy_(torch.tensor([[3, 0, 5, 1], [2, 7, 4, 6]], dtype=torch.int32, device="npu"))
k_cache = torch.randn(8, PAGE, KVN, D, device=ModelRunner.device)
v_cache = torch.randn(8, PAGE, KVN, D, device=ModelRunner.device)
q = torch.randn(2, N, D).to(ModelRunner.device)
lens = [7, 13]
out = backend.forward_decode(q, k_cache, v_cache, lens)
for b, n in enumerate(lens):
    k = k_cache[backend.block_tables[b].long()].flatten(0, 1)[:n][None]
    v = v_cache[backend.block_tables[b].long()].flatten(0, 1)[:n][None]
    gold = fa_forward(q[b][None, None], k, v, head_num=N, input_layout="BSND", scale=D ** -0.5)[0]
    assert (out[b].view(1, 1, N, D).double() - gold).abs().max() < 1e-5
print("ok")
"""

MINDSPEED_ALIBI = """
# MindSpeed's ALiBi and attention-mask helpers: slopes and bias built on the host, moved with .npu(); the causal
# mask built directly on device "npu"; the model moved with Module.npu()
import math
N, S, D = 4, 32, 16

def get_slopes(n):
    start = 2 ** (-2 ** -(math.log2(n) - 3))
    return [start * start ** i for i in range(n)]

def build_alibi(max_seq_len, num_heads):
    slopes = torch.Tensor(get_slopes(num_heads))
    position = torch.arange(max_seq_len) - max_seq_len + 1
    position = position.unsqueeze(0).unsqueeze(0).expand(num_heads, max_seq_len, -1)
    diag = torch.diag(position[0])
    return slopes.unsqueeze(1).unsqueeze(1) * (position - diag.unsqueeze(0).unsqueeze(0).transpose(-1, -2))

attention_mask = torch.triu(torch.ones([S, S], dtype=torch.bool, device="npu"), diagonal=1)
alibi = build_alibi(S, N).npu()
proj = torch.nn.Linear(D, D).npu()
with torch.no_grad():
    q, k, v = (proj(torch.randn(1, N, S, D, device=torch.device("npu"))) for _ in range(3))
pse = alibi.unsqueeze(0).contiguous()
out = torch_npu.npu_fusion_attention(q, k, v, N, "BNSD", pse=pse, atten_mask=attention_mask, scale=D ** -0.5,
                                     pre_tockens=65536, next_tockens=0)[0]
gold = fa_forward(q, k, v, head_num=N, input_layout="BNSD", pse=pse, atten_mask=attention_mask, scale=D ** -0.5)[0]
assert (out.double() - gold).abs().max() < 1e-5
print("ok")
"""

VLLM_METADATA = """
# vllm-ascend's metadata builder: host staging buffers with pin_memory=True, .pin_memory() then a non-blocking copy
# to the device; cache write with _npu_reshape_and_cache and decode with _npu_paged_attention
N, KVN, D, BLOCK = 4, 2, 16, 4
device = torch.device(f"npu:{torch.npu.current_device()}")

class MetadataBuilder:
    def __init__(self, max_reqs, max_blocks):
        self.seq_lens_cpu = torch.zeros(max_reqs, dtype=torch.int32, device="cpu", pin_memory=True)
        self.block_table_cpu = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device="cpu", pin_memory=True)

    def build(self, seq_lens, block_table):
        n = len(seq_lens)
        self.seq_lens_cpu[:n].copy_(torch.from_numpy(np.array(seq_lens, dtype=np.int32)))
        self.block_table_cpu[:n].copy_(torch.from_numpy(np.array(block_table, dtype=np.int32)))
        slots = torch.from_numpy(np.array([block_table[b][p // BLOCK] * BLOCK + p % BLOCK
                                           for b, length in enumerate(seq_lens) for p in range(length)],
                                          dtype=np.int32)).pin_memory()
        return (self.seq_lens_cpu[:n], self.block_table_cpu[:n].to(device, non_blocking=True),
                slots.to(device, non_blocking=True))

seq_lens, table = [6, 3], [[2, 5], [0, 7]]
seq_lens_cpu, block_table, slots = MetadataBuilder(4, 2).build(seq_lens, table)
key_cache = torch.zeros(8, BLOCK, KVN, D, device=device)
value_cache = torch.zeros(8, BLOCK, KVN, D, device=device)
keys, values = torch.randn(sum(seq_lens), KVN, D, device="npu"), torch.randn(sum(seq_lens), KVN, D, device="npu")
torch_npu._npu_reshape_and_cache(keys, values, key_cache, value_cache, slots)
query = torch.randn(2, N, D, device=device)
out = torch.empty_like(query)
torch_npu._npu_paged_attention(query, key_cache, value_cache, KVN, N, D ** -0.5, block_table, seq_lens_cpu, out)
start = 0
for b, n in enumerate(seq_lens):
    k, v = keys[start:start + n][None], values[start:start + n][None]
    gold = fa_forward(query[b][None, None], k, v, head_num=N, input_layout="BSND", scale=D ** -0.5)[0]
    assert (out[b].view(1, 1, N, D).double() - gold).abs().max() < 1e-5
    start += n
print("ok")
"""

NPU_PICKLED_FILES = """
import pathlib, sys, tempfile
from tests.msprobe.npu_dump import save_npu_tensor
x = torch.randn(3, 5).half()
file = pathlib.Path(tempfile.mkdtemp()) / "x.pt"
save_npu_tensor(x, file)                  # as torch_npu pickles a tensor on an NPU
assert sys.modules["torch_npu"] is attnops.torch_npu
torch.serialization.add_safe_globals([torch_npu.utils.storage._rebuild_npu_tensor])  # msprobe does this at import
assert torch.equal(torch.load(file, weights_only=True), x) and torch.equal(torch.load(file, weights_only=False), x)
assert torch_npu.npu._format.Format.__module__ == "torch_npu.npu._format"
print("ok")
"""


def _run(body: str, args: str = "") -> None:
    script = IMPORTS.format(args=args) + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_npu_pickled_tensor_files_load_under_the_shim():
    _run(NPU_PICKLED_FILES, 'device="cpu"')


def test_mindspeed_mask_on_current_device_and_numpy_lengths():
    _run(MINDSPEED_MASK, 'device="cpu"')


def test_graph_capture_names_and_events():
    _run(GRAPH_CAPTURE, 'device="cpu"')


def test_default_install_maps_npu_devices_and_ignores_pinning():
    _run(PATCH_TENSOR_NPU)


def test_patches_are_opt_out():
    _run(OPTED_OUT, "patch_tensor_npu=False, patch_pin_memory=False")


def test_unpatch_restores_pytorch():
    _run(UNPATCH)


def test_sglang_backend_constructor_on_device_npu():
    _run(SGLANG_BACKEND)


def test_mindspeed_alibi_and_mask_helpers_on_npu():
    _run(MINDSPEED_ALIBI)


def test_vllm_ascend_metadata_builder_pins_memory():
    _run(VLLM_METADATA)
