"""The sync plan: what every rank decides from the exchanged records, the same on every rank.

``make_plan`` reads the ``[world_size, words]`` table of records (see :mod:`torchmetrics_varlen._protocol`) and
decides everything in tensor operations over it, with no Python loop over the ranks: errors (raised on every rank
alike, see :mod:`torchmetrics_varlen._mismatch`), each entry's plan (:mod:`torchmetrics_varlen._entries`: the dtype
and trailing shape an empty rank takes), which states leave the padded gather for an all-reduce or per-rank
broadcasts (:mod:`torchmetrics_varlen._routes`: the cost model, the collective budget, the transfer cap), each rank's
byte layout and the transfer size. Plans are cached by the table's digest: a per-step sync that sends the same slots
reuses its plan.
"""

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from torchmetrics_varlen import _caches

# ROUTE_* and OP_* are imported as themselves: the route each entry of a plan records and the reductions
# ``make_plan`` takes (``ops``) are the plan's words too, and its callers name them through this module.
from torchmetrics_varlen._entries import ROUTE_BCAST as ROUTE_BCAST
from torchmetrics_varlen._entries import ROUTE_GATHER as ROUTE_GATHER
from torchmetrics_varlen._entries import ROUTE_REDUCE as ROUTE_REDUCE
from torchmetrics_varlen._entries import EntryPlan, any_along, dense_entry, plan_uneven
from torchmetrics_varlen._mismatch import check_headers, refuse_host_grad
from torchmetrics_varlen._protocol import (
    E_KIND,
    E_NUMEL,
    ENTRY_LEN,
    FLAG_DIFF,
    FLAG_GRAD,
    FLAG_HOST_GRAD,
    FLAG_INLINE,
    H_CAP,
    H_FLAGS,
    H_N,
    HEADER_LEN,
    KIND_TENSOR,
    W_AUX,
    DenseGroup,
    dense_layout,
    unpack_slots,
)
from torchmetrics_varlen._routes import OP_MAX as OP_MAX
from torchmetrics_varlen._routes import OP_MEAN as OP_MEAN
from torchmetrics_varlen._routes import OP_MIN as OP_MIN
from torchmetrics_varlen._routes import OP_NONE as OP_NONE
from torchmetrics_varlen._routes import OP_SUM as OP_SUM
from torchmetrics_varlen._routes import ReduceGroup, route_data, route_reduce

Cut = tuple[int, Any, int, int, tuple[int, ...]]  # entry, numpy dtype, first and last data byte, [world_size, *shape]
# A gathered entry's section on one rank: its plan (None for dense entries, packed by groups), where the section
# begins, the bytes of its item shape table and its number of elements.
Section = tuple[EntryPlan | None, int, int, int]


@dataclass(frozen=True)
class JoinFacts:
    """Where the data of `cat` entries unpacked together lies, and what each joins to (``_buffers._joined``)."""

    trailing: list[tuple[int, ...] | None]  # per entry: the dims after the first; None: it comes back in pieces
    held_any: list[bool]  # per entry: some rank holds items (lists) or data (tensors)
    data_starts: list[list[int]]  # per entry and rank: the byte offset of its data in the rank's row
    data_counts: list[list[int]]  # per entry and rank: its elements


@dataclass
class UnpackMemo:
    """Facts unpacking works out from a plan alone, kept with it: a cached plan is unpacked again and again.

    Filled lazily; two threads may fill one field (or one key) at once, with the same value.
    """

    sections: dict[int, list[Section]] = field(default_factory=dict)  # per rank (``_buffers._sections``)
    # Where each dense entry lies in a rank's bytes (``_buffers.inline_cuts``); None for a dtype numpy lacks, False
    # until worked out.
    cuts: list[Cut] | Literal[False] | None = False
    gathered: tuple[list[int], set[int]] | None = None  # the entries cut out of the rows; those referring to others
    joined: dict[tuple[int, ...], JoinFacts] = field(default_factory=dict)  # keyed by the entries joined together


