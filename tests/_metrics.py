"""Small metrics shared by test modules (importable in spawned ranks and fresh processes: tests/ is on sys.path)."""

import torch
import torchmetrics

import torchmetrics_varlen as tv


class Total(tv.Metric):
    """A ``tv.Metric`` subclass: the sum of the inputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x):
        self.total += x.sum()

    def compute(self):
        return self.total


class StockTotal(torchmetrics.Metric):
    """The same sum as a user-defined stock metric (to rebase, or to compare with)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x):
        self.total += x.sum()

    def compute(self):
        return self.total
