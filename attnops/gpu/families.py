"""The kernel families ``gpu-report`` tests one pytest run each: the family's CUDA tests (``tests/cuda/``), its
Triton kernel tests (compiled on a GPU, through the interpreter with ``--interpret``) and the small selection that
``--interpret --quick`` runs. ``tests/cuda/`` files no family claims run in the ``integration`` step."""
from __future__ import annotations

from dataclasses import dataclass

CUDA_TESTS = "tests/cuda"


@dataclass(frozen=True)
class KernelFamily:
    name: str
    cuda_tests: tuple[str, ...]  # files under tests/cuda/
    kernel_tests: tuple[str, ...]  # the Triton kernel tests (files or folders)
    interpret_quick: tuple[str, ...]  # pytest arguments: a few tiny interpreter tests


KERNEL_FAMILIES = (
    KernelFamily("fa", ("test_triton_golden.py", "test_cuda_graphs_fa.py", "test_determinism.py",
                        "test_torch_npu_v3_lengths.py"),
                 ("tests/ops/flash_attention/triton/test_kernels.py",
                  "tests/ops/flash_attention/triton/test_verify.py"),
                 ("tests/ops/flash_attention/triton/test_kernels.py", "-k", "test_dtypes_causal")),
    KernelFamily("nsa", ("test_nsa_triton.py", "test_nsa_layer_module.py"), ("tests/ops/nsa/triton",),
                 ("tests/ops/nsa/triton/test_kernels.py", "-k", "test_compress_varlen")),
    KernelFamily("fia", ("test_fia_graphs.py",), ("tests/ops/fused_infer_attention/triton",),
                 ("tests/ops/fused_infer_attention/triton/test_decode_kernel.py", "-k", "test_dense_decode")),
    KernelFamily("dsa", (), ("tests/ops/dsa/triton",),
                 ("tests/ops/dsa/triton/test_kernels.py", "-k", "test_sparse_attention_kernel_separate_value")),
    KernelFamily("dsv4-compressor-indexer", (),
                 ("tests/ops/dsv4/triton/test_compressor_kernel.py", "tests/ops/dsv4/triton/test_indexer_v2_kernel.py",
                  "tests/ops/dsv4/test_dsv4_dry_run.py"),
                 ("tests/ops/dsv4/triton/test_indexer_v2_kernel.py", "-k", "test_ties_go_to_the_lower_index")),
    KernelFamily("dsv4-sfm", (), ("tests/ops/dsv4/test_sparse_flash_mla_triton.py",),
                 ("tests/ops/dsv4/test_sparse_flash_mla_triton.py", "-k", "test_branches_and_layouts and csa")),
)


def family_test_args(family: KernelFamily, interpret: bool, quick: bool) -> list[str]:
    """The pytest arguments of one family's test step: on CUDA its CUDA tests and kernel tests (``--quick``: the
    CUDA tests alone where it has some); through the interpreter its kernel tests (``--quick``: the tiny ones)."""
    if interpret:
        return list(family.interpret_quick if quick else family.kernel_tests)
    cuda = [f"{CUDA_TESTS}/{name}" for name in family.cuda_tests]
    return cuda if quick and cuda else cuda + list(family.kernel_tests)


def integration_test_args() -> list[str]:
    """``tests/cuda/`` less every file a family claims: custom ops, ``torch.compile``, NCCL, the KV cache."""
    claimed = [f"--ignore={CUDA_TESTS}/{name}" for family in KERNEL_FAMILIES for name in family.cuda_tests]
    return [CUDA_TESTS, *claimed]
