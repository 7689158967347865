"""``torchmetrics_varlen.MetricCollection``: all members' states synced in one shot, compute groups moved once."""

import functools
import weakref
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from torchmetrics import Metric as StockMetric
from torchmetrics import MetricCollection as StockMetricCollection

from torchmetrics_varlen._sync import deferred
from torchmetrics_varlen._sync.group import link, parse_cap, resolve_timeout
from torchmetrics_varlen._sync.states import metrics_device, sync_states
from torchmetrics_varlen.metric import Metric, check_in_flight, has_child_metrics, is_coalescing_sync_fn

__all__ = ["MetricCollection"]


_PLAIN_SYNC_DIST = (StockMetric._sync_dist, Metric._sync_dist)


class MetricCollection(StockMetricCollection):
    """A :class:`torchmetrics.MetricCollection` whose ``compute()`` syncs every member in two collectives in all.

    Members may be stock torchmetrics metrics or :class:`~torchmetrics_varlen.Metric` subclasses. At ``compute()``
    the states of all members that sync on compute travel together in one metadata and one data exchange (a state
    shared by a compute group is moved once), then each member computes from the global states and gets its local
    states back. Members with a custom ``dist_sync_fn`` or a ``process_group`` of their own sync themselves.
    As for :class:`~torchmetrics_varlen.Metric`, a valid cache is part of the sync: every rank says whether every
    member's cached result is still valid, and when every rank's are, only the records move and the caches stand.

    A member's own ``compute()`` syncs the whole collection too: it syncs every eligible member at once and caches
    each result, so the members computed next find every rank's caches valid and cost one small exchange each. That
    is how ``self.log_dict(collection)`` in Lightning, which computes member after member at epoch end, moves the
    collection's data once. Members with ``compute_with_cache=False`` compute on their own.

    Args:
        metrics: as for :class:`torchmetrics.MetricCollection`.
        additional_metrics: as for :class:`torchmetrics.MetricCollection`.
        prefix: as for :class:`torchmetrics.MetricCollection`.
        postfix: as for :class:`torchmetrics.MetricCollection`.
        compute_groups: as for :class:`torchmetrics.MetricCollection`.
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
        self.max_in_flight = check_in_flight(max_in_flight)
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

        As :meth:`torchmetrics_varlen.Metric.compute_async`, for every member at once (one sync of all their
        states, on the side group, from the worker thread). Where some member would sync on its own (a
        ``process_group`` of its own, a custom ``dist_sync_fn``, ``sync_on_compute=False``, a ``ScalarLog``, a wrapper
        of other metrics), or nothing is to sync, it computes at once and returns a finished future.

        Returns:
            A :class:`concurrent.futures.Future` of the dict.

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
        whole = members and len(members) == len(self._modules) and not any(map(has_child_metrics, members))
        if sync_link is None or not whole:
            return deferred.finished(self.compute)
        memo: dict[int, Any] = {}
        stand_ins = [deferred.snapshot(metric, memo) for metric in members]
        cached = [metric._computed for metric in members]
        names = list(self._modules)
        shell = object.__new__(type(self))  # the collection's own settings, for the result's names
        vars(shell).update(vars(self))

        def run(side: Any) -> dict[str, Any]:
            every = all(value is not None for value in cached)
            synced = sync_states(
                stand_ins, side, phase="collection", label="MetricCollection", cap=self.sync_cap, cached=every
            )
            values = cached if synced is None else [None] * len(stand_ins)
            for index, states in enumerate(synced or []):
                _set_states(stand_ins[index], states)
                values[index] = Metric._finish(type(members[index]).compute(stand_ins[index]))
            modules = type(self._modules)()
            for name, stand_in, value in zip(names, stand_ins, values):
                vars(stand_in)["compute"] = functools.partial(_identity, value)  # what the member computed
                modules[name] = stand_in
            vars(shell)["_modules"] = modules
            return StockMetricCollection._compute_and_reduce(shell, "compute")

        device = metrics_device(members)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        future = deferred.submit(run, sync_link, self._tv_pending, self.max_in_flight, stream)
        return future if future is not None else deferred.finished(self.compute)  # inside a join: at once

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # type: ignore[no-untyped-call]
        state["_tv_pending"] = deque()  # futures belong to this process: a copy has none pending
        return state

    def _join_member_computes(self) -> None:
        """Wrap each member's ``compute`` so that the first one computed syncs the whole collection (see above).

        torchmetrics keeps a metric's wrapped ``compute`` as an instance attribute (and drops it when pickling); the
        wrapper goes around that one and holds the collection weakly (a member must not keep its collection alive).
        """
        collection = weakref.ref(self)
        for metric in self._modules.values():
            compute = vars(metric).get("compute")
            if isinstance(metric, StockMetric) and callable(compute) and not hasattr(compute, "__tv_collection__"):
                vars(metric)["compute"] = _collection_compute(collection, metric, compute)

    def _cache_members_for(self, trigger: StockMetric) -> bool:
        """A member's ``compute()`` is about to run: sync and compute every eligible member at once, cache each.

        Decided from the members' configuration only (the same on every rank that computes the same member); whether
        their caches are valid is part of the sync. Returns whether it synced.
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

        Compute groups are not used to choose: they form from local data (an empty rank has none), so ranks could
        disagree. Members of a group share state objects instead, and the protocol sends a shared object once.
        """
        return [
            metric
            for _, metric in self.items(keep_base=True, copy_state=False)
            if metric._to_sync
            and not metric._is_synced
            and is_coalescing_sync_fn(metric.dist_sync_fn)
            and type(metric)._sync_dist in _PLAIN_SYNC_DIST  # a member with its own `_sync_dist` syncs through it
            and metric.process_group is None
            and metric._defaults
            and metric.distributed_available_fn()
        ]

    @contextmanager
    def _synced_members(self) -> Generator[None, None, None]:
        """Sync all eligible members at once, compute each from the global states, cache it, restore local states.

        The members' own ``compute()`` then returns the cached global value: no second sync, and none of the
        per-member sync bookkeeping of torchmetrics (that bookkeeping costs more than the exchange itself).
        """
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

        ``tolerant``: a member whose compute raises is left uncached (for one member's ``compute()``, the others are
        computed ahead only to save their syncs: one never updated must not break it; its own ``compute()`` later
        syncs on its own and raises what it would have raised).
        """
        sync_link = link(None, metrics_device(members), self.sync_timeout, "sync of MetricCollection")
        if members and sync_link is not None:
            cached = all(metric._computed is not None for metric in members)
            synced = sync_states(
                members,
                sync_link,
                phase="collection",
                label="MetricCollection",
                cap=self.sync_cap,
                cached=cached,
            )
            if synced is None:  # every member's cached result is valid on every rank: it is the global value
                return
        else:  # a group of one: nothing to exchange (stock members would still gather with themselves)
            members = [metric for metric in members if metric._computed is None]
            synced = [{} for _ in members]
        for metric, states in zip(members, synced):
            local = {name: vars(metric)[name] for name in states}
            try:
                _set_states(metric, states)
                computed = Metric._finish(type(metric).compute(metric))  # the unwrapped compute
                vars(metric)["_computed"] = computed  # a plain attribute, as `_set_states` explains
            except Exception:
                if not tolerant:
                    raise
            finally:
                _set_states(metric, local)


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


def _identity(value: Any) -> Any:
    return value


def _set_states(metric: StockMetric, states: dict[str, Any]) -> None:
    # States are plain instance attributes (torchmetrics never registers them as buffers), so writing them straight
    # into the instance dict is what nn.Module.__setattr__ would do, minus its per-call checks.
    vars(metric).update(states)
