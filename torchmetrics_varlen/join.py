"""Join support: ranks that ran out of data shadow the metrics' per-step syncs until every rank is done.

Use :func:`join`: ``with torchmetrics_varlen.join(ddp_model, metric):`` builds a
:class:`torch.distributed.algorithms.join.Join` in which a rank that ran out of batches takes part in the metrics'
per-step syncs as a rank with an empty batch (every state at its default), so the other ranks' per-step values and
the epoch ``compute()`` are exact. A plain ``Join([metric, ddp_model])`` (metrics first) works the same way.

Why a side process group and a thread: when the metric is a DDP loss, a running rank issues, per iteration, DDP's
forward collectives, then the metric's step sync, then DDP's backward all-reduces. DDP's own join hook shadows its
forward and backward collectives in one call, so a joined rank cannot put the metric's sync between them on the same
process group. Once some rank has joined, the per-step syncs therefore travel on a gloo process group of their own
(one per process group, made once by that group's ranks: see :mod:`torchmetrics_varlen._join_shadow`), and the joined
rank shadows them from a worker thread, while its main thread runs DDP's hook. Until then they stay on the metric's
own group: every rank switches at the same sync, decided from Join's count of the running ranks (see
:mod:`torchmetrics_varlen._join_session`). The side group is gloo whatever the job's backend: NCCL must not be driven
from two threads at once, and the worker never touches CUDA (it sends CPU copies of the defaults, made on the main
thread).

Order: a joinable's hook that runs before the metrics' hook (DDP's) blocks until the running ranks reach their
backward pass, after their per-step sync, which the metrics' hook has not started shadowing yet. So the metrics'
hook runs first; :func:`join` arranges it, and a plain ``Join`` listing another joinable before a metric raises
``ValueError``. On the way out DDP's hook runs first in :func:`join` (its final model broadcast must run on every
rank even when a metric has an error to report); errors of the worker are raised when ``join`` exits.

Failures: a worker that fails sends a "failed" record instead of its empty batch, so the running ranks raise
:class:`~torchmetrics_varlen.SyncMismatchError` at their next per-step sync (the message names the failing rank)
instead of waiting out ``sync_timeout``; every shadow exchange and the final "terminate" record wait at most the
metric's ``sync_timeout``.
"""

import contextlib
import inspect
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from torchmetrics_varlen import _join_shadow, _policy, _presence
from torchmetrics_varlen._join_session import _Session
from torchmetrics_varlen._join_shadow import JoinShadowError
from torchmetrics_varlen._state_sync import StateDict

__all__ = ["MetricJoinHook", "join"]

_SETTLE_SECONDS = 2.0


