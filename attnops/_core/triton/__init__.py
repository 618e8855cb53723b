"""Shared Triton machinery of every operator's kernels: ahead-of-time compilation and resource figures
(:mod:`.aot`), the registry of AOT cases operators fill (:mod:`.registry`) and ``python -m attnops aot``
(:mod:`.cli`)."""
