"""Packing: this rank's entries into the buffers a sync sends (pure: nothing here communicates).

* :func:`pack` copies the gathered entries into one ``uint8`` send buffer laid out by the plan;
* :func:`pack_reduced` copies the all-reduced entries into one flat buffer per reduce group, each encoded for it;
* the **broadcast route** (:func:`allocate`, :func:`own_data`, :func:`sections`, :func:`rounds`): a large or skewed
  state's result is allocated first (every rank's data in rank order) and one broadcast per rank holding data fills
  its section in place, so ranks receive the true sizes and allocate only the result. Sections move as ``uint8``: a
  dtype a backend cannot reduce or broadcast (gloo's ``int16``, NCCL's ``uint32``) moves as any other;
* the **one-rank route** (:func:`pieces`): ``compute_on_rank``'s destination receives every other rank's sections as
  contiguous spans of each result, cut into pieces of at most the cap, one collective each.

States on any device take one path (``Tensor.to`` is a no-op on the same device). A tensor with a conjugate or
negative bit is resolved before its bytes are read.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from torchmetrics_varlen._engine.plan import ENC_INVERT, ENC_SPLIT, ROUTE_BCAST, Plan, Section
from torchmetrics_varlen._engine.record import KIND_LIST, LocalEntry, Ref, resolved, shape_slots


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


def pack(entries: Sequence[LocalEntry], plan: Plan, rank: int, buffer: Tensor) -> Tensor:
    """Copy this rank's gathered entries into ``buffer`` (``uint8``, the transfer size ``plan.max_bytes``)."""
    device = buffer.device
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
    """This rank's ``Section`` of each entry (``plan.Section``), worked out once per plan and rank."""
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
        # Items of one trailing shape on the buffer's device (a `cat` state's batches) go in one `cat` into the section
        # viewed in that shape (equal element counts); `cat` refuses the rest (0-d, empty, other shapes or devices).
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


# ------------------------------------------------------------------------------------------------ broadcast route
Allocator = Callable[[int, torch.dtype, torch.device], Tensor]  # how a sync allocates what it receives into


def allocate(plan: Plan, device: torch.device, empty: Allocator) -> dict[int, Tensor]:
    """One flat buffer per broadcast entry: every rank's elements in rank order."""
    buffers: dict[int, Tensor] = {}
    for index in plan.broadcast:
        entry = plan.entries[index]
        assert entry.dtype is not None  # only entries with data are broadcast
        buffers[index] = empty(int(entry.numels.sum()), entry.dtype, device)
    return buffers


def own_data(
    entries: Sequence[LocalEntry],
    plan: Plan,
    rank: int,
    buffers: dict[int, Tensor],
    device: torch.device,
    empty: Allocator,
) -> tuple[dict[int, Tensor], list[tuple[Tensor, Tensor]]]:
    """This rank's data of each routed entry, as the source of what it sends: ``(sources, later)``.

    A state held as one contiguous tensor of the entry's dtype on ``device`` is sent from itself; its copy into its
    section of the result (``buffers``) is left in ``later``, to run while the data moves. Any other is copied into its
    section now (into a buffer of its own on a one-rank sync's other ranks, which receive no results).
    """
    sources: dict[int, Tensor] = {}
    later: list[tuple[Tensor, Tensor]] = []
    with torch.no_grad():
        for index in plan.broadcast:
            entry, eplan = entries[index], plan.entries[index]
            assert not isinstance(entry, Ref) and eplan.dtype is not None  # routed entries hold data, refer to none
            count = int(eplan.numels[rank])
            if count == 0:
                continue
            buffer = buffers.get(index)
            start = int(eplan.numels[:rank].sum())
            own = buffer[start : start + count] if buffer is not None else None
            items = [entry] if isinstance(entry, Tensor) else [item for item in entry if item.numel() > 0]
            if len(items) == 1 and _sendable(items[0], eplan.dtype, device):
                sources[index] = flat = items[0].detach().reshape(-1)
                if own is not None:
                    later.append((own, flat))
                continue
            if own is None:
                own = empty(count, eplan.dtype, device)
            if len(items) == 1:
                own.copy_(items[0].reshape(-1))
            else:
                torch.cat([item.reshape(-1).to(own.device) for item in items], out=own)
            sources[index] = own
    return sources, later


