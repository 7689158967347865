"""The module that runs the sync's collectives: world queries, the two exchanges, the backend choice, timeouts.

What runs where:

* gloo (CPU): tested here. Buffers live on the CPU; each exchange is one ``all_gather_single``
  (``all_gather_into_tensor`` before torch 2.13) of equal-size buffers, the smaller ones padded up to the largest.
* NCCL (CUDA): not runnable on the machines this package is tested on. Buffers live on the current CUDA device (CPU
  states, for example with ``compute_on_cpu=True``, are moved there for the transfer and back afterwards), and the data
  exchange uses NCCL's list ``all_gather``, which accepts unequal sizes, so nothing is padded.
* any other backend: buffers stay on the device of the first tensor, the exchange is the padded equal-size gather.

A metadata exchange with a sync timeout waits asynchronously; a rank still waiting after a short slice notes where it
waits in the process group's store, so that the ranks whose timeout expires can name the ranks that never arrived
(gloo and NCCL alike: every process group has a store). Quick exchanges pay nothing for this.

Collectives are looked up on ``torch.distributed`` at call time, so tests can count them by wrapping those functions.
"""

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torchmetrics_varlen.errors import SyncTimeoutError

ProcessGroup = Any  # torch.distributed.ProcessGroup; kept loose because its import path moved between torch releases

TIMEOUT_ENV = "TORCHMETRICS_VARLEN_SYNC_TIMEOUT"
DEFAULT_SYNC_TIMEOUT = 300.0


