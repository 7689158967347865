"""Combining one state's per-rank values the way torchmetrics combines the states its gather returns.

:func:`reduce_state` takes an entry's result as unpacking gives it (see :mod:`torchmetrics_varlen._buffers`):
all-reduced (the sum, max or min of the ranks), joined (a `cat` state's data of every rank, concatenated), stacked (a
dense state as ``[world_size, *shape]``), or one piece per rank (uneven tensors, list items). Each comes back with the
value and dtype stock's reduction gives, with this rank's own tensors in place where they carry a rank-local autograd
graph, as with stock; what cannot be combined raises `SyncMismatchError` on every rank alike.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics.utilities.data import dim_zero_cat

from torchmetrics_varlen import _caches, _plan
from torchmetrics_varlen._buffers import Joined, Reduced, Result, Stacked
from torchmetrics_varlen._plan import Plan
from torchmetrics_varlen._protocol import Entry, LocalEntry
from torchmetrics_varlen.errors import SyncMismatchError


@functools.lru_cache(maxsize=256)
def _result_dtype(reduction: Any, dtype: torch.dtype) -> torch.dtype:
    """The dtype stock's ``reduction`` gives for stacked states of ``dtype`` (``torch.sum`` widens integers)."""
    return reduction(torch.empty(2, 1, dtype=dtype, device="meta")).dtype  # type: ignore[no-any-return]


def reduce_state(
    result: Result,
    reduction: Any,
    op: int,
    own: LocalEntry | None,
    rank: int,
    plan: Plan,
    where: Callable[[int], str],
    index: int,
    empty: tuple[torch.dtype, torch.device] | None = None,
) -> Any:
    """Combine one state's per-rank values the way torchmetrics does after its gather.

    ``empty`` is the (dtype, device) of a `cat` state that no rank holds an item of: stock gathers the
    ``torch.tensor([], dtype=metric.dtype)`` each rank sends for its empty list, and gets that back concatenated.
    """
    if isinstance(result, Reduced):
        return _reduced_value(result, reduction, op, plan, index)
    if isinstance(result, Joined):
        return _joined_value(result, own, rank, plan, index, empty)
    if isinstance(result, Stacked):
        return stacked_value(result, reduction, own, rank)
    return _pieces_value(result, reduction, own, rank, where, index, empty)


def _reduced_value(result: Reduced, reduction: Any, op: int, plan: Plan, index: int) -> Tensor:
    """An all-reduced state in the dtype and with the signed zeros stock's reduction of the stacked ranks gives."""
    dtype = plan.entries[index].dtype
    assert dtype is not None  # a dense entry has one
    value = result.tensor
    if value.is_floating_point():
        value = value + 0.0  # torch.sum starts from +0.0: a sum of zeros that are all -0.0 is +0.0 with stock
    value = value / plan.world_size if op == _plan.OP_MEAN else value
    return value.to(_result_dtype(reduction, dtype))


