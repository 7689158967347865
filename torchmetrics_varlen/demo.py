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


def shard(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's samples: a strided shard, and the last rank's data filtered away (when there are 2+ ranks)."""
    preds, target = validation_set()
    if world_size > 1 and rank == world_size - 1:
        return preds[:0], target[:0]
    return preds[rank::world_size], target[rank::world_size]


def kept_data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Everything the ranks hold, concatenated rank after rank: the single-process truth is computed on this."""
    parts = [shard(rank, world_size) for rank in range(world_size)]
    return torch.cat([p for p, _ in parts]), torch.cat([t for _, t in parts])


def _batches(preds: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(preds[i : i + BATCH_SIZE], target[i : i + BATCH_SIZE]) for i in range(0, preds.numel(), BATCH_SIZE)]


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


def _method_naive(preds: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    from torchmetrics.functional.classification import binary_auroc, binary_average_precision

    all_preds, all_target = _naive_gather(preds, target)
    return {
        "auroc": binary_auroc(all_preds, all_target).item(),
        "ap": binary_average_precision(all_preds, all_target).item(),
    }


def _metric_pair(kind: str) -> Any:
    from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision

    import torchmetrics_varlen as tv

    if kind == "stock":
        return {"auroc": BinaryAUROC(thresholds=None), "ap": BinaryAveragePrecision(thresholds=None)}
    if kind == "hook":
        hook = tv.gather_all_tensors
        return {
            "auroc": BinaryAUROC(thresholds=None, dist_sync_fn=hook),
            "ap": BinaryAveragePrecision(thresholds=None, dist_sync_fn=hook),
        }
    return tv.MetricCollection({"auroc": BinaryAUROC(thresholds=None), "ap": BinaryAveragePrecision(thresholds=None)})


def _method_metrics(kind: str) -> Callable[[torch.Tensor, torch.Tensor], dict[str, float]]:
    def run(preds: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        metrics = _metric_pair(kind)
        for batch_preds, batch_target in _batches(preds, target):
            if isinstance(metrics, dict):
                for metric in metrics.values():
                    metric.update(batch_preds, batch_target)
            else:
                metrics.update(batch_preds, batch_target)
        values = {k: m.compute() for k, m in metrics.items()} if isinstance(metrics, dict) else metrics.compute()
        return {k: float(v.item()) for k, v in values.items()}

    return run


METHODS: dict[str, Callable[[torch.Tensor, torch.Tensor], dict[str, float]]] = {
    "naive equal-shape all_gather": _method_naive,
    "stock torchmetrics": _method_metrics("stock"),
    "torchmetrics_varlen hook (dist_sync_fn=)": _method_metrics("hook"),
    "torchmetrics_varlen MetricCollection": _method_metrics("collection"),
}


def run_method(rank: int, world_size: int, name: str) -> Row:
    """Run one method on this rank's shard: values, collective count, median compute time (ms)."""
    import warnings

    preds, target = shard(rank, world_size)
    method = METHODS[name]
    times, values, count = [], {}, 0
    for _ in range(REPEATS):
        with warnings.catch_warnings(), _CollectiveCounter() as counter:
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            values = method(preds, target)
            times.append((time.perf_counter() - start) * 1000)
        count = counter.count
    return {"values": values, "collectives": count, "ms": statistics.median(times)}


def truth(world_size: int) -> dict[str, float]:
    """AUROC and AP of one process on everything the ranks hold."""
    from torchmetrics.functional.classification import binary_auroc, binary_average_precision

    preds, target = kept_data(world_size)
    return {"auroc": binary_auroc(preds, target).item(), "ap": binary_average_precision(preds, target).item()}


def format_table(world_size: int, rows: dict[str, Row | str]) -> str:
    """The demo's one table: one line per method, with what was measured."""
    reference = truth(world_size)
    sizes = [shard(r, world_size)[0].numel() for r in range(world_size)]
    lines = [
        f"Field report 1 on {world_size} gloo CPU processes: {N_SAMPLES} validation samples, strided shards,"
        f" batches of {BATCH_SIZE}, last rank filtered to 0 samples; samples per rank: {sizes}",
        "",
        f"{'method':<42} {'AUROC':>10} {'AP':>10}  {'matches truth':<44} {'collectives':>11} {'ms':>8}",
        f"{'single-process truth':<42} {reference['auroc']:>10.6f} {reference['ap']:>10.6f}  {'(reference)':<44}"
        f" {'-':>11} {'-':>8}",
    ]
    for name, row in rows.items():
        if isinstance(row, str):
            lines.append(f"{name:<42} {'-':>10} {'-':>10}  {row[:44]:<44} {'-':>11} {'-':>8}")
            continue
        values = row["values"]
        ok = {k: abs(values[k] - reference[k]) <= 1e-6 for k in reference}
        verdict = "yes" if all(ok.values()) else f"NO (AUROC {_word(ok['auroc'])}, AP {_word(ok['ap'])})"
        lines.append(
            f"{name:<42} {values['auroc']:>10.6f} {values['ap']:>10.6f}  {verdict:<44}"
            f" {row['collectives']:>11} {row['ms']:>8.2f}"
        )
    lines.append("")
    lines.append("collectives: torch.distributed calls per rank for computing both metrics; ms: median wall time of")
    lines.append(f"update+compute on rank 0 over {REPEATS} runs (includes the sync).")
    return "\n".join(lines)


def _word(ok: bool) -> str:
    return "right" if ok else "wrong"


def _failure_text(err: BaseException) -> str:
    text = str(err)
    if any(sign in text for sign in ("died", "Received data size", "collective mismatch", "Connection")):
        return "ERROR: a rank aborted (gloo collective mismatch)"
    last = [line for line in text.splitlines() if line.strip()][-1]
    return f"ERROR: {last.strip()[:60]}"


def run_spawned(world_size: int) -> str:
    """Spawn ``world_size`` gloo processes, run every method, return the table."""
    from torchmetrics_varlen._launch import WorkerError, WorkerPool

    rows: dict[str, Row | str] = {}
    with WorkerPool(world_size, pg_timeout=30.0, quiet=True) as pool:
        for name in METHODS:
            if name == "stock torchmetrics":
                continue
            rows[name] = pool.run(run_method, name, deadline=60.0)[0]
    # Stock torchmetrics can abort a process on an empty rank: it runs in a pool of its own.
    with WorkerPool(world_size, pg_timeout=30.0, quiet=True) as pool:
        try:
            rows["stock torchmetrics"] = pool.run(run_method, "stock torchmetrics", deadline=60.0)[0]
        except WorkerError as err:
            rows["stock torchmetrics"] = _failure_text(err)
    order = list(METHODS)
    return format_table(world_size, {name: rows[name] for name in order})


def run_under_torchrun() -> str | None:
    """Use the process group that ``torchrun`` set up; return the table on rank 0."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows: dict[str, Row | str] = {}
    for name in METHODS:
        if name == "stock torchmetrics" and world_size > 1:
            # It aborts the whole job on the empty rank; run the demo without torchrun to see that row.
            rows[name] = "skipped under torchrun (aborts the job)"
            continue
        rows[name] = run_method(rank, world_size, name)
    dist.barrier()
    return format_table(world_size, rows) if rank == 0 else None


def main(world_size: int = 4) -> int:
    """Entry point of ``python -m torchmetrics_varlen demo``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        table = run_under_torchrun()
    else:
        table = run_spawned(world_size)
    if table is not None:
        print(table, flush=True)
    return 0
