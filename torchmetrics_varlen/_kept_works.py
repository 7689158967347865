"""The works of the last sync, kept referenced from Python until the next sync begins.

A backend's own thread (gloo's worker, NCCL's watchdog) drops its reference to a work a moment *after* the work
completed and ``wait`` returned. Where that reference is the last one to the work's tensors, and their Python objects
are gone (a send buffer dropped right after the wait), that thread must take the GIL to free them. In a process that
is exiting, it then cannot: the interpreter ends the thread inside a C++ destructor and the whole process aborts
("terminate called without an active exception", SIGABRT, after its work is done). This hits a rank that returns
without ``destroy_process_group()`` right after its last sync, as a Lightning rank does after its final epoch
(pytorch/pytorch#190489 tracks it in PyTorch).

So every work a sync waits for is kept here. The main thread releases them when the next sync of the process
begins, long after the backend's thread let go, or at interpreter exit while tearing down modules, where it holds the
GIL: the backend's thread never drops the last reference. What stays alive between two syncs is the last sync's works
and the tensors only they still hold (send buffers; results are the caller's anyway).
"""

import threading
from collections import deque
from typing import Any

KEPT_AT_MOST = 256  # a bound for works waited outside any sync's start (Join's counts): older ones let go long ago

_KEPT: "deque[Any]" = deque(maxlen=KEPT_AT_MOST)
_LOCK = threading.Lock()  # the Join worker thread waits for works while the main thread syncs


def keep(work: Any) -> None:
    """Keep ``work`` (about to be waited for) referenced until the next sync begins."""
    with _LOCK:
        _KEPT.append(work)


def release_previous() -> None:
    """A sync begins: let the works of the syncs before it go (their backend threads are done with them)."""
    if not _KEPT:
        return
    with _LOCK:
        released = list(_KEPT)
        _KEPT.clear()
    released.clear()  # outside the lock: freeing a work's tensors may run Python code (finalizers)
