"""The torch.distributed calls of context parallelism: ring P2P exchange, all-to-all, seed broadcast.

Every wait is a ``Work.wait()`` under the process group's timeout, so a peer that failed or died surfaces as an
exception on every rank (Gloo: connection closed or timeout; NCCL: the watchdog) instead of a hang.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._core.checks import Described, describe, fail, require
from .traffic import nbytes, record


@dataclass(frozen=True)
class GroupInfo:
    """This process's place in a process group: group rank, group size, global ranks of the ring neighbours."""

    group: object
    rank: int
    size: int
    next_global: int
    prev_global: int
    first_global: int


def group_info(group) -> GroupInfo:
    """Validate ``group`` (None = the default group) and return its :class:`GroupInfo`."""
    require(dist.is_available() and dist.is_initialized(), "group",
            "an initialized torch.distributed process group (call torch.distributed.init_process_group first)",
            Described("no process group"))
    if group is not None and not isinstance(group, dist.ProcessGroup):
        fail("group", "a torch.distributed.ProcessGroup or None (the default group)", Described(type(group).__name__))
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    require(rank >= 0, "group", "a process group this process belongs to", Described("a group without this rank"))

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    return GroupInfo(group, rank, size, global_rank((rank + 1) % size), global_rank((rank - 1) % size),
                     global_rank(0))


class RingExchange:
    """Send tensors to the next rank and receive same-shaped ones from the previous rank, asynchronously.

    ``start`` posts the sends/receives and returns at once (compute overlaps the transfer); ``wait`` returns the
    received tensors. Tags keep the tensors of one exchange apart. With one rank it is never started.
    """

    def __init__(self, info: GroupInfo, tensors: list[torch.Tensor], tag_base: int = 0):
        self.received = [torch.empty_like(t) for t in tensors]
        self._works = []
        for i, (t, buf) in enumerate(zip(tensors, self.received)):
            self._works.append(dist.irecv(buf, src=info.prev_global, group=info.group, tag=tag_base + i))
            self._works.append(dist.isend(t.contiguous(), dst=info.next_global, group=info.group, tag=tag_base + i))
            record("p2p", nbytes(t))

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        return self.received


def broadcast_seed(info: GroupInfo, seed: int, device: torch.device) -> int:
    """Group rank 0's ``seed`` on every rank (every rank must draw the same dropout masks); ``device``: the
    tensors' device (NCCL broadcasts GPU tensors). The one host read of context parallelism: only a dropout call
    without a ``seed`` broadcasts (and waits for) one; give ``seed`` to keep the call free of it."""
    t = torch.tensor([seed], dtype=torch.int64, device=device)
    if info.size > 1:
        if info.rank == 0:
            record("broadcast", (info.size - 1) * nbytes(t))
        dist.broadcast(t, src=info.first_global, group=info.group)
    return int(t.item())


def all_to_all(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 (which must have size ``info.size``): slot ``i`` goes to rank ``i``."""
    x = x.contiguous()
    if info.size == 1:
        return x
    out = torch.empty_like(x)
    record("all_to_all", nbytes(x) * (info.size - 1) // info.size)
    dist.all_to_all_single(out, x, group=info.group)
    return out


def all_gather(x: torch.Tensor, info: GroupInfo, kind: str = "all_gather") -> torch.Tensor:
    """Every rank's ``x`` stacked on a new dim 0 (``[P, *x.shape]``, slot ``i`` from rank ``i``)."""
    x = x.contiguous()
    if info.size == 1:
        return x.unsqueeze(0)
    out = x.new_empty((info.size * x.shape[0], *x.shape[1:]))  # Gloo takes the concatenation along dim 0
    record(kind, (info.size - 1) * nbytes(x))
    dist.all_gather_single(out, x, group=info.group)
    return out.unflatten(0, (info.size, x.shape[0]))


def reduce_scatter(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """Sum over ranks of slot ``rank`` of ``x`` (``[P, ...]``; slot ``i`` goes to rank ``i``)."""
    x = x.contiguous()
    if info.size == 1:
        return x[0]
    out = x.new_empty(x.shape[1:])
    record("reduce_scatter", nbytes(x) * (info.size - 1) // info.size)
    dist.reduce_scatter_single(out, x.flatten(0, 1), group=info.group)
    return out


_rank_checks = [True]


def set_rank_checks(enabled: bool) -> None:
    """Turn the cross-rank argument check of the context-parallel functions on (default) or off (it costs one
    small all-gather and a host read per call)."""
    _rank_checks[0] = bool(enabled)


def _fingerprint(value) -> str:
    """Tensors: shape, dtype, device (and the values of small host integer tensors: lengths); others: repr."""
    if isinstance(value, torch.Tensor):
        small_host_ints = value.device.type == "cpu" and not value.is_floating_point() and value.numel() <= 4096
        return describe(value) + (repr(value.tolist()) if small_host_ints else "")
    return repr(value)


def check_same_across_ranks(groups: GroupInfo | tuple[GroupInfo, ...], device: torch.device, **args) -> None:
    """Raise on every rank of ``groups``, naming the first argument whose value (tensors: shape and dtype) differs
    between ranks. Runs before any local validation, so a mismatch never leaves some ranks waiting in a collective
    that others skipped. Several groups (a mesh's dimensions) are checked in turn, each all-gather also carrying
    the verdict so far, so every rank of the mesh learns of a mismatch anywhere."""
    groups = groups if isinstance(groups, tuple) else (groups,)
    if all(g.size == 1 for g in groups) or not _rank_checks[0]:
        return
    args = {name: v for name, v in args.items() if not isinstance(v, dist.ProcessGroup)}
    names = list(args)
    codes = [zlib.crc32(_fingerprint(v).encode()) for v in args.values()]
    verdict = len(names)  # the index of the first differing argument found anywhere so far (len: none)
    for info in groups:
        if info.size == 1:
            continue
        gathered = all_gather(torch.tensor([*codes, verdict], dtype=torch.int64, device=device), info,
                              "rank_check").cpu()
        differs = (gathered[:, :-1] != gathered[0, :-1]).any(0).tolist() + [True]
        verdict = min(verdict, int(gathered[:, -1].min()), differs.index(True))
    if verdict < len(names):
        name = names[verdict]
        fail(name, "the same value on every rank of the group", Described(f"different values across ranks (rank "
             f"{dist.get_rank()}: {_fingerprint(args[name])})"))
