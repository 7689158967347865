"""A repeated small sync of the same metrics, learnt: their states in, their synced states out, one collective.

A metric synced at every step (``dist_sync_on_step``, ``forward``, a ``compute()`` per batch) sends the same few
small dense states each time; only their values change. The engine already learns such a sync's record and plan
(:mod:`torchmetrics_varlen._repeat`). What is left of its cost is the Python around them, and right after a collective
woke the process every operation costs several times what it costs warm. So a sync of the same metrics, with the same
states, dtypes and shapes, the same settings and the same group is done here with the least work:

* **before the collective**: the states checked against what was learnt, their values copied into the learnt record
  (one copy per dtype), the records exchanged into a table kept between syncs;
* **after it**: every rank's header and slots compared byte for byte with the learnt ones. The plan is made from
  exactly those bytes, so equal bytes mean the learnt plan on every rank. Then each state is reduced as stock reduces
  the gathered states: one sum per dtype for integer sum states (integer sums are exact in any order, and the sum
  of an integer dtype is ``int64`` either way), the state's own reduction for the others.

Every rank compares the same table, so every rank takes the same branch; on any difference the sync goes on the long
way from that table (:func:`torchmetrics_varlen._engine.run` with ``exchanged``). What travels is what the long way
sends (the record ``describe`` makes: tests compare them), so ranks on either path sync together.

Learnt only where that is safe: CPU exchange buffers (gloo), no autograd graph, no ``mean`` state (its update count is
in the record and changes at every step), reductions whose results are fresh tensors (sum, max, min: the kept table
is overwritten by the next sync), no state object shared by two entries.
"""

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum

from torchmetrics_varlen import _cap, _engine, _policy, _protocol, _transport
from torchmetrics_varlen._repeat import Template

StateDict = dict[str, Any]
Exchanged = tuple[list[int], Tensor]  # this rank's record and the exchanged table, for the long way
_FRESH = (dim_zero_sum, dim_zero_max, dim_zero_min)  # reductions whose result never views their input
_INTEGERS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_CPU = torch.device("cpu")
_INT64 = np.dtype(np.int64)
SHORTCUTS_KEPT = 256


