"""Packing the local entries into transfer buffers, and cutting every rank's entries back out.

``pack`` copies the gathered entries into one ``uint8`` send buffer, ``pack_reduced`` the all-reduced ones into one
flat buffer per reduce group. ``unpack`` turns the gathered ``[world_size, bytes]`` rows into one result per entry
with tensor operations over all ranks at once: dense entries as ``[world_size, *shape]`` blocks, ``cat`` entries as
every rank's data concatenated in rank order (one index selection, whatever the number of ranks), other entries as
per-rank pieces. Padding never escapes. Tensors are copied to and from the buffer device with ``Tensor.to``, a no-op
on the same device, so states on any device take the same path.
"""

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from torchmetrics_varlen import _caches
from torchmetrics_varlen._plan import (
    ENC_INVERT,
    ENC_SPLIT,
    ROUTE_BCAST,
    ROUTE_REDUCE,
    EntryPlan,
    Plan,
    all_along,
    any_along,
)
from torchmetrics_varlen._protocol import (
    KIND_LIST,
    KIND_TENSOR,
    MAX_NDIM,
    NUMPY_DTYPES,
    SHAPE_WORDS,
    Entry,
    LocalEntry,
    Ref,
    dtype_of,
    shape_slots,
)


class Stacked:
    """Every rank's value of a dense entry, as one ``[world_size, *shape]`` tensor (what stock reductions take)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"Stacked({tuple(self.tensor.shape)}, {self.tensor.dtype})"


class Joined:
    """A ``cat`` entry: every rank's data concatenated in rank order; ``tensor`` is None when no rank held an item."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor | None) -> None:
        self.tensor = tensor

    def __repr__(self) -> str:
        return "Joined(empty)" if self.tensor is None else f"Joined({tuple(self.tensor.shape)}, {self.tensor.dtype})"


class Reduced:
    """A dense entry all-reduced over the ranks (sum, max or min) in its transport dtype."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"Reduced({tuple(self.tensor.shape)}, {self.tensor.dtype})"


Result = Stacked | Joined | Reduced | list[Tensor | list[Tensor]]  # a list: one piece per rank

_CACHE = threading.local()  # per thread: the Join worker thread packs while the main thread may too
_caches.register(
    "_buffers._CACHE: a CPU send buffer reused between syncs (this thread's), since fresh pages cost time",
    lambda: _CACHE.__dict__.clear(),
)
SEND_BUFFER_CACHE_BYTES = 64 * 2**20
_CPU = torch.device("cpu")


def _send_buffer(nbytes: int, device: torch.device) -> Tensor:
    """A send buffer of ``nbytes``; on the CPU reused between syncs (up to 64 MiB), since fresh pages cost time.

    Reuse is safe because nothing refers to the send buffer once its collective completed; received data lives in
    buffers of its own. CUDA's caching allocator already reuses memory, so only CPU buffers are kept.
    """
    cache: dict[torch.device, Tensor] = _CACHE.__dict__.setdefault("buffers", {})
    cached = cache.get(device)
    if cached is not None and cached.numel() >= nbytes:
        return cached[:nbytes]
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type == "cpu" and nbytes <= SEND_BUFFER_CACHE_BYTES:
        cache[device] = buffer
    return buffer


def pack(entries: Sequence[LocalEntry], plan: Plan, rank: int, device: torch.device) -> Tensor:
    """Copy this rank's gathered entries into one ``uint8`` buffer of the transfer size (``plan.max_bytes``)."""
    buffer = _send_buffer(plan.max_bytes, device)
    with torch.no_grad():
        for group in plan.groups:
            section = buffer[group.start : group.start + group.nbytes].view(group.dtype)
            try:  # states on the buffer's device, as nearly always: no move per state (cat refuses other devices)
                torch.cat([entries[i].reshape(-1) for i in group.indices], out=section)  # type: ignore[union-attr]
            except RuntimeError:
                torch.cat([entries[i].reshape(-1).to(device) for i in group.indices], out=section)  # type: ignore[union-attr]
        raw = buffer.numpy() if buffer.device.type == "cpu" else None
        for entry, (eplan, offset, table_bytes, numel) in zip(entries, _sections(plan, rank)):
            if isinstance(entry, Ref) or eplan is None:
                continue
            items = [entry] if isinstance(entry, Tensor) else entry
            if eplan.kind == KIND_LIST and table_bytes > 0:
                shape_table = [slot for item in items for slot in shape_slots(item.shape)]
                if raw is not None:
                    raw[offset : offset + len(shape_table) * 8].view(np.int64)[:] = shape_table
                else:
                    table_view = buffer[offset : offset + len(shape_table) * 8].view(torch.int64)
                    table_view.copy_(torch.tensor(shape_table, dtype=torch.int64))
                offset += table_bytes
            if eplan.dtype is None or eplan.route == ROUTE_BCAST or numel == 0:  # broadcast data goes straight
                continue  # into its result
            # One copy per entry, however many items: a `cat` list of a hundred batches costs one operation, not a
            # hundred (the section is contiguous, so the items' bytes follow each other in row-major order).
            section = buffer[offset : offset + numel * eplan.dtype.itemsize].view(eplan.dtype)
            _copy_items(items, section, device)
    return buffer


