"""The one place that knows backends: where exchange buffers live, how to wait, which data path runs.

Everything else in the package is backend-agnostic. The decisions, and why:

* **Buffer device.** NCCL moves CUDA memory only, so an NCCL group's buffers live on a CUDA device (the device of the
  first CUDA state, else the current device); gloo's on the CPU (gloo stages CUDA tensors through the host anyway);
  any other backend's on the device of the first state. A group created with several backends
  (``"cpu:gloo,cuda:nccl"``) takes the device that the states' device type maps to. States on other devices are
  copied to the buffer device when packed and back to their own device when unpacked: one code path whatever the
  devices, since ``Tensor.to`` is a no-op on the same device.
* **Waiting.** Every collective is started asynchronously and waited on by polling ``work.is_completed()``, then
  ``work.wait()`` *without* a timeout. A timed ``wait`` behaves differently per backend: on NCCL it blocks and, on
  expiry, marks the work timed out and aborts the communicator (``ProcessGroupNCCL::WorkNCCL::wait``), which would
  tear down the job's group for a rank that is merely late. Polling behaves the same on every backend, so the gloo
  tests cover it, and nothing here ever aborts a communicator. A wait that expires leaves the collective pending.
* **Data path.** The padded equal-size gather (``all_gather_into_tensor``) on every backend, and ``all_reduce`` for
  the dense states the plan routes there. NCCL's list ``all_gather`` with unequal sizes is not used: it could not be
  run where this package is tested.

Tests force a policy on gloo with :func:`forced`, and call :func:`buffer_device` and :func:`wait_for` directly with
made-up backends and work objects.
"""

import contextlib
import os
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

REDUCE_ENV = "TORCHMETRICS_VARLEN_REDUCE"
REDUCE_MODES = ("auto", "never", "always")
# Polling: the first checks come quickly (a sync among ready ranks completes in well under a millisecond), then the
# interval grows, so a rank waiting for a late peer costs almost no CPU.
POLL_FIRST = 20e-6
POLL_GROWTH = 1.5
POLL_MAX = 2e-3


@dataclass(frozen=True)
class TransportPolicy:
    """The backend-dependent choices of one sync.

    Args:
        backend: the group's backend name, lower case.
        device: where the exchange buffers live.
        reduce: "auto" (the plan's cost model), "never" or "always" (every eligible state all-reduced).
    """

    backend: str
    device: torch.device
    reduce: str = "auto"


_FORCED = threading.local()


def backend_of(group: Any) -> str:
    """The backend name of ``group`` (the default group when None), lower case."""
    return str(dist.get_backend(group)).lower()


def buffer_device(backend: str, like: torch.device, current_cuda: Callable[[], int]) -> torch.device:
    """Where the buffers of a sync over ``backend`` live, for states whose first device is ``like``."""
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        mapping = dict(part.split(":", 1) for part in backend.split(","))
        chosen = mapping.get(like.type) or next(iter(mapping.values()))
        return buffer_device(chosen, like, current_cuda)
    if backend == "nccl":
        return like if like.type == "cuda" else torch.device("cuda", current_cuda())
    if backend == "gloo":
        return torch.device("cpu")
    return like


def reduce_mode() -> str:
    """``TORCHMETRICS_VARLEN_REDUCE``: "auto" (default), "never" (gather everything) or "always"."""
    raw = os.environ.get(REDUCE_ENV, "auto").strip().lower() or "auto"
    if raw not in REDUCE_MODES:
        raise ValueError(f"Expected `{REDUCE_ENV}` to be one of {REDUCE_MODES} but got {raw!r}")
    return raw


def policy_for(group: Any, like: torch.device) -> TransportPolicy:
    """The policy of a sync over ``group`` of states whose first device is ``like``."""
    forced: TransportPolicy | None = getattr(_FORCED, "policy", None)
    if forced is not None:
        return forced
    backend = backend_of(group)
    return TransportPolicy(backend, buffer_device(backend, like, torch.cuda.current_device), reduce_mode())


@contextlib.contextmanager
def forced(**fields: Any) -> Generator[TransportPolicy, None, None]:
    """Use a policy with ``fields`` replaced (in this thread) for the syncs inside the block: tests."""
    base = TransportPolicy("gloo", torch.device("cpu"), "auto")
    policy = replace(base, **fields)
    previous = getattr(_FORCED, "policy", None)
    _FORCED.policy = policy
    try:
        yield policy
    finally:
        _FORCED.policy = previous


class PeerFailedError(RuntimeError):
    """A collective failed (a peer crashed or closed its connection); carries the backend's error as the cause."""


def wait_for(
    work: Any,
    timeout: float | None,
    on_slow: Callable[[], None] | None = None,
    slow_after: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Wait for ``work`` by polling; False when ``timeout`` seconds passed first (the work stays pending).

    ``on_slow`` runs once after ``slow_after`` seconds of waiting. A work that completed with an error raises
    :class:`PeerFailedError` from the backend's error. No timeout is ever passed to ``work.wait``.
    """
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
    try:
        work.wait()  # completed: returns at once (on NCCL it orders the current stream after the collective)
    except RuntimeError as err:
        raise PeerFailedError(str(err)) from err
    return True