class Shortcut:
    """What one repeated sync of some metrics checks, sends and reduces, learnt from a sync that went the long way.

    Everything a sync would work out again is worked out here once: the checks compare with kept values, the copy
    and the reductions run on views of the kept record and table. Right after a collective every operation costs
    several times what it costs warm, so the fewer there are the better.
    """

    def __init__(
        self,
        metrics: Sequence[StockMetric],
        keys: list[tuple[int, str]],
        reductions: list[Any],
        group: Any,
        policy: _policy.TransportPolicy,
        cap: int,
        settings: tuple[Any, ...],
        template: Template,
        world_size: int,
        what: str,
    ) -> None:
        # Per metric: itself (weakly), its class, reductions and device, as they were learnt
        self.learnt = tuple(
            (weakref.ref(metric), type(metric), dict(metric._reductions), metric.device) for metric in metrics
        )
        self.keys, self.count = keys, len(metrics)
        self.group = group  # as the caller passes it (None: the world, checked by identity below)
        self.world = weakref.ref(torch.distributed.group.WORLD) if group is None else None
        self.options = _transport.gather_options()  # the exchange's, made once
        self.policy, self.cap, self.template, self.what = policy, cap, template, what
        self.settings = settings  # with the group and the devices: the cap and the policy (see `_settings`)
        self.length = _transport.record_length(group)
        self.limits: tuple[float | None, Any] = (None, None)  # the last `sync_timeout` and its limits
        self.kinds = template.kinds
        self.expect = list(self.kinds)  # each state's dtype and shape
        self.graphs = [i for i, (dtype, _) in enumerate(self.kinds) if dtype.is_floating_point or dtype.is_complex]
        self.lock = threading.Lock()  # one sync at a time uses the kept buffers
        self.forget: Any = None  # the finalizer that drops this shortcut with its first metric
        described = self.described = len(template.prefix)
        self.needed = int(template.prefix[_protocol.H_WORDS])  # this rank's record length, header included
        groups, _ = _protocol.inline_layout(tuple((dtype, shape.numel()) for dtype, shape in self.kinds))
        start = 8 * described  # a record's data follows its header and slots
        # Per dtype group: its entries, how they are copied into the record, and the record's bytes they go to.
        # Integer scalars are written as Python ints into a numpy view (the cheapest copy right after a collective),
        # entries of one shape are stacked, the others flattened and joined.
        self.packs = []
        for group in groups:
            shapes = {self.kinds[i][1] for i in group.indices}
            how = (
                "ints"
                if group.dtype in _INTEGERS and all(shape.numel() == 1 for shape in shapes)
                else "stack"
                if len(shapes) == 1
                else "cat"
            )
            self.packs.append(
                (group.indices, how, group.dtype, start + group.start, start + group.start + group.nbytes)
            )
        # Integer sum groups, one sum each: entries, dtype, data bytes, and where their results come from
        self.sums: list[tuple[list[int], torch.dtype, int, int, _FreshSums]] = []
        self.each: list[tuple[int, torch.dtype, int, int, tuple[int, ...], Any]] = []  # the others: own reduction
        for group in groups:
            cuts = [cut for cut in template.cuts if cut[0] in group.indices]
            if group.dtype in _INTEGERS and all(reductions[i] is dim_zero_sum for i in group.indices):
                fresh = _FreshSums([self.kinds[i][1] for i in group.indices], [keys[i] for i in group.indices])
                self.sums.append((group.indices, group.dtype, cuts[0][2], cuts[-1][3], fresh))
            else:
                self.each += [(i, group.dtype, a, b, shape, reductions[i]) for i, _, a, b, shape in cuts]
        self.fresh = [fresh for _, _, _, _, fresh in self.sums]
        self.world_size = world_size
        self._allocate(_transport.INITIAL_WORDS, list(template.prefix))

    def _allocate(self, words: int, record: Sequence[int]) -> None:
        """The send buffer and the table at the group's record length ``words``, with ``record``'s words in."""
        self.words = words = max(words, self.needed)
        self.send = torch.zeros(words, dtype=torch.int64)
        self.send[: len(record)] = torch.tensor(record, dtype=torch.int64)
        data = self.send.view(torch.uint8)
        self.outs: list[Any] = []  # per pack: the record's bytes of its group, viewed as the group's entries
        for indices, how, dtype, start, stop in self.packs:
            out = data[start:stop].view(dtype)
            if how == "ints":
                self.outs.append(out.numpy())
            else:
                self.outs.append(out.view(len(indices), *self.kinds[indices[0]][1]) if how == "stack" else out)
        self.send_words = self.send[:words]
        self.table = torch.empty(self.world_size * words, dtype=torch.int64)
        self.rows = self.table.numpy().reshape(self.world_size, words)
        self.heads = self.rows[:, : self.described]  # every rank's header and slots, compared with the learnt ones
        # Every rank's data, viewed per reduction: [world_size, ...] for each sum group and each other entry
        table = self.table.view(self.world_size, words).view(torch.uint8)[:, 8 * self.described :]
        raw = self.rows.view("u1")[:, 8 * self.described :]  # numpy: a cold sum costs less there than in torch
        # With two ranks an int64 sum is one add (cheaper right after a collective than a reduce), else a reduce
        self.summed = [
            (self.world_size == 2 and dtype == torch.int64, raw[:, start:stop].view(_protocol.NUMPY_DTYPES[dtype]))
            for _, dtype, start, stop, _ in self.sums
        ]
        self.reduced = [
            (index, table[:, start:stop].view(dtype).view(shape), reduction)
            for index, dtype, start, stop, shape, reduction in self.each
        ]

    def run(self, metrics: Sequence[StockMetric], group: Any, timeout: float | None, cap: int | None) -> Any:
        """The synced states (one dict per metric), the record and table for the long way, or None: not applicable.

        None is decided before any collective: the caller then syncs the long way from the start. One function of
        plain loops: right after a collective every call and comprehension costs a few microseconds.
        """
        if not self.lock.acquire(blocking=False):
            return None
        try:
            states = self._states(metrics, group, cap)
            if states is None:
                return None
            try:  # into the record; nothing was sent yet if a state cannot be copied from (a device, sparse, ...)
                for (indices, how, _, _, _), out in zip(self.packs, self.outs):
                    if how == "ints":
                        out[:] = [int(states[i]) for i in indices]
                    elif how == "stack":
                        torch.stack([states[i] for i in indices], out=out)
                    else:
                        torch.cat([states[i].reshape(-1) for i in indices], out=out)
            except (RuntimeError, TypeError, ValueError):
                return None
            seen, limits = self.limits
            if limits is None or seen != timeout:
                limits = _transport.limits_of(timeout, group, self.policy.wait)
                self.limits = (timeout, limits)
            # Only the records' length is worked out before they go: the rest of a sync's start runs in flight
            length = self.length
            words, _ = length.next_sync()
            wait = self.policy.wait
            if words != self.words:  # the group's length changed since these buffers were made
                if words < self.needed:  # below this record: the long way's two exchanges
                    return self._shrunk(words, length, group, timeout)
                self._allocate(words, self.send[: self.needed].tolist())
            # The results' tensors are made while the records travel
            pg = group if self.world is None else self.world()  # the world: checked alive and current in `_states`
            out, sums = _transport.exchange_prepared(
                self.send_words, self.table, group, wait, timeout, self.what, limits, self._fresh, (pg, self.options)
            )
            if self.heads.tobytes() != self.template.table:
                record = self.send.numpy()[: self.needed].tolist()
                table = self.table.view(self.world_size, words).clone()  # the long way's results may view it
                return record, _transport.settle(table, record, length, words, group, _CPU, wait, timeout, self.what)
            length.saw(self.needed)  # what `settle` records for a table of the learnt headers
            # Each state reduced over every rank's values in the table, as stock reduces the gathered states
            for (pair, gathered), summed in zip(self.summed, sums):  # exact: integer sums wrap alike in any order
                if pair:
                    np.add(gathered[0], gathered[1], summed)
                else:
                    np.add.reduce(gathered, 0, _INT64, summed)
            keys = self.keys
            for index, each, reduction in self.reduced:
                metric, name = keys[index]
                out[metric][name] = reduction(each)
            return out
        finally:
            self.lock.release()

    def _shrunk(self, words: int, length: Any, group: Any, timeout: float | None) -> Exchanged:
        """The record and table for the long way, where the group's length (``words``) is below this record's."""
        record = self.send.numpy()[: self.needed].tolist()
        wait = self.policy.wait
        table = _transport._exchange_at(record, words, group, _CPU, wait, timeout, self.what)
        return record, _transport.settle(table, record, length, words, group, _CPU, wait, timeout, self.what)

    def _states(self, metrics: Sequence[StockMetric], group: Any, cap: int | None) -> list[Tensor] | None:
        """The metrics' states where this sync is the learnt one, else None.

        Written as plain loops: right after a collective every call and comprehension costs a few microseconds.
        """
        if group is not self.group or (self.world is not None and self.world() is not torch.distributed.group.WORLD):
            return None
        attrs = []
        for (owner, cls, reductions, device), metric in zip(self.learnt, metrics):
            attr = vars(metric)
            if owner() is not metric or type(metric) is not cls or attr.get("_reductions") != reductions:
                return None
            if metric.device != device:
                return None
            attrs.append(attr)
        if _settings(attrs, cap) != self.settings:
            return None
        states = []
        try:
            # dtype and shape as learnt, and no graph; the copy into the record refuses what it cannot copy from
            # (a layout, or a device for a stack): the long way then. Two entries holding one tensor are two
            # entries here, as with stock's sync.
            for (index, name), kind in zip(self.keys, self.expect):
                state = attrs[index][name]
                if (state.dtype, state.shape) != kind:
                    return None
                states.append(state)
            for index in self.graphs:  # a graph makes the long way's record another one (FLAG_GRAD)
                if states[index].requires_grad:
                    return None
        except (KeyError, AttributeError):  # a state kept elsewhere, or a list
            return None
        return states

    def _fresh(self) -> tuple[list[StateDict], list[Any]]:
        """The synced states' dicts with fresh tensors for the integer sums, to be summed into; made in flight."""
        out: list[StateDict] = [{}] if self.count == 1 else [{} for _ in range(self.count)]
        sums = []
        for fresh in self.fresh:
            summed, parts = fresh.ready.pop() if fresh.ready else fresh.take()
            for metric, states in parts:
                out[metric].update(states)
            sums.append(summed)
        return out, sums


