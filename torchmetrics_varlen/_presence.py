"""Presence: where each rank waits, whether it exited, whether it is busy, noted in the rendezvous store.

Every process group has a store (the rendezvous store). A sync that times out or fails must say why, and a rank that
is merely busy must not be taken for a missing one. The collectives cannot tell; the notes each process leaves in the
store can, read by the waiting ranks (``_waits``) once their timeout expired. Three kinds, one key each per global
rank, plus a heartbeat counter:

* **waiting** ``"<group>|<sync number>|<what>"``: written by a rank that has waited ``NOTE_AFTER`` seconds at a
  collective of a sync, cleared when it completes. Syncs are numbered per process group on each rank, so ranks that
  run the same syncs agree on the numbers: the same group and number means "arrived"; another note means "waits at
  another sync"; no note means the peer is not waiting at any sync of this package.
* **busy** ``"<what>"`` plus a heartbeat counter: written while a process is inside a scope that promises to come back
  to the sync (the one rank computing in ``compute_on_rank``; a rank inside ``join``), the counter raised every
  ``BEAT`` seconds by a thread. A waiting rank whose timeout expired keeps waiting while every peer that has not
  arrived is busy and its counter moves: alive and working, not missing.
* **exited** ``"normal"`` or ``"exception <type>"``: written at interpreter exit (``atexit``) by a process that took
  part in a sync, saying whether an uncaught exception ended it (see :func:`_uncaught`). A peer whose connection
  closed and that left ``"normal"`` ended normally: it did not crash, it ran fewer syncs.

**Store traffic.** The first note a process writes to a store creates all three of its keys at once (``multi_set``)
and adds its rank to a roster key (``append``); every later note is one ``set``. So a waiting rank reads every peer's
notes in a constant number of store operations, whatever the world size ``W``: one ``compare_set`` that reads the
roster (or creates it empty), then one ``multi_get`` of the ``3 x (W - 1)`` keys of the listed peers (keys that
exist: ``multi_get`` would wait for a missing one). A look at where the peers are is **2** store operations (it
was up to ``6 (W - 1)`` sequential ones), a look at busy peers' heartbeats **1**; only the bytes read grow with
``W``. A store without these operations (one written in Python) is read key by key, as before.

**Bounded.** Every store operation here runs on a thread of its own and is given up after ``STORE_ANSWER`` seconds:
a store whose host process is frozen (stopped, swapping, deadlocked) answers nothing until the store's own timeout
(the group's, 30 minutes by default), and a rank must still raise its error within about its timeout. Once an
operation was given up, none is started until it returns (so threads do not pile up, and a late write cannot land
after a newer one), and the errors say that the store did not answer.

The store is reached through a private function of ``torch.distributed`` (covered by a test); without it, errors name
no ranks and nothing waits longer than the timeout. Nothing here runs on a sync that completes within ``NOTE_AFTER``.
"""

import atexit
import contextlib
import sys
import threading
import weakref
from collections.abc import Generator
from typing import Any

import torch.distributed as dist

NOTE_AFTER = 1.0  # seconds of waiting before a rank notes where it waits
BEAT = 2.0  # seconds between heartbeats of a busy process: one store increment each, per busy process
STORE_ANSWER = 3.0  # seconds a store operation may take before the store is taken as not answering
_PREFIX = "torchmetrics_varlen"
_ROSTER = f"{_PREFIX}/roster"  # "<rank>,<rank>,...": the processes whose note keys exist
_KINDS = ("waiting", "exited", "busy")  # the note keys of a process, created together


class StoreSilentError(RuntimeError):
    """The store did not answer an operation within ``STORE_ANSWER`` seconds (its host process may be frozen)."""


