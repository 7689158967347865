"""Join support: ranks that ran out of data shadow the metrics' per-step syncs until every rank is done.

:func:`join` builds a ``Join`` in which a joined rank takes part in the metrics' per-step syncs with an empty batch
(the "Uneven data and Join" docs page tells the whole story). The non-obvious whys:

* DDP's join hook shadows a running rank's forward and backward collectives in one call, so a joined rank cannot put
  the metric's step sync between them on the same group: once some rank has joined (decided by every rank alike, from
  Join's count of the running ranks), the step syncs travel on a gloo side group (``_engine.side_link``), shadowed from
  a worker thread. Gloo whatever the backend: NCCL must not be driven from two threads at once, and the worker never
  touches CUDA (it sends CPU copies of the defaults, made on the main thread).
* One side group carries every metric of a join: the worker sends the empty batch of the metric it expects
  (``FLAG_SHADOW``, guessed from the order seen so far); when the running ranks sync another one, every rank runs
  that exchange again (:func:`verdict`, from the exchanged table alone).
* The metrics' main hook runs first (DDP's blocks until the running ranks' backward, after their step sync), DDP's
  post hook first (its final model broadcast needs every rank). The worker waits up to the group's own timeout:
  between two steps a running rank may be busy for long (a checkpoint on rank 0).
"""

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import Metric as StockMetric

from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine import deferred
from torchmetrics_varlen._engine.group import Link, link
from torchmetrics_varlen._engine.record import FLAG_SHADOW, H_CONTEXT, H_FLAGS, HEADER_LEN, context_hash
from torchmetrics_varlen._engine.states import StateDict, layout, layout_text, reduce_results, run
from torchmetrics_varlen.metric import Metric

__all__ = ["JoinShadowError", "join"]

TERMINATE = context_hash("torchmetrics_varlen.join.terminate")
FAILED = context_hash("torchmetrics_varlen.join.failed")
GO, RETRY, END, FAIL = "go", "retry", "end", "fail"
_SETTLE_SECONDS = 2.0


class JoinShadowError(RuntimeError):
    """The worker that shadows a metric's per-step syncs failed on some rank (raised by :func:`join` on exit)."""


def step_context(metric: StockMetric, position: int) -> int:
    """The context of a per-step sync on the side group of the join's metric at ``position``.

    The position is part of it: two metrics of one class have the same layout but may have other defaults (a
    ``num_classes``), and a worker must never answer one with the other's empty batch.
    """
    return context_hash(f"{layout_text([metric], 'step')}|join:{position}")


def verdict(table: Tensor, contexts: Sequence[int]) -> tuple[str, int]:
    """What a side-group exchange does, from its table alone (so every rank decides alike), and the running context.

    FAIL: a worker sent its failure record. END: the last ranks to join sent "terminate". RETRY: the running ranks
    agree on a step sync of the join's metrics, and some worker expected another one. GO: anything else (a mismatch
    among running ranks is then raised by the plan, on every rank).
    """
    rows = table[:, :HEADER_LEN].tolist()
    found = [row[H_CONTEXT] for row in rows]
    if FAILED in found:
        return FAIL, 0
    if TERMINATE in found:
        return END, 0
    shadow = [bool(row[H_FLAGS] & FLAG_SHADOW) for row in rows]
    running = {context for context, flag in zip(found, shadow) if not flag}
    if len(running) != 1:
        return GO, 0
    (context,) = running
    stale = any(flag and seen != context for seen, flag in zip(found, shadow))
    return (RETRY if stale and context in contexts else GO), context


def _raise_if_failed(side: Link, table: Tensor) -> None:
    """Raise when the exchanged ``table`` holds a worker's failure record, naming the failing ranks."""
    failed = [rank for rank, row in enumerate(table[:, H_CONTEXT].tolist()) if row == FAILED]
    if failed:
        raise JoinShadowError(
            f"The Join worker that shadows the per-step syncs of {side.what} failed on rank"
            f" {', '.join(map(str, failed))} of its join group; see that rank's error. The job cannot go on: end it."
        )


def _cpu_defaults(metric: StockMetric) -> StateDict:
    """The states of a rank with an empty batch, as plain CPU tensors (a fresh list for list states).

    Made on the main thread: a copy off the GPU, or a tensor subclass's own code, must not run on the worker.
    """
    return {
        name: [] if isinstance(value, list) else value.detach().to("cpu", copy=True).as_subclass(Tensor)
        for name, value in metric._defaults.items()
    }


def _terminate(side: Link) -> None:
    """The last ranks to join end the workers: one "terminate" record; raise if a worker failed meanwhile."""
    seen: list[Tensor] = []

    def stop(table: Tensor) -> bool:
        seen.append(table)
        return True

    _engine.run(_engine.Request([], TERMINATE, "Join.terminate", stop=stop), side)
    _raise_if_failed(side, seen[0])


