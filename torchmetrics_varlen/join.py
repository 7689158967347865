"""Join support: ranks that ran out of data shadow a metric's per-step syncs until every rank is done.

Use :func:`join`: ``with torchmetrics_varlen.join(ddp_model, metric):`` builds a
:class:`torch.distributed.algorithms.join.Join` in which a rank that ran out of batches takes part in the metric's
per-step syncs as a rank with an empty batch (every state at its default), so the other ranks' per-step values and
the epoch ``compute()`` are exact.

Why a side process group and a thread: when the metric is a DDP loss, a running rank issues, per iteration, DDP's
forward collectives, then the metric's step sync, then DDP's backward all-reduces. DDP's own join hook shadows its
forward and backward collectives in one call, so a joined rank cannot put the metric's sync between them on the same
process group. The metric's per-step syncs inside ``join`` therefore travel on a gloo process group of their own
(made once per metric, when its first ``join`` is built), and the joined rank shadows them from a worker thread,
while its main thread runs DDP's hook. The side group is gloo whatever the job's backend: NCCL must not be driven
from two threads at once, and gloo waits the same way on every platform.

Order, decided here rather than by the caller: the model (DDP) is the first joinable, because it counts the running
ranks at the start of each iteration, before its forward collectives; the metrics' hooks run before the model's hook
(they only start the worker, which must run before DDP's hook blocks), and after it on the way out (DDP's final model
broadcast must run on every rank even when a metric has an error to report). Errors of the worker are raised when
``join`` exits, after ``Join`` finished.

Failures: a worker that fails sends a "failed" record instead of its empty batch, so the running ranks raise
:class:`~torchmetrics_varlen.SyncMismatchError` at their next per-step sync (the message names the failing rank)
instead of waiting out ``sync_timeout``; every shadow exchange and the final "terminate" record wait at most the
metric's ``sync_timeout``.
"""

import contextlib
import threading
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from torchmetrics_varlen import _engine, _notes, _policy, _protocol
from torchmetrics_varlen._state_sync import run_layout, sync_layout

if TYPE_CHECKING:
    from torchmetrics_varlen.metric import Metric

__all__ = ["MetricJoinHook", "join"]


_TERMINATE = _protocol.context_hash("torchmetrics_varlen.join.terminate")
_FAILED = _protocol.context_hash("torchmetrics_varlen.join.failed")
_SETTLE_SECONDS = 2.0


class JoinShadowError(RuntimeError):
    """The worker that shadows a metric's per-step syncs failed on some rank (raised by :func:`join` on exit)."""


