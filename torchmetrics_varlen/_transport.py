"""The collectives of a sync: metadata exchange, padded gather, all-reduce, gather to one rank, broadcast.

Each is started asynchronously and waited for through :func:`torchmetrics_varlen._policy.wait_for` (a timed wait on
gloo, polling elsewhere: see :mod:`torchmetrics_varlen._policy`), so every collective of the package has the same
timeout behaviour on every backend:

* the timeout is ``sync_timeout``, by default the process group's own timeout (what ``init_process_group`` or
  ``new_group`` was given; NCCL's default is 10 minutes, other backends' 30), and never more than that;
* a rank late by less than the timeout never causes an error, and neither does one that is alive and busy (computing
  in ``compute_on_rank``, running its steps inside ``join``): the waiting ranks keep waiting for it up to the group's
  timeout (see :mod:`torchmetrics_varlen._notes`);
* a rank that never arrives makes the waiting ranks raise :class:`~torchmetrics_varlen.SyncTimeoutError` naming it
  (where the store can tell), and the collective stays pending. When the backend's own timeout expired first (the
  work failed with the backend's timeout), the error is the same ``SyncTimeoutError``, saying it was the group's;
* a peer that exited normally (it ran fewer syncs) is named as such in a ``SyncTimeoutError``; a peer that crashed or
  closed its connection makes the waiting ranks raise :class:`~torchmetrics_varlen.SyncPeerError` with the backend's
  error.

Collectives are looked up on ``torch.distributed`` at call time, so tests can count them by wrapping those functions.
"""

import array
import contextlib
import datetime
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torchmetrics_varlen import _caches, _exit_grace, _notes, _plan, _policy, _protocol
from torchmetrics_varlen._notes import NOTE_AFTER
from torchmetrics_varlen._policy import PeerFailedError, wait_first, wait_for
from torchmetrics_varlen.errors import SyncMemoryError, SyncPeerError, SyncTimeoutError

ProcessGroup = Any  # torch.distributed.ProcessGroup; kept loose because its import path moved between torch releases

TIMEOUT_ENV = "TORCHMETRICS_VARLEN_SYNC_TIMEOUT"
__all__ = ["NOTE_AFTER"]
# Our timeout fires this much before the group's own (at most 10 s, at least 0.5 s): on NCCL the watchdog ends the
# process at the group's timeout, so a rank must raise its clear error before then.
MARGIN_SHARE, MARGIN_MIN, MARGIN_MAX = 0.05, 0.5, 10.0
CHECK_BUSY = 5.0  # seconds between two looks at a busy peer's heartbeat (two beats and a half)
EXIT_GRACE = 1.0  # seconds a rank whose peer closed its connection looks for that peer's exit note
_BACKEND_TIMEOUT = re.compile(r"timed? ?out|timing out", re.IGNORECASE)


