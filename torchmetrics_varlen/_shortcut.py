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

import threading
import weakref
from collections.abc import Sequence
from typing import Any

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
SHORTCUTS_KEPT = 256


class Shortcut:
    """What one repeated sync of some metrics checks, sends and reduces, learnt from a sync that went the long way."""

    def __init__(
        self,
        metrics: Sequence[StockMetric],
        keys: list[tuple[int, str]],
        reductions: list[Any],
        group: Any,
        policy: _policy.TransportPolicy,
        cap: int,
        template: Template,
        world_size: int,
        what: str,
    ) -> None:
        self.owners = tuple(weakref.ref(metric) for metric in metrics)
        self.signature = tuple((type(metric), tuple(metric._reductions.items())) for metric in metrics)
        self.keys = keys
        self.group = group  # as the caller passes it (None: the world, checked by identity below)
        self.world = weakref.ref(torch.distributed.group.WORLD) if group is None else None
        self.policy, self.cap, self.template, self.what = policy, cap, template, what
        self.device = next((m.device for m in metrics if m.device.type != "cpu"), _CPU)  # `metrics_device`
        self.facts = _policy.changing_facts()  # with the group and the device: the policy
        self.length = _transport.record_length(group)
        self.kinds = template.kinds
        self.expect = [(dtype, shape, False) for dtype, shape in self.kinds]  # dtype, shape, requires_grad
        self.lock = threading.Lock()  # one sync at a time uses the kept buffers
        self.forget: Any = None  # the finalizer that drops this shortcut with its first metric
        described = self.described = len(template.prefix)
        self.needed = int(template.prefix[_protocol.H_WORDS])  # this rank's record length, header included
        groups, _ = _protocol.inline_layout(tuple((dtype, shape.numel()) for dtype, shape in self.kinds))
        start = 8 * described  # a record's data follows its header and slots
        # Per dtype group: its entries, whether they share one shape (stacked) or not (flattened and joined), and
        # the bytes of the record they are copied into.
        self.packs = [
            (
                group.indices,
                len({self.kinds[i][1] for i in group.indices}) == 1,
                group.dtype,
                start + group.start,
                start + group.start + group.nbytes,
            )
            for group in groups
        ]
        # Integer sum groups, one sum each: entries, numpy dtype, data bytes, and [entries, *shape] where they share one
        self.sums: list[tuple[list[int], Any, int, int, tuple[int, ...] | None]] = []
        self.each: list[tuple[int, Any, int, int, tuple[int, ...], Any]] = []  # the others: their own reduction
        for group in groups:
            cuts = [cut for cut in template.cuts if cut[0] in group.indices]
            if group.dtype in _INTEGERS and all(reductions[i] is dim_zero_sum for i in group.indices):
                shapes = {self.kinds[i][1] for i in group.indices}
                stacked = (len(group.indices), *self.kinds[group.indices[0]][1]) if len(shapes) == 1 else None
                self.sums.append((group.indices, cuts[0][1], cuts[0][2], cuts[-1][3], stacked))
            else:
                self.each += [(i, dtype, a, b, shape, reductions[i]) for i, dtype, a, b, shape in cuts]
        self.world_size = world_size
        self._allocate(_transport.INITIAL_WORDS, list(template.prefix))

    def _allocate(self, words: int, record: Sequence[int]) -> None:
        """The send buffer and the table at the group's record length ``words``, with ``record``'s words in."""
        self.words = words = max(words, self.needed)
        self.send = torch.zeros(words, dtype=torch.int64)
        self.send[: len(record)] = torch.tensor(record, dtype=torch.int64)
        data = self.send.view(torch.uint8)
        self.outs = []  # per pack: the record's bytes of its group, viewed as the group's entries
        for indices, same_shape, dtype, start, stop in self.packs:
            out = data[start:stop].view(dtype)
            self.outs.append(out.view(len(indices), *self.kinds[indices[0]][1]) if same_shape else out)
        self.send_words = self.send[:words]
        self.table = torch.empty(self.world_size * words, dtype=torch.int64)
        self.rows = self.table.numpy().reshape(self.world_size, words)

    def run(self, metrics: Sequence[StockMetric], group: Any, timeout: float | None, cap: int | None) -> Any:
        """The synced states (one dict per metric), the record and table for the long way, or None: not applicable.

        None is decided before any collective: the caller then syncs the long way from the start.
        """
        if not self.lock.acquire(blocking=False):
            return None
        try:
            return self._run(metrics, group, timeout, cap)
        finally:
            self.lock.release()

    def _run(self, metrics: Sequence[StockMetric], group: Any, timeout: float | None, cap: int | None) -> Any:
        states = self._states(metrics, group, cap)
        if states is None:
            return None
        try:
            for (indices, same_shape, _, _, _), out in zip(self.packs, self.outs):
                if same_shape:
                    torch.stack([states[i] for i in indices], out=out)
                else:
                    torch.cat([states[i].reshape(-1) for i in indices], out=out)
        except (RuntimeError, TypeError):  # a state on another device, sparse, ...: nothing was sent yet
            return None
        length, words = _transport.begin_exchange(group, self.length)
        policy = self.policy
        if words < self.needed:  # the group's length shrank below this record: the long way's two exchanges
            record = self.send.numpy()[: self.needed].tolist()
            table = _transport._exchange_at(record, words, group, _CPU, policy.wait, timeout, self.what)
            return record, _transport.settle(table, record, length, words, group, _CPU, policy.wait, timeout, self.what)
        if words != self.words:
            self._allocate(words, self.send[: self.needed].tolist())
        _transport.exchange_prepared(self.send_words, self.table, group, policy.wait, timeout, self.what, _nothing)
        rows = self.rows
        if rows[:, : self.described].tobytes() != self.template.table:
            record = self.send.numpy()[: self.needed].tolist()
            table = self.table.view(self.world_size, words).clone()  # the long way's results may view it
            return record, _transport.settle(table, record, length, words, group, _CPU, policy.wait, timeout, self.what)
        _transport.saw(length, self.needed)  # what `settle` records for a table of the learnt headers
        return self._reduce(metrics, rows)

    def _states(self, metrics: Sequence[StockMetric], group: Any, cap: int | None) -> list[Tensor] | None:
        """The metrics' states where this sync is the learnt one, else None."""
        if group is not self.group or (self.world is not None and self.world() is not torch.distributed.group.WORLD):
            return None
        for owner, metric, (cls, items) in zip(self.owners, metrics, self.signature):
            if owner() is not metric or type(metric) is not cls or tuple(metric._reductions.items()) != items:
                return None
        if cap is None:
            cap = min((c for metric in metrics if (c := getattr(metric, "sync_cap", None)) is not None), default=None)
        if (cap if cap is not None else _cap.resolve_cap()) != self.cap:
            return None
        device = next((m.device for m in metrics if m.device.type != "cpu"), _CPU)
        if device != self.device or _policy.changing_facts() != self.facts:
            return None
        try:
            states = [vars(metrics[index])[name] for index, name in self.keys]
            # dtype, shape and autograd as learnt; the copy into the record refuses the rest (other devices, layouts)
            if [(state.dtype, state.shape, state.requires_grad) for state in states] != self.expect:
                return None
        except (KeyError, AttributeError):  # a state kept elsewhere, or a list
            return None
        if len({id(state) for state in states}) != len(states):  # a shared object is a reference on the long way
            return None
        return states  # type: ignore[no-any-return]

    def _reduce(self, metrics: Sequence[StockMetric], rows: Any) -> list[StateDict]:
        data = rows[:, self.described :].view("u1")
        values: list[Any] = [None] * len(self.keys)
        for indices, dtype, start, stop, stacked in self.sums:
            summed = torch.from_numpy(data[:, start:stop].view(dtype)).sum(0)
            if stacked is not None:
                parts: Sequence[Tensor] = summed.view(stacked).unbind()
            else:
                numels = [self.kinds[i][1].numel() for i in indices]
                parts = [part.view(self.kinds[i][1]) for part, i in zip(summed.split_with_sizes(numels), indices)]
            for index, part in zip(indices, parts):
                values[index] = part
        for index, dtype, start, stop, shape, reduction in self.each:
            values[index] = reduction(torch.from_numpy(data[:, start:stop].view(dtype).reshape(shape)))
        out: list[StateDict] = [{} for _ in metrics]
        for (index, name), value in zip(self.keys, values):
            out[index][name] = value
        return out


def _nothing() -> None:
    return None


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
