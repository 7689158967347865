"""The broadcast route of a one-rank sync (``compute_on_rank``): every other rank's sections into the destination.

Only the destination holds the results. Each routed entry's result is every rank's section in rank order, so what
the destination receives is one or two contiguous spans of it (before and after its own section, which it copies).
Each span is cut into **pieces** of at most the plan's cap, and a piece, which may hold the sections of many ranks,
moves by one collective: every rank computes the same pieces from the plan, so every rank issues the same
collectives in the same order.

How a piece moves depends on the backend (``_policy.no_point_to_point``):

* **one ``all_to_all_single``** (gloo and every backend but NCCL): each rank in the piece sends its part to the
  destination alone, straight into the result; the others send and receive nothing. With sections under the cap and
  the destination at rank 0, that is one collective per entry, where it used to be one per rank.
* **one list ``all_gather``** (NCCL): NCCL's all-to-all is point to point. ``torch``'s unequal-split
  ``all_to_all_single`` issues an ``ncclSend`` and an ``ncclRecv`` between every pair of ranks, zero bytes included,
  and NCCL connects a peer the first time an operation names it, whatever its size, keeping that connection's
  buffers for the communicator's life. A list ``all_gather`` runs as one group of broadcasts on the ring every
  collective uses, which needs no connection of its own; the ranks other than the destination receive each piece
  into one scratch buffer (at most the cap), and each piece is waited for before the next reuses it.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from torchmetrics_varlen._plan import Plan


@dataclass
class Piece:
    """One collective of a one-rank sync's broadcast route: a contiguous span of one entry's result on ``dst``.

    Args:
        counts: bytes of each rank's part in the piece (0 for ranks outside it, and for ``dst``).
        received: on ``dst``, the piece of the result (``uint8``); else None.
        sent: on a rank with a part in the piece, that part of its data (``uint8``); else None.
    """

    counts: list[int]
    received: Tensor | None = None
    sent: Tensor | None = None


def pieces(plan: Plan, buffers: dict[int, Tensor], sources: dict[int, Tensor], rank: int, dst: int) -> list[Piece]:
    """The pieces of a one-rank sync, in the order every rank issues them (see the module docstring).

    ``buffers``: the results (on ``dst`` only); ``sources``: this rank's data of each routed entry.
    """
    out: list[Piece] = []
    for index in plan.broadcast:
        eplan = plan.entries[index]
        assert eplan.dtype is not None
        sizes = [count * eplan.dtype.itemsize for count in eplan.numels.tolist()]
        starts = [sum(sizes[:src]) for src in range(len(sizes))]
        result = _bytes(buffers[index]) if rank == dst else None
        source = _bytes(sources[index]) if rank != dst and sizes[rank] else None
        spans = ((0, starts[dst]), (starts[dst] + sizes[dst], sum(sizes)))
        for begin, end in spans:
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
    return tensor.reshape(-1).view(torch.uint8)


def all_to_all(piece: Piece, rank: int, dst: int, group: object, nothing: Tensor) -> object:
    """Start one ``all_to_all_single`` moving ``piece``: each rank's part to ``dst`` alone (returns the work)."""
    world_size = len(piece.counts)
    into = piece.counts if rank == dst else [0] * world_size
    out_of = [0] * world_size
    if piece.sent is not None:
        out_of[dst] = piece.counts[rank]
    received = piece.received if piece.received is not None else nothing
    sent = piece.sent if piece.sent is not None else nothing
    return dist.all_to_all_single(received, sent, into, out_of, group=group, async_op=True)


def scratch_bytes(all_pieces: list[Piece], rank: int, dst: int) -> int:
    """Bytes of the scratch buffer a rank other than ``dst`` receives the grouped pieces into (0 on ``dst``)."""
    if rank == dst:
        return 0
    return max((sum(piece.counts) - piece.counts[rank] for piece in all_pieces), default=0)


def all_gather(piece: Piece, rank: int, group: object, scratch: Tensor, nothing: Tensor) -> object:
    """Start one list ``all_gather`` moving ``piece`` (NCCL: one group of broadcasts; returns the work).

    On the destination each rank's tensor is its part of the result; on the other ranks it is a slice of
    ``scratch`` (their own part: their data).
    """
    parts: list[Tensor] = []
    offset = 0
    for src, count in enumerate(piece.counts):
        if piece.received is not None:
            parts.append(piece.received[offset : offset + count])
            offset += count
        elif src == rank:
            parts.append(piece.sent if piece.sent is not None else nothing)
        else:
            parts.append(scratch[offset : offset + count])
            offset += count
    return dist.all_gather(parts, parts[rank], group=group, async_op=True)
