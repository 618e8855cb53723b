"""Runs the lightning indexer v2 on its backend (the custom op calls :func:`lightning_indexer_v2` and nothing else).

The Triton kernel serves CUDA calls (and CPU calls through Triton's interpreter with ``ATTNOPS_BACKEND=triton``)
that :mod:`.triton.indexer_v2_verify` accepts. On that path no metadata value is read on the host when any metadata
tensor lives on a device: their shapes, dtypes and devices are checked and the kernel reads the values, clamping every
length into the tensors (no synchronisation, CUDA-graph capturable); metadata that is all on the CPU is validated
first (values included) and uploaded without blocking. The reference runs on CPU copies with the host normal form.
"""
from __future__ import annotations

from ..._core import staging
from ..._core.devices import on_cpu
from ..._core.dispatch import choose_backend
from .indexer_v2_problem import check_device_metadata, check_operands, indexer_v2_problem
from .indexer_v2_reference import lightning_indexer_v2_forward
from .triton import indexer_v2_launch as launch
from .triton.indexer_v2_verify import indexer_v2_reason

METADATA = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "cmp_residual_k", "block_table")


def lightning_indexer_v2(query, key, weights, topk: int, output_idx_offset, attrs: dict, metadata: dict):
    """``(sparse_indices, sparse_values)`` as flat ``[R, topk]`` rows; ``attrs`` the layouts, ``mask_mode`` and
    ``cmp_ratio``, ``metadata`` the tensors named in :data:`METADATA` (or None)."""
    check_operands(query, key, weights, topk=topk, block_table=metadata["block_table"],
                   output_idx_offset=output_idx_offset, **attrs)
    on_device = any(t is not None and t.device.type != "cpu" for t in metadata.values())
    if on_device:
        check_device_metadata(query, key, **metadata, **attrs)
    problem = None if on_device else indexer_v2_problem(query, key, weights, topk=topk, **metadata,
                                                        output_idx_offset=output_idx_offset, **attrs)
    if choose_backend("auto", query.device, lambda: indexer_v2_reason(query, weights)) == "triton":
        uploaded = {name: staging.upload_if_host(t, query.device) for name, t in metadata.items()}
        meta = launch.IndexerV2Metadata(**uploaded, output_idx_offset=output_idx_offset)
        indices, values = launch.lightning_indexer_v2(query, key, weights, meta, topk, attrs["layout_q"],
                                                      attrs["layout_k"], attrs["mask_mode"], attrs["cmp_ratio"])
        return indices.view(-1, topk), values.view(-1, topk)

    def reference(query, key, weights, output_idx_offset, metadata):
        host = problem or indexer_v2_problem(query, key, weights, topk=topk, **metadata,
                                             output_idx_offset=output_idx_offset, **attrs)
        return lightning_indexer_v2_forward(host, query, key, weights, topk, output_idx_offset)

    return on_cpu(reference, query, key, weights, output_idx_offset, metadata)

