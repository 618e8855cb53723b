"""DSA on the GPU hot path, checked without a GPU: the operators and the kernels' launchers run inside
:func:`attnops.testing.gpu_dry_run` on ``meta`` tensors, where launches are recorded and any host read of a device
value, blocking upload or tensor built on the host raises. Each case records the expected launches."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import gpu_dry_run

pytest.importorskip("triton")

from attnops.ops.dsa import problem  # noqa: E402
from attnops.ops.dsa.triton import launch  # noqa: E402
from attnops.ops.dsa.triton.family import KERNELS  # noqa: E402

META = torch.device("meta")
H = torch.float16


def meta(*shape, dtype=H, grad=False):
    return torch.empty(*shape, device=META, dtype=dtype, requires_grad=grad)


def kernels(launches) -> list[str]:
    assert launches, "no launch recorded"
    return [record.kernel for record in launches]


def _no_rows(*args):
    raise AssertionError("per-row metadata built on the host for a call on the kernels")


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_operators_record_their_kernels(layout, monkeypatch):
    """The Pythonic operators with host lengths (BSND: none; TND: cumulative lists). The kernels derive each row's
    batch, position and key limit from the lengths: no per-row tensor is built on the host (its cost grows with
    the tokens)."""
    monkeypatch.setattr(problem, "_rows", _no_rows)
    lead, lens = ((2, 64), {}) if layout == "BSND" else ((96,), dict(actual_seq_lengths_query=[40, 96]))
    kv_lens = {} if layout == "BSND" else dict(actual_seq_lengths_kv=[64, 128])
    key_lead = (2, 64) if layout == "BSND" else (128,)
    with gpu_dry_run() as launches:
        idx = attnops.lightning_indexer(meta(*lead, 64, 128), meta(*key_lead, 1, 128), meta(*lead, 64), layout=layout,
                                        sparse_count=2048, **lens,
                                        **{k.replace("kv", "key"): v for k, v in kv_lens.items()}).sparse_indices
        latent = meta(*key_lead, 1, 512)
        attnops.sparse_flash_attention(meta(*lead, 128, 512), latent, latent, idx, query_rope=meta(*lead, 128, 64),
                                       key_rope=meta(*key_lead, 1, 64), layout=layout, **lens, **kv_lens)
    assert kernels(launches) == ["indexer_topk_kernel", "sparse_attention_kernel"]
    assert launches[1].grid[2] == 4  # 128 heads x 512 columns: two head tiles of 64 x two column tiles of 256


def test_paged_launchers_read_device_lengths_and_tables():
    """The launchers with device lengths and a device block table (vllm-ascend's decode step: TND queries over a
    paged cache): nothing is read back, the kernels read them."""
    t, blocks, page = 4, 32, 64
    query, table = meta(t, 128, 512), meta(t, 8, dtype=torch.int32)
    q_lens, kv_lens = meta(t, dtype=torch.int32), meta(t, dtype=torch.int32)
    index_key, latent, rope = meta(blocks, page, 1, 128), meta(blocks, page, 1, 512), meta(blocks, page, 1, 64)
    quant = meta(blocks, page, 1, 656, dtype=torch.int8)
    with gpu_dry_run() as launches:
        g = launch.geometry(query, index_key, "TND", "PA_BSND", q_lens, kv_lens, table)
        (idx, _), plan = launch.indexer_plan(g, meta(t, 64, 128), index_key, meta(t, 64), 2048, True, False,
                                             interpret=False)
        KERNELS.run_all(plan, META)
        for cache in (launch.plain_cache(latent, latent, rope), launch.packed_cache(quant, H)):
            _, plan = launch.attention_plan(g, query, meta(t, 128, 64), cache, idx, 0.1, 1, True, True, None,
                                            interpret=False)
            KERNELS.run_all(plan, META)
    split = ["sparse_attention_kernel", "sparse_attention_merge_kernel"]  # 4 tokens: each row split over programs
    assert kernels(launches) == ["indexer_topk_kernel", *split, *split]
    assert launches[3].constexprs["QUANT"] == 1 and launches[1].constexprs["SPLIT"]


# ------------------------------------------- device lengths, block tables and indices through every operator
T, B, BLOCKS, PAGE = 6, 2, 16, 64
I32 = torch.int32


def _device_metadata(layout: str, layout_kv: str) -> tuple[tuple, tuple, dict, dict]:
    """(query lead, key lead, lengths and table as ``meta`` tensors by the indexer's names, the same by sparse
    attention's names) of a call whose metadata all live on the device."""
    lead = (B, 3) if layout == "BSND" else (T,)
    key_lead = {"BSND": (B, 128), "TND": (256,), "PA_BSND": (BLOCKS, PAGE)}[layout_kv]
    lens = dict(actual_seq_lengths_query=meta(B, dtype=I32), actual_seq_lengths_key=meta(B, dtype=I32))
    if layout_kv == "PA_BSND":
        lens["block_table"] = meta(B, 8, dtype=I32)
    kv_names = {("actual_seq_lengths_kv" if k == "actual_seq_lengths_key" else k): v for k, v in lens.items()}
    return lead, key_lead, lens, kv_names


DEVICE_LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("TND", "PA_BSND"), ("BSND", "PA_BSND")]


