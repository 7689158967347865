"""Metrics meant to be trained on: differentiable, computed over the global batch of all ranks."""

from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen.metric import Metric

__all__ = ["SoftF1Loss"]


class SoftF1Loss(Metric):
    r"""``1 - soft F1`` (soft Dice) of binary probabilities over the global batch, as a differentiable loss.

    Soft counts replace hard ones: :math:`tp = \sum p\,y`, :math:`fp = \sum p\,(1-y)`, :math:`fn = \sum (1-p)\,y`,
    and the loss is :math:`1 - 2tp / (2tp + fp + fn + \epsilon)`. Calling the metric (``forward``) returns the loss
    of the current batch of *all* ranks (``dist_sync_on_step=True``); ``compute()`` returns it over every batch since
    the last ``reset()``.

    With ``sync_grads=True`` (the default here) the DDP parameter gradients equal the single-process gradient of the
    same loss over the concatenated batch; with ``sync_grads=False`` exactly ``1 / world_size`` of it (see the
    "Metrics as losses" docs page).

    Args:
        eps: added to the denominator, so that a batch without positives gives a finite loss.
        kwargs: keyword arguments of :class:`~torchmetrics_varlen.Metric` (``sync_grads``, ``dist_sync_on_step``...).

    Example:
        >>> import torch
        >>> from torchmetrics_varlen.losses import SoftF1Loss
        >>> probs = torch.tensor([0.9, 0.2, 0.7, 0.4], requires_grad=True)
        >>> target = torch.tensor([1, 0, 1, 1])
        >>> loss = SoftF1Loss()(probs, target)
        >>> round(loss.item(), 4)  # tp = 2.0, fp = 0.2, fn = 1.0: 1 - 4 / 5.2
        0.2308
        >>> loss.backward()
        >>> probs.grad.shape
        torch.Size([4])
    """

    full_state_update = False
    is_differentiable = True
    higher_is_better = False
    tp: Tensor
    fp: Tensor
    fn: Tensor

    def __init__(self, eps: float = 1e-8, **kwargs: Any) -> None:
        kwargs.setdefault("dist_sync_on_step", True)
        kwargs.setdefault("sync_grads", True)
        super().__init__(**kwargs)
        self.eps = eps
        for name in ("tp", "fp", "fn"):
            self.add_state(name, default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Add a batch: ``probs`` in [0, 1] and ``target`` in {0, 1}, of the same shape."""
        if probs.shape != target.shape:
            raise ValueError(
                f"Expected `probs` and `target` to have the same shape but got {tuple(probs.shape)}"
                f" and {tuple(target.shape)}"
            )
        target = target.to(probs.dtype)
        self.tp = self.tp + (probs * target).sum()
        self.fp = self.fp + (probs * (1 - target)).sum()
        self.fn = self.fn + ((1 - probs) * target).sum()

    def compute(self) -> Tensor:
        """The loss over the accumulated (and, across ranks, synced) soft counts."""
        return 1 - 2 * self.tp / (2 * self.tp + self.fp + self.fn + self.eps)
