"""Field report 1: AUROC/AP that jump around on several GPUs, replayed on gloo CPU processes.

A binary classifier's validation set of 1003 samples is sharded over the ranks without padding, batched with uneven
tails, and one rank's data is filtered away entirely. Each method computes AUROC and average precision over what the
ranks hold; the table says whether it matches one process on the concatenated data, and what it cost.
"""

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.demo._common import NOTE, OURS, STOCK, TODAY, Method, Rows, Section, line
from tests._meters import CollectiveCounter

N_SAMPLES = 1003
BATCH_SIZE = 32
REPEATS = 3


def validation_set() -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of a decent but imperfect classifier on ``N_SAMPLES`` labelled samples (equal on every rank)."""
    gen = torch.Generator().manual_seed(2024)
    target = torch.randint(0, 2, (N_SAMPLES,), generator=gen)
    logits = 1.5 * (target.float() - 0.5) + torch.randn(N_SAMPLES, generator=gen)
    return torch.sigmoid(logits), target


Shard = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # preds, target, dataset index


def shard(rank: int, world_size: int, scenario: str = "filtered") -> Shard:
    """This rank's samples in a scenario.

    ``filtered``: a strided shard without padding, and the last rank's data filtered away (with 2+ ranks).
    ``padded``: what ``DistributedSampler(drop_last=False)`` hands this rank: the data set padded with repeats.
    ``unpadded``: what ``UnpaddedDistributedSampler`` hands this rank: every sample exactly once.
    """
    from torch.utils.data import DistributedSampler

    from torchmetrics_varlen.sampler import UnpaddedDistributedSampler

    preds, target = validation_set()
    if scenario == "filtered":
        index = torch.arange(N_SAMPLES)[rank::world_size]
        if world_size > 1 and rank == world_size - 1:
            index = index[:0]
    else:
        sampler_cls = DistributedSampler if scenario == "padded" else UnpaddedDistributedSampler
        dataset: Any = range(N_SAMPLES)  # samplers only need len()
        sampler: Any = sampler_cls(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=7)
        index = torch.tensor(list(sampler), dtype=torch.int64)
    return preds[index], target[index], index


def truth(world_size: int, scenario: str) -> dict[str, float]:
    """AUROC, AP and sample count of one process on the data set (what the ranks hold, each sample once)."""
    from torchmetrics.functional.classification import binary_auroc, binary_average_precision

    preds, target = validation_set()
    if scenario == "filtered":
        index = torch.cat([shard(rank, world_size, scenario)[2] for rank in range(world_size)])
        preds, target = preds[index], target[index]
    return {
        "auroc": binary_auroc(preds, target).item(),
        "ap": binary_average_precision(preds, target).item(),
        "count": float(preds.numel()),
    }


def _batches(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    size = tensors[0].numel()
    return [tuple(t[i : i + BATCH_SIZE] for t in tensors) for i in range(0, size, BATCH_SIZE)]


def _naive_gather(preds: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The field report's code: pad to the longest rank, all_gather, and forget to cut the padding off."""
    longest = torch.tensor([preds.numel()])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    size = int(longest.item())
    out = []
    for local in (preds, target):
        padded = torch.zeros(size, dtype=local.dtype)
        padded[: local.numel()] = local
        gathered = [torch.zeros_like(padded) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, padded)
        out.append(torch.cat(gathered))
    return out[0], out[1]


def _method_naive(data: Shard) -> dict[str, float]:
    from torchmetrics.functional.classification import binary_auroc, binary_average_precision

    all_preds, all_target = _naive_gather(data[0], data[1])
    return {
        "auroc": binary_auroc(all_preds, all_target).item(),
        "ap": binary_average_precision(all_preds, all_target).item(),
        "count": float(all_preds.numel()),
    }


def _metrics(kind: str) -> Any:
    """AUROC, AP and a sample count, synced the way ``kind`` says."""
    from torchmetrics.aggregation import SumMetric
    from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision

    import torchmetrics_varlen as tv

    def members(**kw: Any) -> dict[str, Any]:
        return {
            "auroc": BinaryAUROC(thresholds=None, **kw),
            "ap": BinaryAveragePrecision(thresholds=None, **kw),
            "count": SumMetric(**kw),
        }

    if kind == "stock":
        return members()
    if kind == "hook":
        return members(dist_sync_fn=tv.gather_all_tensors)
    if kind == "indexed":
        return {name: tv.IndexedMetric(metric) for name, metric in members().items()}
    return tv.MetricCollection(members())


def _method_metrics(kind: str) -> Callable[[Shard], dict[str, float]]:
    def run(data: Shard) -> dict[str, float]:
        metrics = _metrics(kind)
        for preds, target, index in _batches(*data):
            extra = {"sample_index": index} if kind == "indexed" else {}
            for name, metric in metrics.items():  # a collection yields its members the same way
                args = (torch.ones(preds.numel()),) if name == "count" else (preds, target)
                metric.update(*args, **extra)
        values = metrics.compute() if kind == "collection" else {k: m.compute() for k, m in metrics.items()}
        return {k: float(v.item()) for k, v in values.items()}

    return run


