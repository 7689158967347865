"""Ranks that never arrive: the others raise SyncTimeoutError naming them, within about the timeout; mismatches."""

import contextlib
import ctypes
import datetime
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist
from _helpers import forced_policy
from _metrics import Total
from conftest import PG_TIMEOUT, run_distributed
from torch import multiprocessing as mp
from torchmetrics.aggregation import CatMetric, SumMetric

from torchmetrics_varlen import (
    Metric,
    SyncMismatchError,
    SyncPeerError,
    SyncTimeoutError,
    join,
    rebase,
)
from torchmetrics_varlen._engine import group, wait
from torchmetrics_varlen.onerank import compute_on_rank


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
    with contextlib.nullcontext() if wait == "block" else forced_policy(wait=wait):
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
        time.sleep(wait.NOTE_AFTER + 0.5)
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
    reachable = wait.NOTES.store() is not None
    calls = []
    original = wait.NOTES.store
    wait.NOTES.store = lambda: calls.append(1) or original()
    try:
        metric = Total(sync_timeout=30)
        metric.update(torch.ones(2))
        value = metric.compute().item()
    finally:
        wait.NOTES.store = original
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

    fixed = group.INITIAL_WORDS  # a fresh pool: the group's agreed record length is the initial one
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


# ------------------------------------------------------------------------ the group's own timeout (issue 20 items 5, 6)
def body_group_timeouts(rank, world_size):
    """The timeout a group was created with is read from it (torch keeps it in the backend's options: private)."""
    short = dist.new_group(timeout=datetime.timedelta(seconds=7))
    return {"world": group.group_timeout(dist.group.WORLD, "cpu"), "short": group.group_timeout(short, "cpu")}


def test_the_group_timeout_is_read_from_the_group():
    # A torch release that moves `Backend.options._timeout` fails here, not silently at a user's timeout.
    for result in run_distributed(body_group_timeouts, 2, deadline=60):
        assert result == {"world": PG_TIMEOUT, "short": 7.0}


