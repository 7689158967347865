"""The plan: what every rank decides from the exchanged records, the same on every rank (pure: nothing communicates).

:func:`make_plan` reads the ``[world_size, words]`` table of records (see :mod:`.record`) and decides everything in
tensor operations over it, with no Python loop over the ranks:

1. the headers: ranks that sync different things, or carry a local problem, raise on every rank alike
   (:mod:`.mismatch`);
2. each entry: a *dense* entry (the same slot on every rank) is read once (:func:`dense_entry`); every other entry
   (uneven sizes, empty ranks, lists, shared objects) has every rank's slot decoded and checked at once
   (:func:`plan_uneven`), which also gives the dtype and trailing shape an empty rank takes;
3. the routes: which dense states travel by all-reduce (:func:`route_reduce`), which large or skewed states by
   per-rank broadcasts straight into their results (:func:`route_data`: the cost model and the transfer cap);
4. the byte layout of every rank's gather buffer, and the transfer size.

Plans are never mutated once made (a routed entry is a copy), so the group's plan cache shares them between syncs.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import torch
from torch import Tensor

from torchmetrics_varlen._sync.mismatch import ObjectsBesideTensorsError, check_headers, raise_uneven, refuse_host_grad
from torchmetrics_varlen._sync.record import (
    ALIGN,
    DTYPES,
    E_DIMS,
    E_DTYPE,
    E_KIND,
    E_NDIM,
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
    KIND_LIST,
    KIND_REF,
    KIND_TENSOR,
    MAX_NDIM,
    OBJECT_ITEMS,
    SHAPE_WORDS,
    W_AUX,
    W_DIMS,
    W_HEAD,
    W_NUMEL,
    DenseGroup,
    align,
    dense_layout,
    unpack_slots,
)

# How an entry's data moves: inside the one padded gather, by an all-reduce of its reduce group, or by per-rank
# broadcasts straight into its result (``route_data``).
ROUTE_GATHER, ROUTE_REDUCE, ROUTE_BCAST = 0, 1, 2
# Reductions the plan can move by all-reduce (equal shape and dtype on every rank). Stock's `mean` is a sum / W.
OP_NONE, OP_SUM, OP_MAX, OP_MIN, OP_MEAN = 0, 1, 2, 3, 4


@dataclass
class EntryPlan:
    """What every rank knows about one entry after the metadata exchange. Per-rank fields are ``[W]`` tensors."""

    kind: int
    dtype: torch.dtype | None  # the common dtype of the non-empty ranks; None when every rank is empty
    dtype_codes: Tensor  # per rank: the dtype it sent (kept when no rank holds data)
    numels: Tensor
    items: Tensor
    shapes: Tensor  # [W, SHAPE_WORDS] (tensor entries)
    refs: Tensor  # per rank: index of the earlier entry this one repeats, or -1
    empty_shape: tuple[int, ...] | None  # shape an empty rank takes: (0, *trailing dims of the first non-empty rank)
    offsets: Tensor | None = None  # per rank: byte offset of this entry's section (gathered, not dense)
    table_bytes: Tensor | None = None  # per rank: bytes of the item shape table (list entries)
    dense: bool = False  # a tensor of the same shape and dtype on every rank
    shape: tuple[int, ...] = ()  # dense entries: the common shape
    route: int = ROUTE_GATHER

    def shape_of(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s shape (tensor entries)."""
        row = self.shapes[rank].tolist()
        return tuple(row[1 : 1 + row[0]])


def dense_entry(slot: tuple[int, ...], world: int) -> EntryPlan:
    """The plan of an entry whose slot is the same on every rank (never mutated: routed entries are copies)."""
    dtype = DTYPES[slot[E_DTYPE] - 1]
    ones = torch.ones(world, dtype=torch.int64)
    return EntryPlan(
        kind=KIND_TENSOR,
        dtype=dtype,
        dtype_codes=ones * slot[E_DTYPE],
        numels=ones * slot[E_NUMEL],
        items=ones,
        shapes=torch.tensor([slot[E_NDIM:]] * world, dtype=torch.int64),
        refs=-ones,
        empty_shape=None,
        dense=True,
        shape=tuple(slot[E_DIMS : E_DIMS + slot[E_NDIM]]),
    )


