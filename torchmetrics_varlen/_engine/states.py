"""Metric states in, reduced states out: the states layer between the metrics and the engine.

* **Layout** (:func:`layout`): a sync of some metrics sends every synced state of every metric, in registration order,
  as one entry each; a state that is the very object of an earlier one (a compute group) goes as a reference, so
  shared data moves once. What the metric classes alone decide (the states, their reductions, the context hash) is
  kept per set of classes (:func:`_class_layout`).
* **Sync** (:func:`sync_states`): one request of the engine for all of them (a repeated sync of small dense states
  is learnt: its key is the classes, the label, the states' dtypes and shapes).
* **Reduce** (:func:`reduce_results`): each state's per-rank values combined as stock ``Metric._sync_dist`` combines
  what its gather returns, with the same types (a ``cat`` list comes back as one concatenated tensor), except that
  uneven shapes and empty ranks work. Integer sums, maxima and minima whose data rode in the records are reduced a
  whole dense group at a time (exact: the same values as one reduction per state).
"""

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_mean, dim_zero_min, dim_zero_sum

from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine import move, objects, record
from torchmetrics_varlen._engine.group import Link, sent_cap
from torchmetrics_varlen._engine.mismatch import ObjectsBesideTensorsError
from torchmetrics_varlen._engine.pack import Joined, Reduced, Result, Stacked
from torchmetrics_varlen._engine.plan import OP_MAX, OP_MEAN, OP_MIN, OP_NONE, OP_SUM, Plan
from torchmetrics_varlen._engine.record import Entry, LocalEntry, ObjectList, Ref
from torchmetrics_varlen.errors import SyncMismatchError

StateDict = dict[str, Any]
_OPS = MappingProxyType({dim_zero_sum: OP_SUM, dim_zero_max: OP_MAX, dim_zero_min: OP_MIN, dim_zero_mean: OP_MEAN})
_FUSED = MappingProxyType({dim_zero_sum: "sum", dim_zero_max: "amax", dim_zero_min: "amin"})  # exact on integers
_Signature = tuple[tuple[type, tuple[tuple[str, Any], ...]], ...]
_Empty = tuple[torch.dtype, torch.device] | None  # what an empty `cat` state takes (see `Layout.empty`)


def _signature(metrics: Sequence[StockMetric]) -> _Signature:
    """Each metric's class and synced states with their reductions: everything a layout's class part follows from."""
    return tuple((type(metric), tuple(metric._reductions.items())) for metric in metrics)


def layout_text(metrics: Sequence[StockMetric], phase: str) -> str:
    """What is being synced, as text equal on every rank that syncs the same thing (hashed into the record)."""
    return _text(phase, _signature(metrics))


def _text(phase: str, signature: _Signature) -> str:
    parts = [phase]
    for cls, reductions in signature:
        states = ",".join(f"{name}:{_reduction_name(fn)}" for name, fn in reductions)
        parts.append(f"{cls.__qualname__}({states})")
    return "|".join(parts)


def _reduction_name(fn: Any) -> str:
    return "None" if fn is None else getattr(fn, "__qualname__", type(fn).__name__)


@dataclass(eq=False)
class ClassLayout:
    """What a set of metric classes syncs in a phase (read only; hashed by identity: part of a learnt sync's key)."""

    keys: list[tuple[int, str]]  # (metric index, state name) per entry
    reductions: list[Any]
    ops: list[int]
    cat: list[bool]
    context: int
    classes: list[str]
    means: list[int]  # positions of the `mean` states, whose aux word is the owning metric's update count

    def state_name(self, position: int) -> str:
        """``"<metric class>.<state>"`` of the entry at ``position``: error messages."""
        index, name = self.keys[position]
        return f"{self.classes[index]}.{name}"


@functools.lru_cache(maxsize=256)
def _class_layout(phase: str, signature: _Signature) -> ClassLayout:
    # Process-global: a per-step sync asks at every step. Keyed by the classes and the reduction objects themselves
    # (held by the key, so no id is ever reused), never by a digest: a wrong hit would send another layout.
    keys = [(index, name) for index, (_, reductions) in enumerate(signature) for name, _ in reductions]
    reductions = [fn for _, pairs in signature for _, fn in pairs]
    ops = [_OPS.get(fn, OP_NONE) for fn in reductions]
    return ClassLayout(
        keys=keys,
        reductions=reductions,
        ops=ops,
        cat=[fn is dim_zero_cat for fn in reductions],
        context=record.context_hash(_text(phase, signature)),
        classes=[cls.__name__ for cls, _ in signature],
        means=[position for position, op in enumerate(ops) if op == OP_MEAN],
    )


