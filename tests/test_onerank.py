"""`compute_on_rank`: states gathered to one rank only, result broadcast, equal to the all-gather compute."""

import pytest
import torch
import torch.distributed as dist
from _helpers import assert_same, count_collectives, outcome, split
from conftest import run_distributed
from torchmetrics.aggregation import CatMetric
from torchmetrics.classification import BinaryAUROC, MulticlassAUROC
from torchmetrics.regression import MeanSquaredError
from torchmetrics.retrieval import RetrievalMAP
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors as stock_gather_all_tensors

from torchmetrics_varlen import Metric, SyncMismatchError, rebase
from torchmetrics_varlen.onerank import compute_on_rank


class Nested(Metric):
    """A result of every nesting: dict of tensor, list, tuple, named values; a sum state and a cat state."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.total += x.double().sum()
        self.values.append(x)

    def compute(self):
        # After a sync a `cat` list state is one tensor, as with stock torchmetrics: dim_zero_cat takes both.
        values = dim_zero_cat(self.values) if len(self.values) else torch.zeros(0)
        return {
            "total": self.total,
            "parts": [values[:2], (values.numel(), values.sort().values)],
            "label": "nested",
        }


class FailsOnBigData(Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, x):
        self.count += x.numel()

    def compute(self):
        if self.count > 3:
            raise ValueError(f"too many samples: {int(self.count)}")
        return self.count


# (class, arguments): compute_on_rank runs on the stock class; the all-gather reference is its rebased twin (stock
# torchmetrics' own sync breaks on empty ranks, which is what this package fixes).
FACTORIES = {
    "BinaryAUROC": (BinaryAUROC, {"thresholds": None}),
    "VarlenMulticlassAUROC": (rebase(MulticlassAUROC), {"num_classes": 3, "thresholds": None}),
    "MeanSquaredError": (MeanSquaredError, {}),
    "CatMetric": (CatMetric, {}),
    "RetrievalMAP": (RetrievalMAP, {}),
    "Nested": (Nested, {}),
}


SIZES = {"uneven": [7, 3, 5], "one_empty": [6, 0, 4], "first_empty": [0, 4, 2], "all_empty": [0, 0, 0]}


def data(name, n):
    gen = torch.Generator().manual_seed(21)
    if name == "VarlenMulticlassAUROC":
        return (torch.softmax(torch.randn(n, 3, generator=gen), -1), torch.randint(0, 3, (n,), generator=gen)), {}
    if name == "RetrievalMAP":
        return (torch.rand(n, generator=gen), torch.randint(0, 2, (n,), generator=gen)), {
            "indexes": torch.arange(n) // 3
        }
    if name in ("CatMetric", "Nested"):
        return (torch.randn(n, generator=gen),), {}
    return (torch.rand(n, generator=gen), torch.randint(0, 2, (n,), generator=gen)), {}


def fill(metric, name, sizes, rank, batch=2):
    args, kwargs = data(name, sum(sizes))
    mine = split(sizes, rank)
    for start in range(mine.start, mine.stop, batch):
        part = slice(start, min(start + batch, mine.stop))
        metric.update(*(a[part] for a in args), **{k: v[part] for k, v in kwargs.items()})


def body_equal_to_all_gather(rank, world_size):
    results = []
    for scenario, all_sizes in SIZES.items():
        sizes = all_sizes[:world_size]
        for name, (cls, options) in FACTORIES.items():
            for dst in sorted({0, world_size - 1}):
                one_rank, every_rank = cls(**options), rebase(cls)(**options)
                fill(one_rank, name, sizes, rank)
                fill(every_rank, name, sizes, rank)
                with count_collectives() as counts:
                    got = outcome(lambda m=one_rank, d=dst: compute_on_rank(m, dst=d))
                expected = outcome(every_rank.compute)
                if sum(sizes):
                    single = cls(sync_on_compute=False, **options)
                    fill(single, name, [sum(sizes)], 0, batch=sum(sizes))
                else:
                    # No rank has data: stock's own sync turns each empty `cat` list into `tensor([])` (one process
                    # keeps `[]`), so the reference is stock's per-state sync with its own gather on the same ranks.
                    single = cls(dist_sync_fn=stock_gather_all_tensors, **options)
                results.append(((scenario, name, dst), got, expected, outcome(single.compute), dict(counts)))
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_equal_to_all_gather_and_single_process(world_size):
    for rank_results in run_distributed(body_equal_to_all_gather, world_size):
        for case, got, expected, single, counts in rank_results:
            assert type(got) is type(expected), (case, got, expected)
            assert_same(got, expected, exact=True)  # the same reductions on the same states: bit for bit
            assert_same(got, single)  # float sums may differ in the last bit from one update on one process
            if case[1] in ("BinaryAUROC", "CatMetric", "RetrievalMAP", "VarlenMulticlassAUROC"):
                assert_same(got, single, exact=True)  # cat states: the same samples in the same order
            data_moved = "all_empty" not in case[0] or case[1] in ("MeanSquaredError", "Nested")  # tensor states
            # One metadata all-gather, one gather to dst (none when nobody holds a byte), two broadcasts.
            assert counts.pop("gather", 0) == (1 if data_moved else 0), (case, counts)
            metadata = counts.pop("all_gather_single", 0) + counts.pop("all_gather_into_tensor", 0)
            assert metadata == 1 and counts == {"broadcast": 2}, (case, counts)


def body_cache_errors_and_options(rank, world_size):
    report = {}
    # A cached result everywhere: metadata only, same value.
    metric = BinaryAUROC(thresholds=None)
    fill(metric, "BinaryAUROC", [5, 2, 4][:world_size], rank)
    first = compute_on_rank(metric, dst=1)
    with count_collectives() as counts:
        second = compute_on_rank(metric, dst=1)
    report["cached"] = (torch.equal(first, second), sum(counts.values()))
    # An error while computing on dst is raised on every rank; the group stays usable.
    failing = FailsOnBigData()
    failing.update(torch.ones(2))
    try:
        compute_on_rank(failing, dst=world_size - 1)
    except ValueError as err:
        report["error"] = str(err)
    after = FailsOnBigData()
    after.update(torch.ones(1))
    report["after"] = int(compute_on_rank(after))
    # A wrong dst fails on every rank before any collective.
    with count_collectives() as counts:
        report["bad_dst"] = outcome(lambda: compute_on_rank(after, dst=world_size))
    report["bad_dst_calls"] = sum(counts.values())
    # sync_on_compute=False: a local compute.
    local = CatMetric(sync_on_compute=False)
    local.update(torch.tensor([float(rank)]))
    report["local"] = compute_on_rank(local)
    # Other ranks than dst never hold the gathered data: their states are untouched and dst's are restored.
    held = CatMetric()
    held.update(torch.full((3,), float(rank)))
    before = [v.clone() for v in held.value]
    compute_on_rank(held, dst=0)
    report["states_restored"] = len(held.value) == len(before) and all(
        torch.equal(a, b) for a, b in zip(held.value, before)
    )
    # Ranks that disagree on dst raise together instead of pairing a gather with the wrong peer.
    mismatch = CatMetric()
    mismatch.update(torch.ones(1))
    try:
        compute_on_rank(mismatch, dst=rank)
    except SyncMismatchError as err:
        report["mismatch"] = str(err)
    report["world"] = dist.get_world_size()
    return report


@pytest.mark.parametrize("world_size", [2, 3])
def test_cache_errors_and_options(world_size):
    for rank, report in enumerate(run_distributed(body_cache_errors_and_options, world_size)):
        # Every rank says its cache is valid: the records are all that move (issue 43 item 1; stock: none).
        assert report["cached"] == (True, 1)
        assert report["error"] == f"too many samples: {2 * world_size}"
        assert report["after"] == world_size
        assert report["bad_dst"] == "ValueError"
        assert report["bad_dst_calls"] == 0
        assert torch.equal(report["local"], torch.tensor(float(rank)))
        assert report["states_restored"]
        assert "syncing different things" in report["mismatch"] and "CatMetric.onerank1" in report["mismatch"]


def test_without_process_group_is_compute():
    metric = CatMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    assert torch.equal(compute_on_rank(metric), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="`dst`"):
        compute_on_rank(metric, dst=-1)
    with pytest.raises(TypeError, match=r"torchmetrics\.Metric"):
        compute_on_rank(object())


class _TestPool:
    """`measure_sync_memory` runs on the test-suite's cached worker pool."""

    def __init__(self, world_size):
        self.world_size = world_size

    def run(self, fn, *args, deadline=90.0, **kwargs):
        return run_distributed(fn, self.world_size, *args, deadline=deadline, **kwargs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_measure_sync_memory(world_size):
    from benchmarks._memory import measure_sync_memory

    report = measure_sync_memory(world_size, 400_000, dst=0, pool=_TestPool(world_size))
    values = report["all_gather"]["value"] + report["one_rank"]["value"]
    assert len(set(values)) == 1 and 0.4 < values[0] < 0.6
    # Both paths move these states by the routes that receive the true sizes: each rank's own section is its copy.
    # The rest is the metadata records, the results' broadcast and the item shape tables: a few KiB.
    state_bytes = report["state_bytes"]
    received, one_rank = report["all_gather"]["received_bytes"], report["one_rank"]["received_bytes"]
    for rank in range(world_size):
        assert sum(state_bytes) <= received[rank] < sum(state_bytes) + 2**16
        if rank == 0:  # dst: every other rank's states once
            assert sum(state_bytes) - state_bytes[0] <= one_rank[0] < sum(state_bytes) - state_bytes[0] + 2**16
        else:
            assert one_rank[rank] < 2**16
    if report["peak_method"] == "VmHWM reset":  # the other ranks never hold the gathered data
        non_dst = report["one_rank"]["max_non_dst_peak_rss_growth_bytes"]
        assert non_dst < report["all_gather"]["max_non_dst_peak_rss_growth_bytes"] / 4
    with pytest.raises(ValueError, match="`world_size`"):
        measure_sync_memory(1, 10)


class _ComplexCat(Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.values.append(x)

    def compute(self):
        return dim_zero_cat(self.values)


def body_conjugate_and_int16_to_one_rank(rank, world_size):
    gen = torch.Generator().manual_seed(rank)
    conj = _ComplexCat()
    conj.update(torch.randn(30_000 + rank, dtype=torch.complex64, generator=gen).conj())  # routed: large
    small = _ComplexCat()
    small.update(torch.randn(3, dtype=torch.complex64, generator=gen).conj())
    ints = _ComplexCat()
    ints.update((torch.arange(100_000 + rank) % 300).to(torch.int16))
    return [compute_on_rank(metric, dst=world_size - 1) for metric in (conj, small, ints)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_conjugate_views_and_int16_states_move_to_one_rank(world_size):
    # Issue 43 items 3 and 4 on the one-rank route: the bytes move, whatever the dtype or the view's bits.
    gens = [torch.Generator().manual_seed(r) for r in range(world_size)]
    conj = torch.cat([torch.randn(30_000 + r, dtype=torch.complex64, generator=g).conj() for r, g in enumerate(gens)])
    small = torch.cat([torch.randn(3, dtype=torch.complex64, generator=g).conj() for g in gens])
    ints = torch.cat([(torch.arange(100_000 + r) % 300).to(torch.int16) for r in range(world_size)])
    for got in run_distributed(body_conjugate_and_int16_to_one_rank, world_size, deadline=90):
        for value, expected in zip(got, (conj, small, ints)):
            assert value.dtype == expected.dtype and torch.equal(value.resolve_conj(), expected.resolve_conj())
