"""A rank that never arrives: the others raise SyncTimeoutError naming it, within about the timeout."""

import time

import pytest
import torch
from conftest import run_distributed
from torchmetrics.aggregation import SumMetric

from torchmetrics_varlen import Metric, SyncMismatchError, SyncTimeoutError, _arrivals, rebase


class Total(Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x):
        self.total += x.sum()

    def compute(self):
        return self.total


class Count(Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, x):
        self.count += x.numel()

    def compute(self):
        return self.count


def body_compute_on_some_ranks_only(rank, world_size, absent, timeout=None):
    """Field report 5: compute() inside `if is_global_zero:` (or on all ranks but one)."""
    metric = Total() if timeout is None else Total(sync_timeout=timeout)
    metric.update(torch.ones(3))
    if rank == absent:
        return {"skipped": True}
    start = time.monotonic()
    try:
        metric.compute()
    except SyncTimeoutError as err:
        return {"message": str(err), "seconds": time.monotonic() - start}
    return {"message": None}


@pytest.mark.parametrize("world_size", [2, 3])
def test_missing_rank_is_named_within_the_timeout(world_size):
    absent = world_size - 1
    results = run_distributed(body_compute_on_some_ranks_only, world_size, absent, 3.0, deadline=60, fresh=True)
    for rank, result in enumerate(results):
        if rank == absent:
            continue
        assert result["message"] is not None, "expected SyncTimeoutError"
        assert f"Missing: ranks [{absent}]" in result["message"]
        assert "is_global_zero" in result["message"] and "Join" in result["message"]
        assert 2.5 <= result["seconds"] < 20


def test_timeout_default_comes_from_the_environment():
    env = {"TORCHMETRICS_VARLEN_SYNC_TIMEOUT": "2"}
    results = run_distributed(body_compute_on_some_ranks_only, 2, 1, deadline=60, fresh=True, env=env)
    assert results[0]["message"] is not None
    assert "waited 2 s" in results[0]["message"]


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


def body_store_is_reachable(rank, world_size):
    return _arrivals._store() is not None


def test_private_store_access_still_works():
    # torch.distributed.distributed_c10d._get_default_store is private: a torch release that drops it fails here.
    assert all(run_distributed(body_store_is_reachable, 2))


def test_invalid_timeout_values_are_rejected():
    with pytest.raises(ValueError, match="sync_timeout"):
        Total(sync_timeout="soon")
    assert Total(sync_timeout=0).sync_timeout is None
    assert Total(sync_timeout=5).sync_timeout == 5.0
