"""Metric state that survives a checkpoint and a change of world size, exactly.

A metric's state is spread over the ranks: each rank holds the part of the sums, rows and counts that its own updates
made. A checkpoint written by one rank (Lightning, Accelerate) holds that rank's part only; one written by every rank
through ``torch.distributed.checkpoint`` keeps one rank's copy of each state. This module writes the *global* state
instead, as one process that saw every rank's updates would hold it, and loads it on any number of ranks: the first
rank of the metric's group takes it and the others start from their defaults, so the next ``compute()`` equals one
process on all the data.

* :func:`merged_state_dict` / :func:`load_merged_state_dict`: the global state as one dict, the same on every rank
  (one sync of the engine), writable by any one rank with ``torch.save``. :class:`MergedState` wraps the pair for
  frameworks that call ``state_dict()`` / ``load_state_dict()`` on every rank (Accelerate's
  ``register_for_checkpointing``); ``torchmetrics_varlen.lightning.MetricCheckpoint`` does it for Lightning.
* :class:`ShardedState` with :func:`sharded_load_planner`: ``torch.distributed.checkpoint`` (DCP), each rank writing
  its own share as chunks of global tensors (no gather), read back on another world size by the first rank.

What a state becomes (its *kind*) follows from its ``dist_reduce_fx``: sums, maxima and minima are reduced over the
ranks, ``cat`` states concatenated in rank order, list states with ``dist_reduce_fx=None`` (retrieval metrics) and
lists of Python objects concatenated item by item, update counts summed, a ``ScalarLog``'s accumulators combined per
key. A ``mean`` state, a custom reduction function and a tensor state with ``dist_reduce_fx=None`` (kept per rank)
cannot be split again over another number of ranks: :class:`MergedStateError` names them, on every rank, before
anything is written or loaded. Child metrics (wrappers such as ``ClasswiseWrapper``) are part of their parent's state;
children that never sync (``IndexedMetric``'s template) are not.
"""

import copy
import io
import json
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics import MetricCollection as StockMetricCollection
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_mean, dim_zero_min, dim_zero_sum

from torchmetrics_varlen._sync import scalar_codec as _rec
from torchmetrics_varlen._sync.engine import agree
from torchmetrics_varlen._sync.group import Link, link, resolve_timeout
from torchmetrics_varlen._sync.states import metrics_device, sync_states
from torchmetrics_varlen.scalars import ScalarLog

__all__ = [
    "MergedState",
    "MergedStateError",
    "ShardedState",
    "load_merged_state_dict",
    "merged_state_dict",
    "sharded_load_planner",
]

MERGED_FORMAT = "torchmetrics_varlen.merged_state_dict"
SHARDED_FORMAT = "torchmetrics_varlen.sharded_state"
VERSION = 1
_REDUCED = MappingProxyType({"tensor/sum": dim_zero_sum, "tensor/max": dim_zero_max, "tensor/min": dim_zero_min})
_SCALARS = "scalars"  # a ScalarLog's accumulators, as a state of its own
_SCALAR_KIND = "scalar_log"
_PHASE = "checkpoint"


class MergedStateError(ValueError):
    """A metric state that cannot be merged, or a saved state that does not fit the metric it is loaded into.

    Raised on every rank alike, before anything is written or loaded: a state whose reduction cannot be split again
    over another number of ranks (``dist_reduce_fx="mean"``, a custom function, a tensor state kept per rank), a saved
    state of another class, with other states or members, of another format, or a checkpoint with a shard missing.

    Example:
        >>> from torchmetrics_varlen import MergedStateError
        >>> issubclass(MergedStateError, ValueError)
        True
    """


# ------------------------------------------------------------------------------------------------ what is saved
@dataclass
class _Leaf:
    """One metric whose states are saved: its kinds (state name to kind) in registration order."""

    metric: StockMetric
    kinds: dict[str, str]
    scalars: bool  # a ScalarLog: its accumulators are saved as the state `_SCALARS`
    where: str  # its place, for messages: "MetricCollection['acc']"


def _class_name(metric: Any) -> str:
    """The class a saved state belongs to: a rebased class counts as its stock base (their states are the same)."""
    cls = type(metric)
    base = cls.__dict__.get("_rebased_from", cls)
    return f"{base.__module__}.{base.__qualname__}"