def class_layout(metrics: Sequence[StockMetric], phase: str) -> ClassLayout:
    """The class part of a layout of ``metrics`` in ``phase``; a package metric alone keeps it (every sync asks)."""
    attrs = vars(metrics[0]) if len(metrics) == 1 and "_tv_join" in vars(metrics[0]) else None  # not a stock one
    kept = attrs.get("_tv_classes") if attrs is not None else None  # never pickled
    if kept is not None and kept[0] == phase and kept[1] == len(metrics[0]._reductions):
        return kept[2]  # type: ignore[no-any-return]
    signature = _signature(metrics)
    try:
        found = _class_layout(phase, signature)
    except TypeError:  # a reduction that cannot be hashed: nothing to look up by
        found = _class_layout.__wrapped__(phase, signature)
    if attrs is not None:
        attrs["_tv_classes"] = (phase, len(metrics[0]._reductions), found)  # `add_state` later: another length
    return found


@dataclass
class Layout:
    """What a sync of some metrics sends, and how each entry is reduced afterwards."""

    classes: ClassLayout
    entries: list[LocalEntry]
    aux: list[int]  # the owning metric's update count, for `mean` states (see `_warn_mean_of_means`)
    graph: bool  # a local tensor state carries an autograd graph
    # `cat` entries: the metric's (dtype, device) for an empty result (stock sends ``tensor([], dtype=self.dtype)``)
    empty: list[_Empty]
    device: torch.device  # the metrics' device: equal on every rank, never the states' own
    cap: int | None = None  # the smallest `sync_cap` of the metrics, None when none has one
    context: int = 0

    def state_name(self, position: int) -> str:
        """``"<metric class>.<state>"`` of the entry at ``position``: error messages."""
        return self.classes.state_name(position)


def metrics_device(metrics: Sequence[StockMetric]) -> torch.device:
    """The first ``Metric.device`` not the CPU, else the CPU: equal on every rank (an empty list state has none)."""
    return next((m.device for m in metrics if m.device.type != "cpu"), torch.device("cpu"))


def states_of(metrics: Sequence[StockMetric], classes: ClassLayout, values: Sequence[StateDict] | None) -> list[Any]:
    """The synced states in the layout's order: from ``values`` (one dict per metric) where given."""
    if values:
        return [values[index][name] for index, name in classes.keys]
    attrs = [vars(metric) for metric in metrics]  # plain attributes (tests/test_torchmetrics_internals.py)
    try:
        return [attrs[index][name] for index, name in classes.keys]
    except KeyError:  # a subclass that keeps a state elsewhere (a property): as stock reads it
        return [getattr(metrics[index], name) for index, name in classes.keys]


def layout(metrics: Sequence[StockMetric], phase: str, values: Sequence[StateDict] | None = None) -> Layout:
    """The layout of a sync of ``metrics``; ``values`` replaces their current states (one dict per metric)."""
    classes = class_layout(metrics, phase)
    return _layout(metrics, classes, states_of(metrics, classes, values))


def _layout(metrics: Sequence[StockMetric], classes: ClassLayout, states: list[Any]) -> Layout:
    aux = [metrics[i]._update_count if op == OP_MEAN else 0 for (i, _), op in zip(classes.keys, classes.ops)]
    entries = entries_sharing_objects(states, classes.reductions)
    # From the entries: an object list's tensors travel detached, so it is not scanned item by item
    graph = any([carries_graph(entry) for entry in entries if not isinstance(entry, ObjectList)])
    empty = [(metrics[i].dtype, metrics[i].device) if cat else None for (i, _), cat in zip(classes.keys, classes.cat)]
    return Layout(classes, entries, aux, graph, empty, metrics_device(metrics), metrics_cap(metrics), classes.context)


def metrics_cap(metrics: Sequence[StockMetric]) -> int | None:
    """The smallest ``sync_cap`` of ``metrics`` (an instance attribute), None when none has one."""
    return min((cap for metric in metrics if (cap := vars(metric).get("sync_cap")) is not None), default=None)