def store() -> Any:
    """The default group's store, or None where it cannot be reached."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _key(kind: str, global_rank: int) -> str:
    return f"{_PREFIX}/{kind}/{global_rank}"


# ------------------------------------------------------------------------------------------------ bounded store calls
_GIVEN_UP: list[threading.Thread] = []  # the thread of an operation the store did not answer in time


def store_silent() -> bool:
    """Whether an operation the store did not answer in time is still pending (no other is started meanwhile)."""
    return bool(_GIVEN_UP) and _GIVEN_UP[0].is_alive()


def _ask(store_: Any, operation: str, *args: Any) -> Any:
    """``store_.<operation>(*args)``, given up with :class:`StoreSilentError` after ``STORE_ANSWER`` seconds."""
    if store_silent():
        raise StoreSilentError(f"the store did not answer within {STORE_ANSWER:g} s")
    answer: list[tuple[bool, Any]] = []

    def call() -> None:
        try:
            answer.append((True, getattr(store_, operation)(*args)))
        except BaseException as err:  # handed to the caller's thread
            answer.append((False, err))

    thread = threading.Thread(target=call, name="torchmetrics-varlen-store", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no new thread at interpreter shutdown (Python 3.12+, in atexit handlers): ask directly
        return getattr(store_, operation)(*args)
    thread.join(STORE_ANSWER)
    if not answer:  # the daemon thread stays blocked until the store answers or the process ends
        _GIVEN_UP[:] = [thread]
        raise StoreSilentError(f"the store did not answer `{operation}` within {STORE_ANSWER:g} s")
    done, value = answer[0]
    if not done:
        raise value
    return value


# ---------------------------------------------------------------------------------------------------------- notes
_LISTED: list[Any] = []  # the stores this process created its note keys in (and listed itself in the roster of)
_LIST_LOCK = threading.Lock()  # the main thread, a busy scope's thread and atexit may write a first note at once


def write(store_: Any, kind: str, text: str, rank: int | None = None) -> None:
    """This process's note of ``kind`` (as global ``rank``: the current one where None).

    A store that went away or does not answer must not hide the real problem: nothing is raised.
    """
    if store_ is None:
        return
    rank = dist.get_rank() if rank is None else rank
    try:
        with _LIST_LOCK:
            if any(listed is store_ for listed in _LISTED):
                _ask(store_, "set", _key(kind, rank), text)
                return
            values = [text if each == kind else "" for each in _KINDS]
            _ask(store_, "multi_set", [_key(each, rank) for each in _KINDS], values)
            _ask(store_, "append", _ROSTER, f"{rank},")  # after the keys: a listed rank's keys all exist
            _LISTED.append(store_)
    except (RuntimeError, NotImplementedError, AttributeError):  # a store without multi_set: the note alone
        with contextlib.suppress(RuntimeError):
            if not store_silent():
                _ask(store_, "set", _key(kind, rank), text)


def read_notes(store_: Any, global_ranks: list[int]) -> dict[int, tuple[str, str, str]]:
    """The ``(waiting, exited, busy)`` notes of ``global_ranks`` ("" where none): two store operations in all."""
    try:
        roster = _ask(store_, "compare_set", _ROSTER, "", "")  # the roster, or an empty one made: one operation
        listed = {int(rank) for rank in bytes(roster).decode().split(",") if rank}
        ranks = [rank for rank in global_ranks if rank in listed]
        keys = [_key(kind, rank) for rank in ranks for kind in _KINDS]
        values = [bytes(value).decode(errors="replace") for value in _ask(store_, "multi_get", keys)] if keys else []
    except StoreSilentError:
        raise
    except (RuntimeError, NotImplementedError, AttributeError):  # a store without these operations: key by key
        return {
            rank: (_read(store_, "waiting", rank), _read(store_, "exited", rank), _read(store_, "busy", rank))
            for rank in global_ranks
        }
    notes = {rank: ("", "", "") for rank in global_ranks}
    for index, rank in enumerate(ranks):
        notes[rank] = (values[3 * index], values[3 * index + 1], values[3 * index + 2])
    return notes


def _read(store_: Any, kind: str, global_rank: int) -> str:
    key = _key(kind, global_rank)
    return str(_ask(store_, "get", key).decode(errors="replace")) if _ask(store_, "check", [key]) else ""


def peers(group: Any) -> list[tuple[str, int]]:
    """``(name, global rank)`` of every other rank of ``group``."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = dist.get_rank()
    return [
        (str(local) if local == glob else f"{local} (global rank {glob})", glob)
        for local, glob in enumerate(ranks)
        if glob != me
    ]


