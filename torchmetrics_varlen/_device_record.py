"""Small states on an accelerator ride in the record too: one collective and one device-to-host copy per sync.

On the CPU, ``_protocol.describe`` appends a small sync's data to the record as words read on the host, and the
metadata exchange is the whole sync. On NCCL the record is copied to the device for the exchange anyway, so the data
of states that already live there is appended on the device instead (:func:`attach`; device-side copies, never read
on the host): the exchange moves header, slots and data in one all-gather, one copy of the table to the host feeds the
plan, and the results are cut out of the table still on the device, where the states live. Per sync: one collective,
one host-to-device copy (the header and slots), one device-to-host copy (the table).

The data is laid out exactly as ``describe`` lays out a CPU record's (``_protocol.inline_layout``), so the plan reads
both alike; whether a record carries data is each rank's own business (``FLAG_INLINE`` in its header), and the plan
takes the records' data only where every rank's did. A record that cannot carry its data goes without it, and the
data step moves it, as for any sync.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from torchmetrics_varlen import _protocol
from torchmetrics_varlen._protocol import LocalEntry

__all__ = ["DeviceRecord", "attach", "data_words", "eligible"]

ON_THE_CPU_TOO = False  # tests: take this path with CPU states on gloo, where describe would carry them itself


class DeviceRecord(list[int]):
    """A record's header and slot words, on the host, with its data on the device (``tail``).

    ``received`` holds the exchanged table as it arrived, on the device, once the exchange ran: the results are cut
    out of it.
    """

    def __init__(self, words: list[int], tail: Tensor) -> None:
        super().__init__(words)
        self.tail = tail
        self.received: Tensor | None = None


def eligible(entries: Sequence[LocalEntry], device: torch.device) -> bool:
    """Whether this rank's entries may ride on ``device``: non-empty dense tensors there, of a dtype up to 8 bytes."""
    if device.type == "cpu" and not ON_THE_CPU_TOO:
        return False
    for entry in entries:
        if not isinstance(entry, Tensor) or entry.device != device or entry.layout != torch.strided:
            return False
        if entry.numel() == 0 or entry.dtype.itemsize > 8:
            return False
    return bool(entries)


def attach(record: list[int], entries: Sequence[LocalEntry]) -> list[int]:
    """``record`` with the entries' data appended on their device (``FLAG_INLINE``), or ``record`` as it was.

    The entries passed :func:`eligible`. Their bytes are laid out as ``describe`` lays out a CPU record's data.
    """
    if record[_protocol.H_ERROR] != _protocol.ERR_NONE:
        return record
    tail = data_words([entry for entry in entries if isinstance(entry, Tensor)])
    if tail is None:
        return record
    words = list(record)
    words[_protocol.H_FLAGS] |= _protocol.FLAG_INLINE
    words[_protocol.H_WORDS] += tail.numel()
    return DeviceRecord(words, tail)


def data_words(tensors: Sequence[Tensor]) -> Tensor | None:
    """The data words of small tensors on a device, laid out as ``describe`` lays out a CPU record's, on the device.

    None where they exceed ``INLINE_MAX_BYTES`` or a dtype cannot be viewed as bytes: the data step moves them.
    """
    groups, total = _protocol.inline_layout(tuple((t.dtype, t.numel()) for t in tensors))
    if total > _protocol.INLINE_MAX_BYTES:
        return None
    device = tensors[0].device
    pieces: list[Tensor] = []
    used = 0
    try:
        for group in groups:
            if group.start > used:  # the alignment padding before a group
                pieces.append(torch.zeros(group.start - used, dtype=torch.uint8, device=device))
                used = group.start
            for index in group.indices:
                data = tensors[index].detach().reshape(-1).view(torch.uint8)
                pieces.append(data)
                used += data.numel()
    except RuntimeError:  # a dtype that cannot be viewed as bytes
        return None
    if total > used:
        pieces.append(torch.zeros(total - used, dtype=torch.uint8, device=device))
    return torch.cat(pieces).view(torch.int64)


def local_record(record: Sequence[int], words: int, device: torch.device) -> Tensor | None:
    """The ``words``-long int64 row a :class:`DeviceRecord` sends, made on ``device``; None for any other record."""
    if not isinstance(record, DeviceRecord):
        return None
    local = torch.zeros(words, dtype=torch.int64, device=device)
    meta = torch.tensor(list(record), dtype=torch.int64)
    local[: meta.numel()].copy_(meta)  # the one host-to-device copy
    local[meta.numel() : meta.numel() + record.tail.numel()].copy_(record.tail)
    return local
