"""Metric state that survives a checkpoint and a new world size, exactly (see the docs' page on checkpoints).

The *global* state, what one process that saw every rank's updates would hold, is saved, and loaded on any number of
ranks: the first rank of the metrics' group takes it, the others start from their defaults.
"""

import copy
import functools
import io
import json
import operator
import zlib
from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate, pairwise
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics import MetricCollection as StockMetricCollection
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_mean, dim_zero_min, dim_zero_sum

from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine import scalar_codec as _rec
from torchmetrics_varlen._engine.group import Link, link, resolve_timeout
from torchmetrics_varlen._engine.states import metrics_device, sync_states
from torchmetrics_varlen.scalars import ScalarLog

__all__ = [
    "MergedState",
    "MergedStateError",
    "ShardedState",
    "load_merged_state_dict",
    "merged_state_dict",
    "sharded_load_planner",
]

MERGED_FORMAT, SHARDED_FORMAT, VERSION = "torchmetrics_varlen.merged_state_dict", "torchmetrics_varlen.sharded_state", 1
_NAMES = MappingProxyType({dim_zero_sum: "sum", dim_zero_max: "max", dim_zero_min: "min", dim_zero_cat: "cat"})
_REDUCED = MappingProxyType({"tensor/sum": dim_zero_sum, "tensor/max": dim_zero_max, "tensor/min": dim_zero_min})
_SCALARS, _SCALAR_KIND = "scalars", "scalar_log"  # a ScalarLog's accumulators, saved as a state of its own
_COLUMNS = ("keys", "codes", "first", "weight")  # a ScalarLog's accumulators, per key
# A sharded state's keys beside its states' (`m{i}s{j}`); `_FORMAT` comes first: DCP's default planner stops at it.
_FORMAT, _COUNTS, _BLOB, _HEADER = "format", "counts", "blob", "header"
_PLANNER_MISSING = (
    "Expected `torch.distributed.checkpoint.load(..., planner=torchmetrics_varlen.sharded_load_planner())` for a"
    " ShardedState but DCP's default planner got it: the default planner needs the saved sizes beforehand, which"
    " only the checkpoint knows. Pass the planner."
)
# A metric whose states are saved: (metric, state name -> kind, its place in messages, the path to its saved body).
_Leaf = tuple[StockMetric, dict[str, str], str, tuple[str, ...]]


class MergedStateError(ValueError):
    """A metric state that cannot be merged, or a saved state that does not fit; raised on every rank alike.

    Example:
        >>> issubclass(MergedStateError, ValueError)
        True
    """


def _kind(metric: StockMetric, name: str, where: str) -> str:
    """A state's kind (``"tensor/sum"``, ``"list/cat"``, ...), or `MergedStateError` for one that cannot be merged."""
    fn: Any = metric._reductions[name]
    container = "list" if isinstance(metric._defaults[name], list) else "tensor"
    reduction = "none" if fn is None else _NAMES.get(fn)
    if fn is dim_zero_mean:
        why = (
            "dist_reduce_fx='mean': a mean of per-rank values cannot be split again over another number of ranks (nor"
            " is it the mean one process would compute when the ranks saw different amounts of data). Keep a sum state"
            " and a count state (dist_reduce_fx='sum') and divide in compute()"
        )
    elif reduction is None:
        why = (
            f"a custom dist_reduce_fx ({getattr(fn, '__qualname__', None) or type(fn).__name__}): what it does with the"
            " ranks' values is not known, so the global state cannot be built nor split again. Use 'sum', 'max', 'min'"
            " or 'cat'"
        )
    elif container == "tensor" and reduction == "none":
        why = (
            "dist_reduce_fx=None on a tensor state: a sync stacks one value per rank, which cannot be split again over"
            " another number of ranks. Use 'sum', 'max', 'min' or 'cat', or a list state"
        )
    elif container == "list" and reduction not in ("cat", "none"):
        why = f"dist_reduce_fx='{reduction}' on a list state: only 'cat' and None are defined for lists"
    else:
        return f"{container}/{reduction}"
    raise MergedStateError(f"Expected every state of {where} to be mergeable but state `{name}` has {why}.")


