"""Steps 4 and 6 of the protocol (:mod:`torchmetrics_varlen._protocol`): pack, and cut back out.

``pack`` copies the local entries into one send buffer; ``unpack`` cuts every rank's entries out of the received
buffers as views with their true shape and dtype.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen._protocol import (
    KIND_LIST,
    KIND_TENSOR,
    MAX_NDIM,
    Entry,
    EntryPlan,
    LocalEntry,
    Plan,
    Ref,
    _shape_slots,
)


class StackedRanks(list[Tensor]):
    """Per-rank tensors of a dense entry, kept stacked: a stacking reduction uses ``stacked`` and never unbinds."""

    def __init__(self, stacked: Tensor) -> None:
        super().__init__()
        self.stacked = stacked
        self._unbound = False

    def _unbind(self) -> None:
        if not self._unbound:
            self._unbound = True
            super().extend(self.stacked.unbind(0))

    def __len__(self) -> int:
        return int(self.stacked.shape[0])

    def __iter__(self) -> Any:
        self._unbind()
        return super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        self._unbind()
        return super().__getitem__(index)

    def __setitem__(self, index: Any, value: Any) -> None:
        self._unbind()
        super().__setitem__(index, value)


_SEND_BUFFERS: dict[torch.device, Tensor] = {}
SEND_BUFFER_CACHE_BYTES = 64 * 2**20


def _send_buffer(nbytes: int, device: torch.device) -> Tensor:
    """A send buffer of ``nbytes``; on the CPU reused between syncs (up to 64 MiB), since fresh pages cost time.

    Reuse is safe because nothing refers to the send buffer once its collective returned; received data lives in
    buffers of its own. CUDA's caching allocator already reuses memory, so only CPU buffers are kept.
    """
    cached = _SEND_BUFFERS.get(device)
    if cached is not None and cached.numel() >= nbytes:
        return cached[:nbytes]
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type == "cpu" and nbytes <= SEND_BUFFER_CACHE_BYTES:
        _SEND_BUFFERS[device] = buffer
    return buffer


def pack(entries: Sequence[LocalEntry], plan: Plan, rank: int, device: torch.device) -> Tensor:
    """Copy this rank's entries into one ``uint8`` buffer of the transfer size (``plan.max_bytes``)."""
    buffer = _send_buffer(plan.max_bytes, device)
    with torch.no_grad():
        for group in plan.groups:
            flat = [entries[i].reshape(-1) for i in group.indices]  # type: ignore[union-attr]  # dense: tensors
            torch.cat(flat, out=buffer[group.start : group.start + group.nbytes].view(group.dtype))
        for entry, eplan in zip(entries, plan.entries):
            if isinstance(entry, Ref) or eplan.dense:
                continue
            offset = eplan.offsets[rank]
            items = [entry] if isinstance(entry, Tensor) else entry
            if eplan.kind == KIND_LIST:
                shape_table = [slot for item in items for slot in _shape_slots(item.shape)]
                table_view = buffer[offset : offset + len(shape_table) * 8].view(torch.int64)
                table_view.copy_(torch.tensor(shape_table, dtype=torch.int64))
                offset += eplan.table_bytes[rank]
            if eplan.dtype is None:
                continue
            for item in items:
                nbytes = item.numel() * eplan.dtype.itemsize
                if nbytes:
                    buffer[offset : offset + nbytes].view(eplan.dtype).view(item.shape).copy_(item)
                    offset += nbytes
    return buffer


def unpack(
    rows: Sequence[Tensor], plan: Plan, devices: Sequence[torch.device], join: Sequence[bool] | None = None
) -> list[list[Entry]]:
    """Cut every rank's entries out of the gathered buffers: ``result[entry][rank]`` with true shape and dtype.

    For list entries flagged in ``join`` (``cat`` states), a rank's items come back as one tensor (its items share a
    trailing shape and lie back to back in the buffer, so this is a view, not a copy).
    """
    dense: dict[int, list[Entry]] = {}
    for group in plan.groups:
        block = torch.stack([row[group.start : group.start + group.nbytes] for row in rows]).view(group.dtype)
        for index, part in zip(group.indices, torch.split(block, group.numels, dim=1)):
            stacked = part.view(plan.world_size, *plan.entries[index].shapes[0])
            if stacked.device != devices[index]:
                stacked = stacked.to(devices[index])
            dense[index] = StackedRanks(stacked)  # type: ignore[assignment]
    result: list[list[Entry]] = []
    for index, (eplan, device) in enumerate(zip(plan.entries, devices, strict=True)):
        if eplan.dense:
            result.append(dense[index])
            continue
        per_rank: list[Entry] = []
        for rank in range(plan.world_size):
            row = rows[rank] if rows else torch.empty(0, dtype=torch.uint8)
            if eplan.refs[rank] >= 0:
                per_rank.append(result[eplan.refs[rank]][rank])
            elif eplan.kind == KIND_TENSOR:
                per_rank.append(_unpack_tensor(row, eplan, rank, device))
            else:
                per_rank.append(_unpack_list(row, eplan, rank, device, bool(join and join[index])))
        result.append(per_rank)
    return result


def _section(row: Tensor, dtype: torch.dtype, start: int, numel: int) -> Tensor:
    return row[start : start + numel * dtype.itemsize].view(dtype)


def _unpack_tensor(row: Tensor, eplan: EntryPlan, rank: int, device: torch.device) -> Tensor:
    if eplan.numels[rank] == 0:
        shape = eplan.empty_shape if eplan.empty_shape is not None else eplan.shapes[rank]
        dtype = eplan.dtype or eplan.own_dtypes[rank] or torch.get_default_dtype()
        return torch.empty(shape, dtype=dtype, device=device)
    assert eplan.dtype is not None  # a rank with data has a dtype
    data = _section(row, eplan.dtype, eplan.offsets[rank], eplan.numels[rank]).view(eplan.shapes[rank])
    return data.to(device)


def _unpack_list(row: Tensor, eplan: EntryPlan, rank: int, device: torch.device, join: bool) -> list[Tensor]:
    count = eplan.items[rank]
    if count == 0:
        return []
    offset = eplan.offsets[rank]
    table = row[offset : offset + count * (1 + MAX_NDIM) * 8].view(torch.int64).view(count, 1 + MAX_NDIM).tolist()
    dtype = eplan.dtype if eplan.dtype is not None else torch.get_default_dtype()
    data = None
    if eplan.dtype is not None:
        data = _section(row, eplan.dtype, offset + eplan.table_bytes[rank], eplan.numels[rank])
    if join and data is not None and count > 1:
        shapes = [tuple(slots[1 : 1 + slots[0]]) for slots in table]
        if all(len(shape) <= 1 for shape in shapes):  # scalars and vectors: what dim_zero_cat makes of them
            return [data.to(device)]
        trailing = {shape[1:] for shape in shapes}
        if len(trailing) == 1 and all(len(shape) > 1 for shape in shapes):
            return [data.view(-1, *trailing.pop()).to(device)]
    items, start = [], 0
    for slots in table:
        shape = tuple(slots[1 : 1 + slots[0]])
        numel = 1
        for size in shape:
            numel *= size
        if data is None or numel == 0:
            items.append(torch.empty(shape, dtype=dtype, device=device))
        else:
            items.append(data[start : start + numel].view(shape).to(device))
        start += numel
    return items
