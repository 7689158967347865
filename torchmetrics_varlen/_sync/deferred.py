"""Syncs that finish later: the worker thread behind ``compute_async()``, its queue, and the futures it resolves.

* **The calling thread** takes a snapshot (:func:`snapshot`: a copy of each state, made where the state lives, on
  the current stream) and hands a job to the worker (:func:`submit`); it never waits for a peer, except when
  ``max_in_flight`` syncs of that metric are pending (it then waits for the oldest, with the sync's timeout).
* **One worker thread per process** runs every job in the order of the calls, on the side group of the metric's
  group (:func:`.engine.side_link`: a gloo group of the same ranks, the one the Join worker uses, made on the calling
  thread at the first call). Every rank makes the calls in the same order, so the side groups' collectives pair up as
  the blocking calls' would; no collective of the job's own groups is ever issued from the worker, and a ``join``
  first waits for the jobs on its side group and queues none there while it runs (:func:`hold`), so no side group is
  driven from two threads. Device work of a job (the results' copies back, the metric's compute) runs on the
  caller's CUDA stream, in stream order.
* **Faults.** The worker's waits are the engine's: the sync's timeout, the named errors. A job that ends in
  ``SyncTimeoutError`` or ``SyncPeerError`` leaves a collective pending on its side group: every later job on that
  group raises the same kind of error at once, naming the first failure.
* **Exit.** The package's exit handler (:mod:`.wait`) first waits for the pending jobs, at most the longest of their
  timeouts, and writes to stderr which syncs were lost.
"""

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Any

import torch

from torchmetrics_varlen._sync import engine, wait
from torchmetrics_varlen._sync.group import GroupState, Link
from torchmetrics_varlen.errors import SyncPeerError, SyncTimeoutError

_BREAKING = (SyncTimeoutError, SyncPeerError)
_LOOK = wait.NOTE_AFTER + wait.STORE_ANSWER + 1.0  # a wait's look at the peers' notes after its timeout, at most


@dataclass(eq=False)
class Job:
    """A pending sync: ``run(side_link)`` gives the result; device work on ``stream``, after ``ready`` events."""

    run: Callable[[Link], Any]
    link: Link  # the side group's
    future: "futures.Future[Any]"
    stream: Any = None
    ready: Sequence[Any] = ()


def limit(side: Link) -> float:
    """How long a job on ``side`` may take at most: its timeout, and a look at where the peers are."""
    limits = wait.limits_of(side.state, side.timeout, side.policy.wait)
    return (limits.ours if limits.ours is not None else limits.group_s) + _LOOK


