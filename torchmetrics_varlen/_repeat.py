"""The one fast path: a small inline sync repeated with the same metadata skips planning and laying out.

A per-step metric syncs a few small dense states at every step (``dist_sync_on_step``, ``forward``), and every rank
sends the same header and slots each time: only the data words in the records change. The engine learns the plan of
such a sync once (:func:`learn`); afterwards, when every rank's header and slots in the exchanged table are byte for
byte those it learnt from, it takes the learnt plan and cuts the results out of the table (:func:`results`) instead
of hashing, planning and laying out again. Guard, handle a subset, hand off: the record is always the one
``_protocol.describe`` makes, the collectives are the same, and on any difference the engine goes on the long way
from the same table. Every rank checks the same table, so every rank takes the same branch. Deleting this module and
its call sites changes no result (``TORCHMETRICS_VARLEN_FAST_PATH=0`` switches it off; a test runs the core suite so).

The check is an exact comparison of the bytes the plan is made from (never a hash): a template can never give a wrong
plan. The plan's other inputs (ops, ``cat``, ``grad``) are compared too; the reduce mode and the cap travel in the
compared headers, the broadcast threshold is part of the key.
"""

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchmetrics_varlen import _buffers, _caches, _protocol
from torchmetrics_varlen._buffers import Result
from torchmetrics_varlen._plan import Cut, Plan

TEMPLATES_KEPT = 64  # a job syncs a handful of small metrics per step; more than this is no repeated sync


@dataclass(frozen=True)
class Template:
    """What one repeated sync gets, learnt from a sync that made its plan the long way."""

    ops: tuple[int, ...] | None
    cat: tuple[bool, ...] | None
    grad: str
    table: bytes  # every rank's header and slots in the table the plan was made from
    plan: Plan
    cuts: list[Cut]


Key = tuple[int, str, int, int, int | None]  # context, label, flags, transfer cap, broadcast threshold
# Why a process-global table: the plan of a repeated sync is the same for every metric object with the same key.
_TEMPLATES: dict[Key, Template] = {}
_LOCK = threading.Lock()  # the Join worker thread syncs while the main thread may
_caches.register("_repeat._TEMPLATES: the learnt plans of repeated small syncs (the one fast path)", _TEMPLATES.clear)
ENABLED = os.environ.get("TORCHMETRICS_VARLEN_FAST_PATH", "1").strip() != "0"  # read once: a debugging switch


def lookup(key: Key) -> Template | None:
    """The template learnt for ``key``, if any (never, with the fast path switched off)."""
    return _TEMPLATES.get(key) if ENABLED else None


def results(
    template: Template,
    words: Any,
    meta_words: int,
    ops: Sequence[int] | None,
    cat: Sequence[bool] | None,
    grad: str,
) -> list[Result | None] | None:
    """The results of a sync whose exchanged table (``words``, numpy) has the learnt headers and slots, else None.

    ``meta_words``: the words of a record's header and slots (its data words follow).
    """
    if grad != template.grad or (tuple(ops) if ops is not None else None) != template.ops:
        return None
    if (tuple(cat) if cat is not None else None) != template.cat:
        return None
    if words.shape[1] < meta_words or words[:, :meta_words].tobytes() != template.table:
        return None
    return _buffers.cut_inline(words, meta_words, template.cuts, len(template.plan.entries))


def learn(
    key: Key,
    sent: Sequence[int],
    ops: Sequence[int] | None,
    cat: Sequence[bool] | None,
    grad: str,
    words: Any,
    meta_words: int,
    plan: Plan,
) -> None:
    """Keep the plan of an inline sync for the next sync with the same ``key``.

    ``sent`` is this rank's record, ``words`` the exchanged table (numpy) the plan was made from, ``meta_words`` the
    words of a record's header and slots.
    """
    if not ENABLED or not sent[_protocol.H_FLAGS] & _protocol.FLAG_INLINE:
        return
    cuts = _buffers.inline_cuts(plan)
    if cuts is None:
        return
    template = Template(
        ops=tuple(ops) if ops is not None else None,
        cat=tuple(cat) if cat is not None else None,
        grad=grad,
        table=words[:, :meta_words].tobytes(),
        plan=plan,
        cuts=cuts,
    )
    with _LOCK:
        if key not in _TEMPLATES and len(_TEMPLATES) >= TEMPLATES_KEPT:
            del _TEMPLATES[next(iter(_TEMPLATES))]  # the oldest
        _TEMPLATES[key] = template
