"""Packing the local entries into transfer buffers, and unpacking every rank's entries: one result per entry.

``pack`` copies the gathered entries into one ``uint8`` send buffer, ``pack_reduced`` the all-reduced ones into one
flat buffer per reduce group. ``unpack`` turns the gathered ``[world_size, bytes]`` rows into one result per entry
with tensor operations over all ranks at once: dense entries as ``[world_size, *shape]`` blocks, ``cat`` entries as
every rank's data concatenated in rank order (one index selection, whatever the number of ranks), other entries as
per-rank pieces (cut out of the rows by :mod:`torchmetrics_varlen._rows`). Padding never escapes. Tensors are copied
to and from the buffer device with ``Tensor.to``, a no-op on the same device, so states on any device take the same
path.
"""

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from torchmetrics_varlen import _caches
from torchmetrics_varlen._entries import ROUTE_BCAST, ROUTE_REDUCE, any_along
from torchmetrics_varlen._plan import Cut, JoinFacts, Plan, Section
from torchmetrics_varlen._protocol import (
    KIND_LIST,
    NUMPY_DTYPES,
    Entry,
    LocalEntry,
    Ref,
    shape_slots,
)
from torchmetrics_varlen._routes import ENC_INVERT, ENC_SPLIT
from torchmetrics_varlen._rows import common_trailing, data_start, piece_of, pieces_of, select_elements, sent_dtype


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


def _sections(plan: Plan, rank: int) -> list[Section]:
    """Per entry, where this rank's section of a gathered entry begins, its shape table's bytes and its elements.

    None for the dense entries (their groups are packed together). Worked out once per plan and rank.
    """
    found = plan.unpack_memo.sections.get(rank)
    if found is None:
        found = plan.unpack_memo.sections[rank] = [
            (None, 0, 0, 0)
            if eplan.dense or eplan.offsets is None or eplan.table_bytes is None
            else (eplan, int(eplan.offsets[rank]), int(eplan.table_bytes[rank]), int(eplan.numels[rank]))
            for eplan in plan.entries
        ]
    return found


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


def unpack_inline(table: Tensor, meta_words: int, plan: Plan) -> list[Result | None]:
    """The dense entries of an inline plan, cut out of the records' data words (after the first ``meta_words``).

    The same cut as :func:`unpack` makes from gathered rows, in numpy views, each entry made a tensor once: a small
    sync runs this at every step, and numpy views cost a fraction of tensor operations. Every inline entry is on the
    CPU. A dtype numpy lacks (``bfloat16``) takes the tensor way.
    """
    cuts = inline_cuts(plan)
    if cuts is None:
        rows = table[:, meta_words:].view(torch.uint8)  # each row's words are contiguous: viewed as bytes in place
        return unpack(rows, plan, [_CPU] * len(plan.entries))
    return cut_inline(table.numpy(), meta_words, cuts, len(plan.entries))


def inline_cuts(plan: Plan) -> list[Cut] | None:
    """Where each dense entry of a plan lies in a rank's data bytes; None for a dtype numpy lacks. Kept per plan."""
    found = plan.unpack_memo.cuts
    if found is False:
        found = plan.unpack_memo.cuts = _dense_cuts(plan)
    return found


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


def cut_inline(words: Any, meta_words: int, cuts: Sequence[Cut], count: int) -> list[Result | None]:
    """The entries ``cuts`` names, cut out of the data bytes after the first ``meta_words`` words of each row.

    ``meta_words``: the words of a record's header and slots, which its data words follow.
    """
    results: list[Result | None] = [None] * count
    _cut_dense(words[:, meta_words:].view("u1"), cuts, results)
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
    found = plan.unpack_memo.gathered
    if found is None:
        listing = [index for index, eplan in enumerate(plan.entries) if not eplan.dense and eplan.route != ROUTE_REDUCE]
        found = plan.unpack_memo.gathered = (listing, {i for i in listing if bool((plan.entries[i].refs >= 0).any())})
    gathered, referring = found
    joins = [index for index in gathered if cat is not None and cat[index] and index not in referring]
    joined = _joined(rows, plan, joins, devices, broadcast)
    for index in gathered:
        if index in referring:
            results[index] = _with_refs(rows, plan, index, results, devices[index])
        else:
            whole = joined.get(index)
            pieces = whole is None
            results[index] = (
                pieces_of(rows, plan.entries[index], devices[index], broadcast.get(index)) if pieces else whole
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


def _joined(
    rows: Tensor, plan: Plan, indices: list[int], devices: Sequence[torch.device], broadcast: dict[int, Tensor]
) -> dict[int, Joined]:
    """The ``cat`` entries among ``indices`` whose items' shapes allow it as one tensor each, of all ranks' data.

    Which entries join, to what trailing dims, and where each rank's data lies are decided for all of them at once,
    once per plan; entries of one dtype are cut out together (see ``_rows.select_elements``). A broadcast entry's data
    is already joined: it is viewed in that shape.
    """
    out: dict[int, Joined] = {}
    if not indices:
        return out
    entries = [plan.entries[index] for index in indices]
    listed = [eplan.kind == KIND_LIST for eplan in entries]
    key = tuple(indices)
    found = plan.unpack_memo.joined.get(key)
    if found is None:
        numels = torch.stack([eplan.numels for eplan in entries])  # [k, W]
        items = torch.stack([eplan.items for eplan in entries])
        # The ranks whose shapes say what the entry concatenates to: those with items (lists), or with data (tensors).
        holds = torch.where(torch.tensor(listed).unsqueeze(1), items, numels) > 0
        shapes = common_trailing(torch.stack([eplan.shapes.T for eplan in entries]), holds)
        starts = torch.stack([data_start(eplan) for eplan in entries]).tolist()
        found = plan.unpack_memo.joined[key] = JoinFacts(
            shapes, any_along(holds, dim=1).tolist(), starts, numels.tolist()
        )
    trailing, held_any, data_starts, data_counts = found.trailing, found.held_any, found.data_starts, found.data_counts
    pending: dict[torch.dtype, list[tuple[int, tuple[int, ...]]]] = {}
    for position, (index, eplan, shape, held) in enumerate(zip(indices, entries, trailing, held_any, strict=True)):
        if listed[position] and not held:
            out[index] = Joined(None)
        elif shape is None:
            continue  # its items' shapes do not allow one tensor: per-rank pieces
        elif eplan.dtype is None:  # items of zero length only: they keep the dtype a rank sent, as on one process
            out[index] = Joined(torch.empty(0, dtype=sent_dtype(eplan)).view(-1, *shape).to(devices[index]))
        elif index in broadcast:
            out[index] = Joined(broadcast[index].view(-1, *shape).to(devices[index]))
        else:
            pending.setdefault(eplan.dtype, []).append((position, shape))
    for dtype, members in pending.items():
        starts = [data_starts[position] for position, _ in members]
        counts = [data_counts[position] for position, _ in members]
        for (position, shape), data in zip(members, select_elements(rows, starts, counts, dtype), strict=True):
            out[indices[position]] = Joined(data.view(-1, *shape).to(devices[indices[position]]))
    return out


def rank_piece(result: Result, rank: int, rows: Tensor, plan: Plan, index: int, device: torch.device) -> Entry:
    """Rank ``rank``'s own piece of an unpacked entry (the slow path of compute groups that differ by rank)."""
    if isinstance(result, list):
        return result[rank]  # type: ignore[no-any-return]
    if isinstance(result, Stacked):
        return result.tensor[rank]
    return piece_of(rows, plan.entries[index], rank, device)


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
            pieces.append(piece_of(rows, eplan, rank, device))
    return pieces