class _FreshSums:
    """Fresh int64 tensors for the results of one integer sum group, made in batches.

    Every sync hands out new tensors, as stock does: a metric may keep its synced states (``compute`` returning one),
    and the next sync must not change them. Making them costs several tensor operations right after a collective;
    made a batch at a time, a sync takes its results from the batch (at most ``BATCH_BYTES`` of storage, which a
    synced state that is kept keeps alive).
    """

    BATCH_ROWS, BATCH_BYTES = 64, 8192

    def __init__(self, shapes: list[torch.Size], keys: list[tuple[int, str]]) -> None:
        self.shapes, self.keys = shapes, keys  # the entries' shapes, and their (metric index, state name)
        self.numels = [shape.numel() for shape in shapes]
        self.numel = sum(self.numels)
        self.rows = max(1, min(self.BATCH_ROWS, self.BATCH_BYTES // max(8 * self.numel, 1)))
        self.ready: list[tuple[Any, list[tuple[int, StateDict]]]] = []

    def take(self) -> tuple[Any, list[tuple[int, StateDict]]]:
        """The numpy view of a fresh sum (int64, for every integer dtype, as stock's sum) and its entries' tensors.

        The tensors come as ``(metric index, {state name: tensor})`` pairs: a sync adds each dict to its metric's.
        """
        if not self.ready:
            self.ready = self._make()
        return self.ready.pop()

    def _make(self) -> list[tuple[Any, list[tuple[int, StateDict]]]]:
        block = torch.empty(self.rows, self.numel, dtype=torch.int64)
        count = len(self.shapes)
        if len(set(self.shapes)) == 1:  # one shape: every entry of the batch in one unbind
            each = block.view(self.rows * count, *self.shapes[0]).unbind()
            parts: list[Sequence[Tensor]] = [each[row * count : (row + 1) * count] for row in range(self.rows)]
        else:
            parts = [
                [part.view(shape) for part, shape in zip(row.split_with_sizes(self.numels), self.shapes)]
                for row in block.unbind()
            ]
        made = []
        for summed, tensors in zip(block.numpy(), parts):
            per_metric: dict[int, StateDict] = {}
            for (metric, name), tensor in zip(self.keys, tensors):
                per_metric.setdefault(metric, {})[name] = tensor
            made.append((summed, list(per_metric.items())))
        return made[::-1]


# The environment variables a sync's record depends on, and their names as os.environ keeps them on POSIX
_WATCHED = (_policy.REDUCE_ENV, _cap.SYNC_CAP_ENV)
_WATCHED_KEYS = tuple(os.fsencode(name) for name in _WATCHED)
# On POSIX, the dict of encoded names and values that setting or deleting through ``os.environ`` writes (the same
# object for as long as ``os.environ`` is not rebound); elsewhere, or if it is not there, None: ``os.environ.get``.
_OS_ENVIRON = os.environ
_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENVIRON = _ENVIRON if type(_ENVIRON) is dict else None


def _settings(attrs: Sequence[dict[str, Any]], cap: int | None) -> tuple[Any, ...]:
    """What a sync's cap and policy are decided from besides the group and the devices.

    ``attrs``: the metrics' attribute dicts. The cap given (a collection's) or the metrics' smallest ``sync_cap``,
    the forced policy, and the raw values of the environment variables (None where unset), read where setting or
    deleting through ``os.environ`` lands. On POSIX that is the dict of encoded names and values ``os.environ`` keeps:
    one lookup each, where ``os.environ.get`` encodes and decodes in Python (several microseconds right after a
    collective). Elsewhere, or if that dict is not there, ``os.environ.get``. Equal settings decide alike.
    """
    if cap is None:
        for attr in attrs:
            own = attr.get("sync_cap")
            if own is not None and (cap is None or own < cap):
                cap = own
    if os.environ is _OS_ENVIRON and _ENVIRON is not None:
        return cap, _policy.forced_policy(), _ENVIRON.get(_WATCHED_KEYS[0]), _ENVIRON.get(_WATCHED_KEYS[1])
    return cap, _policy.forced_policy(), os.environ.get(_WATCHED[0]), os.environ.get(_WATCHED[1])


_SHORTCUTS: dict[tuple[int, int, str], Shortcut] = {}
_LOCK = threading.RLock()  # a finalizer may run (garbage collection) while `learn` holds it


def lookup(metrics: Sequence[StockMetric], label: str) -> Shortcut | None:
    """The shortcut learnt for a sync of ``metrics`` labelled ``label``, if any (its run checks the rest)."""
    return _SHORTCUTS.get((id(metrics[0]), len(metrics), label))


def learn(
    metrics: Sequence[StockMetric],
    layout: Any,
    group: Any,
    cap: int | None,
    synced: "_engine.Synced",
    label: str,
) -> None:
    """Keep a shortcut for the next sync of ``metrics`` after a long-way sync that learnt a template, where safe."""
    template = synced.template
    if template is None or not synced.plan.inline or layout.graph:
        return
    if any(fn not in _FRESH for fn in layout.reductions) or len(template.kinds) != len(layout.keys):
        return
    if template.prefix[_protocol.H_FLAGS] & (_protocol.FLAG_DIFF | _protocol.FLAG_GRAD):
        return
    policy = _policy.policy_for(group, layout.device, _CPU)
    if policy.device.type != "cpu":  # NCCL exchanges records on the GPU: the long way
        return
    cap = cap if cap is not None else layout.cap
    resolved = cap if cap is not None else _cap.resolve_cap()
    if resolved != int(template.prefix[_protocol.H_CAP]):
        return
    shortcut = Shortcut(
        metrics,
        layout.keys,
        layout.reductions,
        group,
        policy,
        resolved,
        _settings([vars(metric) for metric in metrics], cap),
        template,
        synced.plan.world_size,
        f"sync of {label}",
    )
    key = (id(metrics[0]), len(metrics), label)
    with _LOCK:
        old = _SHORTCUTS.pop(key, None)
        if old is not None:
            old.forget.detach()  # its metric lives on: only one finalizer per kept shortcut
        elif len(_SHORTCUTS) >= SHORTCUTS_KEPT:
            _SHORTCUTS.pop(next(iter(_SHORTCUTS))).forget.detach()  # the oldest
        _SHORTCUTS[key] = shortcut
    # Keyed by the first metric's id: forgotten when it is collected, before another object can take that id.
    shortcut.forget = weakref.finalize(metrics[0], _forget, key, shortcut)


def _forget(key: tuple[int, int, str], shortcut: Shortcut) -> None:
    with _LOCK:
        if _SHORTCUTS.get(key) is shortcut:
            del _SHORTCUTS[key]
