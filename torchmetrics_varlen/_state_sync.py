"""Coalesced sync of metric states: every state of every metric in one run of the engine.

Used by :class:`torchmetrics_varlen.Metric` (one metric), :class:`torchmetrics_varlen.MetricCollection` (all members
at once) and :func:`torchmetrics_varlen.compute_on_rank`. The reductions (each state's: ``_reductions``) give what
stock ``torchmetrics.Metric._sync_dist`` gives with the gathered states, with the same types (a ``cat`` list state
comes back as one concatenated tensor), except that uneven shapes and empty ranks work: a rank without data
contributes nothing. A ``cat`` list that is empty on every rank comes back as stock's ``tensor([])`` of the
metric's dtype; one whose items all have zero length keeps their dtype and trailing dims. Dense integer states with a
sum, max or min reduction and float states with a sum or mean reduction may travel by all-reduce (see
``_routes.reduce_dtype``): integers bit-identical, floats with NaN, infinities and signed zeros as stock, finite
floats summed in the backend's order. Ranks whose data cannot be combined raise `SyncMismatchError` on every rank,
naming the state.
"""

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_mean, dim_zero_min, dim_zero_sum

from torchmetrics_varlen import _caches, _cap, _engine, _objects, _plan, _policy, _protocol, _repeat
from torchmetrics_varlen._mismatch import ObjectsBesideTensorsError
from torchmetrics_varlen._plan import Plan
from torchmetrics_varlen._protocol import LocalEntry, ObjectList, Ref
from torchmetrics_varlen._reductions import carries_graph, reduce_state, stacked_value

StateDict = dict[str, Any]
_OPS: dict[Any, int] = {dim_zero_sum: _plan.OP_SUM, dim_zero_max: _plan.OP_MAX, dim_zero_min: _plan.OP_MIN}
_OPS[dim_zero_mean] = _plan.OP_MEAN


def _reduction_name(fn: Any) -> str:
    return "None" if fn is None else getattr(fn, "__qualname__", type(fn).__name__)


def layout_text(metrics: Sequence[StockMetric], phase: str) -> str:
    """What is being synced, as text equal on every rank that syncs the same thing (hashed into the record)."""
    return _text(phase, _signature(metrics))


_Signature = tuple[tuple[type, tuple[tuple[str, Any], ...]], ...]


def _signature(metrics: Sequence[StockMetric]) -> _Signature:
    """Each metric's class and synced states with their reductions: everything a layout's class part follows from."""
    return tuple((type(metric), tuple(metric._reductions.items())) for metric in metrics)


def _text(phase: str, signature: _Signature) -> str:
    parts = [phase]
    for cls, reductions in signature:
        states = ",".join(f"{name}:{_reduction_name(fn)}" for name, fn in reductions)
        parts.append(f"{cls.__qualname__}({states})")
    return "|".join(parts)


@dataclass
class Layout:
    """What a sync of some metrics sends, and how each entry is reduced afterwards."""

    keys: list[tuple[int, str]]  # (metric index, state name) per entry
    entries: list[LocalEntry]
    context: int
    reductions: list[Any]
    ops: list[int]
    cat: list[bool]
    aux: list[int]  # the owning metric's update count, for `mean` states (see `_warn_mean_of_means`)
    graph: bool  # a local tensor state carries an autograd graph
    classes: list[str]  # the class name of each metric: error messages name "<class>.<state>"
    # `cat` entries: the owning metric's (dtype, device), which an empty result takes when no rank knows a dtype
    # (stock sends ``torch.tensor([], dtype=self.dtype)`` for an empty `cat` list)
    empty: list[tuple[torch.dtype, torch.device] | None]
    device: torch.device  # the metrics' device (`metrics_device`): equal on every rank, never the states' own
    cap: int | None = None  # the smallest `sync_cap` of the metrics, None when none has one (see `_cap`)

    def state_name(self, position: int) -> str:
        """``"<metric class>.<state>"`` of the entry at ``position``: error messages."""
        index, name = self.keys[position]
        return f"{self.classes[index]}.{name}"


def metrics_device(metrics: Sequence[StockMetric]) -> torch.device:
    """The device a sync of ``metrics`` is decided for: the first one not on the CPU (``Metric.device``), else the CPU.

    Equal on every rank whatever the states hold (an empty list state has no device): it picks the backend of a group
    with several (see :mod:`torchmetrics_varlen._policy`).
    """
    return next((m.device for m in metrics if m.device.type != "cpu"), torch.device("cpu"))


@dataclass(frozen=True)
class _ClassLayout:
    """What a set of metric classes syncs: the part of a layout their states, reductions and the phase alone decide.

    Shared by every sync with the same signature (read only: no user of a layout mutates its lists).
    """

    keys: list[tuple[int, str]]
    reductions: list[Any]
    ops: list[int]
    cat: list[bool]
    context: int
    classes: list[str]
    means: list[int]  # positions of the `mean` states, whose aux word is the owning metric's update count