class MetricJoinHook(JoinHook):
    """Shadows the per-step syncs of a join's metrics on a rank that ran out of data, until every rank has joined.

    A worker thread takes part in every per-step sync the running ranks make on the side group, as a rank with an
    empty batch: it does not count iterations, so it works whatever the other joinables (DDP) do between the syncs
    and however many syncs an iteration makes. When every rank has joined, the ranks that joined last send one
    "terminate" record on the side group; the workers, waiting in their next shadow, see it and stop.

    Its hooks never raise inside :func:`join`, which raises the errors once ``Join`` is done. In a plain ``Join``,
    the post hook raises them when it is the last hook, else warns (a raise would skip the next hooks).

    Args:
        session: the metrics of the join on this rank.
    """

    def __init__(self, session: _Session) -> None:
        self.session = session

    def main_hook(self) -> None:
        """Start the shadowing worker on the first call; it runs until the terminate record."""
        if not self.session.shadow.started:
            self.session.shadow.start()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Stop the workers: the ranks that never shadowed (the last joiners) send the terminate record."""
        session = self.session
        try:
            if session.shadow.started:
                session.shadow.join()
            else:
                _join_shadow.exchange_terminate(session.side, session.shadow.timeout, session.shadow.what)
        except Exception as err:  # a raise here would skip the later hooks (DDP's final model broadcast)
            session.errors.append(err)
        if session.owned:
            return
        session.detach()
        errors = session.all_errors()
        if errors and not session.followed:
            raise errors[0]
        for problem in errors:
            warnings.warn(f"{type(problem).__name__}: {problem}", RuntimeWarning, stacklevel=2)


class _Silent(JoinHook):
    """The hook of a plain ``Join``'s metrics after the first: the first one's hook shadows them all."""


def _calling_join() -> Join | None:
    """The ``Join`` whose constructor asks for our hook (it holds the list of joinables), if that is the caller."""
    frame = inspect.currentframe()
    for _ in range(6):  # join_hook <- (list comprehension) <- Join.__init__
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Join) and hasattr(candidate, "_joinables"):
            return candidate
        frame = frame.f_back
    return None


def _check_order(joinables: Sequence[Any]) -> None:
    """Refuse another joinable's hook before a metric's: it would block before the metric's shadow starts."""
    positions = [index for index, joinable in enumerate(joinables) if isinstance(joinable, JoinableMetric)]
    before = [index for index, joinable in enumerate(joinables[: positions[-1]]) if index not in positions]
    if before:
        other, metric = joinables[before[0]], joinables[positions[-1]]
        raise ValueError(
            f"Expected the metrics before any other joinable in `Join` but got `{type(other).__name__}` (position"
            f" {before[0]}) before `{type(metric).__name__}` (position {positions[-1]}). Join runs the hooks in list"
            f" order, so `{type(other).__name__}`'s hook would block before the metric's hook starts shadowing its"
            " per-step syncs (the job hangs). List the metrics first, `Join([metric, ddp_model], **kwargs)`, or use"
            " `torchmetrics_varlen.join(ddp_model, metric, **kwargs)`."
        )


class JoinableMetric(Joinable):
    """The :class:`~torch.distributed.algorithms.join.Joinable` side of :class:`~torchmetrics_varlen.Metric`."""

    _join_session: _Session | None
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

        self._join_session = None
        self._join_config = _JoinConfig.construct_disabled_join_config()  # type: ignore[no-untyped-call]

    def _join_state_for_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        # A session holds a thread and a process group, which cannot be copied: a copy starts outside any Join.
        state = dict(state)
        state["_join_session"] = None
        if "_join_config" in state:
            state["_join_config"] = state["_join_config"]._replace(enable=False)
        return state

    @property
    def _join_group(self) -> Any:
        """The side group of this metric's process group, once a Join made it; else None."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return _join_shadow.cached_side_group(self.process_group)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook of a plain ``Join``: the metrics listed first, then at most a model (DDP).

        The first metric's hook shadows every metric of the list; the first metric counts the running ranks, on
        DDP's forward when a DDP model follows, else at each per-step sync. A joinable listed before a metric is
        refused with ``ValueError``: its hook would block before the metric's hook runs.
        """
        owner = _calling_join()
        joinables: list[Any] = list(owner._joinables) if owner is not None else [self]
        _check_order(joinables)
        session = self._join_session
        if session is not None and owner is not None and session.owner is owner:
            return _Silent()
        metrics = [joinable for joinable in joinables if isinstance(joinable, JoinableMetric)]
        ddp = next((j for j in joinables if isinstance(j, DistributedDataParallel)), None)
        session = _Session(metrics, metrics[0], ddp, counted=True, owned=False, followed=len(joinables) > len(metrics))
        session.owner = owner
        return MetricJoinHook(session)

    def _join_step_sync(self, label: str) -> StateDict | None:
        """A per-step sync inside Join once some rank has joined (on the side group); else None."""
        session = self._join_session
        if session is None or not session.enabled:
            return None
        side = session.step_group()
        if side is None:
            return None
        position = next(index for index, metric in enumerate(session.metrics) if metric is self)  # not `==`
        return _join_shadow.step_sync(
            self,  # type: ignore[arg-type]
            position,
            side,
            session.contexts,
            label,
            self.sync_timeout,
        )

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