@pytest.mark.parametrize("layout,layout_kv", DEVICE_LAYOUTS)
def test_pythonic_operators_leave_device_metadata_to_the_kernels(layout, layout_kv):
    """Lengths, block tables and indices on the device: validated by shape only, read by the kernels (which
    take the length tensors: ``Q_LENS`` / ``KV_LENS``)."""
    lead, key_lead, lens, kv_names = _device_metadata(layout, layout_kv)
    with gpu_dry_run() as launches:
        idx = attnops.lightning_indexer(meta(*lead, 64, 128), meta(*key_lead, 1, 128), meta(*lead, 64),
                                        layout=layout, layout_key=layout_kv, sparse_count=2048, **lens).sparse_indices
        latent = meta(*key_lead, 1, 512)
        attnops.sparse_flash_attention(meta(*lead, 128, 512), latent, latent, idx, query_rope=meta(*lead, 128, 64),
                                       key_rope=meta(*key_lead, 1, 64), layout=layout, layout_kv=layout_kv,
                                       **kv_names)
    assert kernels(launches)[:2] == ["indexer_topk_kernel", "sparse_attention_kernel"]
    for record in launches[:2]:
        assert record.constexprs["Q_LENS"] and record.constexprs["KV_LENS"]
        assert record.constexprs["KV_MODE"] == launch.KV_MODES[layout_kv]


@pytest.mark.parametrize("layout,layout_kv", DEVICE_LAYOUTS)
def test_torch_npu_names_leave_device_metadata_to_the_kernels(layout, layout_kv):
    """torch_npu's names and vllm-ascend's ``_C_ascend`` twins, device lengths and tables, the quantized cache
    included."""
    import attnops.torch_npu as tnpu
    from attnops.torch_npu.dsa import C_ASCEND_OPS

    lead, key_lead, lens, kv_names = _device_metadata(layout, layout_kv)
    layouts = dict(layout_query=layout, layout_kv=layout_kv)
    q, qr, latent, rope = meta(*lead, 128, 512), meta(*lead, 128, 64), meta(*key_lead, 1, 512), meta(*key_lead, 1, 64)
    packed, quant_q = meta(*key_lead, 1, 656, dtype=torch.int8), meta(*lead, 128, 576)
    with gpu_dry_run() as launches:
        for indexer in (tnpu.npu_lightning_indexer, C_ASCEND_OPS["npu_lightning_indexer"]):
            idx, _ = indexer(meta(*lead, 64, 128), meta(*key_lead, 1, 128), meta(*lead, 64), layout_query=layout,
                             layout_key=layout_kv, **lens)
        for attention in (tnpu.npu_sparse_flash_attention, C_ASCEND_OPS["npu_sparse_flash_attention"]):
            attention(q, latent, latent, idx, 0.04, query_rope=qr, key_rope=rope, attention_mode=2, **layouts,
                      **kv_names)
        tnpu.npu_kv_quant_sparse_flash_attention(quant_q, packed, packed, idx, 0.04, 2, 2, attention_mode=2,
                                                 **layouts, **kv_names)
        C_ASCEND_OPS["npu_kv_quant_sparse_flash_attention"](quant_q, packed, packed, idx, 0.04, key_quant_mode=2,
                                                            value_quant_mode=2, attention_mode=2, **layouts,
                                                            **kv_names)
    names = [name for name in kernels(launches) if name != "sparse_attention_merge_kernel"]
    assert names == ["indexer_topk_kernel"] * 2 + ["sparse_attention_kernel"] * 4
    assert all(r.constexprs["KV_LENS"] for r in launches if r.kernel != "sparse_attention_merge_kernel")
    assert [r.constexprs["QUANT"] for r in launches if r.kernel == "sparse_attention_kernel"] == [0, 0, 1, 1]


def test_host_lengths_with_a_device_block_table():
    """Host lengths are validated and uploaded; the device block table is not read."""
    q = meta(T, 128, 512)
    table = meta(B, 8, dtype=I32)
    latent, rope = meta(BLOCKS, PAGE, 1, 512), meta(BLOCKS, PAGE, 1, 64)
    idx = meta(T, 1, 2048, dtype=I32)
    kw = dict(query_rope=meta(T, 128, 64), key_rope=rope, layout="TND", layout_kv="PA_BSND", block_table=table)
    with gpu_dry_run() as launches:
        attnops.sparse_flash_attention(q, latent, latent, idx, actual_seq_lengths_query=[2, 6],
                                       actual_seq_lengths_kv=[300, 512], **kw)
    assert kernels(launches)[0] == "sparse_attention_kernel"
    with gpu_dry_run(), pytest.raises(attnops.ParamInvalidError, match="actual_seq_lengths_kv"):  # > 8 x 64
        attnops.sparse_flash_attention(q, latent, latent, idx, actual_seq_lengths_query=[2, 6],
                                       actual_seq_lengths_kv=[300, 513], **kw)