@functools.lru_cache(maxsize=256)
def _class_layout(phase: str, signature: _Signature) -> _ClassLayout:
    # Keyed by the classes and the reduction objects themselves (held by the key, so no id is ever reused), never by
    # a digest: a per-step sync asks at every step, and a wrong hit would send another layout.
    keys = [(index, name) for index, (_, reductions) in enumerate(signature) for name, _ in reductions]
    reductions = [fn for _, pairs in signature for _, fn in pairs]
    ops = [_OPS.get(fn, _plan.OP_NONE) for fn in reductions]
    return _ClassLayout(
        keys=keys,
        reductions=reductions,
        ops=ops,
        cat=[fn is dim_zero_cat for fn in reductions],
        context=_protocol.context_hash(_text(phase, signature)),
        classes=[cls.__name__ for cls, _ in signature],
        means=[position for position, op in enumerate(ops) if op == _plan.OP_MEAN],
    )


def _class_layout_of(metrics: Sequence[StockMetric], phase: str) -> _ClassLayout:
    signature = _signature(metrics)
    try:
        return _class_layout(phase, signature)
    except TypeError:  # a reduction that cannot be hashed: nothing to look up by
        return _class_layout.__wrapped__(phase, signature)


def sync_layout(metrics: Sequence[StockMetric], phase: str, values: Sequence[StateDict] | None = None) -> Layout:
    """The layout of a sync of ``metrics``; ``values`` replaces their current states (one dict per metric)."""
    class_layout = _class_layout_of(metrics, phase)
    return _layout(metrics, class_layout, _states_of(metrics, class_layout, values))


def _states_of(
    metrics: Sequence[StockMetric], class_layout: _ClassLayout, values: Sequence[StateDict] | None
) -> list[Any]:
    """The synced states in the layout's order: from ``values`` (one dict per metric) where given."""
    if values:
        return [values[index][name] for index, name in class_layout.keys]
    # The synced states, in registration order: plain attributes (tests/test_torchmetrics_internals.py)
    attrs = [vars(metric) for metric in metrics]
    try:
        return [attrs[index][name] for index, name in class_layout.keys]
    except KeyError:  # a subclass that keeps a state elsewhere (a property): as stock reads it
        return [getattr(metrics[index], name) for index, name in class_layout.keys]


def _layout(metrics: Sequence[StockMetric], class_layout: _ClassLayout, states: list[Any]) -> Layout:
    aux = [0] * len(states)
    for position in class_layout.means:
        aux[position] = metrics[class_layout.keys[position][0]]._update_count
    entries = entries_sharing_objects(states, class_layout.reductions)
    return Layout(
        keys=class_layout.keys,
        entries=entries,
        context=class_layout.context,
        reductions=class_layout.reductions,
        ops=class_layout.ops,
        cat=class_layout.cat,
        aux=aux,
        # From the entries: an object list's tensors travel detached, so it is not scanned item by item
        graph=any([carries_graph(entry) for entry in entries if not isinstance(entry, ObjectList)]),
        classes=class_layout.classes,
        empty=[
            (metrics[i].dtype, metrics[i].device) if joined else None
            for (i, _), joined in zip(class_layout.keys, class_layout.cat)
        ],
        device=metrics_device(metrics),
        cap=_metrics_cap(metrics),
    )


def _metrics_cap(metrics: Sequence[StockMetric]) -> int | None:
    # An instance attribute (set in __init__), read from the instance dict: getattr on a module without one raises
    # inside torch's __getattr__, at several microseconds per stock metric.
    return min((cap for metric in metrics if (cap := vars(metric).get("sync_cap")) is not None), default=None)


