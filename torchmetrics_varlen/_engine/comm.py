"""The communication layer: every collective of the package is started here, and nowhere else.

Each function starts one collective asynchronously and returns its work (the handle); none waits: :mod:`.wait` waits
for every handle, with the sync's timeout and the errors that name the ranks. Process groups the package makes (the
Join worker's side group, the group of several mesh dimensions) are made here too, since making one is a collective
of its ranks. Collectives are looked up on ``torch.distributed`` at call time, so tests can count them by wrapping
those functions.
"""

import datetime
import os
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torchmetrics_varlen._engine.group import SHARED_GPU_FIX, ProcessGroup, bound_device, shared_gpu_hint
from torchmetrics_varlen._engine.pack import Piece
from torchmetrics_varlen._engine.plan import OP_MAX, OP_MIN, OP_SUM

Work = Any  # torch.distributed's Work, or Join's all-reduce work
_OPS = MappingProxyType({OP_SUM: "SUM", OP_MAX: "MAX", OP_MIN: "MIN"})
SIDE_DESC = "torchmetrics_varlen_side"  # what torch's logs and traces call the groups the package makes


def gather_equal(output: Tensor, local: Tensor, group: ProcessGroup, backend: str = "") -> Work:
    """All-gather ``local`` (the same size on every rank) into ``output`` (``world_size`` times as long).

    The first collective on a device makes NCCL's communicator there, which is where NCCL refuses two ranks on one
    GPU: that refusal gets the fix where the facts point to it.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        return gather(output, local, group=group, async_op=True)
    except RuntimeError as err:
        hint = _shared_gpu_hint(group, backend, output.device, str(err))
        if not hint:
            raise
        try:
            hinted = type(err)(f"{err}\n{hint}")
        except Exception:  # an exception type that takes no message: a plain RuntimeError carries the hint
            hinted = RuntimeError(f"{err}\n{hint}")
        raise hinted from err


def _shared_gpu_hint(group: ProcessGroup, backend: str, device: torch.device, error: str) -> str:
    if device.type != "cuda":
        return ""
    count = torch.cuda.device_count()
    hint = shared_gpu_hint(backend, device, bound_device(group), os.environ.get("LOCAL_RANK"), count)
    if not hint and "Duplicate GPU" in error:
        hint = f"This rank put its buffers on {device}.{SHARED_GPU_FIX}"
    return hint


def all_reduce(buffer: Tensor, op: int, group: ProcessGroup) -> Work:
    """All-reduce ``buffer`` in place with ``op`` (``plan.OP_SUM``, ``OP_MAX`` or ``OP_MIN``)."""
    return dist.all_reduce(buffer, op=getattr(dist.ReduceOp, _OPS[op]), group=group, async_op=True)


def broadcast(tensor: Tensor, src: int, group: ProcessGroup) -> Work:
    """Broadcast ``tensor`` in place from rank ``src`` of ``group``."""
    return dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group, async_op=True)


def all_gather(parts: list[Tensor], rank: int, group: ProcessGroup) -> Work:
    """A list all-gather into ``parts`` (sizes may differ by rank: NCCL runs it as one group of broadcasts)."""
    return dist.all_gather(parts, parts[rank], group=group, async_op=True)


def gather(buffer: Tensor, rows: list[Tensor] | None, dst: int, group: ProcessGroup) -> Work:
    """Every rank's ``buffer`` (equal sizes) into ``rows`` on rank ``dst`` only."""
    return dist.gather(buffer, rows, dst=dist.get_global_rank(group, dst), group=group, async_op=True)


def to_rank(piece: Piece, rank: int, dst: int, group: ProcessGroup, nothing: Tensor) -> Work:
    """One ``all_to_all_single`` moving ``piece`` of a one-rank sync: each rank's part to ``dst`` alone."""
    into = piece.counts if rank == dst else [0] * len(piece.counts)
    out_of = [0] * len(piece.counts)
    if piece.sent is not None:
        out_of[dst] = piece.counts[rank]
    received = piece.received if piece.received is not None else nothing
    sent = piece.sent if piece.sent is not None else nothing
    return dist.all_to_all_single(received, sent, into, out_of, group=group, async_op=True)


def to_rank_grouped(piece: Piece, rank: int, group: ProcessGroup, scratch: Tensor, nothing: Tensor) -> Work:
    """One list ``all_gather`` moving ``piece`` (NCCL: one group of broadcasts, no point-to-point connection).

    On the destination each rank's tensor is its part of the result; on the other ranks a slice of ``scratch``.
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


def new_side_group(partition: Sequence[Sequence[int]] | None, timeout: float) -> ProcessGroup:
    """A gloo group of this rank's ranks: of the world (``partition`` None), or of this rank's set in ``partition``.

    Every rank of the world enters it (``new_group`` / ``new_subgroups_by_enumeration``, documented calls in which
    every rank takes part), so the group names that torch derives agree on every rank, whatever torch release.
    """
    seconds = datetime.timedelta(seconds=timeout)
    if partition is None:
        return dist.new_group(ranks=None, backend="gloo", timeout=seconds, group_desc=SIDE_DESC)
    group, _ = dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call]
        [list(ranks) for ranks in partition], timeout=seconds, backend="gloo"
    )
    return group


def new_subgroups(slices: list[list[int]]) -> ProcessGroup:
    """This rank's group of ``slices`` (a partition of the world's ranks): every rank of the world takes part."""
    group, _ = dist.new_subgroups_by_enumeration(slices)  # type: ignore[no-untyped-call]
    return group


def notify_join(joinable: Any) -> Work | None:
    """Start ``Join``'s count of the ranks that have not joined (an all-reduce), as its first joinable does."""
    from torch.distributed.algorithms.join import Join

    return Join.notify_join_context(joinable)
