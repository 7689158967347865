"""GPU check scenarios for the timeouts (issue 20 items 5 and 6): our timeout against the process group's own.

Each scenario makes a process group of its own with the job's backend (NCCL on GPUs; gloo in ``--cpu`` mode, where
the same code runs as the gloo variant) and a short timeout, so that a collective left pending never touches the
job's group. On NCCL, the group is made with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: the watchdog then only logs the
pending collective when the group's timeout passes, instead of ending the process and the rest of the check
(``ProcessGroupNCCL`` reads the variable when a group is made). What each scenario expects:

* ``timeout-group-shorter``: a rank never syncs; the group's timeout (6 s) is shorter than ``sync_timeout`` (60 s):
  ``SyncTimeoutError`` a margin before 6 s, naming the rank and saying it was the group's timeout (before: the work
  failed first and the user saw ``SyncPeerError``).
* ``timeout-group-longer``: the same with a 30 s group and ``sync_timeout=3``: ``SyncTimeoutError`` after 3 s.
* ``timeout-blocking-wait``: ``TORCH_NCCL_BLOCKING_WAIT=1`` (no watchdog), a 6 s group and ``sync_timeout=0`` (no
  timer of ours): ``SyncTimeoutError`` by the group's timeout, never an endless poll.
* ``busy-compute-on-rank``: ``compute_on_rank`` whose compute takes 5 s on rank 0, ``sync_timeout=2``, a 30 s group:
  no error, the exact value (the waiting ranks see rank 0's heartbeat).
"""

import contextlib
import datetime
import os
import time
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._gpu_common import Ctx, Scenario, _binary, _close, _sizes, _SumCat, _update
from benchmarks._gpu_scenarios import _await_missing
from torchmetrics_varlen.onerank import compute_on_rank

__all__ = ["SCENARIOS"]

SHORT_GROUP = 6.0
LONG_GROUP = 30.0
SHORT_SYNC = 3.0
BUSY_SECONDS = 5.0


@contextlib.contextmanager
def _env(**values: str) -> Generator[None, None, None]:
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _group(ctx: Ctx, seconds: float, **env: str) -> Any:
    """A group of every rank with the job's backend and a timeout of ``seconds``; every rank makes it."""
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    with _env(**env):
        return dist.new_group(backend=ctx.backend, timeout=datetime.timedelta(seconds=seconds))


def _missing(ctx: Ctx, group: Any, sync_timeout: float, source: str, limit: float) -> str:
    absent = ctx.world_size - 1
    sizes = _sizes(ctx.world_size, empty=-1, base=7)
    values, _ = _binary(sum(sizes), seed=21)
    metric = _SumCat(process_group=group, sync_timeout=sync_timeout).to(ctx.device)
    _update(metric, *ctx.local((values,), sizes))
    if ctx.rank == absent:
        return f"rank {absent} skipped compute() on purpose"
    message, waited = _await_missing(metric, absent)
    if source not in message:
        raise AssertionError(f"SyncTimeoutError does not say {source!r}: {message}")
    if waited > limit:
        raise AssertionError(f"SyncTimeoutError came after {waited:.1f} s, expected by {limit:g} s: {message}")
    return f"SyncTimeoutError after {waited:.1f} s names rank {absent} and says {source!r}"


def _group_shorter(ctx: Ctx) -> str:
    group = _group(ctx, SHORT_GROUP)
    return _missing(ctx, group, 60.0, "the process group's own timeout", SHORT_GROUP + 5)


def _group_longer(ctx: Ctx) -> str:
    group = _group(ctx, LONG_GROUP)
    return _missing(ctx, group, SHORT_SYNC, "`sync_timeout`", SHORT_SYNC + 5)


def _blocking_wait(ctx: Ctx) -> str:
    group = _group(ctx, SHORT_GROUP, TORCH_NCCL_BLOCKING_WAIT="1")
    return _missing(ctx, group, 0.0, "the process group's own timeout", SHORT_GROUP + 5)


class _SlowOnZero(_SumCat):
    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        if dist.get_rank() == 0:
            time.sleep(BUSY_SECONDS)
        return super().compute()


def _busy_compute_on_rank(ctx: Ctx) -> str:
    group = _group(ctx, LONG_GROUP)
    sizes = _sizes(ctx.world_size, empty=-1, base=7)
    values, _ = _binary(sum(sizes), seed=22)
    metric = _SlowOnZero(process_group=group, sync_timeout=2.0).to(ctx.device)
    _update(metric, *ctx.local((values,), sizes))
    total, gathered = compute_on_rank(metric, dst=0)  # any error fails the scenario
    _close("sum state", total, values.double().sum(), rtol=1e-6)
    _close("cat state", gathered, values, rtol=0, atol=0)
    return f"rank 0 computed for {BUSY_SECONDS:g} s with sync_timeout=2: no error, as one process"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("timeout-group-shorter", "missing rank, group timeout 6 s < sync_timeout 60 s", _group_shorter),
    Scenario("timeout-group-longer", "missing rank, group timeout 30 s > sync_timeout 3 s", _group_longer),
    Scenario("timeout-blocking-wait", "missing rank, TORCH_NCCL_BLOCKING_WAIT=1, sync_timeout=0", _blocking_wait),
    Scenario("busy-compute-on-rank", "compute_on_rank computing 5 s with sync_timeout=2", _busy_compute_on_rank),
)
