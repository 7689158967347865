"""The collectives of a sync: metadata exchange, padded gather, all-reduce, gather to one rank, broadcast.

Each is started asynchronously and waited for through :func:`torchmetrics_varlen._policy.wait_for` (a timed wait on
gloo, polling elsewhere: see :mod:`torchmetrics_varlen._policy`), so every collective of the package has the same
timeout behaviour on every backend:

* a rank late by less than the sync timeout never causes an error;
* a rank that never arrives makes the waiting ranks raise :class:`~torchmetrics_varlen.SyncTimeoutError` naming it
  (where the store can tell), and the collective stays pending (nothing aborts the process group);
* a peer that crashed or closed its connection makes them raise :class:`~torchmetrics_varlen.SyncPeerError` with the
  backend's error.

Collectives are looked up on ``torch.distributed`` at call time, so tests can count them by wrapping those functions.
"""

import array
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torchmetrics_varlen import _plan, _protocol
from torchmetrics_varlen._policy import PeerFailedError, wait_for
from torchmetrics_varlen.errors import SyncPeerError, SyncTimeoutError

ProcessGroup = Any  # torch.distributed.ProcessGroup; kept loose because its import path moved between torch releases

TIMEOUT_ENV = "TORCHMETRICS_VARLEN_SYNC_TIMEOUT"
DEFAULT_SYNC_TIMEOUT = 300.0
NOTE_AFTER = 1.0  # seconds of waiting before a rank notes where it waits (see "who is waiting where" below)


