"""Syncs that finish later: the worker thread behind ``compute_async()``, its queue, and the futures it resolves.

The caller snapshots the states (on the current stream) and queues a job, waiting for a peer only at ``max_in_flight``
pending syncs. One worker thread per process runs the jobs in call order (each ``START_AFTER_S`` after its call at the
earliest) on the (gloo) side group of the metric's group: every rank makes the calls in the same order, so the side
groups' collectives pair up as the blocking calls' would. The job's own groups (NCCL's: one driving thread) are never
used from the worker, and a ``join`` waits for the jobs on its side group and queues none there while it runs: no group
is driven from two threads. Device work runs on the caller's stream, in stream order. A job ending in
``SyncTimeoutError`` or ``SyncPeerError`` leaves a collective pending: later jobs on that side group raise the same kind
at once. At exit, :mod:`.wait` waits for pending jobs (at most their longest timeout) and names the lost ones.
"""

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torchmetrics import Metric as StockMetric

from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine import states, wait
from torchmetrics_varlen._engine.group import GroupState, Link
from torchmetrics_varlen.errors import SyncPeerError, SyncTimeoutError

_LOOK = wait.NOTE_AFTER + wait.STORE_ANSWER + 1.0  # a wait's look at the peers' notes after its timeout, at most
# The worker starts a job this long after its call at the earliest. Right after `compute_async()` a loop typically runs
# a little more Python (a `reset()`, a log call), then waits on the accelerator or the data loader, without the GIL. A
# job started at once takes the GIL at the caller's first torch operation and holds it for its first stretch of Python
# (about 0.3 ms in the benchmark), which the caller waits out; started a little later, it runs while the caller waits.
# Measured in the async benchmark (2 gloo ranks, 5 paired repeats, two alternated runs): the 100-key log's share off
# the loop went from 56-79 % to 88-94 %. The price: each result is ready that much later.
START_AFTER_S = 0.0005


@dataclass(eq=False)
class Job:
    """A pending sync: ``run(side_link)`` gives the result; device work on ``stream``, after ``ready`` events."""

    run: Callable[[Link], Any]
    link: Link  # the side group's
    future: "futures.Future[Any]"
    stream: Any = None
    ready: Sequence[Any] = ()
    called: float = field(default_factory=time.monotonic)  # when `compute_async()` queued it


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
                self._cond.wait_for(lambda: self._jobs)
                job = self._jobs[0]
            time.sleep(max(0.0, job.called + START_AFTER_S - time.monotonic()))  # the caller's own Python first
            _run(job)
            with self._cond:
                self._jobs.popleft()
                self._cond.notify_all()

    def settle(self, state: GroupState | None = None, timeout: float | None = None) -> None:
        """Wait until no job (on ``state``'s side group) is pending, at most ``timeout`` s."""
        with self._cond:
            self._cond.wait_for(
                lambda: not any(state is None or job.link.state is state for job in self._jobs), timeout
            )

    def at_exit(self) -> None:
        """At interpreter exit: wait for the pending jobs (the longest of their limits at most), say what was lost."""
        with self._cond:
            jobs = list(self._jobs)
        if not jobs:
            return
        start = time.monotonic()
        self.settle(None, max(limit(job.link) for job in jobs))
        unfinished = [job.link.what for job in jobs if not job.future.done()]
        failed = [
            f"{job.link.what}: {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
            for job in jobs
            if job.future.done() and (err := job.future.exception()) is not None
        ]
        if unfinished or failed:
            sys.stderr.write(
                f"torchmetrics_varlen: the process exited with {len(jobs)} compute_async() sync(s) pending; after"
                f" {time.monotonic() - start:.3g} s, {len(unfinished)} unfinished (the other ranks raise"
                f" SyncTimeoutError or SyncPeerError there), {len(failed)} failed; their results are lost."
                + "".join(f"\n  unfinished: {what}" for what in sorted(set(unfinished)))
                + "".join(f"\n  failed: {line}" for line in failed[:5])
                + "\n"
            )