def _reduction_text(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _kind(metric: StockMetric, name: str, where: str) -> str:
    """A state's kind (``"tensor/sum"``, ``"list/cat"``, ...), or `MergedStateError` for one that cannot be merged."""
    fn: Any = metric._reductions[name]
    default = metric._defaults[name]
    container = "list" if isinstance(default, list) else "tensor"
    reductions: dict[Any, str] = {dim_zero_sum: "sum", dim_zero_max: "max", dim_zero_min: "min", dim_zero_cat: "cat"}
    reduction = "none" if fn is None else reductions.get(fn)
    why = None
    if fn is dim_zero_mean:
        why = (
            "dist_reduce_fx='mean': a mean of per-rank values cannot be split again over another number of ranks (nor"
            " is it the mean one process would compute when the ranks saw different amounts of data). Keep a sum state"
            " and a count state (dist_reduce_fx='sum') and divide in compute()"
        )
    elif reduction is None:
        why = (
            f"a custom dist_reduce_fx ({_reduction_text(fn)}): what it does with the ranks' values is not known, so the"
            " global state cannot be built nor split again. Use 'sum', 'max', 'min' or 'cat'"
        )
    elif container == "tensor" and reduction == "none":
        why = (
            "dist_reduce_fx=None on a tensor state: a sync stacks one value per rank, which cannot be split again over"
            " another number of ranks. Use 'sum', 'max', 'min' or 'cat', or a list state"
        )
    elif container == "list" and reduction not in ("cat", "none"):
        why = f"dist_reduce_fx='{reduction}' on a list state: only 'cat' and None are defined for lists"
    if why is not None:
        raise MergedStateError(f"Expected every state of {where} to be mergeable but state `{name}` has {why}.")
    return f"{container}/{reduction}"


def _child_metrics(metric: StockMetric) -> list[tuple[str, Any]]:
    """The metrics a metric holds (wrappers), by module name, stopping at each one; those that never sync left out."""
    found: list[tuple[str, Any]] = []

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if isinstance(child, (StockMetric, StockMetricCollection)):
                if isinstance(child, StockMetricCollection) or child._to_sync or child.dist_sync_on_step:
                    found.append((prefix + name, child))
            else:
                visit(child, f"{prefix}{name}.")

    visit(metric, "")
    return found


def _walk(obj: Any, where: str) -> tuple[dict[str, Any], list[_Leaf]]:
    """What ``obj`` saves: its description (class, state kinds, members, children) and its metrics in a fixed order.

    Read from the objects' configuration only (the same on every rank). Raises `MergedStateError` for a state that
    cannot be merged, `TypeError` for an object that is no metric.
    """
    if isinstance(obj, (StockMetricCollection, Mapping)):
        items = obj.items(keep_base=True, copy_state=False) if isinstance(obj, StockMetricCollection) else obj.items()
        members: dict[str, Any] = {}
        leaves: list[_Leaf] = []
        for name, member in items:
            members[str(name)], found = _walk(member, f"{where}[{str(name)!r}]")
            leaves += found
        return {
            "class": "MetricCollection" if isinstance(obj, StockMetricCollection) else "metrics",
            "members": members,
        }, leaves
    if not isinstance(obj, StockMetric):
        raise TypeError(f"Expected a torchmetrics Metric or MetricCollection at {where} but got {type(obj).__name__}")
    kinds = {name: _kind(obj, name, where) for name in obj._defaults}
    scalars = isinstance(obj, ScalarLog)
    if scalars:
        kinds[_SCALARS] = _SCALAR_KIND
    description: dict[str, Any] = {"class": _class_name(obj), "states": kinds}
    leaves = [_Leaf(obj, kinds, scalars, where)]
    children = _child_metrics(obj)
    if children:
        description["children"] = {}
        for name, child in children:
            description["children"][name], found = _walk(child, f"{where}.{name}")
            leaves += found
    return description, leaves


def _name(obj: Any) -> str:
    """How messages name what is saved: its class, or the names of a mapping's metrics."""
    if isinstance(obj, Mapping):
        return f"metrics {[str(key) for key in obj]}"
    return "MetricCollection" if isinstance(obj, StockMetricCollection) else type(obj).__name__


def _group_and_timeout(leaves: Sequence[_Leaf], where: str) -> tuple[Any, float | None]:
    """The one process group the metrics sync over, and their sync timeout (the smallest of theirs)."""
    groups = {id(leaf.metric.process_group): leaf.metric.process_group for leaf in leaves}
    if len(groups) > 1:
        raise MergedStateError(
            f"Expected the metrics of {where} to sync over one process group but they name {len(groups)}: save them"
            " separately, one call per process group."
        )
    timeouts = [t for leaf in leaves if (t := vars(leaf.metric).get("sync_timeout")) is not None]
    return next(iter(groups.values()), None), min(timeouts) if timeouts else resolve_timeout(None)


def _refuse_synced(leaves: Sequence[_Leaf]) -> None:
    """A synced metric holds the global states on every rank already: merging them again would count them W times."""
    synced = [leaf.where for leaf in leaves if leaf.metric._is_synced]
    if synced:
        raise MergedStateError(
            f"Expected {synced[0]} to hold its own states but it is synced (inside `sync()` or `sync_context()`), so"
            " every rank holds the global states and saving would count them once per rank. Save it after `unsync()`."
        )


def _link(leaves: Sequence[_Leaf], where: str) -> Link | None:
    group, timeout = _group_and_timeout(leaves, where)
    return link(group, metrics_device([leaf.metric for leaf in leaves]), timeout, f"checkpoint of {where}")


# ------------------------------------------------------------------------------------------ ScalarLog's accumulators
# The one place that reads and writes a ScalarLog's accumulators (they live outside torchmetrics' states).
def _read_scalars(log: ScalarLog) -> tuple[list[str], Tensor, Tensor, Tensor]:
    """A ScalarLog's accumulators as (keys, codes, first words, weights), CPU tensors that share nothing with it."""
    acc = log._read(log._acc.read())  # the host's part and every device's, folded
    return (
        list(acc.index),
        torch.tensor(np.asarray(acc.codes, dtype=np.int64)),
        torch.tensor(np.asarray(acc.first, dtype=np.float64)),
        torch.tensor(np.asarray(acc.weight, dtype=np.float64)),
    )


def _write_scalars(log: ScalarLog, scalars: Mapping[str, Any]) -> None:
    """Give a (reset) ScalarLog the accumulators of a merged state."""
    acc = _rec.Accumulator()
    acc.index = {key: position for position, key in enumerate(scalars["keys"])}
    acc.codes = scalars["codes"].cpu().numpy().astype(np.int64)
    acc.first = scalars["first"].cpu().numpy().astype(np.float64)
    acc.weight = scalars["weight"].cpu().numpy().astype(np.float64)
    log._acc = acc


def _scalar_codes(log: ScalarLog, keys: Sequence[str]) -> list[int]:
    """The reduction code the log gives each key (its ``reduce=``)."""
    return log._codes(list(keys))


def _merge_scalars(keys: Sequence[str], codes: Tensor, first: Tensor, weight: Tensor, where: str) -> dict[str, Any]:
    """Accumulators of several ranks (concatenated in rank order) combined per key, as one process would hold them."""
    merged: dict[str, list[Any]] = {}
    for key, code, value, w in zip(keys, codes.tolist(), first.tolist(), weight.tolist()):
        if key not in merged:
            merged[key] = [code, value, w]
            continue
        held = merged[key]
        if held[0] != code:
            raise MergedStateError(
                f"Expected every rank to reduce key {key!r} of {where} the same way but got"
                f" {_rec.REDUCTIONS[held[0] - 1]!r} and {_rec.REDUCTIONS[code - 1]!r}. Pass the same `reduce=`."
            )
        if code in (_rec.MEAN, _rec.SUM):
            held[1] += value
            held[2] += w
        else:  # NaN propagates, as torch.max and torch.min do
            held[1] = float((np.maximum if code == _rec.MAX else np.minimum)(held[1], value))
    names = list(merged)
    return {
        "keys": names,
        "codes": torch.tensor([merged[key][0] for key in names], dtype=torch.int64),
        "first": torch.tensor([merged[key][1] for key in names], dtype=torch.float64),
        "weight": torch.tensor([merged[key][2] for key in names], dtype=torch.float64),
    }


def _scalar_state(keys: Any, codes: Any, first: Any, weight: Any, where: str) -> dict[str, Any]:
    """A ScalarLog's merged accumulators from a sync's results (an all-empty `cat` state comes back as a tensor)."""
    keys = [] if isinstance(keys, Tensor) else list(keys)
    as64 = [torch.as_tensor(t).reshape(-1) for t in (codes, first, weight)]
    return _merge_scalars(keys, as64[0].long(), as64[1].double(), as64[2].double(), where)


# ----------------------------------------------------------------------------------------------- carriers
class _Carrier(StockMetric):
    """States made for one checkpoint sync (update counts, a ScalarLog's accumulators): synced, never updated."""

    full_state_update = False

    def __init__(self, states: Mapping[str, tuple[Any, str]]) -> None:
        super().__init__()
        for name, (value, reduction) in states.items():
            self.add_state(name, default=[] if isinstance(value, list) else torch.zeros(0), dist_reduce_fx=reduction)
            vars(self)[name] = value  # a plain attribute, as torchmetrics keeps states

    def update(self) -> None:
        """Never called."""

    def compute(self) -> None:
        """Never called."""


def _scalar_carrier(log: ScalarLog) -> _Carrier:
    keys, codes, first, weight = _read_scalars(log)
    lists = {"keys": keys, "codes": [codes], "first": [first], "weight": [weight]}
    return _Carrier({name: (value if keys else [], "cat") for name, value in lists.items()})


def _local_value(value: Any, kind: str, metric: StockMetric) -> Any:
    """A state of one rank as its merged value: what a sync over a group of one would give (copies)."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    items = list(value)
    if kind == "list/cat" and all(isinstance(item, Tensor) for item in items):
        if not items:
            return torch.empty(0, dtype=metric.dtype, device=metric.device)
        return dim_zero_cat([item.detach() for item in items])
    return [item.detach().clone() if isinstance(item, Tensor) else copy.deepcopy(item) for item in items]


def _unshared(value: Any, local: set[int]) -> Any:
    """``value`` detached, in memory of its own: not a local state's, nor a view into a sync's receive buffer.

    A sync's results may be views of one ``uint8`` buffer in several dtypes, which ``torch.save`` refuses (and which
    would keep the whole buffer alive).
    """
    if isinstance(value, Tensor):
        value = value.detach()
        storage = value.untyped_storage()
        whole = value.storage_offset() == 0 and storage.nbytes() == value.numel() * value.element_size()
        return value if whole and storage.data_ptr() not in local else value.clone()
    if isinstance(value, list):
        return [_unshared(item, local) for item in value]
    return copy.deepcopy(value)  # a Python object of a list state: never the metric's own


def _storages(leaves: Sequence[_Leaf]) -> set[int]:
    found = set()
    for leaf in leaves:
        for name in leaf.metric._defaults:
            value = getattr(leaf.metric, name)
            for tensor in value if isinstance(value, list) else [value]:
                if isinstance(tensor, Tensor) and tensor.numel():
                    found.add(tensor.untyped_storage().data_ptr())
    return found


def _global_states(leaves: Sequence[_Leaf], sync_link: Link | None) -> list[dict[str, Any]]:
    """Each leaf's global states (plus ``update_count``): one sync of the engine for all of them."""
    if sync_link is None:  # a group of one: this rank's states are the global ones
        out = []
        for leaf in leaves:
            states = {
                name: _local_value(getattr(leaf.metric, name), kind, leaf.metric)
                for name, kind in leaf.kinds.items()
                if kind != _SCALAR_KIND
            }
            if leaf.scalars:
                states[_SCALARS] = _scalar_state(*_read_scalars(leaf.metric), leaf.where)  # type: ignore[arg-type]
            out.append({"states": states, "update_count": int(leaf.metric._update_count)})
        return out
    scalar_carriers = {i: _scalar_carrier(leaf.metric) for i, leaf in enumerate(leaves) if leaf.scalars}  # type: ignore[arg-type]
    counts = torch.tensor([int(leaf.metric._update_count) for leaf in leaves], dtype=torch.int64)
    carriers = [leaf.metric for leaf in leaves] + list(scalar_carriers.values())
    carriers.append(_Carrier({"counts": (counts, "sum")}))
    synced = sync_states(carriers, sync_link, phase=_PHASE, label="merged_state_dict")
    assert synced is not None  # only a sync of cached results ends early
    local = _storages(leaves)
    totals = synced[-1]["counts"].tolist()
    scalar_results = dict(zip(scalar_carriers, synced[len(leaves) : -1]))
    out = []
    for i, leaf in enumerate(leaves):
        states = {name: _unshared(value, local) for name, value in synced[i].items()}
        if leaf.scalars:
            got = scalar_results[i]
            states[_SCALARS] = _scalar_state(got["keys"], got["codes"], got["first"], got["weight"], leaf.where)
        out.append({"states": states, "update_count": int(totals[i])})
    return out


