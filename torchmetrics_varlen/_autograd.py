"""The differentiable gather behind ``gather_all_tensors(result, group, sync_grads=True)``.

Forward: the same protocol as the plain gather (one metadata exchange, one data exchange, uneven sizes along any
dimension, empty ranks shaped like their peers), but every returned piece, other ranks' included, is an output of one
autograd node. Backward: every rank holds a gradient for every rank's piece; the gradient of rank ``r``'s input is
the sum over all ranks of their gradient for piece ``r`` (a reduce-scatter, like the backward of
``torch.distributed.nn.functional.all_gather``). It is done with one ``all_reduce`` (sum) of a flat buffer that
holds every piece's gradient back to back; each rank keeps its own section. Every rank knows every piece's size from
the forward's plan, so the buffer needs no padding and a gradient that never arrived (an unused piece) counts as zeros.
"""

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from torchmetrics_varlen import _protocol, _transport
from torchmetrics_varlen.errors import SyncTimeoutError
from torchmetrics_varlen.gather import exchange_entries

__all__ = ["differentiable_gather"]

# Its own context: a rank gathering with ``sync_grads=True`` while a peer gathers without it would hang in backward,
# so the metadata exchange turns that into a `SyncMismatchError` on every rank instead.
_CONTEXT = _protocol.context_hash("torchmetrics_varlen.gather_all_tensors(sync_grads=True)")
_LABEL = "gather_all_tensors(grad)"


def differentiable_gather(result: Tensor, group: Any) -> list[Tensor]:
    """Gather ``result`` from every rank of ``group`` so that gradients flow back to the rank each piece came from.

    The caller must have checked that a sync is needed (``_transport.world_of(group)`` is not None).

    Every rank must call ``backward`` on a loss that depends on the gathered output whenever any rank does (as DDP
    already requires of its model output): the backward pass runs a collective. To keep that rule independent of the
    local data, the outputs require grad on every rank whenever grad mode is on, also on a rank whose ``result`` is
    empty or does not require grad; such a rank takes part in the backward collective and gets no gradient (or an
    empty one). Detach the outputs before converting them to NumPy or Python values.

    Only floating point and complex tensors carry gradients. When the ranks' common dtype is anything else (or no
    rank holds data), the result is that of the plain gather: nothing requires grad and no backward collective runs,
    decided alike on every rank from the exchanged metadata.

    Args:
        result: this rank's tensor; any shape, possibly empty.
        group: the process group to gather over; the default group when None.

    Returns:
        One tensor per rank: element i is rank i's tensor with its true shape. The gradient of ``result`` is, summed
        over all ranks, the gradient that rank's loss sends to element ``rank`` of its own gathered list.
    """
    anchor = torch.empty(0, requires_grad=True)  # makes the outputs require grad on every rank, see above
    outputs: tuple[Tensor, ...] = _Gather.apply(group, result, anchor)  # type: ignore[no-untyped-call]
    pieces = list(outputs)
    rank = dist.get_rank(group)
    if not pieces[rank].requires_grad and result.numel() > 0:
        pieces[rank] = result  # plain-gather fallback: the caller's own object, as without sync_grads
    return pieces


class _Gather(torch.autograd.Function):
    """All-gather forward, reduce-scatter (as an all-reduce) backward."""

    @staticmethod
    def forward(ctx: Any, group: Any, result: Tensor, anchor: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        plan, gathered = exchange_entries(
            [result.detach()], group, context=_CONTEXT, label=_LABEL, timeout=_transport.default_timeout()
        )
        assert plan is not None  # no `stop` given
        pieces = [piece for piece in gathered[0] if isinstance(piece, Tensor)]
        dtype = plan.entries[0].dtype
        if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
            ctx.mark_non_differentiable(*pieces)
            return tuple(pieces)
        ctx.set_materialize_grads(False)
        ctx.group, ctx.rank, ctx.numels, ctx.dtype = group, dist.get_rank(group), plan.entries[0].numels, dtype
        ctx.input = (result.shape, result.dtype, result.device)
        # Fresh tensors, not views of the receive buffer: views made inside a custom Function refuse in-place ops.
        return tuple(piece.clone() for piece in pieces)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, Tensor | None, None]:
        numels: list[int] = ctx.numels
        offsets = [sum(numels[:rank]) for rank in range(len(numels) + 1)]
        shape, dtype, device = ctx.input
        like = next((g.device for g in grads if g is not None), device)
        # Half-precision gradients are summed in float32; complex ones are summed as pairs of reals by torch.
        flat = torch.zeros(
            offsets[-1],
            dtype=torch.promote_types(ctx.dtype, torch.float32),
            device=_transport.transport_device(ctx.group, like),
        )
        for grad, start, numel in zip(grads, offsets[:-1], numels, strict=True):
            if grad is not None and numel > 0:
                flat[start : start + numel].copy_(grad.reshape(-1))
        if offsets[-1] > 0:  # every rank knows the sizes: all of them skip alike when there is nothing to send
            _all_reduce_sum(flat, ctx.group)
        if not ctx.needs_input_grad[1]:
            return None, None, None
        mine = flat[offsets[ctx.rank] : offsets[ctx.rank + 1]]
        return None, mine.view(shape).to(device=device, dtype=dtype), None


def _all_reduce_sum(flat: Tensor, group: Any) -> None:
    timeout = _transport.default_timeout()
    if timeout is None:
        dist.all_reduce(flat, group=group)
        return
    work = dist.all_reduce(flat, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as err:
        raise SyncTimeoutError(
            f"backward of gather_all_tensors(sync_grads=True): rank {dist.get_rank(group)} waited {timeout:g} s for"
            " the other ranks to run the same backward; at least one never did. With sync_grads=True every rank must"
            " call backward on a loss that depends on the gathered output, at the same step, empty ranks included."
            " The process group now has a pending collective and should not be used for anything else."
        ) from err
