"""Runs each NSA operator on its backend: the custom ops (``op.py``) call these functions and nothing else.

Every operator runs the CPU reference (tensors on another device are copied to the CPU and the results back)
unless a Triton implementation is registered for it and :func:`~attnops._core.dispatch.choose_backend` picks it:
``auto`` on CUDA when the kernels' verifier accepts the call (a PerformanceWarning names the reason when it does not),
``ATTNOPS_BACKEND=triton`` always (raising with the reason when the kernels cannot serve the call).
"""
from __future__ import annotations

import torch

from ..._core.devices import on_cpu
from ..._core.dispatch import choose_backend
from ..._core.indices import valid_ids
from ..common import backends as fa_backends
from .compress import compress_backward, compress_forward
from .compress_attention import build_compress_attention_spec, compress_attention_forward, compress_attention_problem
from .decode import compress_decode, compress_into_cache, selected_decode
from .selected import selected_backward, selected_forward
from .triton import infer_launch
from .triton import launch as triton_launch
from .triton import verify as triton_verify


def _run(device_tensor, verify, triton_fn, reference_fn, *args, emulated: bool = False):
    """``triton_fn(*args)`` when :func:`choose_backend` picks the Triton kernels for ``device_tensor``'s device
    (``verify()``: why they cannot serve the call, or None), else the reference on CPU copies; always the reference
    when ``emulated`` (``precision="npu"``)."""
    if not emulated and choose_backend("auto", device_tensor.device, verify) == "triton":
        return triton_fn(*args)
    return on_cpu(reference_fn, *args)


def compress(spec, input, weight):
    """``nsa_compress``: the compressed ``[rows, N, D]``."""
    return _run(input, lambda: triton_verify.compress_reason(spec, input), triton_launch.compress_forward,
                compress_forward, spec, input, weight)


def compress_grad(spec, output_grad, input, weight):
    """``nsa_compress_grad``: ``(input_grad, weight_grad)``."""
    return _run(input, lambda: triton_verify.compress_grad_reason(spec, input), triton_launch.compress_backward,
                compress_backward, spec, output_grad, input, weight)


def selected(spec, query, key, value, topk_indices):
    """``nsa_selected_attention``: ``(attention_out, softmax_max, softmax_sum)``."""
    return _run(query, lambda: triton_verify.selected_reason(spec, query), triton_launch.selected_forward,
                selected_forward, spec, query, key, value, topk_indices, emulated=spec.rounding is not None)


def selected_grad(spec, query, key, value, attention_out, grad, softmax_max, softmax_sum, topk_indices):
    """``nsa_selected_attention_grad``: ``(dq, dk, dv)``."""
    return _run(query, lambda: triton_verify.selected_grad_reason(spec, query), triton_launch.selected_backward,
                selected_backward, spec, query, key, value, attention_out, grad, softmax_max, softmax_sum,
                topk_indices, emulated=spec.rounding is not None)


def compress_attention(query, key, value, topk_mask, atten_mask, **spec_args):
    """``nsa_compress_attention``: ``(attention_out, topk_indices, softmax_max, softmax_sum)``; ``spec_args``:
    :func:`build_compress_attention_spec`'s keywords. The spec (it holds the masks, on the inputs' device) is built
    once, for the verifier and the kernels (or the reference on the CPU)."""

    def spec_of(query, key, value, topk_mask, atten_mask):
        return build_compress_attention_spec(query, key, value, topk_mask=topk_mask, atten_mask=atten_mask,
                                             **spec_args)

    tensors = (query, key, value, topk_mask, atten_mask)
    spec = spec_of(*tensors)

    def reference(*cpu_tensors):  # CPU copies when the inputs live elsewhere: the spec is rebuilt there
        cpu_spec = spec if query.device.type == "cpu" else spec_of(*cpu_tensors)
        return compress_attention_forward(cpu_spec, *cpu_tensors[:3])

    return _run(query, lambda: triton_verify.compress_attention_reason(spec, query),
                lambda *_: infer_launch.compress_attention(spec, query, key, value), reference, *tensors,
                emulated=spec.fa.rounding is not None)


def compress_attention_backward(grad, query, key, value, attention_out, softmax_max, softmax_sum, atten_mask,
                                **problem_args):
    """``nsa_compress_attention``'s ``(dq, dk, dv)``: the FlashAttention backward of its problem
    (:func:`compress_attention_problem`'s keywords in ``problem_args``)."""
    p = compress_attention_problem(query, key, value, atten_mask=atten_mask, **problem_args)
    dq, dk, dv, _ = fa_backends.backward(p, query, key, value, grad, attention_out, softmax_max, softmax_sum)
    return dq, dk, dv


def selected_infer(kv, block, query, key, value, topk_indices, block_table, lens=None):
    """``nsa_selected_attention_infer``: the output ``[B, N1, Dv]`` (``lens``: device lengths, or None)."""
    return _run(query, lambda: triton_verify.decode_reason(query, key, value), infer_launch.selected_decode,
                selected_decode, kv, block, query, key, value, topk_indices, block_table, lens,
                emulated=kv.rounding is not None)


def compress_attention_infer(kv, sel, query, key, value, block_table, lens=None):
    """``nsa_compress_attention_infer``: ``(attention_out, topk_indices)`` (``lens``: device lengths, or None)."""
    return _run(query, lambda: triton_verify.decode_reason(query, key, value), infer_launch.compress_decode,
                compress_decode, kv, sel, query, key, value, block_table, lens, emulated=kv.rounding is not None)


def compress_infer(input, weight, slot_mapping, block_table, cache, lens, block, stride, lens_tensor=None) -> None:
    """``nsa_compress_infer``: writes the completed compression blocks into ``cache`` in place (dispatched like
    :func:`_run`; the reference on another device computes on CPU copies and writes back the rows it changed)."""
    args = (input, weight, slot_mapping, block_table, cache, lens, block, stride, lens_tensor)
    if choose_backend("auto", cache.device, lambda: triton_verify.compress_cache_reason(input)) == "triton":
        infer_launch.compress_into_cache(*args)
    elif cache.device.type == "cpu":
        compress_into_cache(*args)
    else:
        _reference_elsewhere(*args)


def _reference_elsewhere(input, weight, slot_mapping, block_table, cache, lens, block, stride, lens_tensor) -> None:
    """The reference for a cache on another device: computed on CPU copies of the inputs and of the cache rows
    ``slot_mapping`` names (not the whole cache), which are written back. A slow path that reads on the host."""
    slots = slot_mapping.cpu().long()
    inside = valid_ids(slots, cache.shape[0])  # an unvalidated slot outside the cache writes nothing
    unique, local = torch.unique(slots.clamp(0, cache.shape[0] - 1), return_inverse=True)
    index = unique.to(cache.device)
    rows = cache[index].cpu()
    compress_into_cache(input.cpu(), weight.cpu(), torch.where(inside, local, -1), block_table.cpu(), rows, lens,
                        block, stride,
                        None if lens_tensor is None else lens_tensor.cpu())
    cache.index_copy_(0, index, rows.to(cache.device))