def _tree(obj: Any, where: str = "", path: tuple[str, ...] = ()) -> tuple[str, dict[str, Any], list[_Leaf]]:
    """How messages name ``obj``, its description (classes, state kinds, members, children) and its metrics."""
    if not where:  # what is saved: its class, or the names of a mapping's metrics
        where = "MetricCollection" if isinstance(obj, StockMetricCollection) else type(obj).__name__
        where = f"metrics {[str(key) for key in obj]}" if isinstance(obj, Mapping) else where
    leaves: list[_Leaf] = []
    if isinstance(obj, (StockMetricCollection, Mapping)):
        collection = isinstance(obj, StockMetricCollection)
        items = obj.items(keep_base=True, copy_state=False) if isinstance(obj, StockMetricCollection) else obj.items()
        description: dict[str, Any] = {"class": "MetricCollection" if collection else "metrics", "members": {}}
        key, subs = "members", [(str(name), member, f"{where}[{str(name)!r}]") for name, member in items]
    elif isinstance(obj, StockMetric):
        kinds = {name: _kind(obj, name, where) for name in obj._defaults}
        if isinstance(obj, ScalarLog):
            kinds[_SCALARS] = _SCALAR_KIND
        base = type(obj).__dict__.get("_rebased_from", type(obj))  # a rebased class counts as its stock base
        description = {"class": f"{base.__module__}.{base.__qualname__}", "states": kinds}
        leaves, key, subs, stack = [(obj, kinds, where, path)], "children", [], list(obj.named_children())
        while stack:  # the metrics it holds (a wrapper's), stopping at each; those that never sync left out
            name, child = stack.pop(0)
            if not isinstance(child, (StockMetric, StockMetricCollection)):
                stack[:0] = [(f"{name}.{inner}", module) for inner, module in child.named_children()]
            elif isinstance(child, StockMetricCollection) or child._to_sync or child.dist_sync_on_step:
                subs.append((name, child, f"{where}.{name}"))
    else:
        raise TypeError(f"Expected a torchmetrics Metric or MetricCollection at {where} but got {type(obj).__name__}")
    for name, sub, place in subs:
        _, description.setdefault(key, {})[name], found = _tree(sub, place, (*path, key, name))
        leaves += found
    return where, description, leaves


def _link(leaves: Sequence[_Leaf], where: str, saving: bool) -> Link | None:
    """The link of the metrics' one process group (the smallest of their sync timeouts); a synced metric not saved."""
    groups = {id(metric.process_group): metric.process_group for metric, *_ in leaves}
    if len(groups) > 1:
        raise MergedStateError(
            f"Expected the metrics of {where} to sync over one process group but they name {len(groups)}: save them"
            " separately, one call per process group."
        )
    if saving and (synced := [place for metric, _, place, _ in leaves if metric._is_synced]):
        raise MergedStateError(
            f"Expected {synced[0]} to hold its own states but it is synced (inside `sync()` or `sync_context()`), so"
            " every rank holds the global states and saving would count them once per rank. Save it after `unsync()`."
        )
    timeouts = [t for metric, *_ in leaves if (t := vars(metric).get("sync_timeout")) is not None]
    timeout, device = min(timeouts, default=resolve_timeout(None)), metrics_device([metric for metric, *_ in leaves])
    return link(next(iter(groups.values()), None), device, timeout, f"checkpoint of {where}")


