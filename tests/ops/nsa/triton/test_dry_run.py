"""NSA on the GPU hot path, checked without a GPU: every NSA operator in the three dialects and the layer (forward and
backward) run inside :func:`attnops.testing.gpu_dry_run` on ``meta`` tensors, where launches are recorded and any
host read of a device value, blocking upload or tensor built on the host raises. Each case records at least one
launch and raises nothing, the FlashAttention calls of compressed attention and the window branch included."""
from __future__ import annotations

import pytest
import torch

import attnops
import attnops.torch_npu as tnpu
from attnops import aclnn
from attnops.testing import gpu_dry_run
from tests.ops.nsa.nsa_aclnn_params import OPS, base_params

pytest.importorskip("triton")

META = torch.device("meta")
H = torch.float16
N1, N2, D, DV = 16, 1, 192, 128


def meta(*shape, dtype=H, grad=False):
    return torch.empty(*shape, device=META, dtype=dtype, requires_grad=grad)


def to_meta(params: dict) -> dict:
    return {name: value.to(META) if isinstance(value, torch.Tensor) else value for name, value in params.items()}


def kernels(launches) -> list[str]:
    assert launches, "no launch recorded"
    return [launch.kernel for launch in launches]


# ------------------------------------------------------------------------------------------------ Pythonic API
def test_compress_forward_and_backward():
    x, w = meta(300, 4, D, grad=True), meta(32, 4, grad=True)
    with gpu_dry_run() as launches:
        attnops.nsa_compress(x, w, block_size=32, stride=16, actual_seq_len=[100, 100, 300]).sum().backward()
    assert kernels(launches) == ["compress_fwd_kernel", "compress_dx_kernel", "compress_dw_kernel"]


def test_selected_forward_and_backward_with_inverted_lists():
    q, k, v = meta(70, N1, D, grad=True), meta(768, N2, D, grad=True), meta(768, N2, DV, grad=True)
    topk = meta(70, N2, 4, dtype=torch.int32)
    with gpu_dry_run() as launches:  # an empty batch, varlen
        out = attnops.nsa_selected_attention(q, k, v, topk, select_block_size=64, actual_seq_qlen=[20, 20, 70],
                                             actual_seq_kvlen=[256, 512, 768])
        out.backward(meta(70, N1, DV))
    assert kernels(launches) == ["selected_fwd_kernel", "selected_delta_kernel", "selected_dq_kernel",
                                 "selected_keys_kernel", "selected_dkdv_kernel", "selected_dkdv_reduce_kernel"]


def test_compress_attention_with_top_k_forward_and_backward():
    q, k, v = meta(4096, N1, D, grad=True), meta(262, N2, D, grad=True), meta(262, N2, DV, grad=True)
    mask, forced = meta(2048, 131, dtype=torch.bool), meta(2048, 33, dtype=torch.bool)
    with gpu_dry_run() as launches:
        res = attnops.nsa_compress_attention(q, k, v, compress_block_size=32, compress_stride=16,
                                             select_block_size=64, select_block_count=16, atten_mask=mask,
                                             topk_mask=forced, actual_seq_qlen=[2048, 4096],
                                             actual_cmp_seq_kvlen=[131, 262])
        res.out.backward(meta(4096, N1, DV))
    assert kernels(launches)[:3] == ["fwd_kernel", "importance_kernel", "topk_kernel"]
    assert res.topk_indices.shape == (4096, N2, 16) and res.topk_indices.dtype == torch.int32


def _paged(batch=3, blocks=20, page=64):
    return meta(batch, N1, D), meta(blocks, page, N2, D), meta(blocks, page, N2, DV)


@pytest.mark.parametrize("lengths", ["list", "device"])
def test_selected_attention_infer(lengths):
    q, k, v = _paged()
    table, topk = meta(3, 6, dtype=torch.int32), meta(3, N2, 4, dtype=torch.int32)
    lens = [300, 64, 1] if lengths == "list" else meta(3, dtype=torch.int64)
    with gpu_dry_run() as launches:
        out = attnops.nsa_selected_attention_infer(q, k, v, topk, table, lens, select_block_size=64)
    assert kernels(launches) == ["selected_decode_kernel", "decode_merge_kernel"] and out.shape == (3, N1, DV)