@dataclass
class Plan:
    """The decision every rank reaches from the same metadata table."""

    world_size: int
    entries: list[EntryPlan]
    nbytes: Tensor  # per rank: used bytes of its gather buffer
    max_bytes: int  # transfer size per rank of the padded gather
    flags: Tensor  # per rank: header flags
    aux: Tensor  # [W, entries]: the auxiliary words
    groups: list[DenseGroup]
    reduce_groups: list[ReduceGroup]
    differentiable: bool = False  # the data step runs inside an autograd function (see ``_engine``)
    inline: bool = False  # every rank's data came in its record (``FLAG_INLINE``): no data step
    broadcast: list[int] = field(default_factory=list)  # the entries on ROUTE_BCAST, in order
    cap: int = 0  # the smallest transfer cap of the ranks (bytes): the most one broadcast moves
    unpack_memo: UnpackMemo = field(default_factory=UnpackMemo, repr=False, compare=False)

    @functools.cached_property
    def alloc_bytes(self) -> int:
        """Bytes this sync allocates on every rank for what it receives: the padded rows, broadcast results.

        Kept once worked out: a cached plan serves sync after sync, and each asks.
        """
        total = self.world_size * self.max_bytes + sum(group.nbytes for group in self.reduce_groups)
        for index in self.broadcast:
            entry = self.entries[index]
            assert entry.dtype is not None  # only entries with data broadcast
            total += int(entry.numels.sum()) * entry.dtype.itemsize
        return total


_PLANS: dict[tuple[bytes, tuple[int, ...], str], Plan] = {}
# Plans (and the dense entries they share) are never mutated once made: a routed entry is a copy
# (``_routes._with_route``).
_PLANS_LOCK = threading.Lock()  # the Join worker thread plans too
PLAN_CACHE_SIZE = 64
_caches.register(
    "_plan._PLANS: a metric synced again and again sends the same table, and a lookup costs less than a plan",
    _PLANS.clear,
)


def make_plan(
    table: Tensor,
    what: str,
    ops: Sequence[int] | None = None,
    reduce: str = "auto",
    digest: bytes | None = None,
    grad: str = "if_graph",
    cat: Sequence[bool] | None = None,
    names: Callable[[int], str] | None = None,
    broadcast_min: int | None = None,
) -> Plan:
    """Check the gathered records and lay out the data exchange; raise `SyncMismatchError` on every rank alike.

    ``ops`` gives, per entry, the reduction the caller applies afterwards (equal on every rank, since it follows
    from the synced layout whose hash every record carries); ``reduce`` is "auto" (cost model), "never" or
    "always". ``grad`` says when a sync that every rank asked to be differentiable (``FLAG_DIFF``) really is:
    "always" (a per-step sync in grad mode: the result is a loss) or "if_graph" (only when some rank's states carry
    a graph). ``digest`` identifies the table: a metric synced again and again sends the same table, and a plan
    looked up costs less than one made. Plans are never mutated after this; a table that raises is never cached.
    ``names`` names the entry at a position in error messages (a metric's state: ``"BinaryAUROC.preds"``).
    ``broadcast_min`` enables the broadcast route (``_routes.route_data``) for entries whose largest rank holds at
    least that many bytes (the policy's cost model); None keeps every entry in the gather (a sync to one rank).
    """
    routes = (*(ops or ()), -1, *(cat or ()), -1, -1 if broadcast_min is None else broadcast_min)
    key = (digest, routes, reduce + grad) if digest is not None else None
    if key is not None:
        with _PLANS_LOCK:
            plan = _PLANS.get(key)  # type: ignore[arg-type]
        if plan is not None:
            return plan
    plan = _make_plan(table, what, ops, reduce, grad, cat, names or _entry_name, broadcast_min)
    if key is not None:
        with _PLANS_LOCK:
            if len(_PLANS) >= PLAN_CACHE_SIZE:
                del _PLANS[next(iter(_PLANS))]  # the oldest
            _PLANS[key] = plan  # type: ignore[index]
    return plan


def _entry_name(index: int) -> str:
    return f"entry {index}"


