"""Context parallelism on ``torch.distributed``: ring attention and Ulysses over attnops' FlashAttention.

* :func:`ring_flash_attention`: the sequence stays sharded (load-balanced chunks ``r`` and ``2P-1-r``); KV shards
  travel around the ring and partial results merge through the softmax statistics.
* :func:`ulysses_flash_attention`: all-to-all from sequence shards to head shards, the local operator on the
  whole sequence, all-to-all back.
* :func:`allgather_flash_attention`: K/V all-gathered, local query rows against the keys they may see; dK/dV
  reduce-scattered (MindSpeed ``kvallgather``, llama3 varlen); NSA and DSA operators on the gathered keys.
* :func:`hybrid_flash_attention`: Ulysses over one group, ring attention over another (:func:`hybrid_groups`).

Importing this package also makes attnops' FlashAttention (:mod:`.torch_cp`) and PyTorch's own
``F.scaled_dot_product_attention`` on CPU (:mod:`.torch_cp_sdpa`) run as ring attention inside PyTorch's
``torch.distributed.tensor.experimental.context_parallel()``.

See ``docs/distributed.md``.
"""
from .allgather import allgather_flash_attention, allgather_sequence
from .allgather_sparse import (allgather_lightning_indexer, allgather_lightning_indexer_kl_loss,
                               allgather_nsa_compress_attention, allgather_nsa_selected_attention,
                               allgather_sparse_flash_attention)
from .dropout import hybrid_dropout_mask, ring_dropout_mask
from .hybrid import HybridGroups, hybrid_flash_attention, hybrid_groups, hybrid_shard, hybrid_unshard
from .ring import ring_flash_attention
from .sharding import ring_shard, ring_unshard
from .torch_cp import register as _register_torch_region_runner
from .torch_cp_sdpa import register as _register_torch_region_sdpa
from .ulysses import ulysses_flash_attention

_register_torch_region_runner()
_register_torch_region_sdpa()

__all__ = ["HybridGroups", "allgather_flash_attention", "allgather_lightning_indexer",
           "allgather_lightning_indexer_kl_loss", "allgather_nsa_compress_attention",
           "allgather_nsa_selected_attention", "allgather_sequence", "allgather_sparse_flash_attention",
           "hybrid_dropout_mask", "hybrid_flash_attention", "hybrid_groups", "hybrid_shard", "hybrid_unshard",
           "ring_dropout_mask", "ring_flash_attention", "ring_shard", "ring_unshard", "ulysses_flash_attention"]