def _sendable(tensor: Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    # A conjugate or negative view is sent from a resolved copy: its bytes are not its values.
    plain = not tensor.is_conj() and not tensor.is_neg()
    return plain and tensor.is_contiguous() and tensor.dtype == dtype and tensor.device == device


def copy_later(later: list[tuple[Tensor, Tensor]]) -> None:
    """The copies :func:`own_data` left for later: this rank's data into its sections of the results."""
    with torch.no_grad():
        for section, tensor in later:
            section.copy_(tensor)


def chunk_elements(cap: int, itemsize: int) -> int:
    """Elements of ``itemsize`` bytes one broadcast moves at most: as many as fit in ``cap`` bytes, at least one."""
    return max(1, cap // itemsize)


def sections(plan: Plan, buffers: dict[int, Tensor], sources: dict[int, Tensor], rank: int) -> list[tuple[int, Tensor]]:
    """Every broadcast's ``(source rank, tensor)`` in issue order: per entry and rank with data, a section's chunks."""
    out: list[tuple[int, Tensor]] = []
    for index in plan.broadcast:
        eplan = plan.entries[index]
        assert eplan.dtype is not None
        chunk = chunk_elements(plan.cap, eplan.dtype.itemsize)
        start = 0
        for src, count in enumerate(eplan.numels.tolist()):
            if count:
                section = sources[index] if src == rank else buffers[index][start : start + count]
                out += [(src, part.view(torch.uint8)) for part in torch.split(section, chunk)]
            start += count
    return out


@dataclass
class Round:
    """One collective of the grouped broadcast route: every rank's chunk of one routed entry (``parts``).

    ``whole``: where the chunks are the ranks' whole sections, all of one size, the result itself (they lie back to
    back in it): one ``all_gather_into_tensor`` straight into it, with no temporary. Else a list ``all_gather`` into the
    parts. ``ProcessGroupNCCL::allgather`` runs one of unequal parts as a group of broadcasts and one of equal parts
    through a temporary of the whole round; torch 2.15's default ``ProcessGroupNCCL2`` was not read (not in the wheel).
    So rounds go one at a time, each waited for: at most one temporary (at most the cap) is alive, whatever the
    implementation.
    """

    parts: list[Tensor]
    whole: Tensor | None = None


def rounds(plan: Plan, buffers: dict[int, Tensor], sources: dict[int, Tensor], rank: int) -> list[Round]:
    """The broadcast route grouped: per routed entry and chunk, one tensor per rank, in the order every rank issues.

    Round ``k`` holds every rank's ``k``-th chunk (of at most ``cap / W``) of its section, empty where a rank has none.
    """
    out: list[Round] = []
    for index in plan.broadcast:
        eplan = plan.entries[index]
        assert eplan.dtype is not None
        chunk = chunk_elements(max(plan.cap // plan.world_size, 1), eplan.dtype.itemsize)
        counts = eplan.numels.tolist()
        per_rank: list[tuple[Tensor, ...]] = []
        start = 0
        for src, count in enumerate(counts):
            section = sources[index] if src == rank and count else buffers[index][start : start + count]
            per_rank.append(tuple(part.view(torch.uint8) for part in torch.split(section, chunk)) if count else ())
            start += count
        if len(set(counts)) == 1 and 0 < counts[0] <= chunk:  # one whole section per rank, all of one size
            out.append(Round(list(next(zip(*per_rank))), buffers[index].view(torch.uint8)))
            continue
        nothing = buffers[index][:0].view(torch.uint8)
        for k in range(max((len(parts) for parts in per_rank), default=0)):
            out.append(Round([parts[k] if k < len(parts) else nothing for parts in per_rank]))
    return out


# ---------------------------------------------------------------------------------------------- one-rank route
@dataclass
class Piece:
    """One collective of a one-rank sync's broadcast route: a contiguous span of one entry's result on ``dst``."""

    counts: list[int]  # bytes of each rank's part in the piece (0 for ranks outside it, and for ``dst``)
    received: Tensor | None = None  # on ``dst``: the piece of the result (``uint8``)
    sent: Tensor | None = None  # on a rank with a part in the piece: that part of its data (``uint8``)


def pieces(plan: Plan, buffers: dict[int, Tensor], sources: dict[int, Tensor], rank: int, dst: int) -> list[Piece]:
    """A one-rank sync's pieces in issue order (``buffers``: the results, on ``dst``; ``sources``: this rank's data)."""
    out: list[Piece] = []
    for index in plan.broadcast:
        eplan = plan.entries[index]
        assert eplan.dtype is not None
        sizes = [count * eplan.dtype.itemsize for count in eplan.numels.tolist()]
        starts = [sum(sizes[:src]) for src in range(len(sizes))]
        result = _bytes(buffers[index]) if rank == dst else None
        source = _bytes(sources[index]) if rank != dst and sizes[rank] else None
        for begin, end in ((0, starts[dst]), (starts[dst] + sizes[dst], sum(sizes))):
            for low in range(begin, end, max(plan.cap, 1)):
                high = min(low + max(plan.cap, 1), end)
                counts = [max(0, min(high, s + n) - max(low, s)) for s, n in zip(starts, sizes, strict=True)]
                piece = Piece(counts, received=None if result is None else result[low:high])
                if source is not None and counts[rank]:
                    offset = max(low, starts[rank]) - starts[rank]
                    piece.sent = source[offset : offset + counts[rank]]
                out.append(piece)
    return out


def _bytes(tensor: Tensor) -> Tensor:
    return resolved(tensor).reshape(-1).view(torch.uint8)


def scratch_bytes(all_pieces: list[Piece], rank: int, dst: int) -> int:
    """Bytes of the scratch buffer a rank other than ``dst`` receives the grouped pieces into (0 on ``dst``)."""
    return 0 if rank == dst else max((sum(piece.counts) - piece.counts[rank] for piece in all_pieces), default=0)
