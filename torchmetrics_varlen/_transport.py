"""The only module that talks to ``torch.distributed``: world queries, the two exchanges, the backend choice.

What runs where:

* gloo (CPU): tested here. Buffers live on the CPU; each exchange is one ``all_gather_single``
  (``all_gather_into_tensor`` before torch 2.13) of equal-size buffers, the smaller ones padded up to the largest.
* NCCL (CUDA): not runnable on the machines this package is tested on. Buffers live on the current CUDA device (CPU
  states, for example with ``compute_on_cpu=True``, are moved there for the transfer and back afterwards), and the data
  exchange uses NCCL's list ``all_gather``, which accepts unequal sizes, so nothing is padded.
* any other backend: buffers stay on the device of the first tensor, the exchange is the padded equal-size gather.

Collectives are looked up on ``torch.distributed`` at call time, so tests can count them by wrapping those functions.
"""

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torchmetrics_varlen import _arrivals
from torchmetrics_varlen.errors import SyncTimeoutError

ProcessGroup = Any  # torch.distributed.ProcessGroup; kept loose because its import path moved between torch releases

TIMEOUT_ENV = "TORCHMETRICS_VARLEN_SYNC_TIMEOUT"
DEFAULT_SYNC_TIMEOUT = 300.0


def world_of(group: ProcessGroup | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` within ``group``, or None when no sync is needed (no process group, or a group of one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size(group)
    if world_size <= 1:
        return None
    return dist.get_rank(group), world_size


def _backend(group: ProcessGroup | None) -> str:
    return str(dist.get_backend(group)).lower()


def transport_device(group: ProcessGroup | None, like: torch.device) -> torch.device:
    """The device the exchange buffers live on: the one place that knows which backend wants which device."""
    backend = _backend(group)
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    return like


def default_timeout() -> float | None:
    """Sync timeout in seconds: ``TORCHMETRICS_VARLEN_SYNC_TIMEOUT`` if set (0: only the group's own), else 300."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_SYNC_TIMEOUT
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(f"Expected `{TIMEOUT_ENV}` to be a number of seconds but got {raw!r}") from err
    return value if value > 0 else None


def _gather_equal(output: Tensor, local: Tensor, group: ProcessGroup | None, async_op: bool = False) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=async_op)


def exchange_metadata(
    record: list[int], group: ProcessGroup | None, device: torch.device, timeout: float | None, what: str
) -> list[list[int]]:
    """Collective 1: every rank's fixed-size record, as nested Python ints (one device-to-host copy)."""
    world_size = dist.get_world_size(group)
    local = torch.tensor(record, dtype=torch.int64, device=device)
    table = torch.empty(world_size * len(record), dtype=torch.int64, device=device)
    number = _arrivals.next_sync_number(group)
    if timeout is None:
        _gather_equal(table, local, group)
    else:
        work = _gather_equal(table, local, group, async_op=True)
        # A short first wait, then a note in the store saying where this rank waits: nothing extra when all is well.
        if not _wait(work, min(_arrivals.NOTE_AFTER, timeout)):
            _arrivals.note_waiting(number, what)
            if not _wait(work, max(timeout - _arrivals.NOTE_AFTER, 0.0)):
                missing = _arrivals.describe_missing(group, number)
                raise SyncTimeoutError(_timeout_message(what, timeout, group, missing))
    return table.view(world_size, len(record)).tolist()  # type: ignore[no-any-return]


def _wait(work: Any, seconds: float) -> bool:
    """Wait for ``work``; False if it is still pending after ``seconds``. Other failures propagate."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as err:
        if "timed out" in str(err).lower() or "timeout" in str(err).lower():
            return False
        raise
    return True


def exchange_payload(buffer: Tensor, nbytes: list[int], group: ProcessGroup | None) -> list[Tensor]:
    """Collective 2: every rank's ``uint8`` buffer; element i holds at least rank i's ``nbytes[i]`` bytes."""
    world_size = len(nbytes)
    if "nccl" in _backend(group):
        rows = [torch.empty(size, dtype=torch.uint8, device=buffer.device) for size in nbytes]
        dist.all_gather(rows, buffer[: nbytes[dist.get_rank(group)]], group=group)
        return rows
    output = torch.empty(world_size * buffer.numel(), dtype=torch.uint8, device=buffer.device)
    _gather_equal(output, buffer, group)
    return list(output.view(world_size, buffer.numel()).unbind(0))


def _timeout_message(what: str, timeout: float, group: ProcessGroup | None, missing: str = "") -> str:
    rank = dist.get_rank(group)
    return (
        f"{what}: rank {rank} waited {timeout:g} s for the other ranks to arrive at this sync; at least one never did."
        + (f" {missing}" if missing else "")
        + " Usual causes: ranks that run different numbers of steps (uneven data without"
        " `torch.distributed.algorithms.join.Join`), or `compute()` / `self.log(...)` called on rank 0 only (for"
        " example inside `if trainer.is_global_zero:`): every rank must run the same syncs in the same order."
        " The process group now has a pending collective and should not be used for anything else."
    )