@pytest.mark.parametrize("case,name", [
    ("wrong_count", "actual_seq_lengths_kv"), ("host_beside_device", "actual_seq_lengths_query"),
    ("float_lengths", "actual_seq_lengths_kv"), ("missing_table", "block_table"), ("table_rows", "block_table")])
def test_device_metadata_shapes_are_checked(case, name):
    """Device values are not read, but their shapes, dtypes and devices are: errors name the argument."""
    q, latent = meta(T, 16, 64), meta(BLOCKS, PAGE, 1, 64)
    args = dict(actual_seq_lengths_query=meta(B, dtype=I32), actual_seq_lengths_kv=meta(B, dtype=I32),
                block_table=meta(B, 8, dtype=I32))
    if case == "wrong_count":
        args["actual_seq_lengths_kv"] = meta(B + 1, dtype=I32)
    elif case == "host_beside_device":
        args["actual_seq_lengths_query"] = torch.tensor([2, 6], dtype=I32)
    elif case == "float_lengths":
        args["actual_seq_lengths_kv"] = meta(B)
    elif case == "missing_table":
        args["block_table"] = None
    else:
        args["block_table"] = meta(B + 1, 8, dtype=I32)
    with gpu_dry_run(), pytest.raises(attnops.AclnnError, match=name):
        attnops.sparse_flash_attention(q, latent, latent, meta(T, 1, 8, dtype=I32), layout="TND",
                                       layout_kv="PA_BSND", **args)


BACKWARD = ["sparse_attention_dq_kernel", "sparse_attention_dkdv_kernel", "sparse_attention_dkdv_reduce_kernel"]


@pytest.mark.parametrize("layout,layout_kv", DEVICE_LAYOUTS)
def test_backward_leaves_device_metadata_to_the_kernels(layout, layout_kv):
    """Sparse attention's backward with device lengths (and block table): dQ, the inverted lists ordered by torch
    ops on the device, dK/dV and the reduction of split lists; nothing is read back."""
    lead, key_lead, _, kv_names = _device_metadata(layout, layout_kv)
    q, latent = meta(*lead, 128, 512, grad=True), meta(*key_lead, 1, 512, grad=True)
    q_rope, k_rope = meta(*lead, 128, 64, grad=True), meta(*key_lead, 1, 64, grad=True)
    idx = meta(*lead, 1, 2048, dtype=I32)
    with gpu_dry_run() as launches:
        out = attnops.sparse_flash_attention(q, latent, latent, idx, query_rope=q_rope, key_rope=k_rope,
                                             layout=layout, layout_kv=layout_kv, **kv_names)
        out.attention_out.sum().backward()
    names = [name for name in kernels(launches) if name != "sparse_attention_merge_kernel"]
    assert names == ["sparse_attention_kernel", *BACKWARD]
    dq = launches[-3]
    assert dq.constexprs["Q_LENS"] and dq.constexprs["KV_LENS"] and dq.constexprs["KV_MODE"] == launch.KV_MODES[
        layout_kv]
    assert launches[-2].constexprs["V_IS_K"]  # MLA: the value's gradient accumulates into the latent's
    assert q.grad.shape == q.shape and latent.grad.shape == latent.shape and k_rope.grad.shape == k_rope.shape


def test_backward_with_host_lengths_records_its_kernels():
    """Host lengths (uploaded once), the torch_npu name's autograd."""
    import attnops.torch_npu as tnpu

    q, latent = meta(T, 128, 512, grad=True), meta(256, 1, 512, grad=True)
    rope = dict(query_rope=meta(T, 128, 64, grad=True), key_rope=meta(256, 1, 64, grad=True))
    with gpu_dry_run() as launches:
        out, *_ = tnpu.npu_sparse_flash_attention(q, latent, latent, meta(T, 1, 8, dtype=I32), 0.04, **rope,
                                                  actual_seq_lengths_query=torch.tensor([2, 6], dtype=I32),
                                                  actual_seq_lengths_kv=torch.tensor([64, 128], dtype=I32),
                                                  layout_query="TND", layout_kv="TND", attention_mode=2,
                                                  return_softmax_lse=True)
        out.sum().backward()
    assert [name for name in kernels(launches) if name != "sparse_attention_merge_kernel"][-3:] == BACKWARD


