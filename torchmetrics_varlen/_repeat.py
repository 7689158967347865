"""The one fast path: a repeated small sync of the same metrics re-sends its learnt record and reuses its plan.

A per-step metric (``dist_sync_on_step``, ``forward``, a ``compute()`` per batch) syncs the same few small dense
states at every step: every rank sends the same header and slots each time, and only the data words after them
change. The first such sync goes the long way and :func:`learn` keeps what it made. The next one, in three steps:

1. **Guard** (this rank's facts, before any collective): the same metric classes and phase, label, group, policy and
   transfer cap as learnt, and every state a tensor with the learnt dtype, shape and device, carrying no graph.
   From these facts ``_protocol.describe`` makes the learnt header and slots, byte for byte.
2. **Handle a subset**: the record is the learnt header and slots followed by this sync's data words, laid out by
   ``_protocol.inline_data`` (what ``describe`` calls for them). It is exchanged as the long way exchanges it. When
   every rank's header and slots in the table are byte for byte the learnt table, the learnt plan is the plan on
   every rank: each state's result is cut out of the table (:func:`sync`).
3. **Hand off**: a rank that fails the guard goes the long way and sends the same bytes; a table that differs goes on
   the long way from that table (``_engine.Request.exchanged``). Every rank sees the same table, so every rank
   decides alike, and the collectives are the same on both ways.

Deleting this module and its call sites in ``_state_sync`` changes no result: ``TORCHMETRICS_VARLEN_FAST_PATH=0``
switches it off, and a test runs the core of the suite so. The check is an exact comparison of the bytes the plan is
made from, never a hash. It serves states on the CPU (their data in the host record) and small states on an
accelerator (their data in a device record, :mod:`torchmetrics_varlen._device_record`) alike. Not learnt:
differentiable syncs, syncs to one rank, ``mean`` states (their update count is in the slots and changes at every
step), one state object held twice.
"""

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen import _caches, _device_record, _engine, _policy, _protocol, _transport
from torchmetrics_varlen._buffers import Result
from torchmetrics_varlen._engine import Exchanged
from torchmetrics_varlen._plan import Plan

TEMPLATES_KEPT = 64  # a job syncs a handful of small metrics per step; more than this is no repeated sync
Settings = tuple[_policy.TransportPolicy, int]  # the policy and the transfer cap (the header's flags follow from both)


@dataclass(frozen=True)
class Template:
    """What a repeated sync of some metrics sends and gets, learnt from a sync that went the long way."""

    classes: object  # the metrics' class layout (``_state_sync``), held so that its id in the key is not reused
    group: "weakref.ref[Any]"  # the process group, weakly: a destroyed group's template is never taken
    settings: Settings
    states: tuple[tuple[torch.dtype, torch.Size], ...]  # each state's dtype and shape, as learnt
    device: torch.device  # where the states live
    device_record: bool  # their data rode in a device record (``_device_record``), else in the host record
    prefix: list[int]  # this rank's header and slots (``describe``'s)
    inline: tuple[list[_protocol.DenseGroup], int]  # where each state's bytes go in the data words, and their total
    table: bytes  # every rank's header and slots in the table the plan was made from
    plan: Plan


Key = tuple[int, str, int]  # id of the class layout, label, id of the group
# Why a process-global table: the plan of a repeated sync is the same for every metric object with the same key.
_TEMPLATES: dict[Key, Template] = {}
_LOCK = threading.Lock()  # the Join worker thread syncs while the main thread may
_caches.register("_repeat._TEMPLATES: the learnt records and plans of repeated small syncs", _TEMPLATES.clear)
ENABLED = os.environ.get("TORCHMETRICS_VARLEN_FAST_PATH", "1").strip() != "0"  # read once: a debugging switch


def _group_object(group: Any) -> Any:
    return group if group is not None else torch.distributed.group.WORLD