# name: (scenario, role, method, what it does to the process group)
METHODS: dict[str, tuple[str, str, Callable[[Shard], dict[str, float]], str]] = {
    "naive equal-shape all_gather": ("filtered", TODAY, _method_naive, ""),
    # Stock torchmetrics aborts a process when one rank holds no data: it runs in a process group of its own.
    "stock torchmetrics": ("filtered", STOCK, _method_metrics("stock"), "aborts"),
    "ours: hook (dist_sync_fn=)": ("filtered", OURS, _method_metrics("hook"), ""),
    "ours: MetricCollection": ("filtered", OURS, _method_metrics("collection"), ""),
    "stock torchmetrics (padded sampler)": ("padded", STOCK, _method_metrics("stock"), ""),
    "hook alone (padded sampler)": ("padded", NOTE, _method_metrics("hook"), ""),
    "ours: IndexedMetric + sample_index": ("padded", OURS, _method_metrics("indexed"), ""),
    "ours: UnpaddedDistributedSampler": ("unpadded", OURS, _method_metrics("collection"), ""),
}
SCENARIO_TITLES = {
    "filtered": "A. strided shards, batches of {batch}, last rank filtered to 0 samples",
    "padded": "B. DistributedSampler(drop_last=False): the data set padded with repeats",
}
TITLE = "1. AUROC/AP misaligned by equal-shape gathers"


def run_method(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """Run one method on this rank's shard: values, collective count, median update+compute time (ms)."""
    import warnings

    scenario, _, method, _ = METHODS[name]
    data = shard(rank, world_size, scenario)
    times, values, count = [], {}, 0
    for _ in range(REPEATS):
        with warnings.catch_warnings(), CollectiveCounter() as counter:
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            values = method(data)
            times.append((time.perf_counter() - start) * 1000)
        count = counter.count
    return {"values": values, "collectives": count, "ms": statistics.median(times)}


def methods(world_size: int) -> list[Method]:
    """The section's methods, in table order."""
    return [
        Method(name, role, functools.partial(run_method, name=name), breaks)
        for name, (_, role, _, breaks) in METHODS.items()
    ]


WIDTHS = (36, 8, 8, 7, 11, 7, 26)


def _values(name: str, values: dict[str, float], verdict: str, collectives: str, ms: str) -> str:
    auroc, ap, count = f"{values['auroc']:.6f}", f"{values['ap']:.6f}", str(int(values["count"]))
    return line(name, auroc, ap, count, collectives, ms, verdict, widths=WIDTHS)


def _verdict(values: dict[str, float], reference: dict[str, float]) -> tuple[bool, str]:
    keys = ("auroc", "ap", "count")
    wrong = [key for key in keys if abs(values[key] - reference[key]) > 1e-6]
    if wrong:
        return False, "NO: " + ", ".join(wrong) + " wrong"
    return True, "yes, exactly" if all(values[key] == reference[key] for key in keys) else "yes (within 1e-6)"


def render(world_size: int, rows: Rows) -> Section:
    """Per scenario, the single-process truth and one line per method, as measured."""
    header = line("method", "AUROC", "AP", "samples", "collectives", "ms", "matches truth", widths=WIDTHS)
    lines = [f"{TITLE}: {N_SAMPLES} validation samples, batches of {BATCH_SIZE}, {world_size} ranks"]
    ok = True
    for scenario in ("filtered", "padded"):
        reference = truth(world_size, scenario)
        sizes = [shard(r, world_size, scenario)[0].numel() for r in range(world_size)]
        lines += [SCENARIO_TITLES[scenario].format(batch=BATCH_SIZE) + f"; per rank: {sizes}", header]
        lines.append(_values("single-process truth", reference, "(reference)", "-", "-"))
        for name, (where, role, _, _) in METHODS.items():
            if where != scenario and not (where == "unpadded" and scenario == "padded"):
                continue  # the unpadded sampler is the other fix for B: same data set, a sampler that does not pad
            row = rows[name]
            if isinstance(row, str):
                ok &= role != OURS or row.startswith("skipped")
                lines.append(line(name, "-", "-", "-", "-", "-", row, widths=WIDTHS))
                continue
            first = row[0]
            good, text = _verdict(first["values"], reference)
            ok &= good or role != OURS
            lines.append(_values(name, first["values"], text, str(first["collectives"]), f"{first['ms']:.1f}"))
    lines.append(
        f"collectives: torch.distributed calls per rank for update+compute; ms: median on rank 0 of {REPEATS} runs."
    )
    return Section("\n".join(lines), ok)
