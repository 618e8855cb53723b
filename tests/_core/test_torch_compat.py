"""The private PyTorch names behind ``attnops._core.torch_compat``: all present on the tested PyTorch, a missing one
named in the error, custom ops' parts and schemas read through it, and the floor it names equals pyproject's."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import attnops
from attnops._core import torch_compat
from attnops._core.errors import TorchFeatureMissing

REPO = Path(__file__).resolve().parents[2]


def test_every_name_is_present_on_this_pytorch():
    assert torch_compat.missing() == []


def test_the_tested_version_is_pyprojects_floor():
    floor = re.search(r'"torch>=([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert torch_compat.TESTED == floor
    assert tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= tuple(map(int, floor.split(".")))


def test_a_missing_name_is_named_in_the_error():
    name = "torch._C:_attnops_no_such_internal"
    assert torch_compat.lookup(name) is None and torch_compat.lookup("no_such_module_xyz:thing") is None
    assert torch_compat.missing() == [] and torch_compat.lookup("torch._C:_attnops_no_such_internal") is None
    absent = torch_compat._bound(name)
    with pytest.raises(TorchFeatureMissing, match=r"_C\._attnops_no_such_internal, which"):
        absent(1, key=2)
    with pytest.raises(TorchFeatureMissing, match=r"PyTorch internal torch\._C\._attnops_no_such_internal, which "
                                                   rf"PyTorch {re.escape(torch.__version__)} lacks .*>= 2\.13"):
        torch_compat.require(name)


def test_custom_op_parts_and_schemas():
    op = attnops.ops.fused_infer_attention.op.fused_infer_attention
    assert callable(torch_compat.custom_op_part(op, "_init_fn"))
    names = [a.name for a in torch_compat.schema_arguments(op)]
    assert names[:3] == ["query", "key", "value"]
    assert [a.name for a in torch_compat.schema_arguments(torch.ops.aten.add.Tensor)] == ["self", "other", "alpha"]
    with pytest.raises(TorchFeatureMissing, match=r"_init_fn of a torch.library custom op \(object\), which PyTorch .* lacks"):
        torch_compat.custom_op_part(object(), "_init_fn")
    with pytest.raises(ValueError, match="part: expected one of"):
        torch_compat.custom_op_part(op, "_schema")


def test_the_autograd_keys_are_included_inside_the_guard():
    key = torch._C.DispatchKey.AutogradFunctionality
    with torch._C._AutoDispatchBelowAutograd():
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(key)
        with torch_compat.autograd_keys_included():
            assert not torch._C._dispatch_tls_is_dispatch_key_excluded(key)
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(key)


def test_dispatch_state_probes():
    from torch.utils._python_dispatch import TorchDispatchMode

    assert not torch_compat.dispatch_mode_active() and not torch_compat.functorch_transform_active()
    with TorchDispatchMode():
        assert torch_compat.dispatch_mode_active()
    seen = []
    torch.func.vmap(lambda x: seen.append(torch_compat.functorch_transform_active()) or x)(torch.zeros(2))
    assert seen == [True]
    assert not torch_compat.profiler_enabled()
    with torch.autograd.profiler.profile():
        assert torch_compat.profiler_enabled()
    assert torch_compat.dispatch_mode_base() is TorchDispatchMode


def test_dynamos_table_is_dropped():
    import torch._dynamo.trace_rules as trace_rules

    trace_rules.get_torch_obj_rule_map()
    assert trace_rules.get_torch_obj_rule_map.cache_info().currsize == 1
    torch_compat.forget_dynamo_torch_functions()
    assert trace_rules.get_torch_obj_rule_map.cache_info().currsize == 0
    assert "torch._dynamo.trace_rules" in sys.modules


def test_tensor_rebuild_and_tree_leaves():
    t = torch.arange(6.0)
    storage = torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)
    rebuilt = torch_compat.rebuild_tensor(storage, 1, (2, 2), (2, 1), False, {})
    assert torch.equal(rebuilt, t[1:5].view(2, 2))
    assert torch_compat.tree_leaves([t, {"a": (1, t)}]) == [t, 1, t]
    assert torch_compat.privateuse1_backend_name() in ("privateuseone", "npu")
    assert torch_compat.accelerator_hook_api() is not None
