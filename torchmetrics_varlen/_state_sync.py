"""Coalesced sync of metric states: every state of every metric in one metadata and one data exchange.

Used by :class:`torchmetrics_varlen.Metric` (one metric) and :class:`torchmetrics_varlen.MetricCollection` (all
members at once). The reductions reproduce what stock ``torchmetrics.Metric._sync_dist`` does with the gathered
states, except that uneven shapes and empty ranks work: a rank without data contributes nothing, a ``cat`` list
that is empty on every rank stays ``[]`` as on one process, and a ``cat`` list stays a list after the sync (one tensor
per rank, views of the received buffer) instead of being concatenated: ``dim_zero_cat`` in ``compute()`` joins it
exactly as it joins a local list, so the sync moves the data once and copies it nowhere.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics.utilities.data import dim_zero_cat

from torchmetrics_varlen import _protocol, _transport
from torchmetrics_varlen._buffers import StackedRanks
from torchmetrics_varlen._protocol import Entry, LocalEntry, Plan, Ref
from torchmetrics_varlen.errors import SyncMismatchError
from torchmetrics_varlen.gather import exchange_entries

StateDict = dict[str, Any]


def state_names(metric: StockMetric) -> list[str]:
    """The metric's synced states, in registration order (the private ``_reductions`` of torchmetrics)."""
    return list(metric._reductions)


def _reduction_name(fn: Any) -> str:
    return "None" if fn is None else getattr(fn, "__qualname__", type(fn).__name__)


def layout_text(metrics: Sequence[StockMetric], phase: str) -> str:
    """What is being synced, as text equal on every rank that syncs the same thing (hashed into the record)."""
    parts = [phase]
    for metric in metrics:
        states = ",".join(f"{n}:{_reduction_name(metric._reductions[n])}" for n in state_names(metric))
        parts.append(f"{type(metric).__qualname__}({states})")
    return "|".join(parts)


def _entry(value: Any) -> Entry:
    if isinstance(value, Tensor):
        return value
    return list(value)


def sync_states(
    metrics: Sequence[StockMetric],
    group: Any,
    *,
    phase: str,
    label: str,
    timeout: float | None,
    cached: bool = False,
    values: Sequence[StateDict] | None = None,
) -> list[StateDict] | None:
    """Gather and reduce the states of ``metrics`` across ``group`` in two collectives.

    Returns one dict of reduced (global) states per metric, or None when every rank reported ``cached`` (then only
    the metadata was exchanged). The local slot keeps this rank's own tensors, so their autograd graph survives.
    ``values`` replaces the metrics' current states (one dict per metric), for example by their defaults.
    """
    world = _transport.world_of(group)
    assert world is not None
    rank, _ = world
    keys, entries, context, join = sync_layout(metrics, phase, values)
    plan, gathered = exchange_entries(
        entries, group, context=context, label=label, timeout=timeout, synced=cached, join=join
    )
    assert plan is not None  # no `stop` given
    if plan.all_synced:
        return None
    reductions = [(metrics[index]._reductions[name], f"{type(metrics[index]).__name__}.{name}") for index, name in keys]
    reduced = reduce_gathered(reductions, entries, plan, gathered, rank)
    out: list[StateDict] = [{} for _ in metrics]
    for (index, name), value in zip(keys, reduced):
        out[index][name] = value
    return out


def sync_layout(
    metrics: Sequence[StockMetric], phase: str, values: Sequence[StateDict] | None = None
) -> tuple[list[tuple[int, str]], list[LocalEntry], int, list[bool]]:
    """What a sync of ``metrics`` sends: (metric index, state name) keys, entries, context hash, ``cat`` flags."""
    keys = [(index, name) for index, metric in enumerate(metrics) for name in state_names(metric)]
    states = [values[index][name] if values else getattr(metrics[index], name) for index, name in keys]
    context = _protocol.context_hash(layout_text(metrics, phase))
    join = [metrics[index]._reductions[name] is dim_zero_cat for index, name in keys]
    return keys, entries_sharing_objects(states), context, join


def reduce_gathered(
    reductions: Sequence[tuple[Any, str]],
    entries: Sequence[LocalEntry],
    plan: Plan,
    gathered: list[list[Entry]],
    rank: int,
) -> list[Any]:
    """Reduce every gathered entry with its ``(reduction, name)``; ``gathered`` is emptied as it goes (memory).

    The local slot gets this rank's own objects back where they carry an autograd graph (or are lists), and a state
    shared by a compute group on every rank is reduced once.
    """
    reduced: list[Any] = []
    for position, ((reduction, where), local) in enumerate(zip(reductions, entries)):
        per_rank = gathered[position]
        gathered[position] = []
        if plan.entries[position].dense and not (isinstance(local, Tensor) and local.requires_grad):
            # The common case, kept short (a hundred states per sync): equal shapes on every rank, no shared object,
            # no graph of ours to put back, so the stacked ranks go to the reduction as they are.
            reduced.append(reduce_state(per_rank, reduction, where))
            continue
        refs = set(plan.entries[position].refs)
        if len(refs) == 1 and min(refs) >= 0:
            reduced.append(reduced[min(refs)])
        else:
            keep_graph = (isinstance(local, Tensor) and local.requires_grad) or isinstance(local, list)
            if keep_graph or (isinstance(local, Tensor) and local.numel() > 0 and not plan.entries[position].dense):
                per_rank = list(per_rank)
                per_rank[rank] = local  # type: ignore[assignment]  # this rank's own objects keep their graph
            reduced.append(reduce_state(per_rank, reduction, where))
    return reduced


def entries_sharing_objects(values: list[Any]) -> list[LocalEntry]:
    """One entry per state; a state that is the very object of an earlier one (a compute group) becomes a Ref."""
    seen: dict[int, int] = {}
    entries: list[LocalEntry] = []
    for position, value in enumerate(values):
        first = seen.setdefault(id(value), position)
        entries.append(Ref(first) if first != position else _entry(value))
    return entries


def reduce_state(per_rank: list[Entry], reduction: Any, where: str) -> Any:
    """Combine one state's per-rank values the way torchmetrics does after its gather."""
    if isinstance(per_rank, StackedRanks) and reduction is not dim_zero_cat:  # checked first: it never unbinds
        return reduction(per_rank.stacked) if reduction is not None else per_rank.stacked
    if isinstance(per_rank[0], list):
        flat = [item for items in per_rank for item in items]  # type: ignore[union-attr]
        if not flat or reduction is dim_zero_cat:
            # A `cat` list stays a list (one tensor per rank, views of the received buffer): `dim_zero_cat` in
            # compute() joins it, so the sync itself copies nothing.
            return flat
        return reduction(flat) if reduction is not None else flat
    tensors: list[Tensor] = [t for t in per_rank if isinstance(t, Tensor)]
    if reduction is dim_zero_cat:
        # Uneven `cat` tensor states: concatenate what each rank holds (stock stacks, which needs equal shapes).
        return dim_zero_cat([t for t in tensors if t.numel() > 0] or tensors[:1])
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        listing = ", ".join(f"rank {r}: {tuple(t.shape)}" for r, t in enumerate(tensors))
        raise SyncMismatchError(
            f"Expected state `{where}` to have the same shape on every rank (its reduction stacks them) but got"
            f" {listing}. Use dist_reduce_fx='cat' or a list state for data whose size differs between ranks."
        )
    stacked = torch.stack(tensors)
    return reduction(stacked) if reduction is not None else stacked
