"""Process exit right after a collective: give the backend's threads a moment to let go of its work first.

A backend's own thread (gloo's worker, NCCL's watchdog) drops its reference to a work a moment *after* the work
completed and ``wait`` returned. Where that reference is the last one, the thread destroys the work and its
references to the work's tensors; a tensor with a Python object hands that object back as its count drops, which
takes the GIL. While the interpreter runs, that is harmless. In a process that is already finalizing, the thread
cannot take it: the interpreter ends the thread inside a C++ destructor and the process aborts ("terminate called
without an active exception", SIGABRT, after its work is done). This hits a rank that returns without
``destroy_process_group()`` right after its last sync, as a Lightning rank does after its final epoch
(pytorch/pytorch#190489 tracks it in PyTorch).

So a sync lets its works and their buffers go as soon as it ends (nothing it moved stays allocated once its results
are dropped: on a GPU that is device memory), and every wait notes when it returned. An ``atexit`` handler, which
runs before finalization, sleeps until :data:`GRACE` seconds have passed since the last one: the backend's threads
have let go by then (gloo's worker within microseconds; NCCL's watchdog within its polling interval, 100 ms in
``ProcessGroupNCCL``). A process that did not sync within the last :data:`GRACE` seconds exits without waiting.
"""

import atexit
import time

GRACE = 0.5  # seconds after the last wait returned during which an exiting process waits

_LAST_WAIT = [float("-inf")]  # time.monotonic() when the last wait of this process returned


def waited() -> None:
    """Note that a wait returned (or gave up) now: an exit within :data:`GRACE` seconds waits for the rest."""
    _LAST_WAIT[0] = time.monotonic()


def remaining() -> float:
    """Seconds an exit now would wait: what is left of :data:`GRACE` since the last wait returned (0 when none)."""
    return max(_LAST_WAIT[0] + GRACE - time.monotonic(), 0.0)


def _before_exit() -> None:
    left = remaining()
    if left > 0:
        time.sleep(left)


atexit.register(_before_exit)
