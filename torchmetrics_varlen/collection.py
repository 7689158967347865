"""``torchmetrics_varlen.MetricCollection``: all members' states synced in one shot, compute groups moved once."""

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torchmetrics import Metric as StockMetric
from torchmetrics import MetricCollection as StockMetricCollection

from torchmetrics_varlen import _transport
from torchmetrics_varlen._state_sync import StateDict, sync_states
from torchmetrics_varlen.metric import is_coalescing_sync_fn, local_state_copy, resolve_timeout

__all__ = ["MetricCollection"]


class MetricCollection(StockMetricCollection):
    """A :class:`torchmetrics.MetricCollection` whose ``compute()`` syncs every member in two collectives in all.

    Members may be stock torchmetrics metrics or :class:`~torchmetrics_varlen.Metric` subclasses. At ``compute()``
    the states of all members that sync on compute travel together in one metadata and one data exchange (a state
    shared by a compute group is moved once), then each member computes from the global states and gets its local
    states back. Members with a custom ``dist_sync_fn`` or a ``process_group`` of their own sync themselves.
    When every member's ``compute()`` result is cached on every rank, only the metadata is exchanged.

    Args:
        metrics: as for :class:`torchmetrics.MetricCollection`.
        additional_metrics: as for :class:`torchmetrics.MetricCollection`.
        prefix: as for :class:`torchmetrics.MetricCollection`.
        postfix: as for :class:`torchmetrics.MetricCollection`.
        compute_groups: as for :class:`torchmetrics.MetricCollection`.
        sync_timeout: seconds to wait for the other ranks (see :class:`~torchmetrics_varlen.Metric`).

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
    ) -> None:
        super().__init__(metrics, *additional_metrics, prefix=prefix, postfix=postfix, compute_groups=compute_groups)
        self.sync_timeout = resolve_timeout(sync_timeout)

    def compute(self) -> dict[str, Any]:
        """Sync all members at once, then compute each one from the global states."""
        with self._synced_members():
            return self._compute_and_reduce("compute")

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
            and metric.process_group is None
            and metric._defaults
            and metric.distributed_available_fn()
        ]

    @contextmanager
    def _synced_members(self) -> Generator[None, None, None]:
        members = self._coalesced_members() if _transport.world_of(None) is not None else []
        if not members:
            yield
            return
        cached = all(m._computed is not None for m in members)
        synced = sync_states(
            members, None, phase="collection", label="MetricCollection", timeout=self.sync_timeout, cached=cached
        )
        if synced is None:  # every rank has every result cached: compute() returns the caches
            yield
            return
        touched: list[tuple[StockMetric, StateDict]] = []
        try:
            for metric, states in zip(members, synced):
                local = local_state_copy(metric)
                touched.append((metric, local))
                for name, value in states.items():
                    setattr(metric, name, value)
                # Mark as synced so the member's own compute() neither syncs again nor fails as "already synced".
                metric._cache, metric._is_synced, metric._computed = dict(local), True, None
                metric._to_sync = False
            yield
        finally:
            for metric, local in touched:
                for name, value in local.items():
                    setattr(metric, name, value)
                metric._is_synced, metric._cache = False, None
                metric._to_sync = metric.sync_on_compute