@pytest.mark.parametrize("lengths", ["list", "device"])
def test_compress_attention_infer(lengths):
    q, k, v = _paged()
    table = meta(3, 6, dtype=torch.int32)
    lens = [300, 64, 40] if lengths == "list" else meta(3, dtype=torch.int64)
    with gpu_dry_run() as launches:
        out, topk = attnops.nsa_compress_attention_infer(q, k, v, table, lens, compress_block_size=32,
                                                         compress_stride=16, select_block_size=64,
                                                         select_block_count=5)
    assert kernels(launches) == ["compress_decode_kernel", "compress_decode_score_kernel", "topk_kernel"]
    assert topk.shape == (3, N2, 5)


# ----------------------------------------------------------------------------------------------------- aclnn
@pytest.mark.parametrize("two_phase", [False, True], ids=["direct", "two-phase"])
@pytest.mark.parametrize("op", OPS)
def test_aclnn(op, two_phase):
    params = to_meta(base_params(op, **({"forward": False} if op == "nsa_selected_attention_grad" else {})))
    run, get_workspace_size = OPS[op]
    with gpu_dry_run() as launches:
        if two_phase:
            _, executor = get_workspace_size(*params.values())
            run(None, 0, executor, None)
        else:
            run(*params.values())
    assert kernels(launches)


# ------------------------------------------------------------------------------------------------- torch_npu
def test_torch_npu_compress_and_grad():
    x, w = meta(300, 4, D), meta(32, 4)
    with gpu_dry_run() as launches:
        out = tnpu.npu_nsa_compress(x, w, 32, 16, actual_seq_len=[100, 300])
        tnpu.npu_nsa_compress_grad(torch.empty_like(out), x, w, 32, 16, actual_seq_len=[100, 300])
    assert kernels(launches) == ["compress_fwd_kernel", "compress_dx_kernel", "compress_dw_kernel"]


def test_torch_npu_select_attention_and_grad():
    q, k, v = meta(70, N1, D), meta(256, N2, D), meta(256, N2, DV)
    topk, mask = meta(70, N2, 4, dtype=torch.int32), meta(2048, 2048, dtype=torch.bool)
    kw = dict(atten_mask=mask, actual_seq_qlen=[20, 70], actual_seq_kvlen=[128, 256])
    with gpu_dry_run() as launches:
        out, smax, ssum = tnpu.npu_nsa_select_attention(q, k, v, topk, D ** -0.5, N1, 32, 4, **kw)
        tnpu.npu_nsa_select_attention_grad(torch.empty_like(out), q, k, v, out, smax, ssum, topk, D ** -0.5, N1, 32,
                                           4, **kw)
    assert "selected_dkdv_kernel" in kernels(launches)


def test_torch_npu_compress_attention():
    q, k, v = meta(96, N1, D), meta(20, N2, D), meta(20, N2, DV)
    with gpu_dry_run() as launches:
        tnpu.npu_nsa_compress_attention(q, k, v, D ** -0.5, N1, 32, 16, 64, 2,
                                        atten_mask=meta(64, 12, dtype=torch.bool),
                                        topk_mask=meta(64, 5, dtype=torch.bool), actual_seq_qlen=[32, 96],
                                        actual_cmp_seq_kvlen=[8, 20], actual_sel_seq_kvlen=[2, 5])
    assert "topk_kernel" in kernels(launches)