class _OrderedHook(JoinHook):
    """The hooks of a :func:`join`: the metrics' main hook first, the model's post hook first; none raises first."""

    def __init__(self, model_hook: JoinHook | None, metric_hook: MetricJoinHook) -> None:
        self.model_hook = model_hook
        self.metric_hook = metric_hook

    def main_hook(self) -> None:
        self.metric_hook.main_hook()  # it only starts a thread: the shadow must run before DDP's hook blocks
        if self.model_hook is not None:
            self.model_hook.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        try:
            if self.model_hook is not None:  # DDP's final model broadcast: every rank must take part
                self.model_hook.post_hook(is_last_joiner)
        finally:
            self.metric_hook.post_hook(is_last_joiner)  # never raises here: `join` raises its errors on exit


class _JoinedGroup(Joinable):
    """The one joinable :func:`join` hands to ``Join``: the model and the metrics.

    It is the first joinable, and counts the running ranks (on DDP's forward, or at each per-step sync without a
    model) so that the metrics can read the count; a model that is not DDP counts them itself instead.
    """

    def __init__(self, model: Joinable | None, metrics: list[JoinableMetric]) -> None:
        self.model = model
        self.metrics = metrics
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.counted = model is None or self.ddp is not None
        self.session: _Session | None = None
        self.hook: _OrderedHook | None = None
        super().__init__()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        model_hook = self.model.join_hook(**kwargs) if self.model is not None else None
        notifier = self if self.counted else self.model
        self.session = _Session(self.metrics, notifier, self.ddp, self.counted, owned=True)
        self.hook = _OrderedHook(model_hook, MetricJoinHook(self.session))
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
        # What each member needs of Join's config: "enable" for all, "first" only for a model that counts itself.
        self.__dict__["_join_config_value"] = config
        first = config.is_first_joinable and not self.counted
        if self.model is not None:
            self.model._join_config = config._replace(is_first_joinable=first)
        for metric in self.metrics:
            metric._join_config = config._replace(is_first_joinable=False)


def join(model: Joinable | None, *metrics: JoinableMetric, **join_kwargs: Any) -> "_MetricJoin":
    """Run a training loop in which ranks may run out of data: ``Join`` with the hooks in a safe order.

    Inside ``with join(ddp_model, metric, ...):`` a rank that ran out of batches leaves its loop; until every rank
    is done it takes part in DDP's collectives (DDP's own join hook) and in each metric's per-step syncs
    (``dist_sync_on_step=True``) as a rank with an empty batch, so nothing hangs and every value stays exact.

    Builds :class:`torch.distributed.algorithms.join.Join` with one joinable that counts the running ranks (on the
    DDP model's forward, or at each per-step sync for metrics alone), runs the metrics' hook before the model's (it
    starts the shadowing thread that DDP's hook waits on) and the model's post hook first (DDP's final model
    broadcast runs on every rank). The per-step syncs travel on the metrics' own process group until some rank has
    joined, then on a gloo side group. On exit, whatever happened, the metrics leave the join; an error of the
    shadowing thread is raised once ``Join`` finished. Every rank of the metrics' process group must enter the same
    ``join`` (the first one on a process group makes its side group, with that group's ranks alone: each slice of a
    ``DeviceMesh`` may run its own). A plain ``Join`` works too when it lists the metrics first
    (``Join([metric, ddp_model])``); one that lists them after another joinable raises ``ValueError``.

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
        # (a rank-0 checkpoint save between steps) keeps waiting past `sync_timeout` (see _presence).
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
            self._busy.enter_context(_presence.busy("it runs its steps inside `join`"))
            self._join = Join([self._group], **self.join_kwargs)
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
            session = self._session()
            if session is not None:
                session.shadow.join(timeout=_SETTLE_SECONDS)
            shadow = session.all_errors() if session is not None else []
            if shadow:  # a blocked collective gave way because a peer failed: name the first cause
                raise JoinShadowError(str(shadow[0])) from err
            raise
        finally:
            self._leave()
        session = self._session()
        if exc is None and session is not None:
            errors = session.all_errors()
            if errors:
                raise errors[0]

    def _session(self) -> _Session | None:
        return self._group.session if self._group is not None else None

    def _leave(self) -> None:
        session = self._session()
        if session is not None:
            session.detach()
        self._busy.close()
        for metric in self.metrics:
            metric._join_config = metric._join_config._replace(enable=False)
