"""``torchmetrics_varlen.MetricCollection``: all members' states synced in one shot, compute groups moved once."""

import functools
import weakref
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from torchmetrics import Metric as StockMetric
from torchmetrics import MetricCollection as StockMetricCollection

from torchmetrics_varlen._engine import deferred
from torchmetrics_varlen._engine.group import link, parse_cap, resolve_timeout
from torchmetrics_varlen._engine.states import metrics_device, sync_states
from torchmetrics_varlen.metric import Metric, is_coalescing_sync_fn, set_states

__all__ = ["MetricCollection"]


class MetricCollection(StockMetricCollection):
    """A :class:`torchmetrics.MetricCollection` whose ``compute()`` syncs every member in two collectives in all.

    Members may be stock torchmetrics metrics or :class:`~torchmetrics_varlen.Metric` subclasses. At ``compute()``
    the states of all members that sync on compute travel together (a state a compute group shares moves once), then
    each member computes from the global states; a valid cache is part of the sync, as for a ``Metric``. Members with a
    custom ``dist_sync_fn`` or ``process_group`` sync themselves. A member's own ``compute()`` syncs and caches every
    eligible member at once (``self.log_dict(collection)`` in Lightning moves the data once).

    Args:
        metrics, additional_metrics, prefix, postfix, compute_groups: as for :class:`torchmetrics.MetricCollection`.
        sync_timeout: seconds to wait for the other ranks (see :class:`~torchmetrics_varlen.Metric`).
        sync_cap: the transfer cap of the collection's syncs (see :class:`~torchmetrics_varlen.Metric`); None: the
            smallest of the members' own, else the environment's or the default.
        max_in_flight: how many :meth:`compute_async` syncs of the collection may be pending at once.

    Example:
        >>> import torch
        >>> from torchmetrics.classification import BinaryAccuracy, BinaryAUROC
        >>> from torchmetrics_varlen import MetricCollection
        >>> metrics = MetricCollection([BinaryAccuracy(), BinaryAUROC(thresholds=None)])
        >>> metrics.update(torch.tensor([0.2, 0.9, 0.4]), torch.tensor([0, 1, 1]))
        >>> {name: round(value.item(), 4) for name, value in metrics.compute().items()}
        {'BinaryAccuracy': 0.6667, 'BinaryAUROC': 1.0}
    """

    def __init__(
        self,
        metrics: Any,
        *additional_metrics: StockMetric,
        prefix: str | None = None,
        postfix: str | None = None,
        compute_groups: bool | list[list[str]] = True,
        sync_timeout: float | None = None,
        sync_cap: int | str | None = None,
        max_in_flight: int = 2,
    ) -> None:
        super().__init__(metrics, *additional_metrics, prefix=prefix, postfix=postfix, compute_groups=compute_groups)
        self.sync_timeout = resolve_timeout(sync_timeout)
        self.sync_cap = parse_cap(sync_cap, "sync_cap") if sync_cap is not None else None
        self.max_in_flight = deferred.check_in_flight(max_in_flight)
        self._tv_pending: deque[Future[Any]] = deque()
        self._join_member_computes()

    def add_metrics(self, metrics: Any, *additional_metrics: StockMetric) -> None:
        """Add members as :class:`torchmetrics.MetricCollection` does; their ``compute()`` syncs the collection."""
        super().add_metrics(metrics, *additional_metrics)
        if "sync_timeout" in vars(self):  # not during __init__: that joins the members once they are all in
            self._join_member_computes()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled and deep-copied members get torchmetrics' plain `compute` back: join the copies again.
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._join_member_computes()

    def compute(self) -> dict[str, Any]:
        """Sync all members at once, then compute each one from the global states."""
        with self._synced_members():
            return self._compute_and_reduce("compute")

    def compute_async(self) -> "Future[dict[str, Any]]":
        """Start this ``compute()``'s sync and return at once: a future of exactly the dict ``compute()`` returns now.

        As :meth:`torchmetrics_varlen.Metric.compute_async`, with one sync of every member's states. Where some member
        would sync on its own (``sync_on_compute=False``, a ``ScalarLog``, ...) it computes at once.

        Example:
            >>> import torch
            >>> from torchmetrics.aggregation import MaxMetric, SumMetric
            >>> from torchmetrics_varlen import MetricCollection
            >>> metrics = MetricCollection({"sum": SumMetric(), "max": MaxMetric()})
            >>> metrics.update(torch.tensor([1.0, 5.0]))
            >>> future = metrics.compute_async()
            >>> metrics.reset()  # at once: the pending sync owns a snapshot
            >>> future.result()
            {'max': tensor(5.), 'sum': tensor(6.)}
        """
        members = self._coalesced_members()
        sync_link = link(None, metrics_device(members), self.sync_timeout, "sync of MetricCollection")
        whole = members and len(members) == len(self._modules) and not any(map(deferred.has_child_metrics, members))
        if sync_link is None or not whole:
            return deferred.finished(self.compute)
        stand_ins, compute = deferred.snapshot(members, Metric._finish)
        shell = object.__new__(type(self))  # the collection's own settings, for the result's names
        vars(shell).update(vars(self), _modules=type(self._modules)(zip(self._modules, stand_ins)))

        def run(side: Any) -> dict[str, Any]:
            values = compute(side, phase="collection", label="MetricCollection", cap=self.sync_cap)
            for stand_in, value in zip(stand_ins, values):
                vars(stand_in)["compute"] = lambda value=value: value  # what the member computed
            return StockMetricCollection._compute_and_reduce(shell, "compute")

        return deferred.submit(self, sync_link, metrics_device(members), run)

    def __getstate__(self) -> dict[str, Any]:
        # Futures belong to this process: a copy has none pending.
        return {**super().__getstate__(), "_tv_pending": deque()}  # type: ignore[no-untyped-call]

    def _join_member_computes(self) -> None:
        """Wrap each member's ``compute`` so that the first one computed syncs the whole collection (see above).

        It goes around torchmetrics' own (an instance attribute, dropped when pickling) and holds the collection
        weakly: a member must not keep its collection alive.
        """
        collection = weakref.ref(self)
        for metric in self._modules.values():
            compute = vars(metric).get("compute")
            if isinstance(metric, StockMetric) and callable(compute) and not hasattr(compute, "__tv_collection__"):
                vars(metric)["compute"] = _collection_compute(collection, metric, compute)

    def _cache_members_for(self, trigger: StockMetric) -> bool:
        """Before a member's ``compute()``: sync, compute and cache every eligible member at once; whether it synced.

        Decided from configuration only, the same on every rank (whether caches are valid is part of the sync).
        """
        if "_syncing" in vars(self):
            return False
        members = [m for m in self._coalesced_members() if m.compute_with_cache]
        if trigger not in members:
            return False
        self._sync_and_compute(members, tolerant=True)
        return True

    def _coalesced_members(self) -> list[StockMetric]:
        """Members that take part in the one-shot sync, chosen from their configuration only (equal on all ranks).

        Not from compute groups: they form from local data (an empty rank has none), so ranks could disagree.
        """
        return [
            metric
            for _, metric in self.items(keep_base=True, copy_state=False)
            if metric._to_sync
            and not metric._is_synced
            and is_coalescing_sync_fn(metric.dist_sync_fn)
            and type(metric)._sync_dist in (StockMetric._sync_dist, Metric._sync_dist)  # not one of its own
            and metric.process_group is None
            and metric._defaults
            and metric.distributed_available_fn()
        ]

    @contextmanager
    def _synced_members(self) -> Generator[None, None, None]:
        """Sync, compute and cache every eligible member at once, without torchmetrics' costly per-member steps."""
        members = self._coalesced_members()  # from their configuration: the same on every rank
        self._sync_and_compute(members)
        uncached = [metric for metric in members if not metric.compute_with_cache]
        vars(self)["_syncing"] = True  # the members' computes below must not start another collection sync
        try:
            yield
        finally:
            del vars(self)["_syncing"]
            for metric in uncached:
                vars(metric)["_computed"] = None

    def _sync_and_compute(self, members: list[StockMetric], tolerant: bool = False) -> None:
        """One sync of ``members``' states, then each member's result from the global states into its cache.

        ``tolerant``: a member whose compute raises, computed ahead for another's ``compute()``, is left uncached (its
        own ``compute()`` raises later).
        """
        sync_link = link(None, metrics_device(members), self.sync_timeout, "sync of MetricCollection")
        if members and sync_link is not None:
            cached = all(metric._computed is not None for metric in members)
            synced = sync_states(
                members, sync_link, phase="collection", label="MetricCollection", cap=self.sync_cap, cached=cached
            )
            if synced is None:  # every member's cached result is valid on every rank: it is the global value
                return
        else:  # a group of one: nothing to exchange (stock members would still gather with themselves)
            members = [metric for metric in members if metric._computed is None]
            synced = [{} for _ in members]
        for metric, states in zip(members, synced):
            local = {name: vars(metric)[name] for name in states}
            try:
                set_states(metric, states)
                vars(metric)["_computed"] = Metric._finish(type(metric).compute(metric))  # the unwrapped compute
            except Exception:
                if not tolerant:
                    raise
            finally:
                set_states(metric, local)


def _collection_compute(
    collection: "weakref.ref[MetricCollection]", metric: StockMetric, compute: Callable[..., Any]
) -> Callable[..., Any]:
    """``metric.compute`` that first lets its collection sync all members at once (``forward``'s batch value not)."""

    @functools.wraps(compute)
    def compute_in_collection(*args: Any, **kwargs: Any) -> Any:
        owner = collection()
        # `forward` computes the batch value with `_should_unsync` cleared: a per-step value, never the collection's.
        if owner is not None and metric._should_unsync:
            # Inside the collection's own compute every rank synced every member just now: its result stands.
            synced = "_syncing" in vars(owner) or owner._cache_members_for(metric)
            if synced and metric._computed is not None:  # what the collection's sync computed for this member
                return metric._computed
        return compute(*args, **kwargs)

    compute_in_collection.__tv_collection__ = collection  # type: ignore[attr-defined]
    return compute_in_collection
