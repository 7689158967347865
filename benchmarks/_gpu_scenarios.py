"""The scenarios of the GPU check (:mod:`benchmarks.gpu_check`), each a function every rank runs.

A scenario returns one line saying what it checked, raises ``AssertionError`` when the distributed result differs from
the single-process reference, :class:`~benchmarks._gpu_common.SkipError` when this machine cannot run it,
:class:`~benchmarks._gpu_common.NoteError` for a finding about the platform. Every rank generates every rank's data
from one seed, so the reference needs no communication. What the scenarios share (the context, the scenario record,
data, checks and small metrics) is in :mod:`benchmarks._gpu_common`.
"""

import copy
import re
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryAveragePrecision, MulticlassAUROC
from torchmetrics.functional.classification import (
    binary_accuracy,
    binary_auroc,
    binary_average_precision,
    multiclass_auroc,
)

import torchmetrics_varlen as tv
from benchmarks._gpu_common import (
    Ctx,
    NoteError,
    Scenario,
    SkipError,
    _BatchMSE,
    _binary,
    _close,
    _Count,
    _Mixed,
    _on,
    _sizes,
    _SumCat,
    _update,
)
from torchmetrics_varlen import SyncTimeoutError, gather_all_tensors, rebase
from torchmetrics_varlen.losses import SoftF1Loss

__all__ = ["SCENARIOS"]

LATE_SECONDS = 3.0  # how late the late rank arrives
LATE_TIMEOUT = 10.0  # its peers' sync_timeout: longer than the delay, so no error is allowed
MISSING_TIMEOUT = 3.0  # sync_timeout of the missing-rank scenario
REUSE_WAIT = 10.0  # how long the DDP-style all_reduce after a timeout may take before it counts as stuck


# ----------------------------------------------------------------------------------------------------- scenarios
def _uneven_empty_hook(ctx: Ctx) -> str:
    sizes = _sizes(ctx.world_size, empty=ctx.world_size - 1)
    preds, target = _binary(sum(sizes), seed=1)
    metric = BinaryAUROC(thresholds=None, dist_sync_fn=gather_all_tensors).to(ctx.device)
    _update(metric, *ctx.local((preds, target), sizes))
    got = metric.compute()
    _close("BinaryAUROC", got, binary_auroc(preds, target, thresholds=None))
    _on("BinaryAUROC", got, ctx.device)
    return f"BinaryAUROC(dist_sync_fn=gather_all_tensors), samples per rank {sizes}: {got.item():.6f}, as one process"


def _uneven_empty_rebased(ctx: Ctx) -> str:
    sizes = _sizes(ctx.world_size, empty=0)
    gen = torch.Generator().manual_seed(2)
    preds = torch.randn(sum(sizes), 3, generator=gen).softmax(-1)
    target = torch.randint(0, 3, (sum(sizes),), generator=gen)
    metric = rebase(MulticlassAUROC)(num_classes=3, thresholds=None).to(ctx.device)
    cat = _SumCat().to(ctx.device)
    local_preds, local_target = ctx.local((preds, target), sizes)
    _update(metric, local_preds, local_target)
    _update(cat, local_preds[:, 0])
    got = metric.compute()
    _close("MulticlassAUROC", got, multiclass_auroc(preds, target, num_classes=3, thresholds=None))
    _on("MulticlassAUROC", got, ctx.device)
    total, values = cat.compute()
    _close("sum state", total, preds[:, 0].double().sum(), rtol=1e-6)
    _close("cat state", values, preds[:, 0], rtol=0, atol=0)
    return f"rebase(MulticlassAUROC) and a Metric with sum + cat states, samples per rank {sizes}: as one process"


