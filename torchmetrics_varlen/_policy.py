"""The one place that knows backends: where exchange buffers live, how to wait, which data path runs.

Everything else in the package is backend-agnostic. The decisions, and why:

* **Buffer device.** NCCL moves CUDA memory only, so an NCCL group's buffers live on a CUDA device (the device of the
  first CUDA state, else the current device); gloo's on the CPU (gloo stages CUDA tensors through the host anyway);
  any other backend's on the device of the first state. A group created with several backends
  (``"cpu:gloo,cuda:nccl"``) takes the device that the states' device type maps to. States on other devices are
  copied to the buffer device when packed and back to their own device when unpacked: one code path whatever the
  devices, since ``Tensor.to`` is a no-op on the same device.
* **Waiting.** Every collective is started asynchronously and waited for in one of two ways, both with the same
  outcome (done, expired with the collective left pending, or failed), both run by the gloo tests. Both first check
  ``work.is_completed()`` a few hundred times without sleeping (a small collective is done by then), then:

  - ``"block"`` (gloo): ``work.wait(timeout)`` in slices. gloo's work is c10d's base ``Work``, whose timed ``wait``
    is a condition-variable wait that raises "Operation timed out!" and changes nothing (``c10d::Work::wait``), so a
    rank wakes the moment the collective completes. A slice is never zero: c10d reads a zero timeout as "none".
  - ``"poll"`` (NCCL and every other backend): check ``work.is_completed()`` between sleeps of growing length, and
    call ``work.wait()`` *without* a timeout once it completed. A timed ``wait`` is not safe there: on NCCL it blocks
    and, on expiry, marks the work timed out and aborts the communicator (``ProcessGroupNCCL::WorkNCCL::wait``),
    which would tear down the job's group for a rank that is merely late.

  Nothing here aborts a communicator because a rank is late: no timed wait ever runs on NCCL, and our timer only
  stops waiting. Once the backend itself failed a work (its own group timeout, a crashed peer), the untimed ``wait()``
  runs the backend's error handling, which on NCCL may abort the communicator and end the process (the watchdog
  does so at the group's timeout anyway); that is why our timeout is capped below the group's (see ``_transport``).
  A sleep asks the OS for tens of microseconds and gets 100-200 on a busy machine, which is why gloo blocks instead of
  sleeping.
* **Data path.** The padded equal-size gather (``all_gather_into_tensor``) on every backend, and ``all_reduce`` for
  the dense states the plan routes there. NCCL's list ``all_gather`` with unequal sizes is not used: it could not be
  run where this package is tested.

Tests force a policy on gloo with :func:`forced`, and call :func:`buffer_device` and :func:`wait_for` directly with
made-up backends and work objects.
"""

import contextlib
import datetime
import functools
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
# Checks without sleeping first (100-200 us): a small collective completes within them, and a rank that neither
# sleeps nor blocks is not woken up late by the OS (on gloo that took a small metric's sync from 0.82 to 0.77 ms).
SPIN_CHECKS = 500
# Polling: the first checks come quickly (a sync among ready ranks completes in well under a millisecond), then the
# interval grows, so a rank waiting for a late peer costs almost no CPU.
POLL_FIRST = 20e-6
POLL_GROWTH = 1.5
POLL_MAX = 2e-3
MIN_SLICE = 1e-3  # seconds: the shortest timed wait; c10d takes whole milliseconds, and reads 0 as "no timeout"


@dataclass(frozen=True)
class TransportPolicy:
    """The backend-dependent choices of one sync.

    Args:
        backend: the group's backend name, lower case.
        device: where the exchange buffers live.
        reduce: "auto" (the plan's cost model), "never" or "always" (every eligible state all-reduced).
        wait: how the collectives are waited for: "block" or "poll" (see :func:`wait_for`).
    """

    backend: str
    device: torch.device
    reduce: str = "auto"
    wait: str = "poll"


_FORCED = threading.local()


def backend_of(group: Any) -> str:
    """The backend name of ``group`` (the default group when None), lower case."""
    return str(dist.get_backend(group)).lower()


def _serving(backend: str, device_type: str) -> str:
    """The backend that serves tensors of ``device_type``: ``backend`` itself, or its entry for that device type."""
    if ":" not in backend:
        return backend
    mapping = dict(part.split(":", 1) for part in backend.split(","))  # "cpu:gloo,cuda:nccl"
    return mapping.get(device_type) or next(iter(mapping.values()))


def wait_mode(backend: str, device_type: str) -> str:
    """How to wait for a collective of ``backend`` on buffers of ``device_type``: "block" on gloo, else "poll"."""
    return "block" if _serving(backend, device_type) == "gloo" else "poll"


def buffer_device(backend: str, like: torch.device, current_cuda: Callable[[], int]) -> torch.device:
    """Where the buffers of a sync over ``backend`` live, for states whose first device is ``like``."""
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        return buffer_device(_serving(backend, like.type), like, current_cuda)
    if backend == "nccl":
        return like if like.type == "cuda" else torch.device("cuda", current_cuda())
    if backend == "gloo":
        return torch.device("cpu")
    return like


def reduce_mode(raw: str | None = None) -> str:
    """``TORCHMETRICS_VARLEN_REDUCE`` (or ``raw``): "auto" (default), "never" (gather everything) or "always"."""
    raw = os.environ.get(REDUCE_ENV, "auto") if raw is None else raw
    raw = raw.strip().lower() or "auto"
    if raw not in REDUCE_MODES:
        raise ValueError(f"Expected `{REDUCE_ENV}` to be one of {REDUCE_MODES} but got {raw!r}")
    return raw


def policy_for(group: Any, like: torch.device) -> TransportPolicy:
    """The policy of a sync over ``group`` of states whose first device is ``like``."""
    forced: TransportPolicy | None = getattr(_FORCED, "policy", None)
    if forced is not None:
        return forced
    backend = backend_of(group)
    needs_current = like.type != "cuda" and _serving(backend, like.type) == "nccl"
    current = torch.cuda.current_device() if needs_current else -1
    return _policy(backend, like, os.environ.get(REDUCE_ENV, ""), current)


@functools.lru_cache(maxsize=64)
def _policy(backend: str, like: torch.device, raw_reduce: str, current_cuda: int) -> TransportPolicy:
    # Every sync asks for its policy: the answer depends on these values only, so it is built once per combination.
    device = buffer_device(backend, like, lambda: current_cuda)
    return TransportPolicy(backend, device, reduce_mode(raw_reduce), wait_mode(backend, device.type))


@contextlib.contextmanager
def forced(**fields: Any) -> Generator[TransportPolicy, None, None]:
    """Use a policy with ``fields`` replaced (in this thread) for the syncs inside the block: tests."""
    base = TransportPolicy("gloo", torch.device("cpu"), "auto", "block")
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
    mode: str = "poll",
) -> bool:
    """Wait for ``work``; False when ``timeout`` seconds passed first (the work stays pending).

    ``mode`` is "block" (a timed ``work.wait``, only where it has no side effects: gloo) or "poll" (``is_completed``
    checks, then an untimed ``work.wait``). ``on_slow`` runs once after ``slow_after`` seconds of waiting. A work that
    completed with an error raises :class:`PeerFailedError` from the backend's error.
    """
    for _ in range(SPIN_CHECKS):
        if work.is_completed():
            _wait_completed(work)  # on NCCL it orders the current stream after the collective
            return True
    if mode == "block":
        return _wait_blocking(work, timeout, on_slow, slow_after, clock)
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
