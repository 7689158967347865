"""The Join side group and its exchanges: the shadow of a joined rank, the running ranks' step syncs, "terminate".

Once some rank has joined, the per-step syncs of a join's metrics travel on a gloo *side group* (one per process
group, made once by that group's ranks), where a joined rank's worker thread answers each of them as a rank with an
empty batch.

One side group carries every metric of a join, so the worker cannot know beforehand which metric the running ranks
sync next. It sends the empty batch of the metric it expects (flagged :data:`FLAG_SHADOW`); when the exchanged
records show that the running ranks sync another metric of the join, every rank drops that exchange and runs it again,
the workers now with the right metric. Every rank decides this from the exchanged table alone (:func:`verdict`), so
all of them retry, or go on, together. The guess follows the order of the metrics seen so far, so a loop that syncs
its metrics in the same order every iteration costs a retry only while that order is being learnt.

The worker never touches CUDA: it sends plain CPU copies of the metrics' defaults, made on the main thread before the
worker starts, over the gloo side group, and drops what it receives (CPU tensors). A thread that copied to or from a
GPU would run on the stream the main thread shares with it, which the main thread made wait on NCCL work that
completes only after the running ranks' next step sync: a circular wait.
"""

import datetime
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric as StockMetric

from torchmetrics_varlen import _engine, _protocol, _transport, _waits
from torchmetrics_varlen._state_sync import (
    StateDict,
    _warn_mean_of_means,
    layout_text,
    reduce_results,
    run_layout,
    sync_layout,
)

TERMINATE = _protocol.context_hash("torchmetrics_varlen.join.terminate")
FAILED = _protocol.context_hash("torchmetrics_varlen.join.failed")
FLAG_SHADOW = _protocol.FLAG_SHADOW  # every header bit is defined in _protocol, so that no two share a bit
GO, RETRY, END, FAIL = "go", "retry", "end", "fail"


class JoinShadowError(RuntimeError):
    """The worker that shadows a metric's per-step syncs failed on some rank (raised by :func:`join` on exit)."""


# ------------------------------------------------------------------------------------------------- side groups
# Keyed by the process group object, held weakly on both sides: torch.distributed holds its groups until they are
# destroyed, so an entry lives exactly as long as both groups do. A group destroyed with `destroy_process_group()`
# is never kept alive here (a gloo group finalised at interpreter exit can abort the process), and a re-initialised
# world is a new key.
_SIDE_GROUPS: "weakref.WeakKeyDictionary[Any, weakref.ref[Any]]" = weakref.WeakKeyDictionary()
_SIDE_LOCK = threading.Lock()
_SIDE_DESC = "torchmetrics_varlen_join_side"  # what torch's logs and traces call the side groups


def cached_side_group(group: Any) -> Any:
    """The side group made for ``group`` (the world when None), or None."""
    key = dist.group.WORLD if group is None else group
    with _SIDE_LOCK:
        ref = _SIDE_GROUPS.get(key)
    return ref() if ref is not None else None


def side_group(group: Any, device: torch.device) -> Any:
    """The gloo side group of ``group``, made on first use by the ranks of ``group`` (each of them gets here alike).

    Args:
        group: the metrics' process group (the world when None).
        device: the device ``Join`` counts the ranks on for ``group`` (the metrics' ``join_device``).
    """
    side = cached_side_group(group)
    if side is None:
        key = dist.group.WORLD if group is None else group
        side = _make_side_group(key, device)
        with _SIDE_LOCK:
            _SIDE_GROUPS[key] = weakref.ref(side)
    return side


def _make_side_group(group: Any, device: torch.device) -> Any:
    """A gloo group of the ranks of ``group``, with ``group``'s timeout; only those ranks take part.

    gloo whatever the job's backend: the worker thread must not drive an NCCL communicator.
    """
    timeout = datetime.timedelta(seconds=_waits.group_timeout(group, device.type))
    if group is dist.group.WORLD:  # every rank is a member: torch's plain contract, as a collective on the world
        return dist.new_group(ranks=None, backend="gloo", timeout=timeout, group_desc=_SIDE_DESC)
    # The ranks of another subgroup (the other "dp" slice of a mesh) make their own side group at the same time, so
    # the world cannot enter one `new_group` together, and torch's counter-based names would give both side groups
    # one name (colliding rendezvous keys). With `use_local_synchronization` only the members take part, and torch
    # names the group by a hash of its ranks and of how many groups the process knows (`_process_group_name`,
    # `_hash_ranks_to_str`): distinct for disjoint rank sets, equal on the members once they know equally many.
    _equalise_known_groups(group, device)
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(
        ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True, group_desc=_SIDE_DESC
    )