def world_of(group: ProcessGroup | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` within ``group``, or None when no sync is needed (no process group, or a group of one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size(group)
    if world_size <= 1:
        return None
    return dist.get_rank(group), world_size


def default_timeout() -> float | None:
    """Sync timeout in seconds: ``TORCHMETRICS_VARLEN_SYNC_TIMEOUT`` if set (0: no timeout of ours), else 300."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_SYNC_TIMEOUT
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(f"Expected `{TIMEOUT_ENV}` to be a number of seconds but got {raw!r}") from err
    return value if value > 0 else None


def _finish(
    work: Any,
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    note: str | None = None,
) -> None:
    """Wait for ``work`` the ``wait`` way (the policy's); raise SyncTimeoutError / SyncPeerError naming it."""
    noted: list[Any] = []  # the store, once this rank noted where it waits (a quick sync never touches it)

    def write_note() -> None:
        noted.append(_store())
        _set_note(noted[0], note)

    try:
        done = wait_for(work, timeout, write_note if note is not None else None, NOTE_AFTER, mode=wait)
    except PeerFailedError as err:
        raise SyncPeerError(_peer_message(what, group, str(err))) from err.__cause__
    if done and noted:
        _set_note(noted[0], "")  # arrived: an old note must not describe this rank at a later timeout
    if not done:  # the note stays: peers timing out at their own syncs read where this rank waits
        assert timeout is not None
        missing = _describe_missing(noted[0] if noted else _store(), group, note) if note is not None else ""
        raise SyncTimeoutError(_timeout_message(what, timeout, group, missing))


def _gather_equal(output: Tensor, local: Tensor, group: ProcessGroup | None) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=True)


# ------------------------------------------------------------------------------------------------- metadata
# Records are as long as the sync needs, but a collective needs one size on every rank, whatever each rank syncs.
# So each group has an agreed record length, equal on all its ranks because each rank derives it from the tables
# that all ranks saw (every rank of a group runs the same syncs in the same order):
#
# * records are sent at that length, at first room for 30 entries (1,520 bytes: one exchange for most collections);
# * when a header (always within it) says that some rank needs more, every rank exchanges again at the longest
#   length, and the group keeps it;
# * every RECORD_WINDOW syncs the length shrinks to the longest record of that window, but not below MIN_WORDS.
#
# So a per-step metric's records soon shrink to what it sends (464 bytes for a few small states), and a job that
# alternates a large sync (a collection at the end of an epoch) with many small ones pays the second exchange at most
# once per large sync.
INITIAL_WORDS = _protocol.record_words(30)
MIN_WORDS = _protocol.record_words(8)
MAX_WORDS = _protocol.record_words(1 << 16)  # a larger "need" is not a record of ours: make_plan names the ranks
RECORD_WINDOW = 64


@dataclass
class _RecordLength:
    """A group's agreed record length and what the current window of syncs needed (the same on all its ranks)."""

    words: int = INITIAL_WORDS
    longest: int = 0  # the longest record of the current window
    left: int = RECORD_WINDOW  # syncs left in the window
    syncs: int = 0  # syncs of this group so far: numbers the "where I wait" notes

    def next_sync(self) -> tuple[int, int]:
        """The length to send at, and the sync's number."""
        self.syncs += 1
        return self.words, self.syncs

    def saw(self, needed: int) -> None:
        """Every rank saw that the longest record of this sync has ``needed`` words."""
        self.words = max(self.words, needed)
        self.longest = max(self.longest, needed)
        self.left -= 1
        if self.left == 0:
            self.words, self.longest, self.left = max(self.longest, MIN_WORDS), 0, RECORD_WINDOW


_LENGTHS: dict[str, _RecordLength] = {}
_LOCK = threading.Lock()  # the Join worker thread syncs on its own group while the main thread syncs on others


def exchange_records(
    record: list[int], group: ProcessGroup | None, device: torch.device, wait: str, timeout: float | None, what: str
) -> Tensor:
    """Collective 1 (rarely 2): every rank's record, as a ``[world_size, words]`` int64 CPU tensor.

    ``words`` is the group's agreed length: a record's own length is in its header (``H_WORDS``), zeros follow.
    """
    tag = _group_tag(group)
    with _LOCK:
        length = _LENGTHS.setdefault(tag, _RecordLength())
        words, number = length.next_sync()
    note = f"{tag}|{number}|{what}"
    table = _exchange_at(record, words, group, device, wait, timeout, what, note)
    # Every sync runs these checks: on a few words, Python lists are several times quicker than tensor operations.
    heads = table.numpy()
    magic = heads[:, _protocol.H_MAGIC].tolist()
    ours = magic.count(_protocol.MAGIC) == len(magic)  # else make_plan raises, naming the ranks
    needed = max(heads[:, _protocol.H_WORDS].tolist()) if ours else words
    if ours and words < needed <= MAX_WORDS:  # decided from the headers: every rank takes this branch together
        table = _exchange_at(record, needed, group, device, wait, timeout, what, note)
    with _LOCK:
        length.saw(needed if needed <= MAX_WORDS else words)  # a larger claim is no record of ours: not learnt
    return table  # at the agreed length: the plan reads each record's length from its header


def _exchange_at(
    record: list[int],
    words: int,
    group: Any,
    device: torch.device,
    wait: str,
    timeout: float | None,
    what: str,
    note: str,
) -> Tensor:
    padded = array.array("q", record[:words])
    padded.frombytes(bytes(8 * (words - len(padded))))
    local = torch.frombuffer(padded, dtype=torch.int64)  # no copy
    local = local if device.type == "cpu" else local.to(device)
    world_size = dist.get_world_size(group)
    table = torch.empty(world_size * words, dtype=torch.int64, device=device)  # gloo takes only the flat form
    _finish(_gather_equal(table, local, group), group, wait, timeout, what, note)
    table = table.view(world_size, words)
    return table if device.type == "cpu" else table.cpu()


# ----------------------------------------------------------------------------------------------------- data
def gather_rows(buffer: Tensor, group: ProcessGroup | None, wait: str, timeout: float | None, what: str) -> Tensor:
    """Every rank's ``uint8`` buffer (equal sizes) as a ``[world_size, bytes]`` tensor."""
    world_size = dist.get_world_size(group)
    output = torch.empty(world_size * buffer.numel(), dtype=torch.uint8, device=buffer.device)
    _finish(_gather_equal(output, buffer, group), group, wait, timeout, what)
    return output.view(world_size, buffer.numel())


_OPS = {_plan.OP_SUM: "SUM", _plan.OP_MAX: "MAX", _plan.OP_MIN: "MIN"}


def all_reduce(
    buffers: list[tuple[Tensor, int]], group: ProcessGroup | None, wait: str, timeout: float | None, what: str
) -> None:
    """All-reduce each ``(buffer, op)`` in place: all started at once, then waited for."""
    works = [
        dist.all_reduce(buffer, op=getattr(dist.ReduceOp, _OPS[op]), group=group, async_op=True)
        for buffer, op in buffers
    ]
    for work in works:
        _finish(work, group, wait, timeout, what)


def _global_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def gather_to_rank(buffer: Tensor, dst: int, group: Any, wait: str, timeout: float | None, what: str) -> Tensor | None:
    """Every rank's ``uint8`` buffer (equal sizes) to rank ``dst`` of ``group`` only: ``[world_size, bytes]`` there."""
    rank = dist.get_rank(group)
    output = rows = None
    if rank == dst:
        output = torch.empty(dist.get_world_size(group), buffer.numel(), dtype=torch.uint8, device=buffer.device)
        rows = list(output.unbind(0))
    work = dist.gather(buffer, rows, dst=_global_rank(group, dst), group=group, async_op=True)
    _finish(work, group, wait, timeout, what)
    return output


def broadcast_bytes(
    data: bytes | None, src: int, group: Any, device: torch.device, wait: str, timeout: float | None
) -> bytes:
    """The bytes ``data`` of rank ``src`` to every rank of ``group`` (a size, then the bytes: two broadcasts)."""
    rank = dist.get_rank(group)
    what = f"broadcast of the result from rank {src}"
    size = torch.tensor([len(data) if rank == src and data is not None else 0], dtype=torch.int64, device=device)
    _finish(dist.broadcast(size, src=_global_rank(group, src), group=group, async_op=True), group, wait, timeout, what)
    if rank == src:
        assert data is not None
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    work = dist.broadcast(payload, src=_global_rank(group, src), group=group, async_op=True)
    _finish(work, group, wait, timeout, what)
    return data if rank == src and data is not None else bytes(payload.cpu().untyped_storage())


def run_collective(start: Callable[[], Any], group: Any, wait: str, timeout: float | None, what: str) -> None:
    """Start a collective (``start`` returns its work) and wait for it the ``wait`` way, like every other."""
    _finish(start(), group, wait, timeout, what)


# ------------------------------------------------------------------------------ who is waiting where (timeouts)
# A rank that has waited ``NOTE_AFTER`` seconds at a metadata exchange writes one key to the store every process group
# has (the rendezvous store): "<group>|<sync number>|<what>", cleared again when the exchange ends. Syncs are numbered
# per process group on each rank, so ranks that run the same syncs agree on the numbers. When a timeout expires, the
# waiting rank reads every peer's key: the same group and number means "arrived"; another note means "waits at
# another sync"; no note means the peer is not waiting at any sync of this package (it never got here, or its
# compute() returned a cached value). The store is reached through a private function of torch.distributed (covered
# by a test); without it, the error names no ranks. Nothing of this runs on a sync that completes within NOTE_AFTER.


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


def _set_note(store: Any, note: str | None) -> None:
    if store is None or note is None:
        return
    try:
        store.set(_note_key(dist.get_rank()), note)
    except RuntimeError:  # a store that went away must not hide the real problem
        pass


def _peers(group: ProcessGroup | None) -> list[tuple[str, int]]:
    """``(name, global rank)`` of every other rank of ``group``."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = dist.get_rank()
    return [
        (str(local) if local == glob else f"{local} (global rank {glob})", glob)
        for local, glob in enumerate(ranks)
        if glob != me
    ]


def _describe_missing(store: Any, group: ProcessGroup | None, note: str) -> str:
    """Where the other ranks of ``group`` are, from their notes; empty when the store cannot be read."""
    if store is None:
        return ""
    tag, number, _ = note.split("|", 2)
    missing: list[str] = []
    elsewhere: list[str] = []
    try:
        for name, global_rank in _peers(group):
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


def _timeout_message(what: str, timeout: float, group: ProcessGroup | None, missing: str = "") -> str:
    rank = dist.get_rank(group)
    return (
        f"{what}: rank {rank} waited {timeout:g} s for the other ranks to arrive at this sync; at least one never did."
        + (f" {missing}" if missing else "")
        + " Usual causes: ranks that run different numbers of steps (uneven data outside a `Join`: see"
        " `torchmetrics_varlen.join`),"
        " `compute()` / `self.log(...)` called on rank 0 only (for example inside `if trainer.is_global_zero:`), or"
        " `compute()` called again after an `update()` on this rank only (the other ranks returned their cached"
        " value without syncing): every rank must run the same syncs in the same order. The process group now has a"
        " pending collective and should not be used for anything else."
    )


def _peer_message(what: str, group: ProcessGroup | None, error: str) -> str:
    rank = dist.get_rank(group)
    first = error.strip().splitlines()[0] if error.strip() else "no message"
    return (
        f"{what}: rank {rank} lost a peer during the sync: another rank of the group crashed or closed its connection"
        f" (the backend said: {first}). Check the logs of the other ranks for the original error; this process group"
        " cannot be used any more."
    )