def _nest(description: Mapping[str, Any], bodies: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """The metrics' bodies (in `_tree`'s order) laid out as the description: members, children of wrappers."""
    if "members" in description:
        return {"members": {name: _nest(member, bodies) for name, member in description["members"].items()}}
    body = next(bodies)
    if "children" in description:
        body["children"] = {name: _nest(child, bodies) for name, child in description["children"].items()}
    return body


def _local_value(metric: Any, name: str, kind: str, copies: bool = True) -> Any:
    """One rank's state as its merged value, copied or only detached; a ScalarLog's accumulators as CPU columns."""
    if kind == _SCALAR_KIND:  # [keys, codes, first words, weights]: the host's part and every device's, folded
        acc = metric._read(metric._acc.read())
        first, weight = (torch.tensor(np.asarray(column, dtype=np.float64)) for column in (acc.first, acc.weight))
        return [list(acc.index), torch.tensor(np.asarray(acc.codes, dtype=np.int64)), first, weight]
    value = getattr(metric, name)
    if isinstance(value, Tensor):
        return value.detach().clone() if copies else value.detach()
    if kind == "list/cat" and all(isinstance(item, Tensor) for item in value):
        empty = torch.empty(0, dtype=metric.dtype, device=metric.device)
        return dim_zero_cat([item.detach() for item in value]) if value else empty
    items = [item.detach() if isinstance(item, Tensor) else item for item in value]
    return [item.clone() if isinstance(item, Tensor) else copy.deepcopy(item) for item in items] if copies else items


def _merged_scalars(where: str, keys: Any, codes: Any, first: Any, weight: Any) -> dict[str, Any]:
    """Ranks' accumulators (in rank order; keys a tensor where a sync found none) combined per key, as a log does."""
    keys = [] if isinstance(keys, Tensor) else list(keys)
    codes, first, weight = (torch.as_tensor(t).reshape(-1) for t in (codes, first, weight))
    acc = _rec.Accumulator()
    for key, code, value, w in zip(keys, codes.long().tolist(), first.double().tolist(), weight.double().tolist()):
        at = acc.register([key], [code])[0]  # first: it replaces `acc.codes`
        if (held := int(acc.codes[at])) != code:
            raise MergedStateError(
                f"Expected every rank to reduce key {key!r} of {where} the same way but got"
                f" {_rec.REDUCTIONS[held - 1]!r} and {_rec.REDUCTIONS[code - 1]!r}. Pass the same `reduce=`."
            )
        acc.merge([key], np.array([value]), np.array([w]))  # sums, or maxima and minima (NaN propagates)
    return {"keys": list(acc.index), **{column: torch.from_numpy(getattr(acc, column)) for column in _COLUMNS[1:]}}


class _Carrier(StockMetric):
    """States made for one checkpoint sync (update counts, ScalarLogs' accumulators): synced, never updated."""

    full_state_update = False

    def __init__(self, states: Mapping[str, tuple[Any, str]]) -> None:
        super().__init__()
        for name, (value, reduction) in states.items():
            self.add_state(name, default=[] if isinstance(value, list) else torch.zeros(0), dist_reduce_fx=reduction)
            vars(self)[name] = value  # a plain attribute, as torchmetrics keeps states

    def update(self) -> None: ...

    compute = update  # never called either


def merged_state_dict(metric_or_collection: Any) -> dict[str, Any]:
    """The global state of a metric or collection, what one process would hold: a collective (one engine sync).

    Args:
        metric_or_collection: a metric (stock, rebased or this package's), a ``MetricCollection``, or a mapping.

    Returns:
        The same dict on every rank, sharing no memory with the metric: ``{"header", "states", "update_count"}``
        (``"children"`` for a wrapper's metrics), or ``{"header", "members"}`` for a collection or a mapping.

    Raises:
        MergedStateError: on every rank: a state that cannot be merged, several process groups, a synced metric.
        TypeError: ``metric_or_collection`` is no metric.

    Example:
        >>> from torchmetrics.aggregation import SumMetric
        >>> metric = SumMetric()
        >>> metric.update(torch.tensor([1.0, 2.0]))
        >>> state = merged_state_dict(metric)  # on every rank; torch.save(state, path) on one
        >>> state["header"]["states"], state["states"], state["update_count"]
        ({'sum_value': 'tensor/sum'}, {'sum_value': tensor(3.)}, 1)
    """
    where, description, leaves = _tree(metric_or_collection)
    sync_link = _link(leaves, where, saving=True)
    logs = {i: _local_value(m, _SCALARS, _SCALAR_KIND) for i, (m, *_) in enumerate(leaves) if isinstance(m, ScalarLog)}
    counts = [int(metric._update_count) for metric, *_ in leaves]
    if sync_link is None:  # a group of one: this rank's states are the global ones
        synced = [{n: _local_value(m, n, k) for n, k in kinds.items() if k != _SCALAR_KIND} for m, kinds, *_ in leaves]
    else:  # one sync of the engine for every metric, its update count, a ScalarLog's accumulators
        carried: dict[str, tuple[Any, str]] = {"counts": (torch.tensor(counts, dtype=torch.int64), "sum")}
        for i, (keys, *columns) in logs.items():
            values = [keys, *([column] for column in columns)]
            carried.update({f"{name}{i}": (value if keys else [], "cat") for name, value in zip(_COLUMNS, values)})
        metrics = [metric for metric, *_ in leaves]
        results = sync_states([*metrics, _Carrier(carried)], sync_link, phase="checkpoint", label="merged_state_dict")
        assert results is not None  # only a sync of cached results ends early
        *synced, totals = results
        counts, logs = totals["counts"].tolist(), {i: [totals[f"{name}{i}"] for name in _COLUMNS] for i in logs}
        for states in synced:  # results own their memory; one carries a graph where the state did (list items never)
            states.update({name: value.detach() for name, value in states.items() if isinstance(value, Tensor)})
    for i, log in logs.items():
        synced[i][_SCALARS] = _merged_scalars(leaves[i][2], *log)
    bodies = iter([{"states": states, "update_count": int(count)} for states, count in zip(synced, counts)])
    header = {"format": MERGED_FORMAT, "version": VERSION, **description}
    header["world_size"] = sync_link.size if sync_link is not None else 1
    return {"header": header, **_nest(description, bodies)}


def _agree_or_raise(problem: str | None, sync_link: Link | None, what: str, where: str) -> None:
    """Every rank raises `MergedStateError` when any rank found a problem (one tiny exchange), naming the ranks."""
    words = [int(problem is not None)]
    table = _engine.agree(words, sync_link, what) if sync_link is not None else [words]
    if not (failing := [rank for rank, row in enumerate(table) if row[0]]):
        return
    if problem is None:
        problem = (
            f"Expected the state given to every rank to fit {where} but ranks {failing} found it does not (their error"
            " names what): nothing was loaded on any rank."
        )
    elif len(table) > 1:
        problem = f"{problem} (found on ranks {failing}; nothing was loaded on any rank)"
    raise MergedStateError(problem)


def _first_difference(saved: Any, current: Any, path: str) -> str | None:
    """Where two descriptions differ first, as text; None when equal."""
    if not (isinstance(saved, Mapping) and isinstance(current, Mapping)):
        return None if saved == current else f"{path}: saved {saved!r}, expected {current!r}"
    if list(saved) != list(current):
        return f"{path}: saved {list(saved)}, expected {list(current)}"
    found = (_first_difference(saved[key], current[key], f"{path}.{key}" if path else str(key)) for key in current)
    return next((text for text in found if text is not None), None)


def _check_header(state: Any, description: Mapping[str, Any], fmt: str, where: str) -> str | None:
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
    if not isinstance(version := header.get("version"), int) or version > VERSION:
        return (
            f"Expected a saved state of format version {VERSION} or older for {where} but got version {version!r}:"
            " it was written by a newer torchmetrics-varlen; upgrade to load it."
        )
    saved = {key: header[key] for key in ("class", "states", "members", "children") if key in header}
    if (difference := _first_difference(saved, description, "")) is None:
        return None
    return (
        f"Expected a saved state of {where} but the saved one differs at {difference}."
        " Load it into an object of the same classes, states and members."
    )


def _load(leaves: Sequence[_Leaf], body: Any, apply: bool) -> None:
    """Check the saved values against the metrics; with ``apply`` (once the ranks agreed) reset them and load them."""
    for metric, *_ in leaves if apply else ():
        metric.reset()
    for metric, _, where, path in leaves if body is not None else ():
        found = functools.reduce(operator.getitem, path, body)
        states, count, device = found["states"], found["update_count"], metric.device
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"{where} has update count {count!r}")
        for name, default in metric._defaults.items():
            value: Any = states[name]
            state, reduced = f"state `{name}` of {where}", metric._reductions[name] is not dim_zero_cat
            if isinstance(default, Tensor) and not isinstance(value, Tensor):
                raise ValueError(f"{state} is a {type(value).__name__}, not a tensor")
            if isinstance(default, Tensor) and reduced and value.shape != default.shape:
                raise ValueError(f"{state} is saved with shape {tuple(value.shape)}, not {tuple(default.shape)}")
            if not isinstance(value, (Tensor, list)):
                raise ValueError(f"{state} is a {type(value).__name__}, not a tensor or a list")
            current = getattr(metric, name) if apply else None
            # a tensor state (`cat` data without rows keeps its default), or a list state (`cat` rows: one item)
            if isinstance(current, Tensor) and isinstance(value, Tensor) and (reduced or value.numel()):
                loaded = value.to(device=device, dtype=current.dtype if reduced else value.dtype)
                setattr(metric, name, loaded.clone() if loaded is value else loaded)
            elif isinstance(current, list):
                items = ([value] if value.numel() else []) if isinstance(value, Tensor) else value
                setattr(metric, name, [item.to(device) if isinstance(item, Tensor) else item for item in items])
        if isinstance(metric, ScalarLog):
            scalars = states[_SCALARS]
            keys, codes = list(scalars["keys"]), scalars["codes"].tolist()
            if len({len(keys), len(codes), scalars["first"].numel(), scalars["weight"].numel()}) != 1:
                raise ValueError(f"the accumulators of {where} have different lengths")
            for key, code, want in zip(keys, codes, metric._codes(keys)):
                if code != want:
                    raise ValueError(
                        f"key {key!r} of {where} was saved with reduce={_rec.REDUCTIONS[code - 1]!r} but this"
                        f" ScalarLog reduces it with {_rec.REDUCTIONS[want - 1]!r}"
                    )
            if apply:
                acc = metric._acc = _rec.Accumulator()
                acc.register(keys, codes)
                acc.first, acc.weight = (scalars[n].cpu().numpy().astype(np.float64) for n in ("first", "weight"))
        if apply:
            metric._update_count = int(count)


