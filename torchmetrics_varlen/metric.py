"""``torchmetrics_varlen.Metric``: a torchmetrics base class whose sync is coalesced, varlen-safe and never doubled."""

import copyreg
import functools
import importlib
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics import metric as _tm_metric
from torchmetrics.utilities import distributed as _tm_distributed
from torchmetrics.utilities.data import _squeeze_if_scalar
from torchmetrics.utilities.prints import rank_zero_warn

from torchmetrics_varlen._engine import deferred
from torchmetrics_varlen._engine.group import link, needs_sync, parse_cap, resolve_timeout
from torchmetrics_varlen._engine.states import StateDict, sync_states
from torchmetrics_varlen.gather import gather_all_tensors

__all__ = ["Metric", "rebase"]

_OUR_GATHERS = (None, gather_all_tensors, _tm_distributed.gather_all_tensors)


def is_coalescing_sync_fn(fn: Callable[..., Any] | None) -> bool:
    """True for the gathers the coalesced path replaces: ours, torchmetrics' default, or none given."""
    return fn in _OUR_GATHERS


def local_state_copy(metric: StockMetric) -> StateDict:
    """The states as they are now; lists are copied so that a compute appending to them cannot alter the cache."""
    attrs = vars(metric)
    copy = {}
    for name in metric._defaults:  # a loop: a comprehension is one more call, at every sync
        value = attrs[name]
        copy[name] = list(value) if isinstance(value, list) else value
    return copy


def set_states(metric: StockMetric, states: StateDict) -> None:
    """Write ``states`` (or sync flags) into the instance dict, as ``setattr`` of plain attributes, minus its checks."""
    vars(metric).update(states)


