"""GPU-check scenarios of where a sync runs (issue 20, items 2 to 4): backend, device, autograd thread, stream.

Each is a function every rank runs (see :mod:`benchmarks._gpu_scenarios` for the conventions): it returns a line
saying what it checked, raises ``AssertionError`` when a result differs from one process's,
:class:`~benchmarks._gpu_common.SkipError` (with the reason) where this machine cannot run it. Each makes its own
process groups, so it does not depend on what earlier scenarios left on the job's group.

What a GPU shows and gloo cannot: a rank whose states are all empty meeting its peers in the NCCL communicator of a
``"cpu:gloo,cuda:nccl"`` group; a group bound with ``device_id`` while the current device is 0 on every local rank;
the backward all-reduce of a ``sync_grads`` metric issued from the CUDA autograd thread, where DDP's hooks run, also
for CPU states; a sync issued on a side stream. The decisions behind them are tested on gloo (tests/test_policy.py,
tests/test_device_choice.py).
"""

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torchmetrics.classification import BinaryAUROC
from torchmetrics.functional.classification import binary_auroc

import torchmetrics_varlen as tv
from benchmarks._gpu_common import (
    Ctx,
    NoteError,
    Scenario,
    SkipError,
    _binary,
    _close,
    _on,
    _SumCat,
    _update,
)
from torchmetrics_varlen import gather_all_tensors, rebase
from torchmetrics_varlen._engine.group import link
from torchmetrics_varlen.losses import SoftF1Loss

__all__ = ["SCENARIOS"]


def _sizes(world_size: int, empty: int, base: int = 13) -> list[int]:
    return [0 if r == empty else base + 7 * r for r in range(world_size)]


def _two_backend_group(ctx: Ctx) -> tuple[Any, str]:
    """A group with one backend per device type: NCCL for CUDA where each rank has a GPU, else stand-ins."""
    backend = {"nccl": "cpu:gloo,cuda:nccl", "shared": "cpu:gloo,cuda:gloo"}.get(ctx.mode, "cpu:gloo")
    return dist.new_group(backend=backend), backend


def _two_backend_empty_rank(ctx: Ctx) -> str:
    group, backend = _two_backend_group(ctx)
    sizes = _sizes(ctx.world_size, empty=0)  # rank 0 never updates: its list states stay []
    preds, target = _binary(sum(sizes), seed=21)
    on_group: dict[str, Any] = {"process_group": group}
    dense = _SumCat(**on_group).to(ctx.device)
    rebased = rebase(BinaryAUROC)(thresholds=None, **on_group).to(ctx.device)
    hook = BinaryAUROC(thresholds=None, dist_sync_fn=gather_all_tensors, **on_group).to(ctx.device)
    # compute_on_cpu: the ranks with data hold CPU list states, the empty rank sends torchmetrics' placeholder on the
    # metric's (CUDA) device: the hook must still pick one backend on every rank.
    hook_cpu = BinaryAUROC(thresholds=None, compute_on_cpu=True, dist_sync_fn=gather_all_tensors, **on_group)
    hook_cpu = hook_cpu.to(ctx.device)
    one_rank = BinaryAUROC(thresholds=None, **on_group).to(ctx.device)
    local = ctx.local((preds, target), sizes)
    for metric in (rebased, hook, hook_cpu, one_rank):
        _update(metric, *local)
    _update(dense, local[0])
    group_link = link(group, dense.device, None, "two-backend-empty-rank")
    assert group_link is not None  # a group of every rank: more than one
    kinds = ctx.gather_objects(group_link.policy.device.type)
    if len(set(kinds)) != 1:
        raise AssertionError(f"the ranks picked different kinds of buffer device: {kinds}")
    expected = binary_auroc(preds, target, thresholds=None)
    for what, metric in (("rebase(BinaryAUROC)", rebased), ("hook", hook), ("hook, compute_on_cpu", hook_cpu)):
        _close(what, metric.compute(), expected)
    got = tv.compute_on_rank(one_rank, dst=0)  # the empty rank computes
    _close("compute_on_rank", got, expected)
    _on("compute_on_rank", got, ctx.device)
    total, values = dense.compute()
    _close("sum state", total, preds.double().sum(), rtol=1e-6)
    _close("cat state", values, preds, rtol=0, atol=0)
    _on("cat state", values, ctx.device)
    return f"group {backend!r}, samples per rank {sizes} (rank 0 empty): every rank on {kinds[0]}, as one process"


