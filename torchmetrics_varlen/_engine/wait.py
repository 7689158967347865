"""The waiting layer: every handle a collective returns is waited for here, with the sync's timeout and named errors.

A collective is started asynchronously (:mod:`.comm`) and its work waited for by :func:`wait`, the way the policy
chose (a timed wait on gloo, polling elsewhere: see :mod:`.group`), so every collective of the package has the same
timeout behaviour on every backend:

* the timeout is ``sync_timeout``, by default the process group's own timeout less a margin (NCCL's watchdog ends the
  process at the group's timeout, so our error must come first), never more than that;
* a rank that never arrives makes the waiting ranks raise :class:`~torchmetrics_varlen.SyncTimeoutError` naming it
  where the store can tell, and the collective stays pending; the backend's own timeout failing the work first gives
  the same error, saying it was the group's;
* a peer whose exit note saw the uncaught exception that ended it makes them raise
  :class:`~torchmetrics_varlen.SyncPeerError` naming its type; a peer that ended with no exception seen,
  ``SyncTimeoutError`` saying that it may have crashed all the same (a launcher that catches the exception hides it:
  see :func:`_exit_kind`) and only then that it may have run fewer syncs; a peer that crashed or closed its connection
  without a note, ``SyncPeerError`` with the backend's error.

**Notes in the store.** The collectives cannot tell why a peer is missing; the notes each process leaves in the
rendezvous store can, read by the waiting ranks once their timeout expired or a peer failed. Two kinds, one key each per
global rank, under a prefix that names the job's generation (a restarted job, or a world initialised again, never reads
an older one's notes): *waiting* ``"<group>|<sync number>|<what>"``, written by a rank that waited ``NOTE_AFTER``
seconds at a collective and cleared when it completes (syncs are numbered per group, so ranks that run the same syncs
agree: the same group and number means "arrived", another means "waits elsewhere", none means "not waiting at any
sync"); *exited*, written at interpreter exit by a process that took part in a sync, saying what the process could see
of its own end (:func:`_exit_kind`). The first note a process writes creates both its keys at once and lists its rank in
a roster key, so a look at every peer's notes is **2** store operations whatever the world size (a ``compare_set``
reading the roster, a ``multi_get`` of the listed peers' keys). Writes never wait for the store; reads use a clone of
the store whose timeout is ``STORE_ANSWER`` seconds, which bounds a read of a live store, but not one whose host process
is stopped (``SIGSTOP``): that read returns when the host resumes. Nothing here touches the store on a sync that
completes within ``NOTE_AFTER``.

**Process exit** (the package's one ``atexit`` handler): a backend's thread drops its reference to a work a moment
after the wait returned; in a process that is finalizing, that thread cannot take the GIL and the process aborts
(pytorch/pytorch#190489). So every wait notes when it returned, and at exit the process sleeps out what is left of
``GRACE`` seconds since then; then it writes its exit notes.
"""

import atexit
import datetime
import multiprocessing
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from torchmetrics_varlen._engine.group import SHARED_GPU_FIX, GroupState, Link, group_timeout, is_nccl
from torchmetrics_varlen.errors import SyncPeerError, SyncTimeoutError

# Our timeout fires this much before the group's own (at most 10 s, at least 0.5 s).
MARGIN_SHARE, MARGIN_MIN, MARGIN_MAX = 0.05, 0.5, 10.0
NOTE_AFTER = 1.0  # seconds of waiting before a rank notes where it waits
STORE_ANSWER = 3.0  # seconds a store read may wait for an answer (see the module docstring)
EXIT_GRACE = 1.0  # seconds a rank whose peer closed its connection looks for that peer's exit note
GRACE = 0.5  # seconds after the last wait returned during which an exiting process waits
_BACKEND_TIMEOUT = re.compile(r"timed? ?out|timing out", re.IGNORECASE)
# Polling checks without sleeping first: a small collective completes within them, and a rank that neither sleeps
# nor polls slowly is not woken up late by the OS. Not for "block": gloo runs the collective on a thread of its own
# in this process, which a spinning caller takes CPU from, and its blocking wait wakes the moment the work completes.
SPIN_CHECKS = 500
POLL_FIRST, POLL_GROWTH, POLL_MAX = 20e-6, 1.5, 2e-3  # then the interval grows: a late peer costs almost no CPU
MIN_SLICE = 1e-3  # seconds: the shortest timed wait; c10d takes whole milliseconds, and reads 0 as "no timeout"
_PREFIX = "torchmetrics_varlen"
# An exit note's first word: "exception <type>" (an uncaught exception ended the process), or "ended" (none was seen,
# which is not a clean exit: see _exit_kind).
CRASH, ENDED = "exception", "ended"