KL_LOSS = ["indexer_kl_loss_kernel", "indexer_kl_loss_sum_kernel", "indexer_kl_loss_dk_kernel",
           "sparse_attention_dkdv_reduce_kernel"]


def test_kl_loss_records_its_kernels_with_host_lengths():
    """The indexer's KL loss (``lightning_indexer_kl_loss`` and its autograd, ``npu_sparse_lightning_indexer_grad_kl_
    loss``) with host lengths (uploaded once): the row kernel, the loss sum, then d_key_index over the inverted
    lists ordered on the device; nothing is read back."""
    import attnops.torch_npu as tnpu

    idx = meta(T, 1, 2048, dtype=I32)
    qi, ki, w = meta(T, 64, 128, grad=True), meta(T, 1, 128, grad=True), meta(T, 64, dtype=torch.float32, grad=True)
    stats = meta(1, T, 128, dtype=torch.float32)
    q, k, q_rope, k_rope = meta(T, 128, 512), meta(T, 1, 512), meta(T, 128, 64), meta(T, 1, 64)
    with gpu_dry_run() as launches:
        loss = attnops.lightning_indexer_kl_loss(q, k, qi, ki, w, idx, stats, stats, scale=0.1, query_rope=q_rope,
                                                 key_rope=k_rope, layout="TND", actual_seq_lengths_query=[2, 6],
                                                 actual_seq_lengths_key=[2, 6])
        loss.sum().backward()
        tnpu.npu_sparse_lightning_indexer_grad_kl_loss(q, k, qi, ki, w, idx, stats, stats, 0.1, query_rope=q_rope,
                                                       key_rope=k_rope, actual_seq_qlen=[2, 6],
                                                       actual_seq_klen=[2, 6], layout="TND")
    assert kernels(launches) == KL_LOSS * 2
    assert launches[0].grid == (T, 1) and launches[0].constexprs["HAS_ROPE"]
    assert qi.grad.shape == qi.shape and ki.grad.shape == ki.shape and w.grad.shape == w.shape


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_kl_loss_leaves_device_lengths_to_the_kernels(layout):
    """Lengths on the device (the Pythonic API's tensors): validated by shape only, read by the row kernel."""
    lead, key_lead = ((B, 3), (B, 128)) if layout == "BSND" else ((T,), (256,))
    stats = meta(*((B, 1, 3) if layout == "BSND" else (1, T)), 16, dtype=torch.float32)
    with gpu_dry_run() as launches:
        attnops.lightning_indexer_kl_loss(meta(*lead, 16, 64), meta(*key_lead, 1, 64), meta(*lead, 8, 32),
                                          meta(*key_lead, 1, 32), meta(*lead, 8), meta(*lead, 1, 8, dtype=I32), stats,
                                          stats, scale=0.1, layout=layout, actual_seq_lengths_query=meta(B, dtype=I32),
                                          actual_seq_lengths_key=meta(B, dtype=I32))
    assert kernels(launches) == KL_LOSS
    row = launches[0].constexprs
    assert row["Q_LENS"] and row["KV_LENS"] and row["KV_MODE"] == launch.KV_MODES[layout] and not row["HAS_ROPE"]


def test_aclnn_two_phase_names_leave_device_metadata_to_the_kernels():
    """aclnn's LightningIndexer and SparseFlashAttention (two phases: phase 1 runs the operator) over a paged cache
    with device lengths and block table."""
    from attnops import aclnn

    lead, key_lead, lens, _ = _device_metadata("TND", "PA_BSND")
    q_lens, kv_lens, table = lens["actual_seq_lengths_query"], lens["actual_seq_lengths_key"], lens["block_table"]
    latent = meta(*key_lead, 1, 512)
    with gpu_dry_run() as launches:
        size, executor = aclnn.lightning_indexer_get_workspace_size(
            meta(*lead, 64, 128), meta(*key_lead, 1, 128), meta(*lead, 64), q_lens, kv_lens, table, "TND",
            "PA_BSND", 2048, 3, 2**63 - 1, 2**63 - 1, False)
        idx, _ = aclnn.lightning_indexer(None, size, executor, None)
        size, executor = aclnn.sparse_flash_attention_get_workspace_size(
            meta(*lead, 128, 512), latent, latent, idx, table, q_lens, kv_lens, meta(*lead, 128, 64),
            meta(*key_lead, 1, 64), 0.04, 1, "TND", "PA_BSND", 3, 2**63 - 1, 2**63 - 1, 2, False)
        aclnn.sparse_flash_attention(None, size, executor, None)
    assert [r.kernel for r in launches if r.kernel != "sparse_attention_merge_kernel"] == [
        "indexer_topk_kernel", "sparse_attention_kernel"]
    assert all(r.constexprs["KV_LENS"] and r.constexprs["Q_LENS"] for r in launches[:2])
