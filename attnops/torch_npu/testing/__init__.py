"""``torch_npu.testing``: the unittest base class and decorators torch_npu's and op-plugin's test files import
(:mod:`.testcase`, :mod:`.common_utils`, :mod:`.common_distributed`), so that those files run unmodified on the
stand-in device; SoC-specific tests run or skip by the SoC the stand-in reports (:mod:`attnops.torch_npu.soc`)."""