class _Session(JoinHook):
    """The metrics of one join on this rank: where their per-step syncs go, and the worker of a joined rank.

    The first joinable starts Join's count of the running ranks at each iteration (on DDP's forward, else at each
    per-step sync), read before the sync: a joined rank is blocked in Join's matching all-reduce, so the count drops
    at the first iteration it misses. A model that is not DDP counts the ranks itself: the syncs use the side group.
    As the join's hook: the metrics' main hook first, the model's post hook first (module docstring); none raises.
    """

    def __init__(
        self, metrics: Sequence[Metric], notifier: Any, ddp: Any, counted: bool, model_hook: JoinHook | None
    ) -> None:
        if any(metric.sync_grads for metric in metrics):
            raise RuntimeError(
                "Expected `sync_grads=False` for a metric inside `Join` but got True: a rank that ran out of"
                " data cannot shadow the backward pass of a differentiable gather. Use the default rank-local"
                " gradient (DDP then gives 1/world_size of the single-process gradient; scale the loss by the"
                " world size)."
            )
        self.metrics = [metric for i, metric in enumerate(metrics) if not any(metric is m for m in metrics[:i])]
        self.notifier, self.ddp, self.counted, self.model_hook = notifier, ddp, counted, model_hook
        first = self.metrics[0]
        what = ", ".join(f"`{type(metric).__name__}`" for metric in self.metrics)
        own = link(first.process_group, first.device, first.sync_timeout, f"join of {what}")
        assert own is not None  # `join` makes a session only in a group to sync
        self.own = own
        # Made by every rank of the world the first time (each builds its join at the same point); kept after.
        self.side = _engine.side_link(own, None)  # the worker waits up to the group's own timeout (module docstring)
        deferred.hold(self.side, True)  # pending compute_async syncs on it first, none until `detach`: one driver
        self.contexts = [step_context(metric, position) for position, metric in enumerate(self.metrics)]
        self.joined = not counted
        self.errors: list[BaseException] = []  # the hooks' (raised by `join` on exit, after the worker's)
        self.worker_errors: list[BaseException] = []
        self._values: list[StateDict] = []
        self._start_error: Exception | None = None
        self.thread: threading.Thread | None = None  # the worker, on a rank that joined before the others were done
        self._next: dict[tuple[int, ...], int] = {}  # the last two contexts seen -> the one that followed
        self._history: tuple[int, ...] = ()
        self._pending: Any = None
        self._handle = ddp.register_forward_pre_hook(self._on_forward) if ddp is not None else None
        for metric in self.metrics:
            metric._tv_join = self

    def _on_forward(self, module: Any, args: Any) -> None:
        # Runs instead of DDP's own notify (DDP is not the first joinable here), at the same point of its forward,
        # and hands DDP the work as its own notify would.
        work = _engine.count_running(self.notifier)
        if work is not None:
            module.reducer._set_forward_pass_work_handle(work, module._divide_by_initial_world_size)
            self._pending = work

    def step_sync(self, metric: Metric, label: str) -> StateDict | None:
        """A per-step sync of ``metric`` once some rank has joined (on the side group); else None."""
        if not self.notifier._join_config.enable:
            return None
        if self.ddp is None and self.counted:
            work = _engine.count_running(self.notifier)
            if work is not None:
                self._pending = work
        work, self._pending = self._pending, None
        if work is not None and not self.joined:
            self.joined = _engine.running(work, self.own) < self.own.size
        if not self.joined:
            return None
        position = next(index for index, member in enumerate(self.metrics) if member is metric)  # not `==`
        side = replace(self.side, timeout=metric.sync_timeout, what=f"sync of {label}")

        def stop(table: Tensor) -> bool:
            return verdict(table, self.contexts)[0] == RETRY

        synced: _engine.Synced | None = None
        while synced is None:  # None: a worker expected another metric of the join, and every rank runs it again
            step_layout = layout([metric], "step")
            step_layout.context = self.contexts[position]
            synced = run(step_layout, side, label, 0, "step", stop=stop)
        reduced = reduce_results(step_layout, synced, step_layout.state_name)
        return {name: value for (_, name), value in zip(step_layout.classes.keys, reduced)}

    def detach(self) -> None:
        """End the session: the metrics' per-step syncs go back to their own group, outside any join."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for metric in self.metrics:
            if metric._tv_join is self:
                metric._tv_join = None
        deferred.hold(self.side, False)

    def main_hook(self) -> None:
        if self.thread is None:  # it only starts a thread: the worker must run before DDP's hook blocks
            try:  # the empty batches, snapshot on this (the main) thread
                self._values = [_cpu_defaults(metric) for metric in self.metrics]
            except Exception as err:  # raised by the worker, which sends the failure record the running ranks expect
                self._start_error = err
            self.thread = threading.Thread(target=self._work, name="torchmetrics-varlen-join", daemon=True)
            self.thread.start()
        if self.model_hook is not None:
            self.model_hook.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        try:
            if self.model_hook is not None:  # DDP's final model broadcast: every rank must take part
                self.model_hook.post_hook(is_last_joiner)
        finally:
            try:  # the ranks that never shadowed (the last joiners) send the terminate record
                self.thread.join() if self.thread is not None else _terminate(self.side)
            except Exception as err:  # a raise here would skip the later hooks; `join` raises it on exit
                self.errors.append(err)

    def _guess(self) -> int:
        context = self._next.get(self._history, self._history[-1]) if self._history else self.contexts[0]
        return self.contexts.index(context) if context in self.contexts else 0

    def _work(self) -> None:
        """A joined rank's worker: answers the running ranks' per-step syncs until "terminate"."""
        at_boundary = True  # no exchange of ours is half done: a whole failure record can still be sent
        try:
            if self._start_error is not None:
                raise self._start_error
            index = self._guess()
            while True:
                at_boundary = False
                outcome, context = self._shadow_once(index)
                at_boundary = True
                if outcome == END:
                    return
                if outcome == RETRY:  # the running ranks sync another metric: correct the guess, send that one
                    self._next[self._history] = context
                    index = self.contexts.index(context)
                    continue
                self._next[self._history] = self.contexts[index]
                self._history = (*self._history, self.contexts[index])[-2:]
                index = self._guess()
        except JoinShadowError as err:  # a peer's worker failed: its rank is named already
            self.worker_errors.append(err)
        except BaseException as err:
            rank = self.side.rank
            wrapped = JoinShadowError(
                f"The Join worker that shadows the per-step syncs of {self.side.what} failed on rank {rank} of its join"
                f" group: {type(err).__name__}: {err}"
            )
            wrapped.__cause__ = err
            self.worker_errors.append(wrapped)
            if at_boundary:  # else an exchange is half done: the peers end in a timeout or a mismatch instead
                # A record the running ranks' per-step sync refuses, naming this rank, instead of an empty batch.
                with contextlib.suppress(Exception):  # the original error is what gets reported
                    request = _engine.Request([], FAILED, f"Join failed on rank {rank}", stop=lambda table: True)
                    _engine.run(request, self.side)

    def _shadow_once(self, index: int) -> tuple[str, int]:
        """One exchange as a rank with an empty batch of metric ``index``: what the table said."""
        seen: list[tuple[Tensor, tuple[str, int]]] = []

        def stop(table: Tensor) -> bool:
            seen.append((table, verdict(table, self.contexts)))
            return seen[-1][1][0] != GO

        empty = layout([self.metrics[index]], "step", [self._values[index]])
        empty.context = self.contexts[index]
        # The CPU, not the metric's device: the worker must never touch CUDA (its results are dropped anyway).
        label = f"{type(self.metrics[index]).__name__}.step"
        run(empty, self.side, label, FLAG_SHADOW, "step", stop=stop, device=torch.device("cpu"))
        table, outcome = seen[0]
        _raise_if_failed(self.side, table)
        return outcome


class _JoinedGroup(Joinable):
    """The one joinable :func:`join` hands to ``Join``, the first: the model and the metrics (see ``_Session``)."""

    def __init__(self, model: Joinable | None, metrics: list[Metric]) -> None:
        self.model, self.metrics = model, metrics
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.counted = model is None or self.ddp is not None
        self.session: _Session | None = None
        super().__init__()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        model_hook = self.model.join_hook(**kwargs) if self.model is not None else None
        notifier = self if self.counted else self.model
        self.session = _Session(self.metrics, notifier, self.ddp, self.counted, model_hook)
        return self.session

    @property
    def join_device(self) -> torch.device:
        if self.model is not None:
            return self.model.join_device
        return self.session.own.policy.device if self.session is not None else self.metrics[0].device

    @property
    def join_process_group(self) -> Any:
        if self.model is not None:
            return self.model.join_process_group
        return self.metrics[0].process_group if self.metrics[0].process_group is not None else dist.group.WORLD

    @property
    def _join_config(self) -> Any:
        return self.__dict__["_join_config_value"]

    @_join_config.setter
    def _join_config(self, config: Any) -> None:
        # A model that counts itself is the first joinable; otherwise this group is.
        self.__dict__["_join_config_value"] = config
        if self.model is not None:
            self.model._join_config = config._replace(is_first_joinable=config.is_first_joinable and not self.counted)


def join(model: Joinable | Metric | None, *metrics: Metric, **join_kwargs: Any) -> "_MetricJoin":
    """Run a training loop in which ranks may run out of data: ``Join`` with the hooks in a safe order.

    Inside ``with join(ddp_model, metric, ...):`` a rank that ran out of batches leaves its loop; until every rank
    is done it takes part in DDP's collectives and in each metric's per-step syncs (``dist_sync_on_step=True``) as a
    rank with an empty batch, so nothing hangs and every value stays exact (see the "Uneven data and Join" docs page).
    On exit the metrics leave the join, and an error of the shadowing thread is raised. Every rank of the metrics'
    group must enter the same ``join``; the first one on a group is a collective of the whole world (each slice of a
    ``DeviceMesh`` with its own group, at the same point).

    Args:
        model: the DDP model, another joinable (it then counts the running ranks itself, and the per-step syncs use
            the side group from the first one), None, or a metric, for metrics alone.
        metrics: the metrics (:class:`~torchmetrics_varlen.Metric`) whose per-step syncs are shadowed. A
            ``MetricCollection`` is not a joinable: list its members.
        join_kwargs: keyword arguments of ``Join`` (``enable``, ``throw_on_early_termination``) and of the joinables'
            hooks (``divide_by_initial_world_size`` for DDP).

    Example:
        Without a process group the block simply runs:

        >>> import torch
        >>> import torchmetrics_varlen
        >>> from torchmetrics_varlen.losses import SoftF1Loss
        >>> loss_fn = SoftF1Loss()
        >>> with torchmetrics_varlen.join(None, loss_fn):
        ...     loss = loss_fn(torch.tensor([0.9, 0.2]), torch.tensor([1.0, 0.0]))
        >>> round(loss.item(), 4)
        0.1429
    """
    return _MetricJoin(model, metrics, join_kwargs)


class _MetricJoin:
    """The context manager :func:`join` returns."""

    def __init__(self, model: Joinable | Metric | None, metrics: Sequence[Metric], join_kwargs: dict[str, Any]) -> None:
        if isinstance(model, Metric):  # metrics alone: `join(metric, ...)`
            metrics = (model, *metrics)
            model = None
        for metric in metrics:
            if not isinstance(metric, Metric):
                raise TypeError(
                    f"Expected every metric of `join` to be a `torchmetrics_varlen.Metric` but got"
                    f" {type(metric).__name__}. List the members of a MetricCollection; rebase stock metrics first."
                )
        if model is not None and not isinstance(model, Joinable):
            raise TypeError(f"Expected `model` to be a Joinable (a DDP model) or None but got {type(model).__name__}")
        if model is None and not metrics:
            raise ValueError("Expected a model or at least one metric in `join` but got neither")
        self.model, self.metrics, self.join_kwargs = model, list(metrics), join_kwargs
        self._join: Join | None = None
        self._group: _JoinedGroup | None = None

    def __enter__(self) -> "_MetricJoin":
        if not (dist.is_available() and dist.is_initialized()):
            return self  # nothing to shadow: the body runs as it is
        groups = [metric.process_group or dist.group.WORLD for metric in self.metrics]
        if self.model is not None:
            groups.append(self.model.join_process_group)
        if any(group is not groups[0] for group in groups[1:]):
            raise ValueError(
                "Expected the model and the metrics of `join` on one process group but got several: Join counts the"
                " running ranks on one group. Give the metrics the model's `process_group`."
            )
        if link(groups[0], None, None, "join") is None:
            return self  # a group of one: nothing to shadow
        self._group = _JoinedGroup(self.model, self.metrics) if self.metrics else None  # a model alone: plain Join
        try:
            self._join = Join([self._group or self.model], **self.join_kwargs)  # type: ignore[list-item]
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._join is None:
            return
        try:
            self._join.__exit__(exc_type, exc, traceback)
        except BaseException as err:
            # A collective of Join (or DDP's hook) gave way, most likely because a peer failed and left: if a worker
            # of ours saw why, that is the error to report. Workers stop at once after a peer's failure record.
            shadow = self._errors(settle=True)
            if shadow:
                raise JoinShadowError(str(shadow[0])) from err
            raise
        finally:
            self._leave()
        errors = self._errors()
        if exc is None and errors:
            raise errors[0]

    def _errors(self, settle: bool = False) -> list[BaseException]:
        """The errors of the worker and of the hooks (after waiting a moment for the worker, with ``settle``)."""
        session = self._group.session if self._group is not None else None
        if session is None:
            return []
        if settle and session.thread is not None:
            session.thread.join(timeout=_SETTLE_SECONDS)
        return [*session.worker_errors, *session.errors]

    def _leave(self) -> None:
        session = self._group.session if self._group is not None else None
        if session is not None:
            session.detach()
