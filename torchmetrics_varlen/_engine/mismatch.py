"""Refusals every rank raises alike from the exchanged records, and the text that says why.

The checks read the ``[world_size, words]`` table every rank holds alike (:mod:`.record`), so every rank raises the
same `SyncMismatchError` (or `ValueError`) at the same step, none left waiting in a collective: ``check_headers``
first, then the plan through ``raise_uneven`` and ``refuse_host_grad``. Messages list each rank's value.
"""

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen._engine.record import (
    DTYPES,
    ERR_DIM,
    ERR_DTYPE,
    ERR_LAYOUT,
    ERR_LIST_DTYPE,
    ERR_NDIM,
    ERR_NONE,
    ERR_NOT_TENSOR,
    ERR_OBJECT,
    FLAG_DIFF,
    H_CAP,
    H_CONTEXT,
    H_ERROR,
    H_ERROR_ENTRY,
    H_FLAGS,
    H_LABEL,
    H_MAGIC,
    H_N,
    KIND_LIST,
    KIND_TENSOR,
    LABEL_WORDS,
    MAGIC,
    MAX_DIM,
    MAX_NDIM,
    REDUCE_FLAGS,
    REDUCE_MASK,
    decode_text,
    object_detail,
    record_words,
    unpack_slots,
)
from torchmetrics_varlen.errors import SyncMismatchError

# What a rank's local problem (``H_ERROR``, found by ``record.describe``) is, in a message.
_ERROR_TEXT = MappingProxyType(
    {
        ERR_DIM: f"a tensor with a dimension larger than {MAX_DIM} (flatten it, or use a `cat` list state)",
        ERR_NDIM: f"a tensor with more than {MAX_NDIM} dimensions",
        ERR_LIST_DTYPE: "a list state whose tensors have different dtypes",
        ERR_NOT_TENSOR: "a list state holding something that is not a tensor",
        ERR_LAYOUT: "a sparse or otherwise non-strided tensor",
        ERR_DTYPE: "a tensor of a dtype the protocol cannot carry",
    }
)


def check_headers(table: Tensor, what: str, names: Callable[[int], str] | None = None) -> None:
    """Raise `SyncMismatchError` on every rank alike when the ranks do not sync the same thing (``names``: entries)."""
    if table.device.type == "cpu" and _headers_agree(table.numpy()):  # every sync checks: the common case, fast
        return
    if not bool((table[:, H_MAGIC] == MAGIC).all()):
        bad = (table[:, H_MAGIC] != MAGIC).nonzero().flatten().tolist()
        raise SyncMismatchError(
            f"{what}: ranks {bad} are not running the torchmetrics_varlen sync protocol (version {MAGIC & 0xFFFF}) at"
            " this point. Every rank must call the same sync in the same order; mixing torchmetrics_varlen versions or"
            " stock collectives at the same step is not supported."
        )
    keys = table[:, [H_CONTEXT, H_N]]
    if not bool((keys == keys[:1]).all()):
        raise SyncMismatchError(
            f"{what}: ranks are syncing different things at the same time (different metric, state layout, or phase:"
            " per-step sync vs epoch compute). Every rank must sync the same metrics in the same order.\n"
            + rank_lines(table)
        )
    diff = (table[:, H_FLAGS] & FLAG_DIFF) != 0
    if bool(diff.any()) and not bool(diff.all()):
        raise SyncMismatchError(
            f"{what}: ranks {diff.nonzero().flatten().tolist()} run a differentiable sync (`sync_grads=True` in grad"
            " mode) and the others do not; the backward pass would wait for them. Run the same code on every rank"
            " (same `sync_grads`, same `torch.no_grad()` context).\n" + rank_lines(table)
        )
    modes = table[:, H_FLAGS] & REDUCE_MASK
    if not bool((modes == modes[:1]).all()):
        mode_names = {flag: mode for mode, flag in REDUCE_FLAGS.items()}
        per_rank = ", ".join(
            f"rank {rank}: {mode_names.get(int(mode), '?')!r}" for rank, mode in enumerate(modes.tolist())
        )
        raise SyncMismatchError(
            f"{what}: the ranks run with different `TORCHMETRICS_VARLEN_REDUCE` settings ({per_rank}); they would move"
            " the states by different collectives. Set the same value (or none) in every rank's environment."
        )
    invalid = (table[:, H_CAP] <= 0).nonzero().flatten().tolist()
    if invalid:
        raise SyncMismatchError(
            f"{what}: expected `TORCHMETRICS_VARLEN_SYNC_CAP` to be a number of bytes of at least 1024 (such as"
            f" '64MiB') but ranks {invalid} have a value that does not parse. Fix it, or unset it, on those ranks."
        )
    failing = (table[:, H_ERROR] != ERR_NONE).nonzero().flatten().tolist()
    if failing:
        rank = failing[0]
        error, entry = int(table[rank, H_ERROR]), int(table[rank, H_ERROR_ENTRY])
        name = f"`{names(entry)}`" if names is not None else f"entry {entry}"
        if error == ERR_OBJECT:  # the item's index and type ride after the rank's slots
            item, type_name = object_detail(table[rank, record_words(int(table[rank, H_N])) :].tolist())
            raise SyncMismatchError(
                f"{what}: expected every item of list state {name} to be a tensor or a picklable object, but item"
                f" {item} on rank {rank} is a `{type_name}` that pickle refuses; it cannot be synced. Keep tensors,"
                " numbers, strings or other picklable values in list states (convert the item, or give its class"
                " `__reduce__`)."
            )
        raise SyncMismatchError(
            f"{what}: rank {rank} holds {_ERROR_TEXT.get(error, 'an unsupported value')} in {name}; it cannot"
            " be synced.\n" + rank_lines(table, entry)
        )