def _nest(obj: Any, bodies: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """The leaves' bodies laid out as the object is: members of collections, children of wrappers (as `_walk`)."""
    if isinstance(obj, (StockMetricCollection, Mapping)):
        items = obj.items(keep_base=True, copy_state=False) if isinstance(obj, StockMetricCollection) else obj.items()
        return {"members": {str(name): _nest(member, bodies) for name, member in items}}
    body = next(bodies)
    children = _child_metrics(obj)
    if children:
        body["children"] = {name: _nest(child, bodies) for name, child in children}
    return body


# ------------------------------------------------------------------------------------------------- merged API
def merged_state_dict(metric_or_collection: Any) -> dict[str, Any]:
    """The global state of a metric or collection, the same dict on every rank: what one process would hold.

    A collective on the metrics' process group: call it on every rank of the group (one sync of the engine, as a
    ``compute()`` costs). Sums, maxima and minima come reduced over the ranks, ``cat`` states concatenated in rank
    order, list states (retrieval metrics, ``IndexedMetric``'s inputs and indices, Python objects) as every rank's
    items in rank order, update counts summed, a ``ScalarLog``'s accumulators combined per key. A small header says
    the format and its version, the class, each state's name and kind, and the world size it came from. The metric
    is not changed, and the dict shares no memory with it; write it with ``torch.save`` on any one rank and load it
    with :func:`load_merged_state_dict` on any number of ranks.

    Float sums are regrouped (each rank's sum, then their sum): they equal one process up to reassociation, exactly
    for integer states and for float values whose sums are exact.

    Args:
        metric_or_collection: a torchmetrics metric (stock, rebased or this package's), a ``MetricCollection``, or a
            mapping from names to either.

    Returns:
        ``{"header": ..., "states": ..., "update_count": n}`` for a metric, with ``"children"`` for a wrapper's
        metrics; ``{"header": ..., "members": ...}`` for a collection or a mapping, one such dict per member. Tensors
        stay on the metrics' device.

    Raises:
        MergedStateError: a state cannot be merged (``dist_reduce_fx="mean"``, a custom function, a tensor state
            with ``dist_reduce_fx=None``), or the metrics sync over different process groups; on every rank, before
            anything moves.
        TypeError: ``metric_or_collection`` is no metric.

    Example:
        >>> import torch
        >>> from torchmetrics.aggregation import SumMetric
        >>> from torchmetrics_varlen import merged_state_dict
        >>> metric = SumMetric()
        >>> metric.update(torch.tensor([1.0, 2.0]))
        >>> state = merged_state_dict(metric)  # on every rank; torch.save(state, path) on one
        >>> state["header"]["class"], state["header"]["states"], state["header"]["world_size"]
        ('torchmetrics.aggregation.SumMetric', {'sum_value': 'tensor/sum'}, 1)
        >>> state["states"], state["update_count"]
        ({'sum_value': tensor(3.)}, 1)
    """
    where = _name(metric_or_collection)
    description, leaves = _walk(metric_or_collection, where)
    _refuse_synced(leaves)
    sync_link = _link(leaves, where)
    bodies = _global_states(leaves, sync_link)
    header = {"format": MERGED_FORMAT, "version": VERSION, **description}
    header["world_size"] = sync_link.size if sync_link is not None else 1
    return {"header": header, **_nest(metric_or_collection, iter(bodies))}


def load_merged_state_dict(metric_or_collection: Any, state: Mapping[str, Any]) -> None:
    """Load a state written by :func:`merged_state_dict` on any world size: the first rank takes it all.

    Call it on every rank of the metrics' process group, each with the state (every rank reads the file): the first
    rank of the group gets the global state, the others are reset to their defaults, so that after further updates on
    the new ranks the next ``compute()`` equals one process on all the data. The state is checked on every rank first
    (format and version, class, state names and kinds, members, shapes of reduced states, a ``ScalarLog``'s
    reductions), and the ranks agree (one tiny exchange): a state that does not fit raises on every rank and nothing is
    loaded. Reduced states take the dtype and device of the metric's own; ``cat`` data keep their dtype.

    Args:
        metric_or_collection: what was saved, or an object of the same classes and states (a fresh one on another
            world size).
        state: the dict :func:`merged_state_dict` returned (``torch.load`` of its file).

    Raises:
        MergedStateError: the state does not fit (another class, other states or members, another format, a stock
            ``state_dict()``), or the metric has states that cannot be merged; on every rank, nothing loaded.

    Example:
        >>> import torch
        >>> from torchmetrics.aggregation import CatMetric
        >>> from torchmetrics_varlen import load_merged_state_dict, merged_state_dict
        >>> saved = CatMetric()
        >>> saved.update(torch.tensor([1.0, 2.0]))
        >>> state = merged_state_dict(saved)
        >>> resumed = CatMetric()  # on any number of ranks
        >>> load_merged_state_dict(resumed, state)
        >>> resumed.update(torch.tensor([3.0]))
        >>> resumed.compute()
        tensor([1., 2., 3.])
    """
    where = _name(metric_or_collection)
    description, leaves = _walk(metric_or_collection, where)
    sync_link = _link(leaves, where)
    problem = _check_merged(state, description, MERGED_FORMAT, where)
    if problem is None:
        problem = _check_bodies(metric_or_collection, state, where)
    _agree_or_raise(problem, sync_link, "a merged state checked", where)
    first = sync_link is None or sync_link.rank == 0
    _apply(metric_or_collection, state if first else None)


def _agree_or_raise(problem: str | None, sync_link: Link | None, what: str, where: str) -> None:
    """Every rank raises `MergedStateError` when any rank found a problem (one tiny exchange), naming the ranks."""
    if sync_link is None:
        if problem is not None:
            raise MergedStateError(problem)
        return
    table = agree([0 if problem is None else 1], sync_link, what)
    failing = [rank for rank, row in enumerate(table) if row[0]]
    if not failing:
        return
    if problem is not None:
        raise MergedStateError(
            problem if len(table) == 1 else f"{problem} (found on ranks {failing}; nothing was loaded on any rank)"
        )
    raise MergedStateError(
        f"Expected the state given to every rank to fit {where} but ranks {failing} found it does not (their error"
        " names what): nothing was loaded on any rank."
    )


def _first_difference(saved: Any, current: Any, path: str) -> str | None:
    """Where two descriptions differ first, as text; None when equal."""
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        if list(saved) != list(current):
            return f"{path}: saved {list(saved)}, expected {list(current)}"
        for key in current:
            found = _first_difference(saved[key], current[key], f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    return None if saved == current else f"{path}: saved {saved!r}, expected {current!r}"


def _check_merged(state: Any, description: Mapping[str, Any], fmt: str, where: str) -> str | None:
    """What is wrong with a saved state's header for this object, as the error message; None when it fits."""
    header = state.get("header") if isinstance(state, Mapping) else None
    if not isinstance(header, Mapping) or header.get("format") not in (MERGED_FORMAT, SHARDED_FORMAT):
        keys = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        return (
            f"Expected a merged state of {where} (written by torchmetrics_varlen.merged_state_dict) but got {keys}"
            " without its header: a stock `state_dict()` holds one rank's states only (or none: states are not"
            " persistent by default) and cannot be loaded exactly on another world size. Save with"
            " `merged_state_dict` (or `MergedState`, `ShardedState`, Lightning's `MetricCheckpoint`)."
        )
    if header.get("format") != fmt:
        return f"Expected a state of format {fmt!r} for {where} but got one of format {header.get('format')!r}."
    version = header.get("version")
    if not isinstance(version, int) or version > VERSION:
        return (
            f"Expected a saved state of format version {VERSION} or older for {where} but got version {version!r}:"
            " it was written by a newer torchmetrics-varlen; upgrade to load it."
        )
    saved = {key: header[key] for key in ("class", "states", "members", "children") if key in header}
    difference = _first_difference(saved, description, "")
    if difference is not None:
        return (
            f"Expected a saved state of {where} but the saved one differs at {difference}."
            " Load it into an object of the same classes, states and members."
        )
    return None


def _check_bodies(obj: Any, state: Mapping[str, Any], where: str) -> str | None:
    """Check the saved values against the object (types, shapes of reduced states, a ScalarLog's reductions)."""
    try:
        _check_body(obj, state, where)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:  # a hand-edited or truncated state
        missing = f"it has no {err}" if isinstance(err, KeyError) else str(err)
        return f"Expected the saved state of {where} to hold what its header lists but {missing}."
    return None


def _check_body(obj: Any, body: Mapping[str, Any], where: str) -> None:
    if isinstance(obj, (StockMetricCollection, Mapping)):
        items = obj.items(keep_base=True, copy_state=False) if isinstance(obj, StockMetricCollection) else obj.items()
        for name, member in items:
            _check_body(member, body["members"][str(name)], f"{where}[{str(name)!r}]")
        return
    states, count = body["states"], body["update_count"]
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"{where} has update count {count!r}")
    for name in obj._defaults:
        value, default = states[name], obj._defaults[name]
        if isinstance(default, Tensor) and not isinstance(value, Tensor):
            raise ValueError(f"state `{name}` of {where} is a {type(value).__name__}, not a tensor")
        if isinstance(default, Tensor) and obj._reductions[name] is not dim_zero_cat and value.shape != default.shape:
            shape = tuple(value.shape)
            raise ValueError(f"state `{name}` of {where} is saved with shape {shape}, not {tuple(default.shape)}")
        if not isinstance(value, (Tensor, list)):
            raise ValueError(f"state `{name}` of {where} is a {type(value).__name__}, not a tensor or a list")
    if isinstance(obj, ScalarLog):
        scalars = states[_SCALARS]
        keys, codes = list(scalars["keys"]), scalars["codes"].tolist()
        lengths = {len(keys), len(codes), scalars["first"].numel(), scalars["weight"].numel()}
        if len(lengths) != 1:
            raise ValueError(f"the accumulators of {where} have different lengths")
        expected = _scalar_codes(obj, keys)
        wrong = [(k, c, e) for k, c, e in zip(keys, codes, expected) if c != e]
        if wrong:
            key, code, want = wrong[0]
            raise ValueError(
                f"key {key!r} of {where} was saved with reduce={_rec.REDUCTIONS[code - 1]!r} but this ScalarLog"
                f" reduces it with {_rec.REDUCTIONS[want - 1]!r}"
            )
    for name, child in _child_metrics(obj):
        _check_body(child, body["children"][name], f"{where}.{name}")


def _apply(obj: Any, body: Mapping[str, Any] | None) -> None:
    """Reset every metric; with a body (the first rank), give each its saved global state."""
    if isinstance(obj, (StockMetricCollection, Mapping)):
        items = obj.items(keep_base=True, copy_state=False) if isinstance(obj, StockMetricCollection) else obj.items()
        for name, member in items:
            _apply(member, body["members"][str(name)] if body is not None else None)
        return
    children = _child_metrics(obj)
    obj.reset()
    for name, child in children:
        _apply(child, body["children"][name] if body is not None else None)
    if body is None:
        return
    states = body["states"]
    device = obj.device
    for name in obj._defaults:
        current, value = getattr(obj, name), states[name]
        if isinstance(current, Tensor):
            loaded = value.to(device=device)
            if obj._reductions[name] is not dim_zero_cat:
                loaded = loaded.to(dtype=current.dtype)
            elif loaded.numel() == 0:
                continue  # no rows: the default
            setattr(obj, name, loaded.clone() if loaded is value else loaded)
        elif isinstance(value, Tensor):  # a `cat` list state, concatenated
            setattr(obj, name, [value.to(device)] if value.numel() else [])
        else:
            setattr(obj, name, [item.to(device) if isinstance(item, Tensor) else item for item in value])
    if isinstance(obj, ScalarLog):
        _write_scalars(obj, states[_SCALARS])
    obj._update_count = int(body["update_count"])


class MergedState:
    """A metric's or collection's merged state behind ``state_dict()`` / ``load_state_dict()``: for frameworks.

    Frameworks that call ``state_dict()`` and ``load_state_dict()`` of registered objects on every rank and write
    the result on one (Accelerate's ``register_for_checkpointing``) then save the global state, and load it exactly
    on any number of processes: ``state_dict()`` is :func:`merged_state_dict`, ``load_state_dict()`` is
    :func:`load_merged_state_dict`, both collectives. The states are checked when the wrapper is made, so a state
    that cannot be merged is refused before training starts.

    Args:
        metric_or_collection: the metric, collection, or mapping from names to metrics to save and load.

    Raises:
        MergedStateError: a state cannot be merged (see :func:`merged_state_dict`).

    Example:
        With Accelerate (on every process; ``save_state`` writes the file on the main one)::

            accelerator.register_for_checkpointing(MergedState(metrics))
            accelerator.save_state(path)  # later, on another number of processes: accelerator.load_state(path)

        The wrapper itself:

        >>> import torch
        >>> from torchmetrics.aggregation import SumMetric
        >>> from torchmetrics_varlen import MergedState
        >>> metric = SumMetric()
        >>> metric.update(torch.tensor(5.0))
        >>> saved = MergedState(metric).state_dict()
        >>> resumed = SumMetric()
        >>> MergedState(resumed).load_state_dict(saved)
        >>> resumed.compute()
        tensor(5.)
    """

    def __init__(self, metric_or_collection: Any) -> None:
        _walk(metric_or_collection, _name(metric_or_collection))
        self.metrics = metric_or_collection

    def state_dict(self) -> dict[str, Any]:
        """The merged state (a collective: every rank calls it)."""
        return merged_state_dict(self.metrics)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a merged state (a collective: every rank calls it, each with the state)."""
        load_merged_state_dict(self.metrics, state_dict)


# ------------------------------------------------------------------------------------ torch.distributed.checkpoint
_FORMAT = "format"  # a one-element tensor first in the state dict: DCP's default planner stops at it (see _Chunk)
_COUNTS = "counts"
_BLOB = "blob"
_HEADER = "header"


class _Chunk(Tensor):
    """One rank's share of a global tensor of a DCP checkpoint: the ``_Checkpointable`` protocol DCP's planners use.

    Saved, it describes one chunk (``__create_write_items__``: its offsets in the global tensor, the global size), or
    none for a rank with no rows (a zero-row chunk would share its offsets with the next rank's, and DCP keys chunks
    by offsets). Loaded, it is replaced by :func:`sharded_load_planner`'s planner before DCP plans anything.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # plain results

    tv_data: Tensor
    tv_owner: "ShardedState"
    tv_key: str
    tv_global: tuple[int, ...]
    tv_offsets: tuple[int, ...]
    tv_reads: bool
    tv_written: bool
    tv_empty: bool  # no rows (or bytes) on this rank: no chunk

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self.tv_written = True
        if self.tv_empty:
            return []  # an empty rank writes no chunk
        offsets, sizes = torch.Size(self.tv_offsets), self.tv_data.shape
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties.create_from_tensor(self.tv_data),
                    size=torch.Size(self.tv_global),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[Any]:
        raise TypeError(_PLANNER_MISSING)

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        if not self.tv_written:
            raise TypeError(_PLANNER_MISSING)
        return self.tv_data


_PLANNER_MISSING = (
    "Expected `torch.distributed.checkpoint.load(..., planner=torchmetrics_varlen.sharded_load_planner())` for a"
    " ShardedState but DCP's default planner got it: the default planner needs the saved sizes beforehand, which"
    " only the checkpoint knows. Pass the planner."
)


def _chunk(
    data: Tensor,
    owner: "ShardedState",
    key: str,
    size: Sequence[int],
    offsets: Sequence[int],
    reads: bool,
    empty: bool = False,
) -> _Chunk:
    # Shaped as the global tensor (zero strides: no memory), so that DCP's default planner, which compares the sizes
    # first, reaches `__create_chunk_list__` and its message where the sizes agree (always for `_FORMAT`).
    shaped = torch.zeros((), dtype=data.dtype).expand(*(int(s) for s in size))
    chunk: _Chunk = Tensor._make_subclass(_Chunk, shaped)  # type: ignore[assignment]
    chunk.tv_data, chunk.tv_owner, chunk.tv_key = data.detach(), owner, key
    chunk.tv_global, chunk.tv_offsets = tuple(int(s) for s in size), tuple(int(o) for o in offsets)
    chunk.tv_reads, chunk.tv_written = reads, False
    chunk.tv_empty = empty
    return chunk


def _code(text: str) -> int:
    """A short, rank-independent number for a dtype or shape (compared between ranks)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass
class _Share:
    """What one rank saves of one state: stacked (reduced states), rows (``cat`` data), or items in its blob.

    ``form`` follows from the state's kind alone (the same on every rank): a ``list/cat`` state is "rows" even on a
    rank whose list holds Python objects, whose ``items`` then go in the blob (``objects``).
    """

    key: str
    form: str  # "stack", "rows" or "blob"
    data: Tensor | None  # stack: the state; rows: this rank's rows (None: no rows)
    items: Any  # what goes in this rank's blob under `key` (None: nothing)
    where: str

    @property
    def objects(self) -> bool:
        return self.form == "rows" and self.items is not None


def _shares(leaves: Sequence[_Leaf]) -> list[_Share]:
    shares = []
    for i, leaf in enumerate(leaves):
        for j, (name, kind) in enumerate(leaf.kinds.items()):
            key, where = f"m{i}s{j}", f"state `{name}` of {leaf.where}"
            if kind == _SCALAR_KIND:
                keys, codes, first, weight = _read_scalars(leaf.metric)  # type: ignore[arg-type]
                shares.append(_Share(key, "blob", None, [keys, codes, first, weight] if keys else None, where))
                continue
            value = getattr(leaf.metric, name)
            if kind in _REDUCED:
                shares.append(_Share(key, "stack", value.detach(), None, where))
            elif kind == "tensor/cat":
                rows = value.detach() if value.ndim else value.detach().reshape(1)
                shares.append(_Share(key, "rows", rows if rows.shape[0] else None, None, where))
            elif kind == "list/cat" and all(isinstance(item, Tensor) for item in value):
                rows = dim_zero_cat([item.detach() for item in value]) if value else None
                shares.append(_Share(key, "rows", rows if rows is not None and rows.shape[0] else None, None, where))
            else:  # a list kept item by item (dist_reduce_fx=None), or Python objects (then in the blob)
                items = [item.detach() if isinstance(item, Tensor) else item for item in value]
                form = "rows" if kind == "list/cat" else "blob"
                shares.append(_Share(key, form, None, items or None, where))
    return shares


def _share_words(share: _Share) -> list[int]:
    """A share's words in the ranks' agreement: rows, dtype, trailing shape (-1: none); for rows an objects flag."""
    if share.form == "blob":
        return []
    data = share.data
    if data is None:
        words = [0, -1, -1]
    elif share.form == "stack":
        words = [1, _code(str(data.dtype)), _code(repr(tuple(data.shape)))]
    else:
        words = [int(data.shape[0]), _code(str(data.dtype)), _code(repr(tuple(data.shape[1:])))]
    return words + ([int(share.objects)] if share.form == "rows" else [])


def _check_shares(table: list[list[int]], shares: Sequence[_Share], where: str) -> None:
    """Raise on every rank alike (the table is every rank's) when the ranks' shares cannot form global tensors."""
    failing = [rank for rank, row in enumerate(table) if row[0]]
    if failing:
        raise MergedStateError(
            f"Expected every list state of {where} to be picklable (each rank's lists are saved as one pickle) but"
            f" ranks {failing} hold an object that pickle refuses."
        )
    column = 2
    for share in shares:
        width = len(_share_words(share))
        if not width:
            continue
        kinds = {(row[column + 1], row[column + 2]) for row in table if row[column + 1] != -1}
        if len(kinds) > 1:
            what = "shape" if share.form == "stack" else "dims after the first"
            listing = ", ".join(f"rank {r}: {row[column]} rows" for r, row in enumerate(table))
            raise MergedStateError(
                f"Expected {share.where} to have the same dtype and {what} on every rank (its shares form one"
                f" global tensor) but the ranks hold different ones ({listing})."
            )
        if share.form == "rows":
            tensors = [r for r, row in enumerate(table) if row[column] > 0]
            objects = [r for r, row in enumerate(table) if row[column + 3]]
            if tensors and objects:
                raise MergedStateError(
                    f"Expected {share.where} to hold tensors on every rank or Python objects on every rank but ranks"
                    f" {tensors} hold tensors and ranks {objects} objects."
                )
        column += width


def _pickled(items: Mapping[str, Any]) -> Tensor:
    buffer = io.BytesIO()
    torch.save({key: value for key, value in items.items()}, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpickled(data: Tensor) -> Any:
    # A checkpoint is trusted as any torch.load(weights_only=False) of one: these are the job's own pickles.
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=False)


class ShardedState:
    """A metric's or collection's state for ``torch.distributed.checkpoint``: each rank writes its own share.

    Put it in the state dict given to ``torch.distributed.checkpoint.save`` on every rank: each rank writes its own
    share of every state as a chunk of a global tensor (reduced states as one row per rank of a ``[world_size, ...]``
    tensor, ``cat`` data as its rows at the rank's offset, lists and a ``ScalarLog``'s accumulators in one pickled
    ``uint8`` chunk per rank, the update counts as one row per rank), plus one small header (JSON: the format, the
    class and state kinds, the world size, each rank's rows and bytes). Nothing is gathered to one rank: the ranks
    exchange their sizes only (one tiny all-gather), and DCP writes each rank's chunks. A rank with no rows of a state
    writes no chunk of it.

    Load with ``torch.distributed.checkpoint.load(..., planner=sharded_load_planner())`` on any number of ranks, the
    same object in the state dict: the planner reads the saved sizes from the checkpoint's metadata and lets the
    first rank of the metrics' group read every chunk, the others none; ``load_state_dict`` then checks the header
    and the chunks on every rank (another class, other states, a missing shard raise `MergedStateError` on every
    rank, nothing loaded), and the first rank takes the global state as :func:`load_merged_state_dict` gives it, the
    others their defaults. Loaded without that planner, DCP's default one raises on every rank, saying to pass it,
    before anything is read.

    Works with DCP on torch 2.13 and newer, through the ``__create_write_items__`` / ``__get_tensor_shard__`` protocol
    that DCP's default planners ask of a tensor (DTensor's own). torch 2.15's ``CheckpointableTensor`` describes the
    same chunks with attributes; it too needs the saved sizes at load, so the planner stays needed there.

    Args:
        metric_or_collection: the metric, collection, or mapping from names to metrics.

    Raises:
        MergedStateError: a state cannot be merged (see :func:`merged_state_dict`).

    Example:
        On every rank (``path`` the same directory)::

            import torch.distributed.checkpoint as dcp
            dcp.save({"model": model.state_dict(), "metrics": ShardedState(metrics)}, checkpoint_id=path)
            # later, on another number of ranks:
            state = {"model": model.state_dict(), "metrics": ShardedState(metrics)}
            dcp.load(state, checkpoint_id=path, planner=sharded_load_planner())

        Without a process group, the state of one process:

        >>> import torch
        >>> from torchmetrics.aggregation import CatMetric
        >>> from torchmetrics_varlen import ShardedState
        >>> metric = CatMetric()
        >>> metric.update(torch.tensor([1.0, 2.0]))
        >>> sorted(ShardedState(metric).state_dict())
        ['blob', 'counts', 'format', 'header', 'm0s0']
    """

    def __init__(self, metric_or_collection: Any) -> None:
        _walk(metric_or_collection, _name(metric_or_collection))
        self.metrics = metric_or_collection
        self._found: dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]] | None] = {}
        self._read: dict[str, Tensor] = {}
        self._planned = False

    # ------------------------------------------------------------------------------------------------- save
    def state_dict(self) -> dict[str, Any]:
        """Each rank's share of every state, as DCP saves it (a collective: every rank calls it).

        DCP also calls it to load: the planner of :func:`sharded_load_planner` then replaces the shares.
        """
        where = _name(self.metrics)
        description, leaves = _walk(self.metrics, where)
        sync_link = _link(leaves, where)
        self._found, self._read, self._planned = {}, {}, False
        _refuse_synced(leaves)
        rank, size = (sync_link.rank, sync_link.size) if sync_link is not None else (0, 1)
        reads = rank == 0
        shares = _shares(leaves)
        blob_items = {share.key: share.items for share in shares if share.items is not None}
        failure = 0
        try:
            blob = _pickled(blob_items) if blob_items else torch.empty(0, dtype=torch.uint8)
        except Exception:  # an object pickle refuses: every rank raises below, naming this one
            blob, failure = torch.empty(0, dtype=torch.uint8), 1
        words = [failure, blob.numel()]
        for share in shares:
            words += _share_words(share)
        table = agree(words, sync_link, "shares of a sharded state") if sync_link is not None else [words]
        _check_shares(table, shares, where)
        header: dict[str, Any] = {"format": SHARDED_FORMAT, "version": VERSION, **description, "world_size": size}
        header["blob"] = [row[1] for row in table]
        header["rows"] = {}
        version = torch.tensor([VERSION], dtype=torch.int64)
        out: dict[str, Any] = {_FORMAT: _chunk(version, self, _FORMAT, (1,), (0,), reads, rank != 0)}
        counts = torch.tensor([[int(leaf.metric._update_count) for leaf in leaves]], dtype=torch.int64)
        out[_COUNTS] = _chunk(counts, self, _COUNTS, (size, len(leaves)), (rank, 0), reads)
        column = 2
        for share in shares:
            width = len(_share_words(share))
            per_rank = [row[column] for row in table]
            column += width
            if share.form == "stack":
                data = share.data
                assert data is not None  # a reduced state is a tensor on every rank
                stacked = data.reshape(1, *data.shape)
                offsets = (rank,) + (0,) * data.ndim
                out[share.key] = _chunk(stacked, self, share.key, (size, *data.shape), offsets, reads)
            elif share.form == "rows":
                header["rows"][share.key] = per_rank
                rows = share.data if share.data is not None else torch.empty(0)
                trailing = tuple(rows.shape[1:])
                offsets = (sum(per_rank[:rank]),) + (0,) * len(trailing)
                global_size = (sum(per_rank), *trailing)
                out[share.key] = _chunk(rows, self, share.key, global_size, offsets, reads, share.data is None)
        blobs = header["blob"]
        out[_BLOB] = _chunk(blob, self, _BLOB, (sum(blobs),), (sum(blobs[:rank]),), reads, blob.numel() == 0)
        out[_HEADER] = json.dumps(header)
        return out

    # ------------------------------------------------------------------------------------------------- load
    def _found_chunks(self, key: str, stored: Any, read: Tensor | None) -> None:
        """The planner's note: what the checkpoint holds under ``key`` (None: nothing), and the tensor read into."""
        self._planned = True
        if stored is None:
            self._found[key] = None
        else:
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in stored.chunks]
            self._found[key] = (tuple(stored.size), chunks)
        if read is not None:
            self._read[key] = read

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Check what DCP read on every rank, then give the first rank the global state (a collective)."""
        if not self._planned:
            raise TypeError(_PLANNER_MISSING)
        where = _name(self.metrics)
        description, leaves = _walk(self.metrics, where)
        sync_link = _link(leaves, where)
        first = sync_link is None or sync_link.rank == 0
        body = None
        try:
            header = json.loads(state_dict[_HEADER])
            problem = _check_merged({"header": header}, description, SHARDED_FORMAT, where)
            if problem is None:
                problem = self._check_chunks(header, leaves, where)
            if problem is None and first:
                body = _nest(self.metrics, iter(self._assemble(header, leaves)))
                _check_body(self.metrics, body, where)
        except MergedStateError as err:
            problem = str(err)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:  # not what it should be
            problem = f"Expected the saved shares of {where} to be what their header lists but got {err!r}."
        except Exception as err:  # a pickled share that does not load
            problem = f"Expected the saved shares of {where} to load but got {type(err).__name__}: {err}"
        self._read = {}  # the chunks read are in `body` now, or not needed
        _agree_or_raise(problem, sync_link, "a sharded state checked", where)
        _apply(self.metrics, body)

    def _check_chunks(self, header: Mapping[str, Any], leaves: Sequence[_Leaf], where: str) -> str | None:
        """Every chunk the header says was written is in the checkpoint, where it says: else name the missing one."""
        world = int(header["world_size"])
        every_rank = [(rank, rank, 1) for rank in range(world)]
        expected: dict[str, tuple[str, list[tuple[int, int, int]]]] = {_COUNTS: ("update counts", every_rank)}
        expected[_FORMAT] = ("format version", [(0, 0, 1)])
        for i, leaf in enumerate(leaves):
            for j, (name, kind) in enumerate(leaf.kinds.items()):
                if kind in _REDUCED:  # a row per rank
                    expected[f"m{i}s{j}"] = (f"state `{name}` of {leaf.where}", every_rank)
                elif f"m{i}s{j}" in header["rows"]:
                    expected[f"m{i}s{j}"] = (f"state `{name}` of {leaf.where}", [])
        for key, per_rank in [*header["rows"].items(), (_BLOB, header["blob"])]:
            spans = [(rank, sum(per_rank[:rank]), int(n)) for rank, n in enumerate(per_rank) if n]
            expected[key] = (expected[key][0] if key in expected else "its pickled lists", spans)
        for key, (what, spans) in expected.items():
            found = self._found.get(key)
            stored = set() if found is None else {(offsets[0], sizes[0]) for offsets, sizes in found[1] if offsets}
            for rank, start, length in spans:
                if (start, length) not in stored:
                    return (
                        f"Expected the checkpoint to hold every saved rank's share of {where} but the share of rank"
                        f" {rank} of {world} ({what}: {length} rows from row {start}) is missing: a shard was lost, or"
                        " the checkpoint was written by another save."
                    )
        return None

    def _assemble(self, header: Mapping[str, Any], leaves: Sequence[_Leaf]) -> list[dict[str, Any]]:
        """The global state of each leaf from the chunks the first rank read: as `merged_state_dict` builds it."""
        counts = self._read[_COUNTS].sum(0).tolist()
        blobs: list[dict[str, Any]] = []
        data, start = self._read.get(_BLOB), 0
        for nbytes in header["blob"]:
            blobs.append(_unpickled(data[start : start + nbytes]) if nbytes and data is not None else {})
            start += nbytes
        out = []
        for i, leaf in enumerate(leaves):
            states: dict[str, Any] = {}
            for j, (name, kind) in enumerate(leaf.kinds.items()):
                key = f"m{i}s{j}"
                parts = [blob[key] for blob in blobs if key in blob]
                if kind == _SCALAR_KIND:
                    keys = [k for part in parts for k in part[0]]
                    codes, first, weight = (
                        torch.cat([p[n] for p in parts]) if parts else torch.zeros(0) for n in (1, 2, 3)
                    )
                    states[name] = _scalar_state(keys, codes, first, weight, leaf.where)
                elif kind in _REDUCED:
                    states[name] = _REDUCED[kind](self._read[key])
                elif key in self._read:  # rows of `cat` data
                    states[name] = self._read[key]
                elif parts:  # lists kept item by item, or Python objects
                    states[name] = [item for part in parts for item in part]
                else:
                    states[name] = torch.empty(0) if kind == "tensor/cat" else []
            out.append({"states": states, "update_count": int(counts[i])})
        return out


@dataclass
class _Found:
    """Where the planner found a share in the state dict DCP loads."""

    parent: dict[Any, Any]
    key: Any
    path: tuple[Any, ...]
    chunk: _Chunk


def _resolve_shares(state_dict: dict[str, Any], metadata: Any) -> None:
    """Replace every ShardedState share in ``state_dict`` before DCP plans the load (see `sharded_load_planner`)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    found: list[_Found] = []

    def visit(node: Any, path: tuple[Any, ...]) -> None:
        for key, value in list(node.items()):
            if isinstance(value, _Chunk):
                found.append(_Found(node, key, (*path, key), value))
            elif isinstance(value, dict):
                visit(value, (*path, key))

    visit(state_dict, ())
    saved = metadata.state_dict_metadata
    for item in found:
        fqn = ".".join(map(str, item.path))
        prefix = fqn[: len(fqn) - len(item.chunk.tv_key)]
        if not isinstance(saved.get(prefix + _HEADER), BytesStorageMetadata):
            under = sorted(key for key in saved if key.startswith(prefix))
            owner = item.chunk.tv_owner
            raise MergedStateError(
                f"Expected a sharded state of {_name(owner.metrics)} (saved with torchmetrics_varlen.ShardedState)"
                f" under `{prefix.rstrip('.')}` but the checkpoint holds {under[:8] or 'nothing there'}: a stock"
                " metric's `state_dict()` holds each rank's persistent states under one key, of which DCP keeps one"
                " rank's copy, so it cannot be loaded exactly. Save with ShardedState."
            )
        stored = saved.get(fqn)
        stored = stored if isinstance(stored, TensorStorageMetadata) else None
        target = None
        if stored is not None and item.chunk.tv_reads:
            target = torch.empty(stored.size, dtype=stored.properties.dtype)
            item.parent[item.key] = target
        else:
            del item.parent[item.key]  # nothing to read on this rank
        item.chunk.tv_owner._found_chunks(item.chunk.tv_key, stored, target)


def sharded_load_planner(**kwargs: Any) -> Any:
    """A load planner for ``torch.distributed.checkpoint.load`` of a state dict that holds a :class:`ShardedState`.

    DCP loads into tensors of the saved sizes, which only the checkpoint knows (every rank saved its own number of
    rows). This planner is DCP's ``DefaultLoadPlanner`` (it loads everything else in the state dict as that one
    does: a model, an optimizer) that first looks up each share of a ``ShardedState`` in the checkpoint's metadata:
    on the first rank of the metrics' group it becomes a tensor of the saved size, read from every rank's chunks;
    on the other ranks it is not read at all. A checkpoint that holds no sharded state where the state dict has one (a
    stock metric's ``state_dict()``) raises `MergedStateError` on every rank before anything is read.

    Args:
        kwargs: keyword arguments of ``DefaultLoadPlanner`` (``flatten_state_dict``, ``allow_partial_load``, ...).

    Returns:
        A ``torch.distributed.checkpoint.DefaultLoadPlanner`` (a subclass made for this call).

    Example:
        >>> from torch.distributed.checkpoint import DefaultLoadPlanner
        >>> from torchmetrics_varlen import sharded_load_planner
        >>> isinstance(sharded_load_planner(), DefaultLoadPlanner)
        True
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class ShardedLoadPlanner(DefaultLoadPlanner):  # type: ignore[misc]
        """DCP's default load planner, with the shares of ShardedStates sized from the checkpoint first."""

        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            if metadata is not None:
                _resolve_shares(state_dict, metadata)
            super().set_up_planner(state_dict, metadata, is_coordinator)

    return ShardedLoadPlanner(**kwargs)
