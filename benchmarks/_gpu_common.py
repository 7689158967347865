"""What the GPU check's scenarios share: the context every rank runs in, the scenario record, data and checks.

:class:`Ctx` is what a scenario is given (mode, rank, device, the verdict group), :class:`Scenario` names it and what
it covers; a scenario raises :class:`SkipError` when this machine cannot run it and :class:`NoteError` for a finding
about the platform. The small metrics here are the states the scenarios sync (:mod:`benchmarks._gpu_scenarios` and
the other ``_gpu_*_scenarios`` modules).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torchmetrics.utilities.data import dim_zero_cat

import torchmetrics_varlen as tv

__all__ = ["Ctx", "NoteError", "Scenario", "SkipError", "counted"]


class SkipError(Exception):
    """The scenario cannot run here (no GPU, one GPU for several ranks)."""


class NoteError(Exception):
    """A finding about the platform: printed as NOTE, does not fail the check."""


@dataclass
class Ctx:
    mode: str  # "nccl", "shared" or "cpu"
    rank: int
    world_size: int
    device: torch.device
    control: Any  # gloo group for verdicts and references only: the package never touches it
    side_gloo: Any  # gloo group for "device states over gloo"

    @property
    def backend(self) -> str:
        return str(dist.get_backend()).lower()

    def local(self, tensors: tuple[Tensor, ...], sizes: list[int]) -> tuple[Tensor, ...]:
        """This rank's slice of data generated for all ranks, on this rank's device."""
        start = sum(sizes[: self.rank])
        return tuple(t[start : start + sizes[self.rank]].to(self.device) for t in tensors)

    def ddp(self, module: torch.nn.Module) -> DistributedDataParallel:
        module = module.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids)

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out


# ------------------------------------------------------------------------------------------------- data, checks
def _sizes(world_size: int, empty: int, base: int = 19) -> list[int]:
    """Uneven samples per rank, rank ``empty`` holding none."""
    return [0 if r == empty else base + 12 * r for r in range(world_size)]


def _binary(n: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=gen), torch.randint(0, 2, (n,), generator=gen)


def _close(what: str, got: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    got_t = torch.as_tensor(got).detach().cpu().double()
    expected_t = torch.as_tensor(expected).detach().cpu().double()
    try:
        torch.testing.assert_close(got_t, expected_t, rtol=rtol, atol=atol)
    except AssertionError as err:
        raise AssertionError(f"{what}: got {got_t.tolist()} but one process gives {expected_t.tolist()}") from err


def _on(what: str, tensor: Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise AssertionError(f"{what}: expected the result on {device} but got it on {tensor.device}")


def _update(metric: Any, *tensors: Tensor, batch: int = 8) -> None:
    """Update in batches; a rank without data never calls ``update`` (the hardest empty rank)."""
    for start in range(0, tensors[0].shape[0], batch):
        metric.update(*(t[start : start + batch] for t in tensors))


class _SumCat(tv.Metric):
    """A dense ``sum`` state and a ``cat`` list state: the two kinds every sync moves."""

    total: Tensor
    values: list[Tensor]
    devices: tuple[torch.device, torch.device]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, x: Tensor) -> None:
        self.total = self.total + x.double().sum().to(self.total.device)  # stays where it is (see _Mixed)
        self.values.append(x)

    def compute(self) -> tuple[Tensor, Tensor]:
        # After a sync the list state may be one tensor (stock reduction) or a list; never synced: a list.
        empty = isinstance(self.values, list) and not self.values
        values = torch.empty(0) if empty else dim_zero_cat(self.values)
        self.devices = (self.total.device, values.device)
        return self.total, values


class _Mixed(_SumCat):
    """Like ``_SumCat``, but the dense state is kept on the CPU while the list state is on the GPU."""

    def update(self, x: Tensor) -> None:
        self.total = self.total.cpu()
        super().update(x)


class _Count(tv.Metric):
    count: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        self.count = self.count + target.numel()

    def compute(self) -> Tensor:
        return self.count.clone()


class _BatchMSE(tv.Metric):
    """Mean squared error over the global batch, synced at every step: a DDP loss."""

    full_state_update = False
    sse: Tensor
    count: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(dist_sync_on_step=True, **kwargs)
        self.add_state("sse", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        self.sse = self.sse + ((preds.double() - target.double()) ** 2).sum()
        self.count = self.count + target.numel()

    def compute(self) -> Tensor:
        mse: Tensor = self.sse / self.count
        return mse


@dataclass(frozen=True)
class Scenario:
    """One check: a name (stable, printed), what it covers, and the function every rank runs.

    Example:
        >>> from benchmarks._gpu_scenarios import SCENARIOS
        >>> SCENARIOS[-1].name
        'group-after-timeout'
    """

    name: str
    summary: str
    run: Callable[[Ctx], str]


def counted(calls: list[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, appending ``name`` to ``calls`` at each call: which collectives a scenario issued."""

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)

    return counting
