"""Ranks that never arrive: the others raise SyncTimeoutError naming them, within about the timeout; mismatches."""

import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist
from _metrics import Total
from conftest import run_distributed
from torchmetrics.aggregation import SumMetric

from torchmetrics_varlen import Metric, SyncMismatchError, SyncTimeoutError, _notes, _policy, _transport, rebase


class Count(Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, x):
        self.count += x.numel()

    def compute(self):
        return self.count


def body_timeouts(rank, world_size, absent, wait):
    """Two syncs that never complete, in one fresh pool (each leaves a collective pending on its own group).

    ``wait`` "poll" forces the polling wait that NCCL gets onto gloo; "block" is gloo's own.
    """
    with contextlib.nullcontext() if wait == "block" else _policy.forced(wait=wait):
        return _timeouts(rank, world_size, absent)


def _timeouts(rank, world_size, absent):
    # 1. Field report 5: compute() inside `if is_global_zero:` (here: on all ranks but one), on the default group,
    #    with the sync timeout taken from the environment.
    os.environ["TORCHMETRICS_VARLEN_SYNC_TIMEOUT"] = "2"
    metric = Total()
    del os.environ["TORCHMETRICS_VARLEN_SYNC_TIMEOUT"]
    metric.update(torch.ones(3))
    # A slow sync first: the absent rank waits there long enough to note it in the store. Once that sync completes,
    # the note must not make the absent rank look "waiting at sync #1" when the next sync times out.
    if rank != absent:
        time.sleep(_transport.NOTE_AFTER + 0.5)
    metric.compute()
    metric.update(torch.ones(3))
    missing = None
    if rank != absent:
        start = time.monotonic()
        try:
            metric.compute()
        except SyncTimeoutError as err:
            missing = {"message": str(err), "seconds": time.monotonic() - start}
    # 2. Ranks waiting at syncs of different process groups: each names the others and where they wait.
    first, second = dist.new_group(), dist.new_group()
    other = Total(process_group=first, sync_timeout=2) if rank == 0 else Count(process_group=second, sync_timeout=2)
    other.update(torch.ones(2))
    try:
        other.compute()
    except SyncTimeoutError as err:
        elsewhere = str(err)
    else:
        elsewhere = None
    return {"missing": missing, "elsewhere": elsewhere, "groups": (first.group_name, second.group_name)}


@pytest.mark.parametrize(("world_size", "wait"), [(2, "block"), (3, "poll"), (3, "block")])
def test_missing_ranks_are_named_within_the_timeout(world_size, wait):
    absent = world_size - 1
    results = run_distributed(body_timeouts, world_size, absent, wait, deadline=60, fresh=True)
    first, second = results[0]["groups"]
    for rank, result in enumerate(results):
        if rank != absent:
            missing = result["missing"]
            assert missing is not None, "expected SyncTimeoutError"
            assert "waited 2 s" in missing["message"]
            assert f"Missing: ranks [{absent}] are not waiting" in missing["message"], missing["message"]
            assert "waits at another sync" not in missing["message"], "a stale note was read"
            assert "is_global_zero" in missing["message"] and "Join" in missing["message"]
            assert 1.5 <= missing["seconds"] < 15
        elsewhere = result["elsewhere"]
        assert elsewhere is not None and "Missing" not in elsewhere, elsewhere
        for peer in range(world_size):
            if (peer == 0) != (rank == 0):  # ranks 1.. wait together on the second group: "arrived" to each other
                what, group = ("Total", first) if peer == 0 else ("Count", second)
                assert f"Rank {peer} waits at another sync: sync of {what}.compute (process group {group})" in (
                    elsewhere
                ), elsewhere


def body_different_metrics(rank, world_size):
    metric = Total(sync_timeout=20) if rank == 0 else Count(sync_timeout=20)
    metric.update(torch.ones(2))
    try:
        metric.compute()
    except SyncMismatchError as err:
        message = str(err)
    else:
        message = None
    again = rebase(SumMetric)()
    again.update(torch.tensor(1.0))
    return {"message": message, "after": again.compute().item()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_different_metrics_raise_mismatch_on_every_rank(world_size):
    for result in run_distributed(body_different_metrics, world_size, deadline=60):
        assert result["message"] is not None
        assert "Total.compute" in result["message"] and "Count.compute" in result["message"]
        assert result["after"] == world_size  # no rank was left inside a collective


def body_store_notes(rank, world_size):
    """The private store access works, and a quick sync never touches the store."""
    reachable = _notes.store() is not None
    calls = []
    original = _notes.store
    _notes.store = lambda: calls.append(1) or original()
    try:
        metric = Total(sync_timeout=30)
        metric.update(torch.ones(2))
        value = metric.compute().item()
    finally:
        _notes.store = original
    return {"reachable": reachable, "store_calls": len(calls), "value": value}


def test_store_is_reachable_and_quick_syncs_do_not_touch_it():
    # torch.distributed.distributed_c10d._get_default_store is private: a torch release that drops it fails here.
    for result in run_distributed(body_store_notes, 2):
        assert result == {"reachable": True, "store_calls": 0, "value": 4.0}


def test_invalid_timeout_values_are_rejected():
    with pytest.raises(ValueError, match="sync_timeout"):
        Total(sync_timeout="soon")
    assert Total(sync_timeout=0).sync_timeout == 0.0  # no timer of ours: the backend's own timeout acts
    assert Total().sync_timeout is None  # the process group's own timeout, read at each sync
    assert Total(sync_timeout=5).sync_timeout == 5.0


def body_foreign_peer(rank, world_size):
    """Rank 1 issues the same collective as the metadata exchange, but its record is not ours (a version mismatch,
    or stock code at the same step) and claims a huge entry count. The others must raise at once, not start a second,
    giant exchange that the foreign rank never joins."""
    from torchmetrics_varlen import gather_all_tensors

    fixed = _transport.INITIAL_WORDS  # a fresh pool: the group's agreed record length is the initial one
    if rank == 1:
        record = torch.full((fixed,), 10**6, dtype=torch.int64)
        dist.all_gather_into_tensor(torch.empty(world_size * fixed, dtype=torch.int64), record)
        return None
    os.environ["TORCHMETRICS_VARLEN_SYNC_TIMEOUT"] = "5"
    try:
        gather_all_tensors(torch.ones(3))
    except SyncMismatchError as err:
        return str(err)
    except SyncTimeoutError as err:  # what an attempted second exchange ends in
        return f"timeout: {err}"
    finally:
        del os.environ["TORCHMETRICS_VARLEN_SYNC_TIMEOUT"]
    return "no error"


@pytest.mark.parametrize("world_size", [2, 3])
def test_foreign_peer_is_named_without_a_second_exchange(world_size):
    results = run_distributed(body_foreign_peer, world_size, deadline=60, fresh=True)
    for rank, message in enumerate(results):
        if rank == 1:
            continue
        assert message.startswith("sync of gather_all_tensors: ranks [1] are not running"), message