def _make_plan(
    table: Tensor,
    what: str,
    ops: Sequence[int] | None,
    reduce: str,
    grad: str,
    cat: Sequence[bool] | None,
    names: Callable[[int], str],
    broadcast_min: int | None,
) -> Plan:
    world = table.shape[0]
    check_headers(table, what, names)
    count = int(table[0, H_N])
    packed = table[:, HEADER_LEN : HEADER_LEN + count * ENTRY_LEN].reshape(world, count, ENTRY_LEN)
    differs = any_along(packed != packed[:1], dim=0)  # [count, ENTRY_LEN]
    differs[:, W_AUX] = False  # everything but the auxiliary word decides whether an entry is dense
    same = (~any_along(differs, dim=1)).tolist()
    first = unpack_slots(packed[0]).tolist() if count else []
    dense = [same[i] and first[i][E_KIND] == KIND_TENSOR and first[i][E_NUMEL] > 0 for i in range(count)]
    uneven = [index for index in range(count) if not dense[index]]  # only these need every rank's slot unpacked
    planned, data_bytes = plan_uneven(packed, uneven, cat, table, what, names) if uneven else ([], None)
    unevens = iter(planned)
    entries = [dense_entry(tuple(first[i]), world) if dense[i] else next(unevens) for i in range(count)]
    flags = table[:, H_FLAGS]
    inline = count > 0 and bool((flags & FLAG_INLINE).all()) and all(entry.dense for entry in entries)
    if inline:
        reduce = "never"  # the data came with the records: nothing is left to move
    any_graph = bool((flags & FLAG_GRAD).any())
    differentiable = bool((flags & FLAG_DIFF).all()) and (grad == "always" or any_graph)
    if differentiable and bool((flags & FLAG_HOST_GRAD).any()):
        refuse_host_grad(what, (flags & FLAG_HOST_GRAD).nonzero().flatten().tolist())
    if any_graph and not differentiable:
        reduce = "never"  # the local slot gets this rank's own tensor back, with its graph, as stock does
    reduce_groups = route_reduce(entries, ops, world, reduce, differentiable)
    cap = int(table[:, H_CAP].min())
    groups, nbytes = _layout(entries, uneven, data_bytes, world)
    broadcast: list[int] = []
    if not inline and broadcast_min is not None and world > 1:
        # Most syncs move small states: one check of the largest section and of the gather's size keeps them here.
        largest = int(data_bytes.max()) if data_bytes is not None else 0
        if largest >= broadcast_min or world * int(nbytes.max()) > cap:
            broadcast = route_data(entries, data_bytes, uneven, world, cap, broadcast_min)
            groups, nbytes = _layout(entries, uneven, data_bytes, world)
    return Plan(
        world_size=world,
        entries=entries,
        nbytes=nbytes,
        max_bytes=int(nbytes.max()) if world else 0,
        flags=table[:, H_FLAGS].clone(),
        aux=packed[:, :, W_AUX].clone(),
        groups=groups,
        reduce_groups=reduce_groups,
        differentiable=differentiable,
        inline=inline,
        broadcast=broadcast,
        cap=cap,
    )


def _layout(
    entries: list[EntryPlan], uneven: list[int], data_bytes: Tensor | None, world: int
) -> tuple[list[DenseGroup], Tensor]:
    """Lay out each rank's gather buffer; return the dense groups and each rank's used bytes (``[W]``).

    The dense groups come first, then each uneven entry's section: its item shape table, and its data unless the
    entry is broadcast.
    """
    gathered_dense = [
        (index, entry.dtype, int(entry.numels[0]))
        for index, entry in enumerate(entries)
        if entry.dense and entry.route == ROUTE_GATHER and entry.dtype is not None  # a dense entry has a dtype
    ]
    groups, used = dense_layout(gathered_dense)
    if data_bytes is None:
        return groups, torch.full((world,), used, dtype=torch.int64)
    planned = [entries[index] for index in uneven]  # routed entries are copies: take them from `entries`
    kept = torch.tensor([entry.route != ROUTE_BCAST for entry in planned]).unsqueeze(1)
    tables = torch.stack([entry.table_bytes for entry in planned])  # type: ignore[misc]  # set by plan_uneven
    return groups, _layout_uneven(planned, tables + data_bytes * kept, world, used)


def _layout_uneven(uneven: list[EntryPlan], sections: Tensor | None, world: int, start: int) -> Tensor:
    """Per-rank offsets of the uneven entries (``[m, W]`` section bytes) after the dense groups: one cumulative sum."""
    if sections is None:
        return torch.full((world,), start, dtype=torch.int64)
    ends = start + sections.cumsum(dim=0)
    for entry, offsets in zip(uneven, (ends - sections).unbind(0), strict=True):
        entry.offsets = offsets
    return ends[-1]
