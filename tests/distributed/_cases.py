"""Multi-process cases for the context-parallel tests (run inside ``torch.multiprocessing`` workers).

Every rank builds the same global inputs, runs the single-device :func:`attnops.flash_attention` (autograd) and the
fp64 golden, then the distributed call on its shard, and checks its local output and q/k/v gradients: against the
golden with FlashAttention's tolerance rule (baseline: the golden's formula in the input dtype, on the same shard)
and against the single-device attnops result (tight ``assert_close``). Results go to one JSON file per rank.
"""
from __future__ import annotations

import functools
import json
import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import attnops
from attnops._core.dropout import DropoutSpec, keep_mask
from attnops.distributed import (allgather_flash_attention, hybrid_dropout_mask, hybrid_flash_attention,
                                 hybrid_groups, hybrid_shard, ring_dropout_mask, ring_flash_attention, ring_shard,
                                 ulysses_flash_attention)
from attnops.distributed.sharding import SEQ_DIM
from attnops.ops.attention_update import blocked_to_tnd, tnd_to_blocked
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import fa_backward, fa_forward
from tests.helpers import F64, TRIU2048, cum, golden_kwargs, make_qkv, randn

SEED, OFFSET = 1234, 7


@dataclass(frozen=True)
class Case:
    name: str
    kind: str = "ring"  # "ring" | "ulysses" | "hybrid" | "allgather"
    layout: str = "BNSD"
    b: int = 1
    n1: int = 2
    n2: int | None = None
    s: int = 16  # global sequence length (dense)
    lens: tuple[int, ...] = ()  # global sequence lengths (TND)
    d: int = 8
    dv: int | None = None
    causal: bool = False
    alibi: int | None = None  # pse_type: 2/3 with slopes, 0/1 with a [1, N, S, S] tensor
    keep_prob: float = 1.0
    dtype: torch.dtype = torch.float32
    stats: bool = False  # also compare the returned softmax statistics (ring, hybrid)
    own_group: bool = False  # run on a one-rank group (world size 1)
    ulysses_degree: int = 1  # hybrid: the Ulysses group size (the ring group gets the rest of the world)
    split: str = "head_tail"  # allgather: "head_tail" (ring_shard) or "contiguous" (like Ulysses)


def _slopes(n: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / n) for i in range(n)], dtype=torch.float32)


