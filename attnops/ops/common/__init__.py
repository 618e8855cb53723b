"""Operator math several operators share and none owns: the attention engine (:mod:`.problem`, the chunked CPU
:mod:`.reference`, :mod:`.backends`, the Triton attention-tile library and launchers in :mod:`.triton`) that
FlashAttention, FusedInferAttention prefill, NSA and DSA run on; the compiled CPU decode kernel
(:mod:`.cpu_kernels`); the per-operator NPU rounding rules (:mod:`.npu_rounding`); the lightning indexers' scores
and top-k (:mod:`.indexer`)."""
