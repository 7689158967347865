"""The data routes under skew and memory caps: per-rank broadcasts into the result, chunks, allocation failures.

Every value is compared with stock torchmetrics run in one process on the concatenated data; the bytes each rank
receives are compared with the true sizes computed here from the known per-rank sizes.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torchmetrics
from _helpers import assert_same, describe, forced_policy, split
from conftest import run_distributed
from torchmetrics.aggregation import CatMetric, MaxMetric
from torchmetrics.classification import BinaryAUROC
from torchmetrics.retrieval import RetrievalMAP

import torchmetrics_varlen as tv
from torchmetrics_varlen._engine import group as _cap
from torchmetrics_varlen._engine import move as _broadcast
from torchmetrics_varlen._engine import pack
from torchmetrics_varlen._engine import plan as _plan
from torchmetrics_varlen.onerank import compute_on_rank

SKEWED = 8  # the big rank holds this many times the others' samples


def _sizes(world_size, small, empty=None):
    """Rank 0 holds SKEWED x ``small`` samples, the others ``small``; rank ``empty`` holds none."""
    return [0 if rank == empty else small * (SKEWED if rank == 0 else 1) for rank in range(world_size)]


@contextlib.contextmanager
def _traffic():
    """Per collective name: (calls, bytes this rank receives into), while the block runs."""
    seen = {}
    names = ("all_gather_into_tensor", "all_gather_single", "broadcast", "all_reduce", "gather", "all_to_all_single")
    names += ("all_gather",)
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            out = args[0]
            calls, nbytes = seen.get(name, (0, 0))
            src = kwargs.get("src")
            own = name == "broadcast" and src == dist.get_rank()  # a broadcast's source receives nothing
            size = (
                sum(t.numel() * t.element_size() for t in out)
                if isinstance(out, list)
                else out.numel() * out.element_size()
            )
            seen[name] = (calls + 1, nbytes + (0 if own else size))
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _data(total, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(total, generator=gen), torch.randint(0, 2, (total,), generator=gen)


# ------------------------------------------------------------------------------------------------- skewed cat states
def body_skewed(rank, world_size, sizes, cap=None):
    preds, target = _data(sum(sizes))
    part = split(sizes, rank)
    auroc = tv.rebase(BinaryAUROC)(thresholds=None, sync_cap=cap)
    values = tv.rebase(CatMetric)(sync_cap=cap)
    if sizes[rank]:
        auroc.update(preds[part], target[part])
        values.update(preds[part])
    with _traffic() as seen:
        got = {"auroc": auroc.compute(), "values": values.compute()}
    return {"got": got, "seen": seen}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("empty", [None, 1], ids=["all-hold", "rank1-empty"])
def test_skewed_cat_states_are_exact_and_each_rank_receives_the_true_sizes(world_size, empty):
    sizes = _sizes(world_size, 20_000, empty)  # rank 0: 640 KiB of float32 per state, past the broadcast threshold
    results = run_distributed(body_skewed, world_size, sizes)
    preds, target = _data(sum(sizes))
    reference = BinaryAUROC(thresholds=None)
    reference.update(preds, target)
    for rank, result in enumerate(results):
        assert_same(result["got"]["auroc"], reference.compute())
        assert torch.equal(result["got"]["values"], preds)  # rank order, exactly
        calls, received = result["seen"]["broadcast"]
        holders = sum(1 for size in sizes if size)
        assert calls == 3 * holders  # preds, target (AUROC) and values: one broadcast per rank holding data
        # float32 preds and values, int64 target: each rank receives the others' bytes, no padding
        others = sum(sizes) - sizes[rank]
        assert received == others * (4 + 8 + 4)
        padded = world_size * max(sizes) * (4 + 8 + 4)
        gathered = (
            result["seen"].get("all_gather_into_tensor", (0, 0))[1] + result["seen"].get("all_gather_single", (0, 0))[1]
        )
        assert gathered < padded / 20  # only the metadata records are gathered


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_small_cap_chunks_the_broadcasts_and_stays_exact(world_size):
    sizes = _sizes(world_size, 3_000)
    cap = 4096
    results = run_distributed(body_skewed, world_size, sizes, cap)
    preds, target = _data(sum(sizes))
    reference = BinaryAUROC(thresholds=None)
    reference.update(preds, target)
    for result in results:
        assert_same(result["got"]["auroc"], reference.compute())
        assert torch.equal(result["got"]["values"], preds)
        calls, _ = result["seen"]["broadcast"]
        chunks = sum(-(-size * itemsize // cap) for size in sizes for itemsize in (4, 8, 4))
        assert calls == chunks


def body_caps_differ(rank, world_size, sizes):
    preds, _ = _data(sum(sizes))
    metric = tv.rebase(CatMetric)(sync_cap=4096 if rank == world_size - 1 else None)  # one rank only
    metric.update(preds[split(sizes, rank)])
    with _traffic() as seen:
        value = metric.compute()
    return {"value": value, "calls": seen["broadcast"][0]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_caps_all_use_the_smallest(world_size):
    sizes = _sizes(world_size, 3_000)
    results = run_distributed(body_caps_differ, world_size, sizes)
    preds, _ = _data(sum(sizes))
    for result in results:
        assert torch.equal(result["value"], preds)
        assert result["calls"] == sum(-(-size * 4 // 4096) for size in sizes)


# ------------------------------------------------------------------------------------------- every kind of entry
class Shapes(tv.Metric):
    """A stacked float max (dense) and a list without reduction whose items differ in ndim (per-rank pieces)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("peak", default=torch.zeros(64, 64), dist_reduce_fx="max")
        self.add_state("items", default=[], dist_reduce_fx=None)

    def update(self, x):
        self.peak = torch.maximum(self.peak, x[: 64 * 64].reshape(64, 64))
        self.items.extend([x[:500], x[500:].reshape(-1, 1)])

    def compute(self):
        return self.peak, self.items


