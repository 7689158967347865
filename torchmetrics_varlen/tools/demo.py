"""The demo: field report 1 (AUROC/AP that jump around on several GPUs) replayed on gloo CPU processes.

A binary classifier's validation set of 1003 samples is sharded over the ranks without padding, batched with uneven
tails, and one rank's data is filtered away entirely. Each method computes AUROC and average precision over what the
ranks hold; the table says whether it matches one process on the concatenated data, and what it cost.
"""

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

N_SAMPLES = 1003
BATCH_SIZE = 32
REPEATS = 3

Row = dict[str, Any]


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


class _CollectiveCounter:
    """Counts ``torch.distributed`` collective calls made while active (nested calls count once)."""

    NAMES = ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast")

    def __init__(self) -> None:
        self.count = 0
        self._originals: dict[str, Callable[..., Any]] = {}
        self._depth = 0

    def __enter__(self) -> "_CollectiveCounter":
        for name in self.NAMES:
            if hasattr(dist, name):
                self._originals[name] = original = getattr(dist, name)
                setattr(dist, name, self._wrap(original))
        return self

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += self._depth == 0
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)


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


METHODS: dict[str, tuple[str, Callable[[Shard], dict[str, float]]]] = {
    "naive equal-shape all_gather": ("filtered", _method_naive),
    "stock torchmetrics": ("filtered", _method_metrics("stock")),
    "torchmetrics_varlen hook (dist_sync_fn=)": ("filtered", _method_metrics("hook")),
    "torchmetrics_varlen MetricCollection": ("filtered", _method_metrics("collection")),
    "stock torchmetrics (padded sampler)": ("padded", _method_metrics("stock")),
    "varlen hook (padded sampler)": ("padded", _method_metrics("hook")),
    "IndexedMetric + sample_index (padded)": ("padded", _method_metrics("indexed")),
    "UnpaddedDistributedSampler + collection": ("unpadded", _method_metrics("collection")),
}
SCENARIO_TITLES = {
    "filtered": "A. strided shards, batches of {batch}, last rank filtered to 0 samples",
    "padded": "B. DistributedSampler(drop_last=False, shuffle=True): the data set padded with repeated samples",
}


def run_method(rank: int, world_size: int, name: str) -> Row:
    """Run one method on this rank's shard: values, collective count, median update+compute time (ms)."""
    import warnings

    scenario, method = METHODS[name]
    data = shard(rank, world_size, scenario)
    times, values, count = [], {}, 0
    for _ in range(REPEATS):
        with warnings.catch_warnings(), _CollectiveCounter() as counter:
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            values = method(data)
            times.append((time.perf_counter() - start) * 1000)
        count = counter.count
    return {"values": values, "collectives": count, "ms": statistics.median(times)}


def _line(method: str, auroc: str, ap: str, samples: str, verdict: str, collectives: str, ms: str) -> str:
    # The verdict column fits the longest verdict, "NO: auroc wrong, ap wrong, count wrong".
    return f"{method:<42} {auroc:>9} {ap:>9} {samples:>8}  {verdict[:38]:<38} {collectives:>11} {ms:>7}"


def _verdict(values: dict[str, float], reference: dict[str, float]) -> str:
    keys = ("auroc", "ap", "count")
    wrong = [key for key in keys if abs(values[key] - reference[key]) > 1e-6]
    if wrong:
        return "NO: " + ", ".join(f"{key} wrong" for key in wrong)
    return "yes, exactly" if all(values[key] == reference[key] for key in keys) else "yes (within 1e-6)"


def _values_line(method: str, values: dict[str, float], verdict: str, collectives: str, ms: str) -> str:
    auroc, ap, count = f"{values['auroc']:.6f}", f"{values['ap']:.6f}", str(int(values["count"]))
    return _line(method, auroc, ap, count, verdict, collectives, ms)


def format_table(world_size: int, rows: dict[str, Row | str]) -> str:
    """The demo's table: per scenario, the single-process truth and one line per method, as measured."""
    header = _line("method", "AUROC", "AP", "samples", "matches truth", "collectives", "ms")
    lines = [
        f"Field report 1 on {world_size} gloo CPU processes; {N_SAMPLES} validation samples, batches of {BATCH_SIZE}.",
    ]
    for scenario in ("filtered", "padded"):
        reference = truth(world_size, scenario)
        sizes = [shard(r, world_size, scenario)[0].numel() for r in range(world_size)]
        lines += ["", SCENARIO_TITLES[scenario].format(batch=BATCH_SIZE) + f"; samples per rank: {sizes}", header]
        lines.append(_values_line("single-process truth", reference, "(reference)", "-", "-"))
        for name, row in rows.items():
            if METHODS[name][0] == "unpadded" and scenario == "padded":
                pass  # the fix for B: same data set, a sampler that does not pad
            elif METHODS[name][0] != scenario:
                continue
            if isinstance(row, str):
                lines.append(_line(name, "-", "-", "-", row, "-", "-"))
                continue
            verdict = _verdict(row["values"], reference)
            lines.append(_values_line(name, row["values"], verdict, str(row["collectives"]), f"{row['ms']:.2f}"))
    lines += [
        "",
        "samples: how many samples the method's sync counted; collectives: torch.distributed calls per rank for",
        f"update+compute of AUROC, AP and the count; ms: median wall time of that on rank 0 over {REPEATS} runs.",
    ]
    return "\n".join(lines)


def _failure_text(err: BaseException) -> str:
    text = str(err)
    if any(sign in text for sign in ("died", "Received data size", "collective mismatch", "Connection")):
        return "ERROR: a rank aborted (gloo)"
    last = [line for line in text.splitlines() if line.strip()][-1]
    return f"ERROR: {last.strip()[:60]}"


# Stock torchmetrics aborts a process when one rank holds no data: it runs in a process group of its own.
_MAY_ABORT = ("stock torchmetrics",)


def run_spawned(world_size: int) -> str:
    """Spawn ``world_size`` gloo processes, run every method, return the table."""
    from torchmetrics_varlen.tools._launch import WorkerError, WorkerPool

    rows: dict[str, Row | str] = {}
    with WorkerPool(world_size, pg_timeout=30.0, quiet=True) as pool:
        for name in METHODS:
            if name not in _MAY_ABORT:
                rows[name] = pool.run(run_method, name, deadline=60.0)[0]
    for name in _MAY_ABORT:
        with WorkerPool(world_size, pg_timeout=30.0, quiet=True) as pool:
            try:
                rows[name] = pool.run(run_method, name, deadline=60.0)[0]
            except WorkerError as err:
                rows[name] = _failure_text(err)
    return format_table(world_size, {name: rows[name] for name in METHODS})


def run_under_torchrun() -> str | None:
    """Use the process group that ``torchrun`` set up; return the table on rank 0."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows: dict[str, Row | str] = {}
    for name in METHODS:
        if name in _MAY_ABORT and world_size > 1:
            rows[name] = "skipped: aborts under torchrun"  # run the demo without torchrun to see that row
            continue
        rows[name] = run_method(rank, world_size, name)
    dist.barrier()
    return format_table(world_size, rows) if rank == 0 else None


def main(world_size: int = 4) -> int:
    """Entry point of ``python -m torchmetrics_varlen demo``."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    table = run_under_torchrun() if under_torchrun else run_spawned(world_size)
    if table is not None:
        print(table, flush=True)
    return 0