def _device_id_without_set_device(ctx: Ctx) -> str:
    if ctx.mode != "nccl":
        raise SkipError("needs NCCL with a GPU per rank: device_id binds a group to a GPU")
    torch.cuda.set_device(0)  # as a job that never calls set_device: the current device is 0 on every local rank
    try:
        group = dist.new_group(backend="nccl", device_id=ctx.device)
        bound = getattr(group, "bound_device_id", None)
        if bound != ctx.device:
            raise NoteError(f"new_group(device_id={ctx.device}) left bound_device_id={bound}: nothing to check")
        sizes = _sizes(ctx.world_size, empty=ctx.world_size - 1)
        values, _ = _binary(sum(sizes), seed=22)
        metric = _SumCat(process_group=group)  # CPU states: only the bound device tells which GPU is this rank's
        _update(metric, *ctx.local((values,), sizes))
        total, gathered = metric.compute()
        pieces = gather_all_tensors(ctx.local((values,), sizes)[0].cpu(), group=group)
    finally:
        torch.cuda.set_device(ctx.device)
    _close("sum state", total, values.double().sum(), rtol=1e-6)
    _close("cat state", gathered, values, rtol=0, atol=0)
    _close("hook", torch.cat(pieces), values, rtol=0, atol=0)
    return f"new_group(backend='nccl', device_id={ctx.device}), current device 0 everywhere: CPU states on {bound}"


def _soft_f1_loss(probs: Tensor, target: Tensor, eps: float = 1e-8) -> Tensor:
    tp, fp, fn = (probs * target).sum(), (probs * (1 - target)).sum(), ((1 - probs) * target).sum()
    return 1 - 2 * tp / (2 * tp + fp + fn + eps)


def _sync_grads_ddp(ctx: Ctx, states_on_cpu: bool) -> str:
    group = dist.new_group()  # the job's backend; its own, so no earlier scenario's leftovers pair with it
    sizes = _sizes(ctx.world_size, empty=ctx.world_size - 1, base=6)
    gen = torch.Generator().manual_seed(23)
    features = torch.randn(sum(sizes), 4, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 2, (sum(sizes), 3), generator=gen).double()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # Tiny buckets: one DDP all-reduce per parameter, issued from the autograd thread while ours is pending.
    model = DistributedDataParallel(
        copy.deepcopy(reference).to(ctx.device), device_ids=device_ids, process_group=group, bucket_cap_mb=1e-6
    )
    metric = SoftF1Loss(sync_grads=True, process_group=group)
    if not states_on_cpu:
        metric = metric.to(ctx.device)
    x, t = ctx.local((features, target), sizes)
    steps = 2  # the second step pairs with whatever the first left behind
    for _ in range(steps):
        model.zero_grad()
        probs = torch.sigmoid(model(x))
        loss = metric(probs.cpu(), t.cpu()) if states_on_cpu else metric(probs, t)
        loss.backward()  # type: ignore[no-untyped-call]
    reference.zero_grad()
    _soft_f1_loss(torch.sigmoid(reference(features)), target).backward()  # type: ignore[no-untyped-call]
    for (name, got), expected in zip(model.module.named_parameters(), reference.parameters()):
        _close(f"grad of {name} after step {steps}", got.grad, expected.grad, rtol=1e-7, atol=1e-10)
    where = "CPU states (updated with .cpu() tensors)" if states_on_cpu else f"states on {metric.device}"
    return (
        f"SoftF1Loss(sync_grads=True), {where}, DDP on {ctx.backend} with a bucket per parameter: grads as one process"
    )


def _sync_grads_cpu_states(ctx: Ctx) -> str:
    if ctx.device.type != "cuda":  # no CUDA autograd thread: nothing to race, the gradients are checked
        return _sync_grads_ddp(ctx, states_on_cpu=True)
    try:
        _sync_grads_ddp(ctx, states_on_cpu=True)
    except ValueError as err:  # refused on every rank: its backward would race DDP's buckets (FLAG_HOST_GRAD)
        if "hold them on the CPU while their process uses CUDA" not in str(err) or "metric.to(device)" not in str(err):
            raise
        return "SoftF1Loss(sync_grads=True) with CPU states in a CUDA process: ValueError on this rank, naming the fix"
    raise AssertionError("a differentiable sync of CPU states in a process that uses CUDA was not refused")


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 8)
        self.head_a = torch.nn.Linear(8, 3)  # a loss term of its own
        self.head_b = torch.nn.Linear(8, 3)  # feeds the metric

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        hidden = torch.tanh(self.trunk(x))
        return self.head_a(hidden), self.head_b(hidden)