class Worker:
    """The thread that runs every pending sync of the process, in call order, and the jobs it has yet to finish."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: deque[Job] = deque()  # the first is running
        self._thread: threading.Thread | None = None

    def submit(self, job: Job) -> None:
        """Queue ``job``; start the thread if it is not running (first use, or in a forked child)."""
        with self._cond:
            self._jobs.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="torchmetrics-varlen-async", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs[0]
            _run(job)
            with self._cond:
                self._jobs.popleft()
                self._cond.notify_all()

    def settle(self, state: GroupState | None = None, timeout: float | None = None) -> list[Job]:
        """Wait until no job (on ``state``'s side group) is pending, at most ``timeout`` s; what is still pending."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                left = [job for job in self._jobs if state is None or job.link.state is state]
                if not left or (end is not None and time.monotonic() >= end):
                    return left
                self._cond.wait(None if end is None else end - time.monotonic())

    def at_exit(self) -> None:
        """At interpreter exit: wait for the pending jobs (the longest of their limits at most), say what was lost."""
        with self._cond:
            jobs = list(self._jobs)
        if not jobs:
            return
        start = time.monotonic()
        self.settle(None, max(limit(job.link) for job in jobs))
        unfinished = [job.link.what for job in jobs if not job.future.done()]
        failed = [f"{job.link.what}: {_first_line(job.future.exception())}" for job in jobs if _failed(job.future)]
        if unfinished or failed:
            sys.stderr.write(
                f"torchmetrics_varlen: the process exited with {len(jobs)} compute_async() sync(s) pending; after"
                f" {time.monotonic() - start:.3g} s, {len(unfinished)} unfinished (the other ranks raise"
                f" SyncTimeoutError or SyncPeerError there), {len(failed)} failed; their results are lost."
                + "".join(f"\n  unfinished: {what}" for what in sorted(set(unfinished)))
                + "".join(f"\n  failed: {line}" for line in failed[:5])
                + "\n"
            )


# Why a process-global: one thread runs every pending sync of the process in call order, the order every rank makes
# the calls in; the exit handler waits for it.
WORKER = Worker()


def _run(job: Job) -> None:
    state = job.link.state
    try:
        if state.broken is not None:
            raise _again(state.broken, job.link.what)
        for event in job.ready:  # device copies the snapshot made without blocking the caller
            wait.wait_event(event, job.link)
        with torch.cuda.stream(job.stream) if job.stream is not None else contextlib.nullcontext():
            value = job.run(job.link)
    except _BREAKING as err:
        if state.broken is None:
            state.broken = err
        job.future.set_exception(err)
    except BaseException as err:  # the future carries it to whoever reads the result
        job.future.set_exception(err)
    else:
        job.future.set_result(value)


def _failed(future: "futures.Future[Any]") -> bool:
    return future.done() and future.exception() is not None


def _first_line(err: BaseException | None) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"


def _again(first: BaseException, what: str) -> BaseException:
    """The error of a job whose side group an earlier job left with a collective pending: the same kind."""
    err = type(first)(
        f"{what}: not run, because an earlier pending sync on the same process group failed and left a collective"
        f" pending there, so no later sync of it can pair up. The first failure: {first}"
    )
    err.__cause__ = first
    return err


def submit(
    run: Callable[[Link], Any],
    group_link: Link,
    pending: "deque[futures.Future[Any]]",
    max_in_flight: int,
    stream: Any = None,
    ready: Sequence[Any] = (),
) -> "futures.Future[Any] | None":
    """Queue ``run`` on the side group of ``group_link``'s group; its future, also appended to ``pending``.

    At ``max_in_flight`` pending futures of the caller (``pending``), first waits for the oldest. Makes the side group
    at the first call on a group (every rank of the world then, see :func:`.engine.side_link`). None, queuing nothing,
    while a ``join`` drives that side group: the caller syncs at once instead.
    """
    side = engine.side_link(group_link, group_link.timeout)
    if side.state.held:
        return None
    side = replace(side, what=f"{group_link.what} (compute_async)")
    while pending and pending[0].done():
        pending.popleft()
    if len(pending) >= max_in_flight:
        seconds = limit(side) * len(pending)  # the oldest may wait behind the others of the queue
        if not futures.wait([pending[0]], timeout=seconds).done:
            raise SyncTimeoutError(
                f"{side.what}: waited {seconds:.3g} s for the oldest of this metric's {len(pending)} pending syncs"
                f" (max_in_flight={max_in_flight}) and it did not finish: a peer is late, gone or stopped; its future"
                " raises the named error."
            )
        pending.popleft()
    wait.NOTES.arm(side.state)  # the exit handler is registered before the job can be pending at exit
    wait.NOTES.before_exit = WORKER.at_exit
    future: futures.Future[Any] = futures.Future()
    future.set_running_or_notify_cancel()  # never cancelled: the other ranks run the sync, so this rank must too
    pending.append(future)
    WORKER.submit(Job(run, side, future, stream, ready))
    return future


def hold(side: Link, held: bool) -> None:
    """A ``join`` starts (``held``) or stops driving the side group ``side``.

    It first waits for the pending syncs there; while it is held, :func:`submit` queues none (the caller computes at
    once).
    """
    if held:
        WORKER.settle(side.state)
    side.state.held = held


def finished(compute: Callable[[], Any]) -> "futures.Future[Any]":
    """A future already resolved with ``compute()``, or with its exception (a call that syncs at once)."""
    future: futures.Future[Any] = futures.Future()
    try:
        future.set_result(compute())
    except Exception as err:
        future.set_exception(err)
    return future


def wait_all(pending: "deque[futures.Future[Any]]") -> None:
    """Wait for every pending future of a metric (they end within their syncs' timeouts)."""
    futures.wait(list(pending))
    pending.clear()


def snapshot(metric: Any, memo: dict[int, Any]) -> Any:
    """A stand-in of ``metric`` that owns copies of its states, for a sync and a compute on the worker.

    Tensor states are cloned (detached) on their device and stream; list states become new lists of the same items
    (torchmetrics appends items and never changes them in place). ``memo`` holds one copy per state object, so states
    a compute group shares stay shared. The stand-in is of the metric's class, with the metric's other attributes,
    and looks synced (``_is_synced``) as the metric does inside a blocking ``compute()``.
    """
    attrs = dict(vars(metric))
    for name in metric._defaults:
        value = attrs[name]
        copied = memo.get(id(value))
        if copied is None:
            copied = memo[id(value)] = list(value) if isinstance(value, list) else value.detach().clone()
        attrs[name] = copied
    attrs["_is_synced"] = True
    stand_in = object.__new__(type(metric))
    vars(stand_in).update(attrs)
    return stand_in