@pytest.mark.parametrize("lengths", ["list", "device"])
def test_torch_npu_decode_ops(lengths):
    q, k, v = _paged()
    table = meta(3, 6, dtype=torch.int32)
    kv_lens = [300, 64, 200] if lengths == "list" else meta(3, dtype=torch.int64)
    with gpu_dry_run() as launches:
        tnpu.npu_nsa_select_attention_infer(q, k, v, meta(3, N2, 2, dtype=torch.int32), D ** -0.5, N1, N2, 64, 2, 64,
                                            layout="TND", block_table=table, actual_seq_kvlen=kv_lens)
        tnpu.npu_nsa_compress_attention_infer(q, k, v, D ** -0.5, N1, N2, 64, 3, 64, 32, 16, block_table=table,
                                              actual_cmp_seq_kvlen=kv_lens)
    assert kernels(launches) == ["selected_decode_kernel", "decode_merge_kernel", "compress_decode_kernel",
                                 "compress_decode_score_kernel", "topk_kernel"]


@pytest.mark.parametrize("lengths", ["list", "device"])
def test_torch_npu_compress_infer_reads_nothing_back(lengths):
    kv, w, cache = meta(12, 16, N2, D), meta(32, N2), meta(6, N2, D)
    lens = [48, 40, 32, 56] if lengths == "list" else meta(4, dtype=torch.int64)
    with gpu_dry_run() as launches:
        out = tnpu.npu_nsa_compress_infer(kv, w, meta(4, dtype=torch.int64), 32, 8, 16,
                                          block_table=meta(4, 4, dtype=torch.int32), actual_seq_len=lens, cache=cache)
    assert out is cache and kernels(launches) == ["compress_cache_kernel"]


# ----------------------------------------------------------------------------------------------------- layer
GATES = {"all": (0, 1, 2), "compress": (0,), "window": (2,), "compress+select": (0, 1), "select+window": (1, 2)}


def _layer_inputs(layout: str):
    shape = (4096,) if layout == "TND" else (2, 2048)
    return (meta(*shape, N1, D, grad=True), meta(*shape, N2, D, grad=True), meta(*shape, N2, DV, grad=True),
            meta(*shape, N1, grad=True), shape)


def _layer(layout, gates, compress, block_indices):
    q, k, v, g, shape = _layer_inputs(layout)
    kw = dict(cu_seqlens=[0, 2048, 4096]) if layout == "TND" else dict(layout="BSND")
    kw.update({name: g for i, name in enumerate(("g_cmp", "g_slc", "g_swa")) if i in GATES[gates]})
    if compress == "weighted":
        kw.update(compress_weight_k=meta(32, N2, grad=True), compress_weight_v=meta(32, N2, grad=True))
    if block_indices:
        kw.update(block_indices=meta(*shape, N2, 16, dtype=torch.int32), block_counts=meta(*shape, N2,
                                                                                             dtype=torch.int64))
    with gpu_dry_run() as launches:
        out = attnops.native_sparse_attention(q, k, v, compress=compress, **kw)
        out.backward(torch.empty_like(out))
    assert out.shape == (*shape, N1, DV)
    return kernels(launches)


@pytest.mark.parametrize("block_indices", [False, True], ids=["top-k", "given"])
@pytest.mark.parametrize("compress", ["weighted", "mean"])
@pytest.mark.parametrize("layout", ["TND", "BSND"])
def test_layer_forward_and_backward(layout, compress, block_indices):
    launched = _layer(layout, "all", compress, block_indices)
    assert "selected_dkdv_kernel" in launched and "compress_dw_kernel" in launched


@pytest.mark.parametrize("gates", [name for name in GATES if name not in ("all", "select")])
def test_layer_branch_combinations(gates):
    launched = _layer("TND", gates, "weighted", False)
    assert ("selected_fwd_kernel" in launched) == (1 in GATES[gates])


def test_layer_selection_alone_needs_no_flash_attention():
    """The selection branch alone with given block indices: no FlashAttention launch."""
    q, k, v, g, shape = _layer_inputs("TND")
    with gpu_dry_run() as launches:
        out = attnops.native_sparse_attention(q, k, v, g_slc=g, cu_seqlens=[0, 1000, 4096], window_size=0,
                                              block_indices=meta(4096, N2, 16, dtype=torch.int64))
        out.backward(torch.empty_like(out))
    assert kernels(launches)[0] == "selected_fwd_kernel" and {launch.family for launch in launches} == {"nsa"}