def body_backend_timeout(rank, world_size, absent, sync_timeout):
    """A rank never arrives at a sync on a group created with a 4 s timeout."""
    short = dist.new_group(timeout=datetime.timedelta(seconds=4))
    metric = Total(process_group=short, sync_timeout=sync_timeout)
    metric.update(torch.ones(2))
    if rank == absent:
        time.sleep(8)  # alive, never syncing: the others' waits end by the group's timeout
        return None
    start = time.monotonic()
    try:
        metric.compute()
    except (SyncTimeoutError, SyncPeerError) as err:
        return {"type": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
    return None


@pytest.mark.parametrize(("world_size", "sync_timeout"), [(2, None), (2, 0), (3, 60)])
def test_a_missing_rank_against_the_group_timeout_is_a_timeout_naming_it(world_size, sync_timeout):
    # None: our timer is the group's (4 s, less a margin); 0: no timer of ours, gloo's own timeout fails the work
    # (before: SyncPeerError "another rank crashed", the missing rank not named); 60: capped to the group's.
    absent = world_size - 1
    results = run_distributed(body_backend_timeout, world_size, absent, sync_timeout, deadline=60, fresh=True)
    for rank, result in enumerate(results):
        if rank == absent:
            continue
        assert result is not None and result["type"] == "SyncTimeoutError", result
        assert f"Missing: ranks [{absent}] are not waiting" in result["message"], result["message"]
        assert "the process group's own timeout" in result["message"], result["message"]
        assert result["seconds"] < 30


# ------------------------------------------------------------------------------ alive and busy peers (issue 20 item 5)
class SlowOnRankZero(Total):
    """`compute()` takes 4 s on rank 0: longer than the 2 s sync timeout of the ranks waiting for its result."""

    def compute(self):
        if dist.get_rank() == 0:
            time.sleep(4)
        return super().compute()


def body_busy_compute_on_rank(rank, world_size):
    metric = SlowOnRankZero(sync_timeout=2)
    metric.update(torch.arange(rank + 2, dtype=torch.float32))
    return compute_on_rank(metric, dst=0).item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_long_compute_on_rank_is_not_a_missing_rank(world_size):
    # Before: the ranks waiting for rank 0's result raised SyncTimeoutError after 2 s.
    expected = torch.cat([torch.arange(r + 2, dtype=torch.float32) for r in range(world_size)]).sum().item()
    assert run_distributed(body_busy_compute_on_rank, world_size, deadline=90) == [expected] * world_size


class StepSum(Total):
    def __init__(self, **kwargs):
        super().__init__(dist_sync_on_step=True, **kwargs)


def body_pause_inside_join(rank, world_size):
    """Rank 0 runs more steps and pauses 4 s between two of them (a checkpoint save) while the others shadow."""
    steps = 4 if rank == 0 else 1
    metric = StepSum(sync_timeout=2)
    values = []
    with join(metric):
        for step in range(steps):
            if rank == 0 and step == 2:
                time.sleep(4)
            values.append(metric(torch.full((rank + 1,), float(step + 1))).item())
    return {"values": values, "epoch": metric.compute().item()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_pause_between_steps_inside_join_is_not_a_missing_rank(world_size):
    # Before: the shadows timed out after 2 s and every rank failed.
    results = run_distributed(body_pause_inside_join, world_size, deadline=90, fresh=True)
    steps = [4] + [1] * (world_size - 1)
    per_step = [sum((r + 1) * float(s + 1) for r in range(world_size) if s < steps[r]) for s in range(max(steps))]
    epoch = sum((r + 1) * float(s + 1) for r in range(world_size) for s in range(steps[r]))
    for rank, result in enumerate(results):
        assert result["values"] == per_step[: steps[rank]]
        assert result["epoch"] == epoch


# ----------------------------------------------------------------- a peer that ended without a crash (issue 19 item 6)
def _exit_main(rank, world_size, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    metric = Total(sync_timeout=60)
    metric.update(torch.ones(2))
    metric.compute()  # every rank: the first epoch
    if rank == world_size - 1:
        return  # a normal end of the process (as a Lightning rank whose fit is over): it syncs no more
    metric.update(torch.ones(2))
    try:
        metric.compute()  # as under `if trainer.is_global_zero:`
    except (SyncTimeoutError, SyncPeerError) as err:
        results.put((rank, type(err).__name__, str(err)))
    else:
        results.put((rank, "no error", ""))
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_peer_that_exited_normally_is_not_reported_as_a_crash(world_size, tmp_path):
    # Before: SyncPeerError "another rank crashed or closed its connection".
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_exit_main, args=(rank, world_size, str(tmp_path / "rdv"), results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        seen = [results.get(timeout=90) for _ in range(world_size - 1)]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert procs[-1].exitcode == 0
    for rank, kind, message in seen:
        assert kind == "SyncTimeoutError", (rank, kind, message)
        assert f"the processes of ranks [{world_size - 1}] ended" in message, message
        # Issue 47: its exit note cannot tell this from a crash that multiprocessing caught: it says both.
        assert "may have crashed" in message and "is_global_zero" in message, message
        assert "nothing crashed" not in message and "normally" not in message, message


def _resident_mib():
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # what glibc's heap kept of freed blocks is not what a sync holds
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def body_memory_after_compute(rank, world_size, side):
    baseline = _resident_mib()
    metric = CatMetric() if side == "stock" else rebase(CatMetric)(sync_timeout=30)
    metric.update(torch.rand(16 * 2**20 + 1000 * rank))  # 64 MiB a rank, uneven: a padded gather or broadcasts
    started = time.monotonic()
    value = metric.compute()
    assert value.numel() == sum(16 * 2**20 + 1000 * r for r in range(world_size))
    del value, metric
    return _resident_mib() - baseline, wait.NOTES.last_wait >= started


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_sync_holds_no_memory_once_its_results_are_dropped(world_size):
    # Issue 34 item 4: the works of the last sync used to be kept until the next one, and with them every buffer they
    # moved (192 MiB a rank here, on a GPU device memory). Stock in the same steps is the reference.
    stock = run_distributed(body_memory_after_compute, world_size, "stock")
    ours = run_distributed(body_memory_after_compute, world_size, "ours")
    for (held, _), (stock_held, _) in zip(ours, stock):
        assert held < max(stock_held, 0) + 16, (ours, stock)  # MiB, against 64 MiB of data a rank
    # Its waits noted when they returned: an exit within the grace would first give the backend's thread the rest.
    assert all(noted for _, noted in ours), ours


def test_exit_grace_counts_from_the_last_wait(monkeypatch):
    monkeypatch.setattr(wait.NOTES, "_armed", [])  # no store to note the exit in: the grace alone
    monkeypatch.setattr(wait.NOTES, "last_wait", float("-inf"))
    start = time.monotonic()
    wait.NOTES._at_exit()  # what atexit runs: no wait returned lately, nothing to sleep out
    assert time.monotonic() - start < 0.2 * wait.GRACE
    wait.NOTES.last_wait = time.monotonic()  # a wait returned just now
    start = time.monotonic()
    wait.NOTES._at_exit()  # sleeps out the rest of the grace
    assert time.monotonic() - start >= 0.8 * wait.GRACE


# ---------------------------------------------------------------------- the reduce mode travels (issue 20 item 8)
def body_reduce_modes(rank, world_size):
    os.environ[group.REDUCE_ENV] = "never" if rank == 0 else "always"
    try:
        metric = Total(sync_timeout=30)
        metric.update(torch.ones(100_000))  # large: not inline, so the routes would differ
        try:
            metric.compute()
        except SyncMismatchError as err:
            return str(err)
        return "no error"
    finally:
        del os.environ[group.REDUCE_ENV]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_reduce_modes_raise_a_mismatch(world_size):
    for message in run_distributed(body_reduce_modes, world_size, deadline=60, fresh=True):
        assert "TORCHMETRICS_VARLEN_REDUCE" in message, message
        assert "rank 0: 'never'" in message and "rank 1: 'always'" in message, message


# ---------------------------------------------------------------- record lengths follow the group object (item 8)
class ManyStates(Metric):
    """40 states: a record longer than a group's first agreed length (room for 30 entries)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for index in range(40):
            self.add_state(f"s{index}", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x):
        self.s0 += x.sum()

    def compute(self):
        return self.s0


def body_lengths_after_reinit(rank, world_size, init_file):
    metric = ManyStates(sync_timeout=30)
    metric.update(torch.ones(2))
    metric.compute()  # a long record: the group learns a longer agreed length
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    sizes = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original = getattr(dist, name)  # the metadata exchange's collective (see comm.gather_equal)

    def spy(output, local, *args, **kwargs):
        sizes.append(local.numel())
        return original(output, local, *args, **kwargs)

    setattr(dist, name, spy)
    try:
        total = Total(sync_timeout=30)
        total.update(torch.ones(2))
        total.compute()
    finally:
        setattr(dist, name, original)
    return sizes[0]


def test_a_new_process_group_starts_with_fresh_record_lengths(tmp_path):
    # Before: the lengths were keyed by the group's name ("0" again after re-init): a survivor of an elastic restart
    # kept the old length while a new process started afresh.
    results = run_distributed(body_lengths_after_reinit, 2, str(tmp_path / "again"), deadline=60, fresh=True)
    assert results == [group.INITIAL_WORDS] * 2