def _slow(grad: Tensor) -> None:
    time.sleep(0.3)


def _two_heads_race(ctx: Ctx) -> str:
    """Opposite delays on two ranks: DDP's bucket for ``head_a`` and the metric's backward all-reduce race."""
    group = dist.new_group()
    gen = torch.Generator().manual_seed(29)
    features = torch.randn(8 * ctx.world_size, 4, generator=gen, dtype=torch.float64)
    target = (torch.rand(8 * ctx.world_size, 3, generator=gen) > 0.5).double()
    torch.manual_seed(0)
    reference = _TwoHeads().double()
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    model = DistributedDataParallel(
        copy.deepcopy(reference).to(ctx.device), device_ids=device_ids, process_group=group, bucket_cap_mb=1e-6
    )
    metric = SoftF1Loss(sync_grads=True, process_group=group).to(ctx.device)
    x, t = ctx.local((features, target), [8] * ctx.world_size)
    out_a, out_b = reference(features)
    (out_a.square().mean() + _soft_f1_loss(torch.sigmoid(out_b), target)).backward()  # type: ignore[no-untyped-call]
    steps = 4  # DDP rebuilds its buckets after the first step: the race can show from the second
    for step in range(steps):
        model.zero_grad()
        metric.reset()
        a, b = model(x)
        if ctx.rank == 0:
            a.register_hook(_slow)  # delays head_a's gradients and DDP's bucket for them
        loss_b = metric(torch.sigmoid(b), t)
        if ctx.rank == 1:
            loss_b.register_hook(_slow)  # delays the metric's backward all-reduce
        (a.square().mean() + loss_b).backward()  # type: ignore[no-untyped-call]
        for (name, got), expected in zip(model.module.named_parameters(), reference.parameters()):
            _close(f"grad of {name} at step {step}", got.grad, expected.grad, rtol=1e-7, atol=1e-10)
    return (
        f"two heads, SoftF1Loss(sync_grads=True) on {metric.device} beside a loss term of its own, opposite delays on"
        f" ranks 0 and 1, DDP on {ctx.backend} with a bucket per parameter: {steps} steps, grads as one process"
    )


def _sync_grads_cuda_states(ctx: Ctx) -> str:
    return _sync_grads_ddp(ctx, states_on_cpu=False)


def _sync_in_stream(ctx: Ctx) -> str:
    if ctx.device.type != "cuda":
        raise SkipError("needs CUDA streams")
    group = dist.new_group()
    sizes = _sizes(ctx.world_size, empty=0, base=17)
    preds, target = _binary(sum(sizes), seed=24)
    dense = _SumCat(process_group=group).to(ctx.device)
    hook = BinaryAUROC(thresholds=None, process_group=group, dist_sync_fn=gather_all_tensors).to(ctx.device)
    side = torch.cuda.Stream(device=ctx.device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):  # data made, updated and synced on the side stream
        local = ctx.local((preds, target), sizes)
        _update(dense, local[0])
        _update(hook, *local)
        total, values = dense.compute()
        got = hook.compute()
    side.synchronize()
    _close("sum state", total, preds.double().sum(), rtol=1e-6)
    _close("cat state", values, preds, rtol=0, atol=0)
    _close("hook", got, binary_auroc(preds, target, thresholds=None))
    return f"update and compute inside torch.cuda.stream(side) on {ctx.backend}: as one process"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("two-backend-empty-rank", "a 'cpu:gloo,cuda:nccl' group, one rank with no data", _two_backend_empty_rank),
    Scenario(
        "device-id-no-set-device", "a group bound with device_id, current device 0", _device_id_without_set_device
    ),
    Scenario("sync-grads-cpu-states", "sync_grads with CPU states under DDP", _sync_grads_cpu_states),
    Scenario("sync-grads-cuda-states", "sync_grads with CUDA states under DDP", _sync_grads_cuda_states),
    Scenario("two-heads-race", "sync_grads beside a second loss head, opposite delays per rank", _two_heads_race),
    Scenario("sync-in-cuda-stream", "a sync issued inside torch.cuda.stream(...)", _sync_in_stream),
)