def entries_sharing_objects(values: list[Any], reductions: list[Any]) -> list[LocalEntry]:
    """One entry per state; a state that is the very object of an earlier one (a compute group) becomes a Ref.

    Only where the reduction is the same too: a Ref's value is the earlier entry's reduced value, and stock reduces
    every state with its own reduction, also two states holding one tensor.
    """
    if len({id(value) for value in values}) == len(values):  # the usual case: no state is another's object
        return [value if isinstance(value, Tensor) else objects.encode(list(value)) for value in values]
    seen: dict[tuple[int, int], int] = {}
    entries: list[LocalEntry] = []
    for position, value in enumerate(values):
        first = seen.setdefault((id(value), id(reductions[position])), position)
        local = value if isinstance(value, Tensor) else objects.encode(list(value))
        entries.append(Ref(first) if first != position else local)
    return entries


# ---------------------------------------------------------------------------------------------------- sync
def sync_states(
    metrics: Sequence[StockMetric],
    link: Link,
    *,
    phase: str,
    label: str,
    values: Sequence[StateDict] | None = None,
    differentiable: bool = False,
    cap: int | None = None,
    cached: bool = False,
) -> list[StateDict] | None:
    """Gather and reduce the states of ``metrics`` over ``link``: one dict of global states per metric.

    ``cached``: this rank's last result is still valid (no update since). When every rank's is, the sync ends after
    the records (on every rank alike) and None is returned: each rank's cache is the global value. The local slot
    keeps this rank's own tensors, so their rank-local autograd graph survives; with ``differentiable`` the sync is
    one autograd node instead. ``cap`` (bytes) replaces the metrics' own ``sync_cap``.
    """
    classes = class_layout(metrics, phase)
    states = states_of(metrics, classes, values)
    flags = (record.FLAG_DIFF if differentiable else 0) | (record.FLAG_CACHED if cached else 0)
    stop = every_rank_cached if phase != "step" else None
    cap = sent_cap(cap if cap is not None else metrics_cap(metrics))
    dense = all(isinstance(state, Tensor) and not state.requires_grad for state in states)
    if dense and not (differentiable or classes.means) and len({id(state) for state in states}) == len(states):
        # The engine's fast path: dense tensors, each its own object, no graph, no mean. Keyed by what the header and
        # slots follow from (of the policy: its reduce flag; its device is checked with the states').
        key = (classes, label, flags, cap, link.policy.reduce, tuple([(state.dtype, state.shape) for state in states]))
        request = _engine.Request(
            states,
            classes.context,
            label,
            flags,
            ops=classes.ops,
            cat=classes.cat,
            names=classes.state_name,
            device=metrics_device(metrics),
            cap=cap,
            grad="always" if phase == "step" else "if_graph",
            stop=stop,
            key=key,
        )
        synced = _engine.run(request, link)
        if synced is None:
            return None
        if synced.blocks and len(synced.blocks) == len(synced.plan.groups) and not synced.plan.differentiable:
            return _fused_states(len(metrics), classes, synced)
        sync_layout = _layout(metrics, classes, states)
    else:
        sync_layout = _layout(metrics, classes, states)
        synced = run(sync_layout, link, label, flags, phase, stop=stop, cap=cap)
        if synced is None:
            return None
    _warn_mean_of_means(metrics, sync_layout, synced.plan)
    loaded = _load_objects_on_every_rank(sync_layout, synced, link)
    reduced = reduce_results(sync_layout, synced, sync_layout.state_name, loaded=loaded)
    out: list[StateDict] = [{} for _ in metrics]
    for (index, name), value in zip(classes.keys, reduced):
        out[index][name] = value
    return out


def every_rank_cached(table: Tensor) -> bool:
    """Whether every rank's record says its cached result is valid (``FLAG_CACHED``)."""
    return bool((table[:, record.H_FLAGS] & record.FLAG_CACHED).all())


