"""The plan: what every rank decides from the exchanged records, the same on every rank (pure: nothing communicates).

:func:`make_plan` decides everything from the ``[world_size, words]`` table of records (:mod:`.record`) in tensor
operations, with no Python loop over the ranks:

1. the headers: ranks that sync different things, or carry a local problem, raise alike (:mod:`.mismatch`);
2. each entry: a *dense* entry (the same slot on every rank) is read once (:func:`dense_entry`); the others (uneven
   sizes, empty ranks, lists, shared objects) have every rank's slot decoded and checked at once (:func:`plan_uneven`);
3. the routes: dense states by all-reduce (:func:`route_reduce`), large or skewed ones by per-rank broadcasts
   straight into their results (:func:`route_data`: the cost model and the transfer cap);
4. the byte layout of every rank's gather buffer, and the transfer size.

Plans are never mutated once made (a routed entry is a copy), so the group's plan cache shares them between syncs.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import Tensor

from torchmetrics_varlen._engine.mismatch import (
    ObjectsBesideTensorsError,
    check_headers,
    raise_uneven,
    refuse_host_grad,
)
from torchmetrics_varlen._engine.record import (
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

# How an entry's data moves: in the padded gather, by its reduce group's all-reduce, or by per-rank broadcasts.
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
    codes, numels = ones * slot[E_DTYPE], ones * slot[E_NUMEL]
    shapes = torch.tensor([slot[E_NDIM:]] * world, dtype=torch.int64)
    shape = tuple(slot[E_DIMS : E_DIMS + slot[E_NDIM]])
    return EntryPlan(KIND_TENSOR, dtype, codes, numels, ones, shapes, -ones, None, dense=True, shape=shape)


def plan_uneven(
    packed: Tensor,
    indices: list[int],
    cat: Sequence[bool] | None,
    table: Tensor,
    what: str,
    names: Callable[[int], str],
) -> tuple[list[EntryPlan], Tensor]:
    """The entries ``indices``, whose slots differ between ranks (uneven sizes, empty ranks, lists, shared objects).

    ``packed``: every entry's slots (``[W, entries, ENTRY_LEN]``). Returns the plans and each entry's aligned data bytes
    per rank (``[m, W]``). Every check and size is one tensor operation over all entries and ranks; the first offending
    entry raises, as if they were checked one by one.
    """
    # Every rank's slots, decoded: ``[m, W]`` unless said otherwise. Entry-major (``[m, ENTRY_LEN, W]``): the plan
    # reduces over ranks, which is fastest along contiguous memory.
    planes = packed.permute(1, 2, 0).index_select(0, torch.tensor(indices, dtype=torch.int64))
    column = torch.arange(len(indices))
    head = planes[:, W_HEAD]
    is_ref = (head & 3) == KIND_REF
    refs = torch.where(is_ref, head >> 12, -1)  # the earlier entry a rank repeats, or -1
    sends = ~is_ref  # a rank repeating an earlier entry sends nothing for it: its other words are zeros here
    head, numels, dims = head * sends, planes[:, W_NUMEL] * sends, planes[:, W_DIMS:] * sends.unsqueeze(1)
    kinds, codes, items = head & 3, (head >> 2) & 63, head >> 12
    halves = torch.stack([dims & 0xFFFF_FFFF, dims >> 32], dim=2).flatten(1, 2)
    shapes = torch.cat([((head >> 8) & 15).unsqueeze(1), halves], dim=1)  # [m, SHAPE_WORDS, W]
    nonempty = numels > 0
    holder = _first(nonempty)  # [m]: each entry's first rank with data: its dtype and shape are the entry's
    lead, lead_codes = shapes[column, :, holder], codes[column, holder]  # [m, SHAPE_WORDS], [m]
    has_tensor, has_list = any_along(kinds == KIND_TENSOR, dim=1), any_along(kinds == KIND_LIST, dim=1)  # [m]
    # The checks. Objects beside tensors raise alike on every rank: all of them sync those states again, as objects.
    objects = shapes[:, 0] == OBJECT_ITEMS
    if bool(objects.any()):
        beside = any_along(objects, dim=1) & any_along(~objects & (items > 0), dim=1)
        if bool(beside.any()):
            raise ObjectsBesideTensorsError(what, [indices[i] for i in beside.nonzero().flatten().tolist()], names)
    # Only ranks with data must agree on the dtype. A 0-d tensor counts as a 1-d tensor of one element: a one-item
    # `cat` list arrives 0-d, a longer one 1-d.
    ndims = shapes[:, 0].clamp(min=1)
    catted = torch.tensor([cat is not None and bool(cat[index]) for index in indices])
    problems = torch.stack(
        [
            any_along(refs >= torch.tensor(indices).unsqueeze(1), dim=1),
            has_tensor & has_list,
            any_along(nonempty & (codes != lead_codes.unsqueeze(1)), dim=1),
            has_tensor & any_along(nonempty & (ndims != lead[:, :1].clamp(min=1)), dim=1),
            _cat_conflicts(shapes, nonempty, catted),
        ]
    )  # [check, m], in the order each entry is checked
    if bool(problems.any()):
        raise_uneven(problems, indices, codes, ndims, nonempty, table, what, names)
    # Item shape table bytes, aligned (lists only); none for a `cat` list whose items join alike on all ranks with items
    # (same shape words, not MIXED_ITEMS): joined from its slots alone, unless another entry refers to it.
    with_items = items > 0
    referenced = set(refs[refs >= 0].tolist())
    joined = [bool(cat[index]) and index not in referenced if cat is not None else False for index in indices]
    alike = all_along(shapes == shapes[column, :, _first(with_items)].unsqueeze(2), dim=1) & (shapes[:, 0] <= MAX_NDIM)
    shared = torch.tensor(joined) & all_along(alike | ~with_items, dim=1) & ~any_along(is_ref, dim=1)
    table_bytes = (items * (SHAPE_WORDS * 8) + ALIGN - 1 & _ALIGNED) * (has_list & ~shared).unsqueeze(1)
    holds = any_along(nonempty, dim=1).tolist()
    dtypes = [DTYPES[code - 1] if held else None for code, held in zip(lead_codes.tolist(), holds, strict=True)]
    itemsizes = torch.tensor([dtype.itemsize if dtype is not None else 0 for dtype in dtypes]).unsqueeze(1)
    data_bytes = numels * itemsizes + ALIGN - 1 & _ALIGNED  # a referring rank's numel is 0
    # One ``EntryPlan`` per entry, its per-rank fields views of the decoded slots.
    per_rank = zip(*(part.unbind(0) for part in (codes, numels, items, shapes.transpose(1, 2), refs)), strict=True)
    heads = zip(lead.tolist(), has_tensor.tolist(), has_list.tolist(), dtypes, table_bytes.unbind(0), strict=True)
    entries = []
    for (row, tensor, listed, dtype, tables), (e_codes, e_numels, e_items, e_shapes, e_refs) in zip(
        heads, per_rank, strict=True
    ):
        kind = KIND_TENSOR if tensor else KIND_LIST if listed else KIND_REF
        empty = (0, *row[2 : 1 + row[0]]) if kind == KIND_TENSOR and dtype is not None else None
        entries.append(EntryPlan(kind, dtype, e_codes, e_numels, e_items, e_shapes, e_refs, empty, table_bytes=tables))
    return entries, data_bytes


_ALIGNED = -ALIGN  # x + ALIGN - 1 & -ALIGN is align(x): bit operations, cheaper than a division


def _cat_conflicts(shapes: Tensor, nonempty: Tensor, catted: Tensor) -> Tensor:
    """Per `cat` entry: whether the ranks with data join to different dims after the first (``[m]``).

    ``shapes``: ``[m, SHAPE_WORDS, W]`` (a list's: what its items join to; ``MIXED_ITEMS`` is left to the join). A 0-d
    tensor joins as a vector. Ranks without data are left out: ``torch.cat`` skips the empty vectors stock sends.
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


# How an entry rides its reduce group's buffer: as it is, bit-inverted (an integer `min` in the `max` group: ~x = -x - 1
# keeps order without overflow), or in 32-bit halves (int64 in a float64 sum: exact in float64 up to 2**21 ranks).
ENC_PLAIN, ENC_INVERT, ENC_SPLIT = 0, 2, 3


@dataclass
class ReduceGroup:
    """Dense entries all-reduced as one flat ``dtype`` buffer: a group of sums and means, one of integer max and min."""

    op: int
    dtype: torch.dtype  # the transport dtype
    indices: list[int] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)  # elements of each entry in the buffer (twice for ENC_SPLIT)
    encodings: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the all-reduced buffer."""
        return sum(self.numels) * self.dtype.itemsize


# An all-reduce saves about (W - 2) x a group's bytes of gather traffic per rank (W x of receive memory) for one more
# collective. On gloo (docs "Scale") a tiny one costs what a 150-300 KiB gather does (0.2 ms); the threshold is lower,
# since at scale bytes and receive memory matter more.
REDUCE_MIN_SAVING = 64 * 2**10


def reduce_dtype(op: int, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a dense state of ``dtype`` travels in when all-reduced with ``op``, or None to gather it.

    Only int64, float32 and float64 travel (every backend all-reduces these); complex and float8 are gathered. Integers
    and bools sum as int64, as ``torch.sum`` does: bit-identical; their max and min are exact. Float sums and means:
    half floats travel as float32, in which ``torch.sum`` accumulates them; NaN and infinities propagate in any order,
    and a sum of zeros is made ``+0.0`` afterwards (``states.reduce_state``) as ``torch.sum`` gives; only finite sums'
    rounding order on three or more ranks is the backend's. Float max and min are gathered: ``torch.max`` of the stack
    propagates NaN and keeps the first rank's zero of a ``-0.0``/``+0.0`` tie, which no ``MAX`` all-reduce does (gloo
    drops NaN).
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
    # Gathered: a state some ranks share with an earlier entry (a compute group on some ranks: its per-rank pieces are
    # needed), and a differentiable max or min (its gradient goes to one rank's element, which the stack keeps).
    shared = _referenced(entries)
    members: dict[str, list[tuple[int, int, torch.dtype]]] = {"sum": [], "max": []}
    for index, (entry, op) in enumerate(zip(entries, ops, strict=True)):
        if not entry.dense or entry.dtype is None or index in shared or (differentiable and op in (OP_MAX, OP_MIN)):
            continue
        if (transport := reduce_dtype(op, entry.dtype)) is None:
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
            entries[index] = replace(entries[index], route=ROUTE_REDUCE)
    return chosen


def route_data(
    entries: list[EntryPlan], data_bytes: Tensor | None, uneven: list[int], world: int, cap: int, broadcast_min: int
) -> list[int]:
    """Move entries to per-rank broadcasts (``ROUTE_BCAST``), straight into their results; returns them, in order.

    The padded gather allocates ``world_size x`` the largest rank's bytes (and a joined ``cat`` state is copied out of
    it); ``W`` broadcasts move the true sizes into the result itself, for ``W - 1`` more collectives. The cost model
    (gloo, docs page "How the sync works"): a tiny broadcast costs what moving ``broadcast_min`` bytes does, so an
    uneven entry whose largest rank holds that many is broadcast. Then, while the gather would allocate more than
    ``cap``, the largest remaining entry with data moves too, dense or not. An entry that refers to another or is
    referred to stays in the gather (its pieces are cut from the rows). Every rank routes alike, from the plan alone.
    """
    referenced = _referenced(entries)
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
            assert data_bytes is not None and entry.table_bytes is not None
            sizes = data_bytes[positions[index]]
            per_rank += entry.table_bytes  # shape tables always ride in the gather
        movable = entry.dtype is not None and index not in referenced and not bool((entry.refs >= 0).any())
        if movable and not entry.dense and int(sizes.max()) >= broadcast_min:
            entries[index] = replace(entry, route=ROUTE_BCAST)
            continue
        per_rank += sizes
        if movable and int(sizes.max()) > 0:
            candidates.append((int(sizes.sum()), index, sizes))
    candidates.sort(key=lambda found: -found[0])  # the largest first: fewest entries moved
    for _, index, sizes in candidates:
        if world * int(per_rank.max()) <= cap:
            break
        entries[index] = replace(entries[index], route=ROUTE_BCAST)
        per_rank -= sizes
    return [index for index, entry in enumerate(entries) if entry.route == ROUTE_BCAST]


def _reduce_group(kind: str, members: list[tuple[int, int, torch.dtype]], entries: list[EntryPlan]) -> ReduceGroup:
    dtypes = {transport for _, _, transport in members}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    group = ReduceGroup(OP_SUM if kind == "sum" else OP_MAX, dtype)
    for index, op, transport in members:
        numel = int(entries[index].numels[0])
        split = transport == torch.int64 and dtype == torch.float64
        encoding = ENC_INVERT if op == OP_MIN else ENC_SPLIT if split else ENC_PLAIN
        group.indices.append(index)
        group.numels.append(2 * numel if encoding == ENC_SPLIT else numel)
        group.encodings.append(encoding)
    return group


def _referenced(entries: list[EntryPlan]) -> set[int]:
    # The entries that another entry repeats on some rank.
    return {ref for entry in entries if not entry.dense for ref in entry.refs[entry.refs >= 0].tolist()}


# A gathered entry's section on one rank: its plan (None: dense), start, shape table bytes, elements.
Section = tuple[EntryPlan | None, int, int, int]


@dataclass(frozen=True)
class JoinFacts:
    """Where the data of `cat` entries unpacked together lies, and what each joins to (``unpack._joined``)."""

    trailing: list[tuple[int, ...] | None]  # per entry: the dims after the first; None: it comes back in pieces
    held_any: list[bool]  # per entry: some rank holds items (lists) or data (tensors)
    data_starts: list[list[int]]  # per entry and rank: the byte offset of its data in the rank's row
    data_counts: list[list[int]]  # per entry and rank: its elements


@dataclass
class UnpackMemo:
    """What unpacking works out from a plan alone, cached with it; filled lazily (two threads may fill one alike)."""

    sections: dict[int, list[Section]] = field(default_factory=dict)  # per rank (``pack._sections``)
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
    differentiable: bool = False  # the data step runs inside an autograd function (see ``grad``)
    inline: bool = False  # every rank's data came in its record (``FLAG_INLINE``): no data step
    broadcast: list[int] = field(default_factory=list)  # the entries on ROUTE_BCAST, in order
    cap: int = 0  # the smallest transfer cap of the ranks (bytes): the most one broadcast moves
    unpack_memo: UnpackMemo = field(default_factory=UnpackMemo, repr=False, compare=False)

    @cached_property
    def alloc_bytes(self) -> int:
        """Bytes every rank allocates for what it receives (padded rows, broadcast results); each sync asks."""
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

    ``ops``: per entry, the reduction the caller applies afterwards (equal on every rank: it follows from the layout
    whose hash every record carries); ``reduce``: "auto" (cost model), "never" or "always". ``grad``: when a sync every
    rank asked to be differentiable (``FLAG_DIFF``) is: "always" (per-step in grad mode: the result is a loss) or
    "if_graph" (some rank's states carry a graph). ``names``: entry names for messages (``"BinaryAUROC.preds"``).
    ``broadcast_min``: the broadcast route's threshold in bytes (:func:`route_data`); None keeps all in the gather.
    """
    names = names or (lambda index: f"entry {index}")
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
    any_graph = bool((flags & FLAG_GRAD).any())
    differentiable = bool((flags & FLAG_DIFF).all()) and (grad == "always" or any_graph)
    if differentiable and bool((flags & FLAG_HOST_GRAD).any()):
        refuse_host_grad(what, (flags & FLAG_HOST_GRAD).nonzero().flatten().tolist())
    if inline or (any_graph and not differentiable):
        # Inline: the data came with the records. A graph: the local slot gets this rank's own tensor back, as stock.
        reduce = "never"
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
    max_bytes, flags, aux = int(nbytes.max()) if world else 0, flags.clone(), packed[:, :, W_AUX].clone()
    return Plan(
        world, entries, nbytes, max_bytes, flags, aux, groups, reduce_groups, differentiable, inline, broadcast, cap
    )


def _layout(
    entries: list[EntryPlan], uneven: list[int], data_bytes: Tensor | None, world: int
) -> tuple[list[DenseGroup], Tensor]:
    """Lay out the gather buffers (dense groups, then uneven sections); return the groups and each rank's bytes."""
    groups, used = dense_layout(
        (index, entry.dtype, int(entry.numels[0]))
        for index, entry in enumerate(entries)
        if entry.dense and entry.route == ROUTE_GATHER and entry.dtype is not None  # a dense entry has a dtype
    )
    if data_bytes is None:
        return groups, torch.full((world,), used, dtype=torch.int64)
    planned = [entries[index] for index in uneven]  # routed entries are copies: take them from `entries`
    kept = torch.tensor([entry.route != ROUTE_BCAST for entry in planned]).unsqueeze(1)
    tables = torch.stack([entry.table_bytes for entry in planned])  # type: ignore[misc]  # set by plan_uneven
    sections = tables + data_bytes * kept  # [m, W]
    ends = used + sections.cumsum(dim=0)
    for entry, offsets in zip(planned, (ends - sections).unbind(0), strict=True):
        entry.offsets = offsets
    return groups, ends[-1]
