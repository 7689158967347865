"""A small inline sync repeated with the same metadata: its record and its results' layout, learnt once.

A per-step metric syncs a few small dense states at every step (``dist_sync_on_step``, ``forward``), and every rank
sends the same slots each time: only the data words in the records change. The engine learns such a sync once
(:func:`learn`) and afterwards builds its record from the learnt header and slots plus the data (:func:`record`)
and, when every rank's header and slots in the exchanged table are byte for byte those it learnt from, takes the
learnt plan and cuts the results out of the table (:func:`results`) instead of describing, hashing, planning and
laying out again. It changes nothing that travels: the record is the one ``_protocol.describe`` makes (tests compare
them), and the collectives are the same. Every rank checks the same table, so every rank takes the same branch; on
any difference the engine goes on as without a template, from the same table.

The check is an exact comparison of the bytes the plan is made from (never a hash): a template can never give a wrong
plan. What it compares is what ``make_plan`` reads of the table; the plan's other inputs (ops, ``cat``, ``grad``,
the reduce mode) are part of the key or of the compared headers.
"""

import array
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen import _buffers, _protocol
from torchmetrics_varlen._buffers import Cut, Result
from torchmetrics_varlen._plan import Plan
from torchmetrics_varlen._protocol import LocalEntry

TEMPLATES_KEPT = 64  # a job syncs a handful of small metrics per step; more than this is no repeated sync


@dataclass(frozen=True)
class Template:
    """What one repeated sync sends and gets, learnt from a sync that made its plan the long way."""

    kinds: tuple[tuple[torch.dtype, torch.Size], ...]  # each entry's dtype and shape
    aux: tuple[int, ...]
    ops: tuple[int, ...] | None
    cat: tuple[bool, ...] | None
    grad: str
    prefix: "array.array[int]"  # this rank's header and slots, as ``describe`` made them, as int64 words
    pieces: tuple[tuple[bytes, int], ...]  # the data: per entry in layout order, the padding before it and its index
    tail: bytes  # the padding after the last entry
    table: bytes  # every rank's header and slots in the table the plan was made from
    plan: Plan
    cuts: list[Cut]


Key = tuple[int, str, int, int, int | None]  # context, label, flags, transfer cap, broadcast threshold
_TEMPLATES: dict[Key, Template] = {}
_LOCK = threading.Lock()  # the Join worker thread syncs while the main thread may


def lookup(key: Key) -> Template | None:
    """The template learnt for ``key``, if any."""
    return _TEMPLATES.get(key)


def record(
    template: Template,
    entries: Sequence[LocalEntry],
    aux: Sequence[int] | None,
    ops: Sequence[int] | None,
    cat: Sequence[bool] | None,
    grad: str,
) -> "array.array[int] | None":
    """``describe(entries, ..., inline=True)`` for entries that fit ``template``, as int64 words; else None.

    They fit when each is a strided CPU tensor of the learnt dtype and shape, with the learnt aux words, ops, ``cat``
    and ``grad``: then ``describe`` would make the learnt header and slots, and lay the data out as learnt.
    """
    if len(entries) != len(template.kinds) or template.grad != grad:
        return None
    if tuple(aux or ()) != template.aux or (tuple(ops) if ops is not None else None) != template.ops:
        return None
    if (tuple(cat) if cat is not None else None) != template.cat:
        return None
    for entry, kind in zip(entries, template.kinds):
        if not isinstance(entry, Tensor) or entry.layout != torch.strided or not entry.is_cpu:
            return None
        if (entry.dtype, entry.shape) != kind:
            return None
    data: list[bytes] = []
    try:
        for padding, index in template.pieces:
            data += (padding, _protocol.raw_bytes(entries[index]))  # type: ignore[arg-type]
    except (RuntimeError, TypeError):  # as `describe`: such a tensor's data goes by the gather
        return None
    words = array.array("q", template.prefix)
    words.frombytes(b"".join(data) + template.tail)
    return words


def results(template: Template, words: Any, described: int) -> list[Result | None] | None:
    """The results of a sync whose exchanged table (``words``, numpy) has the learnt headers and slots, else None."""
    if words.shape[1] < described or words[:, :described].tobytes() != template.table:
        return None
    return _buffers.cut_inline(words, described, template.cuts, len(template.kinds))


def learn(
    key: Key,
    entries: Sequence[LocalEntry],
    sent: Sequence[int],
    aux: Sequence[int] | None,
    ops: Sequence[int] | None,
    cat: Sequence[bool] | None,
    grad: str,
    words: Any,
    described: int,
    plan: Plan,
) -> Template | None:
    """Keep what an inline sync of small tensors sent and got, for the next sync with the same ``key``; return it.

    ``sent`` is this rank's record, ``words`` the exchanged table (numpy) the plan was made from.
    """
    if not (sent[_protocol.H_FLAGS] & _protocol.FLAG_INLINE) or not all(isinstance(e, Tensor) for e in entries):
        return None
    tensors: list[Tensor] = list(entries)  # type: ignore[arg-type]
    cuts = _buffers.inline_cuts(plan)
    if cuts is None:
        return None
    groups, total = _protocol.inline_layout(tuple((t.dtype, t.numel()) for t in tensors))
    pieces, used = [], 0
    for group in groups:
        for offset, index in enumerate(group.indices):
            padding = group.start - used if offset == 0 else 0  # the alignment padding before a group
            pieces.append((bytes(padding), index))
            used += padding + tensors[index].numel() * group.dtype.itemsize
    template = Template(
        kinds=tuple((t.dtype, t.shape) for t in tensors),
        aux=tuple(aux or ()),
        ops=tuple(ops) if ops is not None else None,
        cat=tuple(cat) if cat is not None else None,
        grad=grad,
        prefix=array.array("q", sent[:described]),
        pieces=tuple(pieces),
        tail=bytes(total - used),
        table=words[:, :described].tobytes(),
        plan=plan,
        cuts=cuts,
    )
    with _LOCK:
        if key not in _TEMPLATES and len(_TEMPLATES) >= TEMPLATES_KEPT:
            del _TEMPLATES[next(iter(_TEMPLATES))]  # the oldest
        _TEMPLATES[key] = template
    return template