def lookup(
    classes: object, label: str, group: Any, settings: Callable[[], Settings], states: Sequence[Any]
) -> Template | None:
    """The template of a sync of ``states`` with these facts, if one was learnt and the states pass the guard.

    ``settings`` gives this sync's policy and cap: asked only where a template was learnt (the long way asks the
    policy itself).
    """
    if not ENABLED:
        return None
    pg = _group_object(group)
    template = _TEMPLATES.get((id(classes), label, id(pg)))
    if template is None or template.group() is not pg or template.settings != settings():
        return None
    device = template.device
    for state, (dtype, shape) in zip(states, template.states):
        if not isinstance(state, Tensor) or state.dtype != dtype or state.shape != shape or state.device != device:
            return None
        if state.requires_grad or state.layout != torch.strided:
            return None
    if len({id(state) for state in states}) != len(states):  # a state object held twice travels once, as a Ref
        return None
    return template


def sync(
    template: Template, states: Sequence[Tensor], group: Any, timeout: float | None, what: str
) -> list[Result | None] | Exchanged | None:
    """Sync ``states`` by ``template``: every state's result, or what was exchanged when the table was not the learnt.

    One collective, the metadata exchange (two when a rank's record outgrew the group's agreed record length, as on
    the long way). None where a state's bytes cannot be laid out: nothing was exchanged, and the caller goes the long
    way, which finds the same.
    """
    record = _record(template, states)
    if record is None:
        return None
    policy = template.settings[0]
    table = _transport.exchange_records(record, group, policy.device, policy.wait, timeout, what)
    meta_words = len(template.prefix)
    words = table.numpy()
    if words.shape[1] < meta_words or words[:, :meta_words].tobytes() != template.table:
        return Exchanged(record, table)
    return _engine.inline_results(record, table, meta_words, template.plan, policy.device)


def _record(template: Template, states: Sequence[Tensor]) -> list[int] | None:
    """The learnt header and slots with this sync's data: the words ``describe`` (or ``_device_record``) would send."""
    if template.device_record:
        tail = _device_record.data_words(states)
        return None if tail is None else _device_record.DeviceRecord(template.prefix, tail)
    groups, total = template.inline
    data = _protocol.inline_data(states, groups, total)
    return None if data is None else template.prefix + data


def learn(
    classes: object,
    label: str,
    group: Any,
    settings: Settings,
    states: Sequence[Any],
    exchanged: Exchanged,
    plan: Plan,
) -> None:
    """Keep the record and plan of a sync of ``states`` that went the long way with its data in the records."""
    record = exchanged.record
    if not ENABLED or not record[_protocol.H_FLAGS] & _protocol.FLAG_INLINE or not plan.inline or not states:
        return
    on_device = isinstance(record, _device_record.DeviceRecord)
    device = states[0].device if isinstance(states[0], Tensor) else None
    if device is None or not all(
        isinstance(state, Tensor) and state.device == device and not state.requires_grad for state in states
    ):
        return
    if len({id(state) for state in states}) != len(states):  # its slots hold a Ref: see `lookup`
        return
    meta_words = _protocol.record_words(len(states))
    pg = _group_object(group)
    try:
        group_ref = weakref.ref(pg)
    except TypeError:  # a group that cannot be weakly referenced is never learnt
        return
    template = Template(
        classes=classes,
        group=group_ref,
        settings=settings,
        states=tuple((state.dtype, state.shape) for state in states),
        device=device,
        device_record=on_device,
        prefix=list(record[:meta_words]),
        inline=_protocol.inline_layout(tuple((state.dtype, state.numel()) for state in states)),
        table=exchanged.table.numpy()[:, :meta_words].tobytes(),
        plan=plan,
    )
    _keep((id(classes), label, id(pg)), template)


def _keep(key: Key, template: Template) -> None:
    with _LOCK:
        if key not in _TEMPLATES and len(_TEMPLATES) >= TEMPLATES_KEPT:
            del _TEMPLATES[next(iter(_TEMPLATES))]  # the oldest
        _TEMPLATES[key] = template