def load_merged_state_dict(metric_or_collection: Any, state: Mapping[str, Any]) -> None:
    """Load a :func:`merged_state_dict` state on any world size: the first rank takes it, the others their defaults.

    Args:
        metric_or_collection: what was saved, or an object of the same classes and states.
        state: the dict :func:`merged_state_dict` returned, given to every rank (a collective that checks it first).

    Raises:
        MergedStateError: on every rank, nothing loaded: the state does not fit, or a state cannot be merged.

    Example:
        >>> from torchmetrics.aggregation import CatMetric
        >>> saved, resumed = CatMetric(), CatMetric()
        >>> saved.update(torch.tensor([1.0, 2.0]))
        >>> load_merged_state_dict(resumed, merged_state_dict(saved))  # on any number of ranks
        >>> resumed.update(torch.tensor([3.0]))
        >>> resumed.compute()
        tensor([1., 2., 3.])
    """
    where, description, leaves = _tree(metric_or_collection)
    sync_link = _link(leaves, where, saving=False)
    problem = _check_header(state, description, MERGED_FORMAT, where)
    try:
        _load(leaves, state if problem is None else None, apply=False)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:  # a hand-edited or truncated state
        missing = f"it has no {err}" if isinstance(err, KeyError) else str(err)
        problem = f"Expected the saved state of {where} to hold what its header lists but {missing}."
    _agree_or_raise(problem, sync_link, "a merged state checked", where)
    _load(leaves, state if sync_link is None or sync_link.rank == 0 else None, apply=True)