def _collection(ctx: Ctx) -> str:
    sizes = _sizes(ctx.world_size, empty=ctx.world_size // 2, base=23)
    preds, target = _binary(sum(sizes), seed=3)
    members = {
        "auroc": BinaryAUROC(thresholds=None),
        "ap": BinaryAveragePrecision(thresholds=None),
        "acc": BinaryAccuracy(),
        "count": _Count(),
    }
    metrics = tv.MetricCollection(members).to(ctx.device)
    _update(metrics, *ctx.local((preds, target), sizes))
    got = metrics.compute()
    expected = {
        "auroc": binary_auroc(preds, target, thresholds=None),
        "ap": binary_average_precision(preds, target, thresholds=None),
        "acc": binary_accuracy(preds, target),
        "count": torch.tensor(sum(sizes)),
    }
    for name, value in expected.items():
        _close(name, got[name], value)
        _on(name, got[name], ctx.device)
    return f"MetricCollection of AUROC, AP, accuracy and a count, samples per rank {sizes}: as one process"


def _compute_on_rank(ctx: Ctx) -> str:
    sizes = _sizes(ctx.world_size, empty=0, base=29)
    preds, target = _binary(sum(sizes), seed=10)
    metric = BinaryAUROC(thresholds=None).to(ctx.device)
    _update(metric, *ctx.local((preds, target), sizes))
    dst = ctx.world_size - 1
    got = tv.compute_on_rank(metric, dst=dst)
    _close("BinaryAUROC", got, binary_auroc(preds, target, thresholds=None))
    _on("BinaryAUROC", got, ctx.device)
    return f"compute_on_rank(BinaryAUROC, dst={dst}) (gather + broadcast), samples per rank {sizes}: as one process"


def _cpu_states(ctx: Ctx) -> str:
    sizes = _sizes(ctx.world_size, empty=ctx.world_size - 1, base=31)
    preds, target = _binary(sum(sizes), seed=4)
    metric = rebase(BinaryAUROC)(thresholds=None, compute_on_cpu=True).to(ctx.device)
    hook = BinaryAUROC(thresholds=None, compute_on_cpu=True, dist_sync_fn=gather_all_tensors).to(ctx.device)
    local = ctx.local((preds, target), sizes)
    _update(metric, *local)
    _update(hook, *local)
    devices = {str(t.device) for m in (metric, hook) for t in m.preds}
    if devices - {"cpu"}:
        raise AssertionError(f"compute_on_cpu=True left list states on {sorted(devices)}")
    expected = binary_auroc(preds, target, thresholds=None)
    _close("rebase(BinaryAUROC)", metric.compute(), expected)
    _close("BinaryAUROC via the hook", hook.compute(), expected)
    where = "CUDA updates, list states moved to the CPU" if ctx.device.type == "cuda" else "CPU states"
    return f"compute_on_cpu=True ({where}) synced over the {ctx.backend} job group: as one process"


def _device_states_gloo(ctx: Ctx) -> str:
    sizes = _sizes(ctx.world_size, empty=0, base=17)
    preds, target = _binary(sum(sizes), seed=5)
    group = ctx.side_gloo
    rebased = rebase(BinaryAUROC)(thresholds=None, process_group=group).to(ctx.device)
    hook = BinaryAUROC(thresholds=None, process_group=group, dist_sync_fn=gather_all_tensors).to(ctx.device)
    dense = _SumCat(process_group=group).to(ctx.device)
    local = ctx.local((preds, target), sizes)
    _update(rebased, *local)
    _update(hook, *local)
    _update(dense, local[0])
    expected = binary_auroc(preds, target, thresholds=None)
    for what, metric in (("rebase(BinaryAUROC)", rebased), ("BinaryAUROC via the hook", hook)):
        got = metric.compute()
        _close(what, got, expected)
        _on(what, got, ctx.device)
    total, values = dense.compute()
    _close("sum state", total, preds.double().sum(), rtol=1e-6)
    _close("cat state", values, preds, rtol=0, atol=0)
    _on("cat state", values, ctx.device)
    kind = "CUDA" if ctx.device.type == "cuda" else "CPU (--cpu stand-in for CUDA)"
    return f"{kind} states over a dist.new_group(backend='gloo') group, results back on {ctx.device}: as one process"


def _mixed_devices(ctx: Ctx) -> str:
    if ctx.device.type != "cuda":
        raise SkipError("needs a GPU: one state on the CPU, one on CUDA")
    sizes = _sizes(ctx.world_size, empty=ctx.world_size - 1)
    values, _ = _binary(sum(sizes), seed=6)
    metric = _Mixed().to(ctx.device)
    _update(metric, *ctx.local((values,), sizes))
    # Each state comes back on the device this rank kept it on, as stock's would: the CPU where update() moved it,
    # the metric's device on the empty rank, which never ran update().
    expected = (metric.total.device, ctx.device)
    total, gathered = metric.compute()
    _close("sum state (CPU)", total, values.double().sum(), rtol=1e-6)
    _close("cat state (CUDA)", gathered, values, rtol=0, atol=0)
    if metric.devices != expected:
        raise AssertionError(f"expected synced states on {expected} but compute() saw them on {metric.devices}")
    return (
        f"one metric, a CPU sum state (on the metric's device on the empty rank) and a {ctx.device} cat state, over"
        f" {ctx.backend}: each back on the device its rank kept it on"
    )


def _soft_f1(logits: Tensor, target: Tensor) -> Tensor:
    prob = torch.sigmoid(logits)
    f1 = 2 * (prob * target).sum(0) / (prob.sum(0) + target.sum(0))
    return 1 - f1.mean() + (logits**2).mean()


def _soft_f1_loss(probs: Tensor, target: Tensor, eps: float = 1e-8) -> Tensor:
    """The formula of :class:`~torchmetrics_varlen.losses.SoftF1Loss`, in one process."""
    tp, fp, fn = (probs * target).sum(), (probs * (1 - target)).sum(), ((1 - probs) * target).sum()
    return 1 - 2 * tp / (2 * tp + fp + fn + eps)


def _sync_grads(ctx: Ctx) -> str:
    sizes = _sizes(ctx.world_size, empty=ctx.world_size - 1, base=5)
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(sum(sizes), 4, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 2, (sum(sizes), 3), generator=gen).double()
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 3).double()
    model = ctx.ddp(copy.deepcopy(reference))
    x, t = ctx.local((features, target), sizes)
    tol = {"rtol": 1e-7, "atol": 1e-10}

    # 1. The hook, differentiable: DDP averages the ranks' gradients of the same global loss.
    loss = _soft_f1(torch.cat(gather_all_tensors(model(x), sync_grads=True)), target.to(ctx.device))
    loss.backward()  # type: ignore[no-untyped-call]
    _soft_f1(reference(features), target).backward()  # type: ignore[no-untyped-call]
    for (name, got), expected in zip(model.module.named_parameters(), reference.parameters()):
        _close(f"gather_all_tensors(sync_grads=True): grad of {name}", got.grad, expected.grad, **tol)

    # 2. A metric as the loss: SoftF1Loss(sync_grads=True), a per-step sync inside forward.
    model.zero_grad()
    reference.zero_grad()
    metric = SoftF1Loss(sync_grads=True).to(ctx.device)
    loss = metric(torch.sigmoid(model(x)), t)
    loss.backward()  # type: ignore[no-untyped-call]
    expected_loss = _soft_f1_loss(torch.sigmoid(reference(features)), target)
    expected_loss.backward()  # type: ignore[no-untyped-call]
    _close("SoftF1Loss value", loss, expected_loss, **tol)
    for (name, got), expected in zip(model.module.named_parameters(), reference.parameters()):
        _close(f"SoftF1Loss(sync_grads=True): grad of {name}", got.grad, expected.grad, **tol)
    return f"DDP parameter gradients equal one process's (hook and SoftF1Loss), samples per rank {sizes}"


