"""Plan / run for FIA decoding (FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper.plan/run``):
:func:`fused_infer_attention_plan` validates a call once and does its host arithmetic (the work split, buffers,
metadata uploads); :meth:`FusedInferAttentionPlan.run` launches the kernels for new queries, caches, block tables
and KV lengths of the same shapes, at a host cost that depends neither on the batch size nor on the page order.
"""
from __future__ import annotations

from functools import partial

from torch import Tensor

from ..._core.autocast import autocast_off
from ..._core.dispatch import choose_backend
from ..._core.inference_only import run_inference_only
from ..._core.triton.support import interpreting
from . import api
from .op import INFERENCE_ONLY
from .paged import flash_attn_cache_views
from .problem import build_problem


class FusedInferAttentionPlan:
    """A planned FIA call (:func:`fused_infer_attention_plan`): :meth:`run` computes it for new inputs.

    On the Triton decode kernels (CUDA, when they serve the call), the plan holds the work split, the partial
    buffers and every argument that stays the same; ``run`` checks shapes, dtypes and devices, allocates the two
    outputs and launches two kernels, reading nothing back. Elsewhere (the CPU, or calls the decode kernels do not
    serve) ``run`` makes the one call :func:`attnops.fused_infer_attention` would make. ``kernels``: whether the
    decode kernels run it.
    """

    def __init__(self, query: Tensor, key, value, arguments: dict):
        self._return_lse = arguments["return_lse"]
        self._arguments = arguments
        self._plan = None
        query, key, value, options = api.call_options(query, key, value, arguments)
        key, value = flash_attn_cache_views(key, value, options)
        self._options = options
        self._block_table = options.get("block_table")
        problem = build_problem(query, key, value, **options)  # fused_infer_attention's checks, on every device
        built = {}

        def verify():
            from .triton.verify import kernel_route

            built["route"], reason = kernel_route(problem, query, key, value, options)
            return reason

        backend = "reference" if options["precision"] == "npu" else arguments["backend"]  # the NPU emulation
        if choose_backend(backend, query.device, verify) == "triton" and built["route"] == "decode":
            from .triton.decode_plan import make_plan

            lengths_on_host = not isinstance(arguments["actual_seq_lengths_kv"], Tensor)  # a tensor: plan for any
            self._plan = make_plan(problem, interpreting(query.device), lengths_on_host)

    @property
    def kernels(self) -> bool:
        return self._plan is not None

    def run(self, query: Tensor, key: Tensor, value: Tensor, *, block_table: Tensor | None = None,
            actual_seq_lengths_kv=None):
        """The attention of ``query`` over ``key``/``value`` (a dense KV or a paged cache, of the planned shapes,
        dtypes and device) with ``block_table`` and ``actual_seq_lengths_kv`` (None: the planned ones). Lengths
        given as a device tensor are read by the kernels (at most the planned capacity: the block table's columns x
        block size, or the KV S); every other tensor given to the plan is read at each run, so it may be updated in
        place. Returns the output, or ``(out, softmax_lse)`` when the plan was made with ``return_lse=True``."""
        if self._plan is None:
            arguments = dict(self._arguments)
            if block_table is not None:
                arguments["block_table"] = block_table
            if actual_seq_lengths_kv is not None:
                arguments["actual_seq_lengths_kv"] = actual_seq_lengths_kv
            return api.fused_infer_attention(query, key, value, **{name: x for name, x in arguments.items()
                                                                  if name not in ("query", "key", "value")})
        from .triton import launch

        if block_table is None:
            block_table = self._block_table
        key, value = flash_attn_cache_views(key, value, self._options)
        with autocast_off(query.device):
            out, lse = run_inference_only(INFERENCE_ONLY, partial(launch.run, self._plan, query, key, value,
                                                                  block_table, actual_seq_lengths_kv),
                                          query, key, value)
        return api.FusedInferAttentionResult(out, lse) if self._return_lse else out


def fused_infer_attention_plan(query: Tensor, key, value, **keywords) -> FusedInferAttentionPlan:
    """Plan an FIA call: every keyword of :func:`attnops.fused_infer_attention` (same meaning, same checks), with
    example ``query``/``key``/``value`` (real tensors or ones of the same shapes, dtypes and device). The KV
    lengths shape the work split: host lengths balance it over their total (made once per batch composition);
    ``actual_seq_lengths_kv`` as a device tensor gives a plan for any lengths up to the capacity, which a CUDA graph
    of :meth:`FusedInferAttentionPlan.run` can replay with new lengths and block tables written into the captured
    tensors.

    Example::

        >>> cache = attnops.PagedKVCache(64, 16, num_kv_heads=2, head_dim=64)
        >>> seqs = [cache.new_sequence() for _ in range(2)]
        >>> cache.append(seqs[0], torch.randn(40, 2, 64), torch.randn(40, 2, 64))
        >>> cache.append(seqs[1], torch.randn(7, 2, 64), torch.randn(7, 2, 64))
        >>> q = torch.randn(2, 4, 1, 64)
        >>> kw = cache.attention_kwargs(seqs)
        >>> plan = attnops.fused_infer_attention_plan(q, cache.key_cache, cache.value_cache, num_key_value_heads=2,
        ...                                           **kw)
        >>> plan.run(q, cache.key_cache, cache.value_cache, block_table=kw["block_table"]).shape
        torch.Size([2, 4, 1, 64])
    """
    arguments = api.SIGNATURE.bind(query, key, value, **keywords)
    arguments.apply_defaults()
    return FusedInferAttentionPlan(query, key, value, dict(arguments.arguments))


fused_infer_attention_plan.__signature__ = api.SIGNATURE.replace(return_annotation=FusedInferAttentionPlan)