def plan_uneven(
    packed: Tensor,
    indices: list[int],
    cat: Sequence[bool] | None,
    table: Tensor,
    what: str,
    names: Callable[[int], str],
) -> tuple[list[EntryPlan], Tensor]:
    """The entries ``indices``, whose slots differ between ranks (uneven sizes, empty ranks, lists, shared objects).

    ``packed`` holds every entry's slots (``[W, entries, ENTRY_LEN]``). Returns the plans and each entry's data
    bytes on each rank (``[m, W]``, aligned; the item shape tables' bytes are in each plan's ``table_bytes``). Every
    check and size is one tensor operation over all of them (a fixed number per sync, not per entry and rank); Python
    only builds the ``EntryPlan`` objects from the results. The first offending entry raises, as if the entries were
    checked one by one.
    """
    slots = _decode_uneven(packed, indices)
    _check_uneven(slots, indices, cat, table, what, names)
    table_bytes = _table_bytes(slots, indices, cat)
    column = torch.arange(len(indices))
    holds = any_along(slots.nonempty, dim=1).tolist()
    dtypes = [
        DTYPES[code - 1] if held else None
        for code, held in zip(slots.codes[column, slots.holder].tolist(), holds, strict=True)
    ]
    itemsizes = torch.tensor([dtype.itemsize if dtype is not None else 0 for dtype in dtypes]).unsqueeze(1)
    data_bytes = slots.numels * itemsizes + ALIGN - 1 & _ALIGNED  # a referring rank's numel is 0
    return _uneven_entries(slots, dtypes, table_bytes), data_bytes


_ALIGNED = -ALIGN  # x + ALIGN - 1 & -ALIGN is align(x): bit operations, cheaper than a division


@dataclass
class _UnevenSlots:
    """Every rank's slot of each of ``m`` uneven entries, decoded: ``[m, W]`` tensors unless said otherwise.

    A rank that repeats an earlier entry (``is_ref``) sends nothing for it: its other words here are zeros.
    """

    is_ref: Tensor
    refs: Tensor  # the earlier entry a rank repeats, or -1
    kinds: Tensor
    codes: Tensor  # dtype codes
    numels: Tensor
    items: Tensor
    shapes: Tensor  # [m, SHAPE_WORDS, W]
    nonempty: Tensor  # a rank holds data
    holder: Tensor  # [m]: each entry's first rank with data: its dtype and shape are the entry's
    lead: Tensor  # [m, SHAPE_WORDS]: the holder's shape words
    has_tensor: Tensor  # [m]: some rank sent a tensor
    has_list: Tensor  # [m]: some rank sent a list


def _decode_uneven(packed: Tensor, indices: list[int]) -> _UnevenSlots:
    """The slots of the entries ``indices`` on every rank, unpacked from ``packed`` (``[W, entries, ENTRY_LEN]``)."""
    # Entry-major (``[m, ENTRY_LEN, W]``): the plan reduces over ranks, which is fastest along contiguous memory.
    planes = packed.permute(1, 2, 0).index_select(0, torch.tensor(indices, dtype=torch.int64))
    head = planes[:, W_HEAD]
    is_ref = (head & 3) == KIND_REF
    refs = torch.where(is_ref, head >> 12, -1)
    sends = ~is_ref  # a rank repeating an earlier entry sends nothing for it
    head, numels, dims = head * sends, planes[:, W_NUMEL] * sends, planes[:, W_DIMS:] * sends.unsqueeze(1)
    kinds, codes, items = head & 3, (head >> 2) & 63, head >> 12
    halves = torch.stack([dims & 0xFFFF_FFFF, dims >> 32], dim=2).flatten(1, 2)
    shapes = torch.cat([((head >> 8) & 15).unsqueeze(1), halves], dim=1)  # [m, SHAPE_WORDS, W]
    nonempty = numels > 0
    holder = _first(nonempty)
    return _UnevenSlots(
        is_ref=is_ref,
        refs=refs,
        kinds=kinds,
        codes=codes,
        numels=numels,
        items=items,
        shapes=shapes,
        nonempty=nonempty,
        holder=holder,
        lead=shapes[torch.arange(len(indices)), :, holder],
        has_tensor=any_along(kinds == KIND_TENSOR, dim=1),
        has_list=any_along(kinds == KIND_LIST, dim=1),
    )