def _sections(plan: Plan, rank: int) -> list[tuple[EntryPlan | None, int, int, int]]:
    """Per entry, where this rank's section of a gathered entry begins, its shape table's bytes and its elements.

    None for the dense entries (their groups are packed together). Worked out once per plan and rank.
    """
    found = plan.memo.get(("sections", rank))
    if found is None:
        found = plan.memo[("sections", rank)] = [
            (None, 0, 0, 0)
            if eplan.dense or eplan.offsets is None or eplan.table_bytes is None
            else (eplan, int(eplan.offsets[rank]), int(eplan.table_bytes[rank]), int(eplan.numels[rank]))
            for eplan in plan.entries
        ]
    return found  # type: ignore[return-value]


def _copy_items(items: list[Tensor], section: Tensor, device: torch.device) -> None:
    """The items' elements, in order, into ``section`` (exactly their number of elements)."""
    first = items[0]
    if first.dim() and first.numel():
        # Items of one trailing shape on the buffer's device (a `cat` state's batches) go in one `cat` into the
        # section viewed in that shape; anything else (0-d or empty first items, other shapes or devices) is refused
        # by `cat` (the numbers of elements are equal, so the view's shape is the one `cat` makes) and flattened.
        try:
            torch.cat(items, out=section.view(-1, *first.shape[1:]))
            return
        except RuntimeError:
            pass
    data = [item.reshape(-1).to(device) for item in items if item.numel()]
    if len(data) == 1:
        section.copy_(data[0])
    else:
        torch.cat(data, out=section)


def pack_reduced(entries: Sequence[LocalEntry], plan: Plan, device: torch.device) -> list[Tensor]:
    """One flat buffer per reduce group (the all-reduce works in place on it), each entry encoded for its group."""
    with torch.no_grad():
        return [
            torch.cat(
                [
                    _encode(entries[index], encoding, group.dtype, device)  # type: ignore[arg-type]  # dense: tensors
                    for index, encoding in zip(group.indices, group.encodings, strict=True)
                ]
            )
            for group in plan.reduce_groups
        ]


