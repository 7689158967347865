"""Field report 4: distributed evaluation by ``all_reduce``: a mean of per-rank means.

Rank ``r`` evaluates ``400 // (1 + 3 r)`` samples with an accuracy that falls with the rank (the hard samples were
filtered onto the later ranks). The truth is the accuracy over every sample.
"""

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics.aggregation import MeanMetric

from benchmarks.demo._common import NOTE, OURS, STOCK, TODAY, Method, Rows, Section, close, line
from torchmetrics_varlen import Metric, MetricCollection, ScalarLog, sync_scalars

TITLE = "4. Mean of means: per-rank means all-reduced and divided by the world size"


def correct(rank: int) -> torch.Tensor:
    """1.0 for every sample rank ``rank`` classified correctly, else 0.0."""
    gen = torch.Generator().manual_seed(90 + rank)
    return (torch.rand(400 // (1 + 3 * rank), generator=gen) < 0.9 - 0.25 * rank).float()


class PerRankMean(Metric):
    """A metric that keeps its mean in a ``dist_reduce_fx="mean"`` state (stock's mean over ranks)."""

    mean: torch.Tensor
    seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("mean", default=torch.tensor(0.0), dist_reduce_fx="mean")
        self.add_state("seen", default=torch.tensor(0.0), dist_reduce_fx=None)

    def update(self, value: torch.Tensor) -> None:
        """Fold a batch into the running mean of this rank."""
        self.mean = (self.mean * self.seen + value.sum()) / (self.seen + value.numel())
        self.seen = self.seen + value.numel()

    def compute(self) -> torch.Tensor:
        """The mean (over ranks, after the sync)."""
        return self.mean


def evaluate(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """This rank's accuracy, made global the way ``kind`` says (in batches of 32)."""
    data = correct(rank)
    if kind == "today":
        local = data.mean()
        dist.barrier()  # as in the usual recipe
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        return {"value": float(local / dist.get_world_size()), "warnings": []}
    if kind == "sync_scalars":  # the recipe's one-line replacement: each rank's mean, weighted by its samples
        return {"value": sync_scalars({"acc": data.mean()}, weight=data.numel())["acc"], "warnings": []}
    if kind == "stock":
        metric: Any = MeanMetric()
    elif kind == "ours":
        metric = MetricCollection({"acc": MeanMetric()})
    elif kind == "scalar_log":
        metric = ScalarLog()
    else:
        metric = PerRankMean()
    for start in range(0, data.numel(), 32):
        batch = data[start : start + 32]
        if kind == "scalar_log":  # a logged scalar per batch, weighted by the batch's size
            metric.update({"acc": batch.mean()}, weight=batch.numel())
        else:
            metric.update(batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = metric.compute()
    value = value["acc"] if isinstance(value, dict) else value
    return {"value": float(value), "warnings": [str(w.message) for w in caught]}


def methods(world_size: int) -> list[Method]:
    """The section's methods, in table order."""
    return [
        Method("all_reduce(SUM) / W (+ barrier)", TODAY, functools.partial(evaluate, kind="today")),
        Method("stock torchmetrics MeanMetric", STOCK, functools.partial(evaluate, kind="stock")),
        Method("ours: MetricCollection(MeanMetric)", OURS, functools.partial(evaluate, kind="ours")),
        Method("ours: sync_scalars(mean, weight=n)", OURS, functools.partial(evaluate, kind="sync_scalars")),
        Method("ours: ScalarLog, batch means", OURS, functools.partial(evaluate, kind="scalar_log")),
        Method('ours: a dist_reduce_fx="mean" state', NOTE, functools.partial(evaluate, kind="mean_state")),
    ]


WIDTHS = (36, 10, 40)


def render(world_size: int, rows: Rows) -> Section:
    """Each method's accuracy beside the accuracy over every sample."""
    everything = torch.cat([correct(rank) for rank in range(world_size)])
    expected = float(everything.double().mean())
    sizes = [correct(rank).numel() for rank in range(world_size)]
    lines = [
        f"{TITLE}: samples per rank {sizes}",
        line("method", "accuracy", "matches truth", widths=WIDTHS),
        line("single-process truth", f"{expected:.6f}", "(reference)", widths=WIDTHS),
    ]
    ok, notes = True, []
    for method in methods(world_size):
        row = rows[method.name]
        if isinstance(row, str):
            ok &= method.role != OURS or row.startswith("skipped")
            lines.append(line(method.name, "-", row, widths=WIDTHS))
            continue
        good = all(close(r["value"], expected) for r in row)
        ok &= good or method.role != OURS
        text = "yes" if good else "NO: a mean of per-rank means"
        if method.role == NOTE and not good:
            text += " (as stock)"
        lines.append(line(method.name, f"{row[0]['value']:.6f}", text, widths=WIDTHS))
        notes += [f"  warning on rank 0 ({method.name}): {message}" for message in row[0]["warnings"]]
    lines += notes or ['  (no warning was raised for the dist_reduce_fx="mean" state)']
    return Section("\n".join(lines), ok)