def _check_uneven(
    slots: _UnevenSlots,
    indices: list[int],
    cat: Sequence[bool] | None,
    table: Tensor,
    what: str,
    names: Callable[[int], str],
) -> None:
    """Raise `SyncMismatchError` for the first entry whose ranks cannot be combined (see ``raise_uneven``)."""
    objects = slots.shapes[:, 0] == OBJECT_ITEMS  # [m, W]: the ranks that sent Python objects (``_objects``)
    if bool(objects.any()):
        beside = any_along(objects, dim=1) & any_along(~objects & (slots.items > 0), dim=1)
        if bool(beside.any()):  # raised alike on every rank: all of them sync those states again, as objects
            raise ObjectsBesideTensorsError(what, [indices[i] for i in beside.nonzero().flatten().tolist()], names)
    column = torch.arange(len(indices))
    codes, nonempty, lead, has_tensor = slots.codes, slots.nonempty, slots.lead, slots.has_tensor
    # Only ranks with data must agree on the dtype. A 0-d tensor counts as a 1-d tensor of one element: a one-item
    # `cat` list arrives 0-d, a longer one 1-d.
    ndims = slots.shapes[:, 0].clamp(min=1)
    catted = torch.tensor([cat is not None and bool(cat[index]) for index in indices])
    problems = torch.stack(
        [
            any_along(slots.refs >= torch.tensor(indices).unsqueeze(1), dim=1),
            has_tensor & slots.has_list,
            any_along(nonempty & (codes != codes[column, slots.holder].unsqueeze(1)), dim=1),
            has_tensor & any_along(nonempty & (ndims != lead[:, :1].clamp(min=1)), dim=1),
            _cat_conflicts(slots.shapes, nonempty, catted),
        ]
    )  # [check, m], in the order each entry is checked
    if bool(problems.any()):
        raise_uneven(problems, indices, codes, ndims, nonempty, table, what, names)


def _table_bytes(slots: _UnevenSlots, indices: list[int], cat: Sequence[bool] | None) -> Tensor:
    """Per entry and rank (``[m, W]``): the bytes of the item shape table it sends, aligned (lists only)."""
    # A `cat` list whose items concatenate alike on every rank (the same shape words, not MIXED_ITEMS, on every rank
    # with items) is joined from its slots' shape words alone: no rank sends its item shape table. Not when another
    # entry refers to it, since then its per-rank pieces may be needed.
    refs, shapes, with_items = slots.refs, slots.shapes, slots.items > 0
    column = torch.arange(len(indices))
    referenced = set(refs[refs >= 0].tolist())
    joined = [bool(cat[index]) and index not in referenced if cat is not None else False for index in indices]
    alike = all_along(shapes == shapes[column, :, _first(with_items)].unsqueeze(2), dim=1) & (shapes[:, 0] <= MAX_NDIM)
    shared = torch.tensor(joined) & all_along(alike | ~with_items, dim=1) & ~any_along(slots.is_ref, dim=1)
    return (slots.items * (SHAPE_WORDS * 8) + ALIGN - 1 & _ALIGNED) * (slots.has_list & ~shared).unsqueeze(1)