class Metric(StockMetric):
    """Base class for metrics that sync all their states at once and stay exact on uneven and empty ranks.

    Write a metric exactly as for :class:`torchmetrics.Metric` (``add_state``, ``update``, ``compute``) and subclass
    this class instead. Differences from stock torchmetrics (see the Quickstart and "How the sync works"):

    * **One-shot sync.** All states (tensors and lists, any dtypes, shapes and ``dist_reduce_fx``) travel in one
      metadata exchange and one data step, never a barrier. A custom ``dist_sync_fn`` takes the stock per-state path.
    * **Uneven and empty ranks.** ``cat`` states may differ in length on every rank and a rank may hold nothing.
    * **No double sync.** ``sync()`` holds until ``unsync()``: ``compute()`` in between returns the global value with no
      further exchange, a second ``sync()`` is a no-op; ``sync_context`` restores local states even if its body raises.
    * **Never a value from another round.** In a process group every ``compute()`` takes part in a sync (only the
      records move where every rank's cache is valid): call it on every rank alike; each gets this round's value.
    * **Join.** Inside :func:`~torchmetrics_varlen.join` ranks that ran out of data take part in the per-step syncs as
      ranks with an empty batch; a plain ``Join`` of a metric raises ``TypeError``.
    * **Clear failures.** Ranks syncing different things, or data that cannot be combined, raise
      :class:`~torchmetrics_varlen.SyncMismatchError` together; a rank that never arrives makes the others raise
      :class:`~torchmetrics_varlen.SyncTimeoutError` after ``sync_timeout`` seconds.

    Args:
        sync_timeout: seconds to wait for the other ranks at a sync before raising ``SyncTimeoutError``. None takes
            ``TORCHMETRICS_VARLEN_SYNC_TIMEOUT``, else the process group's own timeout; never longer than that, and
            that where a peer is known to be busy (``compute_on_rank``, a ``join``). 0: the backend's timeout only.
        sync_grads: gather states differentiably across ranks, so gradients reach every rank's inputs (see the
            "Metrics as losses" docs page). Every rank must then run the backward pass.
        sync_cap: the most bytes one collective of a sync moves (an int, or a string such as ``"64MiB"``); larger
            transfers move in chunks. None takes ``TORCHMETRICS_VARLEN_SYNC_CAP``, else 256 MiB. The ranks use the
            smallest of theirs. See "How the sync works".
        max_in_flight: how many :meth:`compute_async` syncs may be pending at once; the next first waits for the oldest.
        kwargs: the keyword arguments of :class:`torchmetrics.Metric` (``dist_sync_on_step``, ``process_group``, ...).

    Example:
        >>> import torch
        >>> from torchmetrics_varlen import Metric
        >>> class MeanAbsError(Metric):
        ...     def __init__(self, **kwargs):
        ...         super().__init__(**kwargs)
        ...         self.add_state("abs_sum", default=torch.tensor(0.0), dist_reduce_fx="sum")
        ...         self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")
        ...     def update(self, preds, target):
        ...         self.abs_sum += (preds - target).abs().sum()
        ...         self.count += target.numel()
        ...     def compute(self):
        ...         return self.abs_sum / self.count
        >>> metric = MeanAbsError()
        >>> metric.update(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]))
        >>> metric.compute()
        tensor(0.2500)
    """

    def __init__(
        self,
        *,
        sync_timeout: float | None = None,
        sync_grads: bool = False,
        sync_cap: int | str | None = None,
        max_in_flight: int = 2,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("dist_sync_fn", gather_all_tensors)
        super().__init__(**kwargs)
        if not isinstance(sync_grads, bool):
            raise ValueError(f"Expected keyword argument `sync_grads` to be a `bool` but got {sync_grads!r}")
        self.sync_grads = sync_grads
        self.sync_timeout = resolve_timeout(sync_timeout)
        self.sync_cap = parse_cap(sync_cap, "sync_cap") if sync_cap is not None else None
        self.max_in_flight = deferred.check_in_flight(max_in_flight)
        self._tv_join: Any = None  # the join whose worker shadows this metric's per-step syncs (``join``)
        self._tv_pending: deque[Future[Any]] = deque()  # this metric's pending ``compute_async`` syncs

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state.pop("_tv_classes", None)  # what the sync keeps of the class: made again where it is needed
        # A join (a thread, a process group) and futures belong to this process: a copy is outside any, none pending.
        return {**state, "_tv_join": None, "_tv_pending": deque()}

    def join_hook(self, **kwargs: Any) -> Any:
        """Refuse a plain :class:`torch.distributed.algorithms.join.Join` of a metric: use :func:`~.join` instead.

        Raises:
            TypeError: always, saying what to use.
        """
        raise TypeError(
            f"Expected `torchmetrics_varlen.join(ddp_model, metric)` around a loop with uneven steps but got"
            f" `Join([..., {type(self).__name__}, ...])`: a metric is not a joinable of its own. Use"
            " `with torchmetrics_varlen.join(ddp_model, metric): ...`, which builds the `Join` with the hooks in a"
            " safe order."
        )

    def _sync_dist(self, dist_sync_fn: Callable[..., Any] = gather_all_tensors, process_group: Any = None) -> None:
        if dist_sync_fn not in _OUR_GATHERS:  # see `is_coalescing_sync_fn`
            super()._sync_dist(dist_sync_fn, process_group=process_group)
            return
        attrs = vars(self)
        cached = attrs.pop("_tv_cached", False)  # set by `compute()` for its own sync (see `_wrap_compute`)
        phase = "compute" if self._should_unsync else "step"  # `forward` clears it for its batch compute: per step
        label = f"{type(self).__name__}.{phase}"
        if phase == "step" and self._tv_join is not None:  # inside `join`, once some rank has joined: the side group
            joined = self._tv_join.step_sync(self, label)
            if joined is not None:
                set_states(self, joined)
                return
        sync_link = link(process_group or self.process_group, self.device, self.sync_timeout, f"sync of {label}")
        if sync_link is None:
            synced: list[StateDict] | None = None if cached else [{}]
        else:
            grads = self.sync_grads and torch.is_grad_enabled()
            synced = sync_states([self], sync_link, phase=phase, label=label, differentiable=grads, cached=cached)
        if synced is None:  # every rank's cached result is valid: nothing but the records moved
            attrs["_tv_kept_cache"] = True
        else:
            set_states(self, synced[0])

    def _distributed(self, distributed_available: Callable[[], bool] | None = None) -> bool:
        available = distributed_available or self.distributed_available_fn
        # torchmetrics' default asks what the registry asks first: every sync asks, so once
        up = available is _tm_metric.jit_distributed_available or (callable(available) and available())
        return bool(up) and needs_sync(self.process_group)  # a group of one has nothing to sync

    def sync(
        self,
        dist_sync_fn: Callable[..., Any] | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Callable[[], bool] | None = None,
    ) -> None:
        """Replace the local states by the global ones until :meth:`unsync`; a no-op when already synced.

        Args:
            dist_sync_fn: gather to use; None, this package's or torchmetrics' default take the coalesced path.
            process_group: group to sync over; defaults to the metric's ``process_group``, then the world.
            should_sync: when False, nothing happens.
            distributed_available: callable telling whether a process group is up.
        """
        if not should_sync or self._is_synced or not self._distributed(distributed_available):
            return
        vars(self)["_cache"] = local_state_copy(self)  # plain attributes: see `set_states`
        self._sync_dist(dist_sync_fn or self.dist_sync_fn or gather_all_tensors, process_group=process_group)
        vars(self)["_is_synced"] = True

    def unsync(self, should_unsync: bool = True) -> None:
        """Restore the local states saved by :meth:`sync` so that accumulation can go on; a no-op when not synced.

        Args:
            should_unsync: when False, nothing happens.
        """
        if not should_unsync or not self._is_synced:
            return
        set_states(self, self._cache or {})
        vars(self).update(_is_synced=False, _cache=None)

    @contextmanager
    def sync_context(
        self,
        dist_sync_fn: Callable[..., Any] | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        should_unsync: bool = True,
        distributed_available: Callable[[], bool] | None = None,
    ) -> Generator[None, None, None]:
        """Sync for the ``with`` block's body, then restore local states even if it raises (not if synced before)."""
        was_synced = self._is_synced
        self.sync(dist_sync_fn, process_group, should_sync, distributed_available)
        try:
            yield
        finally:
            if not was_synced:
                self.unsync(should_unsync=should_unsync)

    def _wrap_compute(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(compute)
        def wrapped_compute(*args: Any, **kwargs: Any) -> Any:
            if self._update_count == 0:  # `update_called` is deprecated in torchmetrics
                self._warn_before_update()
            collective = self._to_sync and not self._is_synced and self._distributed()
            cached = self._computed is not None
            if cached and not (collective and self.dist_sync_fn in _OUR_GATHERS):
                return self._computed  # no sync of ours: a valid cache is local, as with stock
            if collective:
                attrs = vars(self)
                attrs["_tv_cached"] = cached  # every rank says whether its cache is valid (see `_sync_dist`)
                try:
                    self.sync(self.dist_sync_fn)  # through `_sync_dist`, so a subclass's override is honoured
                finally:
                    attrs.pop("_tv_cached", None)
                if attrs.pop("_tv_kept_cache", False):  # every rank's cache is valid: it is the global value
                    self.unsync(should_unsync=self._should_unsync)
                    return self._computed
            try:
                value = self._finish(compute(*args, **kwargs))
            finally:
                if collective:
                    self.unsync(should_unsync=self._should_unsync)
            if self.compute_with_cache:
                self._computed = value
            return value

        return wrapped_compute

    @staticmethod
    def _finish(value: Any) -> Any:
        # As stock: clone so that the result shares no memory with the states (a compute may return a state, which
        # later updates change in place). The cached object is the one returned, as with stock.
        return apply_to_collection(_squeeze_if_scalar(value), Tensor, lambda tensor: tensor.clone())

    def _warn_before_update(self) -> None:
        rank_zero_warn(
            f"The ``compute`` method of metric {type(self).__name__} was called before the ``update`` method which may"
            " lead to errors, as metric states have not yet been updated.",
            UserWarning,
        )

    def compute_async(self) -> "Future[Any]":
        """Start this ``compute()``'s sync and return at once: a future of exactly what ``compute()`` returns now.

        Call it on every rank in the same order, as ``compute()``; the metric may be updated or reset at once.
        ``result()`` is bit for bit what a blocking ``compute()`` returns at the call, or raises its error. The sync and
        ``compute`` (which must not communicate) run on a worker thread from a copy of the states, on a gloo side group
        made at the first call on every rank, or else at once: see "Syncs off the critical path".

        Example:
            >>> import torch
            >>> from torchmetrics.aggregation import SumMetric
            >>> from torchmetrics_varlen import rebase
            >>> metric = rebase(SumMetric)()
            >>> metric.update(torch.tensor([1.0, 2.0]))
            >>> future = metric.compute_async()  # no process group: computed at once
            >>> metric.update(torch.tensor(10.0))  # after the call: not in its result
            >>> future.result()
            tensor(3.)
        """
        label = f"{type(self).__name__}.compute"
        collective = self._to_sync and not self._is_synced and self._distributed()
        sync_link = link(self.process_group, self.device, self.sync_timeout, f"sync of {label}") if collective else None
        if sync_link is None or (prepared := self._async_run(label)) is None:
            return deferred.finished(self.compute)
        return deferred.submit(self, sync_link, self.device, *prepared)

    def _async_run(self, label: str) -> tuple[Callable[[Any], Any], list[Any]] | None:
        """What the worker runs on the side group's link, and the events it first waits for; None: compute at once."""
        differentiable = self.sync_grads and torch.is_grad_enabled()
        ours = self.dist_sync_fn in _OUR_GATHERS and type(self)._sync_dist is Metric._sync_dist
        plain = all(name in vars(self) for name in self._defaults)  # not states kept elsewhere (a property)
        if not ours or not plain or differentiable or self._tv_join is not None or deferred.has_child_metrics(self):
            return None
        if self._update_count == 0:
            self._warn_before_update()
        compute = deferred.snapshot([self], type(self)._finish)[1]
        return lambda side: compute(side, phase="compute", label=label)[0], []


_M = TypeVar("_M", bound=StockMetric)


class _RebasedMeta(type(StockMetric)):  # type: ignore[misc]
    """The metaclass of :func:`rebase`'s classes, made at run time under stock names: pickled as ``rebase(base)``."""


def _reduce_rebased_class(cls: type) -> Any:
    base = cls.__dict__.get("_rebased_from")
    if base is None:  # a class of its own deriving from a rebased one: by reference, as any class
        return cls.__qualname__
    # The base by module and name rather than by reference: code that swaps the rebased class in under the stock name
    # (`module.BinaryAUROC = rebase(BinaryAUROC)`) makes pickle's own lookup of the base find the rebased class.
    return _rebase_by_name, (base.__module__, base.__qualname__)


def _rebase_by_name(module: str, qualname: str) -> type[StockMetric]:
    """``rebase`` of the class ``module.qualname`` (the stock one, or the rebased one swapped in): unpickles one."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return rebase(found)


@functools.cache
def _rebased_meta(meta: type) -> type:
    """The metaclass of ``rebase(cls)`` for a class whose metaclass is ``meta`` (torchmetrics': ``ABCMeta``)."""
    rebased_meta = (
        _RebasedMeta if issubclass(_RebasedMeta, meta) else type(f"_Rebased{meta.__name__}", (meta, _RebasedMeta), {})
    )
    # copyreg's table is keyed by the exact metaclass; pickle consults it before its own "a class: by reference".
    copyreg.pickle(rebased_meta, _reduce_rebased_class)
    return rebased_meta


# Stock `_sync_dist` overrides that only gather object list states with `all_gather_object` after the usual sync.
_OBJECT_GATHERING_SYNCS = frozenset({("torchmetrics.detection.mean_ap", "MeanAveragePrecision._sync_dist")})


@functools.cache
def rebase(metric_cls: type[_M]) -> type[_M]:
    """Return a subclass of a stock torchmetrics metric class that syncs through :class:`Metric`.

    The new class keeps the name, arguments and behaviour of ``metric_cls`` and is still an instance of it; only the
    sync changes. It and its instances pickle, deep-copy and ``torch.save`` where ``metric_cls`` is importable: to this
    very class in the same process (one class per base is cached), to an equivalent one in another.

    Args:
        metric_cls: a subclass of :class:`torchmetrics.Metric`.

    Returns:
        ``class <Name>(metric_cls, torchmetrics_varlen.Metric)``, cached per class.

    Raises:
        TypeError: ``metric_cls`` is not a metric class, or is a task wrapper such as ``AUROC`` or ``Accuracy``, whose
            constructor returns an instance of another class (``BinaryAUROC``, ...): rebase that class instead.

    Example:
        >>> import torch
        >>> from torchmetrics.classification import BinaryAUROC
        >>> from torchmetrics_varlen import Metric, rebase
        >>> VarlenAUROC = rebase(BinaryAUROC)
        >>> VarlenAUROC.__name__
        'BinaryAUROC'
        >>> metric = VarlenAUROC(thresholds=None)
        >>> isinstance(metric, BinaryAUROC), isinstance(metric, Metric)
        (True, True)
        >>> metric.update(torch.tensor([0.2, 0.9, 0.4]), torch.tensor([0, 1, 1]))
        >>> metric.compute()
        tensor(1.)
    """
    if not (isinstance(metric_cls, type) and issubclass(metric_cls, StockMetric)):
        raise TypeError(f"Expected `metric_cls` to be a subclass of torchmetrics.Metric but got {metric_cls!r}")
    if issubclass(metric_cls, Metric):
        return metric_cls
    if metric_cls.__new__ is not object.__new__:
        name = metric_cls.__name__
        tasks = "/".join(f"{task}{name}" for task in ("Binary", "Multiclass", "Multilabel"))
        raise TypeError(
            f"Expected `metric_cls` to be a metric class but got {name}, a task wrapper whose constructor returns an"
            f" instance of another class ({tasks}): rebase that class instead, e.g. `rebase(Binary{name})`."
        )
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": metric_cls.__qualname__}
    namespace.update(__doc__=metric_cls.__doc__, _rebased_from=metric_cls)
    sync = getattr(metric_cls, "_sync_dist", None)
    if (getattr(sync, "__module__", None), getattr(sync, "__qualname__", None)) in _OBJECT_GATHERING_SYNCS:
        # Its `_sync_dist` only adds per-state object gathers that the one sync now does itself (see `_objects`);
        # kept, they would gather the synced lists a second time (and index every rank's by rank 0's length).
        namespace["_sync_dist"] = Metric._sync_dist
    base_meta: type = type(metric_cls)
    rebased: type[_M] = _rebased_meta(base_meta)(metric_cls.__name__, (metric_cls, Metric), namespace)
    return rebased
