"""Join: ranks with fewer steps shadow the metric's per-step syncs; nothing hangs; values stay exact."""

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torch.distributed.algorithms.join import Join

from torchmetrics_varlen import Metric, gather_all_tensors


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
    with Join([model, metric]):
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
    copied = metric.clone()  # a process group and a thread cannot be copied: the copy starts outside Join
    assert copied._join_group is None and metric._join_group is not None
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
    with Join([model, first, second]):
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
    with Join([metric]):
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
        with Join([BatchMSE(sync_grads=True)]):
            pass
    except RuntimeError as err:
        messages["sync_grads"] = str(err)
    # The metric before the DDP model: DDP's forward collectives would come before the count of running ranks.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    metric = BatchMSE()
    try:
        with Join([metric, model]):
            pass
    except ValueError as err:
        messages["order"] = str(err)
    # The refused Join left the metric as it was: per-step syncs on its own group, outside any Join.
    value = metric(torch.full((2,), float(rank)), torch.zeros(2))
    return {"messages": messages, "join_active": metric._join_active, "value": value.item()}


def test_join_refuses_what_it_cannot_shadow_on_every_rank():
    for result in run_distributed(body_join_refuses_what_it_cannot_shadow, 2, deadline=60):
        assert "sync_grads" in result["messages"]["sync_grads"]
        assert "Join([ddp_model, metric])" in result["messages"]["order"]
        assert result["join_active"] is False
        assert result["value"] == 0.5  # (0 + 0 + 1 + 1) / 4: the global batch


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
    with Join([metric]):
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
