"""What every rank knows about each entry once the records are exchanged: the slots read, checked, one plan each.

``_plan.make_plan`` takes a dense entry (the same slot on every rank) from :func:`dense_entry`, kept per slot, and
every other entry from :func:`plan_uneven`, which reads and checks all of them in a fixed number of tensor operations
over the ``[world_size, entries, ENTRY_LEN]`` slots (see :mod:`torchmetrics_varlen._protocol`). The routes
(:mod:`torchmetrics_varlen._routes`) and the byte layout (``_plan``) then fill in how each entry moves.
"""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from torchmetrics_varlen import _caches
from torchmetrics_varlen._mismatch import ObjectsBesideTensorsError, raise_uneven
from torchmetrics_varlen._protocol import (
    ALIGN,
    DTYPES,
    E_DIMS,
    E_DTYPE,
    E_NDIM,
    E_NUMEL,
    KIND_LIST,
    KIND_REF,
    KIND_TENSOR,
    MAX_NDIM,
    OBJECT_ITEMS,
    SHAPE_WORDS,
    W_DIMS,
    W_HEAD,
    W_NUMEL,
)

# How an entry's data moves: inside the one padded gather, by an all-reduce of its reduce group, or by per-rank
# broadcasts straight into its result (``_routes.route_data``).
ROUTE_GATHER, ROUTE_REDUCE, ROUTE_BCAST = 0, 1, 2


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


@functools.lru_cache(maxsize=1024)
def dense_entry(slot: tuple[int, ...], world: int) -> EntryPlan:
    # Shared between entries and syncs, so never mutated: a dense entry's place is its group's business.
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


_caches.register(
    "_entries.dense_entry: a dense entry's plan, shared by every sync with that slot (read only)",
    dense_entry.cache_clear,
)
