"""Join: ranks with fewer steps shadow the metric's per-step syncs; nothing hangs; values stay exact."""

import sys
import threading
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from _helpers import engine_runs
from conftest import run_distributed
from torch.distributed.algorithms.join import Join

from torchmetrics_varlen import Metric, gather_all_tensors, join
from torchmetrics_varlen._engine.group import REGISTRY


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


STEPS = {1: [6], 2: [10, 7], 3: [10, 7, 0]}  # a group of one: Join has nothing to shadow, and must not fail


def _batches(rank, steps, seed=0):
    gen = torch.Generator().manual_seed(100 + rank + seed)
    # Uneven batch sizes too: 3..5 samples.
    return [
        (torch.randn(3 + (s + rank) % 3, 4, generator=gen), torch.randn(3 + (s + rank) % 3, generator=gen))
        for s in range(steps)
    ]


def _single_process_mse(seen_preds, seen_target):
    """The reference: every sample any rank evaluated, gathered after the fact and scored by one process."""
    local_p = torch.cat(seen_preds) if seen_preds else torch.empty(0, dtype=torch.float64)
    local_t = torch.cat(seen_target) if seen_target else torch.empty(0, dtype=torch.float64)
    all_p, all_t = torch.cat(gather_all_tensors(local_p)), torch.cat(gather_all_tensors(local_t))
    return ((all_p - all_t) ** 2).mean()


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
    assert copied._tv_join is None and (world_size == 1 or REGISTRY.state(None).side is not None)
    torch.testing.assert_close(copied.compute(), epoch)
    return {"epoch": epoch, "expected": _single_process_mse(seen_preds, seen_target), "steps": len(step_values)}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_join_with_ddp_loss_does_not_hang_and_is_exact(world_size):
    # Shared pools: a passing Join leaves nothing pending (a hang hits the deadline, which closes the pool).
    results = run_distributed(body_join_ddp_loss, world_size, deadline=60)
    for rank, result in enumerate(results):
        assert result["steps"] == STEPS[world_size][rank]
        torch.testing.assert_close(result["epoch"], result["expected"])