class MergedState:
    """:func:`merged_state_dict` and :func:`load_merged_state_dict` as ``state_dict()`` and ``load_state_dict()``.

    Args:
        metric_or_collection: what to save and load (Accelerate's ``register_for_checkpointing`` takes the wrapper).

    Raises:
        MergedStateError: a state cannot be merged (checked here, before training starts).

    Example:
        >>> from torchmetrics.aggregation import SumMetric
        >>> metric, resumed = SumMetric(), SumMetric()
        >>> metric.update(torch.tensor(5.0))
        >>> MergedState(resumed).load_state_dict(MergedState(metric).state_dict())
        >>> resumed.compute()
        tensor(5.)
    """

    def __init__(self, metric_or_collection: Any) -> None:
        _tree(metric_or_collection)
        self.metrics = metric_or_collection

    def state_dict(self) -> dict[str, Any]:
        """The merged state (a collective: every rank calls it)."""
        return merged_state_dict(self.metrics)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a merged state (a collective: every rank calls it, each with the state)."""
        load_merged_state_dict(self.metrics, state_dict)


class _Chunk(Tensor):
    """A rank's rows of a global tensor for DCP, shaped as that tensor (zero strides) so DCP's planners ask it."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # plain results

    tv_data: Tensor
    tv_owner: "ShardedState"
    tv_key: str
    tv_offsets: tuple[int, ...] | None  # None: no rows, no chunk (it would share its offsets with the next rank's)
    tv_reads: bool  # this rank reads every chunk at load (the first of the group)
    tv_written: bool

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self.tv_written = True
        if self.tv_offsets is None:
            return []
        offsets, properties = torch.Size(self.tv_offsets), TensorProperties.create_from_tensor(self.tv_data)
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=self.tv_data.shape)
        data = TensorWriteData(chunk=chunk, properties=properties, size=torch.Size(self.shape))
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[Any]:
        raise TypeError(_PLANNER_MISSING)  # DCP's default load planner: it needs the saved sizes beforehand

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        if not self.tv_written:
            raise TypeError(_PLANNER_MISSING)
        return self.tv_data


