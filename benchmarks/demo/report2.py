"""Field report 2: lost gradients when a metric is the loss of a DDP model and the ranks' batches differ in size.

A tiny DDP model (a linear layer and a sigmoid, gloo on CPU) is trained one step with ``1 - soft F1`` over the
global batch as its loss; rank ``r`` holds ``6 + 5 r`` samples. The parameter gradient is compared with one process
doing the same step on the concatenated batch.
"""

import functools
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import Metric as StockMetric

from benchmarks.demo._common import OURS, STOCK, TODAY, Method, Rows, Section, line
from torchmetrics_varlen.losses import SoftF1Loss

TITLE = "2. Lost gradients: a metric as a DDP loss, uneven batches"
FEATURES = 4


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch: ``6 + 5 rank`` samples."""
    gen = torch.Generator().manual_seed(50 + rank)
    n = 6 + 5 * rank
    return torch.randn(n, FEATURES, generator=gen, dtype=torch.float64), torch.randint(0, 2, (n,), generator=gen)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the single process
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 1), torch.nn.Flatten(0), torch.nn.Sigmoid()).double()


def soft_f1_loss(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``1 - soft F1`` of one batch, written out (what the metrics compute)."""
    target = target.to(probs.dtype)
    tp, fp, fn = (probs * target).sum(), (probs * (1 - target)).sum(), ((1 - probs) * target).sum()
    return 1 - 2 * tp / (2 * tp + fp + fn + 1e-8)


class StockSoftF1Loss(StockMetric):
    """The same loss on stock torchmetrics (``dist_sync_on_step=True``), as a user would write it."""

    full_state_update = False
    is_differentiable = True

    def __init__(self) -> None:
        super().__init__(dist_sync_on_step=True)
        self.eps = 1e-8
        for name in ("tp", "fp", "fn"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    update = SoftF1Loss.update
    compute = SoftF1Loss.compute


def _gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])


def _plain_all_gather(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The usual recipe: pad to the longest rank, ``all_gather``, cut each part back, concatenate."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([probs.numel()]))
    longest = int(max(sizes).item())
    parts = []
    for local in (probs, target.to(probs.dtype)):
        padded = torch.zeros(longest, dtype=local.dtype)
        padded[: local.numel()] = local
        gathered = [torch.zeros_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded)
        parts.append(torch.cat([part[: int(size)] for part, size in zip(gathered, sizes)]))
    return soft_f1_loss(parts[0], parts[1])


def train_step(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """One DDP step with the loss computed the way ``kind`` says; the loss and the parameter gradient."""
    model = torch.nn.parallel.DistributedDataParallel(_model())
    x, y = batch(rank)
    probs = model(x)
    if kind == "plain":
        loss = _plain_all_gather(probs, y)
    elif kind == "stock":
        loss = StockSoftF1Loss()(probs, y)
    else:
        loss = SoftF1Loss()(probs, y)  # sync_grads=True is its default
    if not loss.requires_grad:
        return {"loss": loss.item(), "grad": None}  # nothing to call backward() on: no gradient at all
    loss.backward()  # type: ignore[no-untyped-call]
    return {"loss": loss.item(), "grad": _gradient(model.module)}


def truth(world_size: int) -> dict[str, Any]:
    """One process, the concatenated batch, the same model and loss."""
    model = _model()
    x, y = (torch.cat(parts) for parts in zip(*(batch(rank) for rank in range(world_size))))
    loss = soft_f1_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    return {"loss": loss.item(), "grad": _gradient(model)}


def methods(world_size: int) -> list[Method]:
    """The section's methods, in table order."""
    return [
        Method("plain all_gather (padded, cut)", TODAY, functools.partial(train_step, kind="plain")),
        Method("stock torchmetrics Metric", STOCK, functools.partial(train_step, kind="stock")),
        Method("ours: SoftF1Loss(sync_grads=True)", OURS, functools.partial(train_step, kind="ours")),
    ]


WIDTHS = (36, 9, 10, 13, 30)


def render(world_size: int, rows: Rows) -> Section:
    """The loss and the gradient of every method beside the single-process ones."""
    reference = truth(world_size)
    norm = float(reference["grad"].norm())
    sizes = [batch(rank)[0].shape[0] for rank in range(world_size)]
    lines = [
        f"{TITLE}: samples per rank {sizes}, one DDP step",
        line("method", "loss", "|grad|", "grad / truth", "matches truth", widths=WIDTHS),
        line("single-process truth", f"{reference['loss']:.6f}", f"{norm:.6f}", "1", "(reference)", widths=WIDTHS),
    ]
    ok = True
    for method in methods(world_size):
        row = rows[method.name]
        if isinstance(row, str):
            ok &= method.role != OURS or row.startswith("skipped")
            lines.append(line(method.name, "-", "-", "-", row, widths=WIDTHS))
            continue
        loss, grad = row[0]["loss"], row[0]["grad"]
        if grad is None:
            good, size, ratio, text = False, "none", "-", "NO: no gradient (no graph)"
        else:
            share = float(grad @ reference["grad"]) / norm**2  # the part of the true gradient it carries
            good = torch.allclose(grad, reference["grad"], rtol=1e-6, atol=1e-9)
            size, ratio = f"{float(grad.norm()):.6f}", f"{share:.4f}"
            text = "yes" if good else f"NO: {share:.2f} x the gradient"
        ok &= good or method.role != OURS
        lines.append(line(method.name, f"{loss:.6f}", size, ratio, text, widths=WIDTHS))
    lines.append("grad / truth: the projection of rank 0's gradient after DDP on the single-process gradient.")
    return Section("\n".join(lines), ok)