def world_of(group: ProcessGroup | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` within ``group``, or None when no sync is needed (no process group, or a group of one)."""
    if not _DISTRIBUTED:
        return None
    default = dist.group.WORLD  # None: not initialized (what `dist.is_initialized()` asks; every sync asks)
    if default is None:
        return None
    pg = group if group is not None else default
    last = _LAST_WORLD[0]
    if last is not None and last[0]() is pg:  # the group asked last: no weak-key lookup (every sync asks)
        return last[1]
    try:
        world = _WORLDS[pg]
    except (KeyError, TypeError):  # not seen yet, or a group that cannot be weakly referenced
        world_size = dist.get_world_size(group)
        world = None if world_size <= 1 else (dist.get_rank(group), world_size)
        with contextlib.suppress(TypeError):
            _WORLDS[pg] = world
    with contextlib.suppress(TypeError):
        _LAST_WORLD[0] = (weakref.ref(pg), world)
    return world


_DISTRIBUTED = dist.is_available()  # built with torch.distributed: fixed for the process
# A group's ranks never change, and every sync asks more than once: kept per group object, weakly (a destroyed
# group takes its entry along; one made later is looked up afresh).
_WORLDS: "weakref.WeakKeyDictionary[Any, tuple[int, int] | None]" = weakref.WeakKeyDictionary()
_LAST_WORLD: "list[tuple[weakref.ref[Any], tuple[int, int] | None] | None]" = [None]
_caches.register("_transport._WORLDS: a group's rank and size never change, and every sync asks", _WORLDS.clear)
_caches.register(
    "_transport._LAST_WORLD: the group asked last, without a weak-key lookup", lambda: _LAST_WORLD.__setitem__(0, None)
)


def default_timeout() -> float | None:
    """``TORCHMETRICS_VARLEN_SYNC_TIMEOUT`` in seconds if set (0: no timeout of ours), else None: the group's own."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(f"Expected `{TIMEOUT_ENV}` to be a number of seconds but got {raw!r}") from err
    return max(value, 0.0)


def group_timeout(group: ProcessGroup | None, device_type: str) -> float:
    """The timeout ``group`` was created with, in seconds, for its backend that serves ``device_type``.

    ``init_process_group``/``new_group`` store it in the backend's options (``Backend.options._timeout``, private:
    covered by a test, so a torch release that moves it fails there); where it cannot be read, torch's default for
    that backend (:func:`fallback_timeout`).
    """
    pg: Any = group if group is not None else dist.group.WORLD
    try:
        value = pg._get_backend(torch.device(device_type)).options._timeout
        return float(value.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return fallback_timeout(_policy.backend_of(group), device_type)


def fallback_timeout(backend: str, device_type: str) -> float:
    """The default timeout torch gives a group of ``backend`` (its entry for ``device_type``), in seconds.

    NCCL's is 10 minutes (``default_pg_nccl_timeout``, None in a torch built without NCCL), every other backend's 30.

    Example:
        >>> fallback_timeout("nccl", "cuda"), fallback_timeout("gloo", "cpu")
        (600.0, 1800.0)
        >>> fallback_timeout("cpu:gloo,cuda:nccl", "cuda"), fallback_timeout("cpu:gloo,cuda:nccl", "cpu")
        (600.0, 1800.0)
    """
    if _policy.serving_backend(backend, device_type) == "nccl":
        nccl: datetime.timedelta | None = getattr(dist.constants, "default_pg_nccl_timeout", None)
        return float((nccl or datetime.timedelta(minutes=10)).total_seconds())
    default: datetime.timedelta = dist.default_pg_timeout
    return float(default.total_seconds())


def margin(seconds: float) -> float:
    """How much before the group's timeout ours fires."""
    return min(max(seconds * MARGIN_SHARE, MARGIN_MIN), MARGIN_MAX, seconds / 2)


@dataclass(frozen=True)
class _Limits:
    """How long one collective is waited for.

    ``ours``: our timer (None: none); ``bound``: how far busy peers extend the wait; ``from_group``: whether ``ours``
    is the group's timeout (the default, or ``sync_timeout`` capped to it).
    """

    ours: float | None
    bound: float
    group_s: float
    from_group: bool
    first: datetime.timedelta | None = None  # "block": the first timed slice, tried before anything else (see _finish)


def _limits(timeout: float | None, group: ProcessGroup | None, wait: str, device_type: str) -> _Limits:
    state = _state(group)
    key = (timeout, wait, device_type)
    limits = state.limits.get(key)  # the same few keys at every sync of a group
    if limits is None:
        group_s = state.group_seconds.get(device_type)
        if group_s is None:
            group_s = state.group_seconds[device_type] = group_timeout(group, device_type)
        limits = state.limits[key] = limits_for(timeout, group_s, wait)
    return limits


def limits_of(timeout: float | None, group: ProcessGroup | None, wait: str) -> _Limits:
    """How long a CPU collective of ``group`` is waited for, with a ``sync_timeout`` of ``timeout``."""
    return _limits(timeout, group, wait, "cpu")


def limits_for(timeout: float | None, group_s: float, wait: str) -> _Limits:
    """How long to wait, for a ``sync_timeout`` of ``timeout`` on a group whose own timeout is ``group_s`` seconds."""
    bound = group_s - margin(group_s)
    if timeout == 0:  # no timer of ours: gloo's own timeout ends the wait; polling (NCCL) would never end: the bound
        limits = _Limits(None if wait == "block" else group_s, group_s, group_s, True)
    elif timeout is None or timeout >= bound:
        limits = _Limits(bound, bound, group_s, True)
    else:
        limits = _Limits(timeout, bound, group_s, False)
    if wait != "block":
        return limits
    # The first slice ends at the note (NOTE_AFTER) or at our timeout, whichever comes first: what wait_for's first
    # slice would be, made once.
    first = min(NOTE_AFTER, limits.ours) if limits.ours is not None else NOTE_AFTER
    return replace(limits, first=datetime.timedelta(seconds=max(first, _policy.MIN_SLICE)))


def _finish(
    work: Any,
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    device_type: str = "cpu",
    limits: _Limits | None = None,
) -> None:
    """Wait for ``work`` the ``wait`` way (the policy's); raise SyncTimeoutError / SyncPeerError naming it.

    ``timeout``: the metric's ``sync_timeout`` (None: the group's own timeout; 0: no timer of ours). ``limits``: what
    :func:`limits_of` gives for them, where the caller kept it.
    """
    try:
        _wait(work, group, wait, timeout, what, device_type, limits)
    finally:
        _exit_grace.waited()  # an exit right after it lets the backend's thread finish with the work first


def _wait(
    work: Any,
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    device_type: str,
    limits: _Limits | None,
) -> None:
    if limits is None:
        limits = _limits(timeout, group, wait, device_type)
    start = time.monotonic()
    # "block": the common case in one call, a small collective done within the first slice. A sync pays for every
    # microsecond here, several times over right after a collective woke it (its caches are cold). Else (the slice
    # expired, or the work failed) the full wait below goes on from there and tells which.
    if limits.first is not None and wait_first(work, limits.first):
        return
    noted: list[Any] = []  # the store, once this rank noted where it waits (a quick sync never touches it)

    def write_note() -> None:
        noted.append(_notes.store())
        _notes.write(noted[0], "waiting", _note(group, what))

    try:
        waited = time.monotonic() - start
        ours = None if limits.ours is None else max(limits.ours - waited, 0.0)
        done = wait_for(work, ours, write_note, max(NOTE_AFTER - waited, 0.0), mode=wait)
        found = None
        recent: set[int] = set()  # the peers that were busy at the last look
        while not done:  # our timeout expired: keep waiting while every peer that has not arrived is alive and busy
            store = noted[0] if noted else _notes.store()
            found = _notes.where_peers_are(store, group, _note(group, what))
            left = limits.bound - (time.monotonic() - start)
            if found is None or left <= 0:
                break
            if found["missing"] and {rank for _, rank, _ in found["missing"]} <= recent:
                # Peers that just left their busy scope are on their way here (a rank notes where it waits only
                # after NOTE_AFTER): one more look, once.
                recent = set()
                done = wait_for(work, min(NOTE_AFTER + CHECK_BUSY, left), mode=wait)
                continue
            recent = {rank for _, rank, _ in found["busy"]}
            state = _watch_busy(found, store, work, wait, min(CHECK_BUSY, left))
            if state == "stop":
                break
            done = state == "done"
    except PeerFailedError as err:
        raise _failure(err, what, group, _note(group, what), limits, time.monotonic() - start) from err.__cause__
    if done and noted:
        _notes.write(noted[0], "waiting", "")  # arrived: an old note must not describe this rank at a later timeout
    if not done:  # the note stays: peers timing out at their own syncs read where this rank waits
        waited = time.monotonic() - start
        waited = limits.ours if limits.ours is not None and waited < limits.ours + CHECK_BUSY else waited
        source = "the process group's own timeout" if limits.from_group else "`sync_timeout`"
        raise SyncTimeoutError(_timeout_message(what, waited, source, limits, group, _notes.describe(found)))


def _watch_busy(found: dict[str, Any], store: Any, work: Any, wait: str, window: float) -> str:
    """Whether to keep waiting for peers that are busy: "alive", "done" or "stop".

    "alive" when every peer that has not arrived is busy and its heartbeat moved within ``window`` seconds (spent
    waiting for ``work``: "done" if it completed meanwhile), else "stop" (busy peers whose beat stopped are moved to
    ``found["missing"]``).
    """
    if not found["busy"] or found["missing"] or found["elsewhere"] or found["exited"]:
        return "stop"
    ranks = [rank for _, rank, _ in found["busy"]]
    try:
        before = _notes.beats(store, ranks)
        if wait_for(work, window, mode=wait):
            return "done"
        after = _notes.beats(store, ranks)
    except RuntimeError:
        return "stop"
    stale = [entry for entry, old, new in zip(found["busy"], before, after) if new <= old]
    if not stale:
        return "alive"
    found["busy"] = [entry for entry in found["busy"] if entry not in stale]
    found["missing"] += [
        (f"{name} (it noted it was busy, but its heartbeat stopped)", rank, "") for name, rank, _ in stale
    ]
    return "stop"


def _failure(
    err: PeerFailedError, what: str, group: ProcessGroup | None, note: str, limits: _Limits, waited: float
) -> RuntimeError:
    """The error for a collective the backend failed: its own timeout, a peer's normal exit, or a peer's crash."""
    message = str(err)
    store = _notes.store()
    found = _notes.where_peers_are(store, group, note)
    deadline = time.monotonic() + EXIT_GRACE
    # A peer that exits normally writes its note at interpreter exit, around when its connections close: look again
    # for a moment before calling it a crash.
    while found is not None and not found["exited"] and not _BACKEND_TIMEOUT.search(message):
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
        found = _notes.where_peers_are(store, group, note)
    if found is not None and found["exited"]:
        return SyncTimeoutError(_exited_message(what, group, found))
    if _BACKEND_TIMEOUT.search(message):
        source = f"the process group's own timeout ({limits.group_s:g} s, enforced by the backend)"
        return SyncTimeoutError(_timeout_message(what, waited, source, limits, group, _notes.describe(found)))
    return SyncPeerError(_peer_message(what, group, message))


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
    """A group's agreed record length and what the current window of syncs needed (the same on all its ranks).

    Also the group's timeout per device type, read once.
    """

    words: int = INITIAL_WORDS
    longest: int = 0  # the longest record of the current window
    left: int = RECORD_WINDOW  # syncs left in the window
    syncs: int = 0  # syncs of this group so far: numbers the "where I wait" notes
    group_seconds: dict[str, float] = field(default_factory=dict)
    limits: dict[tuple[float | None, str, str], _Limits] = field(default_factory=dict)  # ``_limits``, kept

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


# Keyed by the group object, weakly: a group destroyed (``destroy_process_group()``) takes its state along, and a group
# made afterwards starts fresh even where it gets the same name, as on its other ranks.
_LENGTHS: "weakref.WeakKeyDictionary[Any, _RecordLength]" = weakref.WeakKeyDictionary()
_caches.register(
    "_transport._LENGTHS: each group's agreed record length, which every rank derives alike", _LENGTHS.clear
)
# Guards the table of groups: the Join worker thread syncs on its own group while the main thread syncs on others.
# A group's own state needs no lock: only the thread that syncs on a group uses it (its collectives are ordered).
_LOCK = threading.Lock()


def _state(group: ProcessGroup | None) -> _RecordLength:
    pg = group if group is not None else dist.group.WORLD
    with _LOCK:
        state = _LENGTHS.get(pg)
        if state is None:  # the group's first sync
            state = _LENGTHS[pg] = _RecordLength()
        return state


def record_length(group: ProcessGroup | None) -> _RecordLength:
    """The state of ``group``'s agreed record length, the same object for as long as the group lives."""
    return _state(group)


def _note(group: ProcessGroup | None, what: str) -> str:
    """This rank's "where I wait" note for a collective of the current sync of ``group`` (see _notes)."""
    return f"{_group_tag(group)}|{_state(group).syncs}|{what}"


def exchange_records(
    record: Sequence[int], group: ProcessGroup | None, device: torch.device, wait: str, timeout: float | None, what: str
) -> Tensor:
    """Collective 1 (rarely 2): every rank's record, as a ``[world_size, words]`` int64 CPU tensor.

    ``words`` is the group's agreed length: a record's own length is in its header (``H_WORDS``), zeros follow.
    """
    _notes.arm_exit_note()
    length = _state(group)
    words, _ = length.next_sync()
    table = _exchange_at(record, words, group, device, wait, timeout, what)
    return settle(table, record, length, words, group, device, wait, timeout, what)


def settle(
    table: Tensor,
    record: Sequence[int],
    length: _RecordLength,
    words: int,
    group: ProcessGroup | None,
    device: torch.device,
    wait: str,
    timeout: float | None,
    what: str,
) -> Tensor:
    """The exchanged ``table`` (sent at ``words``), exchanged again at the longest record's length where one is longer.

    Records the longest length with the group's state (every rank saw the same table, so they all agree on it).
    """
    # Every sync runs these checks: on a few words, Python lists are several times quicker than tensor operations.
    heads = table.numpy()
    magic = heads[:, _protocol.H_MAGIC].tolist()
    ours = magic.count(_protocol.MAGIC) == len(magic)  # else make_plan raises, naming the ranks
    needed = max(heads[:, _protocol.H_WORDS].tolist()) if ours else words
    if ours and words < needed <= MAX_WORDS:  # decided from the headers: every rank takes this branch together
        table = _exchange_at(record, needed, group, device, wait, timeout, what)
    length.saw(needed if needed <= MAX_WORDS else words)  # a larger claim is no record of ours: not learnt
    return table  # at the agreed length: the plan reads each record's length from its header


def _exchange_at(
    record: Sequence[int],
    words: int,
    group: Any,
    device: torch.device,
    wait: str,
    timeout: float | None,
    what: str,
) -> Tensor:
    padded = array.array("q", record[:words])
    padded.frombytes(bytes(8 * (words - len(padded))))
    local = torch.frombuffer(padded, dtype=torch.int64)  # no copy
    local = local if device.type == "cpu" else local.to(device)
    world_size = dist.get_world_size(group)
    table = torch.empty(world_size * words, dtype=torch.int64, device=device)  # gloo takes only the flat form
    _finish(_gather_equal(table, local, group), group, wait, timeout, what, device.type)
    table = table.view(world_size, words)
    return table if device.type == "cpu" else table.cpu()


# ----------------------------------------------------------------------------------------------------- data
def gather_rows(
    buffer: Tensor,
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    output: Tensor | None = None,
) -> Tensor:
    """Every rank's ``uint8`` buffer (equal sizes) as a ``[world_size, bytes]`` tensor (``output``, if given)."""
    world_size = dist.get_world_size(group)
    if output is None:
        output = torch.empty(world_size * buffer.numel(), dtype=torch.uint8, device=buffer.device)
    _finish(_gather_equal(output, buffer, group), group, wait, timeout, what, buffer.device.type)
    return output.view(world_size, buffer.numel())


def broadcast_all(
    sections: list[tuple[int, Tensor]],
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Broadcast each ``(src, tensor)`` from rank ``src`` of ``group`` in place: all started at once, then waited for.

    Every rank passes the same sources and sizes in the same order (they come from the plan). ``meanwhile`` runs
    once they are started, before the wait.
    """
    works = [
        dist.broadcast(tensor, src=_global_rank(group, src), group=group, async_op=True) for src, tensor in sections
    ]
    if meanwhile is not None:
        meanwhile()
    for work, (_, tensor) in zip(works, sections, strict=True):
        _finish(work, group, wait, timeout, what, tensor.device.type)


def send_to_rank(
    transfers: list[tuple[int, Tensor | None]],
    dst: int,
    group: ProcessGroup | None,
    device: torch.device,
    wait: str,
    timeout: float | None,
    what: str,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Move each ``(src, tensor)`` from rank ``src`` to rank ``dst`` of ``group``: all started at once, then waited for.

    One ``all_to_all_single`` per transfer, in which ``src`` sends its bytes to ``dst`` alone: a collective, waited
    for like every other (gloo's point-to-point works cannot be polled, and a timed wait ends them). Every rank passes
    the same sources and sizes in the same order (they come from the plan); ``tensor`` is ``dst``'s receive section,
    ``src``'s data, and None on the other ranks. ``meanwhile`` runs once they are started, before the wait.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    nothing = torch.empty(1, dtype=torch.uint8, device=device)[:0]  # a valid pointer to no bytes
    works = []
    for src, tensor in transfers:
        data = tensor.view(-1).view(torch.uint8) if tensor is not None else nothing
        into, out_of = [0] * world_size, [0] * world_size
        if rank == dst:
            into[src] = data.numel()
        if rank == src:
            out_of[dst] = data.numel()
        received, sent = (data, nothing) if rank == dst else (nothing, data if rank == src else nothing)
        works.append(dist.all_to_all_single(received, sent, into, out_of, group=group, async_op=True))
    if meanwhile is not None:
        meanwhile()
    for work in works:
        _finish(work, group, wait, timeout, what, device.type)


def agree_allocation(
    failure: BaseException | None,
    nbytes: int,
    group: ProcessGroup | None,
    device: torch.device,
    wait: str,
    timeout: float | None,
    what: str,
) -> None:
    """One tiny all-gather of whether each rank could allocate what the sync receives; raise on all if one failed.

    ``failure`` is this rank's allocation error, or None. Raises :class:`SyncMemoryError` naming the failing ranks
    (this rank's error as the cause), on every rank alike, before any data moved.
    """
    world_size = dist.get_world_size(group)
    local = torch.tensor([0 if failure is None else 1], dtype=torch.int64, device=device)
    table = torch.empty(world_size, dtype=torch.int64, device=device)
    _finish(_gather_equal(table, local, group), group, wait, timeout, f"{what} (memory check)", device.type)
    failing = table.cpu().nonzero().flatten().tolist()
    if failing:
        raise SyncMemoryError(_memory_message(what, failing, nbytes, failure, group)) from failure


_OPS = {_plan.OP_SUM: "SUM", _plan.OP_MAX: "MAX", _plan.OP_MIN: "MIN"}


def all_reduce(
    buffers: list[tuple[Tensor, int]], group: ProcessGroup | None, wait: str, timeout: float | None, what: str
) -> None:
    """All-reduce each ``(buffer, op)`` in place: all started at once, then waited for."""
    works = [
        dist.all_reduce(buffer, op=getattr(dist.ReduceOp, _OPS[op]), group=group, async_op=True)
        for buffer, op in buffers
    ]
    device_type = buffers[0][0].device.type if buffers else "cpu"
    for work in works:
        _finish(work, group, wait, timeout, what, device_type)


def _global_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def gather_to_rank(
    buffer: Tensor, dst: int, group: Any, wait: str, timeout: float | None, what: str, output: Tensor | None = None
) -> Tensor | None:
    """Every rank's ``uint8`` buffer (equal sizes) to rank ``dst`` of ``group`` only: ``[world_size, bytes]`` there.

    ``output``: rank ``dst``'s receive buffer (``world_size x bytes``), if allocated already.
    """
    rank = dist.get_rank(group)
    rows = None
    if rank == dst:
        world_size = dist.get_world_size(group)
        if output is None:
            output = torch.empty(world_size * buffer.numel(), dtype=torch.uint8, device=buffer.device)
        output = output.view(world_size, buffer.numel())
        rows = list(output.unbind(0))
    else:
        output = None
    work = dist.gather(buffer, rows, dst=_global_rank(group, dst), group=group, async_op=True)
    _finish(work, group, wait, timeout, what, buffer.device.type)
    return output


def broadcast_bytes(
    data: bytes | None, src: int, group: Any, device: torch.device, wait: str, timeout: float | None
) -> bytes:
    """The bytes ``data`` of rank ``src`` to every rank of ``group`` (a size, then the bytes: two broadcasts)."""
    rank = dist.get_rank(group)
    what = f"broadcast of the result from rank {src}"
    size = torch.tensor([len(data) if rank == src and data is not None else 0], dtype=torch.int64, device=device)
    work = dist.broadcast(size, src=_global_rank(group, src), group=group, async_op=True)
    _finish(work, group, wait, timeout, what, device.type)
    if rank == src:
        assert data is not None
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    work = dist.broadcast(payload, src=_global_rank(group, src), group=group, async_op=True)
    _finish(work, group, wait, timeout, what, device.type)
    if rank == src and data is not None:
        return data
    return payload.cpu().numpy().tobytes()  # `bytes(storage)` iterates in Python: 1.4 µs a byte


def run_collective(
    start: Callable[[], Any], group: Any, wait: str, timeout: float | None, what: str, device_type: str = "cpu"
) -> None:
    """Start a collective (``start`` returns its work) and wait for it the ``wait`` way, like every other."""
    _finish(start(), group, wait, timeout, what, device_type)


# ------------------------------------------------------------------------------------------------------ messages
def _group_tag(group: ProcessGroup | None) -> str:
    """A name of ``group`` equal on all its ranks (groups are named in creation order)."""
    pg = group if group is not None else dist.group.WORLD
    name = getattr(pg, "group_name", None)
    return str(name) if name else ",".join(map(str, dist.get_process_group_ranks(pg)))


def _timeout_message(
    what: str, waited: float, source: str, limits: _Limits, group: ProcessGroup | None, missing: str = ""
) -> str:
    rank = dist.get_rank(group)
    raise_it = (
        "" if limits.from_group else f" (the process group's own timeout is {limits.group_s:g} s)"
    ) + " Raise the process group's timeout (`init_process_group(timeout=...)`) where a rank legitimately needs longer."
    return (
        f"{what}: rank {rank} waited {waited:.3g} s ({source}) for the other ranks to arrive at this sync; at least"
        " one never did."
        + (f" {missing}" if missing else "")
        + " Usual causes: ranks that run different numbers of steps (uneven data outside a `Join`: see"
        " `torchmetrics_varlen.join`),"
        " `compute()` / `self.log(...)` called on rank 0 only (for example inside `if trainer.is_global_zero:`), or"
        " `compute()` called again after an `update()` on this rank only (the other ranks returned their cached"
        " value without syncing): every rank must run the same syncs in the same order. The process group now has a"
        " pending collective and should not be used for anything else." + raise_it
    )


def _exited_message(what: str, group: ProcessGroup | None, found: dict[str, Any]) -> str:
    rank = dist.get_rank(group)
    names = ", ".join(name for name, _, _ in found["exited"])
    return (
        f"{what}: rank {rank} waited at this sync while ranks [{names}] exited normally (their processes ended"
        " without an error: nothing crashed). They ran fewer syncs than this rank: usually `compute()` or"
        " `self.log(...)` ran on some ranks only (for example inside `if trainer.is_global_zero:`, with"
        " `num_sanity_val_steps=0`), or the ranks ran different numbers of steps. Every rank must run the same syncs in"
        " the same order; the process group cannot be used any more."
    )


def _memory_message(
    what: str, failing: list[int], nbytes: int, failure: BaseException | None, group: ProcessGroup | None
) -> str:
    here = f" This rank ({dist.get_rank(group)}) got: {str(failure).strip().splitlines()[0]}." if failure else ""
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


def _peer_message(what: str, group: ProcessGroup | None, error: str) -> str:
    rank = dist.get_rank(group)
    first = error.strip().splitlines()[0] if error.strip() else "no message"
    return (
        f"{what}: rank {rank} lost a peer during the sync: another rank of the group crashed or closed its connection"
        f" (the backend said: {first}). Check the logs of the other ranks for the original error; this process group"
        " cannot be used any more."
    )
