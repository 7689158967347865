"""The broadcast route: states whose ranks hold very different amounts move straight into their results.

The padded gather makes every rank receive and allocate ``world_size x`` the largest rank's bytes: with one rank
holding 8x the others at 8 ranks, 64 units for 15, and a joined ``cat`` state is then copied out of those rows. An
entry the plan routes here (``_routes.route_data``) instead gets its result allocated first, every rank's data in rank
order (entry-major: the joined ``cat`` tensor itself, a dense entry's ``[world_size, *shape]`` stack, or the data
of the per-rank pieces); this rank copies its own data into its section, and one broadcast per rank that holds data
(in chunks of at most the plan's cap) fills the others' sections in place. Bytes received are the true sizes, the
only allocation is the result, and nothing is copied out afterwards. Which ranks send, and how much, comes from the
plan: every rank issues the same broadcasts in the same order.

A one-rank sync (``compute_on_rank``) routes entries by the same plan, but only its destination rank allocates the
results: the other ranks' sections move in pieces of at most the cap, one collective each (:func:`to_rank`, see
``_to_rank``), so the destination receives the true sizes.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from torchmetrics_varlen import _to_rank
from torchmetrics_varlen._plan import Plan
from torchmetrics_varlen._protocol import LocalEntry, Ref


def empty(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocate a receive buffer (one place, so a test can make it fail on one rank)."""
    return torch.empty(numel, dtype=dtype, device=device)


def allocate(plan: Plan, device: torch.device) -> dict[int, Tensor]:
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
) -> tuple[dict[int, Tensor], list[tuple[Tensor, Tensor]]]:
    """This rank's data of each routed entry, as the source of what it sends: ``(sources, later)``.

    A state held as one contiguous tensor of the entry's dtype on ``device`` is sent from itself, and its copy into
    its section of the result is returned in ``later`` (``(section, tensor)`` pairs), to run while the data moves.
    Any other (a list of several items, another device) is copied into its section now, the source. ``buffers``: the
    results, where this rank receives them (empty on the ranks other than a one-rank sync's destination, which copy
    such a state into a buffer of its own size).
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
    return tensor.is_contiguous() and tensor.dtype == dtype and tensor.device == device


def copy_later(later: list[tuple[Tensor, Tensor]]) -> None:
    """The copies :func:`own_data` left for later: this rank's data into its sections of the results."""
    with torch.no_grad():
        for section, tensor in later:
            section.copy_(tensor)


def chunk_elements(cap: int, itemsize: int) -> int:
    """Elements of ``itemsize`` bytes one broadcast moves at most: as many as fit in ``cap`` bytes, at least one."""
    return max(1, cap // itemsize)


def sections(plan: Plan, buffers: dict[int, Tensor], sources: dict[int, Tensor], rank: int) -> list[tuple[int, Tensor]]:
    """The ``(source rank, tensor)`` of every broadcast, in the order every rank issues them.

    Per entry, per rank holding data: its section of the result (this rank's own: its source), in chunks of at most
    ``plan.cap`` bytes.
    """
    out: list[tuple[int, Tensor]] = []
    for index in plan.broadcast:
        eplan = plan.entries[index]
        assert eplan.dtype is not None
        chunk = chunk_elements(plan.cap, eplan.dtype.itemsize)
        start = 0
        for src, count in enumerate(eplan.numels.tolist()):
            if count:
                section = sources[index] if src == rank else buffers[index][start : start + count]
                out += [(src, part) for part in torch.split(section, chunk)]
            start += count
    return out


def rounds(plan: Plan, buffers: dict[int, Tensor], sources: dict[int, Tensor], rank: int) -> list[list[Tensor]]:
    """The broadcast route grouped: per routed entry and chunk, one tensor per rank, in the order every rank issues.

    Round ``k`` of an entry holds every rank's ``k``-th chunk of its section (this rank's own: its source), an empty
    tensor where a rank has fewer chunks or no data: one list ``all_gather`` moves a round (NCCL runs it as one group
    of broadcasts). The same sections as :func:`sections`, in rounds.
    """
    out: list[list[Tensor]] = []
    for index in plan.broadcast:
        eplan = plan.entries[index]
        assert eplan.dtype is not None
        chunk = chunk_elements(plan.cap, eplan.dtype.itemsize)
        per_rank: list[tuple[Tensor, ...]] = []
        start = 0
        for src, count in enumerate(eplan.numels.tolist()):
            section = sources[index] if src == rank and count else buffers[index][start : start + count]
            per_rank.append(torch.split(section, chunk) if count else ())
            start += count
        empty = buffers[index][:0]
        for k in range(max((len(parts) for parts in per_rank), default=0)):
            out.append([parts[k] if k < len(parts) else empty for parts in per_rank])
    return out


def to_rank(
    plan: Plan, buffers: dict[int, Tensor], sources: dict[int, Tensor], rank: int, dst: int
) -> list[_to_rank.Piece]:
    """A one-rank sync's transfers to ``dst``: its pieces, in the order every rank issues them (``_to_rank.pieces``).

    The sections of :func:`sections` without ``dst``'s own (its data is copied, never sent), as contiguous spans of
    each result of at most ``plan.cap`` bytes, each moved by one collective.
    """
    return _to_rank.pieces(plan, buffers, sources, rank, dst)
