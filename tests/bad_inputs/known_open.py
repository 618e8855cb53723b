"""Bad-input cases still open in attnops, being fixed on other branches: the suite skips exactly these
``(entry point, corrupted argument, corruption kind, variant)``; each comment says what happened. Empty it
once those fixes are merged, so that the suite checks them too."""

KNOWN_OPEN: set[tuple[str, str, str, str]] = {
    # (a) NaN/inf propagation in the FIA, FA, NSA and DSA math
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.aclnn:fused_infer_attention_score_v2', 'query', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.aclnn:sparse_flash_attention', 'query', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.aclnn:sparse_flash_attention', 'query_rope', 'nonfinite', '-inf'),
    # output 0: the formula's infinities not reproduced
    ('attnops.aclnn:sparse_flash_attention', 'value', 'nonfinite', '+inf'),
    # output 0: the formula's infinities not reproduced
    ('attnops.aclnn:sparse_flash_attention', 'value', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fused_infer_attention_score', 'query', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fused_infer_attention_score_v2', 'query', 'nonfinite', 'nan'),
    # output 1: infinite where the formula is finite
    ('attnops.torch_npu:npu_fusion_attention_grad', 'attention_in', 'nonfinite', '+inf'),
    # output 1: infinite where the formula is finite
    ('attnops.torch_npu:npu_fusion_attention_grad', 'attention_in', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'dy', 'nonfinite', '+inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'dy', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'key', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'key', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'key', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'query', 'nonfinite', '-inf'),
    # output 0: a different finite value
    ('attnops.torch_npu:npu_fusion_attention_grad', 'softmax_max', 'nonfinite', '+inf'),
    # output 0: infinite where the formula is finite
    ('attnops.torch_npu:npu_fusion_attention_grad', 'softmax_max', 'nonfinite', '-inf'),
    # output 0: a different finite value
    ('attnops.torch_npu:npu_fusion_attention_grad', 'softmax_sum', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'value', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'value', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad', 'value', 'nonfinite', 'nan'),
    # output 1: infinite where the formula is finite
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'attention_in', 'nonfinite', '+inf'),
    # output 1: infinite where the formula is finite
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'attention_in', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'dy', 'nonfinite', '+inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'dy', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'key', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'key', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'key', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'query', 'nonfinite', '-inf'),
    # output 0: a different finite value
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'softmax_max', 'nonfinite', '+inf'),
    # output 0: infinite where the formula is finite
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'softmax_max', 'nonfinite', '-inf'),
    # output 0: a different finite value
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'softmax_sum', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'value', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'value', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v2', 'value', 'nonfinite', 'nan'),
    # output 1: infinite where the formula is finite
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'attention_in', 'nonfinite', '+inf'),
    # output 1: infinite where the formula is finite
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'attention_in', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'dy', 'nonfinite', '+inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'dy', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'key', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'key', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'key', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'query', 'nonfinite', '-inf'),
    # output 0: a different finite value
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'softmax_max', 'nonfinite', '+inf'),
    # output 0: infinite where the formula is finite
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'softmax_max', 'nonfinite', '-inf'),
    # output 0: a different finite value
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'softmax_sum', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'value', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'value', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_fusion_attention_grad_v3', 'value', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_incre_flash_attention', 'query', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_prompt_flash_attention', 'query', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_sparse_flash_attention', 'query', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops.torch_npu:npu_sparse_flash_attention', 'query_rope', 'nonfinite', '-inf'),
    # output 0: the formula's infinities not reproduced
    ('attnops.torch_npu:npu_sparse_flash_attention', 'value', 'nonfinite', '+inf'),
    # output 0: the formula's infinities not reproduced
    ('attnops.torch_npu:npu_sparse_flash_attention', 'value', 'nonfinite', '-inf'),
    # output 1: infinite where the formula is finite
    ('attnops:flash_attention_backward', 'attention_out', 'nonfinite', '+inf'),
    # output 1: infinite where the formula is finite
    ('attnops:flash_attention_backward', 'attention_out', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'dy', 'nonfinite', '+inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'dy', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'key', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'key', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'key', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'query', 'nonfinite', '-inf'),
    ('attnops:flash_attention_backward', 'softmax_max', 'nonfinite', '+inf'),  # output 0: a different finite value
    # output 0: infinite where the formula is finite
    ('attnops:flash_attention_backward', 'softmax_max', 'nonfinite', '-inf'),
    ('attnops:flash_attention_backward', 'softmax_sum', 'nonfinite', '+inf'),  # output 0: a different finite value
    # output 0: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'value', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'value', 'nonfinite', '-inf'),
    # output 1: finite or infinite where the formula gives NaN
    ('attnops:flash_attention_backward', 'value', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops:fused_infer_attention', 'query', 'nonfinite', 'nan'),
    # output 0: finite or infinite where the formula gives NaN
    ('attnops:sparse_flash_attention', 'query', 'nonfinite', '+inf'),
    # output 0: the formula's infinities not reproduced
    ('attnops:sparse_flash_attention', 'value', 'nonfinite', '+inf'),
    # output 0: the formula's infinities not reproduced
    ('attnops:sparse_flash_attention', 'value', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops:fused_infer_attention', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops:sparse_flash_attention', 'query', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops.aclnn:sparse_flash_attention', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops.aclnn:sparse_flash_attention', 'query_rope', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops.torch_npu:npu_fused_infer_attention_score', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops.torch_npu:npu_fused_infer_attention_score_v2', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops.torch_npu:npu_incre_flash_attention', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops.torch_npu:npu_incre_flash_attention', 'query', 'nonfinite', '-inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops.torch_npu:npu_prompt_flash_attention', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops.torch_npu:npu_sparse_flash_attention', 'query', 'nonfinite', '+inf'),
    # output 0: finite or infinite where the formula gives NaN (a non-finite value past element 0)
    ('attnops.torch_npu:npu_sparse_flash_attention', 'query_rope', 'nonfinite', '+inf'),
    # (b) index / block-table / slot-mapping / length validation in DSA, FIA paged, NSA and the KV-cache ops
#     (cache_index named 'index', caches too small for the slots or the block table included)
    # raw RuntimeError: Tensor on device cpu is not on the expected d
    ('attnops.aclnn:kv_rms_norm_rope_cache', 'index', 'device', 'meta'),
    ('attnops.aclnn:kv_rms_norm_rope_cache', 'index', 'index', 'negative'),  # accepted silently
    ('attnops.aclnn:kv_rms_norm_rope_cache', 'index', 'ndim', 'unsqueezed'),  # accepted silently
    # raw RuntimeError: Tensor on device cpu is not on the expected d
    ('attnops.aclnn:mla_prolog_v2_weight_nz', 'cache_index', 'device', 'meta'),
    ('attnops.aclnn:mla_prolog_v2_weight_nz', 'cache_index', 'index', 'far'),  # the error names index
    ('attnops.aclnn:mla_prolog_v2_weight_nz', 'cache_index', 'index', 'negative'),  # accepted silently
    ('attnops.aclnn:mla_prolog_v2_weight_nz', 'cache_index', 'ndim', 'unsqueezed'),  # accepted silently
    ('attnops.aclnn:mla_prolog_v2_weight_nz', 'kr_cache_ref', 'empty', 'first-dim-0'),  # the error names index
    ('attnops.aclnn:mla_prolog_v2_weight_nz', 'kv_cache_ref', 'empty', 'first-dim-0'),  # the error names index
    # raw RuntimeError: Tensor on device cpu is not on the expected d
    ('attnops.aclnn:mla_prolog_v3_weight_nz', 'cache_index', 'device', 'meta'),
    ('attnops.aclnn:mla_prolog_v3_weight_nz', 'cache_index', 'index', 'far'),  # the error names index
    ('attnops.aclnn:mla_prolog_v3_weight_nz', 'cache_index', 'index', 'negative'),  # accepted silently
    ('attnops.aclnn:mla_prolog_v3_weight_nz', 'cache_index', 'ndim', 'unsqueezed'),  # accepted silently
    ('attnops.aclnn:mla_prolog_v3_weight_nz', 'kr_cache_ref', 'empty', 'first-dim-0'),  # the error names index
    ('attnops.aclnn:mla_prolog_v3_weight_nz', 'kv_cache_ref', 'empty', 'first-dim-0'),  # the error names index
    ('attnops.aclnn:sparse_flash_attention', 'sparse_indices', 'index', 'far'),  # accepted silently
    ('attnops.aclnn:sparse_flash_attention', 'sparse_indices', 'index', 'negative'),  # accepted silently
    # raw IndexError: index 1000000 is out of bounds for dimension 
    ('attnops.aclnn:sparse_lightning_indexer_grad_kl_loss', 'sparse_indices', 'index', 'far'),
    ('attnops.aclnn:sparse_lightning_indexer_grad_kl_loss', 'sparse_indices', 'index', 'negative'),  # accepted silently
    ('attnops.torch_npu:npu_gather_pa_kv_cache', 'block_tables', 'index', 'far'),  # accepted silently
    ('attnops.torch_npu:npu_gather_pa_kv_cache', 'block_tables', 'index', 'negative'),  # accepted silently
    # raw IndexError: index is out of bounds for dimension with siz
    ('attnops.torch_npu:npu_gather_pa_kv_cache', 'key_cache', 'empty', 'first-dim-0'),
    ('attnops.torch_npu:npu_gather_pa_kv_cache', 'seq_lens', 'index', 'far'),  # accepted silently
    # raw IndexError: index is out of bounds for dimension with siz
    ('attnops.torch_npu:npu_gather_pa_kv_cache', 'value_cache', 'empty', 'first-dim-0'),
    ('attnops.torch_npu:npu_gather_pa_kv_cache_functional', 'block_tables', 'index', 'far'),  # accepted silently
    ('attnops.torch_npu:npu_gather_pa_kv_cache_functional', 'block_tables', 'index', 'negative'),  # accepted silently
    # raw IndexError: index is out of bounds for dimension with siz
    ('attnops.torch_npu:npu_gather_pa_kv_cache_functional', 'key_cache', 'empty', 'first-dim-0'),
    ('attnops.torch_npu:npu_gather_pa_kv_cache_functional', 'seq_lens', 'index', 'far'),  # accepted silently
    # raw IndexError: index is out of bounds for dimension with siz
    ('attnops.torch_npu:npu_gather_pa_kv_cache_functional', 'value_cache', 'empty', 'first-dim-0'),
    ('attnops.torch_npu:npu_kv_quant_sparse_flash_attention', 'sparse_indices', 'index', 'far'),  # accepted silently
    # accepted silently
    ('attnops.torch_npu:npu_kv_quant_sparse_flash_attention', 'sparse_indices', 'index', 'negative'),
    # raw RuntimeError: Tensor on device cpu is not on the expected d
    ('attnops.torch_npu:npu_kv_rmsnorm_rope_cache', 'index', 'device', 'meta'),
    ('attnops.torch_npu:npu_kv_rmsnorm_rope_cache', 'index', 'index', 'negative'),  # accepted silently
    ('attnops.torch_npu:npu_kv_rmsnorm_rope_cache', 'index', 'ndim', 'unsqueezed'),  # accepted silently
    # raw RuntimeError: Tensor on device cpu is not on the expected d
    ('attnops.torch_npu:npu_mla_prolog_v2', 'cache_index', 'device', 'meta'),
    ('attnops.torch_npu:npu_mla_prolog_v2', 'cache_index', 'index', 'far'),  # the error names index
    ('attnops.torch_npu:npu_mla_prolog_v2', 'cache_index', 'index', 'negative'),  # accepted silently
    ('attnops.torch_npu:npu_mla_prolog_v2', 'cache_index', 'ndim', 'unsqueezed'),  # accepted silently
    ('attnops.torch_npu:npu_mla_prolog_v2', 'kr_cache', 'empty', 'first-dim-0'),  # the error names index
    ('attnops.torch_npu:npu_mla_prolog_v2', 'kv_cache', 'empty', 'first-dim-0'),  # the error names index
    # raw RuntimeError: Tensor on device cpu is not on the expected d
    ('attnops.torch_npu:npu_mla_prolog_v3', 'cache_index', 'device', 'meta'),
    ('attnops.torch_npu:npu_mla_prolog_v3', 'cache_index', 'index', 'far'),  # the error names index
    ('attnops.torch_npu:npu_mla_prolog_v3', 'cache_index', 'index', 'negative'),  # accepted silently
    ('attnops.torch_npu:npu_mla_prolog_v3', 'cache_index', 'ndim', 'unsqueezed'),  # accepted silently
    ('attnops.torch_npu:npu_mla_prolog_v3', 'kr_cache', 'empty', 'first-dim-0'),  # the error names index
    ('attnops.torch_npu:npu_mla_prolog_v3', 'kv_cache', 'empty', 'first-dim-0'),  # the error names index
    # raw RuntimeError: Tensor on device cpu is not on the expected d
    ('attnops.torch_npu:npu_mla_prolog_v3_functional', 'cache_index', 'device', 'meta'),
    ('attnops.torch_npu:npu_mla_prolog_v3_functional', 'cache_index', 'index', 'far'),  # the error names index
    ('attnops.torch_npu:npu_mla_prolog_v3_functional', 'cache_index', 'index', 'negative'),  # accepted silently
    ('attnops.torch_npu:npu_mla_prolog_v3_functional', 'cache_index', 'ndim', 'unsqueezed'),  # accepted silently
    ('attnops.torch_npu:npu_mla_prolog_v3_functional', 'kr_cache', 'empty', 'first-dim-0'),  # the error names index
    ('attnops.torch_npu:npu_mla_prolog_v3_functional', 'kv_cache', 'empty', 'first-dim-0'),  # the error names index
    ('attnops.torch_npu:npu_nsa_compress_infer', 'block_table', 'index', 'far'),  # accepted silently
    ('attnops.torch_npu:npu_nsa_compress_infer', 'block_table', 'index', 'negative'),  # accepted silently
    # raw RuntimeError: Tensor.item() cannot be called on meta tensor
    ('attnops.torch_npu:npu_scatter_pa_kv_cache', 'slot_mapping', 'device', 'meta'),
    ('attnops.torch_npu:npu_scatter_pa_kv_cache', 'slot_mapping', 'index', 'negative'),  # accepted silently
    # raw RuntimeError: Tensor.item() cannot be called on meta tensor
    ('attnops.torch_npu:npu_scatter_pa_kv_cache_functional', 'slot_mapping', 'device', 'meta'),
    ('attnops.torch_npu:npu_scatter_pa_kv_cache_functional', 'slot_mapping', 'index', 'negative'),  # accepted silently
    ('attnops.torch_npu:npu_sparse_flash_attention', 'sparse_indices', 'index', 'far'),  # accepted silently
    ('attnops.torch_npu:npu_sparse_flash_attention', 'sparse_indices', 'index', 'negative'),  # accepted silently
    # raw IndexError: index 1000000 is out of bounds for dimension 
    ('attnops.torch_npu:npu_sparse_lightning_indexer_grad_kl_loss', 'sparse_indices', 'index', 'far'),
    # accepted silently
    ('attnops.torch_npu:npu_sparse_lightning_indexer_grad_kl_loss', 'sparse_indices', 'index', 'negative'),
    # raw IndexError: index 1000000 is out of bounds for dimension 
    ('attnops:lightning_indexer_kl_loss', 'sparse_indices', 'index', 'far'),
    ('attnops:lightning_indexer_kl_loss', 'sparse_indices', 'index', 'negative'),  # accepted silently
    ('attnops:nsa_compress_attention_infer', 'block_table', 'index', 'far'),  # accepted silently
    ('attnops:nsa_compress_attention_infer', 'block_table', 'index', 'negative'),  # accepted silently
    ('attnops:nsa_selected_attention_infer', 'block_table', 'index', 'far'),  # accepted silently
    ('attnops:nsa_selected_attention_infer', 'block_table', 'index', 'negative'),  # accepted silently
    ('attnops:sparse_flash_attention', 'sparse_indices', 'index', 'far'),  # accepted silently
    ('attnops:sparse_flash_attention', 'sparse_indices', 'index', 'negative'),  # accepted silently
    # (c) the flash_attn drop-in's messages name attnops' arguments (query/key/value, actual_seq_qlen/kvlen)
#     instead of its own (q/k/v/kv/qkv, cu_seqlens_q/k, cu_seqlens)
    ('attnops.flash_attn:flash_attn_func', 'k', 'device', 'meta'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'k', 'dtype', 'bool'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'k', 'dtype', 'float64'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'k', 'dtype', 'int32'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'k', 'empty', 'first-dim-0'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'k', 'ndim', 'flattened'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'k', 'none', 'None'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'q', 'device', 'meta'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'q', 'dtype', 'bool'),  # the error names query
    ('attnops.flash_attn:flash_attn_func', 'q', 'dtype', 'float64'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'q', 'dtype', 'int32'),  # the error names query
    ('attnops.flash_attn:flash_attn_func', 'q', 'empty', 'first-dim-0'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'v', 'device', 'meta'),  # the error names value
    ('attnops.flash_attn:flash_attn_func', 'v', 'dtype', 'bool'),  # the error names value
    ('attnops.flash_attn:flash_attn_func', 'v', 'dtype', 'float64'),  # the error names value
    ('attnops.flash_attn:flash_attn_func', 'v', 'dtype', 'int32'),  # the error names value
    ('attnops.flash_attn:flash_attn_func', 'v', 'empty', 'first-dim-0'),  # the error names key
    ('attnops.flash_attn:flash_attn_func', 'v', 'ndim', 'flattened'),  # the error names value
    ('attnops.flash_attn:flash_attn_func', 'v', 'none', 'None'),  # the error names value
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'kv', 'device', 'meta'),  # the error names key
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'kv', 'dtype', 'bool'),  # the error names key
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'kv', 'dtype', 'float64'),  # the error names key
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'kv', 'dtype', 'int32'),  # the error names key
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'kv', 'empty', 'first-dim-0'),  # the error names key
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'q', 'device', 'meta'),  # the error names key
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'q', 'dtype', 'bool'),  # the error names query
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'q', 'dtype', 'float64'),  # the error names key
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'q', 'dtype', 'int32'),  # the error names query
    ('attnops.flash_attn:flash_attn_kvpacked_func', 'q', 'empty', 'first-dim-0'),  # the error names key
    ('attnops.flash_attn:flash_attn_qkvpacked_func', 'qkv', 'device', 'meta'),  # accepted silently
    ('attnops.flash_attn:flash_attn_qkvpacked_func', 'qkv', 'dtype', 'bool'),  # the error names query
    ('attnops.flash_attn:flash_attn_qkvpacked_func', 'qkv', 'dtype', 'int32'),  # the error names query
    ('attnops.flash_attn:flash_attn_varlen_func', 'cu_seqlens_k', 'index', 'far'),  # the error names actual_seq_kvlen
    # the error names actual_seq_kvlen
    ('attnops.flash_attn:flash_attn_varlen_func', 'cu_seqlens_k', 'index', 'negative'),
    ('attnops.flash_attn:flash_attn_varlen_func', 'cu_seqlens_q', 'index', 'far'),  # the error names actual_seq_qlen
    # the error names actual_seq_qlen
    ('attnops.flash_attn:flash_attn_varlen_func', 'cu_seqlens_q', 'index', 'negative'),
    ('attnops.flash_attn:flash_attn_varlen_func', 'cu_seqlens_q', 'none', 'None'),  # the error names q
    ('attnops.flash_attn:flash_attn_varlen_func', 'k', 'device', 'meta'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_func', 'k', 'dtype', 'bool'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_func', 'k', 'dtype', 'float64'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_func', 'k', 'dtype', 'int32'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_func', 'k', 'empty', 'first-dim-0'),  # the error names value
    ('attnops.flash_attn:flash_attn_varlen_func', 'k', 'ndim', 'flattened'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_func', 'k', 'none', 'None'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_func', 'q', 'device', 'meta'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_func', 'q', 'dtype', 'bool'),  # the error names query
    ('attnops.flash_attn:flash_attn_varlen_func', 'q', 'dtype', 'float64'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_func', 'q', 'dtype', 'int32'),  # the error names query
    ('attnops.flash_attn:flash_attn_varlen_func', 'q', 'empty', 'first-dim-0'),  # the error names actual_seq_qlen
    ('attnops.flash_attn:flash_attn_varlen_func', 'v', 'device', 'meta'),  # the error names value
    ('attnops.flash_attn:flash_attn_varlen_func', 'v', 'dtype', 'bool'),  # the error names value
    ('attnops.flash_attn:flash_attn_varlen_func', 'v', 'dtype', 'float64'),  # the error names value
    ('attnops.flash_attn:flash_attn_varlen_func', 'v', 'dtype', 'int32'),  # the error names value
    ('attnops.flash_attn:flash_attn_varlen_func', 'v', 'empty', 'first-dim-0'),  # the error names value
    ('attnops.flash_attn:flash_attn_varlen_func', 'v', 'ndim', 'flattened'),  # the error names value
    ('attnops.flash_attn:flash_attn_varlen_func', 'v', 'none', 'None'),  # the error names value
    # the error names actual_seq_kvlen
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'cu_seqlens_k', 'index', 'far'),
    # the error names actual_seq_kvlen
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'cu_seqlens_k', 'index', 'negative'),
    # the error names actual_seq_qlen
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'cu_seqlens_q', 'index', 'far'),
    # the error names actual_seq_qlen
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'cu_seqlens_q', 'index', 'negative'),
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'cu_seqlens_q', 'none', 'None'),  # the error names q
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'kv', 'device', 'meta'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'kv', 'dtype', 'bool'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'kv', 'dtype', 'float64'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'kv', 'dtype', 'int32'),  # the error names key
    # the error names actual_seq_kvlen
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'kv', 'empty', 'first-dim-0'),
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'q', 'device', 'meta'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'q', 'dtype', 'bool'),  # the error names query
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'q', 'dtype', 'float64'),  # the error names key
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'q', 'dtype', 'int32'),  # the error names query
    # the error names actual_seq_qlen
    ('attnops.flash_attn:flash_attn_varlen_kvpacked_func', 'q', 'empty', 'first-dim-0'),
    # the error names cu_seqlens_q
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'cu_seqlens', 'device', 'meta'),
    # the error names cu_seqlens_q
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'cu_seqlens', 'dtype', 'bool'),
    # the error names cu_seqlens_q
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'cu_seqlens', 'dtype', 'float32'),
    # the error names actual_seq_qlen
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'cu_seqlens', 'index', 'far'),
    # the error names actual_seq_qlen
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'cu_seqlens', 'index', 'negative'),
    # the error names cu_seqlens_q
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'cu_seqlens', 'ndim', 'unsqueezed'),
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'cu_seqlens', 'none', 'None'),  # the error names q
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'qkv', 'device', 'meta'),  # accepted silently
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'qkv', 'dtype', 'bool'),  # the error names query
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'qkv', 'dtype', 'int32'),  # the error names query
    # the error names actual_seq_qlen
    ('attnops.flash_attn:flash_attn_varlen_qkvpacked_func', 'qkv', 'empty', 'first-dim-0'),
}