def _uneven_entries(slots: _UnevenSlots, dtypes: list[torch.dtype | None], table_bytes: Tensor) -> list[EntryPlan]:
    """One ``EntryPlan`` per uneven entry, its per-rank fields views of the decoded slots."""
    entries = []
    per_entry = zip(
        *(
            part.unbind(0)
            for part in (slots.codes, slots.numels, slots.items, slots.shapes.transpose(1, 2), slots.refs, table_bytes)
        ),
        strict=True,
    )
    for row, tensor, listed, dtype, fields in zip(
        slots.lead.tolist(), slots.has_tensor.tolist(), slots.has_list.tolist(), dtypes, per_entry, strict=True
    ):
        kind = KIND_TENSOR if tensor else KIND_LIST if listed else KIND_REF
        empty_shape = (0, *row[2 : 1 + row[0]]) if kind == KIND_TENSOR and dtype is not None else None
        entry_codes, entry_numels, entry_items, entry_shapes, entry_refs, entry_table = fields
        entries.append(
            EntryPlan(
                kind=kind,
                dtype=dtype,
                dtype_codes=entry_codes,
                numels=entry_numels,
                items=entry_items,
                shapes=entry_shapes,
                refs=entry_refs,
                empty_shape=empty_shape,
                table_bytes=entry_table,
            )
        )
    return entries


def _cat_conflicts(shapes: Tensor, nonempty: Tensor, catted: Tensor) -> Tensor:
    """Per `cat` entry: whether the ranks with data join to different dims after the first (``[m]``).

    ``shapes`` is ``[m, SHAPE_WORDS, W]``: a tensor's ``[ndim, *dims]``, a list's ``[ndim, 0, *trailing]`` of what its
    items concatenate to (``MIXED_ITEMS`` when they do not: such a list is left to the join, see
    ``_reductions._cat_items``). A 0-d tensor joins as a vector. Ranks without data are left out: ``torch.cat`` skips
    the zero-length vectors stock sends for empty ranks.
    """
    ndims = shapes[:, 0].clamp(min=1)
    known = nonempty & (ndims <= MAX_NDIM)
    lead = shapes[torch.arange(shapes.shape[0]), :, _first(known)]  # [m, SHAPE_WORDS]
    used = torch.arange(2, SHAPE_WORDS) < 1 + lead[:, :1].clamp(min=1)  # the words of the dims after the first
    differ = any_along((shapes[:, 2:] != lead[:, 2:].unsqueeze(2)) & used.unsqueeze(2), dim=1)
    return catted & any_along(known & (differ | (ndims != lead[:, :1].clamp(min=1))), dim=1)


def any_along(mask: Tensor, dim: int) -> Tensor:
    """``mask.any(dim)``: a bool reduction along one dimension takes a slow path on the CPU, 10x this one."""
    return mask.view(torch.uint8).amax(dim=dim).view(torch.bool)


def all_along(mask: Tensor, dim: int) -> Tensor:
    """``mask.all(dim)``, as fast as :func:`any_along`."""
    return mask.view(torch.uint8).amin(dim=dim).view(torch.bool)


def _first(mask: Tensor) -> Tensor:
    """Per row of ``[m, W]``: the first rank where ``mask`` holds (0 where it never does)."""
    return mask.view(torch.uint8).argmax(dim=1)  # argmax gives the first of equal maxima


# How an entry rides its reduce group's buffer: as it is, bit-inverted (an integer `min` inside the `max` group:
# ~x = -x - 1 reverses the order without overflow), or split into a high and a low 32-bit half (an int64 sum inside a
# float64 sum group: each half sums exactly in float64 for up to 2**21 ranks).
ENC_PLAIN, ENC_INVERT, ENC_SPLIT = 0, 2, 3