# Process-global: one thread runs every pending sync in call order, the order of every rank; the exit handler waits.
WORKER = Worker()


def _run(job: Job) -> None:
    state = job.link.state
    try:
        if state.broken is not None:  # an earlier job left a collective pending there: the same kind of error
            raise type(state.broken)(
                f"{job.link.what}: not run, because an earlier pending sync on the same process group failed and left a"
                f" collective pending there, so no later sync of it can pair up. The first failure: {state.broken}"
            ) from state.broken
        for event in job.ready:  # device copies the snapshot made without blocking the caller
            wait.wait_event(event, job.link)
        with torch.cuda.stream(job.stream) if job.stream is not None else contextlib.nullcontext():
            value = job.run(job.link)
    except (SyncTimeoutError, SyncPeerError) as err:
        if state.broken is None:
            state.broken = err
        job.future.set_exception(err)
    except BaseException as err:  # the future carries it to whoever reads the result
        job.future.set_exception(err)
    else:
        job.future.set_result(value)


def submit(
    owner: Any, group_link: Link, device: torch.device, run: Callable[[Link], Any], ready: Sequence[Any] = ()
) -> "futures.Future[Any]":
    """Queue ``run`` on the side group of ``group_link``'s group: its future, also appended to ``owner._tv_pending``.

    At ``owner.max_in_flight`` pending, first waits for the oldest; while a ``join`` drives the side group (made at
    the first call: :func:`._engine.side_link`), ``owner.compute()`` at once.
    """
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    side = _engine.side_link(group_link, group_link.timeout)
    if side.state.held:
        return finished(owner.compute)
    side = replace(side, what=f"{group_link.what} (compute_async)")
    pending, max_in_flight = owner._tv_pending, owner.max_in_flight
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
    """A ``join`` starts (``held``: after the pending syncs there) or stops driving the side group ``side``."""
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


def snapshot(metrics: Sequence[Any], finish: Callable[[Any], Any]) -> tuple[list[Any], Callable[..., list[Any]]]:
    """Stand-ins of ``metrics`` owning copies of their states, and the worker's function: one sync, then each result.

    The function takes the side link and keywords of ``sync_states``. Stand-ins have the metrics' class and attributes
    and look synced. Tensor states are cloned on their device and stream, list states become new lists of the same
    items (torchmetrics never changes items in place); one copy per state object: a compute group's stay shared.
    """
    memo: dict[int, Any] = {}
    stand_ins = []
    for metric in metrics:
        attrs = dict(vars(metric))
        for name in metric._defaults:
            value = attrs[name]
            if id(value) not in memo:
                memo[id(value)] = list(value) if isinstance(value, list) else value.detach().clone()
            attrs[name] = memo[id(value)]
        stand_ins.append(object.__new__(type(metric)))
        vars(stand_ins[-1]).update(attrs, _is_synced=True)
    cached = [metric._computed for metric in metrics]

    def compute(side: Link, **how: Any) -> list[Any]:
        synced = states.sync_states(stand_ins, side, cached=all(value is not None for value in cached), **how)
        if synced is None:  # every rank's caches are valid (no update since): the global values
            return cached
        values = []
        for stand_in, synced_states in zip(stand_ins, synced):
            vars(stand_in).update(synced_states)  # plain attributes, as `metric.set_states` writes them
            values.append(finish(type(stand_in).compute(stand_in)))
        return values

    return stand_ins, compute


def check_in_flight(max_in_flight: object) -> int:
    """``max_in_flight`` checked: an int of at least 1."""
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"Expected `max_in_flight` to be an int of at least 1 but got {max_in_flight!r}")
    return max_in_flight


def has_child_metrics(metric: StockMetric) -> bool:
    """Whether ``metric`` holds metrics of its own (a wrapper): computing it syncs them, on the calling thread only."""
    children = list(vars(metric)["_modules"].values())  # not `modules()`: it hashes metrics, whose hash reads states
    while children:
        child = children.pop()
        if isinstance(child, StockMetric):
            return True
        children += [] if child is None else vars(child)["_modules"].values()
    return False