def _headers_agree(header: Any) -> bool:
    """Whether every rank's header (a row of ``header``, a host table) passes all of :func:`check_headers`' checks."""
    first = header[0]
    if first[H_MAGIC] != MAGIC or first[H_CAP] <= 0 or first[H_ERROR] != ERR_NONE:
        return False
    agreed = header[:, [H_MAGIC, H_CONTEXT, H_N, H_ERROR]] == first[[H_MAGIC, H_CONTEXT, H_N, H_ERROR]]
    flags = header[:, H_FLAGS] & (FLAG_DIFF | REDUCE_MASK)  # other flags may differ by rank
    return bool(agreed.all() and (flags == flags[0]).all() and (header[:, H_CAP] > 0).all())


class ObjectsBesideTensorsError(SyncMismatchError):
    """Some ranks hold objects in a list state where others hold tensors only: every rank sends it again as objects.

    The states layer catches it and syncs again with those states as objects (:mod:`.objects`); others see a mismatch.
    """

    def __init__(self, what: str, positions: list[int], names: Callable[[int], str]) -> None:
        listing = ", ".join(f"`{names(position)}`" for position in positions)
        super().__init__(
            f"{what}: expected list states {listing} to hold tensors on every rank or objects on every rank, but"
            " some ranks hold Python objects there and others tensors only."
        )
        self.positions = positions


def refuse_host_grad(what: str, ranks: list[int]) -> None:
    """Raise on every rank: a differentiable sync of CPU tensors in a process that uses CUDA (see :mod:`.group`)."""
    raise ValueError(
        f"{what}: expected the tensors of a differentiable sync (`sync_grads=True` in grad mode) on the device the"
        f" gradients come from, but ranks {ranks} hold them on the CPU while their process uses CUDA. Their backward"
        " all-reduce would wait for copies on the CPU's autograd thread while DDP issues its gradient all-reduces from"
        " the CUDA thread, and the two can reach the process group in a different order on different ranks (a hang"
        " or mixed-up gradients). Keep the metric on the model's device (`metric.to(device)`, updated with CUDA"
        " tensors rather than `.cpu()` copies), or sync without gradients (`sync_grads=False`)."
    )