@dataclass
class ReduceGroup:
    """Dense entries reduced by one all-reduce (sum or max) of a flat buffer of ``dtype``.

    Every sum and mean state shares one group (integers split into float64 halves when floats are summed too), every
    max and min state of an integer dtype another: at most two groups, whatever the number of states, of which the
    collective budget lets one be all-reduced when something is left to gather (see ``route_reduce``). Float max and min
    states are never all-reduced (see ``reduce_dtype``).
    """

    op: int
    dtype: torch.dtype  # the transport dtype
    indices: list[int] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)  # elements of each entry in the buffer (twice for ENC_SPLIT)
    encodings: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the all-reduced buffer."""
        return sum(self.numels) * self.dtype.itemsize


# Moving a reducible group by all-reduce instead of inside the gather saves about (W - 2) x its bytes of traffic per
# rank (and W x its bytes of receive memory) but costs one more collective. Below this many bytes of saving, one
# collective's latency is worth more. Measured on gloo (docs page "Scale"): a tiny collective costs what a 150-300 KiB
# gather does; the threshold is lower, because at scale bytes and receive memory matter more than 0.2 ms.
REDUCE_MIN_SAVING = 64 * 2**10
_REDUCE_DTYPES = frozenset({torch.int64, torch.float32, torch.float64})  # all-reduce works on these on every backend


def reduce_dtype(op: int, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a dense state of ``dtype`` travels in when all-reduced with ``op``, or None to gather it.

    Integers (and bools) sum as int64, which is what ``torch.sum`` gives, so the result is bit-identical; their max
    and min are exact in int64. Float sums and means: half floats travel as float32, in which ``torch.sum``
    accumulates them too; NaN and infinities propagate in any order, and a sum of zeros is made ``+0.0`` afterwards,
    as ``torch.sum`` (which starts from ``+0.0``) gives (see ``_reductions.reduce_state``); only the rounding order of
    finite sums on three or more ranks is the backend's. Float max and min are gathered: ``torch.max`` of the stacked
    ranks propagates NaN and keeps the first rank's zero of a ``-0.0``/``+0.0`` tie, which no backend's ``MAX``
    all-reduce does (gloo drops NaN). Complex and float8 states are gathered.
    """
    if op == OP_NONE or dtype.is_complex or (dtype.itemsize == 1 and dtype.is_floating_point):
        return None
    if dtype.is_floating_point:
        if op in (OP_MAX, OP_MIN):
            return None
        return torch.float64 if dtype == torch.float64 else torch.float32
    return None if op == OP_MEAN else torch.int64  # torch.mean refuses integers: gather, and raise as stock does


def route_reduce(
    entries: list[EntryPlan], ops: Sequence[int] | None, world: int, reduce: str, differentiable: bool
) -> list[ReduceGroup]:
    """Choose the all-reduced entries: whole (op, dtype) buckets, when the bytes saved pay for a collective."""
    if ops is None or reduce == "never":
        return []
    # A state some ranks share with an earlier entry (a compute group formed on some ranks only) needs the earlier
    # entry's per-rank pieces, which an all-reduce does not keep.
    refs = [entry.refs for entry in entries if not entry.dense]
    every_ref = torch.cat(refs) if refs else torch.empty(0, dtype=torch.int64)
    shared = set(every_ref[every_ref >= 0].tolist())
    members: dict[str, list[tuple[int, int, torch.dtype]]] = {"sum": [], "max": []}
    for index, (entry, op) in enumerate(zip(entries, ops, strict=True)):
        eligible = entry.dense and entry.dtype is not None and index not in shared
        if differentiable and op in (OP_MAX, OP_MIN):
            eligible = False  # the gradient of a max goes to one rank's element: the gathered stack keeps it
        transport = reduce_dtype(op, entry.dtype) if eligible and entry.dtype is not None else None
        if transport is None:
            continue
        kind = "sum" if op in (OP_SUM, OP_MEAN) else "max"  # max and min: integers only (see `reduce_dtype`)
        members[kind].append((index, op, transport))
    groups = [_reduce_group(kind, found, entries) for kind, found in members.items() if found]
    chosen = [group for group in groups if reduce == "always" or (world - 2) * group.nbytes >= REDUCE_MIN_SAVING]
    # The collective budget: metadata + gather + one all-reduce, or metadata + two all-reduces when nothing is left
    # to gather. Past it, only the largest group is all-reduced and the others ride in the gather.
    routed = {index for group in chosen for index in group.indices}
    gathers = any(
        index not in routed and (entry.dense or bool((entry.numels > 0).any())) for index, entry in enumerate(entries)
    )
    if len(chosen) > (1 if gathers else 2):
        chosen = [max(chosen, key=lambda group: group.nbytes)]
    for group in chosen:
        for index in group.indices:
            entries[index] = _with_route(entries[index], ROUTE_REDUCE)
    return chosen