def _encode(tensor: Tensor, encoding: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    flat = tensor.reshape(-1).to(device)
    if encoding == ENC_SPLIT:
        wide = flat.to(torch.int64)
        return torch.cat([(wide >> 32).to(dtype), (wide & 0xFFFF_FFFF).to(dtype)])
    if encoding == ENC_INVERT:
        return torch.bitwise_not(flat.to(torch.int64)).to(dtype)
    return flat.to(dtype)


def _decode(part: Tensor, encoding: int) -> Tensor:
    if encoding == ENC_SPLIT:
        high, low = part.chunk(2)
        return (high.to(torch.int64) << 32) + low.to(torch.int64)  # int64 arithmetic wraps as torch.sum does
    if encoding == ENC_INVERT:
        return torch.bitwise_not(part)
    return part


def unpack_reduced(buffers: Sequence[Tensor], plan: Plan, devices: Sequence[torch.device]) -> dict[int, Reduced]:
    """The all-reduced buffers cut back into one tensor per entry, decoded, on each entry's device."""
    out: dict[int, Reduced] = {}
    for group, flat in zip(plan.reduce_groups, buffers, strict=True):
        parts = torch.split(flat, group.numels)
        for index, part, encoding in zip(group.indices, parts, group.encodings, strict=True):
            value = _decode(part, encoding).view(plan.entries[index].shape)
            out[index] = Reduced(value.to(devices[index]))
    return out


def unpack_inline(table: Tensor, described: int, plan: Plan) -> list[Result | None]:
    """The dense entries of an inline plan, cut out of the records' data words (after the first ``described``).

    The same cut as :func:`unpack` makes from gathered rows, in numpy views, each entry made a tensor once: a small
    sync runs this at every step, and numpy views cost a fraction of tensor operations. Every inline entry is on the
    CPU. A dtype numpy lacks (``bfloat16``) takes the tensor way.
    """
    cuts = inline_cuts(plan)
    if cuts is None:
        rows = table[:, described:].view(torch.uint8)  # each row's words are contiguous: viewed as bytes in place
        return unpack(rows, plan, [_CPU] * len(plan.entries))
    return cut_inline(table.numpy(), described, cuts, len(plan.entries))


Cut = tuple[int, Any, int, int, tuple[int, ...]]  # entry, numpy dtype, first and last data byte, [world_size, *shape]


def inline_cuts(plan: Plan) -> list[Cut] | None:
    """Where each dense entry of a plan lies in a rank's data bytes; None for a dtype numpy lacks. Kept per plan."""
    found = plan.memo.get("cuts", False)
    if found is False:
        found = plan.memo["cuts"] = _dense_cuts(plan)
    return found  # type: ignore[return-value]


def _dense_cuts(plan: Plan) -> list[Cut] | None:
    if any(group.dtype not in NUMPY_DTYPES for group in plan.groups):
        return None
    cuts: list[Cut] = []
    for group in plan.groups:
        start, size = group.start, group.dtype.itemsize
        for index, numel in zip(group.indices, group.numels):
            shape = (plan.world_size, *plan.entries[index].shape)
            cuts.append((index, NUMPY_DTYPES[group.dtype], start, start + numel * size, shape))
            start += numel * size
    return cuts


def cut_inline(words: Any, described: int, cuts: Sequence[Cut], count: int) -> list[Result | None]:
    """The entries ``cuts`` names, cut out of the data bytes after the first ``described`` words of each row."""
    results: list[Result | None] = [None] * count
    _cut_dense(words[:, described:].view("u1"), cuts, results)
    return results


def _cut_dense(
    raw: Any, cuts: Sequence[Cut], results: list[Result | None], devices: Sequence[torch.device] | None = None
) -> None:
    """Each entry ``cuts`` names, as one tensor viewing ``raw`` (every rank's bytes, numpy), into ``results``.

    ``devices``: where each entry's result goes (None: it stays on the CPU).
    """
    for index, dtype, start, stop, shape in cuts:
        stacked = torch.from_numpy(raw[:, start:stop].view(dtype).reshape(shape))
        results[index] = Stacked(stacked if devices is None or devices[index] == _CPU else stacked.to(devices[index]))


def unpack(
    rows: Tensor | None,
    plan: Plan,
    devices: Sequence[torch.device],
    cat: Sequence[bool] | None = None,
    broadcast: dict[int, Tensor] | None = None,
) -> list[Result | None]:
    """Every gathered entry cut out of the ``[world_size, bytes]`` rows; None for the all-reduced ones.

    ``cat`` flags the entries whose ranks' data is concatenated (``dist_reduce_fx="cat"``): they come back as one
    :class:`Joined` tensor. Dense entries come back :class:`Stacked`, the rest as a list of per-rank pieces.
    ``broadcast`` holds the data of the entries on the broadcast route (every rank's, in rank order: see
    :mod:`torchmetrics_varlen._broadcast`); their results are views of it, no copy.
    """
    broadcast = broadcast or {}
    world = plan.world_size
    results: list[Result | None] = [None] * len(plan.entries)
    if rows is None:
        rows = torch.empty(world, 0, dtype=torch.uint8)
    _unpack_dense(rows, plan, devices, results)
    for index, data in broadcast.items():
        if plan.entries[index].dense:
            results[index] = Stacked(data.view(world, *plan.entries[index].shape).to(devices[index]))
    found = plan.memo.get("gathered")
    if found is None:
        listing = [index for index, eplan in enumerate(plan.entries) if not eplan.dense and eplan.route != ROUTE_REDUCE]
        found = plan.memo["gathered"] = (listing, {i for i in listing if bool((plan.entries[i].refs >= 0).any())})
    gathered: list[int] = found[0]  # type: ignore[index]
    referring: set[int] = found[1]  # type: ignore[index]
    joins = [index for index in gathered if cat is not None and cat[index] and index not in referring]
    joined = _joined(rows, plan, joins, devices, broadcast)
    for index in gathered:
        if index in referring:
            results[index] = _with_refs(rows, plan, index, results, devices[index])
        else:
            found = joined.get(index)
            pieces = found is None
            results[index] = (
                _pieces(rows, plan.entries[index], devices[index], broadcast.get(index)) if pieces else found
            )
    return results


def _unpack_dense(rows: Tensor, plan: Plan, devices: Sequence[torch.device], results: list[Result | None]) -> None:
    """The dense entries as ``[world_size, *shape]`` views of ``rows``, into ``results``.

    On the CPU they are numpy views (as :func:`unpack_inline` cuts them), each made a tensor once: a fraction of
    the cost of tensor slicing, which right after a collective costs several microseconds an operation.
    """
    cuts = inline_cuts(plan)
    if rows.device.type == "cpu" and cuts is not None and plan.groups:
        _cut_dense(rows.numpy(), cuts, results, devices)
        return
    world = plan.world_size
    for group in plan.groups:
        block = rows[:, group.start : group.start + group.nbytes].view(group.dtype)
        for index, part in zip(group.indices, block.split_with_sizes(group.numels, dim=1)):
            stacked = part.reshape(world, *plan.entries[index].shape)
            results[index] = Stacked(stacked if devices[index] == rows.device else stacked.to(devices[index]))


# The element index is int32 (half the memory to write and read) while every position fits, with room for the
# jumps between positions (see ``_select``).
INDEX32_ELEMENTS = 2**30
SLICE_MIN_AVERAGE = 4096  # elements per section, on average, from which sections are cut one by one
# Up to this many sections of one dtype (entries x ranks) are cut one by one whatever their size: a slice costs a
# few microseconds, an element index some fifty whatever it selects (2 gloo ranks here, right after the gather).
SLICE_MAX_SECTIONS = 16


def _select(rows: Tensor, starts: list[list[int]], counts: list[list[int]], dtype: torch.dtype) -> list[Tensor]:
    """For each entry ``e``: elements ``[starts[e][r], starts[e][r] + counts[e][r])`` of every rank ``r``'s row.

    ``starts`` (bytes) and ``counts`` (elements) are ``k`` lists of ``W``; each entry's elements come back
    concatenated in rank order. Few or large sections are sliced out one by one, one copy per entry. Otherwise one
    element index for all ``k`` entries and one ``index_select`` each, whatever the number of ranks: the rows are one
    contiguous buffer, and every section is aligned to its dtype, so each element's place follows from its rank's
    start. The index is a cumulative sum of ones with a jump where each section starts, built in place: fewer
    passes over fewer fresh pages than repeating each section's start and adding a range.
    """
    totals = [sum(row) for row in counts]
    total = sum(totals)
    if total == 0:
        return [torch.empty(0, dtype=dtype, device=rows.device) for _ in totals]
    world, width = rows.shape
    flat = rows.reshape(-1).view(dtype)
    size, sections = dtype.itemsize, len(totals) * world
    if sections <= SLICE_MAX_SECTIONS or total >= SLICE_MIN_AVERAGE * sections:
        # Large sections (a big `cat` state on few ranks) are copied at memory speed, where an element index would
        # cost several times the data it selects; few small ones cost less as slices than the index takes to build.
        out = []
        for starts_e, counts_e in zip(starts, counts, strict=True):
            firsts = [(rank * width + start) // size for rank, start in enumerate(starts_e)]
            parts = [flat[first : first + count] for first, count in zip(firsts, counts_e, strict=True) if count]
            out.append(torch.cat(parts) if parts else flat.new_empty(0))
        return out
    counts_t = torch.tensor(counts, dtype=torch.int64)
    first = (torch.arange(world, dtype=torch.int64) * width + torch.tensor(starts, dtype=torch.int64)) // size
    first, sizes = first.reshape(-1), counts_t.reshape(-1)
    begins = sizes.cumsum(0) - sizes  # where each section starts in the output
    # The running sum of ones is begin + 1 at a section's first element, which must be first: the jumps up to there
    # add up to first - begin - 1. Empty sections share their begin with the next section; their jumps cancel out.
    jumps = (first - begins - 1).diff(prepend=torch.zeros(1, dtype=torch.int64))
    kind = torch.int32 if flat.numel() < INDEX32_ELEMENTS else torch.int64
    steps = torch.ones(total + 1, dtype=kind).index_add_(0, begins, jumps.to(kind))  # + 1: trailing empty sections
    index = steps.cumsum_(0)[:total].to(rows.device)
    return [torch.index_select(flat, 0, part) for part in torch.split(index, totals)]


def _joined(
    rows: Tensor, plan: Plan, indices: list[int], devices: Sequence[torch.device], broadcast: dict[int, Tensor]
) -> dict[int, Joined]:
    """The ``cat`` entries among ``indices`` whose items' shapes allow it as one tensor each, of all ranks' data.

    Which entries join, to what trailing dims, and where each rank's data lies are decided for all of them at once,
    once per plan; entries of one dtype are cut out together (see ``_select``). A broadcast entry's data is already
    joined: it is viewed in that shape.
    """
    out: dict[int, Joined] = {}
    if not indices:
        return out
    entries = [plan.entries[index] for index in indices]
    listed = [eplan.kind == KIND_LIST for eplan in entries]
    key = ("joined", *indices)
    found = plan.memo.get(key)
    if found is None:
        numels = torch.stack([eplan.numels for eplan in entries])  # [k, W]
        items = torch.stack([eplan.items for eplan in entries])
        # The ranks whose shapes say what the entry concatenates to: those with items (lists), or with data (tensors).
        holds = torch.where(torch.tensor(listed).unsqueeze(1), items, numels) > 0
        shapes = _common_trailing(torch.stack([eplan.shapes.T for eplan in entries]), holds)
        starts = torch.stack([_data_start(eplan) for eplan in entries]).tolist()
        found = plan.memo[key] = (shapes, any_along(holds, dim=1).tolist(), starts, numels.tolist())
    trailing: list[tuple[int, ...] | None] = found[0]  # type: ignore[index]
    held_any: list[bool] = found[1]  # type: ignore[index]
    data_starts: list[list[int]] = found[2]  # type: ignore[index]
    data_counts: list[list[int]] = found[3]  # type: ignore[index]
    pending: dict[torch.dtype, list[tuple[int, tuple[int, ...]]]] = {}
    for position, (index, eplan, shape, held) in enumerate(zip(indices, entries, trailing, held_any, strict=True)):
        if listed[position] and not held:
            out[index] = Joined(None)
        elif shape is None:
            continue  # its items' shapes do not allow one tensor: per-rank pieces
        elif eplan.dtype is None:  # items of zero length only: they keep the dtype a rank sent, as on one process
            out[index] = Joined(torch.empty(0, dtype=_sent_dtype(eplan)).view(-1, *shape).to(devices[index]))
        elif index in broadcast:
            out[index] = Joined(broadcast[index].view(-1, *shape).to(devices[index]))
        else:
            pending.setdefault(eplan.dtype, []).append((position, shape))
    for dtype, members in pending.items():
        starts = [data_starts[position] for position, _ in members]
        counts = [data_counts[position] for position, _ in members]
        for (position, shape), data in zip(members, _select(rows, starts, counts, dtype), strict=True):
            out[indices[position]] = Joined(data.view(-1, *shape).to(devices[indices[position]]))
    return out


def _sent_dtype(eplan: EntryPlan) -> torch.dtype:
    """The dtype of an entry no rank holds data of: the first dtype a rank sent (of its zero-length items)."""
    sent = eplan.dtype_codes[eplan.dtype_codes > 0]
    return dtype_of(int(sent[0])) or torch.get_default_dtype() if sent.numel() else torch.get_default_dtype()


def _data_start(eplan: EntryPlan) -> Tensor:
    """Per rank: the byte offset of an entry's data, after its item shape table (none for tensors)."""
    assert eplan.offsets is not None and eplan.table_bytes is not None
    return eplan.offsets + eplan.table_bytes


def _common_trailing(shapes: Tensor, holds: Tensor) -> list[tuple[int, ...] | None]:
    """Per entry, the trailing dims ``dim_zero_cat`` gives the items of its ranks that ``holds``; None if they differ.

    ``shapes`` is ``[k, SHAPE_WORDS, W]``, ``holds`` ``[k, W]``; None too for an entry where no rank holds any.
    """
    ndims, ignored = shapes[:, 0], ~holds
    lead = shapes[torch.arange(shapes.shape[0]), :, holds.view(torch.uint8).argmax(dim=1)]  # the first holding rank's
    words = torch.arange(2, SHAPE_WORDS)
    dims = words < 1 + lead[:, :1]  # [k, SHAPE_WORDS - 2]: which words hold the dims after the first
    differ = any_along((shapes[:, 2:] != lead[:, 2:].unsqueeze(2)) & dims.unsqueeze(2), dim=1)
    alike = ~differ & (ndims == lead[:, :1])
    checks = torch.stack(
        [
            any_along(holds, dim=1),
            any_along(holds & (ndims > MAX_NDIM), dim=1),  # a list whose items do not concatenate (MIXED_ITEMS)
            all_along((ndims <= 1) | ignored, dim=1),  # scalars and vectors concatenate to a vector
            all_along(alike | ignored, dim=1),
        ],
        dim=1,
    ).tolist()
    found: list[tuple[int, ...] | None] = []
    for (held, mixed, vectors, same), row in zip(checks, lead.tolist(), strict=True):
        if not held or mixed:
            found.append(None)
        else:
            found.append(() if vectors else tuple(row[2 : 1 + row[0]]) if same else None)
    return found


def _pieces(rows: Tensor, eplan: EntryPlan, device: torch.device, data: Tensor | None = None) -> list:  # type: ignore[type-arg]
    """One piece per rank: a tensor with its true shape, or a list of tensors (list entries).

    ``data``: every rank's data of a broadcast entry, in rank order (its item shape tables are in ``rows``).
    """
    starts = (eplan.numels.cumsum(0) - eplan.numels).tolist() if data is not None else None
    return [
        _piece(rows, eplan, rank, device, None if data is None or starts is None else data[starts[rank] :])
        for rank in range(eplan.numels.shape[0])
    ]


def _piece(
    rows: Tensor, eplan: EntryPlan, rank: int, device: torch.device, data: Tensor | None = None
) -> Tensor | list[Tensor]:
    """Rank ``rank``'s piece; ``data``: its elements (and what follows) where the entry was broadcast."""
    assert eplan.offsets is not None and eplan.table_bytes is not None
    offset, numel = int(eplan.offsets[rank]), int(eplan.numels[rank])
    if eplan.kind == KIND_TENSOR:
        if numel == 0:
            shape = eplan.empty_shape if eplan.empty_shape is not None else eplan.shape_of(rank)
            dtype = eplan.dtype or dtype_of(int(eplan.dtype_codes[rank])) or torch.get_default_dtype()
            return torch.empty(shape, dtype=dtype, device=device)
        assert eplan.dtype is not None  # a rank with data has a dtype
        if data is not None:
            return data[:numel].view(eplan.shape_of(rank)).to(device)
        raw = rows[rank, offset : offset + numel * eplan.dtype.itemsize].view(eplan.dtype)
        return raw.view(eplan.shape_of(rank)).to(device)
    count = int(eplan.items[rank])
    if count == 0:
        return []
    table = rows[rank, offset : offset + count * SHAPE_WORDS * 8].view(torch.int64).view(count, SHAPE_WORDS).tolist()
    dtype = eplan.dtype if eplan.dtype is not None else _sent_dtype(eplan)
    start = offset + int(eplan.table_bytes[rank])
    position = 0  # in ``data``, where the entry was broadcast
    items = []
    for slots in table:
        shape = tuple(slots[1 : 1 + slots[0]])
        size = 1
        for dim in shape:
            size *= dim
        if eplan.dtype is None or size == 0:
            items.append(torch.empty(shape, dtype=dtype, device=device))
        elif data is not None:
            items.append(data[position : position + size].view(shape).to(device))
        else:
            items.append(rows[rank, start : start + size * dtype.itemsize].view(dtype).view(shape).to(device))
        start += size * dtype.itemsize
        position += size
    return items


def rank_piece(result: Result, rank: int, rows: Tensor, plan: Plan, index: int, device: torch.device) -> Entry:
    """Rank ``rank``'s own piece of an unpacked entry (the slow path of compute groups that differ by rank)."""
    if isinstance(result, list):
        return result[rank]  # type: ignore[no-any-return]
    if isinstance(result, Stacked):
        return result.tensor[rank]
    return _piece(rows, plan.entries[index], rank, device)


def _with_refs(
    rows: Tensor, plan: Plan, index: int, results: list[Result | None], device: torch.device
) -> Result | None:
    """An entry some ranks sent as a reference to an earlier entry (a state shared by a compute group)."""
    eplan = plan.entries[index]
    refs = eplan.refs.tolist()
    if all(ref >= 0 for ref in refs) and len(set(refs)) == 1:
        return None  # the same object as an earlier entry on every rank: the caller reuses that entry's value
    pieces: list[Entry] = []
    for rank, ref in enumerate(refs):
        if ref >= 0:
            earlier = results[ref]
            assert earlier is not None and not isinstance(earlier, Reduced)
            pieces.append(rank_piece(earlier, rank, rows, plan, ref, device))
        else:
            pieces.append(_piece(rows, eplan, rank, device))
    return pieces
