"""The tensors of the last sync's collectives, kept referenced from Python until the next sync begins.

A backend's own thread (gloo's worker, NCCL's watchdog) drops its reference to a work, and so to the work's tensors,
a moment *after* the work completed and ``wait`` returned. Where the Python objects of those tensors are gone by then
(a send buffer dropped right after the wait), that thread frees them, and must take the GIL to do so. In a process
that is exiting, it cannot: the interpreter ends the thread inside a C++ destructor and the process aborts
("terminate called without an active exception", SIGABRT, after its work is done). This hits a rank that returns
without ``destroy_process_group()`` right after its last sync, as a Lightning rank does after its final epoch
(pytorch/pytorch#190489 tracks it in PyTorch).

So every tensor a collective of a sync sends or receives is kept here (or by its caller, beyond the sync). The main
thread lets them go when the next sync of the process begins, long after the backend's thread let go of them, or at
interpreter exit while tearing down modules, where it holds the GIL: the backend's thread never frees them. What stays
alive between two syncs is the last sync's buffers that nothing else holds (send buffers, small tables).

The works themselves are not kept: a work holds its group's connections, which ``destroy_process_group()`` must be
able to close (a peer learns from that closing that this rank left).
"""

import threading
from collections import deque
from typing import Any

KEPT_AT_MOST = 1024  # a bound for buffers of collectives issued outside any sync's start: older ones let go long ago

_KEPT: "deque[Any]" = deque(maxlen=KEPT_AT_MOST)
_LOCK = threading.Lock()  # the Join worker thread syncs while the main thread syncs


def keep(*buffers: Any) -> None:
    """Keep ``buffers`` (tensors a collective is given, or a callable holding them) until the next sync begins."""
    with _LOCK:
        _KEPT.extend(buffers)


def release_previous() -> None:
    """A sync begins: let the buffers of the syncs before it go (the backend threads are done with them)."""
    if not _KEPT:
        return
    with _LOCK:
        released = list(_KEPT)
        _KEPT.clear()
    released.clear()  # outside the lock: freeing tensors may run Python code (finalizers)