def _join(ctx: Ctx) -> str:
    steps = [max(0, 6 - 3 * r) for r in range(ctx.world_size)]
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    batches = [
        (torch.randn(3 + s % 3, 4, generator=gen).double(), torch.randn(3 + s % 3, generator=gen).double())
        for s in range(steps[ctx.rank])
    ]
    torch.manual_seed(0)
    model = ctx.ddp(torch.nn.Linear(4, 1).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    metric = _BatchMSE().to(ctx.device)
    manager = tv.join(model, metric)  # a metric is no joinable of its own: a plain Join of it is refused
    how = "torchmetrics_varlen.join(model, metric)"
    seen_preds, seen_target = [], []
    with manager:
        for x, y in batches:
            preds = model(x.to(ctx.device)).squeeze(-1)
            loss = metric(preds, y.to(ctx.device))
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            seen_preds.append(preds.detach().cpu())
            seen_target.append(y)
    epoch = metric.compute()
    # Reference: every sample any rank evaluated, collected on the control group and scored by one process.
    pieces = ctx.gather_objects((seen_preds, seen_target))
    all_preds = torch.cat([p for preds, _ in pieces for p in preds])
    all_target = torch.cat([t for _, targets in pieces for t in targets])
    _close("epoch MSE", epoch, ((all_preds - all_target) ** 2).mean(), rtol=1e-10, atol=1e-12)
    return f"{how}, DDP with a per-step metric loss, steps per rank {steps}: no hang, epoch value as one process"


def _late_rank(ctx: Ctx) -> str:
    sizes = _sizes(ctx.world_size, empty=-1, base=7)
    values, _ = _binary(sum(sizes), seed=8)
    metric = _SumCat(sync_timeout=LATE_TIMEOUT).to(ctx.device)
    _update(metric, *ctx.local((values,), sizes))
    late = ctx.world_size - 1
    if ctx.rank == late:
        time.sleep(LATE_SECONDS)
    start = time.monotonic()
    total, gathered = metric.compute()  # any error fails the scenario
    waited = time.monotonic() - start
    _close("sum state", total, values.double().sum(), rtol=1e-6)
    _close("cat state", gathered, values, rtol=0, atol=0)
    return (
        f"rank {late} arrived {LATE_SECONDS:g} s late, sync_timeout={LATE_TIMEOUT:g}: no error, as one process"
        f" (rank 0 waited {waited:.1f} s)"
    )


def _missing_rank(ctx: Ctx) -> str:
    absent = ctx.world_size - 1
    sizes = _sizes(ctx.world_size, empty=-1, base=7)
    values, _ = _binary(sum(sizes), seed=9)
    metric = _SumCat(sync_timeout=MISSING_TIMEOUT).to(ctx.device)
    _update(metric, *ctx.local((values,), sizes))
    if ctx.rank == absent:
        # It waits for the others at the verdict exchange, on the control group.
        return f"rank {absent} skipped compute() on purpose"
    _, waited = _await_missing(metric, absent)
    total = metric.total.item()
    expected_total = ctx.local((values,), sizes)[0].double().sum().item()
    if abs(total - expected_total) > 1e-9 * max(1.0, abs(expected_total)):
        raise AssertionError(f"after the timeout the local sum state is {total}, expected {expected_total}")
    return (
        f"SyncTimeoutError after {waited:.1f} s (sync_timeout={MISSING_TIMEOUT:g}) names rank {absent};"
        " local states intact"
    )


def _await_missing(metric: Any, absent: int) -> tuple[str, float]:
    """``metric.compute()`` on a rank whose peer ``absent`` never syncs: the SyncTimeoutError's message and the wait.

    Fails (AssertionError) unless it raises SyncTimeoutError naming rank ``absent`` in a ``[list]``.
    """
    start = time.monotonic()
    try:
        metric.compute()
    except SyncTimeoutError as err:
        message = str(err)
    except RuntimeError as err:
        raise AssertionError(f"expected SyncTimeoutError but got {type(err).__name__}: {err}") from err
    else:
        raise AssertionError(f"rank {absent} never synced, yet compute() returned: expected SyncTimeoutError")
    waited = time.monotonic() - start
    named = {int(n) for found in re.findall(r"\[(\d[\d, ]*)\]", message) for n in found.split(",")}
    if absent not in named:
        raise AssertionError(f"SyncTimeoutError does not name rank {absent} in a [list]: {message}")
    return message, waited


def _group_after_timeout(ctx: Ctx) -> str:
    # DDP's gradient buckets: an all_reduce on the job's group, issued by every rank, absent one included.
    value = torch.ones(1, device=ctx.device)
    what = f"after the SyncTimeoutError, a DDP-style all_reduce on the {ctx.backend} job group"
    try:
        work = dist.all_reduce(value, async_op=True)
        deadline = time.monotonic() + REUSE_WAIT
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not work.is_completed():
            raise NoteError(
                f"{what} did not complete within {REUSE_WAIT:g} s: the sync that timed out is still pending on the"
                " group, and the next collective pairs with it. End the job, or let the late rank arrive."
            )
        work.wait()
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise NoteError(f"{what} failed ({type(err).__name__}: {first}): the group is not reusable") from err
    if value.item() != ctx.world_size:
        raise NoteError(f"{what} returned {value.item()} instead of {ctx.world_size}: it paired with the pending sync")
    return f"{what} completed with the right sum: the group is still usable"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("uneven-empty-hook", "uneven and empty ranks, stock metric with the hook", _uneven_empty_hook),
    Scenario("uneven-empty-rebased", "uneven and empty ranks, rebased metric and a Metric", _uneven_empty_rebased),
    Scenario("collection", "a MetricCollection of four members", _collection),
    Scenario("compute-on-rank", "one-rank compute: gather to one rank, broadcast the result", _compute_on_rank),
    Scenario("cpu-states", "compute_on_cpu=True: CPU states over the job group (NCCL on GPUs)", _cpu_states),
    Scenario("device-states-gloo", "CUDA states over a gloo group", _device_states_gloo),
    Scenario("mixed-devices", "states on two devices in one metric", _mixed_devices),
    Scenario("sync-grads", "sync_grads=True under DDP", _sync_grads),
    Scenario("join", "Join with uneven steps and DDP", _join),
    Scenario("late-rank", "a rank 3 s late with sync_timeout=10", _late_rank),
    Scenario("missing-rank", "a rank that never syncs: SyncTimeoutError naming it", _missing_rank),
    Scenario("group-after-timeout", "the job's group after the timeout, used by an all_reduce", _group_after_timeout),
)
