"""Context parallelism on ``torch.distributed``: ring attention and Ulysses over attnops' FlashAttention.

* :func:`ring_flash_attention`: the sequence stays sharded (load-balanced chunks ``r`` and ``2P-1-r``); KV shards
  travel around the ring and partial results merge through the softmax statistics.
* :func:`ulysses_flash_attention`: all-to-all from sequence shards to head shards, the local operator on the
  whole sequence, all-to-all back.

See ``docs/distributed.md``.
"""
from .dropout import ring_dropout_mask
from .ring import ring_flash_attention
from .sharding import ring_shard, ring_unshard
from .ulysses import ulysses_flash_attention

__all__ = ["ring_dropout_mask", "ring_flash_attention", "ring_shard", "ring_unshard", "ulysses_flash_attention"]