def _fused_states(count: int, classes: ClassLayout, synced: _engine.Synced) -> list[StateDict]:
    """The states of a sync whose data rode in the records: integer sums, maxima and minima a whole group at once."""
    out: list[StateDict] = [{} for _ in range(count)]
    for group, block in synced.blocks:
        reduction = classes.reductions[group.indices[0]]
        fused = _FUSED.get(reduction)
        exact = not (group.dtype.is_floating_point or group.dtype.is_complex)
        if fused is not None and exact and all(classes.reductions[i] is reduction for i in group.indices):
            reduced = getattr(block, fused)(0)  # torch.sum widens to int64, as stock's torch.sum of the stack does
            for index, value in zip(group.indices, reduced.split(group.numels)):
                metric, name = classes.keys[index]
                out[metric][name] = value.view(synced.plan.entries[index].shape)
            continue
        for index in group.indices:  # `synced.results`: cut from the blocks once, when first asked for
            metric, name = classes.keys[index]
            result = synced.results[index]
            assert isinstance(result, Stacked)
            out[metric][name] = stacked_value(result, classes.reductions[index])
    return out


def run(
    sync_layout: Layout,
    link: Link,
    label: str,
    flags: int = 0,
    phase: str = "compute",
    *,
    dst: int | None = None,
    stop: Callable[[Tensor], bool] | None = None,
    device: torch.device | None = None,
    cap: int | None = None,
) -> _engine.Synced | None:
    """Run the engine on a layout: its entries, reductions and flags (a graph-carrying state sets ``FLAG_GRAD``).

    ``device`` replaces the layout's (the metrics' device) as where empty entries' results go: the Join worker,
    which must never touch CUDA, passes the CPU.
    """
    request = _engine.Request(
        sync_layout.entries,
        sync_layout.context,
        label,
        flags | (record.FLAG_GRAD if sync_layout.graph else 0),
        sync_layout.aux,
        sync_layout.classes.ops,
        sync_layout.classes.cat,
        sync_layout.state_name,
        device or sync_layout.device,
        cap if cap is not None else sent_cap(sync_layout.cap),
        dst,
        "always" if phase == "step" else "if_graph",
        stop,
    )
    try:
        return _engine.run(request, link)
    except ObjectsBesideTensorsError as mixed:  # raised alike on every rank, before any data moved: sync again
        for position in mixed.positions:  # `request.entries` is this list: encoded in place
            entry = sync_layout.entries[position]
            if isinstance(entry, list) and not isinstance(entry, ObjectList):
                sync_layout.entries[position] = objects.encode(entry, always=True)
    return _engine.run(request, link)


def _load_objects_on_every_rank(sync_layout: Layout, synced: _engine.Synced, link: Link) -> bool:
    """Load list states' objects, then agree that every rank could (a tiny all-gather where the records show some)."""
    positions = objects.object_positions(synced.plan.entries)
    if not positions:
        return False
    failure = objects.decode_results(synced.results, synced.plan.entries, positions, sync_layout.device)
    table = move.agree(objects.failure_words(failure), link, "objects loaded")
    error = objects.agreed_error(table, sync_layout.state_name, link.what, failure)
    if error is not None:
        raise error
    return True


def reduce_results(
    sync_layout: Layout, synced: _engine.Synced, where: Callable[[int], str], loaded: bool = False
) -> list[Any]:
    """Reduce every entry's result with its reduction, as stock does with the gathered states.

    ``where`` names a position's state in errors. List states' objects are loaded first unless ``loaded`` (agreed by
    every rank); a failure here raises on this rank (one-rank compute sends it on). ``synced.results`` is emptied as it
    goes (memory). Outside a differentiable sync the local slot keeps this rank's objects that carry a graph, as stock.
    """
    plan, rank, results = synced.plan, synced.rank, synced.results
    classes = sync_layout.classes
    positions = [] if loaded else objects.object_positions(plan.entries)
    failure = objects.decode_results(results, plan.entries, positions, sync_layout.device) if positions else None
    if failure is not None:
        what = "sync of " + ", ".join(classes.classes)
        raise objects.load_error(rank, failure.position, failure.source, failure.type_name, where, what, failure)
    keep_graph = not plan.differentiable
    reduced: list[Any] = []
    for position, (reduction, op, local) in enumerate(zip(classes.reductions, classes.ops, sync_layout.entries)):
        result, results[position] = results[position], None
        if result is None:  # the same object as an earlier entry on every rank (a compute group): reduced once
            assert isinstance(local, Ref)
            reduced.append(reduced[local.index])
            continue
        # Joined and stacked results take this rank's own objects only to keep their graph: none where no state has one
        wanted = keep_graph and not isinstance(local, Ref) and (sync_layout.graph or isinstance(result, list))
        own = local if wanted else None
        empty = sync_layout.empty[position]
        reduced.append(_own_storage(reduce_state(result, reduction, op, own, rank, plan, where, position, empty)))
    return reduced