def sync_states(
    metrics: Sequence[StockMetric],
    group: Any,
    *,
    phase: str,
    label: str,
    timeout: float | None,
    values: Sequence[StateDict] | None = None,
    differentiable: bool = False,
    dst: int | None = None,
    cap: int | None = None,
) -> list[StateDict]:
    """Gather and reduce the states of ``metrics`` across ``group``.

    Returns one dict of reduced (global) states per metric. With ``dst``, only rank ``dst`` gets the states; the
    others get ``[]``. The local slot keeps this rank's own tensors, so their rank-local autograd graph survives; with
    ``differentiable`` the sync is one autograd node instead (per-step syncs always, epoch syncs when some rank's
    states carry a graph). ``cap`` (bytes) replaces the metrics' own ``sync_cap`` (a collection's).

    A repeated small sync takes the fast path (:mod:`torchmetrics_varlen._repeat`): the guard, then the learnt
    record and plan, else the long way (from the table it exchanged, if it got that far).
    """
    class_layout = _class_layout_of(metrics, phase)
    states = _states_of(metrics, class_layout, values)
    repeatable = not differentiable and dst is None and not class_layout.means
    exchanged = None
    if repeatable:
        settings = functools.partial(_repeat_settings, metrics, group, states, cap)
        template = _repeat.lookup(class_layout, label, group, settings, states)
        if template is not None:
            repeated = _repeat.sync(template, states, group, timeout, f"sync of {label}")
            if isinstance(repeated, list):
                return _repeated_states(len(metrics), class_layout, template.plan, repeated)
            exchanged = repeated  # the table was not the learnt one: the long way goes on from it
    layout = _layout(metrics, class_layout, states)
    flags = _protocol.FLAG_DIFF if differentiable else 0
    synced = run_layout(
        layout, group, label=label, timeout=timeout, flags=flags, dst=dst, phase=phase, cap=cap, exchanged=exchanged
    )
    assert synced is not None  # no `stop` given
    if repeatable and synced.exchanged is not None and synced.policy is not None:
        learnt = (synced.policy, _sent_cap(metrics, cap))  # the policy the engine ran under: not asked again
        _repeat.learn(class_layout, label, group, learnt, states, synced.exchanged, synced.plan)
    _warn_mean_of_means(metrics, layout, synced.plan)
    if dst is not None and synced.rank != dst:
        return []
    loaded = dst is None and _load_objects_on_every_rank(layout, synced, group, label, timeout)
    reduced = reduce_results(layout, synced, layout.state_name, loaded=loaded)
    out: list[StateDict] = [{} for _ in metrics]
    for (index, name), value in zip(layout.keys, reduced):
        out[index][name] = value
    return out


def _repeat_settings(
    metrics: Sequence[StockMetric], group: Any, states: list[Any], cap: int | None
) -> _repeat.Settings:
    """The policy and transfer cap the engine would take for this sync: part of the fast path's guard."""
    local = states[0].device if states and isinstance(states[0], Tensor) else None
    return _policy.policy_for(group, metrics_device(metrics), local), _sent_cap(metrics, cap)


def _sent_cap(metrics: Sequence[StockMetric], cap: int | None) -> int:
    """The transfer cap this rank's record carries, resolved as the engine resolves it.

    A collection's, else the smallest of the metrics', else the environment's or the default.
    """
    sent = cap if cap is not None else _metrics_cap(metrics)
    return sent if sent is not None else _cap.resolve_cap()


def _repeated_states(count: int, class_layout: _ClassLayout, plan: Plan, results: list[Any]) -> list[StateDict]:
    """The states of a repeated sync: each dense result reduced as stock reduces the gathered states."""
    out: list[StateDict] = [{} for _ in range(count)]
    for (index, name), reduction, result in zip(class_layout.keys, class_layout.reductions, results):
        out[index][name] = stacked_value(result, reduction)
    return out


def run_layout(
    layout: Layout,
    group: Any,
    *,
    label: str,
    timeout: float | None,
    flags: int = 0,
    dst: int | None = None,
    phase: str = "compute",
    stop: Any = None,
    device: torch.device | None = None,
    cap: int | None = None,
    exchanged: "_engine.Exchanged | None" = None,
) -> "_engine.Synced | None":
    """Run the engine on a layout: its entries, reductions and flags (a graph-carrying state sets ``FLAG_GRAD``).

    ``device`` replaces the layout's (the metrics' device) as the device the sync is decided for and empty entries'
    results go to: the Join shadow, which must never touch CUDA, passes the CPU. ``cap`` replaces the layout's
    transfer cap (a collection's own ``sync_cap``). ``exchanged``: the records were exchanged already (see
    :class:`torchmetrics_varlen._engine.Request`).
    """
    try:
        return _engine.run(_request(layout, group, label, timeout, flags, dst, phase, stop, device, cap, exchanged))
    except ObjectsBesideTensorsError as mixed:  # raised alike on every rank, before any data moved: all sync again
        for position in mixed.positions:
            entry = layout.entries[position]
            if isinstance(entry, list) and not isinstance(entry, ObjectList):
                layout.entries[position] = _objects.encode(entry, always=True)
        return _engine.run(_request(layout, group, label, timeout, flags, dst, phase, stop, device, cap))


def _request(
    layout: Layout,
    group: Any,
    label: str,
    timeout: float | None,
    flags: int,
    dst: int | None,
    phase: str,
    stop: Any,
    device: torch.device | None,
    cap: int | None,
    exchanged: "_engine.Exchanged | None" = None,
) -> "_engine.Request":
    return _engine.Request(
        layout.entries,
        group,
        layout.context,
        label,
        timeout,
        flags=flags | (_protocol.FLAG_GRAD if layout.graph else 0),
        aux=layout.aux,
        ops=layout.ops,
        cat=layout.cat,
        stop=stop,
        dst=dst,
        grad="always" if phase == "step" else "if_graph",
        names=layout.state_name,
        device=device or layout.device,
        cap=cap if cap is not None else layout.cap,
        exchanged=exchanged,
    )


