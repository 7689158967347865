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
* **exited** ``"normal"``: written at interpreter exit (``atexit``) by a process that took part in a sync. A peer
  whose connection closed and that left this note ended normally: it did not crash, it ran fewer syncs.

The store is reached through a private function of ``torch.distributed`` (covered by a test); without it, errors name
no ranks and nothing waits longer than the timeout. Nothing here runs on a sync that completes within ``NOTE_AFTER``.
"""

import atexit
import contextlib
import threading
import weakref
from collections.abc import Generator
from typing import Any

import torch.distributed as dist

NOTE_AFTER = 1.0  # seconds of waiting before a rank notes where it waits
BEAT = 2.0  # seconds between heartbeats of a busy process: one store increment each, per busy process
_PREFIX = "torchmetrics_varlen"


def store() -> Any:
    """The default group's store, or None where it cannot be reached."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _key(kind: str, global_rank: int) -> str:
    return f"{_PREFIX}/{kind}/{global_rank}"


def read(store_: Any, kind: str, global_rank: int) -> str:
    """A peer's note of ``kind`` ("" when it left none)."""
    key = _key(kind, global_rank)
    return str(store_.get(key).decode(errors="replace")) if store_.check([key]) else ""


def write(store_: Any, kind: str, text: str) -> None:
    """This process's note of ``kind``; a store that went away must not hide the real problem."""
    if store_ is None:
        return
    try:
        store_.set(_key(kind, dist.get_rank()), text)
    except RuntimeError:
        pass


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

    Keys: "exited" (ended normally), "elsewhere" (waiting at another sync; the text is that note), "busy" (alive in a
    busy scope; the text says what it does), "missing" (none of these). None when the store cannot be read.
    """
    if store_ is None:
        return None
    tag, number, _ = note.split("|", 2)
    found: dict[str, list[tuple[str, int, str]]] = {"exited": [], "elsewhere": [], "busy": [], "missing": []}
    try:
        for name, global_rank in peers(group):
            seen = read(store_, "waiting", global_rank)
            if seen:
                if tuple(seen.split("|", 2)[:2]) != (tag, number):
                    found["elsewhere"].append((name, global_rank, seen))
                continue  # the same sync: arrived
            if read(store_, "exited", global_rank):
                found["exited"].append((name, global_rank, ""))
                continue
            busy = read(store_, "busy", global_rank)
            found["busy" if busy else "missing"].append((name, global_rank, busy))
    except (RuntimeError, ValueError):
        return None
    return found


def describe(found: dict[str, list[tuple[str, int, str]]] | None) -> str:
    """The sentences of an error that say where the peers are (empty when the store could not be read)."""
    if found is None:
        return ""
    parts: list[str] = []
    if found["missing"]:
        names = ", ".join(name for name, _, _ in found["missing"])
        parts.append(f"Missing: ranks [{names}] are not waiting at any torchmetrics_varlen sync.")
    if found["exited"]:
        names = ", ".join(name for name, _, _ in found["exited"])
        parts.append(f"Exited: ranks [{names}] ended their process normally (no crash): they ran fewer syncs.")
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
    """The heartbeat counters of ``global_ranks`` (a counter that moves: that process is alive)."""
    return [int(store_.add(_key("beat", rank), 0)) for rank in global_ranks]


# ----------------------------------------------------------------------------------------------------- busy scopes
_BUSY_LOCK = threading.Lock()
_BUSY: list[str] = []  # what this process is busy with, innermost last
_BEATER: list[tuple[threading.Thread, threading.Event]] = []


def _beat(store_: Any, rank: int, stop: threading.Event) -> None:
    key = _key("beat", rank)
    while not stop.wait(BEAT):
        try:
            store_.add(key, 1)
        except RuntimeError:  # the store went away: nobody is left to read the beats
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
    """Leave an "exited normally" note in the store at interpreter exit (once per store; every sync arms it).

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
    try:
        store_.set(_key("exited", rank), "normal")
    except RuntimeError:  # the store's host exited first: nobody is left waiting
        pass
