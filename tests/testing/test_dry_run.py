"""``attnops.testing.gpu_dry_run``: launches recorded instead of run, host reads of device values refused with the
line that made them, no fallback to the reference."""
import pytest
import torch

from attnops._core import staging
from attnops._core.dispatch import choose_backend
from attnops._core.triton.launch import KernelFamily, Launch
from attnops._core.triton.support import interpreting
from attnops.testing import HostSyncError, gpu_dry_run

META = torch.device("meta")


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(),
    lambda t: int(t[0]),
    lambda t: bool((t > 0).any()),
    lambda t: t.tolist(),
    lambda t: t.cpu(),
    lambda t: t.to("cpu"),
    lambda t: t.nonzero(),
    lambda t: t[t > 0],
    lambda t: torch.equal(t, t),
])
def test_host_reads_of_device_values_raise_naming_the_line(read):
    t = torch.zeros(4, device=META)
    with pytest.raises(HostSyncError, match="test_dry_run.py|outside attnops"):
        with gpu_dry_run():
            read(t)


def test_blocking_uploads_raise_and_staged_uploads_pass():
    with gpu_dry_run():
        with pytest.raises(HostSyncError, match="blocking host-to-device copy"):
            torch.tensor([1, 2]).to(META)
        with pytest.raises(HostSyncError, match="blocking host-to-device copy"):
            torch.empty(2, device=META).copy_(torch.tensor([1.0, 2.0]))
        for make in (torch.tensor, torch.as_tensor):
            with pytest.raises(HostSyncError, match="blocking host-to-device copy"):
                make([1, 2], device=META)
        staged = staging.upload([[1, 2], [3, 4]], torch.int64, META)
        assert staged.device == META and staged.shape == (2, 2)
        first = staging.cached_upload(("test", 1), lambda: [5, 6], torch.int32, META)
        assert staging.cached_upload(("test", 1), lambda: [7, 8], torch.int32, META) is first


def test_reads_are_allowed_without_the_check():
    with gpu_dry_run(check_host_reads=False):
        torch.tensor([1, 2]).to(META)


def test_every_device_takes_the_triton_path_and_a_refusal_raises():
    with gpu_dry_run():
        assert not interpreting(META) and not interpreting(torch.device("cpu"))
        assert choose_backend("auto", META, lambda: None) == "triton"
        with pytest.raises(RuntimeError, match="would run the reference.*no kernel for this"):
            choose_backend("auto", META, lambda: "no kernel for this")
    assert choose_backend("auto", META, lambda: None) == "reference"  # outside: meta is no GPU


def _family():
    import triton

    return KernelFamily("flash_attention", ("attnops.ops.common.triton.fwd",
                                            "attnops.ops.common.triton.bwd"),
                        lambda launch, args, interpret: [triton.Config({"BLOCK_M": 32}, num_warps=2, num_stages=1),
                                                         triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2)])


def test_launches_are_recorded_with_the_first_tile_configuration():
    x = torch.empty(8, device=META)
    launch = Launch("preprocess_kernel", (100, 3), (x, x, x), dict(BLOCK_DV=16), "BLOCK_M")
    with gpu_dry_run() as launches:
        _family().run(launch, META)
    (record,) = launches
    assert (record.kernel, record.grid, record.num_warps) == ("preprocess_kernel", (4, 3), 2)
    assert record.constexprs == {"BLOCK_DV": 16, "BLOCK_M": 32}


def test_a_kernel_argument_built_on_the_host_raises():
    x = torch.empty(8, device=META)
    launch = Launch("preprocess_kernel", (100, 3), (x, torch.zeros(8), x), dict(BLOCK_DV=16), "BLOCK_M")
    with gpu_dry_run(), pytest.raises(HostSyncError, match="gets do_ptr on cpu"):
        _family().run(launch, META)