def _known_groups() -> int:
    # What `_hash_ranks_to_str` counts: the groups this process is registered in (torch's private `_world`; the
    # subgroup tests fail if a release renames it).
    return len(dist.distributed_c10d._world.pg_names)


def _equalise_known_groups(group: Any, device: torch.device) -> None:
    """Make every rank of ``group`` know as many process groups as the one that knows most (a collective on it).

    A rank that made groups the others are not in (``new_group`` registers a group on its members only) knows more
    of them, and would hash another name for the side group, so that the members would never meet. The others make
    one-rank gloo groups until the counts agree (each is named after its one rank: nothing to collide with).
    """
    mine = _known_groups()
    counts = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    most, fewest = int(counts[0].item()), -int(counts[1].item())
    if most == fewest:
        return
    rank = dist.get_rank()
    for _ in range(most - mine):
        dist.new_group(ranks=[rank], backend="gloo", use_local_synchronization=True, group_desc=_SIDE_DESC + "_pad")


# ------------------------------------------------------------------------------------------------------ records
def step_context(metric: StockMetric, position: int) -> int:
    """The context of a per-step sync on the side group of the join's metric at ``position``.

    The position is part of it: two metrics of one class have the same layout but may have other defaults (a
    ``num_classes``), and a worker must never answer one with the other's empty batch.
    """
    return _protocol.context_hash(f"{layout_text([metric], 'step')}|join:{position}")


def verdict(table: Tensor, contexts: Sequence[int]) -> tuple[str, int]:
    """What a side-group exchange does, from its table alone (so every rank decides alike), and the running context.

    FAIL: a worker sent its failure record. END: the last ranks to join sent "terminate". RETRY: the running ranks
    agree on a step sync of the join's metrics, and some worker expected another one. GO: anything else (a mismatch
    among running ranks is then raised by the plan, on every rank).
    """
    rows = table[:, : _protocol.HEADER_LEN].tolist()
    found = [row[_protocol.H_CONTEXT] for row in rows]
    if FAILED in found:
        return FAIL, 0
    if TERMINATE in found:
        return END, 0
    shadow = [bool(row[_protocol.H_FLAGS] & FLAG_SHADOW) for row in rows]
    running = {context for context, flag in zip(found, shadow) if not flag}
    if len(running) == 1:
        context = running.pop()
        stale = any(flag and seen != context for seen, flag in zip(found, shadow))
        if stale and context in contexts:
            return RETRY, context
        return GO, context
    return GO, 0


def failed_ranks(table: Tensor) -> list[int]:
    """The ranks whose record is a worker's failure record."""
    return [rank for rank, row in enumerate(table[:, _protocol.H_CONTEXT].tolist()) if row == FAILED]


def failure_message(what: str, ranks: Sequence[int]) -> str:
    """The error of the ranks that saw another rank's worker fail."""
    return (
        f"The Join worker that shadows the per-step syncs of {what} failed on rank"
        f" {', '.join(map(str, ranks))} of its join group; see that rank's error. The job cannot go on: end it."
    )


# ------------------------------------------------------------------------------------------- the running ranks
def step_sync(
    metric: StockMetric, position: int, side: Any, contexts: Sequence[int], label: str, timeout: float | None
) -> StateDict:
    """A running rank's per-step sync on the side group: run again when a worker expected another metric."""
    stop: Callable[[Tensor], bool] = lambda table: verdict(table, contexts)[0] == RETRY  # noqa: E731
    while True:
        layout = sync_layout([metric], "step")
        layout.context = contexts[position]
        synced = run_layout(layout, side, label=label, timeout=timeout, phase="step", stop=stop)
        if synced is not None:
            break
    _warn_mean_of_means([metric], layout, synced.plan)
    reduced = reduce_results(layout, synced, layout.state_name)
    return {name: value for (_, name), value in zip(layout.keys, reduced)}


def exchange_terminate(side: Any, timeout: float | None, what: str) -> None:
    """The last ranks to join end the workers: one "terminate" record; raise if a worker failed meanwhile."""
    if _transport.world_of(side) is None:  # a group of one: no other rank, no worker to end
        return
    seen: list[Tensor] = []

    def stop(table: Tensor) -> bool:
        seen.append(table)
        return True

    _engine.run(_engine.Request([], side, TERMINATE, "Join.terminate", timeout, stop=stop))
    failed = failed_ranks(seen[0])
    if failed:
        raise JoinShadowError(failure_message(what, failed))


