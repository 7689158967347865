"""Waiting for a collective: every collective of the package is waited for here, alike on every backend.

A collective is started asynchronously (``_transport``) and its work waited for by :func:`wait_work`, the
``wait`` way the policy chose (a timed wait on gloo, polling elsewhere: see :mod:`torchmetrics_varlen._policy`), so
every collective of the package has the same timeout behaviour on every backend:

* the timeout is ``sync_timeout``, by default the process group's own timeout (what ``init_process_group`` or
  ``new_group`` was given; NCCL's default is 10 minutes, other backends' 30), and never more than that;
* a rank late by less than the timeout never causes an error, and neither does one that is alive and busy (computing
  in ``compute_on_rank``, running its steps inside ``join``): the waiting ranks keep waiting for it up to the group's
  timeout (see :mod:`torchmetrics_varlen._presence`);
* a rank that never arrives makes the waiting ranks raise :class:`~torchmetrics_varlen.SyncTimeoutError` naming it
  (where the store can tell), and the collective stays pending. When the backend's own timeout expired first (the
  work failed with the backend's timeout), the error is the same ``SyncTimeoutError``, saying it was the group's;
* a peer that exited normally (it ran fewer syncs) is named as such in a ``SyncTimeoutError``; a peer that crashed or
  closed its connection makes the waiting ranks raise :class:`~torchmetrics_varlen.SyncPeerError` with the backend's
  error.

The limits of a wait are derived once per group, timeout and wait mode (:class:`GroupWaits`, kept by ``_transport``
with the group's record length).
"""

import datetime
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from torchmetrics_varlen import _exit_grace, _policy, _presence
from torchmetrics_varlen._presence import NOTE_AFTER
from torchmetrics_varlen.errors import SyncPeerError, SyncTimeoutError

ProcessGroup = Any  # torch.distributed.ProcessGroup; kept loose because its import path moved between torch releases