def margin(seconds: float) -> float:
    """How much before the group's timeout ours fires."""
    return min(max(seconds * MARGIN_SHARE, MARGIN_MIN), MARGIN_MAX, seconds / 2)


@dataclass(frozen=True)
class Limits:
    """How long one collective is waited for: ``ours`` (None: no timer of ours), the group's own timeout."""

    ours: float | None
    group_s: float
    from_group: bool  # ``ours`` is the group's timeout (the default, or ``sync_timeout`` capped to it)
    first: datetime.timedelta | None = None  # "block": the first timed slice, tried before anything else


def limits_of(state: GroupState, timeout: float | None, wait: str, device_type: str = "cpu") -> Limits:
    """How long a collective of the group on ``device_type`` is waited for, with a ``sync_timeout`` of ``timeout``."""
    key = (timeout, wait, device_type)
    limits: Limits | None = state.limits.get(key)  # the same few keys at every sync of a group
    if limits is None:
        group_s = state.group_seconds.get(device_type)
        if group_s is None:
            group_s = state.group_seconds[device_type] = group_timeout(state.pg, device_type)
        limits = state.limits[key] = limits_for(timeout, group_s, wait)
    return limits


def limits_for(timeout: float | None, group_s: float, wait: str) -> Limits:
    """How long to wait, for a ``sync_timeout`` of ``timeout`` on a group whose own timeout is ``group_s`` seconds."""
    bound = group_s - margin(group_s)
    if timeout == 0:  # no timer of ours: gloo's own timeout ends the wait; polling (NCCL) would never end: the bound
        limits = Limits(None if wait == "block" else group_s, group_s, True)
    elif timeout is None or timeout >= bound:
        limits = Limits(bound, group_s, True)
    else:
        limits = Limits(timeout, group_s, False)
    if wait != "block":
        return limits
    first = min(NOTE_AFTER, limits.ours) if limits.ours is not None else NOTE_AFTER
    return replace(limits, first=datetime.timedelta(seconds=max(first, MIN_SLICE)))


# --------------------------------------------------------------------------------------------- the ways to wait
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
    return _poll(work.is_completed, lambda: _wait_completed(work), timeout, on_slow, slow_after, clock, sleep)