def where_peers_are(store_: Any, group: Any, note: str) -> dict[str, list[tuple[str, int, str]]] | None:
    """The peers of ``group`` that have not arrived at the sync of ``note``, by where they are.

    Keys: "exited" (ended; the text is the exit note), "elsewhere" (waiting at another sync; the text is that note),
    "busy" (alive in a busy scope; the text says what it does), "missing" (none of these). None when the store cannot
    be read (:func:`store_silent` tells whether it did not answer).
    """
    if store_ is None:
        return None
    tag, number, _ = note.split("|", 2)
    found: dict[str, list[tuple[str, int, str]]] = {"exited": [], "elsewhere": [], "busy": [], "missing": []}
    named = peers(group)
    try:
        notes = read_notes(store_, [global_rank for _, global_rank in named])
    except (RuntimeError, ValueError):
        return None
    for name, global_rank in named:
        seen, exited, busy_with = notes[global_rank]
        if seen:
            if tuple(seen.split("|", 2)[:2]) != (tag, number):
                found["elsewhere"].append((name, global_rank, seen))
            continue  # the same sync: arrived
        if exited:
            found["exited"].append((name, global_rank, exited))
            continue
        found["busy" if busy_with else "missing"].append((name, global_rank, busy_with))
    return found


def crashed(found: dict[str, list[tuple[str, int, str]]]) -> list[tuple[str, int, str]]:
    """The exited peers of ``found`` whose exit note says an uncaught exception ended them."""
    return [entry for entry in found["exited"] if entry[2].startswith("exception")]


def describe(found: dict[str, list[tuple[str, int, str]]] | None) -> str:
    """The sentences of an error that say where the peers are (only that the store did not answer, where so)."""
    if found is None:
        silent = "The store did not answer (its host process, usually rank 0, may be frozen): no rank can be named."
        return silent if store_silent() else ""
    parts: list[str] = []
    if found["missing"]:
        names = ", ".join(name for name, _, _ in found["missing"])
        parts.append(f"Missing: ranks [{names}] are not waiting at any torchmetrics_varlen sync.")
    ended = crashed(found)
    normal = [entry for entry in found["exited"] if entry not in ended]
    if normal:
        names = ", ".join(name for name, _, _ in normal)
        parts.append(f"Exited: ranks [{names}] exited normally (no crash): they ran fewer syncs.")
    if ended:
        names = ", ".join(f"{name} ({text.partition(' ')[2] or 'exception'})" for name, _, text in ended)
        parts.append(f"Crashed: ranks [{names}] exited after an uncaught exception: read their logs.")
    for name, _, text in found["busy"]:
        parts.append(f"Rank {name} is still busy: {text}.")
    for name, _, seen in found["elsewhere"]:
        seen_tag, _, seen_what = seen.split("|", 2)
        parts.append(f"Rank {name} waits at another sync: {seen_what} (process group {seen_tag}).")
    if not parts:
        parts.append(
            "Every rank waits at this sync, yet the exchange did not complete (a collective left pending by an"
            " earlier error pairs with it?)."
        )
    return " ".join(parts)


def beats(store_: Any, global_ranks: list[int]) -> list[int]:
    """The heartbeat counters of ``global_ranks`` (a counter that moves: that process is alive): one operation."""
    keys = [_key("beat", rank) for rank in global_ranks]
    try:
        return [int(value) for value in _ask(store_, "multi_get", keys)]
    except StoreSilentError:
        raise
    except (NotImplementedError, AttributeError):
        return [int(_ask(store_, "add", key, 0)) for key in keys]