def _joined_value(
    result: Joined,
    own: LocalEntry | None,
    rank: int,
    plan: Plan,
    index: int,
    empty: tuple[torch.dtype, torch.device] | None,
) -> Tensor | list[Tensor]:
    """A `cat` state joined over the ranks; this rank's section is its own tensors where they carry a graph."""
    if result.tensor is None:
        return _empty_cat(empty)
    if not carries_graph(own):
        return result.tensor
    # This rank's section comes from its own tensors, so their rank-local graph survives, as with stock.
    numels = plan.entries[index].numels
    start, stop = int(numels[:rank].sum()), int(numels[: rank + 1].sum())
    joined = result.tensor
    mine = dim_zero_cat(own if isinstance(own, list) else [own]).reshape(-1, *joined.shape[1:])  # type: ignore[list-item]
    row = math.prod(joined.shape[1:])  # elements per row of the joined state
    return torch.cat([joined[: start // row], mine.to(joined.dtype), joined[stop // row :]])


def stacked_value(result: Stacked, reduction: Any, own: LocalEntry | None = None, rank: int = 0) -> Any:
    """A dense state's ``[world_size, *shape]`` stack, reduced (or concatenated) as stock reduces the gathered one."""
    stacked = result.tensor
    if isinstance(own, Tensor) and own.requires_grad:
        stacked = torch.cat([stacked[:rank], own.unsqueeze(0), stacked[rank + 1 :]])  # keep this rank's graph
    if reduction is dim_zero_cat:
        return stacked.reshape(-1, *stacked.shape[2:]) if stacked.ndim > 1 else stacked.clone()
    return reduction(stacked) if reduction is not None else stacked.clone()


def _pieces_value(
    result: list[Tensor | list[Tensor]],
    reduction: Any,
    own: LocalEntry | None,
    rank: int,
    where: Callable[[int], str],
    index: int,
    empty: tuple[torch.dtype, torch.device] | None,
) -> Any:
    """A state that came back as one piece per rank (a list's items, or tensors of uneven shapes), reduced."""
    per_rank: list[Entry] = list(result)
    if isinstance(per_rank[0], list):
        flat = [item for items in per_rank for item in items]  # type: ignore[union-attr]
        if not flat:
            return _empty_cat(empty) if reduction is dim_zero_cat else []
        if reduction is dim_zero_cat:
            if not all(isinstance(item, Tensor) for item in flat):
                return flat  # Python objects (see _objects): every rank's items, as one list, in rank order
            return _cat_items(flat, per_rank, where(index))
        return reduction(flat) if reduction is not None else flat
    if isinstance(own, Tensor) and (own.requires_grad or own.numel() > 0):
        per_rank[rank] = own  # this rank's own object keeps its graph
    tensors: list[Tensor] = [t for t in per_rank if isinstance(t, Tensor)]
    if reduction is dim_zero_cat:
        # Uneven `cat` tensor states: concatenate what each rank holds (stock stacks, which needs equal shapes).
        return dim_zero_cat([t for t in tensors if t.numel() > 0] or tensors[:1])
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        listing = ", ".join(f"rank {r}: {tuple(t.shape)} {_dtype_text(t)}" for r, t in enumerate(tensors))
        raise SyncMismatchError(
            f"Expected state `{where(index)}` to have the same shape on every rank (its reduction stacks them) but got"
            f" {listing}. Use dist_reduce_fx='cat' or a list state for data whose size differs between ranks."
        )
    stacked = torch.stack(tensors)
    return reduction(stacked) if reduction is not None else stacked


def _empty_cat(empty: tuple[torch.dtype, torch.device] | None) -> Tensor | list[Tensor]:
    """Stock's value of a `cat` list state that is empty on every rank: ``tensor([])`` of the metric's dtype."""
    if empty is None:  # not a metric's state (no layout names one): nothing to take a dtype from
        return []
    dtype, device = empty
    return torch.empty(0, dtype=dtype, device=device)


def _cat_items(flat: list[Tensor], per_rank: list[Entry], state: str) -> Tensor:
    """``dim_zero_cat`` of every rank's items; items that cannot be joined raise `SyncMismatchError`.

    The plan refuses ranks whose items join to different trailing dims; what is left here are lists whose items
    differ already on one rank (the plan sees no common shape for them). Every rank holds the same pieces, so every
    rank raises alike.
    """
    try:
        return dim_zero_cat(flat)
    except RuntimeError as error:
        listing = "\n".join(
            f"  rank {rank}: items of shapes {[tuple(t.shape) for t in items]}, dtype"  # type: ignore[union-attr]
            f" {_dtype_text(items[0]) if items else '-'}"
            for rank, items in enumerate(per_rank)
        )
        raise SyncMismatchError(
            f"Expected the items of `cat` state `{state}` to have the same shape after the first dimension on every"
            f" rank (they are concatenated along it) but got:\n{listing}\n({error})"
        ) from error


def _dtype_text(tensor: Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def carries_graph(own: LocalEntry | None) -> bool:
    if isinstance(own, Tensor):
        return own.requires_grad
    return isinstance(own, list) and any(isinstance(item, Tensor) and item.requires_grad for item in own)


_caches.register(
    "_reductions._result_dtype: the dtype stock's reduction gives, the same for a dtype", _result_dtype.cache_clear
)
