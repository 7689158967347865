"""The works of the last sync, kept referenced from Python until the next sync begins.

A backend's own thread (gloo's worker, NCCL's watchdog) drops its reference to a work a moment *after* the work
completed and ``wait`` returned. Where that reference is the last one, the thread destroys the work, and with it its
references to the work's tensors. A tensor that has a Python object hands that object back as its count drops (torch
keeps the Python object alive while C++ shares the tensor), which takes the GIL, even where Python still holds the
tensor. In a process that is exiting, the thread cannot take it: the interpreter ends the thread inside a C++
destructor and the process aborts ("terminate called without an active exception", SIGABRT, after its work is
done). This hits a rank that returns without ``destroy_process_group()`` right after its last sync, as a Lightning
rank does after its final epoch (pytorch/pytorch#190489 tracks it in PyTorch). Keeping the tensors is not enough;
keeping the work is.

So every work a sync waits for is kept here, and the main thread, holding the GIL, destroys it: while the records of
the next sync of the process travel (long after the backend's thread let go of it), or at interpreter exit while it
tears down modules. A work also holds its group's connections (and through them the rendezvous): so the kept works
are let go as soon as a group that was synced on is freed (``destroy_process_group()`` frees the world, before a job
makes its group again on the same port; a group a metric still holds goes with the metric), and at once after a
failed wait (so that the peers learn that this rank left). Until then the last sync's send buffers stay alive.
"""

import threading
import weakref
from collections import deque
from typing import Any

KEPT_AT_MOST = 256  # a bound for works waited outside any sync's start (Join's counts): older ones let go long ago

_KEPT: "deque[Any]" = deque(maxlen=KEPT_AT_MOST)
_LOCK = threading.Lock()  # the Join worker thread waits for works while the main thread syncs


def release_when_freed(group: Any) -> None:
    """Let the kept works go when ``group`` (a process group object) is freed; called at its first sync."""
    ending = weakref.finalize(group, release)
    # Not at interpreter exit: a backend thread may hold the last works for a moment more; the modules' teardown
    # destroys them later, on this thread.
    ending.atexit = False


def keep(work: Any) -> None:
    """Keep ``work`` (about to be waited for) referenced until the next sync begins."""
    with _LOCK:
        _KEPT.append(work)


def release() -> None:
    """Let the kept works go: a sync begins (their backend threads are done with them), or a wait failed."""
    if not _KEPT:
        return
    with _LOCK:
        released = list(_KEPT)
        _KEPT.clear()
    released.clear()  # outside the lock: freeing a work's tensors may run Python code (finalizers)