# ----------------------------------------------------------------------------------------------------- busy scopes
_BUSY_LOCK = threading.Lock()
_BUSY: list[str] = []  # what this process is busy with, innermost last
_BEATER: list[tuple[threading.Thread, threading.Event]] = []


def _beat(store_: Any, rank: int, stop: threading.Event) -> None:
    key = _key("beat", rank)
    while not stop.wait(BEAT):
        try:
            _ask(store_, "add", key, 1)
        except RuntimeError:  # the store went away or does not answer: nobody can read the beats
            return


@contextlib.contextmanager
def busy(what: str) -> Generator[None, None, None]:
    """Tell waiting peers that this process is alive and doing ``what`` (it will come to the sync) while inside."""
    store_ = store() if dist.is_available() and dist.is_initialized() else None
    if store_ is None:
        yield
        return
    rank = dist.get_rank()
    with _BUSY_LOCK:
        _BUSY.append(what)
        with contextlib.suppress(RuntimeError):  # the counter exists before the note: peers read both at once
            _ask(store_, "add", _key("beat", rank), 0)
        write(store_, "busy", what)
        # Not waiting at any sync now: a note left by a sync that raised would make this rank look stuck there.
        write(store_, "waiting", "")
        if not _BEATER:
            stop = threading.Event()
            thread = threading.Thread(target=_beat, args=(store_, rank, stop), name="torchmetrics-varlen-beat")
            thread.daemon = True
            thread.start()
            _BEATER.append((thread, stop))
    try:
        yield
    finally:
        ending = None
        with _BUSY_LOCK:
            _BUSY.remove(what)
            write(store_, "busy", _BUSY[-1] if _BUSY else "")
            if not _BUSY and _BEATER:
                ending = _BEATER.pop()
        if ending is not None:  # the thread ends within one beat: nothing of ours runs on at interpreter exit
            ending[1].set()
            ending[0].join()


# ---------------------------------------------------------------------------------------------------- exit notes
_EXIT_ARMED: list[Any] = []  # the stores an exit note is armed for (a job may re-initialise its process group)
_ARMED_WORLD: list[Any] = []  # the default group that was current when the note was last armed


def arm_exit_note() -> None:
    """Leave an exit note in the store at interpreter exit (once per store; every sync arms it).

    The store and rank are captured now: by exit time the process group may be destroyed, but a peer still waiting
    can read the store (it lives on as long as its host process does).
    """
    world = dist.group.WORLD
    if _ARMED_WORLD and _ARMED_WORLD[0]() is world:  # every sync calls this: the common case costs one comparison
        return
    # Weakly: a reference would keep a destroyed group's connections open, and its peers blocked in it.
    _ARMED_WORLD[:] = [weakref.ref(world)]
    try:  # the store object only, no traffic: arming costs a quick sync nothing
        store_ = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return
    if any(armed is store_ for armed in _EXIT_ARMED):
        return
    _EXIT_ARMED.append(store_)
    atexit.register(_write_exit, store_, dist.get_rank())


def _write_exit(store_: Any, rank: int) -> None:
    write(store_, "exited", _exit_kind(), rank)  # the group may be destroyed by now: the rank armed with


def _exit_kind() -> str:
    """What ends this process: "normal", or "exception <type>" where an uncaught exception does.

    The interpreter stores an exception that reached the top of the main thread in ``sys.last_exc`` (Python 3.12+)
    and ``sys.last_value`` before it prints it and finalizes, that is before the ``atexit`` handlers run. That is read
    rather than ``sys.excepthook`` wrapped: whatever replaces the hook later (rich tracebacks, a logging framework)
    does not hide it, and ``sys.exit()`` (SystemExit) does not set it. A launcher that catches its process's
    exception itself (``multiprocessing``'s process bootstrap, ``torch.multiprocessing.spawn``) leaves no trace of it
    here: such a rank reads as exited normally (the error is in its log).
    """
    exception = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return "normal" if exception is None else f"exception {type(exception).__name__}"
