"""Where a sync runs is decided from facts equal on every rank (issue 20, items 2 and 4), checked on real gloo groups.

NCCL cannot run here, so these tests check the seam the NCCL decisions go through: every caller hands the engine the
metric's device (never the device of whatever tensor a rank happens to hold), the policy is asked with it on every
rank alike, an entry without tensors gets its results on the metric's device, and the backward pass of a
differentiable sync waits the way the policy says (on NCCL: a stream-ordered ``wait()``). The decisions themselves,
with made-up backends and devices, are in ``tests/test_policy.py``.
"""

import contextlib
import warnings

import pytest
import torch
from _helpers import forced_policy
from conftest import run_distributed
from torchmetrics.classification import BinaryAUROC

import torchmetrics_varlen as tv
from torchmetrics_varlen import _engine, compute_on_rank, gather_all_tensors
from torchmetrics_varlen._engine import move
from torchmetrics_varlen._engine import wait as _waits
from torchmetrics_varlen._engine.group import GroupState, link, sent_cap
from torchmetrics_varlen._engine.pack import Joined

DEADLINE = 60.0


@contextlib.contextmanager
def _spy(module, name, record):
    """Record every call of ``module.name`` (args, kwargs) while active; the workers are reused, so undo it after."""
    original = getattr(module, name)

    def spy(*args, **kwargs):
        record.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(module, name, spy)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def _policies_asked(record):
    """Record ``(device, local, policy)`` of every ``GroupState.policy`` call (what ``link`` asks at every sync)."""
    original = GroupState.policy

    def policy(self, device, local):
        decided = original(self, device, local)
        record.append((device, local, decided))
        return decided

    GroupState.policy = policy
    try:
        yield
    finally:
        GroupState.policy = original


