"""GPU check scenarios of Join with states on the job's device (issue 20, item 1), each a function every rank runs.

On GPUs the metrics' states live on CUDA and the model is an NCCL DDP model: the worker thread that shadows a
joined rank's per-step syncs must never touch CUDA (a copy on the stream it shares with the main thread deadlocks
against the NCCL work the main thread waits on), so each scenario records every tensor the worker hands to the sync
engine and requires plain CPU tensors, and a deadlock shows as the check's watchdog firing. In ``--cpu`` mode the
same code runs with CPU states on gloo, so CI covers it.
"""

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.algorithms.join import Join

import torchmetrics_varlen as tv
from benchmarks._gpu_common import Ctx, Scenario, _BatchMSE, _close
from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine.group import REGISTRY, Link

__all__ = ["SCENARIOS"]


class _Recorder:
    """Records what the worker threads hand to the engine, and which group carries the main thread's step syncs.

    Every sync of the package, its fast path (the learnt plans) included, starts with ``_engine.start``, which
    ``_engine.sync`` looks up at call time: wrapping it sees every request and the link it runs over.
    """

    def __init__(self) -> None:
        self.worker_tensors: list[tuple[str, str]] = []
        self.main_groups: list[Any] = []
        self._original: Callable[..., Any] = _engine.start

    def __enter__(self) -> "_Recorder":
        original = self._original

        def recording(request: _engine.Request, link: Link) -> Any:
            if threading.current_thread() is threading.main_thread():
                if request.label.endswith(".step"):
                    self.main_groups.append(link.group)
            else:
                for entry in request.entries:
                    for tensor in entry if isinstance(entry, list) else [entry]:
                        if isinstance(tensor, Tensor):
                            self.worker_tensors.append((type(tensor).__name__, str(tensor.device)))
            return original(request, link)

        _engine.start = recording
        return self

    def __exit__(self, *exc: object) -> None:
        _engine.start = self._original

    def check_worker(self) -> None:
        found = set(self.worker_tensors)
        if found - {("Tensor", "cpu")}:
            raise AssertionError(f"the Join worker thread handed the engine {sorted(found)}: expected CPU tensors only")


def _batches(ctx: Ctx, steps: list[int], seed: int) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed + ctx.rank)
    return [
        (torch.randn(3 + s % 3, 4, generator=gen).double(), torch.randn(3 + s % 3, generator=gen).double())
        for s in range(steps[ctx.rank])
    ]


def _side_group(metric: Any) -> Any:
    """The side group of ``metric``'s process group: made by its first ``join``, kept with the group's state."""
    state = REGISTRY.state(metric.process_group)
    return state.side if state is not None else None


def _refuse_plain_join(first: Any, second: Any, model: Any, **kwargs: Any) -> None:
    """A plain ``Join`` of metrics is refused (a metric is no joinable of its own), before any collective."""
    try:
        Join([first, second, model], **kwargs)
    except TypeError as err:
        if "torchmetrics_varlen.join" not in str(err):
            raise AssertionError(f"the plain Join's TypeError does not name torchmetrics_varlen.join: {err}") from err
        return
    raise AssertionError("a plain Join([metric, metric, ddp]) was accepted: expected a TypeError naming tv.join")