class StockShapes(torchmetrics.Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("peak", default=torch.zeros(64, 64), dist_reduce_fx="max")

    def update(self, x):
        self.peak = torch.maximum(self.peak, x[: 64 * 64].reshape(64, 64))

    def compute(self):
        return self.peak


def _shapes_input(rank):
    return torch.randn(4096 + 300 * (rank + 1), generator=torch.Generator().manual_seed(rank))


def body_shapes(rank, world_size, cap):
    metric = Shapes(sync_cap=cap)
    metric.update(_shapes_input(rank))
    with _traffic() as seen:
        metric.sync()
    synced = {"peak": metric.peak, "items": metric.items}
    metric.unsync()
    return {"synced": synced, "broadcasts": seen.get("broadcast", (0, 0))[0]}


def body_shapes_to_one_rank(rank, world_size, cap, dst):
    metric = Shapes(sync_cap=cap)
    metric.update(_shapes_input(rank))
    with _traffic() as seen:
        peak, items = compute_on_rank(metric, dst=dst)
    return {"synced": {"peak": peak, "items": items}, "sends": seen.get("all_to_all_single", (0, 0))[0]}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("cap", [None, 2048], ids=["default", "cap-2KiB"])
@pytest.mark.parametrize("dst", [None, 0, 1], ids=["every-rank", "to-rank-0", "to-rank-1"])
def test_dense_pieces_and_lists_move_exactly_whatever_the_cap(world_size, cap, dst):
    if dst is not None:
        results = run_distributed(body_shapes_to_one_rank, world_size, cap, dst)
        moved = [result["sends"] for result in results]
    else:
        results = run_distributed(body_shapes, world_size, cap)
        moved = [result["broadcasts"] for result in results]
    inputs = [_shapes_input(rank) for rank in range(world_size)]
    peak = StockShapes()
    for x in inputs:
        peak.update(x)
    items = [item for x in inputs for item in (x[:500], x[500:].reshape(-1, 1))]
    for result, calls in zip(results, moved):
        synced = result["synced"]
        assert torch.equal(synced["peak"], peak.compute())
        assert len(synced["items"]) == len(items)
        for got, expected in zip(synced["items"], items):
            assert torch.equal(got, expected)
        # Default cap: everything is small, one gather. A 2 KiB cap: the 16 KiB dense state and the items no longer
        # fit a padded gather of W x 2 KiB, so they move by chunked broadcasts, or to one rank by all-to-alls (the
        # items' shape tables stay in the gather).
        assert (calls > 0) == (cap is not None)


def body_retrieval(rank, world_size, sizes, cap):
    gen = torch.Generator().manual_seed(5)
    total = sum(sizes)
    indexes, preds, target = torch.randint(0, 40, (total,), generator=gen), torch.rand(total, generator=gen), None
    target = torch.randint(0, 2, (total,), generator=gen)
    metric = tv.rebase(RetrievalMAP)(sync_cap=cap)
    part = split(sizes, rank)
    for chunk in torch.arange(total)[part].split(1000) if sizes[rank] else []:
        metric.update(preds[chunk], target[chunk], indexes=indexes[chunk])
    return metric.compute()


@pytest.mark.parametrize("world_size", [2, 3])
def test_retrieval_lists_on_the_broadcast_route(world_size):
    sizes = _sizes(world_size, 5_000, empty=world_size - 1 if world_size == 3 else None)
    results = run_distributed(body_retrieval, world_size, sizes, 8192)
    gen = torch.Generator().manual_seed(5)
    total = sum(sizes)
    indexes, preds = torch.randint(0, 40, (total,), generator=gen), torch.rand(total, generator=gen)
    target = torch.randint(0, 2, (total,), generator=gen)
    reference = RetrievalMAP()
    reference.update(preds, target, indexes=indexes)
    for value in results:
        assert_same(value, reference.compute())


# ---------------------------------------------------------------------------------------------- hook and gradients
def body_hook(rank, world_size, sizes):
    preds, target = _data(sum(sizes), seed=3)
    metric = BinaryAUROC(thresholds=None, dist_sync_fn=tv.gather_all_tensors)
    metric.update(preds[split(sizes, rank)], target[split(sizes, rank)])
    with _traffic() as seen:
        value = metric.compute()
    return {"value": value, "broadcasts": seen.get("broadcast", (0, 0))[0]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_hook_takes_the_broadcast_route_on_stock_metrics(world_size):
    sizes = _sizes(world_size, 20_000)
    results = run_distributed(body_hook, world_size, sizes)
    preds, target = _data(sum(sizes), seed=3)
    reference = BinaryAUROC(thresholds=None)
    reference.update(preds, target)
    for result in results:
        assert_same(result["value"], reference.compute())
        assert result["broadcasts"] >= world_size  # stock calls the hook per state: one broadcast per rank each


# ------------------------------------------------------------------------------------------------ to one rank only
def body_one_rank_skewed(rank, world_size, sizes, dst, cap):
    preds, target = _data(sum(sizes), seed=7)
    part = split(sizes, rank)
    auroc = BinaryAUROC(thresholds=None)  # stock classes: compute_on_rank takes any torchmetrics metric
    values = CatMetric()
    for metric in (auroc, values):
        metric.sync_cap = cap  # what `Metric(sync_cap=...)` sets; a stock metric has none
    if sizes[rank]:
        for chunk in torch.arange(sizes[rank]).split(7_000):  # several batches: list states
            auroc.update(preds[part][chunk], target[part][chunk])
        values.update(preds[part])
    allocated = []
    original = _broadcast.allocate

    def record(numel, dtype, device):
        allocated.append(numel * dtype.itemsize)
        return original(numel, dtype, device)

    _broadcast.allocate = record
    try:
        with _traffic() as seen:
            got = {"auroc": compute_on_rank(auroc, dst=dst), "values": compute_on_rank(values, dst=dst)}
    finally:
        _broadcast.allocate = original
    return {"got": got, "seen": seen, "allocated": allocated}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("dst", "empty", "cap"),
    [(0, None, None), (1, None, None), (0, 1, None), (1, 1, None), (1, None, 65_536)],
    ids=["dst-big", "dst-small", "sender-empty", "dst-empty", "cap-64KiB"],
)
def test_one_rank_compute_receives_the_true_sizes_on_its_destination_only(world_size, dst, empty, cap):
    sizes = _sizes(world_size, 20_000)
    if empty is not None:
        sizes[empty] = 0
    results = run_distributed(body_one_rank_skewed, world_size, sizes, dst, cap)
    preds, target = _data(sum(sizes), seed=7)
    reference = BinaryAUROC(thresholds=None)
    reference.update(preds, target)
    state_bytes = [size * (4 + 8 + 4) for size in sizes]  # float32 preds and values, int64 target
    for rank, result in enumerate(results):
        assert_same(result["got"]["auroc"], reference.compute())
        assert torch.equal(result["got"]["values"], preds)  # rank order, exactly
        calls, received = result["seen"].get("all_to_all_single", (0, 0))
        # One all_to_all_single per piece: each state's result, less the destination's own section, in contiguous
        # spans (before and after that section) cut at the cap, whatever the number of ranks in a span.
        chunk = cap or _cap.DEFAULT_CAP
        spans = [sum(sizes[:dst]), sum(sizes[dst + 1 :])]
        assert calls == sum(-(-span * itemsize // chunk) for span in spans for itemsize in (4, 8, 4))
        gathered = result["seen"].get("gather", (0, 0))[1]
        if rank == dst:  # every other rank's bytes once, no padding; the gather holds only item shape tables
            assert received == sum(state_bytes) - state_bytes[rank]
            assert gathered < sum(state_bytes) / 20
            # What it allocates: the results, and the gather's small buffer
            assert sum(result["allocated"]) < sum(state_bytes) * 1.05
        else:  # nothing comes back but the result; at most a copy of its own list state's batches
            assert received == 0 and gathered == 0
            assert sum(result["allocated"]) <= state_bytes[rank]


class Scores(tv.Metric):
    def __init__(self, **kwargs):
        super().__init__(sync_grads=True, **kwargs)
        self.add_state("scores", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.scores.append(x)

    def compute(self):
        return torch.cat(self.scores) if isinstance(self.scores, list) else self.scores


def body_gradients(rank, world_size, sizes):
    weights = torch.arange(sum(sizes), dtype=torch.float32)
    x = torch.linspace(0, 1, sizes[rank]).requires_grad_()
    metric = Scores()
    metric.update(x * 2)
    with _traffic() as seen:
        synced = metric.compute()
    (synced * weights).sum().backward()
    return {"grad": x.grad, "value": synced.detach(), "broadcasts": seen.get("broadcast", (0, 0))[0]}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("small", [40, 40_000], ids=["gathered", "broadcast"])
def test_gradients_are_exact_on_both_routes(world_size, small):
    sizes = _sizes(world_size, small)
    results = run_distributed(body_gradients, world_size, sizes)
    expected = torch.cat([torch.linspace(0, 1, size) * 2 for size in sizes])
    weights = torch.arange(sum(sizes), dtype=torch.float32)
    for rank, result in enumerate(results):
        assert torch.equal(result["value"], expected)
        assert (result["broadcasts"] == world_size) == (small > 1000)
        # Every rank's loss sum(w * cat(2 x_0, 2 x_1, ...)) depends on x_r: d/dx_r of their sum is W * 2 w there.
        torch.testing.assert_close(result["grad"], world_size * 2 * weights[split(sizes, rank)])


# ---------------------------------------------------------------------------------------------- allocation failure
def body_allocation_fails(rank, world_size, sizes, failing, dst=None):
    preds, _ = _data(sum(sizes))
    metric = tv.rebase(CatMetric)()
    for half in preds[split(sizes, rank)].chunk(2):  # two batches: a rank copies its own data (it cannot send a list)
        metric.update(half)
    compute = metric.compute if dst is None else lambda: compute_on_rank(metric, dst=dst)
    original = _broadcast.allocate

    def refuse(numel, dtype, device):
        raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {numel} elements")

    if rank == failing:
        _broadcast.allocate = refuse
    try:
        compute()
        first = None
    except tv.SyncMemoryError as err:
        first = str(err)
    finally:
        _broadcast.allocate = original
    metric._computed = None
    local = metric.value  # the local state is untouched: the next sync is whole and exact
    return {"error": first, "after": compute(), "local": [t.clone() for t in local]}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dst", [None, -1, 0], ids=["every-rank", "to-the-failing-rank", "to-rank-0"])
def test_a_rank_that_cannot_allocate_makes_every_rank_raise(world_size, dst):
    per_rank = _broadcast.AGREE_MIN_BYTES // 4 // world_size + 1000  # float32: together past the agreement threshold
    sizes = [per_rank] * world_size
    failing = world_size - 1  # to rank 0: a sender, failing to allocate the copy of its own two batches
    results = run_distributed(body_allocation_fails, world_size, sizes, failing, failing if dst == -1 else dst)
    preds, _ = _data(sum(sizes))
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not raise"
        assert f"ranks [{failing}] could not allocate" in result["error"]
        assert ("This rank" in result["error"]) == (rank == failing)
        assert torch.equal(result["after"], preds)
        assert torch.equal(torch.cat(result["local"]), preds[split(sizes, rank)])


# --------------------------------------------------------------------------------------------------- the cap itself
def test_cap_values_parse_and_bad_ones_name_the_expectation(monkeypatch):
    assert _cap.parse_cap("64MiB", "x") == 64 * 2**20
    assert _cap.parse_cap("1.5 KiB", "x") == 1536
    assert _cap.parse_cap(2048, "x") == 2048
    for bad in ("lots", 10, "-5MiB", True, 3.5):
        with pytest.raises(ValueError, match="Expected `sync_cap` to be a number of bytes of at least 1024"):
            tv.rebase(CatMetric)(sync_cap=bad)
    monkeypatch.setenv(_cap.SYNC_CAP_ENV, "1GiB")
    assert _cap.sent_cap(None) == 2**30
    assert _cap.sent_cap(4096) == 4096  # a metric's own cap wins over the environment's
    monkeypatch.setenv(_cap.SYNC_CAP_ENV, "nonsense")
    assert _cap.sent_cap(None) == _cap.INVALID_CAP
    monkeypatch.delenv(_cap.SYNC_CAP_ENV)
    assert _cap.sent_cap(None) == _cap.DEFAULT_CAP


def body_bad_env(rank, world_size):
    import os

    if rank == 1:
        os.environ[_cap.SYNC_CAP_ENV] = "plenty"
    metric = tv.rebase(MaxMetric)()
    metric.update(torch.tensor(float(rank)))
    try:
        metric.compute()
        return None
    except tv.SyncMismatchError as err:
        return str(err)
    finally:
        os.environ.pop(_cap.SYNC_CAP_ENV, None)


def test_a_bad_cap_in_one_ranks_environment_raises_on_every_rank():
    results = run_distributed(body_bad_env, 2)
    for message in results:
        assert message is not None and "ranks [1]" in message and "TORCHMETRICS_VARLEN_SYNC_CAP" in message


# ------------------------------------------------------------------------------------------- the plan's decisions
def _table(entries_per_rank, cap=_cap.DEFAULT_CAP, cat=None):
    records = [describe(entries, 7, "routes", cap=cap) for entries in entries_per_rank]
    width = max(map(len, records))
    return torch.tensor([record + [0] * (width - len(record)) for record in records])


def test_the_plan_routes_by_the_largest_rank_and_the_cap():
    big, small = torch.zeros(SKEWED * 5_000), torch.zeros(5_000)  # 160 KiB on the big rank
    dense = torch.zeros(100)
    table = _table([[big, dense], [small, dense], [small[:10], dense]])
    plan = _plan.make_plan(table, "test", cat=[True, False], broadcast_min=128 * 2**10)
    assert plan.broadcast == [0]
    assert plan.entries[0].route == _plan.ROUTE_BCAST
    assert plan.max_bytes == 400 + 0  # only the dense entry is gathered, 16-byte aligned
    assert plan.alloc_bytes == 3 * 400 + (SKEWED * 5_000 + 5_010) * 4
    # One rank to gather to (broadcast_min None): everything stays in the gather.
    to_one = _plan.make_plan(table, "test", cat=[True, False], broadcast_min=None)
    assert to_one.broadcast == [] and to_one.max_bytes >= SKEWED * 5_000 * 4
    # Under the threshold the padded gather keeps the entry, unless the cap is smaller than the gather.
    mild = _table([[small, dense], [small[:4000], dense]])
    assert _plan.make_plan(mild, "test", cat=[True, False], broadcast_min=128 * 2**10).broadcast == []
    tight = _table([[small, dense], [small[:4000], dense]], cap=8192)
    plan = _plan.make_plan(tight, "test", cat=[True, False], broadcast_min=128 * 2**10)
    assert plan.broadcast == [0] and plan.cap == 8192 and 2 * plan.max_bytes <= 8192


def test_a_plan_takes_the_smallest_cap_of_the_ranks():
    a, b = torch.zeros(10), torch.zeros(20)
    records = [describe([a], 7, "caps", cap=cap) for cap in (2**20, 4096)]
    table = torch.tensor([records[0], describe([b], 7, "caps", cap=4096)])
    assert _plan.make_plan(table, "test", broadcast_min=1).cap == 4096
    del records


# ------------------------------------------------------------------- grouped broadcasts (NCCL's; issue 34 item 7)
def body_grouped(rank, world_size, per_rank, cap):
    """Equal sections on every rank (gloo's list all_gather takes equal sizes only), the grouped path forced."""
    total = per_rank * world_size
    values = tv.rebase(CatMetric)(sync_cap=cap)
    values.update(_data(total)[0][rank * per_rank : (rank + 1) * per_rank])
    with forced_policy(broadcast_min=1024, grouped_broadcasts=True), _traffic() as seen:
        got = values.compute()
    return got, seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_broadcast_rounds_are_exact_in_one_collective_a_round(world_size):
    # A round moves at most the cap in all: each rank's chunk is cap / W. Equal chunks go one round at a time, as NCCL
    # runs a list all-gather of equal parts through a temporary of the round (issue 43 item 8).
    per_rank, cap = 3_000, 4096  # 12,000 bytes a rank
    chunk = max(1, cap // world_size // 4)
    for got, seen in run_distributed(body_grouped, world_size, per_rank, cap):
        assert torch.equal(got, _data(per_rank * world_size)[0])
        assert "broadcast" not in seen, seen
        assert seen["all_gather"][0] == -(-per_rank // chunk), seen  # one list all-gather per round


def body_rounds_in_flight(rank, world_size):
    """Uneven sections over several rounds: what the grouped route issues and waits for, in order.

    gloo's list all-gather takes equal parts only: here each round runs as NCCL runs one of unequal parts, a
    broadcast from each rank (the last one's work stands for the round).
    """
    from torchmetrics_varlen._engine import comm, wait

    events = []
    wait_all = wait.wait_all

    def issuing(parts, rank, group):
        events.append("issue")
        works = [
            dist.broadcast(part, src, group=group, async_op=True) for src, part in enumerate(parts) if part.numel()
        ]
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def waiting(works, *args, **kwargs):
        events.append(f"wait {len(works)}")
        return wait_all(works, *args, **kwargs)

    values = tv.rebase(CatMetric)(sync_cap=4096)
    values.update(_data(2_000 * (rank + 1))[0])  # uneven: 8,000, 16,000 and 24,000 bytes
    issue = comm.all_gather
    comm.all_gather, wait.wait_all = issuing, waiting
    try:
        with forced_policy(broadcast_min=1024, grouped_broadcasts=True):
            got = values.compute()
    finally:
        comm.all_gather, wait.wait_all = issue, wait_all
    return got, events


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_rounds_go_one_at_a_time(world_size):
    # Issue 43 item 8: every round is waited for before the next is issued, so at most one temporary of a round (at
    # most the cap) is alive whatever the backend makes of a list all-gather (torch 2.15's ProcessGroupNCCL2 unread).
    results = run_distributed(body_rounds_in_flight, world_size)
    expected = torch.cat([_data(2_000 * (r + 1))[0] for r in range(world_size)])
    for got, events in results:
        assert torch.equal(got, expected)
        rounds = events.count("issue")
        assert rounds > 1 and events == ["issue", "wait 1"] * rounds, events


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_round_of_equal_sections_goes_straight_into_the_result(world_size):
    # Every rank's whole section in one round, all of one size: they lie back to back in the result, so one
    # all_gather_into_tensor fills it, with no temporary at all.
    per_rank, cap = 3_000, 2**20
    for got, seen in run_distributed(body_grouped, world_size, per_rank, cap):
        assert torch.equal(got, _data(per_rank * world_size)[0])
        assert "all_gather" not in seen and "broadcast" not in seen, seen
        metadata = seen.get("all_gather_single", seen.get("all_gather_into_tensor"))
        assert metadata[0] == 2, seen  # the records, then the result


def test_rounds_hold_the_sections_grouped_by_chunk():
    # Uneven sections, an empty rank, chunks of 3 elements (a round moves at most the cap, 36 bytes: 12 a rank):
    # every section of `sections` is in one round, in order.
    from types import SimpleNamespace

    eplan = SimpleNamespace(dtype=torch.float32, numels=torch.tensor([7, 0, 2]))  # what rounds() reads of a plan
    plan = SimpleNamespace(world_size=3, entries=[eplan], broadcast=[0], cap=36)
    result = torch.arange(9, dtype=torch.float32)
    own = torch.arange(7, 9, dtype=torch.float32)  # rank 2's data
    rounds = pack.rounds(plan, {0: result}, {0: own}, 2)
    # Sections travel as bytes (a dtype a backend cannot broadcast moves as any other): read back as float32 here.
    assert all(part.dtype == torch.uint8 for round_ in rounds for part in round_.parts)
    assert [[part.view(torch.float32).tolist() for part in round_.parts] for round_ in rounds] == [
        [[0.0, 1.0, 2.0], [], [7.0, 8.0]],
        [[3.0, 4.0, 5.0], [], []],
        [[6.0], [], []],
    ]
    assert not any(round_.whole is not None for round_ in rounds)  # unequal: a list all-gather a round
    assert rounds[0].parts[2].data_ptr() == own.data_ptr()  # this rank's own chunk is its source
    assert rounds[0].parts[0].data_ptr() == result.data_ptr()  # the others' chunks are views of the result: no copy
    for src in range(3):  # each rank's chunks, in round order, are its sections of `sections`, in order
        chunks = [round_.parts[src] for round_ in rounds]
        sections = [part for owner, part in pack.sections(plan, {0: result}, {0: own}, 2) if owner == src]
        assert (
            torch.cat([torch.empty(0, dtype=torch.uint8), *chunks]).tolist()
            == torch.cat([torch.empty(0, dtype=torch.uint8), *sections]).tolist()
        )
