"""The broadcast route: states whose ranks hold very different amounts move straight into their results.

The padded gather makes every rank receive and allocate ``world_size x`` the largest rank's bytes: with one rank
holding 8x the others at 8 ranks, 64 units for 15, and a joined ``cat`` state is then copied out of those rows. An
entry the plan routes here (``_plan._route_data``) instead gets its result allocated first, every rank's data in rank
order (entry-major: the joined ``cat`` tensor itself, a dense entry's ``[world_size, *shape]`` stack, or the data
of the per-rank pieces); this rank copies its own data into its section, and one broadcast per rank that holds data
(in chunks of at most the plan's cap) fills the others' sections in place. Bytes received are the true sizes, the
only allocation is the result, and nothing is copied out afterwards. Which ranks send, and how much, comes from the
plan: every rank issues the same broadcasts in the same order.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

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


def fill_own(entries: Sequence[LocalEntry], plan: Plan, rank: int, buffers: dict[int, Tensor]) -> None:
    """Copy this rank's data of each broadcast entry into its section (the source of its own broadcast)."""
    with torch.no_grad():
        for index, buffer in buffers.items():
            entry, numels = entries[index], plan.entries[index].numels
            assert not isinstance(entry, Ref)  # entries that refer to another are never broadcast
            count = int(numels[rank])
            if count == 0:
                continue
            start = int(numels[:rank].sum())
            own = buffer[start : start + count]
            items = [entry] if isinstance(entry, Tensor) else [item for item in entry if item.numel() > 0]
            if len(items) == 1:
                own.copy_(items[0].reshape(-1))
            else:
                torch.cat([item.reshape(-1).to(own.device) for item in items], out=own)


def sections(plan: Plan, buffers: dict[int, Tensor]) -> list[tuple[int, Tensor]]:
    """The ``(source rank, tensor)`` of every broadcast, in the order every rank issues them.

    Per entry, per rank holding data: its section, split into chunks of at most ``plan.cap`` bytes.
    """
    out: list[tuple[int, Tensor]] = []
    for index, buffer in buffers.items():
        numels = plan.entries[index].numels.tolist()
        chunk = max(1, plan.cap // buffer.element_size())
        start = 0
        for src, count in enumerate(numels):
            out += [(src, part) for part in torch.split(buffer[start : start + count], chunk)] if count else []
            start += count
    return out