def _train(ctx: Ctx, plain: bool, divide_by_initial_world_size: bool) -> str:
    """DDP and two per-step metric losses on the job's device, uneven steps; exact epoch values, equal weights.

    ``plain``: first check that a plain ``Join([first, second, model])`` is refused (a metric is no joinable of its
    own: ``tv.join`` orders the hooks), then train under ``tv.join`` as the other case does.
    """
    steps = [6 - 2 * r if r < 2 else 0 for r in range(ctx.world_size)]  # a rank that ran 4 steps, one with none
    batches = _batches(ctx, steps, seed=300)
    torch.manual_seed(0)
    model = ctx.ddp(torch.nn.Linear(4, 1).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first, second = _BatchMSE().to(ctx.device), _BatchMSE().to(ctx.device)
    kwargs = {"divide_by_initial_world_size": divide_by_initial_world_size}
    if plain:
        _refuse_plain_join(first, second, model, **kwargs)
    manager = tv.join(model, first, second, **kwargs)
    seen_preds, seen_target = [], []
    with _Recorder() as recorder, manager:
        for x, y in batches:
            preds = model(x.to(ctx.device)).squeeze(-1)
            loss = first(preds, y.to(ctx.device)) + second(preds.detach(), y.to(ctx.device))
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            seen_preds.append(preds.detach().cpu())
            seen_target.append(y)
    recorder.check_worker()
    epochs = (first.compute(), second.compute())
    pieces = ctx.gather_objects((seen_preds, seen_target))
    all_preds = torch.cat([p for preds, _ in pieces for p in preds])
    all_target = torch.cat([t for _, targets in pieces for t in targets])
    expected = ((all_preds - all_target) ** 2).mean()
    for name, epoch in zip(("first", "second"), epochs):
        _close(f"epoch MSE of the {name} metric", epoch.cpu(), expected, rtol=1e-10, atol=1e-12)
    weights = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    for rank, other in enumerate(ctx.gather_objects(weights)):
        _close(f"rank {rank}'s weights after Join", other, weights, rtol=0, atol=0)
    # Step s runs on the job's group while every rank runs (here: none, a rank has no data), then on the side group.
    side = _side_group(first)
    on_side = sum(group is side for group in recorder.main_groups)
    how = "tv.join(model, first, second)"
    if plain:
        how = f"Join([first, second, model]) refused with TypeError naming tv.join; {how}"
    return (
        f"{how} (divide_by_initial_world_size={divide_by_initial_world_size}), states on {ctx.device}, steps per"
        f" rank {steps}: no hang, the worker handed the engine CPU tensors only, epoch values as one process,"
        f" {on_side} of {len(recorder.main_groups)} step syncs on the side group"
    )


def _metrics_alone(ctx: Ctx) -> str:
    """Metrics alone with states on the job's device: the step syncs switch to the side group when a rank joins."""
    steps = [5 if r == 0 else 3 for r in range(ctx.world_size)]
    batches = _batches(ctx, steps, seed=400)
    metric = _BatchMSE().to(ctx.device)
    with _Recorder() as recorder, tv.join(None, metric):  # metrics alone (as `tv.join(metric)`)
        values = [metric(x[:, 0].to(ctx.device), y.to(ctx.device)) for x, y in batches]
    recorder.check_worker()
    side = _side_group(metric)
    where = ["side" if group is side else "own" for group in recorder.main_groups]
    expected_where = ["own" if step < min(steps) else "side" for step in range(steps[ctx.rank])]
    if where != expected_where:
        raise AssertionError(f"step syncs ran on {where}: expected {expected_where}")
    everything = ctx.gather_objects(batches)
    for step, value in enumerate(values):
        xs = torch.cat([b[step][0][:, 0] for b in everything if step < len(b)])
        ys = torch.cat([b[step][1] for b in everything if step < len(b)])
        _close(f"step {step}'s global-batch MSE", value.cpu(), ((xs - ys) ** 2).mean(), rtol=1e-10, atol=1e-12)
    return f"tv.join(None, metric), states on {ctx.device}, steps per rank {steps}: step syncs {where}, values exact"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "join-device-states",
        "tv.join(ddp, two metrics) with states on the device: no hang, the worker never touches CUDA",
        lambda ctx: _train(ctx, plain=False, divide_by_initial_world_size=True),
    ),
    Scenario(
        "join-plain-metrics-first",
        "plain Join([metric, metric, ddp]) refused; tv.join with states on the device, DDP dividing by the running"
        " ranks (our count)",
        lambda ctx: _train(ctx, plain=True, divide_by_initial_world_size=False),
    ),
    Scenario("join-metrics-alone", "tv.join(None, metric) with states on the device: the group switch", _metrics_alone),
)
