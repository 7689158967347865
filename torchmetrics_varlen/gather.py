"""A varlen-safe ``gather_all_tensors``: the ``dist_sync_fn`` hook for any torchmetrics metric."""

from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine.grad import differentiable_dtype
from torchmetrics_varlen._engine.group import default_timeout, link, sent_cap
from torchmetrics_varlen._engine.pack import Stacked
from torchmetrics_varlen._engine.record import FLAG_DIFF, context_hash
from torchmetrics_varlen.errors import SyncTimeoutError

__all__ = ["gather_all_tensors"]

_HOOK_CONTEXT = context_hash("torchmetrics_varlen.gather_all_tensors")
# Its own context: ranks that disagree on `sync_grads` raise `SyncMismatchError` instead of hanging in backward.
_GRAD_CONTEXT = context_hash("torchmetrics_varlen.gather_all_tensors(sync_grads=True)")

HOOK_LIMIT = (
    " This sync is the `gather_all_tensors` hook, which torchmetrics calls once per tensor: for a list state with"
    " `dist_reduce_fx=None` (the `indexes`, `preds` and `target` of the retrieval metrics, for example) once per list"
    " item, and not at all on a rank whose list is empty, so a rank without data (or with fewer `update()` calls)"
    ' never arrives and usually raises on its own ("No samples to concatenate"). No hook can change that: use'
    " `torchmetrics_varlen.rebase(<the metric class>)`, which syncs every state in one exchange whatever each rank"
    " holds."
)


def gather_all_tensors(result: Tensor, group: Any | None = None, *, sync_grads: bool = False) -> list[Tensor]:
    """Gather a tensor from every rank, whatever its shape on each rank; a drop-in for torchmetrics' function.

    Pass it as ``dist_sync_fn`` to any torchmetrics metric: one metadata and one data exchange (one in all for a small
    tensor of the same shape on every rank; none without a process group or in a group of one), never a barrier.

    * Shapes may differ along any dimension between ranks, 0-d and zero-size tensors included.
    * A rank without data (any zero-element tensor, such as stock's ``torch.tensor([])`` for an empty ``cat`` list)
      gets an empty tensor with the dtype and trailing shape of the ranks that have data; when no rank holds data,
      the dtype of the ranks' own zero-length items (what one process keeps).
    * Ranks whose non-empty tensors differ in dtype or number of dimensions raise
      :class:`~torchmetrics_varlen.SyncMismatchError` together, with each rank's shape and dtype in the message.
      A 0-d tensor is accepted beside 1-d ones (a one-element ``cat`` list arrives 0-d).
    * Element ``rank`` of the result is ``result`` itself, so its autograd graph (rank-local) is kept; the other
      elements carry no graph. With ``sync_grads=True`` every element is differentiable and the backward pass sends
      each rank the gradient of its own samples, summed over all ranks (see the "Metrics as losses" docs page).
    * Torchmetrics calls the hook once per item of a ``dist_reduce_fx=None`` list: ranks with different numbers of
      items raise :class:`~torchmetrics_varlen.SyncTimeoutError`; use :func:`~torchmetrics_varlen.rebase` there.

    Args:
        result: this rank's tensor.
        group: the process group to gather over; the default group when None.
        sync_grads: make the gather differentiable across ranks (every rank must then run the backward pass).

    Returns:
        A list with one tensor per rank of ``group``, on ``result``'s device; element i is rank i's tensor with its
        true shape and dtype.

    Example:
        Without a process group the tensor comes back alone, untouched:

        >>> import torch
        >>> from torchmetrics_varlen import gather_all_tensors
        >>> x = torch.tensor([1.0, 2.0])
        >>> gathered = gather_all_tensors(x)
        >>> len(gathered), gathered[0] is x
        (1, True)

        As a hook on a stock metric:

        >>> from torchmetrics.classification import BinaryAUROC
        >>> metric = BinaryAUROC(dist_sync_fn=gather_all_tensors)
        >>> metric.update(torch.tensor([0.1, 0.8, 0.6]), torch.tensor([0, 1, 0]))
        >>> metric.compute()
        tensor(1.)
    """
    if not isinstance(result, Tensor):
        raise TypeError(f"Expected `result` to be a torch.Tensor but got {type(result).__name__}")
    label = "gather_all_tensors(grad)" if sync_grads else "gather_all_tensors"
    # No metric here: the tensor never picks the backend of a group with several (the accelerator's where CUDA is
    # available, on every rank alike), only the device of the kind picked.
    sync_link = link(group, None, default_timeout(), f"sync of {label}", result.device)
    if sync_link is None:
        return [result]
    request = _engine.Request(
        [result],
        _GRAD_CONTEXT if sync_grads else _HOOK_CONTEXT,
        label,
        # One autograd node whose backward is one all-reduce; under no_grad, the plain gather.
        flags=FLAG_DIFF if sync_grads and torch.is_grad_enabled() else 0,
        names=lambda index: "the tensor passed to gather_all_tensors",
        cap=sent_cap(None),
        grad="always",
    )
    try:
        synced = _engine.run(request, sync_link)
    except SyncTimeoutError as err:  # the waiting ranks: name the case the hook cannot help with
        raise SyncTimeoutError(str(err) + HOOK_LIMIT) from err
    assert synced is not None  # no `stop` given
    rank, gathered = sync_link.rank, synced.results[0]
    per_rank: list[Tensor] = list(gathered.tensor.unbind(0)) if isinstance(gathered, Stacked) else list(gathered)  # type: ignore[union-attr, arg-type]
    dtype = synced.plan.entries[0].dtype
    if dtype is None and len({piece.dtype for piece in per_rank}) > 1:
        # No rank holds data and the dtypes differ: take that of the ranks' own zero-length items, as one process
        # would. Stock sends `torch.tensor([])` of the metric's dtype (1-D, floating) for an empty list, so a piece of
        # another kind says what the items are; else one of a dtype other than the default; else the first rank's.
        own = [piece.dtype for piece in per_rank if piece.ndim != 1 or not piece.is_floating_point()]
        default = torch.get_default_dtype()
        common = (own or [piece.dtype for piece in per_rank if piece.dtype != default] or [per_rank[0].dtype])[0]
        per_rank = [piece.to(common) for piece in per_rank]  # every rank sees the same pieces: all pick alike
    if synced.plan.differentiable and differentiable_dtype(dtype):
        return per_rank  # every piece is an output of the differentiable step
    if result.numel() > 0:
        per_rank[rank] = result  # the caller's own object: its autograd graph stays intact
    elif result.requires_grad:
        # An empty rank's piece takes the peers' dtype and shape, but stays connected to the caller's graph, so a
        # loss built from it still reaches this rank's parameters (DDP needs every rank's backward).
        per_rank[rank] = result.reshape(per_rank[rank].shape).to(per_rank[rank].dtype)
    return per_rank