def _single_device_kwargs(case: Case, world: int) -> tuple[dict, torch.Tensor | None]:
    kw = dict(layout=case.layout, head_num=case.n1, scale=0.3)
    if case.layout == "TND":
        kw.update(actual_seq_qlen=cum(case.lens), actual_seq_kvlen=cum(case.lens))
    if case.causal:
        kw.update(atten_mask=TRIU2048, sparse_mode=2)
    if case.alibi is not None:
        pse = _slopes(case.n1) if case.alibi in (2, 3) else randn(1, case.n1, case.s, case.s, seed=9, scale=0.5)
        kw.update(pse=pse, pse_type=case.alibi)
    drop_keep = None
    if case.keep_prob < 1.0:
        kw["keep_prob"] = case.keep_prob
        numel = case.n1 * (sum(n * n for n in case.lens) if case.layout == "TND" else case.b * case.s * case.s)
        dense = dict(batch=case.b, seq_len=case.s) if case.layout != "TND" else dict(actual_seq_len=cum(case.lens))
        if case.kind in ("ring", "hybrid"):
            common = dict(keep_prob=case.keep_prob, seed=SEED, offset=OFFSET, head_num=case.n1, **dense)
            kw["drop_mask"] = (ring_dropout_mask(world_size=world, **common) if case.kind == "ring" else
                               hybrid_dropout_mask(ulysses_degree=case.ulysses_degree,
                                                   ring_degree=world // case.ulysses_degree, **common))
            drop_keep = keep_mask(DropoutSpec(case.keep_prob, (), packed=kw["drop_mask"]), numel)
        else:
            kw.update(seed=SEED, offset=OFFSET)
            drop_keep = keep_mask(DropoutSpec(case.keep_prob, (), seed=SEED, offset=OFFSET), numel)
    return kw, drop_keep


def _distributed_kwargs(case: Case, kw: dict) -> dict:
    dkw = dict(layout=case.layout, head_num=case.n1, scale=kw["scale"], causal=case.causal)
    if case.layout == "TND":
        dkw["actual_seq_len"] = cum(case.lens)
    if case.alibi is not None:
        dkw.update(pse=kw["pse"], pse_type=case.alibi)
    if case.keep_prob < 1.0:
        dkw.update(keep_prob=case.keep_prob, seed=SEED, offset=OFFSET)
    return dkw


def _shard_fn(case: Case, rank: int, world: int, layout: str | None = None):
    """This rank's shard of a global tensor in ``layout`` (default: the case's)."""
    layout = layout or case.layout
    seqs = cum(case.lens) if case.layout == "TND" else None
    if case.kind == "ring" or (case.kind == "allgather" and case.split == "head_tail"):
        return lambda x: ring_shard(x, rank, world, layout=layout, actual_seq_len=seqs)
    if case.kind == "hybrid":
        u = case.ulysses_degree
        return lambda x: hybrid_shard(x, ulysses_rank=rank % u, ulysses_degree=u, ring_rank=rank // u,
                                      ring_degree=world // u, layout=layout, actual_seq_len=seqs)
    dim = SEQ_DIM[layout]
    return lambda x: x.narrow(dim, rank * x.shape[dim] // world, x.shape[dim] // world)


def run_case(case: Case, rank: int, world: int, group) -> None:
    q, k, v, dy = make_qkv(case.layout, b=case.b, n1=case.n1, n2=case.n2, sq=case.s, d=case.d, dv=case.dv,
                           q_lens=list(case.lens), kv_lens=list(case.lens), dtype=case.dtype, seed=3)
    kw, drop_keep = _single_device_kwargs(case, world)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    single = attnops.flash_attention(*leaves, return_stats=True, **kw)
    single.out.backward(dy)
    gkw = golden_kwargs(kw, drop_keep=drop_keep)
    golden = [fa_forward(q, k, v, dtype=F64, **gkw)[0], *fa_backward(dy, q, k, v, dtype=F64, **gkw)[:3]]
    base = [fa_forward(q, k, v, dtype=case.dtype, **gkw)[0], *fa_backward(dy, q, k, v, dtype=case.dtype, **gkw)[:3]]

    red = fa_reductions(q, k, v, layout=case.layout, head_num=case.n1, actual_seq_qlen=gkw.get("actual_seq_qlen"),
                        actual_seq_kvlen=gkw.get("actual_seq_kvlen"))
    shard = _shard_fn(case, rank, world)
    local = [shard(x).detach().clone().requires_grad_() for x in (q, k, v)]
    if case.kind == "hybrid":
        fn = functools.partial(hybrid_flash_attention, ulysses_group=group.ulysses, ring_group=group.ring)
    elif case.kind == "allgather":
        fn = functools.partial(allgather_flash_attention, group=group, split=case.split)
    else:
        fn = functools.partial(ring_flash_attention if case.kind == "ring" else ulysses_flash_attention, group=group)
    dkw = _distributed_kwargs(case, kw)
    if case.stats:
        true_tnd = case.kind == "hybrid" and case.layout == "TND"  # a hybrid slice holds no whole sequence
        res = fn(*local, return_stats=True, **dkw, **({"softmax_layout": "TND"} if true_tnd else {}))
        out = res.out
        for name, mine, ref in (("softmax_max", res.softmax_max, single.softmax_max),
                                ("softmax_sum", res.softmax_sum, single.softmax_sum)):
            if true_tnd:
                ref_local = shard(blocked_to_tnd(ref, list(case.lens)))
            elif case.layout == "TND":  # blocked per sequence: global lengths -> local lengths
                local_lens = [n // world for n in case.lens]
                ref_local = tnd_to_blocked(shard(blocked_to_tnd(ref, list(case.lens))).contiguous(), local_lens)
            else:  # [B, N, S, 8]
                ref_local = _shard_fn(case, rank, world, "BNSD")(ref)
            torch.testing.assert_close(mine, ref_local, rtol=1e-5, atol=1e-6, msg=name)
    else:
        out = fn(*local, **dkw)
    out.backward(shard(dy))
    actual = [out, *(x.grad for x in local)]
    single_all = [single.out, *(x.grad for x in leaves)]
    tight = dict(rtol=1e-5, atol=2e-6) if case.dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    for name, a, g, bl, s, factor in zip(("out", "dq", "dk", "dv"), actual, golden, base, single_all, (2, 3, 3, 3)):
        assert a.shape == shard(g).shape and a.dtype == case.dtype, (name, a.shape, a.dtype)
        assert_close_to_golden(f"{case.name}: {name}", a, shard(g), shard(bl), factor=factor, reduction=red[name])
        torch.testing.assert_close(a, shard(s.detach()), **tight, msg=lambda m: f"{case.name}: {name} vs single: {m}")


def _init(rank: int, world: int, init_file: str, timeout_s: float):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def write_results(out_dir: str, rank: int, results: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def run_cases(rank: int, world: int, cases: list[Case]) -> dict:
    """Every case's ``"ok"`` or traceback, on the initialized default group."""
    singletons = [dist.new_group([r]) for r in range(world)]
    hybrid = {u: hybrid_groups(u, world // u) for u in sorted({c.ulysses_degree for c in cases if c.kind == "hybrid"})}
    results = {}
    for case in cases:
        try:
            if case.own_group:
                run_case(case, 0, 1, singletons[rank])
            else:
                run_case(case, rank, world, hybrid[case.ulysses_degree] if case.kind == "hybrid" else None)
            results[case.name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[case.name] = traceback.format_exc()
    return results


HANG_GUARD_TIMEOUTS = 30


def _wait_for_files(paths: list[str], guard_s: float) -> bool:
    """Whether every file in ``paths`` exists before ``guard_s`` seconds pass (a hang guard, not a timing check)."""
    deadline = time.monotonic() + guard_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def failing_worker(rank: int, world: int, init_file: str, out_dir: str, timeout_s: float) -> None:
    """The last rank raises in its first backward step (after the KV exchange, before sending dK/dV) and stays
    alive until every other rank has reported (or a hang guard of ``HANG_GUARD_TIMEOUTS`` group timeouts passes):
    every other rank must raise by its own group timeout, not because the failed rank exited."""
    import attnops.distributed.ring as ring

    _init(rank, world, init_file, timeout_s)
    if rank == world - 1:
        def failing(*args, **kwargs):
            raise RuntimeError("injected failure")

        ring.flash_attention_backward = failing
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=4 * world, d=8, seed=rank)
    q.requires_grad_()
    try:
        ring_flash_attention(q, k, v, causal=True).backward(dy)
        outcome = "returned"
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        outcome = f"{type(e).__name__}: {e}"
    report = {"outcome": outcome}
    if rank == world - 1:
        others = [os.path.join(out_dir, f"rank{r}.json") for r in range(world - 1)]
        report["others_reported_while_alive"] = _wait_for_files(others, HANG_GUARD_TIMEOUTS * timeout_s)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    os._exit(0)  # the group is broken; skip the collective teardown