def route_data(
    entries: list[EntryPlan], data_bytes: Tensor | None, uneven: list[int], world: int, cap: int, broadcast_min: int
) -> list[int]:
    """Move entries to per-rank broadcasts (``ROUTE_BCAST``), straight into their results; returns them, in order.

    The padded gather moves and allocates ``world_size x`` the largest rank's bytes, and a joined ``cat`` state is then
    copied out of it; ``W`` broadcasts, one per rank that holds data, move the true sizes into the result itself, at
    the cost of ``W - 1`` more collectives. The cost model (measured on gloo, docs page "How the sync works"): a tiny
    broadcast costs what moving ``broadcast_min`` bytes does, so an uneven entry whose largest rank holds at least
    that many bytes is broadcast. Then the cap: while the padded gather would still allocate more than ``cap``
    (``world_size x`` its largest rank's bytes), the largest remaining entry holding data moves too, dense ones
    included. An entry that refers to another, or that another refers to, stays in the gather (its per-rank pieces
    are cut from the gathered rows). Decided from the plan alone: every rank routes alike.
    """
    referenced: set[int] = set()
    for entry in entries:
        if not entry.dense:
            referenced.update(entry.refs[entry.refs >= 0].tolist())
    per_rank = torch.zeros(world, dtype=torch.int64)  # what each rank's padded section holds, aligned
    candidates: list[tuple[int, int, Tensor]] = []  # (total bytes, index, per-rank bytes)
    positions = {index: position for position, index in enumerate(uneven)}
    for index, entry in enumerate(entries):
        if entry.route != ROUTE_GATHER:
            continue
        if entry.dense:
            assert entry.dtype is not None
            sizes = torch.full((world,), align(int(entry.numels[0]) * entry.dtype.itemsize), dtype=torch.int64)
        else:
            assert data_bytes is not None
            sizes = data_bytes[positions[index]]
            assert entry.table_bytes is not None
            per_rank += entry.table_bytes  # shape tables always ride in the gather
        movable = entry.dtype is not None and index not in referenced and not bool((entry.refs >= 0).any())
        if movable and not entry.dense and int(sizes.max()) >= broadcast_min:
            entries[index] = _with_route(entry, ROUTE_BCAST)
            continue
        per_rank += sizes
        if movable and int(sizes.max()) > 0:
            candidates.append((int(sizes.sum()), index, sizes))
    candidates.sort(key=lambda found: -found[0])  # the largest first: fewest entries moved
    for _, index, sizes in candidates:
        if world * int(per_rank.max()) <= cap:
            break
        entries[index] = _with_route(entries[index], ROUTE_BCAST)
        per_rank -= sizes
    return [index for index, entry in enumerate(entries) if entry.route == ROUTE_BCAST]


def _reduce_group(kind: str, members: list[tuple[int, int, torch.dtype]], entries: list[EntryPlan]) -> ReduceGroup:
    dtypes = {transport for _, _, transport in members}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    group = ReduceGroup(OP_SUM if kind == "sum" else OP_MAX, dtype)
    for index, op, transport in members:
        numel = int(entries[index].numels[0])
        if op == OP_MIN:
            encoding = ENC_INVERT
        else:
            encoding = ENC_SPLIT if transport == torch.int64 and dtype == torch.float64 else ENC_PLAIN
        group.indices.append(index)
        group.numels.append(2 * numel if encoding == ENC_SPLIT else numel)
        group.encodings.append(encoding)
    return group


def _with_route(entry: EntryPlan, route: int) -> EntryPlan:
    # Dense entries are shared between plans (cached), so a routed one is a copy.
    copy = EntryPlan(**{name: getattr(entry, name) for name in entry.__dataclass_fields__})
    copy.route = route
    return copy


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

    @cached_property
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


def make_plan(
    table: Tensor,
    what: str,
    ops: Sequence[int] | None = None,
    reduce: str = "auto",
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
    a graph). ``names`` names the entry at a position in error messages (a metric's state: ``"BinaryAUROC.preds"``).
    ``broadcast_min`` enables the broadcast route (:func:`route_data`) for entries whose largest rank holds at least
    that many bytes (the policy's cost model); None keeps every entry in the gather.
    """
    return _make_plan(table, what, ops, reduce, grad, cat, names or _entry_name, broadcast_min)


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
