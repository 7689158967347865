"""Field report 3: training that freezes at the end of an epoch because the ranks ran different numbers of steps.

Rank ``r`` runs ``max(1, 10 - 3 r)`` steps of a tiny DDP model (gloo on CPU) whose loss is a per-step-synced mean
squared error (``dist_sync_on_step=True``), then computes the epoch value. The truth is one process scoring every
prediction that any rank made.
"""

import contextlib
import functools
from typing import Any

import torch
from torchmetrics.regression import MeanSquaredError

from benchmarks.demo._common import OURS, STOCK, Method, Rows, Section, close, line
from torchmetrics_varlen import join, rebase

TITLE = "3. Uneven step counts with a per-step-synced metric and a DDP model"


def steps(rank: int) -> int:
    """How many steps rank ``rank`` runs: 10, 7, 4, 1, 1, ..."""
    return max(1, 10 - 3 * rank)


def train(rank: int, world_size: int, ours: bool) -> dict[str, Any]:
    """The training loop; the epoch value and every prediction this rank made."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    metric: Any = (rebase(MeanSquaredError) if ours else MeanSquaredError)(dist_sync_on_step=True)
    gen = torch.Generator().manual_seed(70 + rank)
    seen_preds, seen_target = [], []
    with join(model, metric) if ours else contextlib.nullcontext():
        for _ in range(steps(rank)):
            x, y = torch.randn(4, 4, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen)
            preds = model(x).squeeze(-1)
            loss = metric(preds, y.double())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen_preds.append(preds.detach())
            seen_target.append(y.double())
    value = metric.compute()  # the epoch value
    return {
        "value": float(value),
        "steps": steps(rank),
        "preds": torch.cat(seen_preds),
        "target": torch.cat(seen_target),
    }


def methods(world_size: int) -> list[Method]:
    """The section's methods, in table order."""
    return [
        Method("stock torchmetrics + DDP", STOCK, functools.partial(train, ours=False), breaks="hangs"),
        Method("ours: rebase(...) inside join", OURS, functools.partial(train, ours=True)),
    ]


WIDTHS = (32, 12, 44)


def render(world_size: int, rows: Rows) -> Section:
    """The epoch value of each method beside one process on every prediction made."""
    lines = [
        f"{TITLE}: steps per rank {[steps(rank) for rank in range(world_size)]}",
        line("method", "epoch MSE", "matches truth", widths=WIDTHS),
    ]
    ok, truth_line = True, line("single-process truth", "-", "(needs a run that finished)", widths=WIDTHS)
    body = []
    for method in methods(world_size):
        row = rows[method.name]
        if isinstance(row, str):
            ok &= method.role != OURS or row.startswith("skipped")
            body.append(line(method.name, "-", row, widths=WIDTHS))
            continue
        reference = MeanSquaredError(sync_on_compute=False)  # one process: rank 0 renders alone under torchrun
        reference.update(torch.cat([r["preds"] for r in row]), torch.cat([r["target"] for r in row]))
        expected = float(reference.compute())
        truth_line = line("single-process truth", f"{expected:.6f}", "(reference)", widths=WIDTHS)
        good = all(close(r["value"], expected, tol=1e-5) for r in row)  # float32 states
        ok &= good or method.role != OURS
        body.append(line(method.name, f"{row[0]['value']:.6f}", "yes, on every rank" if good else "NO", widths=WIDTHS))
    lines += [truth_line, *body, "truth: one process scoring every prediction the ranks made, in one MSE."]
    return Section("\n".join(lines), ok)