def _own_storage(value: Any) -> Any:
    """``value`` in memory of its own where it views a larger receive buffer (per-rank and list results do).

    As stock's states: ``torch.save`` refuses tensors that view one storage as several dtypes, and a view would keep
    the whole buffer alive. A list's views are copied at once into one tensor of the list's own (it then views that).
    """
    if isinstance(value, Tensor):
        return value.clone() if value.untyped_storage().nbytes() > value.nbytes else value
    if not isinstance(value, list) or not any(
        isinstance(item, Tensor) and item.untyped_storage().nbytes() > item.nbytes for item in value
    ):
        return value
    kinds = {(item.dtype, item.device) for item in value if isinstance(item, Tensor)}
    if len(kinds) > 1 or not all(isinstance(item, Tensor) and not item.requires_grad for item in value):
        return [_own_storage(item) for item in value]
    flat = torch.cat([item.reshape(-1) for item in value])
    parts = torch.split(flat, [item.numel() for item in value])
    return [part.view(item.shape) for part, item in zip(parts, value)]


def _warn_mean_of_means(metrics: Sequence[StockMetric], sync_layout: Layout, plan: Plan) -> None:
    """Warn once per `mean` state whose ranks ran unequal numbers of updates (in the records: every rank alike)."""
    classes = sync_layout.classes
    for position in classes.means:
        counts = plan.aux[:, position]
        if bool((counts == counts[0]).all()):
            continue
        index, name = classes.keys[position]
        metric = metrics[index]
        warned = vars(metric).setdefault("_tv_mean_warned", set())  # once per metric and state
        if name in warned:
            continue
        warned.add(name)
        warnings.warn(
            f"State `{name}` of {type(metric).__name__} has dist_reduce_fx='mean': the synced value is the mean of"
            f" the ranks' values, each rank weighted equally, but the ranks ran different numbers of updates"
            f" ({counts.tolist()}), so it is not the value one process would compute on all the data. Keep a sum"
            " state and a count state (dist_reduce_fx='sum') and divide in compute().",
            UserWarning,
            stacklevel=4,
        )


# -------------------------------------------------------------------------------------------------- reduce
def reduce_state(
    result: Result,
    reduction: Any,
    op: int,
    own: LocalEntry | None,
    rank: int,
    plan: Plan,
    where: Callable[[int], str],
    index: int,
    empty: _Empty = None,
) -> Any:
    """Combine one state's per-rank values the way torchmetrics does after its gather.

    ``empty`` is the (dtype, device) of a `cat` state that no rank holds an item of: stock gathers the
    ``torch.tensor([], dtype=metric.dtype)`` each rank sends for its empty list, and gets that back concatenated.
    """
    if isinstance(result, Reduced):
        return _reduced_value(result, reduction, op, plan, index)
    if isinstance(result, Joined):
        return _joined_value(result, own, rank, plan, index, empty)
    if isinstance(result, Stacked):
        return stacked_value(result, reduction, own, rank)
    return _pieces_value(result, reduction, own, rank, where, index, empty)


def _reduced_value(result: Reduced, reduction: Any, op: int, plan: Plan, index: int) -> Tensor:
    """An all-reduced state in the dtype and with the signed zeros stock's reduction of the stacked ranks gives."""
    dtype = plan.entries[index].dtype
    assert dtype is not None  # a dense entry has one
    value = result.tensor
    if value.is_floating_point():
        value = value + 0.0  # torch.sum starts from +0.0: a sum of zeros that are all -0.0 is +0.0 with stock
    value = value / plan.world_size if op == OP_MEAN else value
    return value.to(reduction(torch.empty(2, 1, dtype=dtype, device="meta")).dtype)  # the dtype stock's reduction gives