TIMEOUT_ENV = "TORCHMETRICS_VARLEN_SYNC_TIMEOUT"
# Our timeout fires this much before the group's own (at most 10 s, at least 0.5 s): on NCCL the watchdog ends the
# process at the group's timeout, so a rank must raise its clear error before then.
MARGIN_SHARE, MARGIN_MIN, MARGIN_MAX = 0.05, 0.5, 10.0
CHECK_BUSY = 5.0  # seconds between two looks at a busy peer's heartbeat (two beats and a half)
EXIT_GRACE = 1.0  # seconds a rank whose peer closed its connection looks for that peer's exit note
_BACKEND_TIMEOUT = re.compile(r"timed? ?out|timing out", re.IGNORECASE)
# Polling checks without sleeping first (100-200 us): a small collective completes within them, and a rank that
# neither sleeps nor polls slowly is not woken up late by the OS. Not for "block": gloo runs the collective on a
# thread of its own in this process, which a spinning caller takes CPU from (two ranks on two cores: a small
# metric's sync went from 0.58 to 0.54 ms without them), and its blocking wait wakes the moment the work completes.
SPIN_CHECKS = 500
# Polling: the first checks come quickly (a sync among ready ranks completes in well under a millisecond), then the
# interval grows, so a rank waiting for a late peer costs almost no CPU.
POLL_FIRST = 20e-6
POLL_GROWTH = 1.5
POLL_MAX = 2e-3
MIN_SLICE = 1e-3  # seconds: the shortest timed wait; c10d takes whole milliseconds, and reads 0 as "no timeout"


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
        >>> fallback_timeout("nccl2", "cuda")
        600.0
    """
    if _policy.is_nccl(backend, device_type):
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
    first: datetime.timedelta | None = None  # "block": the first timed slice, tried before anything else (see _wait)


@dataclass
class GroupWaits:
    """What waiting keeps of one process group: its syncs so far, its timeouts, the limits derived from them.

    ``syncs`` numbers the "where I wait" notes (``_transport`` counts a group's syncs at each metadata exchange);
    ``group_seconds``: the group's own timeout per device type, read once; ``limits``: :func:`limits_of`, kept.
    """

    syncs: int = 0
    group_seconds: dict[str, float] = field(default_factory=dict)
    limits: dict[tuple[float | None, str, str], _Limits] = field(default_factory=dict)


def limits_of(
    waits: GroupWaits, timeout: float | None, group: ProcessGroup | None, wait: str, device_type: str = "cpu"
) -> _Limits:
    """How long a collective of ``group`` on ``device_type`` is waited for, with a ``sync_timeout`` of ``timeout``."""
    key = (timeout, wait, device_type)
    limits = waits.limits.get(key)  # the same few keys at every sync of a group
    if limits is None:
        group_s = waits.group_seconds.get(device_type)
        if group_s is None:
            group_s = waits.group_seconds[device_type] = group_timeout(group, device_type)
        limits = waits.limits[key] = limits_for(timeout, group_s, wait)
    return limits


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
    return replace(limits, first=datetime.timedelta(seconds=max(first, MIN_SLICE)))


# --------------------------------------------------------------------------------------------- the two ways to wait
class PeerFailedError(RuntimeError):
    """A collective failed (a peer crashed or closed its connection); carries the backend's error as the cause."""


def wait_for(
    work: Any,
    timeout: float | None,
    on_slow: Callable[[], None] | None = None,
    slow_after: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    mode: str = "poll",
) -> bool:
    """Wait for ``work``; False when ``timeout`` seconds passed first (the work stays pending).

    ``mode`` is "block" (a timed ``work.wait``, only where it has no side effects: gloo), "poll" (``is_completed``
    checks, then an untimed ``work.wait``) or "stream" (an untimed ``work.wait`` at once: NCCL inside backward).
    ``on_slow`` runs once after ``slow_after`` seconds of waiting. A work that completed with an error raises
    :class:`PeerFailedError` from the backend's error.
    """
    if mode == "stream":  # stream-ordered on NCCL: neither polls nor blocks the calling (autograd) thread
        _wait_completed(work)
        return True
    if mode == "block":
        return _wait_blocking(work, timeout, on_slow, slow_after, clock)
    for _ in range(SPIN_CHECKS):
        if work.is_completed():
            _wait_completed(work)  # on NCCL it orders the current stream after the collective
            return True
    start = clock()
    interval = POLL_FIRST
    slow_called = on_slow is None
    while not work.is_completed():
        waited = clock() - start
        if timeout is not None and waited >= timeout:
            return False
        if not slow_called and waited >= slow_after:
            slow_called = True
            on_slow()  # type: ignore[misc]
        sleep(interval if timeout is None else min(interval, max(timeout - waited, 0.0)))
        interval = min(interval * POLL_GROWTH, POLL_MAX)
    _wait_completed(work)
    return True


def wait_first(work: Any, first: datetime.timedelta) -> bool:
    """The "block" way's first slice on its own: whether ``work`` completed within ``first``.

    False when the slice expired (the work is untouched) or the work failed: :func:`wait_for` then tells which. A
    small collective is done within it, and a sync pays for every call around its wait (see :func:`wait_work`).
    """
    try:
        work.wait(first)
        return True
    except RuntimeError:
        return False


def _wait_completed(work: Any) -> None:
    """``work.wait()`` on a completed work: returns at once, or raises the backend's error as PeerFailedError."""
    try:
        work.wait()
    except RuntimeError as err:
        raise PeerFailedError(str(err)) from err


def _wait_blocking(
    work: Any, timeout: float | None, on_slow: Callable[[], None] | None, slow_after: float, clock: Callable[[], float]
) -> bool:
    start = clock()
    while True:
        waited = clock() - start
        if timeout is not None and waited >= timeout:
            return False
        if on_slow is not None and waited >= slow_after:
            on_slow()
            on_slow = None
        limits = [timeout - waited] if timeout is not None else []
        limits += [slow_after - waited] if on_slow is not None else []
        try:
            if limits:
                work.wait(datetime.timedelta(seconds=max(min(limits), MIN_SLICE)))
            else:
                work.wait()
            return True
        except RuntimeError:
            if work.is_completed():  # it failed (a peer), or completed just after the slice expired
                _wait_completed(work)
                return True
            # The slice expired ("Operation timed out!"): the work is untouched and still pending.


# --------------------------------------------------------------------------------------------- waiting for one work
def wait_work(
    work: Any,
    waits: GroupWaits,
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    device_type: str = "cpu",
) -> None:
    """Wait for ``work`` the ``wait`` way (the policy's); raise SyncTimeoutError / SyncPeerError naming it.

    ``waits``: what ``group`` keeps for waiting. ``timeout``: the metric's ``sync_timeout`` (None: the group's own
    timeout; 0: no timer of ours).
    """
    try:
        _wait(work, group, wait, what, limits_of(waits, timeout, group, wait, device_type), waits.syncs)
    finally:
        _exit_grace.waited()  # an exit right after it lets the backend's thread finish with the work first


def _wait(work: Any, group: ProcessGroup | None, wait: str, what: str, limits: _Limits, sync: int) -> None:
    start = time.monotonic()
    # "block": the common case in one call, a small collective done within the first slice. A sync pays for every
    # microsecond here, several times over right after a collective woke it (its caches are cold). Else (the slice
    # expired, or the work failed) the full wait below goes on from there and tells which.
    if limits.first is not None and wait_first(work, limits.first):
        return
    noted: list[Any] = []  # the store, once this rank noted where it waits (a quick sync never touches it)

    def write_note() -> None:
        noted.append(_presence.store())
        _presence.write(noted[0], "waiting", _note(group, sync, what))

    try:
        waited = time.monotonic() - start
        ours = None if limits.ours is None else max(limits.ours - waited, 0.0)
        done = wait_for(work, ours, write_note, max(NOTE_AFTER - waited, 0.0), mode=wait)
        found = None
        recent: set[int] = set()  # the peers that were busy at the last look
        while not done:  # our timeout expired: keep waiting while every peer that has not arrived is alive and busy
            store = noted[0] if noted else _presence.store()
            found = _presence.where_peers_are(store, group, _note(group, sync, what))
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
        raise _failure(err, what, group, _note(group, sync, what), limits, time.monotonic() - start) from err.__cause__
    if done and noted:
        _presence.write(noted[0], "waiting", "")  # arrived: an old note must not describe this rank at a later timeout
    if not done:  # the note stays: peers timing out at their own syncs read where this rank waits
        waited = time.monotonic() - start
        waited = limits.ours if limits.ours is not None and waited < limits.ours + CHECK_BUSY else waited
        source = "the process group's own timeout" if limits.from_group else "`sync_timeout`"
        raise SyncTimeoutError(_timeout_message(what, waited, source, limits, group, _presence.describe(found)))


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
        before = _presence.beats(store, ranks)
        if wait_for(work, window, mode=wait):
            return "done"
        after = _presence.beats(store, ranks)
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
    store = _presence.store()
    found = _presence.where_peers_are(store, group, note)
    deadline = time.monotonic() + EXIT_GRACE
    # A peer that exits normally writes its note at interpreter exit, around when its connections close: look again
    # for a moment before calling it a crash.
    while found is not None and not found["exited"] and not _BACKEND_TIMEOUT.search(message):
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
        found = _presence.where_peers_are(store, group, note)
    if found is not None and _presence.crashed(found):  # their exit notes say an uncaught exception ended them
        return SyncPeerError(_peer_message(what, group, message, _presence.crashed(found)))
    if found is not None and found["exited"]:
        return SyncTimeoutError(_exited_message(what, group, found))
    if _BACKEND_TIMEOUT.search(message):
        source = f"the process group's own timeout ({limits.group_s:g} s, enforced by the backend)"
        return SyncTimeoutError(_timeout_message(what, waited, source, limits, group, _presence.describe(found)))
    return SyncPeerError(_peer_message(what, group, message))


# --------------------------------------------------------------------------------------------------------- messages
def _note(group: ProcessGroup | None, sync: int, what: str) -> str:
    """This rank's "where I wait" note for a collective of sync number ``sync`` of ``group`` (see _presence)."""
    return f"{_group_tag(group)}|{sync}|{what}"


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
    if "nccl" in _policy.backend_of(group):
        raise_it += (
            f" On NCCL, with its default asynchronous error handling, the watchdog may end this process when the"
            f" group's timeout ({limits.group_s:g} s) expires, a few seconds after this error: log it and end the job."
        )
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


def _peer_message(
    what: str, group: ProcessGroup | None, error: str, crashed: list[tuple[str, int, str]] | None = None
) -> str:
    rank = dist.get_rank(group)
    first = error.strip().splitlines()[0] if error.strip() else "no message"
    names = ", ".join(f"{name} ({text.partition(' ')[2] or 'exception'})" for name, _, text in crashed or [])
    who = f"ranks [{names}] exited after an uncaught exception" if crashed else "another rank of the group crashed"
    who += "" if crashed else " or closed its connection"
    return (
        f"{what}: rank {rank} lost a peer during the sync: {who} (the backend said: {first}). Check the logs of"
        f" {'those ranks' if crashed else 'the other ranks'} for the original error; this process group cannot be"
        " used any more." + (_policy.SHARED_GPU_FIX if "Duplicate GPU" in error else "")
    )