def _poll(
    done: Callable[[], bool],
    then: Callable[[], None],
    timeout: float | None,
    on_slow: Callable[[], None] | None,
    slow_after: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> bool:
    for _ in range(SPIN_CHECKS):
        if done():
            then()
            return True
    start = clock()
    interval = POLL_FIRST
    slow_called = on_slow is None
    while not done():
        waited = clock() - start
        if timeout is not None and waited >= timeout:
            return False
        if not slow_called and waited >= slow_after:
            slow_called = True
            on_slow()  # type: ignore[misc]
        sleep(interval if timeout is None else min(interval, max(timeout - waited, 0.0)))
        interval = min(interval * POLL_GROWTH, POLL_MAX)
    then()
    return True


def wait_first(work: Any, first: datetime.timedelta) -> bool:
    """The "block" way's first slice on its own: whether ``work`` completed within ``first``.

    False when the slice expired (the work is untouched) or the work failed: :func:`wait_for` then tells which.
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


# ------------------------------------------------------------------------------------------------ waiting a sync
def wait(work: Any, link: Link, device_type: str = "cpu", what: str | None = None) -> None:
    """Wait for ``work`` of a collective of ``link``'s group; raise SyncTimeoutError / SyncPeerError naming it."""
    what = what or link.what
    state = link.state
    limits = limits_of(state, link.timeout, link.policy.wait, device_type)
    try:
        start = time.monotonic()
        # "block": the common case in one call, a small collective done within the first slice.
        if limits.first is not None and wait_first(work, limits.first):
            return
        _wait_long(work, state, link.policy.wait, what, limits, start)
    finally:
        NOTES.last_wait = time.monotonic()  # an exit right after it lets the backend's thread finish with the work


def wait_all(works: Sequence[tuple[Any, str]], link: Link, meanwhile: Callable[[], None] | None = None) -> None:
    """Run ``meanwhile`` (the works are started), then wait for each ``(work, device type)`` in order."""
    if meanwhile is not None:
        meanwhile()
    for work, device_type in works:
        wait(work, link, device_type)


def wait_event(event: Any, link: Link, what: str | None = None) -> None:
    """Wait for a CUDA event recorded after a sync's device work, polling it: no stream synchronisation."""
    limits = limits_of(link.state, link.timeout, "poll", "cuda")
    try:
        if not _poll(event.query, lambda: None, limits.ours, None, 1.0, time.monotonic, time.sleep):
            raise SyncTimeoutError(_timeout_message(what or link.what, limits.ours or 0.0, "`sync_timeout`", link))
    finally:
        NOTES.last_wait = time.monotonic()


def _wait_long(work: Any, state: GroupState, mode: str, what: str, limits: Limits, start: float) -> None:
    """The wait past the first slice: note where this rank waits, and at the timeout say where the peers are."""
    note = f"{state.tag}|{state.syncs}|{what}"
    noted = [False]

    def write_note() -> None:
        noted[0] = True
        NOTES.write("waiting", note)

    try:
        waited = time.monotonic() - start
        ours = None if limits.ours is None else max(limits.ours - waited, 0.0)
        done = wait_for(work, ours, write_note, max(NOTE_AFTER - waited, 0.0), mode=mode)
        found = None if done else NOTES.where_peers_are(state, note)
        bound = limits.group_s - margin(limits.group_s)
        if found is not None and found["missing"] and time.monotonic() - start + NOTE_AFTER < bound:
            # A peer notes where it waits only after NOTE_AFTER: one that arrived (here or elsewhere) just before our
            # timeout is not missing. Wait that long once more, then look again.
            done = wait_for(work, NOTE_AFTER + MIN_SLICE, mode=mode)
            found = None if done else NOTES.where_peers_are(state, note)
    except PeerFailedError as err:
        raise _failure(err, what, state, note, limits, time.monotonic() - start) from err.__cause__
    if done:
        if noted[0]:
            NOTES.write("waiting", "")  # arrived: an old note must not describe this rank at a later timeout
        return
    waited = time.monotonic() - start
    if limits.ours is not None and waited < limits.ours + NOTE_AFTER + 1.0:  # the timeout, and one more look
        waited = limits.ours
    source = "the process group's own timeout" if limits.from_group else "`sync_timeout`"
    raise SyncTimeoutError(_timeout_message(what, waited, source, None, state, limits, describe(found)))


# ------------------------------------------------------------------------------------------------ store notes
class Notes:
    """This process's notes in the rendezvous store, the store's bounded clone, and what the exit handler needs.

    One object per process (the notes are per process: one key per global rank), behind the package's one
    ``atexit`` handler.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: tuple[Any, Any] | None = None  # (the default store, its clone with a bounded timeout)
        self._listed: list[Any] = []  # the stores this process created its note keys in
        self._armed: list[tuple[Any, int, str]] = []  # (store, global rank, generation) to write an exit note to
        self.last_wait = float("-inf")  # time.monotonic() when the last wait of this process returned
        self.before_exit: Callable[[], None] | None = None  # the pending syncs' bounded wait (:mod:`.deferred`)

    def store(self) -> Any:
        """A clone of the default group's store whose reads wait at most ``STORE_ANSWER`` s; None where unreachable."""
        try:
            default = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return None
        found = self._store
        if found is not None and found[0] is default:
            return found[1]
        try:
            clone = default.clone()  # type: ignore[attr-defined]  # torch's stubs lack Store.clone
            clone.set_timeout(datetime.timedelta(seconds=STORE_ANSWER))
        except (RuntimeError, NotImplementedError, AttributeError):  # a store that cannot be cloned: itself
            clone = default
        self._store = (default, clone)
        return clone

    def arm(self, state: GroupState) -> None:
        """Leave an exit note in the store at interpreter exit (once per store and generation; every sync arms)."""
        armed = self._armed
        if armed and armed[-1][2] == state.generation:  # every sync calls this: the common case costs one comparison
            return
        store = self.store()
        if store is None:
            return
        with self._lock:
            armed.append((store, dist.get_rank(), state.generation))
        if len(armed) == 1:
            atexit.register(self._at_exit)

    def _key(self, kind: str, rank: int, generation: str) -> str:
        return f"{_PREFIX}/{generation}/{kind}/{rank}"

    def write(self, kind: str, text: str, store: Any = None, rank: int | None = None, generation: str = "") -> None:
        """This process's note of ``kind``; a store that went away must not hide the real problem: nothing raises."""
        if store is None:
            if not self._armed:
                return
            store, rank, generation = self._armed[-1]
        rank = dist.get_rank() if rank is None else rank
        try:
            with self._lock:
                if any(listed is store for listed in self._listed):
                    store.set(self._key(kind, rank, generation), text)
                    return
                keys = [self._key(each, rank, generation) for each in ("waiting", "exited")]
                store.multi_set(keys, [text if each == kind else "" for each in ("waiting", "exited")])
                store.append(f"{_PREFIX}/{generation}/roster", f"{rank},")  # after the keys: a listed rank's exist
                self._listed.append(store)
        except (RuntimeError, NotImplementedError, AttributeError):  # a store without multi_set: the note alone
            try:
                store.set(self._key(kind, rank, generation), text)
            except RuntimeError:
                pass

    def read(self, store: Any, generation: str, global_ranks: list[int]) -> dict[int, tuple[str, str]]:
        """The ``(waiting, exited)`` notes of ``global_ranks`` ("" where none): two store operations in all."""
        roster = store.compare_set(f"{_PREFIX}/{generation}/roster", "", "")  # the roster, or an empty one made
        listed = {int(rank) for rank in bytes(roster).decode().split(",") if rank}
        ranks = [rank for rank in global_ranks if rank in listed]
        keys = [self._key(kind, rank, generation) for rank in ranks for kind in ("waiting", "exited")]
        values = [bytes(value).decode(errors="replace") for value in store.multi_get(keys)] if keys else []
        notes = {rank: ("", "") for rank in global_ranks}
        for index, rank in enumerate(ranks):
            notes[rank] = (values[2 * index], values[2 * index + 1])
        return notes

    def where_peers_are(self, state: GroupState, note: str) -> dict[str, list[tuple[str, int, str]]] | None:
        """The peers of the group that have not arrived at the sync of ``note``: "exited", "elsewhere", "missing".

        None when the store cannot be read.
        """
        tag, number, _ = note.split("|", 2)
        ranks = dist.get_process_group_ranks(state.pg)
        me = dist.get_rank()
        named = [
            (str(local) if local == glob else f"{local} (global rank {glob})", glob) for local, glob in enumerate(ranks)
        ]
        named = [(name, glob) for name, glob in named if glob != me]
        store = self.store()
        if store is None:
            return None
        try:
            notes = self.read(store, state.generation, [glob for _, glob in named])
        except (RuntimeError, ValueError, NotImplementedError, AttributeError):  # a store that went away: no names
            return None
        found: dict[str, list[tuple[str, int, str]]] = {"exited": [], "elsewhere": [], "missing": []}
        for name, glob in named:
            seen, exited = notes[glob]
            if seen:
                if tuple(seen.split("|", 2)[:2]) != (tag, number):
                    found["elsewhere"].append((name, glob, seen))
                continue  # the same sync: arrived
            found["exited" if exited else "missing"].append((name, glob, exited))
        return found

    def _at_exit(self) -> None:
        if self.before_exit is not None:
            self.before_exit()
        left = self.last_wait + GRACE - time.monotonic()
        if left > 0:  # a wait returned just now: let the backend's threads let go of its work first
            time.sleep(left)
        kind = _exit_kind()
        for store, rank, generation in list(self._armed):
            self.write("exited", kind, store, rank, generation)


# Why a process-global: notes are per process (one key per global rank), and the exit handler needs them.
NOTES = Notes()


def _exit_kind() -> str:
    """What this process's exit note says of its end: ``"exception <type>"`` where it saw a crash, else ``"ended ..."``.

    The one end a process can see of itself is an exception that reached the top of its main thread: the interpreter
    stores it in ``sys.last_exc`` (Python 3.12+) and ``sys.last_value`` before it prints it and finalizes, that is
    before the ``atexit`` handlers run. Nothing else is left to read by then: a ``SystemExit`` at the top (and with it
    the exit code) is consumed before the handlers run, and neither ``sys.excepthook`` nor ``threading.excepthook`` is
    called for an exception that a launcher catches. So a note without an exception is not a clean exit:

    * ``"ended multiprocessing"``: a ``multiprocessing`` worker (``multiprocessing.parent_process()`` is set). Its
      bootstrap catches whatever the target raises, prints the traceback and exits with code 1;
      ``torch.multiprocessing.spawn``'s wrapper catches the exception before that, hands its traceback to the parent
      and calls ``sys.exit(1)``. A crash and a clean end read the same here.
    * ``"ended"``: any other process, a plain interpreter (a script under ``torchrun``, whose agent starts each worker
      as a subprocess of its own). An exception that the script lets through is seen; one that the script or a
      launcher inside it catches (then ``sys.exit(1)``) is not.
    """
    exception = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exception is not None:
        return f"{CRASH} {type(exception).__name__}"
    return f"{ENDED} multiprocessing" if multiprocessing.parent_process() is not None else ENDED


def crashed(found: dict[str, list[tuple[str, int, str]]]) -> list[tuple[str, int, str]]:
    """The exited peers of ``found`` whose exit note says an uncaught exception ended them."""
    return [entry for entry in found["exited"] if entry[2].startswith(f"{CRASH} ")]


def _names(entries: Sequence[tuple[str, int, str]]) -> str:
    return ", ".join(name for name, _, _ in entries)


def _may_have_crashed(ended: Sequence[tuple[str, int, str]]) -> str:
    """The sentences saying why peers whose exit notes saw no exception may have crashed all the same."""
    workers = [entry for entry in ended if entry[2] == f"{ENDED} multiprocessing"]
    plain = [entry for entry in ended if entry not in workers]
    parts = []
    if workers:
        parts.append(
            f"Ranks [{_names(workers)}] may have crashed: they are multiprocessing workers, whose launcher"
            " (`multiprocessing`, `torch.multiprocessing.spawn`) catches their exception itself, so their exit notes"
            " cannot tell a crash from a clean exit. A crash has its traceback in their log (under"
            " `torch.multiprocessing.spawn`, in the `ProcessRaisedException` of the launching process)."
        )
    if plain:
        parts.append(
            f"Ranks [{_names(plain)}] may have crashed: no uncaught exception reached their interpreters, but a script"
            " or launcher that catches the exception itself (and ends with `sys.exit(1)`, say) hides a crash from"
            " their exit notes. A crash has its traceback in their log."
        )
    return " ".join(parts)


def describe(found: dict[str, list[tuple[str, int, str]]] | None) -> str:
    """The sentences of an error that say where the peers are."""
    if found is None:
        return ""
    parts: list[str] = []
    if found["missing"]:
        parts.append(f"Missing: ranks [{_names(found['missing'])}] are not waiting at any torchmetrics_varlen sync.")
    crashes = crashed(found)
    ended = [entry for entry in found["exited"] if entry not in crashes]
    if ended:
        parts.append(f"Ended: the processes of ranks [{_names(ended)}] ended. {_may_have_crashed(ended)}")
        parts.append("If they did not crash, they ran fewer syncs.")
    if crashes:
        names = ", ".join(f"{name} ({text.partition(' ')[2] or 'exception'})" for name, _, text in crashes)
        parts.append(f"Crashed: ranks [{names}] exited after an uncaught exception: read their logs.")
    for name, _, seen in found["elsewhere"]:
        seen_tag, _, seen_what = seen.split("|", 2)
        parts.append(f"Rank {name} waits at another sync: {seen_what} (process group {seen_tag}).")
    if not parts:
        parts.append(
            "Every rank waits at this sync, yet the exchange did not complete (a collective left pending by an"
            " earlier error pairs with it?)."
        )
    return " ".join(parts)


# --------------------------------------------------------------------------------------------------------- errors
def _failure(
    err: PeerFailedError, what: str, state: GroupState, note: str, limits: Limits, waited: float
) -> RuntimeError:
    """The error for a collective the backend failed: its own timeout, a peer that ended, or a peer's crash."""
    message = str(err)
    found = NOTES.where_peers_are(state, note)
    deadline = time.monotonic() + EXIT_GRACE
    # A peer that exits writes its note at interpreter exit, around when its connections close: look again for a
    # moment before calling it a crash.
    while found is not None and not found["exited"] and not _BACKEND_TIMEOUT.search(message):
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
        found = NOTES.where_peers_are(state, note)
    if found is not None and crashed(found):
        return SyncPeerError(_peer_message(what, state, message, crashed(found)))
    if found is not None and found["exited"]:
        return SyncTimeoutError(_exited_message(what, state, found))
    if _BACKEND_TIMEOUT.search(message):
        source = f"the process group's own timeout ({limits.group_s:g} s, enforced by the backend)"
        return SyncTimeoutError(_timeout_message(what, waited, source, None, state, limits, describe(found)))
    return SyncPeerError(_peer_message(what, state, message))


def _timeout_message(
    what: str,
    waited: float,
    source: str,
    link: Link | None,
    state: GroupState | None = None,
    limits: Limits | None = None,
    missing: str = "",
) -> str:
    state = state if state is not None else link.state if link is not None else None
    assert state is not None
    raise_it = (
        " Raise the process group's timeout (`init_process_group(timeout=...)`) where a rank legitimately needs longer."
    )
    if limits is not None and not limits.from_group:
        raise_it = f" (the process group's own timeout is {limits.group_s:g} s)" + raise_it
    if limits is not None and is_nccl(state.backend, "cuda"):
        raise_it += (
            f" On NCCL, with its default asynchronous error handling, the watchdog may end this process when the"
            f" group's timeout ({limits.group_s:g} s) expires, a few seconds after this error: log it and end the job."
        )
    return (
        f"{what}: rank {state.rank} waited {waited:.3g} s ({source}) for the other ranks to arrive at this sync; at"
        " least one never did."
        + (f" {missing}" if missing else "")
        + " Usual causes: ranks that run different numbers of steps (uneven data outside a `Join`: see"
        " `torchmetrics_varlen.join`), or `compute()` / `self.log(...)` called on some ranks only (for example inside"
        " `if trainer.is_global_zero:`): every rank must run the same syncs in the same order. The process group now"
        " has a pending collective and should not be used for anything else." + raise_it
    )


def _exited_message(what: str, state: GroupState, found: dict[str, Any]) -> str:
    """The error for peers whose processes ended with no exception that their exit notes could see."""
    ended = found["exited"]
    return (
        f"{what}: rank {state.rank} waited at this sync while the processes of ranks [{_names(ended)}] ended."
        f" {_may_have_crashed(ended)} If their log has no traceback, they ran fewer syncs than this rank: usually"
        " `compute()` or `self.log(...)` ran on some ranks only (for example inside `if trainer.is_global_zero:`, with"
        " `num_sanity_val_steps=0`), or the ranks ran different numbers of steps. Every rank must run the same syncs in"
        " the same order; the process group cannot be used any more."
    )


def _peer_message(what: str, state: GroupState, error: str, crashed: list[tuple[str, int, str]] | None = None) -> str:
    first = error.strip().splitlines()[0] if error.strip() else "no message"
    names = ", ".join(f"{name} ({text.partition(' ')[2] or 'exception'})" for name, _, text in crashed or [])
    who = f"ranks [{names}] exited after an uncaught exception" if crashed else "another rank of the group crashed"
    who += "" if crashed else " or closed its connection"
    return (
        f"{what}: rank {state.rank} lost a peer during the sync: {who} (the backend said: {first}). Check the logs of"
        f" {'those ranks' if crashed else 'the other ranks'} for the original error; this process group cannot be"
        " used any more." + (SHARED_GPU_FIX if "Duplicate GPU" in error else "")
    )


def device_type_of(tensor: torch.Tensor) -> str:
    """The device type a collective on ``tensor`` is waited for on."""
    return tensor.device.type
