"""Runs the compressor on its backend (the custom op calls :func:`compressor` and nothing else).

The Triton kernels serve CUDA calls (and CPU calls through Triton's interpreter with ``ATTNOPS_BACKEND=triton``)
that :mod:`.triton.compressor_verify` accepts. On that path no metadata value is read on the host when any metadata
tensor lives on a device (a CUDA call's state block table always does): their shapes, dtypes and devices are checked
and the kernels read the values, clamping every length into the tensors (no synchronisation, CUDA-graph
capturable); metadata that is all on the CPU is validated first (values included) and uploaded without blocking.
The reference runs on CPU copies with the host normal form and writes the state back.
"""
from __future__ import annotations

from ..._core import staging
from ..._core.devices import on_cpu
from ..._core.dispatch import choose_backend
from .compressor_problem import check_device_metadata, check_operands, compressor_problem
from .compressor_reference import compressor_forward
from .triton import compressor_launch as launch
from .triton.compressor_verify import compressor_reason


def compressor(x, wkv, wgate, state_cache, ape, post: launch.Post, metadata: dict, *, cmp_ratio: int, coff: int,
               cache_mode: int):
    """The compressed rows; ``state_cache`` updated in place. ``metadata``: ``cu_seqlens``, ``seqused``,
    ``start_pos``, ``state_block_table`` (tensors or None)."""
    attrs = dict(cmp_ratio=cmp_ratio, coff=coff, cache_mode=cache_mode, rope_head_dim=post.rope_head_dim,
                 norm_eps=post.norm_eps, rotary_mode=post.rotary_mode)
    tensors = dict(norm_weight=post.norm_weight, rope_sin=post.rope_sin, rope_cos=post.rope_cos)
    ratio, dim, shape = check_operands(x, wkv, wgate, state_cache, ape, **tensors, **attrs,
                                       state_block_table=metadata["state_block_table"],
                                       cu_seqlens=metadata["cu_seqlens"])
    on_device = any(t is not None and t.device.type != "cpu" for t in metadata.values())
    if on_device:
        check_device_metadata(x, **metadata, cache_mode=cache_mode)
    problem = None if on_device else compressor_problem(x, wkv, wgate, state_cache, ape, **tensors, **attrs,
                                                        **metadata)
    if choose_backend("auto", x.device, lambda: compressor_reason(x, state_cache, ape, dim)) == "triton":
        meta = launch.CompressorMetadata(**{name: staging.upload_if_host(t, x.device)
                                            for name, t in metadata.items()})
        return launch.compressor(x, wkv, wgate, state_cache, ape, meta, post, shape, ratio, coff, cache_mode)

    def reference(x, wkv, wgate, state, ape, tensors, metadata):
        host = problem or compressor_problem(x, wkv, wgate, state, ape, **tensors, **attrs, **metadata)
        return compressor_forward(host, x, wkv, wgate, state, ape, tensors["norm_weight"], tensors["rope_sin"],
                                  tensors["rope_cos"], post.rope_head_dim, post.norm_eps, post.rotary_mode)

    state = state_cache.cpu()  # the cache itself on the CPU, else a copy that is written back
    out = on_cpu(reference, x, wkv, wgate, state, ape, tensors, metadata)
    if state is not state_cache:
        state_cache.copy_(state)
    return out
