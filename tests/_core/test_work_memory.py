"""Outputs that cannot fit in memory (here implied by an ``expand``-ed query of stride 0, about 10**15 bytes) raise
a clear attnops error naming ``query`` and the tensors' sizes, from the size check, without trying to allocate."""
import pytest
import torch

import attnops
from attnops._core.errors import ParamInvalidError
from attnops._core.memory import work_memory

HUGE_S = 4 * 10**12  # 1 x 1 x S x 64 fp32 = 1e15 bytes


def _huge(s=HUGE_S):
    return torch.zeros(1, 1, 1, 64).expand(1, 1, s, 64)


@pytest.mark.parametrize("call", [
    lambda: attnops.flash_attention(_huge(), _huge(8), _huge(8)),
    lambda: attnops.fused_infer_attention(_huge(), _huge(8), _huge(8)),
], ids=["flash_attention", "fused_infer_attention"])
def test_outputs_too_large_for_memory_raise_before_allocating(call):
    """The size check against the machine's memory raises (not a failed allocation, nor any compute)."""
    with pytest.raises(ParamInvalidError, match=r"query: expected sizes whose outputs fit in memory on cpu \(needs "
                                                r".*attention_out \[1, 1, 4000000000000, 64\] torch.float32.*; "
                                                r"this machine has "):
        call()


def test_allocator_failure_inside_becomes_the_attnops_error():
    with pytest.raises(ParamInvalidError, match=r"query: expected .*out \[2, 3\].*the allocation failed: "
                                                r"DefaultCPUAllocator: can't allocate memory"):
        with work_memory("query", "q", torch.device("cpu"), {"out": ((2, 3), torch.float32)}):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes.")


def test_other_errors_pass_through():
    with pytest.raises(RuntimeError, match="unrelated"):
        with work_memory("query", "q", torch.device("cpu"), {"out": ((2, 3), torch.float32)}):
            raise RuntimeError("unrelated")
