"""Field report 5: a validation epoch that hangs because only rank 0 logs (computes) the metric.

Every rank updates a mean over its samples; then ``if rank == 0: log(metric.compute())``. ``compute()`` syncs, so
rank 0 waits for ranks that never come. The fix is to compute on every rank and log on rank 0 (or Lightning's
``self.log(..., rank_zero_only=True)`` with an already-global value).
"""

import functools
import re
import time
from typing import Any

import torch
from torchmetrics.aggregation import MeanMetric

from benchmarks.demo._common import OURS, STOCK, Method, Rows, Section, close, line
from torchmetrics_varlen import SyncTimeoutError, rebase

TITLE = "5. Logging on rank 0 only: compute() inside `if rank == 0:`"
SYNC_TIMEOUT = 3.0


def values(rank: int) -> torch.Tensor:
    """Rank ``rank``'s per-sample values (``10 + 7 rank`` of them)."""
    return torch.arange(10 + 7 * rank, dtype=torch.float32) * (rank + 1)


def epoch_end(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """Update, then compute the way ``kind`` says; what rank 0 got (a value or the error), and how long it took."""
    metric: Any = MeanMetric() if kind == "stock" else rebase(MeanMetric)(sync_timeout=SYNC_TIMEOUT)
    metric.update(values(rank))
    start = time.monotonic()
    if kind == "right":
        value = metric.compute()  # every rank computes ...
        return {"value": float(value), "seconds": time.monotonic() - start}  # ... and rank 0 would log it
    if rank != 0:
        return {"value": None, "seconds": 0.0}  # the other ranks move on
    try:
        return {"value": float(metric.compute()), "seconds": time.monotonic() - start}
    except SyncTimeoutError as err:
        return {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}


def methods(world_size: int) -> list[Method]:
    """The section's methods, in table order."""
    return [
        Method("stock: compute() on rank 0 only", STOCK, functools.partial(epoch_end, kind="stock"), breaks="hangs"),
        Method(
            f"ours, sync_timeout={SYNC_TIMEOUT:g}: rank 0 only",
            OURS,
            functools.partial(epoch_end, kind="timeout"),
            breaks="pending",  # the collective that rank 0 gave up on is still pending in its group
        ),
        Method("ours: compute on every rank", OURS, functools.partial(epoch_end, kind="right")),
    ]


WIDTHS = (36, 9, 50)


def _named(message: str) -> tuple[list[int], str]:
    """The ranks a SyncTimeoutError message names as missing, and the sentence that names them."""
    found = re.search(r"[^.]*\branks? \[([0-9, ]+)\][^.]*\.", message)
    if found is None:
        return [], message.split(". ")[0].strip()
    return [int(rank) for rank in found.group(1).split(",")], found.group(0).strip()


def render(world_size: int, rows: Rows) -> Section:
    """What rank 0 got from each pattern, beside the mean over every sample."""
    expected = float(torch.cat([values(rank) for rank in range(world_size)]).double().mean())
    lines = [
        f"{TITLE}: {world_size} ranks",
        line("method", "mean", "result", widths=WIDTHS),
        line("single-process truth", f"{expected:.4f}", "(reference)", widths=WIDTHS),
    ]
    ok, notes = True, []
    for method in methods(world_size):
        row = rows[method.name]
        if isinstance(row, str):
            ok &= method.role != OURS or row.startswith("skipped")
            lines.append(line(method.name, "-", row, widths=WIDTHS))
            continue
        first = row[0]
        if "error" in first:
            ranks, sentence = _named(first["message"])
            good = ranks == list(range(1, world_size))  # the ranks that never called compute()
            text = f"{first['error']} after {first['seconds']:.1f} s" + ("" if good else " (ranks not named)")
            notes.append(f"  rank 0's error: ...{sentence[:100]}")
            lines.append(line(method.name, "-", text, widths=WIDTHS))
        else:
            good = method.name.endswith("every rank") and all(close(r["value"], expected) for r in row)
            text = "yes, on every rank" if good else ("NO: no error, " + f"returned {first['value']}")
            lines.append(line(method.name, f"{first['value']:.4f}", text, widths=WIDTHS))
        ok &= good or method.role != OURS
    lines += notes
    return Section("\n".join(lines), ok)