def _load_objects_on_every_rank(
    layout: Layout, synced: "_engine.Synced", group: Any, label: str, timeout: float | None
) -> bool:
    """Load the objects of list states that hold some, then agree that every rank could (one tiny all-gather).

    Whether a sync moved objects is in the exchanged records, so every rank takes the same branch. Returns whether
    there were any (then loaded in ``synced.results``).
    """
    positions = _objects.object_positions(synced.plan.entries)
    if not positions:
        return False
    failure = _objects.decode_results(synced.results, synced.plan.entries, positions, layout.device)
    policy = _policy.policy_for(group, layout.device, _engine.first_device(layout.entries))
    _objects.agree(failure, layout.state_name, group, policy.device, policy.wait, timeout, f"sync of {label}")
    return True


def reduce_results(
    layout: Layout, synced: "_engine.Synced", where: Callable[[int], str], loaded: bool = False
) -> list[Any]:
    """Reduce every entry's result with its reduction, as stock does with the gathered states.

    ``where`` names the state at a position, for error messages. List states' objects are loaded first, unless
    ``loaded`` says they are (with an agreement of every rank: ``_load_objects_on_every_rank``); here a failure
    raises on this rank (one-rank compute sends it to every rank).
    ``synced.results`` is emptied as it goes (memory). Outside a differentiable sync, the local slot gets this rank's
    own objects back where they carry an autograd graph, as stock does.
    """
    plan, rank, results = synced.plan, synced.rank, synced.results
    positions = [] if loaded else _objects.object_positions(plan.entries)
    failure = _objects.decode_results(results, plan.entries, positions, layout.device) if positions else None
    if failure is not None:
        what = "sync of " + ", ".join(layout.classes)
        raise _objects.load_error(rank, failure.position, failure.source, failure.type_name, where, what, failure)
    keep_graph = not plan.differentiable
    reduced: list[Any] = []
    for position, (reduction, op, local) in enumerate(zip(layout.reductions, layout.ops, layout.entries)):
        result, results[position] = results[position], None
        if result is None:  # the same object as an earlier entry on every rank (a compute group): reduced once
            assert isinstance(local, Ref)
            reduced.append(reduced[local.index])
            continue
        # Joined and stacked results take this rank's own objects only to keep their graph: none where no state has one
        wanted = keep_graph and not isinstance(local, Ref) and (layout.graph or isinstance(result, list))
        own = local if wanted else None
        reduced.append(reduce_state(result, reduction, op, own, rank, plan, where, position, layout.empty[position]))
    return reduced


def entries_sharing_objects(values: list[Any], reductions: list[Any] | None = None) -> list[LocalEntry]:
    """One entry per state; a state that is the very object of an earlier one (a compute group) becomes a Ref.

    Only where the reduction is the same too (``reductions``): a Ref's value is the earlier entry's reduced value,
    and stock reduces every state with its own reduction, also two states holding one tensor.
    """
    if len({id(value) for value in values}) == len(values):  # the usual case: no state is another's object
        return [value if isinstance(value, Tensor) else _objects.encode(list(value)) for value in values]
    seen: dict[tuple[int, int], int] = {}
    entries: list[LocalEntry] = []
    for position, value in enumerate(values):
        reduction = reductions[position] if reductions is not None else None
        first = seen.setdefault((id(value), id(reduction)), position)
        local = value if isinstance(value, Tensor) else _objects.encode(list(value))
        entries.append(Ref(first) if first != position else local)
    return entries


_MEAN_WARNED: "weakref.WeakKeyDictionary[StockMetric, set[str]]" = weakref.WeakKeyDictionary()
_caches.register("_state_sync._MEAN_WARNED: the mean-of-means warning, once per metric and state", _MEAN_WARNED.clear)


def _warn_mean_of_means(metrics: Sequence[StockMetric], layout: Layout, plan: Plan) -> None:
    """Warn once per metric and state when a `mean` state averages ranks that saw different numbers of updates.

    Decided from the update counts every record carries (no extra collective), so every rank warns alike.
    """
    for position, ((index, name), op) in enumerate(zip(layout.keys, layout.ops)):
        if op != _plan.OP_MEAN:
            continue
        counts = plan.aux[:, position]
        if bool((counts == counts[0]).all()):
            continue
        metric = metrics[index]
        warned = _MEAN_WARNED.setdefault(metric, set())
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


_caches.register(
    "_state_sync._class_layout: what a set of metric classes syncs, the same at every sync", _class_layout.cache_clear
)
