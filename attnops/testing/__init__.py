"""Independent dense goldens and the tolerance rule used to judge the attention operators, and
:func:`gpu_dry_run` (the Triton path run on any device with launches recorded and host reads refused)."""
from .dry_run import HostSyncError, LaunchRecord, gpu_dry_run

__all__ = ["HostSyncError", "LaunchRecord", "gpu_dry_run"]