def _joined_value(
    result: Joined, own: LocalEntry | None, rank: int, plan: Plan, index: int, empty: _Empty
) -> Tensor | list[Tensor]:
    """A `cat` state joined over the ranks; this rank's section is its own tensors where they carry a graph."""
    if result.tensor is None:
        return _empty_cat(empty)
    joined = result.tensor
    if not carries_graph(own):
        return joined
    numels = plan.entries[index].numels
    start, stop = int(numels[:rank].sum()), int(numels[: rank + 1].sum())
    mine = dim_zero_cat(own if isinstance(own, list) else [own]).reshape(-1, *joined.shape[1:])  # type: ignore[list-item]
    row = math.prod(joined.shape[1:])  # elements per row of the joined state
    return torch.cat([joined[: start // row], mine.to(joined.dtype), joined[stop // row :]])


def stacked_value(result: Stacked, reduction: Any, own: LocalEntry | None = None, rank: int = 0) -> Any:
    """A dense state's ``[world_size, *shape]`` stack, reduced (or concatenated) as stock reduces the gathered one."""
    stacked = result.tensor
    if isinstance(own, Tensor) and own.requires_grad:
        stacked = torch.cat([stacked[:rank], own.unsqueeze(0), stacked[rank + 1 :]])  # keep this rank's graph
    if reduction is dim_zero_cat:
        return stacked.reshape(-1, *stacked.shape[2:]) if stacked.ndim > 1 else stacked.clone()
    return reduction(stacked) if reduction is not None else stacked.clone()


def _pieces_value(
    result: list[Tensor | list[Tensor]],
    reduction: Any,
    own: LocalEntry | None,
    rank: int,
    where: Callable[[int], str],
    index: int,
    empty: _Empty,
) -> Any:
    """A state that came back as one piece per rank (a list's items, or tensors of uneven shapes), reduced."""
    per_rank: list[Entry] = list(result)
    if isinstance(per_rank[0], list):
        flat = [item for items in per_rank for item in items]  # type: ignore[union-attr]
        if not flat:
            return _empty_cat(empty) if reduction is dim_zero_cat else []
        if reduction is dim_zero_cat:
            if not all(isinstance(item, Tensor) for item in flat):
                return flat  # Python objects (see .objects): every rank's items, as one list, in rank order
            return _cat_items(flat, per_rank, where(index))
        return reduction(flat) if reduction is not None else flat
    if isinstance(own, Tensor) and (own.requires_grad or own.numel() > 0):
        per_rank[rank] = own  # this rank's own object keeps its graph
    tensors: list[Tensor] = [t for t in per_rank if isinstance(t, Tensor)]
    if reduction is dim_zero_cat:
        # Uneven `cat` tensor states: concatenate what each rank holds (stock stacks, which needs equal shapes).
        return dim_zero_cat([t for t in tensors if t.numel() > 0] or tensors[:1])
    if len({tuple(t.shape) for t in tensors}) > 1:
        listing = ", ".join(f"rank {r}: {tuple(t.shape)} {_dtype_text(t)}" for r, t in enumerate(tensors))
        raise SyncMismatchError(
            f"Expected state `{where(index)}` to have the same shape on every rank (its reduction stacks them) but got"
            f" {listing}. Use dist_reduce_fx='cat' or a list state for data whose size differs between ranks."
        )
    stacked = torch.stack(tensors)
    return reduction(stacked) if reduction is not None else stacked


def _empty_cat(empty: _Empty) -> Tensor | list[Tensor]:
    """Stock's value of a `cat` list state that is empty on every rank: ``tensor([])`` of the metric's dtype."""
    if empty is None:  # not a metric's state (no layout names one): nothing to take a dtype from
        return []
    return torch.empty(0, dtype=empty[0], device=empty[1])


def _cat_items(flat: list[Tensor], per_rank: list[Entry], state: str) -> Tensor:
    """``dim_zero_cat`` of every rank's items; items that cannot be joined raise `SyncMismatchError` on every rank.

    The plan refuses ranks whose items join to different trailing dims: left here are items that differ on one rank.
    """
    try:
        return dim_zero_cat(flat)
    except RuntimeError as error:
        listing = "\n".join(
            f"  rank {rank}: items of shapes {[tuple(t.shape) for t in items]}, dtype"  # type: ignore[union-attr]
            f" {_dtype_text(items[0]) if items else '-'}"
            for rank, items in enumerate(per_rank)
        )
        raise SyncMismatchError(
            f"Expected the items of `cat` state `{state}` to have the same shape after the first dimension on every"
            f" rank (they are concatenated along it) but got:\n{listing}\n({error})"
        ) from error


def _dtype_text(tensor: Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def carries_graph(own: LocalEntry | None) -> bool:
    if isinstance(own, Tensor):
        return own.requires_grad
    return isinstance(own, list) and any(isinstance(item, Tensor) and item.requires_grad for item in own)
