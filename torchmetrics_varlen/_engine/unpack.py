"""Unpacking: every rank's entries cut back out of what a sync received (pure: nothing here communicates).

:func:`unpack` turns the gathered ``[world_size, bytes]`` rows into one result per entry, in tensor operations over
all ranks at once: dense entries as ``[world_size, *shape]`` blocks (:class:`~.pack.Stacked`), ``cat`` entries as
every rank's data in rank order (:class:`~.pack.Joined`, one index selection whatever the number of ranks:
:func:`select_elements`), others as per-rank pieces (:func:`piece_of`). :func:`unpack_reduced` cuts the all-reduced
buffers, :func:`unpack_inline` the records' data. Sections are aligned to every dtype: pieces are views, and padding
never escapes.
"""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchmetrics_varlen._engine.pack import Joined, Reduced, Result, Stacked
from torchmetrics_varlen._engine.plan import (
    ENC_INVERT,
    ENC_SPLIT,
    ROUTE_REDUCE,
    EntryPlan,
    JoinFacts,
    Plan,
    all_along,
    any_along,
)
from torchmetrics_varlen._engine.record import (
    KIND_LIST,
    KIND_TENSOR,
    MAX_NDIM,
    NUMPY_DTYPES,
    SHAPE_WORDS,
    DenseGroup,
    Entry,
    dtype_of,
)


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
        for index, part, encoding in zip(group.indices, torch.split(flat, group.numels), group.encodings, strict=True):
            out[index] = Reduced(_decode(part, encoding).view(plan.entries[index].shape).to(devices[index]))
    return out


def unpack_inline(rows: Tensor, plan: Plan) -> list[tuple[DenseGroup, Tensor]]:
    """The dense groups of an inline plan, each a ``[world_size, elements]`` block of the records' data bytes.

    ``rows``: every rank's data bytes (host or device). The states layer reduces whole blocks; :func:`stacked` cuts.
    """
    blocks: list[tuple[DenseGroup, Tensor]] = []
    raw = rows.numpy() if rows.device.type == "cpu" else None
    for group in plan.groups:
        stop = group.start + group.nbytes
        if raw is not None and group.dtype in NUMPY_DTYPES:  # numpy views: a fraction of a tensor slice's cost
            block = torch.from_numpy(raw[:, group.start : stop].view(NUMPY_DTYPES[group.dtype]))
        else:
            block = rows[:, group.start : stop].view(group.dtype)
        blocks.append((group, block))
    return blocks


def stacked(plan: Plan, blocks: Sequence[tuple[DenseGroup, Tensor]]) -> list[Result | None]:
    """Each entry of an inline plan as a :class:`Stacked` view of its group's block."""
    results: list[Result | None] = [None] * len(plan.entries)
    for group, block in blocks:
        raw = block.numpy() if block.device.type == "cpu" and group.dtype in NUMPY_DTYPES else None
        start = 0
        for index, numel in zip(group.indices, group.numels):
            shape = (plan.world_size, *plan.entries[index].shape)
            if raw is not None:  # numpy slices: a fraction of a tensor slice's cost, for many small states
                results[index] = Stacked(torch.from_numpy(raw[:, start : start + numel].reshape(shape)))
            else:
                results[index] = Stacked(block[:, start : start + numel].reshape(shape))
            start += numel
    return results