class ShardedState:
    """A metric's or collection's state for ``torch.distributed.checkpoint``: each rank writes its own share.

    Args:
        metric_or_collection: what to save; load it with ``dcp.load(..., planner=sharded_load_planner())``.

    Raises:
        MergedStateError: a state cannot be merged; at load, on every rank, nothing loaded: another metric's header,
            a missing shard, a stock metric's checkpoint.

    Example:
        >>> from torchmetrics.aggregation import CatMetric
        >>> metric = CatMetric()
        >>> metric.update(torch.tensor([1.0, 2.0]))
        >>> sorted(ShardedState(metric).state_dict())  # dcp.save({"metrics": ShardedState(metrics)}, ...)
        ['blob', 'counts', 'format', 'header', 'm0s0']
    """

    def __init__(self, metric_or_collection: Any) -> None:
        _tree(metric_or_collection)
        self.metrics = metric_or_collection
        self._found: dict[str, set[tuple[int, int]]] = {}  # the planner's note: (first offset, rows) of each chunk
        self._read: dict[str, Tensor] = {}  # the tensors the planner had DCP read into

    def state_dict(self) -> dict[str, Any]:
        """Each rank's share of every state, as DCP saves it (a collective; DCP calls it to load too)."""
        where, description, leaves = _tree(self.metrics)
        sync_link = _link(leaves, where, saving=True)
        rank, size = (sync_link.rank, sync_link.size) if sync_link is not None else (0, 1)
        self._found, self._read = {}, {}
        # Each state's share, in a form that follows from its kind: "stack" (reduced: a row per rank), "rows" (`cat`
        # data; Python objects go in the blob) or "blob" (other lists). The ranks compare rows, dtype, shape, objects.
        shares: list[tuple[str, str, Tensor | None, Any, str]] = []
        compared: list[int] = []
        for i, (metric, kinds, place, _) in enumerate(leaves):
            for j, (name, kind) in enumerate(kinds.items()):
                form = "stack" if kind in _REDUCED else "rows" if kind.endswith("/cat") else "blob"
                value, rows, items = _local_value(metric, name, kind, copies=False), None, None
                if isinstance(value, Tensor):
                    rows = value.reshape(1, *value.shape) if form == "stack" else value.reshape(value.shape or (1,))
                    rows = rows if rows.shape[0] else None
                else:
                    items = (value if value[0] else None) if kind == _SCALAR_KIND else value or None
                text = f"{rows.dtype} {tuple(rows.shape[1:])}".encode() if rows is not None else b""
                count, code = (int(rows.shape[0]), zlib.crc32(text) & 0x7FFFFFFF) if rows is not None else (0, -1)
                shares.append((f"m{i}s{j}", form, rows, items, f"state `{name}` of {place}"))
                compared += [count, code, int(items is not None)]
        blob, failure, buffer = torch.empty(0, dtype=torch.uint8), 0, io.BytesIO()
        try:
            if items := {key: share_items for key, _, _, share_items, _ in shares if share_items is not None}:
                torch.save(items, buffer)
                blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        except Exception:  # an object pickle refuses: every rank raises below, naming this one
            failure = 1
        words = [failure, blob.numel(), *compared]
        table = _engine.agree(words, sync_link, "shares of a sharded state") if sync_link is not None else [words]
        if failing := [r for r, row in enumerate(table) if row[0]]:
            raise MergedStateError(
                f"Expected every list state of {where} to be picklable (each rank's lists are saved as one pickle) but"
                f" ranks {failing} hold an object that pickle refuses."
            )
        header = {"format": SHARDED_FORMAT, "version": VERSION, **description, "world_size": size}
        header.update(blob=[row[1] for row in table], rows={})
        out: dict[str, Any] = {}

        def chunk(key: str, data: Tensor, per_rank: Sequence[int], empty: bool = False) -> None:
            dims = (sum(per_rank), *data.shape[1:])  # the global tensor, whose ranks hold `per_rank` rows each
            made = Tensor._make_subclass(_Chunk, torch.zeros((), dtype=data.dtype).expand(*dims))
            made.tv_data, made.tv_owner, made.tv_key, made.tv_reads = data.detach(), self, key, rank == 0
            made.tv_offsets = None if empty else (sum(per_rank[:rank]),) + (0,) * (data.ndim - 1)
            made.tv_written, out[key] = False, made

        chunk(_FORMAT, torch.tensor([VERSION], dtype=torch.int64), [0] * rank + [1], rank != 0)
        chunk(_COUNTS, torch.tensor([[int(m._update_count) for m, *_ in leaves]], dtype=torch.int64), [1] * size)
        for s, (key, form, rows, _, what) in enumerate(shares):
            cells = [row[2 + 3 * s : 5 + 3 * s] for row in table]
            if form == "blob":
                continue
            if len({cell[1] for cell in cells if cell[1] != -1}) > 1:
                listing = ", ".join(f"rank {r}: {cell[0]} rows" for r, cell in enumerate(cells))
                dims = "shape" if form == "stack" else "dims after the first"
                raise MergedStateError(
                    f"Expected {what} to have the same dtype and {dims} on every rank (its shares form one global"
                    f" tensor) but the ranks hold different ones ({listing})."
                )
            per_rank = [cell[0] for cell in cells]
            objects = [r for r, cell in enumerate(cells) if form == "rows" and cell[2]]
            if objects and (tensors := [r for r, n in enumerate(per_rank) if n > 0]):
                raise MergedStateError(
                    f"Expected {what} to hold tensors on every rank or Python objects on every rank but ranks"
                    f" {tensors} hold tensors and ranks {objects} objects."
                )
            if form == "rows":
                header["rows"][key] = per_rank
            chunk(key, rows if rows is not None else torch.empty(0), per_rank, rows is None)
        chunk(_BLOB, blob, header["blob"], blob.numel() == 0)
        out[_HEADER] = json.dumps(header)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Check what DCP read on every rank, then give the first rank the global state (a collective)."""
        if not self._found:  # the planner notes every share it finds
            raise TypeError(_PLANNER_MISSING)
        where, description, leaves = _tree(self.metrics)
        sync_link = _link(leaves, where, saving=False)
        body = None
        try:
            header = json.loads(state_dict[_HEADER])
            problem = _check_header({"header": header}, description, SHARDED_FORMAT, where)
            problem = problem or self._check_chunks(header, leaves, where)
            if problem is None and (sync_link is None or sync_link.rank == 0):
                body = _nest(description, self._assemble(header, leaves))
                _load(leaves, body, apply=False)
        except MergedStateError as err:
            problem = str(err)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:  # not what it should be
            problem = f"Expected the saved shares of {where} to be what their header lists but got {err!r}."
        except Exception as err:  # a pickled share that does not load
            problem = f"Expected the saved shares of {where} to load but got {type(err).__name__}: {err}"
        self._read = {}  # the chunks read are in `body` now, or not needed
        _agree_or_raise(problem, sync_link, "a sharded state checked", where)
        _load(leaves, body, apply=True)

    def _check_chunks(self, header: Mapping[str, Any], leaves: Sequence[_Leaf], where: str) -> str | None:
        """Every chunk the header says was written is in the checkpoint, where it says: else name the missing one."""
        world, rows = int(header["world_size"]), header["rows"]
        expected = {_COUNTS: ("update counts", [1] * world), _FORMAT: ("format version", [1])}
        for i, (_, kinds, place, _) in enumerate(leaves):
            for j, (name, kind) in enumerate(kinds.items()):
                if kind in _REDUCED or f"m{i}s{j}" in rows:  # reduced: a row per rank; `cat` rows: below
                    expected[f"m{i}s{j}"] = (f"state `{name}` of {place}", [1] * world)
        for key, per_rank in [*rows.items(), (_BLOB, header["blob"])]:
            expected[key] = (expected[key][0] if key in expected else "its pickled lists", per_rank)
        for key, (what, per_rank) in expected.items():
            for rank, (start, length) in enumerate(zip([0, *accumulate(per_rank)], map(int, per_rank))):
                if length and (start, length) not in self._found.get(key, ()):
                    return (
                        f"Expected the checkpoint to hold every saved rank's share of {where} but the share of rank"
                        f" {rank} of {world} ({what}: {length} rows from row {start}) is missing: a shard was lost, or"
                        " the checkpoint was written by another save."
                    )
        return None

    def _assemble(self, header: Mapping[str, Any], leaves: Sequence[_Leaf]) -> Iterator[dict[str, Any]]:
        """The global state of each metric from the chunks the first rank read: as `merged_state_dict` builds it."""
        counts, data = self._read[_COUNTS].sum(0).tolist(), self._read.get(_BLOB, torch.empty(0, dtype=torch.uint8))
        # A checkpoint is trusted as any torch.load(weights_only=False) of one: these are the job's own pickles.
        load = functools.partial(torch.load, map_location="cpu", weights_only=False)
        ends = [0, *accumulate(header["blob"])]
        blobs = [load(io.BytesIO(data[a:b].numpy().tobytes())) if b > a else {} for a, b in pairwise(ends)]
        for i, (_, kinds, place, _) in enumerate(leaves):
            states: dict[str, Any] = {}
            for j, (name, kind) in enumerate(kinds.items()):
                key = f"m{i}s{j}"
                parts = [blob[key] for blob in blobs if key in blob]
                if kind == _SCALAR_KIND:
                    columns = (torch.cat([p[n] for p in parts]) if parts else torch.zeros(0) for n in (1, 2, 3))
                    states[name] = _merged_scalars(place, [k for part in parts for k in part[0]], *columns)
                elif kind in _REDUCED:
                    states[name] = _REDUCED[kind](self._read[key])
                elif key in self._read:  # rows of `cat` data
                    states[name] = self._read[key]
                elif parts:  # lists kept item by item, or Python objects
                    states[name] = [item for part in parts for item in part]
                else:
                    states[name] = torch.empty(0) if kind == "tensor/cat" else []
            yield {"states": states, "update_count": int(counts[i])}


def _resolve_shares(node: dict[Any, Any], metadata: Any, prefix: str = "") -> None:
    """Replace every ShardedState share in a state dict before DCP plans the load (see `sharded_load_planner`)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    saved = metadata.state_dict_metadata
    for key, value in list(node.items()):
        if isinstance(value, dict):
            _resolve_shares(value, metadata, f"{prefix}{key}.")
        if not isinstance(value, _Chunk):
            continue
        owner, at = value.tv_owner, f"{prefix}{key}"[: -len(value.tv_key)]
        if not isinstance(saved.get(at + _HEADER), BytesStorageMetadata):
            under = sorted(name for name in saved if name.startswith(at))
            raise MergedStateError(
                f"Expected a sharded state of {_tree(owner.metrics)[0]} (saved with torchmetrics_varlen.ShardedState)"
                f" under `{at.rstrip('.')}` but the checkpoint holds {under[:8] or 'nothing there'}: a stock"
                " metric's `state_dict()` holds each rank's persistent states under one key, of which DCP keeps one"
                " rank's copy, so it cannot be loaded exactly. Save with ShardedState."
            )
        stored = saved.get(f"{prefix}{key}")
        stored = stored if isinstance(stored, TensorStorageMetadata) else None
        owner._found[value.tv_key] = {(c.offsets[0], c.sizes[0]) for c in getattr(stored, "chunks", []) if c.offsets}
        if stored is not None and value.tv_reads:
            owner._read[value.tv_key] = node[key] = torch.empty(stored.size, dtype=stored.properties.dtype)
        else:
            del node[key]  # nothing to read on this rank


def sharded_load_planner(**kwargs: Any) -> Any:
    """A ``DefaultLoadPlanner`` for ``dcp.load`` that first sizes each :class:`ShardedState` share from the checkpoint.

    Args:
        kwargs: keyword arguments of ``DefaultLoadPlanner`` (``flatten_state_dict``, ``allow_partial_load``, ...).

    Returns:
        A ``torch.distributed.checkpoint.DefaultLoadPlanner`` (a subclass made for this call).

    Example:
        >>> from torch.distributed.checkpoint import DefaultLoadPlanner
        >>> isinstance(sharded_load_planner(), DefaultLoadPlanner)  # dcp.load(state, planner=sharded_load_planner())
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