# ------------------------------------------------------------------------------------------------- the worker
def cpu_defaults(metric: StockMetric) -> StateDict:
    """The states of a rank with an empty batch, as plain CPU tensors (a fresh list for list states).

    Made on the main thread: a copy off the GPU, or a tensor subclass's own code, must not run on the worker.
    """
    values: StateDict = {}
    for name, value in metric._defaults.items():
        if isinstance(value, list):
            values[name] = []
        else:
            values[name] = value.detach().to("cpu", copy=True).as_subclass(torch.Tensor)
    return values


class Shadow:
    """A joined rank's worker: answers the running ranks' per-step syncs of ``metrics`` until "terminate".

    Args:
        metrics: the join's metrics, in the same order on every rank.
        side: the side group.
        timeout: seconds each exchange waits for the other ranks.
        what: the metrics, named for error messages.
    """

    def __init__(self, metrics: Sequence[StockMetric], side: Any, timeout: float | None, what: str) -> None:
        self.metrics = list(metrics)
        self.side = side
        self.timeout = timeout
        self.what = what
        self.contexts = [step_context(metric, position) for position, metric in enumerate(self.metrics)]
        self.errors: list[BaseException] = []
        self._values: list[StateDict] = []
        self._start_error: Exception | None = None
        self._thread: threading.Thread | None = None
        self._next: dict[tuple[int, ...], int] = {}  # the last two contexts seen -> the one that followed
        self._history: tuple[int, ...] = ()

    @property
    def started(self) -> bool:
        """Whether the worker was started (this rank joined before the others were done)."""
        return self._thread is not None

    def start(self) -> None:
        """Snapshot the empty batches on this (the main) thread, then start the worker."""
        try:
            self._values = [cpu_defaults(metric) for metric in self.metrics]
        except Exception as err:  # raised by the worker, which sends the failure record the running ranks expect
            self._start_error = err
        rank = dist.get_rank(self.side)
        self._thread = threading.Thread(target=self._work, args=(rank,), name="torchmetrics-varlen-join", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker (it ends at the terminate record, or on a failure)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _guess(self) -> int:
        if not self._history:
            return 0
        context = self._next.get(self._history, self._history[-1])
        return self.contexts.index(context) if context in self.contexts else 0

    def _learn(self, context: int) -> None:
        self._next[self._history] = context
        self._history = (*self._history, context)[-2:]

    def _work(self, rank: int) -> None:
        at_boundary = True  # no exchange of ours is half done: a whole failure record can still be sent
        try:
            if self._start_error is not None:
                raise self._start_error
            index = self._guess()
            while True:
                at_boundary = False
                outcome, context = self._shadow_once(index)
                at_boundary = True
                if outcome == END:
                    return
                if outcome == RETRY:  # the running ranks sync another metric: correct the guess, send that one
                    self._next[self._history] = context
                    index = self.contexts.index(context)
                    continue
                self._learn(self.contexts[index])
                index = self._guess()
        except BaseException as err:
            if isinstance(err, JoinShadowError):  # a peer's worker failed: its rank is named already
                self.errors.append(err)
                return
            wrapped = JoinShadowError(
                f"The Join worker that shadows the per-step syncs of {self.what} failed on rank {rank} of its join"
                f" group: {type(err).__name__}: {err}"
            )
            wrapped.__cause__ = err
            self.errors.append(wrapped)
            if at_boundary:  # else an exchange is half done: the peers end in a timeout or a mismatch instead
                self._send_failure(rank)

    def _shadow_once(self, index: int) -> tuple[str, int]:
        """One exchange as a rank with an empty batch of metric ``index``: what the table said."""
        metric = self.metrics[index]
        seen: list[tuple[str, int]] = []
        failed: list[int] = []

        def stop(table: Tensor) -> bool:
            outcome = verdict(table, self.contexts)
            seen.append(outcome)
            failed.extend(failed_ranks(table) if outcome[0] == FAIL else [])
            return outcome[0] != GO

        layout = sync_layout([metric], "step", [self._values[index]])
        layout.context = self.contexts[index]
        label = f"{type(metric).__name__}.step"
        # The CPU, not the metric's device: the worker must never touch CUDA (its results are dropped anyway).
        cpu = torch.device("cpu")
        run_layout(
            layout, self.side, label=label, timeout=self.timeout, flags=FLAG_SHADOW, phase="step", stop=stop, device=cpu
        )
        if failed:
            raise JoinShadowError(failure_message(self.what, failed))
        return seen[0]

    def _send_failure(self, rank: int) -> None:
        """Send a record the running ranks' per-step sync refuses, naming this rank, instead of an empty batch."""
        try:
            label = f"Join failed on rank {rank}"
            _engine.run(_engine.Request([], self.side, FAILED, label, self.timeout, stop=lambda table: True))
        except Exception:  # the original error is what gets reported
            pass