def body_join_model_alone(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    with join(model):  # no metric: plain Join on the model (it used to fail with an IndexError)
        for x, y in _batches(rank, STEPS[world_size][rank]):
            optimizer.zero_grad()
            ((model(x.double()).squeeze(-1) - y.double()) ** 2).mean().backward()
            optimizer.step()
            steps += 1
    return steps, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_with_a_model_alone_is_plain_join(world_size):
    results = run_distributed(body_join_model_alone, world_size, deadline=60)
    for rank, (steps, weights) in enumerate(results):
        assert steps == STEPS[world_size][rank]
        for weight, first in zip(weights, results[0][1], strict=True):  # Join's DDP hook: one model on every rank
            torch.testing.assert_close(weight, first)


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
    expected = _single_process_mse(seen_preds, seen_target)
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
    # A metric is no joinable of its own: a plain Join of it is refused on every rank, before any collective.
    try:
        with Join([model, metric]):
            pass
    except TypeError as err:
        messages["plain"] = str(err)
    try:
        with join(metric, model):  # roles, not positions: a model after the metrics is not a metric
            pass
    except TypeError as err:
        messages["model_as_metric"] = str(err)
    # The refused joins left the metric as it was: per-step syncs on its own group, outside any Join.
    value = metric(torch.full((2,), float(rank)), torch.zeros(2))
    return {"messages": messages, "join_active": metric._tv_join is not None, "value": value.item()}


def test_join_refuses_what_it_cannot_shadow_on_every_rank():
    for result in run_distributed(body_join_refuses_what_it_cannot_shadow, 2, deadline=60):
        assert "sync_grads" in result["messages"]["sync_grads"]
        assert "torchmetrics_varlen.join(ddp_model, metric" in result["messages"]["plain"]
        assert "BatchMSE" in result["messages"]["plain"]
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
    return {"join_active": metric._tv_join is not None, "value": value.item()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_join_whose_body_raises_leaves_join_mode(world_size):
    expected = sum((r + 1) ** 2 for r in range(world_size)) / world_size  # every rank's batch holds rank + 1
    for result in run_distributed(body_join_body_raises, world_size, deadline=60):
        assert result == {"join_active": False, "value": expected}


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
    side = REGISTRY.state(None).side
    return {"backends": calls, "side": dist.get_backend(side), "shared": side is not None}


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_gloo_side_group_per_process_group_made_once(world_size):
    # One side group for every metric and every join on a process group (not one per metric: W-1 connections per
    # process each), and gloo whatever the main backend: NCCL must not be driven from the worker thread.
    for result in run_distributed(body_one_side_group_per_process_group, world_size, deadline=60, fresh=True):
        assert result == {"backends": ["gloo"], "side": "gloo", "shared": True}


def body_join_exchanges_and_their_timeouts(rank, world_size):
    seen = []

    def recording(request, link):
        # The shadow runs in the Join worker thread; the terminate record comes from the main thread's post hook.
        if threading.current_thread() is not threading.main_thread() or request.label == "Join.terminate":
            seen.append((request.label, link.timeout))
        elif request.label == "BatchMSE.step" and link.group is REGISTRY.state(None).side:
            seen.append(("running", link.timeout))

    with engine_runs(recording):
        metric = BatchMSE(sync_timeout=17)
        with join(metric):
            for x, y in _batches(rank, STEPS[world_size][rank]):
                metric(x[:, 0].double(), y)
    return seen


def test_shadow_and_terminate_wait_for_the_group_and_running_ranks_for_sync_timeout():
    # Rank 0 (10 steps) joins last and sends the terminate record; ranks 1 and 2 shadow its remaining steps. A
    # worker waits for the running ranks' next step up to the group's own timeout (None): between two steps a
    # running rank may be busy for long (a checkpoint). The running ranks' own step syncs wait `sync_timeout`.
    seen = run_distributed(body_join_exchanges_and_their_timeouts, 3, deadline=60)
    assert [label for label, _ in seen[0] if label != "running"] == ["Join.terminate"]
    assert {timeout for label, timeout in seen[0] if label == "running"} == {17.0}
    assert {label for label, _ in seen[2]} == {"BatchMSE.step"} and len(seen[2]) == 10 + 1  # + the terminate
    assert {timeout for _, timeout in seen[2]} == {None}
    assert {timeout for label, timeout in seen[0] if label == "Join.terminate"} == {None}


def _failing_empty_states(metric):
    raise RuntimeError("injected shadow failure")


def body_shadow_failure(rank, world_size, failing_rank):
    shadow_module = sys.modules["torchmetrics_varlen.join"]
    if rank == failing_rank:
        shadow_module._cpu_defaults = _failing_empty_states  # this process only: a fresh pool, closed afterwards
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
    join_module = sys.modules["torchmetrics_varlen.join"]
    _REAL_TERMINATE = join_module._terminate
    last_joiner = 0  # 10 steps, the most: it never shadows, it sends the terminate record
    join_module._terminate = _terminate_then_fail if rank == last_joiner else _REAL_TERMINATE
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
        join_module._terminate = _REAL_TERMINATE
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


def body_a_plain_join_of_a_metric(rank, world_size):
    try:
        with Join([BatchMSE()]):
            pass
    except TypeError as err:
        return str(err)
    return "no error"


def test_a_plain_join_of_a_metric_says_what_to_use():
    # The metric is no joinable of its own (`join` wraps the metrics): a plain Join raises at once, on every rank.
    for message in run_distributed(body_a_plain_join_of_a_metric, 2):
        assert "torchmetrics_varlen.join(ddp_model, metric)" in message, message


def body_no_process_group_outlives_destroy(rank, world_size):
    import gc
    import weakref

    metric = BatchMSE(sync_timeout=30)  # a sync timeout: the timed metadata exchange numbers its syncs per group
    with join(metric):
        for x, y in _batches(rank, STEPS[world_size][rank]):
            metric(x[:, 0].double(), y)
    metric.compute()
    world, side = weakref.ref(dist.group.WORLD), weakref.ref(REGISTRY.state(None).side)
    dist.destroy_process_group()
    gc.collect()
    # The metric is still alive: it must not keep either group alive (a gloo group destroyed during interpreter
    # shutdown, when a metric in a reference cycle is finally collected, can abort the process).
    return {"world": world() is None, "side": side() is None, "metric_group": metric._tv_join is None}


def test_no_process_group_outlives_destroy_process_group():
    for result in run_distributed(body_no_process_group_outlives_destroy, 2, deadline=60, fresh=True):
        assert result == {"world": True, "side": True, "metric_group": True}


# ------------------------------------------------------------------------------- the shadow never touches CUDA
class MainThreadOnly(torch.Tensor):
    """A tensor that records every torch operation run on it from a thread other than the test body's.

    Stands for a CUDA tensor, which a worker thread must never copy (see `_join_shadow`): on a machine without a GPU,
    this is how a test sees what the worker touches.
    """

    body_thread = None
    touched: ClassVar[list] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if threading.current_thread() is not cls.body_thread:
            cls.touched.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


class GuardedSum(Metric):
    """A per-step sum whose default (what a joined rank sends) may be touched from the body's thread only."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(dist_sync_on_step=True, **kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("seen", default=[], dist_reduce_fx="cat")
        self._defaults["total"] = self._defaults["total"].as_subclass(MainThreadOnly)  # what a joined rank sends

    def update(self, x):
        self.total = self.total + x.sum()
        self.seen.append(x)

    def compute(self):
        return self.total


def body_shadow_sees_only_cpu_tensors(rank, world_size):
    MainThreadOnly.body_thread = threading.current_thread()
    MainThreadOnly.touched = []
    handed = []

    def recording(request, link):
        if threading.current_thread() is not MainThreadOnly.body_thread:  # the shadow
            for entry in request.entries:
                for tensor in entry if isinstance(entry, list) else [entry]:
                    handed.append((type(tensor).__name__, str(tensor.device)))

    with engine_runs(recording):
        metric = GuardedSum()
        steps = STEPS[world_size][rank]
        values = []
        with join(metric):
            for step in range(steps):
                values.append(float(metric(torch.full((2,), float(rank + step), dtype=torch.float64))))
        epoch = float(metric.compute())
    # Truth: at step s, every rank that still has a step s adds 2 * (rank + s).
    expected = [sum(2.0 * (r + s) for r in range(world_size) if s < STEPS[world_size][r]) for s in range(steps)]
    total = sum(2.0 * (r + s) for r in range(world_size) for s in range(STEPS[world_size][r]))
    return {"touched": MainThreadOnly.touched, "handed": handed, "values": values, "expected": expected,
            "epoch": epoch, "total": total}  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_shadow_thread_sends_plain_cpu_copies_made_on_the_main_thread(world_size):
    # The worker of a joined rank must never touch a CUDA state (a copy on the stream it shares with the main thread
    # deadlocks against NCCL work). It gets CPU copies of the defaults, made on the main thread before it starts.
    results = run_distributed(body_shadow_sees_only_cpu_tensors, world_size, deadline=60)
    shadowing = [rank for rank in range(world_size) if STEPS[world_size][rank] < max(STEPS[world_size])]
    for rank, result in enumerate(results):
        assert result["touched"] == []
        assert set(result["handed"]) == ({("Tensor", "cpu")} if rank in shadowing else set())
        assert result["values"] == result["expected"]
        assert result["epoch"] == result["total"]


# ----------------------------------------------------------- which group carries the per-step syncs, and when
UNEVEN = {2: [6, 4], 3: [6, 4, 5]}


def body_step_syncs_switch_groups_together(rank, world_size, with_model):
    groups = []

    def recording(request, link):
        if threading.current_thread() is threading.main_thread() and request.label == "BatchMSE.step":
            groups.append(link.group)

    with engine_runs(recording):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).double()) if with_model else None
        metric = BatchMSE()
        values, seen_preds, seen_target = [], [], []
        with join(model, metric):
            for x, y in _batches(rank, UNEVEN[world_size][rank], seed=3):
                preds = model(x.double()).squeeze(-1) if with_model else x[:, 0].double()
                loss = metric(preds, y.double())
                if with_model:
                    loss.backward()  # DDP's backward all-reduces, shadowed by DDP's join hook
                    model.zero_grad()
                values.append(loss.detach())
                seen_preds.append(preds.detach())
                seen_target.append(y.double())
        epoch = metric.compute()
    side = REGISTRY.state(None).side
    where = ["side" if group is side else "own" if group is dist.group.WORLD else "other" for group in groups]
    return {"where": where, "values": values, "epoch": epoch, "expected": _single_process_mse(seen_preds, seen_target)}


@pytest.mark.parametrize("with_model", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_step_syncs_use_the_metric_group_until_a_rank_joins(world_size, with_model):
    # Step s travels on the metric's own group while every rank still runs; from the first step at which some rank
    # has joined, on the side group, on every running rank alike (they all read Join's count of running ranks).
    steps = UNEVEN[world_size]
    results = run_distributed(body_step_syncs_switch_groups_together, world_size, with_model=with_model, deadline=60)
    for rank, result in enumerate(results):
        assert result["where"] == ["own" if step < min(steps) else "side" for step in range(steps[rank])]
        torch.testing.assert_close(result["epoch"], result["expected"])
    if not with_model:  # the global batch of each step, as one process computes it
        everything = [_batches(r, steps[r], seed=3) for r in range(world_size)]
        for result in results:
            for step, got in enumerate(result["values"]):
                xs = torch.cat([b[step][0][:, 0] for b in everything if step < len(b)]).double()
                ys = torch.cat([b[step][1] for b in everything if step < len(b)]).double()
                torch.testing.assert_close(got, ((xs - ys) ** 2).mean())


class Histogram(Metric):
    """Per-bin sums: two instances of one class with different defaults (a worker must not mix them up)."""

    full_state_update = False

    def __init__(self, bins, **kwargs):
        super().__init__(dist_sync_on_step=True, **kwargs)
        self.add_state("counts", default=torch.zeros(bins, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values):
        self.counts = self.counts + torch.bincount(values, minlength=len(self.counts)).double()

    def compute(self):
        return self.counts


def _histogram_steps(rank, steps):
    gen = torch.Generator().manual_seed(7 + rank)
    return [torch.randint(0, 3, (4,), generator=gen) for _ in range(steps)]


def body_metrics_in_changing_order(rank, world_size):
    small, large = Histogram(3), Histogram(5)
    got = []
    with join(small, large):
        for step, values in enumerate(_histogram_steps(rank, UNEVEN[world_size][rank])):
            # Every iteration its own order and number of syncs: the workers guess, and the ranks retry on a miss.
            order = [small, large] if step % 2 == 0 else [large, small, large]
            got.append([metric(values).clone() for metric in order])
    return {"got": got, "small": small.compute(), "large": large.compute()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_metrics_synced_in_a_changing_order_stay_exact(world_size):
    steps = UNEVEN[world_size]
    data = [_histogram_steps(r, steps[r]) for r in range(world_size)]
    results = run_distributed(body_metrics_in_changing_order, world_size, deadline=60)
    for result in results:
        for step, values in enumerate(result["got"]):
            batch = torch.cat([d[step] for d in data if step < len(d)])
            bins = [3, 5] if step % 2 == 0 else [5, 3, 5]
            for value, width in zip(values, bins):
                torch.testing.assert_close(value, torch.bincount(batch, minlength=width).double())
        everything = torch.cat([v for d in data for v in d])
        # Each update counts once per call: `large` sees odd steps twice.
        large_calls = torch.cat([v for d in data for s, v in enumerate(d) for _ in range(1 if s % 2 == 0 else 2)])
        torch.testing.assert_close(result["small"], torch.bincount(everything, minlength=3).double())
        torch.testing.assert_close(result["large"], torch.bincount(large_calls, minlength=5).double())


# ------------------------------------------------------------------------- the GPU check's Join scenarios, on gloo
def body_gpu_join_scenarios(rank, world_size):
    from benchmarks._gpu_common import Ctx
    from benchmarks._gpu_join_scenarios import SCENARIOS

    control = dist.new_group(backend="gloo")  # the check's verdict group: the package never touches it
    ctx = Ctx("cpu", rank, world_size, torch.device("cpu"), control, None)
    return [(scenario.name, scenario.run(ctx)) for scenario in SCENARIOS]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gpu_check_join_scenarios_pass_on_cpu(world_size):
    # `nox -s gpu` runs them with CUDA states and NCCL; here their code runs with CPU states on gloo.
    for result in run_distributed(body_gpu_join_scenarios, world_size, deadline=90):
        names = [name for name, _ in result]
        assert names == ["join-device-states", "join-plain-metrics-first", "join-metrics-alone"]
        assert all("CPU tensors only" in line for _, line in result[:2])


# ------------------------------------------------------------------------- join on subgroups (a DeviceMesh's "dp")
MESH_STEPS = [[5, 2, 0, 4], [1, 6, 3, 3], [4, 0, 2, 5]]  # per round, per rank; "dp" slices are ranks {0, 2}, {1, 3}


def body_join_on_mesh_subgroups(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    import torchmetrics_varlen as tv

    rounds = []
    for round_index, steps in enumerate(MESH_STEPS):
        # A fresh mesh each round: its "dp" groups are new, so each round makes side groups for two disjoint
        # subgroups at once (the ranks of {0, 2} and of {1, 3} enter the side group's creation together).
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        group = tv.mesh_group(mesh, "dp")
        metric = BatchMSE(process_group=group)
        values = []
        with tv.join(metric):
            for x, y in _batches(rank, steps[rank], seed=20 + round_index):
                values.append(metric(x[:, 0].double(), y))
        rounds.append({"ranks": dist.get_process_group_ranks(group), "values": values, "epoch": metric.compute()})
    # And as the loss of a model replicated over "dp" (DDP on the slice's group), on the last mesh's slices.
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).double(), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = BatchMSE(process_group=group)
    seen_preds, seen_target = [], []
    with tv.join(model, loss_fn):
        for x, y in _batches(rank, MESH_STEPS[0][rank], seed=30):
            preds = model(x.double()).squeeze(-1)
            loss = loss_fn(preds, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen_preds.append(preds.detach())
            seen_target.append(y.double())
    preds = torch.cat(seen_preds) if seen_preds else torch.empty(0, dtype=torch.float64)
    target = torch.cat(seen_target) if seen_target else torch.empty(0, dtype=torch.float64)
    all_p, all_t = torch.cat(gather_all_tensors(preds, group)), torch.cat(gather_all_tensors(target, group))
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    rounds.append({"epoch": loss_fn.compute(), "expected": ((all_p - all_t) ** 2).mean(), "weights": weights})
    return rounds


def test_join_on_two_mesh_subgroups_at_once_is_exact():
    # Both "dp" slices run their own join at the same time, with uneven steps inside each slice (one rank none).
    results = run_distributed(body_join_on_mesh_subgroups, 4, deadline=150)
    for round_index, steps in enumerate(MESH_STEPS):
        data = {r: _batches(r, steps[r], seed=20 + round_index) for r in range(4)}
        for rank, result in enumerate(results):
            got = result[round_index]
            assert got["ranks"] == [rank % 2, rank % 2 + 2]
            members = [data[r] for r in got["ranks"]]
            assert len(got["values"]) == steps[rank]
            for step, value in enumerate(got["values"]):  # the global batch of the slice's ranks still running
                xs = torch.cat([b[step][0][:, 0] for b in members if step < len(b)]).double()
                ys = torch.cat([b[step][1] for b in members if step < len(b)]).double()
                torch.testing.assert_close(value, ((xs - ys) ** 2).mean())
            xs = torch.cat([x[:, 0] for b in members for x, _ in b]).double()
            ys = torch.cat([y for b in members for _, y in b]).double()
            torch.testing.assert_close(got["epoch"], ((xs - ys) ** 2).mean())
    for rank, result in enumerate(results):  # the DDP loss: exact over the slice, one model per slice after the join
        torch.testing.assert_close(result[-1]["epoch"], result[-1]["expected"])
        torch.testing.assert_close(result[-1]["weights"], results[rank % 2][-1]["weights"])


def body_side_groups_of_disjoint_subgroups(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    import torchmetrics_varlen as tv
    from torchmetrics_varlen import _engine
    from torchmetrics_varlen._engine.group import group_timeout, link

    # A group of rank 0 alone, which every rank enters (torch 2.15 requires that: it salts every later group's name
    # with a count of the groups each rank entered): rank 0 now knows one group more than rank 2, its peer in "dp"
    # below (torch 2.13 salts a locally synchronised group's name with the number of groups the process knows).
    dist.new_group([0], backend="gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for dim in ("dp", "tp"):  # "dp": {0, 2} and {1, 3}; then "tp": {0, 1} and {2, 3}, each pair at once
        group = tv.mesh_group(mesh, dim)
        side = _engine.side_link(link(group, torch.device("cpu"), None, "test"), None).group
        total = torch.tensor([rank + 1])
        dist.all_reduce(total, group=side)
        out[dim] = {
            "ranks": dist.get_process_group_ranks(side),
            "sum": total.item(),
            "backend": dist.get_backend(side),
            "timeout": group_timeout(side, "cpu") == group_timeout(group, "cpu"),
            "name": side.group_name,
            "cached": _engine.side_link(link(group, torch.device("cpu"), None, "test"), None).group is side,
        }
    return out


def test_side_groups_of_disjoint_subgroups_made_at_once():
    results = run_distributed(body_side_groups_of_disjoint_subgroups, 4, deadline=60, fresh=True)
    for rank, result in enumerate(results):
        for dim, members in (("dp", [rank % 2, rank % 2 + 2]), ("tp", [rank // 2 * 2, rank // 2 * 2 + 1])):
            got = result[dim]
            assert got["ranks"] == members and got["sum"] == sum(r + 1 for r in members), (rank, dim)
            assert got["backend"] == "gloo" and got["timeout"] and got["cached"], (rank, dim)
            peer = results[members[0] if members[0] != rank else members[1]][dim]
            assert got["name"] == peer["name"], (rank, dim)  # the peers made one group
    assert results[0]["dp"]["name"] != results[1]["dp"]["name"]


def body_join_after_a_group_of_some_ranks(rank, world_size):
    # Issue 43 item 7: every rank enters a plain `new_group([0, 1])` (torch 2.15 then counts one more group on every
    # rank, members or not), then the dp groups [0, 2] and [1, 3]; a per-step metric on the dp group inside `join`.
    import torchmetrics_varlen as tv

    dist.new_group([0, 1], backend="gloo")
    dp = [dist.new_group(ranks, backend="gloo") for ranks in ([0, 2], [1, 3])][rank % 2]
    metric = BatchMSE(process_group=dp)
    steps = [5, 3, 2, 6][rank]
    values = []
    with tv.join(metric):
        for x, y in _batches(rank, steps, seed=40):
            values.append(metric(x[:, 0].double(), y))
    return {"ranks": dist.get_process_group_ranks(dp), "values": values, "epoch": metric.compute()}


def test_join_on_subgroups_after_a_group_of_some_ranks():
    # Hung on torch 2.15, whose group names count every plain `new_group` a rank entered: the side groups are made
    # by documented calls that every rank enters, whatever torch's naming.
    results = run_distributed(body_join_after_a_group_of_some_ranks, 4, deadline=90, fresh=True)
    steps = [5, 3, 2, 6]
    for rank, result in enumerate(results):
        members = [_batches(r, steps[r], seed=40) for r in result["ranks"]]
        assert len(result["values"]) == steps[rank]
        for step, value in enumerate(result["values"]):
            xs = torch.cat([b[step][0][:, 0] for b in members if step < len(b)]).double()
            ys = torch.cat([b[step][1] for b in members if step < len(b)]).double()
            torch.testing.assert_close(value, ((xs - ys) ** 2).mean())
        xs = torch.cat([x[:, 0] for b in members for x, _ in b]).double()
        ys = torch.cat([y for b in members for _, y in b]).double()
        torch.testing.assert_close(result["epoch"], ((xs - ys) ** 2).mean())