class MetricJoinHook(JoinHook):
    """Shadows ``metric``'s per-step syncs on a rank that ran out of data, until every rank has joined.

    A worker thread takes part in every per-step sync the running ranks make on the metric's join group, as a rank
    with an empty batch: it does not count iterations, so it works whatever the other joinables (DDP) do between
    the syncs and however many syncs an iteration makes. When every rank has joined, the ranks that joined last send
    one "terminate" record on the join group; the workers, waiting in their next shadow, see it and stop.

    Its hooks never raise: errors are collected in :attr:`errors` and raised by :func:`join` once ``Join`` is done.

    Args:
        metric: the metric whose per-step syncs are shadowed.
    """

    def __init__(self, metric: "Metric") -> None:
        self.metric = metric
        self.errors: list[BaseException] = []
        self._thread: threading.Thread | None = None

    def main_hook(self) -> None:
        """Start the shadowing worker on the first call; it runs until the terminate record."""
        if self._thread is None:
            rank = dist.get_rank(self.metric._join_group)
            name = "torchmetrics-varlen-join"
            self._thread = threading.Thread(target=self._work, args=(rank,), name=name, daemon=True)
            self._thread.start()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Stop the workers: the ranks that never shadowed (the last joiners) send the terminate record."""
        try:
            if self._thread is None:
                _exchange_terminate(self.metric)
            else:
                self._thread.join()
                self._thread = None
        except Exception as err:  # raised by `join` after Join finished: a raise here would skip later hooks
            self.errors.append(err)

    def settle(self, seconds: float) -> None:
        """Give a worker that is finishing (it saw a peer's failure) up to ``seconds`` to record its error."""
        if self._thread is not None:
            self._thread.join(timeout=seconds)

    def _work(self, rank: int) -> None:
        at_boundary = True  # no exchange of ours is half done on the join group: a whole record can still be sent
        try:
            set_thread_device(self.metric.device)
            while True:
                values = _empty_states(self.metric)
                at_boundary = False
                if not _shadow_once(self.metric, values):
                    return
                at_boundary = True
        except BaseException as err:
            if isinstance(err, JoinShadowError):  # a peer's worker failed: its rank is named already
                self.errors.append(err)
                return
            wrapped = JoinShadowError(
                f"The Join worker that shadows the per-step syncs of `{type(self.metric).__name__}` failed on rank"
                f" {rank} of its join group: {type(err).__name__}: {err}"
            )
            wrapped.__cause__ = err
            self.errors.append(wrapped)
            if at_boundary:  # else an exchange is half done: the peers end in a timeout or a mismatch instead
                _send_failure(self.metric, rank)


def set_thread_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device of the calling thread when it is a CUDA device; else do nothing.

    The current CUDA device is per thread and a new thread starts on device 0: without this, the shadow of every
    joined rank of a node would allocate on cuda:0.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _empty_states(metric: "Metric") -> dict[str, Any]:
    """The states of a rank with an empty batch: every state at its default (a fresh list for list states)."""
    return {name: [] if isinstance(value, list) else value for name, value in metric._defaults.items()}


def _failure_rows(table: list[list[int]]) -> list[int]:
    return [rank for rank, row in enumerate(table) if row[_protocol.H_CONTEXT] == _FAILED]


def _exchange(metric: "Metric", values: dict[str, Any] | None, context: int, label: str, stop: Any) -> bool:
    """One sync on the metric's join group: its per-step layout with ``values``, or an empty record.

    False when ``stop`` (which sees the table as nested lists) ended it after the metadata exchange.
    """

    def stop_on(table: Any) -> bool:
        return bool(stop(table.tolist()))

    if values is None:
        synced = _engine.run(
            [], metric._join_group, context=context, label=label, timeout=metric.sync_timeout, stop=stop_on
        )
        return synced is not None
    layout = sync_layout([metric], "step", [values])
    synced = run_layout(
        layout, metric._join_group, label=label, timeout=metric.sync_timeout, phase="step", stop=stop_on
    )
    return synced is not None


def _shadow_once(metric: "Metric", values: dict[str, Any]) -> bool:
    """One per-step sync as a rank with an empty batch; False when the terminate record arrived instead."""
    seen: list[list[int]] = []

    def stop(table: list[list[int]]) -> bool:
        seen[:] = table
        return any(row[_protocol.H_CONTEXT] in (_TERMINATE, _FAILED) for row in table)

    went_on = _exchange(metric, values, 0, f"{type(metric).__name__}.step", stop)
    failed = _failure_rows(seen)
    if failed:
        raise JoinShadowError(_failure_message(metric, failed))
    return went_on


def _failure_message(metric: "Metric", ranks: Sequence[int]) -> str:
    return (
        f"The Join worker that shadows the per-step syncs of `{type(metric).__name__}` failed on rank"
        f" {', '.join(map(str, ranks))} of its join group; see that rank's error. The job cannot go on: end it."
    )


def _send_failure(metric: "Metric", rank: int) -> None:
    """Send a record the running ranks' per-step sync refuses, naming this rank, instead of an empty batch."""
    try:
        _exchange(metric, None, _FAILED, f"Join failed on rank {rank}", lambda table: True)
    except Exception:  # the original error is what gets reported
        pass


def _exchange_terminate(metric: "Metric") -> None:
    seen: list[list[int]] = []

    def stop(table: list[list[int]]) -> bool:
        seen[:] = table
        return True

    _exchange(metric, None, _TERMINATE, "Join.terminate", stop)
    failed = _failure_rows(seen)
    if failed:
        raise JoinShadowError(_failure_message(metric, failed))


class JoinableMetric(Joinable):
    """The :class:`~torch.distributed.algorithms.join.Joinable` side of :class:`~torchmetrics_varlen.Metric`."""

    _join_active: bool
    process_group: Any
    sync_grads: bool
    sync_timeout: float | None

    @property
    def device(self) -> torch.device:
        """The metric's device (torchmetrics.Metric provides it)."""
        raise NotImplementedError

    def _init_join(self) -> None:
        # Joinable.__init__ is not reached through torchmetrics' constructor chain; this is what it would set.
        from torch.distributed.algorithms.join import _JoinConfig

        self._join_hook: MetricJoinHook | None = None
        self._join_group = None
        self._join_active = False
        self._join_config = _JoinConfig.construct_disabled_join_config()  # type: ignore[no-untyped-call]

    def _join_state_for_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        # A process group and a thread cannot be copied: a copy starts outside any Join, with a group made anew.
        state = dict(state)
        state.update(_join_group_ref=None, _join_hook=None, _join_active=False)
        if "_join_config" in state:
            state["_join_config"] = state["_join_config"]._replace(enable=False)
        return state

    @property
    def _join_group(self) -> Any:
        """The side process group of this metric's per-step syncs inside ``join``; None before the first one."""
        ref = self.__dict__.get("_join_group_ref")
        return ref() if ref is not None else None

    @_join_group.setter
    def _join_group(self, group: Any) -> None:
        # Held weakly: torch.distributed holds its groups until destroy_process_group(). Metrics sit in reference
        # cycles (torchmetrics wraps update/compute), so one may live on until the garbage collector runs at
        # interpreter exit; a gloo group destroyed that late can abort the process ("terminate called without an
        # active exception"). After destroy_process_group() the group is gone, and a later join makes a new one.
        self.__dict__["_join_group_ref"] = weakref.ref(group) if group is not None else None

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Refuse a plain ``Join``: use :func:`torchmetrics_varlen.join`, which orders the hooks safely."""
        raise ValueError(
            f"Expected `{type(self).__name__}` inside `torchmetrics_varlen.join(ddp_model, metric, ...)` but got it"
            " in a plain `torch.distributed.algorithms.join.Join`. A plain Join runs the hooks in list order, so"
            " DDP's hook would block before the metric's hook starts shadowing its per-step syncs (the job hangs)."
            " Replace `Join([ddp_model, metric], **kwargs)` by `torchmetrics_varlen.join(ddp_model, metric, **kwargs)`."
        )

    def _make_join_hook(self) -> MetricJoinHook:
        """This metric's hook for :func:`join`; makes the side group on first use (a collective on the world)."""
        if self.sync_grads:
            raise RuntimeError(
                "Expected `sync_grads=False` for a metric inside `Join` but got True: a rank that ran out of data"
                " cannot shadow the backward pass of a differentiable gather. Use the default rank-local gradient"
                " (DDP then gives 1/world_size of the single-process gradient; scale the loss by the world size)."
            )
        if self._join_group is None:
            # A collective on the whole world: every rank builds its join at the same point, so all get here. gloo
            # whatever the job's backend: the worker thread must not drive a second NCCL communicator.
            ranks = None if self.process_group is None else dist.get_process_group_ranks(self.process_group)
            self._join_group = dist.new_group(ranks=ranks, backend="gloo")
        self._join_hook = MetricJoinHook(self)  # type: ignore[arg-type]
        return self._join_hook

    @property
    def join_device(self) -> torch.device:
        """Device of the tensors ``Join`` all-reduces to count the ranks that have not joined."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.device  # nothing to count without a process group (TorchScript reads every attribute)
        return _policy.policy_for(self.process_group, self.device).device

    @property
    def join_process_group(self) -> Any:
        """Process group ``Join`` counts the ranks on: the metric's own (the world by default)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _step_sync_group(self, group: Any) -> Any:
        """Inside ``join`` the per-step syncs move to the join group, and tell Join that this rank still runs."""
        if not self._join_active:
            return group
        Join.notify_join_context(self)
        return self._join_group


class _OrderedHook(JoinHook):
    """The hooks of a :func:`join`: the metrics' main hooks first, the model's post hook first; none raises first."""

    def __init__(self, model_hook: JoinHook | None, metric_hooks: list[MetricJoinHook]) -> None:
        self.model_hook = model_hook
        self.metric_hooks = metric_hooks

    def main_hook(self) -> None:
        for hook in self.metric_hooks:  # they only start a thread: the shadow must run before DDP's hook blocks
            hook.main_hook()
        if self.model_hook is not None:
            self.model_hook.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        try:
            if self.model_hook is not None:  # DDP's final model broadcast: every rank must take part
                self.model_hook.post_hook(is_last_joiner)
        finally:
            for hook in self.metric_hooks:  # they never raise: errors are raised by `join` on exit
                hook.post_hook(is_last_joiner)


class _JoinedGroup(Joinable):
    """The one joinable :func:`join` hands to ``Join``: the model (first, counts the ranks) and the metrics."""

    def __init__(self, model: Joinable | None, metrics: list[JoinableMetric]) -> None:
        self.model = model
        self.metrics = metrics
        self.hook: _OrderedHook | None = None
        super().__init__()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        model_hook = self.model.join_hook(**kwargs) if self.model is not None else None
        self.hook = _OrderedHook(model_hook, [metric._make_join_hook() for metric in self.metrics])
        return self.hook

    @property
    def join_device(self) -> torch.device:
        return (self.model or self.metrics[0]).join_device

    @property
    def join_process_group(self) -> Any:
        return (self.model or self.metrics[0]).join_process_group

    @property
    def _join_config(self) -> Any:
        return self.__dict__["_join_config_value"]

    @_join_config.setter
    def _join_config(self, config: Any) -> None:
        # What Join would set on each joinable were they listed one by one: the first one (the model, else the
        # first metric) counts the running ranks; the others' notify is a no-op.
        self.__dict__["_join_config_value"] = config
        members: list[Any] = [*([self.model] if self.model is not None else []), *self.metrics]
        for position, member in enumerate(members):
            member._join_config = config._replace(is_first_joinable=config.is_first_joinable and position == 0)


def join(model: Joinable | None, *metrics: JoinableMetric, **join_kwargs: Any) -> "_MetricJoin":
    """Run a training loop in which ranks may run out of data: ``Join`` with the hooks in a safe order.

    Inside ``with join(ddp_model, metric, ...):`` a rank that ran out of batches leaves its loop; until every rank
    is done it takes part in DDP's collectives (DDP's own join hook) and in each metric's per-step syncs
    (``dist_sync_on_step=True``) as a rank with an empty batch, so nothing hangs and every value stays exact.

    Builds :class:`torch.distributed.algorithms.join.Join` with the model as first joinable (it counts the running
    ranks before its forward collectives), the metrics' hooks before the model's (they start the shadowing thread
    that DDP's hook waits on) and the model's post hook first (DDP's final model broadcast runs on every rank). On
    exit, whatever happened, the metrics' per-step syncs go back to their own process group; an error of a shadowing
    thread is raised once ``Join`` finished. Every rank of the world must enter the same ``join`` (the first one of a
    metric makes its side process group, a collective on the world). A plain ``Join`` holding a metric of this package
    raises ``ValueError``.

    Args:
        model: the first joinable, usually the ``DistributedDataParallel`` model; None, or a metric, for metrics alone.
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

    def __init__(self, model: Joinable | None, metrics: Sequence[JoinableMetric], join_kwargs: dict[str, Any]) -> None:
        if isinstance(model, JoinableMetric):  # metrics alone: `join(metric, ...)`
            metrics = (model, *metrics)
            model = None
        for metric in metrics:
            if not isinstance(metric, JoinableMetric):
                raise TypeError(
                    f"Expected every metric of `join` to be a `torchmetrics_varlen.Metric` but got"
                    f" {type(metric).__name__}. List the members of a MetricCollection; rebase stock metrics first."
                )
        if model is not None and not isinstance(model, Joinable):
            raise TypeError(f"Expected `model` to be a Joinable (a DDP model) or None but got {type(model).__name__}")
        if model is None and not metrics:
            raise ValueError("Expected a model or at least one metric in `join` but got neither")
        self.model = model
        self.metrics = list(metrics)
        self.join_kwargs = join_kwargs
        self._join: Join | None = None
        self._group: _JoinedGroup | None = None
        # While inside, this rank is alive and runs its steps: a joined rank's shadow waiting for its next step sync
        # (a rank-0 checkpoint save between steps) keeps waiting past `sync_timeout` (see _notes).
        self._busy = contextlib.ExitStack()

    def __enter__(self) -> "_MetricJoin":
        if not (dist.is_available() and dist.is_initialized()):
            return self  # nothing to shadow: the body runs as it is
        members: list[Any] = [*([self.model] if self.model is not None else []), *self.metrics]
        if any(member.join_process_group != members[0].join_process_group for member in members[1:]):
            raise ValueError(
                "Expected the model and the metrics of `join` on one process group but got several: Join counts the"
                " running ranks on one group. Give the metrics the model's `process_group`."
            )
        self._group = _JoinedGroup(self.model, self.metrics)
        try:
            self._busy.enter_context(_notes.busy("it runs its steps inside `join`"))
            self._join = Join([self._group], **self.join_kwargs)
            for metric in self.metrics:  # Join(enable=False) shadows nothing: syncs stay on the metric's group
                metric._join_active = bool(self.join_kwargs.get("enable", True))
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
            for hook in self._metric_hooks():
                hook.settle(_SETTLE_SECONDS)
            shadow = self._shadow_errors()
            if shadow:  # a blocked collective gave way because a peer failed: name the first cause
                raise JoinShadowError(str(shadow[0])) from err
            raise
        finally:
            self._leave()
        if exc is None:
            shadow = self._shadow_errors()
            if shadow:
                raise shadow[0]

    def _metric_hooks(self) -> list[MetricJoinHook]:
        hook = self._group.hook if self._group is not None else None
        return hook.metric_hooks if hook is not None else []

    def _shadow_errors(self) -> list[BaseException]:
        return [err for hook in self._metric_hooks() for err in hook.errors]

    def _leave(self) -> None:
        self._busy.close()
        for metric in self.metrics:
            metric._join_active = False
            metric._join_config = metric._join_config._replace(enable=False)
