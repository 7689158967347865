"""The scale benchmark's measurements on real gloo processes: bytes per rank of one sync, and small-metric latency.

Bytes are counted by wrapping the ``torch.distributed`` collectives (:class:`tests._meters.ByteMeter`), for the
8-metric collection, a ``MulticlassConfusionMatrix``, a FID-like metric and ``BinaryAccuracy``, stock torchmetrics vs
ours; latency is one ``BinaryAccuracy`` compute() and sync, ours vs stock vs one raw all-gather of the states' bytes,
interleaved. Byte counts are exact whatever the machine's load; times are medians on a shared machine: compare within a
run.
"""

import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks._timing import interleaved_medians
from benchmarks.bench import _feed_eight, eight_metric_members  # the 8-metric case is the benchmark's
from tests._meters import ByteMeter
from torchmetrics_varlen._engine.group import RECORD_WINDOW
from torchmetrics_varlen._engine.record import record_words

Row = dict[str, Any]


# --------------------------------------------------------------------------------------------------- the cases
def _moments_states(metric: Any, dim: int) -> None:
    # FID's states for one image set: a feature sum, a sum of outer products and a count (float64 sums).
    metric.add_state("feature_sum", torch.zeros(dim, dtype=torch.float64), dist_reduce_fx="sum")
    metric.add_state("cov_sum", torch.zeros(dim, dim, dtype=torch.float64), dist_reduce_fx="sum")
    metric.add_state("count", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")


def _moments_update(metric: Any, features: Tensor) -> None:
    features = features.double()
    metric.feature_sum += features.sum(0)
    metric.cov_sum += features.T @ features
    metric.count += features.shape[0]


def _moments_compute(metric: Any) -> Tensor:
    mean = metric.feature_sum / metric.count
    cov = (metric.cov_sum - metric.count * torch.outer(mean, mean)) / (metric.count - 1)
    return torch.trace(cov)  # a cheap stand-in for FID's matrix square root: the sync is what is measured


def fid_like_classes() -> tuple[type, type]:
    """A FID-like metric (the states of FID's real-image half), as a stock metric and as a ``tv.Metric``.

    Example:
        >>> stock_cls, ours_cls = fid_like_classes()
        >>> metric = ours_cls(dim=4)
        >>> metric.update(torch.ones(3, 4))
        >>> metric.compute()
        tensor(0., dtype=torch.float64)
    """
    import torchmetrics

    import torchmetrics_varlen as tv

    class StockFeatureMoments(torchmetrics.Metric):
        def __init__(self, dim: int = 1024, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            _moments_states(self, dim)

        def update(self, features: Tensor) -> None:
            _moments_update(self, features)

        def compute(self) -> Tensor:
            return _moments_compute(self)

    class FeatureMoments(tv.Metric):
        def __init__(self, dim: int = 1024, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            _moments_states(self, dim)

        def update(self, features: Tensor) -> None:
            _moments_update(self, features)

        def compute(self) -> Tensor:
            return _moments_compute(self)

    return StockFeatureMoments, FeatureMoments


def case_sizes(quick: bool) -> dict[str, int]:
    """Sizes of the byte cases: confusion matrix classes, FID-like feature dimension, 8-metric samples."""
    return (
        {"classes": 100, "features": 64, "samples": 200}
        if quick
        else {"classes": 1000, "features": 1024, "samples": 700}
    )


# A per-step metric syncs at every step: it is measured once its group's record length has settled (after two
# windows of its syncs), when its records are as long as it needs; its first syncs on a group travel longer.
SETTLED_CASE = "BinaryAccuracy, per step"


def case_names(quick: bool) -> list[str]:
    """The byte cases, in table order."""
    sizes = case_sizes(quick)
    return [
        "8-metric collection",
        f"MulticlassConfusionMatrix({sizes['classes']})",
        f"FID-like ({sizes['features']} features)",
        SETTLED_CASE,
    ]


def build_case(name: str, side: str, rank: int, quick: bool) -> Any:
    """One side ("stock" or "varlen") of a byte case, fed with this rank's (uneven) data."""
    from torchmetrics import MetricCollection
    from torchmetrics.classification import BinaryAccuracy, MulticlassConfusionMatrix

    import torchmetrics_varlen as tv

    sizes = case_sizes(quick)
    gen = torch.Generator().manual_seed(rank)
    names = case_names(quick)
    if name == names[0]:
        collection = (MetricCollection if side == "stock" else tv.MetricCollection)(eight_metric_members())
        _feed_eight(collection, rank, sizes["samples"] + 300 * rank)
        return collection
    if name == names[1]:
        cls = MulticlassConfusionMatrix if side == "stock" else tv.rebase(MulticlassConfusionMatrix)
        metric = cls(num_classes=sizes["classes"])
        count = 50 + 20 * rank
        metric.update(*torch.randint(0, sizes["classes"], (2, count), generator=gen))
        return metric
    if name == names[2]:
        stock_cls, ours_cls = fid_like_classes()
        metric = (stock_cls if side == "stock" else ours_cls)(dim=sizes["features"])
        metric.update(torch.randn(16 + 8 * rank, sizes["features"], generator=gen))
        return metric
    cls = BinaryAccuracy if side == "stock" else tv.rebase(BinaryAccuracy)
    metric = cls()
    metric.update(torch.rand(10 + rank, generator=gen), torch.randint(0, 2, (10 + rank,), generator=gen))
    return metric


def fresh_compute(metric: Any) -> Any:
    """``compute()`` with a fresh sync: the cached results of the metric (or every member) dropped first."""
    members = list(metric.values(copy_state=False)) if hasattr(metric, "values") else [metric]
    for member in members:
        member._computed = None
    return metric.compute()


def body_bytes(rank: int, world_size: int, quick: bool) -> dict[str, dict[str, dict[str, int]]]:
    """Per case and side: collectives, bytes received and collective buffers of one compute() on this rank.

    A first compute() is not measured: a group's first large sync may exchange the metadata twice (its record
    length is agreed once, then kept). The per-step case syncs two windows first, so that the length settles.
    """
    out: dict[str, dict[str, dict[str, int]]] = {}
    for name in case_names(quick):
        out[name] = {}
        for side in ("stock", "varlen"):
            metric = build_case(name, side, rank, quick)
            for _ in range(2 * RECORD_WINDOW if name == SETTLED_CASE else 1):
                fresh_compute(metric)
            dist.barrier()
            with ByteMeter() as meter:
                fresh_compute(metric)
            out[name][side] = {**meter.as_dict(), "largest": meter.largest}
    return out


def body_latency(rank: int, world_size: int, repeats: int) -> dict[str, float]:
    """Median ms of one small metric's compute() and sync, stock vs ours, and the floor: interleaved.

    The floor is one raw ``all_gather_into_tensor`` of the bytes of the metric's states (32 for ``BinaryAccuracy``),
    preallocated: the least any sync of them costs. "bare" is the least a sync of them does through public calls
    (:func:`_bare_sync`).
    """
    from torchmetrics.classification import BinaryAccuracy

    import torchmetrics_varlen as tv

    metrics = {}
    for side, cls in (("stock", BinaryAccuracy), ("varlen", tv.rebase(BinaryAccuracy))):
        metric = metrics[side] = cls()
        metric.update(torch.rand(10 + rank), torch.randint(0, 2, (10 + rank,)))
    states = [getattr(metrics["varlen"], name) for name in metrics["varlen"]._defaults]
    tiny = torch.zeros(sum(state.numel() * state.element_size() for state in states), dtype=torch.uint8)
    received = torch.empty(world_size * tiny.numel(), dtype=torch.uint8)

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # what the engine calls

    def floor() -> None:
        gather(received, tiny)

    def sync_once(metric: Any) -> None:
        metric.sync()
        metric.unsync()

    fns: dict[str, Callable[[], Any]] = {"floor": floor, "bare": _bare_sync(metrics["stock"], gather, world_size)}
    for side, metric in metrics.items():
        fns[f"{side} compute"] = functools.partial(fresh_compute, metric)
        fns[f"{side} sync"] = functools.partial(sync_once, metric)
    return interleaved_medians(fns, repeats)


def _bare_sync(metric: Any, gather: Callable[..., Any], world_size: int) -> Callable[[], None]:
    """The least a sync of this metric's scalar integer states does through public calls: a bound, not a way to sync.

    It sends a header as long as our header and slots (zeros) and the states' values in one int64 row, with one
    asynchronous gather and a timed wait (as the engine waits), compares every rank's header with the expected bytes,
    sums the data words and sets one fresh tensor per state, then restores the local states as ``unsync`` does. No
    guard, no policy or cap, no agreed record length, no timeout bookkeeping: what the engine adds to this is what
    a sync costs above it.
    """
    names = list(metric._defaults)
    header = [0] * record_words(len(names))
    expected = bytes(8 * len(header) * world_size)
    timeout = datetime.timedelta(seconds=60)
    attrs = vars(metric)

    def bare() -> None:
        local_states = [attrs[name] for name in names]
        local = torch.tensor(header + [int(state) for state in local_states], dtype=torch.int64)
        table = torch.empty(world_size * local.numel(), dtype=torch.int64)
        gather(table, local, async_op=True).wait(timeout)
        rows = table.view(world_size, -1)
        if rows[:, : len(header)].numpy().tobytes() != expected:
            raise RuntimeError("the bare sync's headers differ: the ranks are not running the same benchmark")
        attrs.update(zip(names, rows[:, len(header) :].sum(0).unbind()))
        attrs.update(zip(names, local_states))

    return bare


def measure_processes(world_sizes: Sequence[int], quick: bool, repeats: int) -> tuple[list[Row], list[Row]]:
    """The byte rows (per case, world size, side, with per-rank lists) and the latency rows, on gloo processes."""
    from tests._workers import WorkerPool

    byte_rows: list[Row] = []
    latency_rows: list[Row] = []
    for world_size in world_sizes:
        with WorkerPool(world_size, pg_timeout=120.0) as pool:
            per_rank = pool.run(body_bytes, quick, deadline=600.0)
            for name in case_names(quick):
                for side in ("stock", "varlen"):
                    counts = [ranks[name][side] for ranks in per_rank]
                    row: Row = {"case": name, "world_size": world_size, "side": side}
                    for key in ("collectives", "received", "buffers", "largest"):
                        row[key] = [count[key] for count in counts]
                    byte_rows.append(row)
            if world_size <= 4:
                latency = pool.run(body_latency, repeats, deadline=600.0)[0]
                latency_rows.append({"world_size": world_size, **latency})
    return byte_rows, latency_rows