def world_of(group: ProcessGroup | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` within ``group``, or None when no sync is needed (no process group, or a group of one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size(group)
    if world_size <= 1:
        return None
    return dist.get_rank(group), world_size


def _backend(group: ProcessGroup | None) -> str:
    return str(dist.get_backend(group)).lower()


def transport_device(group: ProcessGroup | None, like: torch.device) -> torch.device:
    """The device the exchange buffers live on: the one place that knows which backend wants which device."""
    backend = _backend(group)
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    return like


def default_timeout() -> float | None:
    """Sync timeout in seconds: ``TORCHMETRICS_VARLEN_SYNC_TIMEOUT`` if set (0: only the group's own), else 300."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_SYNC_TIMEOUT
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(f"Expected `{TIMEOUT_ENV}` to be a number of seconds but got {raw!r}") from err
    return value if value > 0 else None


def _gather_equal(output: Tensor, local: Tensor, group: ProcessGroup | None, async_op: bool = False) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=async_op)


def exchange_metadata(
    record: list[int], group: ProcessGroup | None, device: torch.device, timeout: float | None, what: str
) -> Tensor:
    """Collective 1: every rank's fixed-size record, as a ``[world_size, len(record)]`` int64 tensor on ``device``.

    With a ``timeout``, a rank that is still waiting after a short first slice notes in the store where it waits, so
    that a rank whose timeout expires can name the ranks that never arrived (see :func:`_describe_missing`). A quick
    exchange touches no store.
    """
    world_size = dist.get_world_size(group)
    local = torch.tensor(record, dtype=torch.int64, device=device)
    table = torch.empty(world_size * len(record), dtype=torch.int64, device=device)
    tag = _group_tag(group)
    number = _SYNC_NUMBERS[tag] = _SYNC_NUMBERS.get(tag, 0) + 1
    if timeout is None:
        _gather_equal(table, local, group)
    else:
        work = _gather_equal(table, local, group, async_op=True)
        first = min(NOTE_AFTER, timeout / 2)  # the note is always written before the timeout expires
        if not _wait(work, first):
            store = _store()
            note = f"{tag}|{number}|{what}"
            _set_note(store, note)
            if not _wait(work, timeout - first):
                raise SyncTimeoutError(_timeout_message(what, timeout, group, _describe_missing(store, group, note)))
            _set_note(store, "")  # arrived: an old note must not describe this rank at a later timeout
    return table.view(world_size, len(record))


def _wait(work: Any, seconds: float) -> bool:
    """Wait for ``work``; False if it is still pending after ``seconds``. Other failures propagate."""
    try:
        # At least 1 ms: a zero timeout means "the process group's own timeout" to c10d.
        work.wait(timeout=datetime.timedelta(seconds=max(seconds, 0.001)))
    except RuntimeError as err:
        if "timed out" in str(err).lower() or "timeout" in str(err).lower():
            return False
        raise
    return True


# ------------------------------------------------------------------------------ who is waiting where (timeouts)
# A rank that has waited ``NOTE_AFTER`` seconds at a metadata exchange writes one key to the store every process group
# has (the rendezvous store): "<group>|<sync number>|<what>", cleared again when the exchange completes. Syncs are
# numbered per process group on each rank, so ranks that run the same syncs agree on the numbers. When a timeout
# expires, the waiting rank reads every peer's key: the same group and number means "arrived"; another note means
# "waits at another sync"; no note means the peer is not waiting at any sync of this package (it never got here).
# The store is reached through a private function of torch.distributed (covered by a test); without it, the error
# names no ranks. Nothing of this runs on a sync that completes within the first slice.

NOTE_AFTER = 1.0  # seconds of waiting before a rank notes where it waits
# Keyed by group name, not by group: a module-level reference would keep every process group alive until interpreter
# exit, past destroy_process_group(), and a gloo group destroyed during interpreter shutdown can abort the process.
_SYNC_NUMBERS: dict[str, int] = {}


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _note_key(global_rank: int) -> str:
    return f"torchmetrics_varlen/waiting/{global_rank}"


def _group_tag(group: ProcessGroup | None) -> str:
    """A name of ``group`` equal on all its ranks (groups are named in creation order)."""
    pg = group if group is not None else dist.group.WORLD
    name = getattr(pg, "group_name", None)
    return str(name) if name else ",".join(map(str, dist.get_process_group_ranks(pg)))


def _set_note(store: Any, note: str) -> None:
    if store is None:
        return
    try:
        store.set(_note_key(dist.get_rank()), note)
    except RuntimeError:  # a store that went away must not hide the real problem
        pass


def _describe_missing(store: Any, group: ProcessGroup | None, note: str) -> str:
    """Where the other ranks of ``group`` are, from their notes; empty when the store cannot be read."""
    if store is None:
        return ""
    tag, number, _ = note.split("|", 2)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = dist.get_rank()
    missing: list[str] = []
    elsewhere: list[str] = []
    try:
        for group_rank, global_rank in enumerate(ranks):
            if global_rank == me:
                continue
            name = str(group_rank) if group_rank == global_rank else f"{group_rank} (global rank {global_rank})"
            key = _note_key(global_rank)
            seen = store.get(key).decode(errors="replace") if store.check([key]) else ""
            if not seen:
                missing.append(name)
                continue
            seen_tag, seen_number, seen_what = seen.split("|", 2)
            if (seen_tag, seen_number) != (tag, number):
                elsewhere.append(f"Rank {name} waits at another sync: {seen_what} (process group {seen_tag}).")
    except (RuntimeError, ValueError):
        return ""
    parts = [f"Missing: ranks [{', '.join(missing)}] are not waiting at any torchmetrics_varlen sync."]
    parts = (parts if missing else []) + elsewhere
    if not parts:
        parts.append(
            "Every rank waits at this sync, yet the exchange did not complete (a collective left pending by an"
            " earlier error pairs with it?)."
        )
    return " ".join(parts)


def exchange_payload(buffer: Tensor, nbytes: list[int], group: ProcessGroup | None) -> list[Tensor]:
    """Collective 2: every rank's ``uint8`` buffer; element i holds at least rank i's ``nbytes[i]`` bytes."""
    world_size = len(nbytes)
    if "nccl" in _backend(group):
        rows = [torch.empty(size, dtype=torch.uint8, device=buffer.device) for size in nbytes]
        dist.all_gather(rows, buffer[: nbytes[dist.get_rank(group)]], group=group)
        return rows
    output = torch.empty(world_size * buffer.numel(), dtype=torch.uint8, device=buffer.device)
    _gather_equal(output, buffer, group)
    return list(output.view(world_size, buffer.numel()).unbind(0))


def _timeout_message(what: str, timeout: float, group: ProcessGroup | None, missing: str = "") -> str:
    rank = dist.get_rank(group)
    return (
        f"{what}: rank {rank} waited {timeout:g} s for the other ranks to arrive at this sync; at least one never did."
        + (f" {missing}" if missing else "")
        + " Usual causes: ranks that run different numbers of steps (uneven data without"
        " `torch.distributed.algorithms.join.Join`), or `compute()` / `self.log(...)` called on rank 0 only (for"
        " example inside `if trainer.is_global_zero:`): every rank must run the same syncs in the same order."
        " The process group now has a pending collective and should not be used for anything else."
    )
