"""MLA helpers that feed the (sparse) attention ops: interleaved RoPE, the latent KV's RMSNorm + RoPE written into
(paged, NZ, quantized) caches, and the MLA prolog (query / latent KV projections)."""