def unpack(
    rows: Tensor | None,
    plan: Plan,
    devices: Sequence[torch.device],
    cat: Sequence[bool] | None = None,
    broadcast: dict[int, Tensor] | None = None,
) -> list[Result | None]:
    """Every gathered entry cut out of the ``[world_size, bytes]`` rows; None for the all-reduced ones.

    ``cat`` entries (``dist_reduce_fx="cat"``) come back :class:`Joined`, dense ones :class:`Stacked`, the rest as
    per-rank pieces. ``broadcast``: the broadcast entries' data (every rank's, in rank order), which results view.
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
        elif (whole := joined.get(index)) is not None:
            results[index] = whole
        else:  # one piece per rank; a broadcast entry's data holds every rank's, in rank order
            eplan, sent = plan.entries[index], broadcast.get(index)
            starts = (eplan.numels.cumsum(0) - eplan.numels).tolist() if sent is not None else [0] * world
            results[index] = [
                piece_of(rows, eplan, rank, devices[index], None if sent is None else sent[start:])
                for rank, start in enumerate(starts)
            ]
    return results


def _unpack_dense(rows: Tensor, plan: Plan, devices: Sequence[torch.device], results: list[Result | None]) -> None:
    """The dense entries as ``[world_size, *shape]`` views of ``rows`` (as an inline plan's), each on its device."""
    for index, result in enumerate(stacked(plan, unpack_inline(rows, plan))):
        if isinstance(result, Stacked):
            on = result.tensor
            results[index] = result if devices[index] == on.device else Stacked(on.to(devices[index]))


def _joined(
    rows: Tensor, plan: Plan, indices: list[int], devices: Sequence[torch.device], broadcast: dict[int, Tensor]
) -> dict[int, Joined]:
    """The ``cat`` entries among ``indices`` whose items' shapes allow it as one tensor each, of all ranks' data.

    What joins, to what, and where each rank's data lies is decided once per plan; one dtype's entries are cut together.
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
        trailing = common_trailing(torch.stack([eplan.shapes.T for eplan in entries]), holds)
        starts = torch.stack([data_start(eplan) for eplan in entries]).tolist()
        found = JoinFacts(trailing, any_along(holds, dim=1).tolist(), starts, numels.tolist())
        plan.unpack_memo.joined[key] = found
    pending: dict[torch.dtype, list[tuple[int, tuple[int, ...]]]] = {}
    joins = zip(indices, entries, found.trailing, found.held_any, strict=True)
    for position, (index, eplan, shape, held) in enumerate(joins):
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
        starts = [found.data_starts[position] for position, _ in members]
        counts = [found.data_counts[position] for position, _ in members]
        for (position, shape), data in zip(members, select_elements(rows, starts, counts, dtype), strict=True):
            out[indices[position]] = Joined(data.view(-1, *shape).to(devices[indices[position]]))
    return out


def _with_refs(
    rows: Tensor, plan: Plan, index: int, results: list[Result | None], device: torch.device
) -> Result | None:
    """An entry some ranks sent as a reference to an earlier entry (a state shared by a compute group)."""
    eplan = plan.entries[index]
    refs = eplan.refs.tolist()
    if all(ref >= 0 for ref in refs) and len(set(refs)) == 1:
        return None  # the same object as an earlier entry on every rank: the caller reuses that entry's value
    pieces: list[Entry] = []
    for rank, ref in enumerate(refs):  # the slow path of compute groups that differ by rank
        earlier = results[ref] if ref >= 0 else None
        assert ref < 0 or (earlier is not None and not isinstance(earlier, Reduced))
        if isinstance(earlier, list):
            pieces.append(earlier[rank])
        elif isinstance(earlier, Stacked):
            pieces.append(earlier.tensor[rank])
        else:  # this rank's own piece, or the earlier entry's if it came back joined
            pieces.append(piece_of(rows, plan.entries[ref] if ref >= 0 else eplan, rank, device))
    return pieces


# ---------------------------------------------------------------------------------------------------- rows
# The element index is int32 (half the memory traffic) while every position, with room for the jumps, fits.
INDEX32_ELEMENTS = 2**30
SLICE_MIN_AVERAGE = 4096  # elements per section, on average, from which sections are cut one by one
# Up to this many sections of one dtype (entries x ranks) are cut one by one whatever their size: a slice costs a
# few microseconds, an element index some fifty whatever it selects (2 gloo ranks here, right after the gather).
SLICE_MAX_SECTIONS = 16


def select_elements(rows: Tensor, starts: list[list[int]], counts: list[list[int]], dtype: torch.dtype) -> list[Tensor]:
    """For each entry ``e``: elements ``[starts[e][r], starts[e][r] + counts[e][r])`` of every rank ``r``'s row.

    ``starts`` (bytes) and ``counts`` (elements) are ``k`` lists of ``W``; each entry comes back in rank order. Few or
    large sections are sliced one by one; else one element index for all entries, one ``index_select`` each, whatever
    the number of ranks (the rows are one buffer, every section aligned to its dtype). The index is a cumulative sum of
    ones with a jump where each section starts, built in place: fewer passes than repeating starts and adding a range.
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
    first = (torch.arange(world, dtype=torch.int64) * width + torch.tensor(starts, dtype=torch.int64)) // size
    first, sizes = first.reshape(-1), torch.tensor(counts, dtype=torch.int64).reshape(-1)
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
    dims = torch.arange(2, SHAPE_WORDS) < 1 + lead[:, :1]  # [k, SHAPE_WORDS - 2]: the words of the dims after the first
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
    return [
        None if not held or mixed else () if vectors else tuple(row[2 : 1 + row[0]]) if same else None
        for (held, mixed, vectors, same), row in zip(checks, lead.tolist(), strict=True)
    ]


def piece_of(
    rows: Tensor, eplan: EntryPlan, rank: int, device: torch.device, data: Tensor | None = None
) -> Tensor | list[Tensor]:
    """Rank ``rank``'s piece: a tensor of its true shape, or a list of tensors (list entries).

    ``data``: its elements (and what follows) where the entry was broadcast (the item shape tables are in ``rows``).
    """
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
        size = math.prod(shape)
        if eplan.dtype is None or size == 0:
            items.append(torch.empty(shape, dtype=dtype, device=device))
        elif data is not None:
            items.append(data[position : position + size].view(shape).to(device))
        else:
            items.append(rows[rank, start : start + size * dtype.itemsize].view(dtype).view(shape).to(device))
        start += size * dtype.itemsize
        position += size
    return items
