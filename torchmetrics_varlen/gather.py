"""A varlen-safe ``gather_all_tensors``: the ``dist_sync_fn`` hook for any torchmetrics metric."""

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen import _buffers, _protocol, _transport
from torchmetrics_varlen._protocol import Entry, LocalEntry, Plan

__all__ = ["gather_all_tensors"]

_HOOK_CONTEXT = _protocol.context_hash("torchmetrics_varlen.gather_all_tensors")


def exchange_entries(
    entries: Sequence[LocalEntry],
    group: Any,
    *,
    context: int,
    label: str,
    timeout: float | None = None,
    synced: bool = False,
    join: Sequence[bool] | None = None,
    stop: Callable[[list[list[int]]], bool] | None = None,
) -> tuple[Plan | None, list[list[Entry]]]:
    """Run the protocol on a list of entries: at most two collectives, whatever the entries hold.

    Returns the plan every rank agreed on and ``result[entry][rank]`` (``join``: see ``_buffers.unpack``).
    The caller must have checked that a sync is needed (``_transport.world_of(group)`` is not None). When every rank
    reports ``synced``, or nobody holds any bytes, the data exchange is skipped on every rank alike; when ``stop``
    says so from the metadata table, the sync ends there and returns ``(None, [])`` (every rank sees the same table).
    """
    world = _transport.world_of(group)
    assert world is not None
    rank, _ = world
    like = next((e.device for e in iter_tensors(entries)), torch.device("cpu"))
    device = _transport.transport_device(group, like)
    what = f"sync of {label}"
    record = _protocol.describe(entries, context, label, synced)
    table, digest = exchange_records(record, group, device, timeout, what)
    if stop is not None and stop(table):
        return None, []
    plan = _protocol.make_plan(table, what, digest)
    if plan.all_synced:
        return plan, []
    if plan.max_bytes == 0:
        rows: list[Tensor] = []
    else:
        buffer = _buffers.pack(entries, plan, rank, device)
        rows = _transport.exchange_payload(buffer, plan.nbytes, group)
    devices = [entry_device(entry, like) for entry in entries]
    return plan, _buffers.unpack(rows, plan, devices, join)


def exchange_records(
    record: list[int], group: Any, device: torch.device, timeout: float | None, what: str
) -> tuple[list[list[int]], bytes]:
    """Exchange records of one size on every rank, whatever each holds: a mismatch must be an error, not an abort.

    Returns the table as nested Python ints (one device-to-host copy), cut to the slots in use, and a digest of it
    (the key of the plan cache, see ``_protocol.make_plan``).
    """
    fixed = _protocol.HEADER_LEN + _protocol.RECORD_SLOTS * _protocol.ENTRY_LEN
    table = _transport.exchange_metadata(_pad(record, fixed), group, device, timeout, what).cpu()
    ours = bool((table[:, _protocol.H_MAGIC] == _protocol.MAGIC).all())  # else make_plan raises, naming the ranks
    longest = int(table[:, _protocol.H_N].max())
    if ours and longest > _protocol.RECORD_SLOTS:  # decided from the headers, so every rank takes this branch together
        full = _protocol.HEADER_LEN + longest * _protocol.ENTRY_LEN
        table = _transport.exchange_metadata(_pad(record, full), group, device, timeout, what).cpu()
    if ours:
        table = table[:, : _protocol.HEADER_LEN + longest * _protocol.ENTRY_LEN]
    digest = hashlib.blake2b(table.contiguous().numpy().tobytes(), digest_size=32).digest()
    return table.tolist(), digest


def _pad(record: list[int], length: int) -> list[int]:
    return record[:length] + [0] * (length - len(record))


def iter_tensors(entries: Sequence[LocalEntry]) -> list[Tensor]:
    out: list[Tensor] = []
    for entry in entries:
        if isinstance(entry, Tensor):
            out.append(entry)
        elif isinstance(entry, list):
            out.extend(t for t in entry if isinstance(t, Tensor))
    return out


def entry_device(entry: LocalEntry, default: torch.device) -> torch.device:
    if isinstance(entry, Tensor):
        return entry.device
    if isinstance(entry, list) and entry and isinstance(entry[0], Tensor):
        return entry[0].device
    return default


def gather_all_tensors(result: Tensor, group: Any | None = None, *, sync_grads: bool = False) -> list[Tensor]:
    """Gather a tensor from every rank, whatever its shape on each rank; a drop-in for torchmetrics' function.

    Pass it as ``dist_sync_fn`` to any torchmetrics metric. It costs one fixed-size metadata exchange and one data
    exchange (none at all without a process group or in a group of one), never a barrier.

    * Shapes may differ along any dimension between ranks, 0-d and zero-size tensors included.
    * A rank without data (any zero-element tensor, such as the ``torch.tensor([])`` that torchmetrics sends for an
      empty ``cat`` list) gets an empty tensor with the dtype and trailing shape of the ranks that have data.
    * Ranks whose non-empty tensors differ in dtype or number of dimensions raise
      :class:`~torchmetrics_varlen.SyncMismatchError` together, with each rank's shape and dtype in the message.
      A 0-d tensor is accepted beside 1-d ones (a one-element ``cat`` list arrives 0-d).
    * Element ``rank`` of the result is ``result`` itself, so its autograd graph (rank-local) is kept; the other
      elements carry no graph. With ``sync_grads=True`` every element is differentiable and the backward pass sends
      each rank the gradient of its own samples, summed over all ranks (see the "Metrics as losses" docs page).

    Args:
        result: this rank's tensor.
        group: the process group to gather over; the default group when None.
        sync_grads: make the gather differentiable across ranks (every rank must then run the backward pass).

    Returns:
        A list with one tensor per rank of ``group``; element i is rank i's tensor with its true shape and dtype.

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
    world = _transport.world_of(group)
    if world is None:
        return [result]
    if sync_grads:
        from torchmetrics_varlen._autograd import differentiable_gather

        return differentiable_gather(result, group)
    rank, _ = world
    _, gathered = exchange_entries(
        [result], group, context=_HOOK_CONTEXT, label="gather_all_tensors", timeout=_transport.default_timeout()
    )
    per_rank: list[Tensor] = [t for t in gathered[0] if isinstance(t, Tensor)]
    if result.numel() > 0:
        per_rank[rank] = result  # the caller's own object: its autograd graph stays intact
    elif result.requires_grad:
        # An empty rank's piece takes the peers' dtype and shape, but stays connected to the caller's graph, so a
        # loss built from it still reaches this rank's parameters (DDP needs every rank's backward).
        per_rank[rank] = result.reshape(per_rank[rank].shape).to(per_rank[rank].dtype)
    return per_rank