class _Values(tv.Metric):
    """One ``cat`` list state: empty on a rank that saw no data."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.values.append(x)

    def compute(self):
        return torch.cat(self.values) if isinstance(self.values, list) else self.values


def _data(rank, world_size):
    everything = torch.arange(10 * world_size, dtype=torch.float64)
    sizes = [0 if r == 0 else 3 + r for r in range(world_size)]  # rank 0 holds nothing: its list states stay []
    start = sum(sizes[:rank])
    return everything, sizes, everything[start : start + sizes[rank]]


def body_engine_asks_with_the_metric_device(rank, world_size):
    everything, sizes, local = _data(rank, world_size)
    entry = [local] if sizes[rank] else []
    asked = []
    metric_device = torch.device("meta")  # stands for a device no local tensor is on (gloo still serves the sync)
    # As every caller does: the link is asked with the metric's device, this rank's first local tensor beside it.
    with _policies_asked(asked):
        sync_link = link(None, metric_device, 30.0, "sync of test", local if sizes[rank] else None)
    request = _engine.Request([entry], 7, "test", cat=[True], device=metric_device, cap=sent_cap(None))
    synced = _engine.run(request, sync_link)
    assert synced is not None
    result = synced.results[0]
    assert isinstance(result, Joined) and result.tensor is not None
    policy = sync_link.policy
    return {
        "asked": [device for device, _, _ in asked],
        "policy": (policy.backend, policy.device, policy.wait, policy.grad_device, policy.broadcast_min),
        "device": result.tensor.device,
        "values": result.tensor.to("cpu") if result.tensor.device.type != "meta" else None,
        "shape": tuple(result.tensor.shape),
        "expected": everything[: sum(sizes)],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_engine_decides_from_the_metric_device_and_an_empty_entry_gets_it(world_size):
    results = run_distributed(body_engine_asks_with_the_metric_device, world_size, deadline=DEADLINE)
    # The policy is decided from the metric's device: the empty rank (no local tensor) decides as the others do.
    assert len({res["policy"] for res in results}) == 1, [res["policy"] for res in results]
    for rank, res in enumerate(results):
        # Every rank asks the policy about the metric's device, the empty rank too (its first local tensor: none).
        assert res["asked"] == [torch.device("meta")], res["asked"]
        assert res["shape"] == tuple(res["expected"].shape)
        if rank == 0:  # no tensor of its own: the results go to the metric's device
            assert res["device"] == torch.device("meta")
        else:  # back on the entry's own device
            assert res["device"] == torch.device("cpu")
            torch.testing.assert_close(res["values"], res["expected"], rtol=0, atol=0)


def _engine_devices(calls):
    return [args[0].device for args, _ in calls]  # each call's first argument: the request


def body_callers_pass_the_metric_device(rank, world_size):
    everything, sizes, local = _data(rank, world_size)
    runs, asked, shared = [], [], []
    metric, auroc = _Values(), BinaryAUROC(thresholds=None)
    members = tv.MetricCollection({"first": _Values(), "second": _Values()})
    if sizes[rank]:
        metric.update(local)
        members.update(local)
        auroc.update(local / local.max(), (local.long() % 2))
    with (
        _spy(_engine, "start", runs),
        _spy(move, "share", shared),
        _policies_asked(asked),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # "compute before update" on the empty rank
        got = {"metric": metric.compute(), "collection": members.compute()["first"]}
        one_rank = compute_on_rank(auroc, dst=world_size - 1)
        hooked = gather_all_tensors(local)
    # compute_on_rank's broadcast of the result runs under the policy its sync was given (asked third).
    share_policies = [args[2].policy for args, _ in shared]
    return {
        "runs": _engine_devices(runs),
        "asked": [device for device, _, _ in asked],
        "share_under_sync_policy": [policy is asked[2][2] for policy in share_policies],
        "got": got,
        "expected": everything[: sum(sizes)],
        "one_rank": one_rank,
        "hooked": [piece.numel() for piece in hooked],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_caller_passes_the_metric_device_on_every_rank(world_size):
    results = run_distributed(body_callers_pass_the_metric_device, world_size, deadline=DEADLINE)
    cpu = torch.device("cpu")
    for res in results:
        # Metric, MetricCollection and compute_on_rank hand the engine the metric's device; the hook has none.
        assert res["runs"] == [cpu, cpu, cpu, None], res["runs"]
        # The policy is asked with it for every sync (the hook: with none). compute_on_rank's broadcast of the result
        # is no longer asked for again: it runs under its sync's link, decided with the metric's device.
        assert res["asked"] == [cpu, cpu, cpu, None], res["asked"]
        assert res["share_under_sync_policy"] == [True], res["share_under_sync_policy"]
        for name, value in res["got"].items():
            torch.testing.assert_close(value, res["expected"], rtol=0, atol=0, msg=name)
        assert res["hooked"] == [0] + [3 + r for r in range(1, world_size)]
    assert len({float(res["one_rank"]) for res in results}) == 1


def body_backward_wait(rank, world_size, forced):
    x = torch.arange(rank + 2, dtype=torch.float64, requires_grad=True)  # uneven: 2, 3, 4 elements
    modes = []

    def record(work, timeout, *args, mode="poll", **kwargs):
        modes.append(mode)
        return original(work, timeout, *args, mode=mode, **kwargs)

    def record_first(work, first):  # gloo's first slice, tried before wait_for: only the "block" way has one
        modes.append("block")
        return first_original(work, first)

    original, first_original = _waits.wait_for, _waits.wait_first
    _waits.wait_for, _waits.wait_first = record, record_first
    try:
        with forced_policy(grad_wait=forced) if forced else contextlib.nullcontext():
            loss = 0.5 * (torch.cat(gather_all_tensors(x, sync_grads=True)) ** 2).sum()
            forward = len(modes)
            loss.backward()
    finally:
        _waits.wait_for, _waits.wait_first = original, first_original
    return {"forward": modes[:forward], "backward": modes[forward:], "grad": x.grad, "x": x.detach()}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("forced", [None, "stream"])
def test_backward_waits_the_policy_way(world_size, forced):
    for res in run_distributed(body_backward_wait, world_size, forced, deadline=DEADLINE):
        assert res["forward"] and set(res["forward"]) == {"block"}  # gloo's wait, unforced or not
        # The backward all-reduce: gloo's own wait, or, forced as on NCCL, one plain stream-ordered wait().
        assert res["backward"] == [forced or "block"]
        # Every rank computes the same loss of all elements: each element's gradient is world_size times itself.
        torch.testing.assert_close(res["grad"], world_size * res["x"], rtol=0, atol=0)
