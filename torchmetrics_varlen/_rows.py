"""Cutting entries out of the gathered ``[world_size, bytes]`` rows: one rank's piece, or every rank's elements.

:mod:`torchmetrics_varlen._buffers` unpacks with these: an entry that comes back in per-rank pieces takes each rank's
piece (:func:`piece_of`), a `cat` entry joined over the ranks takes every rank's elements at once
(:func:`select_elements`, once it knows what the ranks' items join to: :func:`common_trailing`). Every rank's section
starts at the offset its plan gives (see :mod:`torchmetrics_varlen._plan`), aligned to every dtype, so each piece is a
view of the rows.
"""

import torch
from torch import Tensor

from torchmetrics_varlen._entries import EntryPlan, all_along, any_along
from torchmetrics_varlen._protocol import KIND_TENSOR, MAX_NDIM, SHAPE_WORDS, dtype_of

# The element index is int32 (half the memory to write and read) while every position fits, with room for the
# jumps between positions (see ``select_elements``).
INDEX32_ELEMENTS = 2**30
SLICE_MIN_AVERAGE = 4096  # elements per section, on average, from which sections are cut one by one
# Up to this many sections of one dtype (entries x ranks) are cut one by one whatever their size: a slice costs a
# few microseconds, an element index some fifty whatever it selects (2 gloo ranks here, right after the gather).
SLICE_MAX_SECTIONS = 16


def select_elements(rows: Tensor, starts: list[list[int]], counts: list[list[int]], dtype: torch.dtype) -> list[Tensor]:
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


def sent_dtype(eplan: EntryPlan) -> torch.dtype:
    """The dtype of an entry no rank holds data of: the first dtype a rank sent (of its zero-length items)."""
    sent = eplan.dtype_codes[eplan.dtype_codes > 0]
    return dtype_of(int(sent[0])) or torch.get_default_dtype() if sent.numel() else torch.get_default_dtype()


def data_start(eplan: EntryPlan) -> Tensor:
    """Per rank: the byte offset of an entry's data, after its item shape table (none for tensors)."""
    assert eplan.offsets is not None and eplan.table_bytes is not None
    return eplan.offsets + eplan.table_bytes


def common_trailing(shapes: Tensor, holds: Tensor) -> list[tuple[int, ...] | None]:
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


def pieces_of(
    rows: Tensor, eplan: EntryPlan, device: torch.device, data: Tensor | None = None
) -> list[Tensor | list[Tensor]]:
    """One piece per rank: a tensor with its true shape, or a list of tensors (list entries).

    ``data``: every rank's data of a broadcast entry, in rank order (its item shape tables are in ``rows``).
    """
    starts = (eplan.numels.cumsum(0) - eplan.numels).tolist() if data is not None else None
    return [
        piece_of(rows, eplan, rank, device, None if data is None or starts is None else data[starts[rank] :])
        for rank in range(eplan.numels.shape[0])
    ]


def piece_of(
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
    dtype = eplan.dtype if eplan.dtype is not None else sent_dtype(eplan)
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