def raise_uneven(
    problems: Tensor,
    indices: list[int],
    codes: Tensor,
    ndims: Tensor,
    nonempty: Tensor,
    table: Tensor,
    what: str,
    names: Callable[[int], str],
) -> None:
    """Raise `SyncMismatchError` for the first entry with a problem (``problems``: ``[check, m]``), its first check."""
    position = problems.any(dim=0).tolist().index(True)
    check, index = problems[:, position].tolist().index(True), indices[position]
    name = names(index)
    if check == 0:
        raise SyncMismatchError(f"{what}: {name} refers to a later entry; this is a torchmetrics_varlen bug.")
    lines = "\nEach rank's value:\n" + rank_lines(table, index)
    if check == 1:
        raise SyncMismatchError(
            f"{what}: expected `{name}` to be a tensor on every rank or a list on every rank, but it is a tensor on"
            " some ranks and a list on others. Register the state with the same default on every rank." + lines
        )
    if check == 4:
        raise SyncMismatchError(
            f"{what}: expected `{name}` (dist_reduce_fx='cat') to have the same shape after the first dimension on"
            " every rank that holds data, since the ranks' data are concatenated along the first dimension, but the"
            " ranks differ. Give the state the same trailing dims on every rank." + lines
        )
    found = sorted(set((codes if check == 2 else ndims)[position][nonempty[position]].tolist()))
    if check == 2:
        raise SyncMismatchError(
            f"{what}: expected `{name}` to have one dtype on every rank that holds data, but got"
            f" {sorted(dtype_name(c) for c in found)}. Cast the state to one dtype on every rank." + lines
        )
    raise SyncMismatchError(
        f"{what}: expected `{name}` to have the same number of dimensions on every rank that holds"
        f" data, but got {found}." + lines
    )


def rank_lines(table: Tensor, entry: int | None = None) -> str:
    """One line per rank saying what it synced (and, with ``entry``, what it held there): error messages."""
    lines = []
    for rank, row in enumerate(table.tolist()):
        text = f"  rank {rank}: {decode_text(row[H_LABEL : H_LABEL + LABEL_WORDS]) or '?'}"
        if entry is not None and entry < row[H_N] and len(row) >= record_words(entry + 1):
            packed = torch.tensor(row[record_words(entry) : record_words(entry + 1)], dtype=torch.int64)
            kind, code, numel, items, _, ndim, *dims = unpack_slots(packed).tolist()  # see ``E_*``
            if kind == KIND_LIST:
                joined = "mixed" if ndim > MAX_NDIM else str(("*", *dims[1:ndim])).replace("'", "")
                text += f", list of {items} tensors, {numel} elements, joined shape={joined}, dtype={dtype_name(code)}"
            elif kind == KIND_TENSOR:
                text += f", shape={tuple(dims[:ndim])}, dtype={dtype_name(code)}"
        lines.append(text)
    return "\n".join(lines)


def dtype_name(code: int) -> str:
    """Readable name of a dtype code, for error messages."""
    return str(DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(DTYPES) else "-"


def memory_message(what: str, failing: list[int], nbytes: int, failure: BaseException | None, rank: int) -> str:
    """The text of the ``SyncMemoryError`` every rank raises when ranks ``failing`` could not allocate ``nbytes``."""
    here = f" This rank ({rank}) got: {str(failure).strip().splitlines()[0]}." if failure else ""
    return (
        f"{what}: ranks {failing} could not allocate the {_readable(nbytes)} per rank that this sync receives into;"
        f" no data has moved, and every rank raises this error.{here} Free memory on those ranks, or use"
        " `torchmetrics_varlen.compute_on_rank(metric, dst=0)` so that only one rank receives the data. The transfer"
        " cap (`sync_cap=`, `TORCHMETRICS_VARLEN_SYNC_CAP`) bounds what a sync allocates beyond its result, not the"
        " result itself. The process group is unharmed."
    )


def _readable(nbytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes} bytes"
