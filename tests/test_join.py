"""Join: ranks with fewer steps shadow the metric's per-step syncs; nothing hangs; values stay exact."""

import sys

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torch.distributed.algorithms.join import Join

from torchmetrics_varlen import Metric, gather_all_tensors, join


class BatchMSE(Metric):
    """Mean squared error over the global batch; a loss with per-step syncs."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(dist_sync_on_step=True, **kwargs)
        self.add_state("sse", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("seen", default=[], dist_reduce_fx="cat")

    def update(self, preds, target):
        self.sse = self.sse + ((preds.double() - target.double()) ** 2).sum()
        self.count = self.count + target.numel()
        self.seen.append(target.double())

    def compute(self):
        return self.sse / self.count


STEPS = {2: [10, 7], 3: [10, 7, 0]}


def _batches(rank, steps, seed=0):
    gen = torch.Generator().manual_seed(100 + rank + seed)
    # Uneven batch sizes too: 3..5 samples.
    return [
        (torch.randn(3 + (s + rank) % 3, 4, generator=gen), torch.randn(3 + (s + rank) % 3, generator=gen))
        for s in range(steps)
    ]


def body_join_ddp_loss(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    metric = BatchMSE()
    seen_preds, seen_target, step_values = [], [], []
    with join(model, metric):
        for x, y in _batches(rank, STEPS[world_size][rank]):
            preds = model(x.double()).squeeze(-1)
            loss = metric(preds, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen_preds.append(preds.detach())
            seen_target.append(y.double())
            step_values.append(loss.detach())
    epoch = metric.compute()
    metric._forward_cache = None  # holds the last loss with its graph, which deepcopy refuses (stock behaviour)
    copied = metric.clone()  # a session holds a thread and a process group: the copy starts outside Join
    assert copied._join_session is None and metric._join_group is not None
    torch.testing.assert_close(copied.compute(), epoch)
    # Reference: every sample any rank evaluated, gathered after the fact and scored by one process.
    local_p = torch.cat(seen_preds) if seen_preds else torch.empty(0, dtype=torch.float64)
    local_t = torch.cat(seen_target) if seen_target else torch.empty(0, dtype=torch.float64)
    all_p = torch.cat(gather_all_tensors(local_p))
    all_t = torch.cat(gather_all_tensors(local_t))
    return {"epoch": epoch, "expected": ((all_p - all_t) ** 2).mean(), "steps": len(step_values)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_with_ddp_loss_does_not_hang_and_is_exact(world_size):
    # Shared pools: a passing Join leaves nothing pending (a hang hits the deadline, which closes the pool).
    results = run_distributed(body_join_ddp_loss, world_size, deadline=60)
    for rank, result in enumerate(results):
        assert result["steps"] == STEPS[world_size][rank]
        torch.testing.assert_close(result["epoch"], result["expected"])


def body_join_several_syncs_per_iteration(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    first, second = BatchMSE(), BatchMSE()
    seen_preds, seen_target = [], []
    with join(model, first, second):
        for x, y in _batches(rank, STEPS[world_size][rank], seed=2):
            preds = model(x.double()).squeeze(-1)
            loss = first(preds, y) + first(preds, y) + second(preds, y)  # three per-step syncs per iteration
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen_preds.append(preds.detach())
            seen_target.append(y.double())
    local_p = torch.cat(seen_preds) if seen_preds else torch.empty(0, dtype=torch.float64)
    local_t = torch.cat(seen_target) if seen_target else torch.empty(0, dtype=torch.float64)
    all_p, all_t = torch.cat(gather_all_tensors(local_p)), torch.cat(gather_all_tensors(local_t))
    expected = ((all_p - all_t) ** 2).mean()
    return {"first": first.compute(), "second": second.compute(), "expected": expected}


def test_join_shadows_several_syncs_per_iteration():
    # The shadow answers whatever per-step syncs come: it does not count iterations.
    for result in run_distributed(body_join_several_syncs_per_iteration, 3, deadline=60):
        torch.testing.assert_close(result["second"], result["expected"])
        torch.testing.assert_close(result["first"], result["expected"])  # each update appears twice: same mean


def body_join_metric_alone(rank, world_size):
    metric = BatchMSE()
    batches = _batches(rank, STEPS[world_size][rank], seed=1)
    values = []
    with join(None, metric):
        for x, y in batches:
            values.append(metric(x[:, 0].double(), y))
    epoch = metric.compute()
    # Per-step truth: at step s, the global batch is the batches of the ranks that still have a step s.
    everything = [_batches(r, STEPS[world_size][r], seed=1) for r in range(world_size)]
    expected_steps = []
    for step in range(len(batches)):
        xs = torch.cat([b[step][0][:, 0] for b in everything if step < len(b)]).double()
        ys = torch.cat([b[step][1] for b in everything if step < len(b)]).double()
        expected_steps.append(((xs - ys) ** 2).mean())
    xs = torch.cat([x[:, 0] for b in everything for x, _ in b]).double()
    ys = torch.cat([y for b in everything for _, y in b]).double()
    return {"values": values, "expected_steps": expected_steps, "epoch": epoch, "expected": ((xs - ys) ** 2).mean()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_with_metric_alone_gives_global_batch_values(world_size):
    for result in run_distributed(body_join_metric_alone, world_size, deadline=60):
        assert len(result["values"]) == len(result["expected_steps"])
        for got, expected in zip(result["values"], result["expected_steps"]):
            torch.testing.assert_close(got, expected)
        torch.testing.assert_close(result["epoch"], result["expected"])


def body_join_refuses_what_it_cannot_shadow(rank, world_size):
    messages = {}
    try:
        with join(BatchMSE(sync_grads=True)):
            pass
    except RuntimeError as err:
        messages["sync_grads"] = str(err)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    metric = BatchMSE()
    # A plain Join runs DDP's hook before the metric's: refused on every rank, before any collective.
    try:
        with Join([model, metric]):
            pass
    except ValueError as err:
        messages["plain"] = str(err)
    try:
        with join(metric, model):  # roles, not positions: a model after the metrics is not a metric
            pass
    except TypeError as err:
        messages["model_as_metric"] = str(err)
    # The refused joins left the metric as it was: per-step syncs on its own group, outside any Join.
    value = metric(torch.full((2,), float(rank)), torch.zeros(2))
    return {"messages": messages, "join_active": metric._join_session is not None, "value": value.item()}


def test_join_refuses_what_it_cannot_shadow_on_every_rank():
    for result in run_distributed(body_join_refuses_what_it_cannot_shadow, 2, deadline=60):
        assert "sync_grads" in result["messages"]["sync_grads"]
        assert "torchmetrics_varlen.join(ddp_model, metric" in result["messages"]["plain"]
        assert "DistributedDataParallel" in result["messages"]["model_as_metric"]
        assert result["join_active"] is False
        assert result["value"] == (0**2 + 0**2 + 1**2 + 1**2) / 4  # the global batch of both ranks


def body_join_body_raises(rank, world_size):
    metric = BatchMSE()
    try:
        with join(metric):
            metric(torch.full((2,), float(rank)), torch.zeros(2))  # a per-step sync inside the join, on every rank
            raise KeyError("the loop failed")
    except KeyError:
        pass
    # Outside the join again: the per-step sync must use the metric's own group, not the join group.
    value = metric(torch.full((3,), float(rank + 1)), torch.zeros(3))
    return {"join_active": metric._join_session is not None, "enabled": metric._join_config.enable, "value": value.item()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_join_whose_body_raises_leaves_join_mode(world_size):
    expected = sum((r + 1) ** 2 for r in range(world_size)) / world_size  # every rank's batch holds rank + 1
    for result in run_distributed(body_join_body_raises, world_size, deadline=60):
        assert result == {"join_active": False, "enabled": False, "value": expected}


def body_one_side_group_per_process_group(rank, world_size):
    calls = []
    original = dist.new_group

    def recording_new_group(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return original(*args, **kwargs)

    dist.new_group = recording_new_group
    try:
        first, second, third = BatchMSE(), BatchMSE(), BatchMSE()
        for metrics in [(first, second), (first, second), (third,)]:  # three joins, three metrics
            with join(*metrics):
                for x, y in _batches(rank, STEPS[world_size][rank]):
                    for metric in metrics:
                        metric(x[:, 0].double(), y)
    finally:
        dist.new_group = original
    side = first._join_group
    return {
        "backends": calls,
        "side": dist.get_backend(side),
        "shared": second._join_group is side and third._join_group is side,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_gloo_side_group_per_process_group_made_once(world_size):
    # One side group for every metric and every join on a process group (not one per metric: W-1 connections per
    # process each), and gloo whatever the main backend: NCCL must not be driven from the worker thread.
    for result in run_distributed(body_one_side_group_per_process_group, world_size, deadline=60, fresh=True):
        assert result == {"backends": ["gloo"], "side": "gloo", "shared": True}


def body_join_exchanges_take_sync_timeout(rank, world_size):
    import threading

    import torchmetrics_varlen._engine as engine

    original = engine.run
    seen = []

    def recording(entries, group, **kwargs):
        # The shadow runs in the Join worker thread; the terminate record comes from the main thread's post hook.
        if threading.current_thread() is not threading.main_thread() or kwargs["label"] == "Join.terminate":
            seen.append((kwargs["label"], kwargs.get("timeout")))
        return original(entries, group, **kwargs)

    engine.run = recording  # join.py looks it up at each call
    try:
        metric = BatchMSE(sync_timeout=17)
        with join(metric):
            for x, y in _batches(rank, STEPS[world_size][rank]):
                metric(x[:, 0].double(), y)
    finally:
        engine.run = original
    return seen


def test_shadow_and_terminate_exchanges_wait_at_most_sync_timeout():
    # Rank 0 (10 steps) joins last and sends the terminate record; ranks 1 and 2 shadow its remaining steps.
    seen = run_distributed(body_join_exchanges_take_sync_timeout, 3, deadline=60)
    assert {label for label, _ in seen[0]} == {"Join.terminate"}
    assert {label for label, _ in seen[2]} == {"BatchMSE.step"} and len(seen[2]) == 10 + 1  # + the terminate
    for per_rank in seen:
        assert per_rank and {timeout for _, timeout in per_rank} == {17.0}


def _failing_empty_states(metric):
    raise RuntimeError("injected shadow failure")


def body_shadow_failure(rank, world_size, failing_rank):
    shadow_module = sys.modules["torchmetrics_varlen._join_shadow"]
    if rank == failing_rank:
        shadow_module.cpu_defaults = _failing_empty_states  # this process only: a fresh pool, closed afterwards
    metric = BatchMSE(sync_timeout=30)
    try:
        with join(metric):
            for x, y in _batches(rank, STEPS[world_size][rank]):
                metric(x[:, 0].double(), y)
    except Exception as err:
        outcome = f"{type(err).__name__}: {err}"
        # What an uncaught error does to a real job's process: its connections close, so the peers blocked in
        # Join's own collectives get an error at once instead of waiting for the process group's timeout.
        dist.destroy_process_group()
        return outcome
    return "no error"


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_failing_shadow_makes_every_rank_fail_naming_it(world_size):
    # Rank 1 runs out of data after 7 steps and its worker fails. The running rank must raise at its next per-step
    # sync (not after `sync_timeout`: 30 s here, beyond the deadline with the other ranks' waits), the joined ranks
    # once that rank is gone; every message names rank 1.
    outcomes = run_distributed(body_shadow_failure, world_size, failing_rank=1, deadline=60, fresh=True)
    assert outcomes[0].startswith("SyncMismatchError") and "Join failed on rank 1" in outcomes[0]
    for outcome in outcomes[1:]:
        assert outcome.startswith("JoinShadowError") and "failed on rank 1" in outcome
    assert "injected shadow failure" in outcomes[1]


def _terminate_then_fail(*args):
    _REAL_TERMINATE(*args)
    raise RuntimeError("injected failure after the terminate record")


_REAL_TERMINATE = None


def body_failing_post_hook_keeps_ddp_final_sync(rank, world_size):
    global _REAL_TERMINATE
    join_module = sys.modules["torchmetrics_varlen._join_shadow"]
    _REAL_TERMINATE = join_module.exchange_terminate
    last_joiner = 0  # 10 steps, the most: it never shadows, it sends the terminate record
    join_module.exchange_terminate = _terminate_then_fail if rank == last_joiner else _REAL_TERMINATE
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).double())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        metric = BatchMSE()
        outcome = "no error"
        try:
            with join(model, metric):
                for x, y in _batches(rank, STEPS[world_size][rank]):
                    loss = metric(model(x.double()).squeeze(-1), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
        except RuntimeError as err:
            outcome = str(err)
    finally:
        join_module.exchange_terminate = _REAL_TERMINATE
    # DDP's final model broadcast ran on every rank: the parameters agree.
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"outcome": outcome, "weights": torch.cat(gather_all_tensors(weights)).view(world_size, -1)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_failing_metric_hook_does_not_skip_ddp_final_sync(world_size):
    results = run_distributed(body_failing_post_hook_keeps_ddp_final_sync, world_size, deadline=60)
    assert "injected failure after the terminate record" in results[0]["outcome"]
    assert all(result["outcome"] == "no error" for result in results[1:])
    for result in results:
        for row in result["weights"]:
            torch.testing.assert_close(row, results[0]["weights"][0])


def body_join_config_is_joinable(rank, world_size):
    metric = BatchMSE()
    return {
        "device": str(metric.join_device),
        "group_is_world": metric.join_process_group is dist.group.WORLD,
        "enabled": metric._join_config.enable,
    }


def test_metric_is_a_joinable_with_a_disabled_config_outside_join():
    for result in run_distributed(body_join_config_is_joinable, 2):
        assert result == {"device": "cpu", "group_is_world": True, "enabled": False}


def body_no_process_group_outlives_destroy(rank, world_size):
    import gc
    import weakref

    metric = BatchMSE(sync_timeout=30)  # a sync timeout: the timed metadata exchange numbers its syncs per group
    with join(metric):
        for x, y in _batches(rank, STEPS[world_size][rank]):
            metric(x[:, 0].double(), y)
    metric.compute()
    world, side = weakref.ref(dist.group.WORLD), weakref.ref(metric._join_group)
    dist.destroy_process_group()
    gc.collect()
    # The metric is still alive: it must not keep either group alive (a gloo group destroyed during interpreter
    # shutdown, when a metric in a reference cycle is finally collected, can abort the process).
    return {"world": world() is None, "side": side() is None, "metric_group": metric._join_group is None}


def test_no_process_group_outlives_destroy_process_group():
    for result in run_distributed(body_no_process_group_outlives_destroy, 2, deadline=60, fresh=True):
        assert result == {"world": True, "side": True, "metric_group": True}
