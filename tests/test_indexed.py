"""`IndexedMetric`: bit-identical to one process evaluating the dataset in order, whatever the sampler."""

import warnings

import pytest
import torch
from _helpers import assert_same, outcome
from conftest import run_distributed
from torch.utils.data import DistributedSampler
from torchmetrics import Metric as StockMetric
from torchmetrics.aggregation import CatMetric, MeanMetric
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy
from torchmetrics.regression import MeanSquaredError
from torchmetrics.retrieval import RetrievalMAP

from torchmetrics_varlen import Metric, rebase
from torchmetrics_varlen.indexed import IndexedMetric


class OrderedSum(Metric):
    """A metric on our base whose result depends on the sample order (a running float32 sum, kept per sample)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, value):
        self.values.append(value)

    def compute(self):
        return torch.cat(self.values).cumsum(0) if self.values else torch.zeros(0)


METRICS = {
    "BinaryAUROC": lambda **kw: BinaryAUROC(thresholds=None, **kw),
    "MulticlassAccuracy": lambda **kw: MulticlassAccuracy(num_classes=4, average="macro", **kw),
    "RetrievalMAP": lambda **kw: RetrievalMAP(**kw),
    "CatMetric": lambda **kw: CatMetric(**kw),
    "MeanSquaredError": lambda **kw: MeanSquaredError(**kw),
    "OrderedSum": lambda **kw: OrderedSum(**kw),
    "VarlenBinaryAUROC": lambda **kw: rebase(BinaryAUROC)(thresholds=None, **kw),
}


def dataset(name, n):
    """The per-sample arguments of metric `name` for a dataset of n samples (indexed by dataset index)."""
    gen = torch.Generator().manual_seed(1234 + n)
    if name in ("BinaryAUROC", "VarlenBinaryAUROC"):
        return (torch.rand(n, generator=gen), torch.randint(0, 2, (n,), generator=gen)), {}
    if name == "MulticlassAccuracy":
        return (torch.randn(n, 4, generator=gen), torch.randint(0, 4, (n,), generator=gen)), {}
    if name == "RetrievalMAP":
        preds, target = torch.rand(n, generator=gen), torch.randint(0, 2, (n,), generator=gen)
        return (preds, target), {"indexes": torch.arange(n) // 5}
    if name in ("CatMetric", "OrderedSum"):
        return (torch.randn(n, generator=gen),), {}
    return (torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)), {}


def take(data, index):
    args, kwargs = data
    return tuple(a[index] for a in args), {k: v[index] for k, v in kwargs.items()}


def single_process(name, n, batch_size=None):
    """One process, the dataset in index order: one update (or batches of batch_size), no sync."""
    metric = METRICS[name](sync_on_compute=False)
    data = dataset(name, n)
    step = batch_size or max(n, 1)
    for start in range(0, n, step):
        args, kwargs = take(data, torch.arange(start, min(start + step, n)))
        metric.update(*args, **kwargs)
    return outcome(metric.compute)


def evaluate(name, n, indices, batch=None, use_forward=False, **options):
    """This rank's loop: batches of the sampler's indices, every call with its sample_index."""
    metric = IndexedMetric(METRICS[name](), **options)
    data = dataset(name, n)
    indices = torch.as_tensor(list(indices), dtype=torch.int64)
    batch = batch or (8 if n < 100 else 48)
    for start in range(0, indices.numel(), batch):
        index = indices[start : start + batch]
        args, kwargs = take(data, index)
        if use_forward:
            metric(*args, sample_index=index, **kwargs)
        else:
            metric.update(*args, sample_index=index, **kwargs)
    return outcome(metric.compute)


def body_distributed_sampler(rank, world_size):
    """DistributedSampler (padding, drop_last=False), shuffled or not, n not divisible by the world size."""
    results = []
    for n in (1003, 37):
        for shuffle in (False, True):
            sampler = DistributedSampler(
                range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=7, drop_last=False
            )
            indices = list(sampler)
            for name in METRICS:
                if n == 1003 and name in ("RetrievalMAP", "OrderedSum"):
                    continue  # the small dataset covers them; keeps the run short
                got = evaluate(name, n, indices)
                results.append(((name, n, shuffle), got, single_process(name, n)))
            # The options: one-rank compute, replay in batches (float sums as in a batched single-process loop),
            # forward (batch values on the way), duplicates="error" (padding copies are equal: no error).
            last = world_size - 1
            got = evaluate("BinaryAUROC", n, indices, compute_on_rank=last, duplicates="error")
            results.append((("BinaryAUROC/onerank", n, shuffle), got, single_process("BinaryAUROC", n)))
            got = evaluate("MeanSquaredError", n, indices, update_batch_size=16)
            results.append((("MSE/batches", n, shuffle), got, single_process("MeanSquaredError", n, batch_size=16)))
            got = evaluate("CatMetric", n, indices, use_forward=True, compute_on_rank=0)
            results.append((("CatMetric/forward", n, shuffle), got, single_process("CatMetric", n)))
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_distributed_sampler_bit_identical_to_single_process(world_size):
    for rank_results in run_distributed(body_distributed_sampler, world_size, deadline=120):
        for case, got, expected in rank_results:
            assert not isinstance(got, str), (case, got)
            assert getattr(got, "shape", None) == getattr(expected, "shape", None), case
            assert_same(got, expected, exact=True)


def body_empty_shards(rank, world_size):
    """Fewer samples than ranks (strided, no padding): some ranks never update, one updates with empty tensors."""
    results = []
    for n in (2, 1, 0):
        indices = list(range(rank, n, world_size))
        for name in ("BinaryAUROC", "CatMetric", "RetrievalMAP", "MulticlassAccuracy", "VarlenBinaryAUROC"):
            metric = IndexedMetric(METRICS[name]())
            if indices:
                args, kwargs = take(dataset(name, n), torch.tensor(indices))
                metric.update(*args, sample_index=torch.tensor(indices), **kwargs)
            elif rank == world_size - 1:  # an empty batch: validated, stores nothing
                args, kwargs = take(dataset(name, 3), torch.tensor([], dtype=torch.int64))
                metric.update(*args, sample_index=torch.tensor([], dtype=torch.int64), **kwargs)
            results.append(((name, n), outcome(metric.compute), single_process(name, n)))
        # A non-tensor argument reaches the ranks that never updated.
        metric = IndexedMetric(MeanMetric())
        if indices:
            metric.update(
                torch.tensor(indices, dtype=torch.float32) * 10, weight=0.5, sample_index=torch.tensor(indices)
            )
        reference = MeanMetric(sync_on_compute=False)
        if n:
            reference.update(torch.arange(n, dtype=torch.float32) * 10, weight=0.5)
        results.append((("MeanMetric/static", n), outcome(metric.compute), outcome(reference.compute)))
    return results


@pytest.mark.parametrize("world_size", [3, 4])
def test_empty_shards(world_size):
    for rank_results in run_distributed(body_empty_shards, world_size):
        for case, got, expected in rank_results:
            assert type(got) is type(expected), (case, got, expected)
            assert_same(got, expected, exact=True)


def body_conflicts(rank, world_size):
    """Sample 0 seen by every rank with a different value (the rank); with `twice`, rank 0 saw it before as 10."""
    report = {}
    value = torch.tensor([float(rank), 100.0 + rank])
    index = torch.tensor([0, 1 + rank])
    for rule, twice in (("first", False), ("first", True), ("error", True)):
        indexed = IndexedMetric(CatMetric(), duplicates=rule)
        if rank == 0 and twice:
            indexed.update(torch.tensor([10.0]), sample_index=torch.tensor([0]))  # earliest call on the lowest rank
        indexed.update(value, sample_index=index)
        try:
            report[rule, twice] = indexed.compute()
        except ValueError as err:
            report[rule, twice] = str(err)
    # Non-tensor arguments that differ between ranks are an error on every rank.
    mean = IndexedMetric(MeanMetric())
    mean.update(torch.ones(1), weight=float(rank + 1), sample_index=torch.tensor([rank]))
    try:
        mean.compute()
    except ValueError as err:
        report["static"] = str(err)
    return report


@pytest.mark.parametrize("world_size", [2, 3])
def test_conflicting_duplicates(world_size):
    for report in run_distributed(body_conflicts, world_size):
        # first wins: the lowest rank's copy (fewer than world_size copies, one per rank: what padding produces);
        # then samples 1.. in index order.
        expected = torch.tensor([0.0] + [100.0 + r for r in range(world_size)])
        assert torch.equal(report["first", False], expected)
        # Two different samples under one index on one rank: no sampler does that; refused on every rank.
        assert isinstance(report["first", True], str), report["first", True]
        assert "1 on rank 0 repeat an index" in report["first", True] and "dataset indices" in report["first", True]
        assert "sample index 0" in report["error", True] and "duplicates='first'" in report["error", True]
        assert "identical on every call and every rank" in report["static"]


def body_local_indices(rank, world_size, n):
    """Issue 13 item 11: each rank passes positions within its own shard (0, 1, ...) instead of dataset indices."""
    data = torch.arange(n, dtype=torch.float32) * 10
    mine = data[rank::world_size]  # an uneven strided shard
    outcomes = {}
    for mistake in (True, False):
        metric = IndexedMetric(CatMetric())
        for start in range(0, mine.numel(), 4):
            batch = mine[start : start + 4]
            local = torch.arange(start, start + batch.numel())
            metric.update(batch, sample_index=local if mistake else local * world_size + rank)
        try:
            outcomes[mistake] = metric.compute()
        except ValueError as err:
            outcomes[mistake] = str(err)
    return outcomes


@pytest.mark.parametrize("world_size", [2, 3])
def test_per_rank_indices_are_refused_not_dropped(world_size):
    n = 23
    for outcomes in run_distributed(body_local_indices, world_size, n):
        # Old behaviour: the first rank's samples kept, about (W-1)/W of the data dropped without a word.
        assert isinstance(outcomes[True], str), f"expected an error, got {outcomes[True]}"
        conflicts = n - len(range(0, n, world_size))  # every sample of ranks 1.. collides with one of rank 0
        assert f"{conflicts} of {n} samples repeat an index" in outcomes[True], outcomes[True]
        assert f"world_size = {world_size}" in outcomes[True] and "duplicates='first'" in outcomes[True]
        assert_same(outcomes[False], torch.arange(n, dtype=torch.float32) * 10, exact=True)  # dataset indices: fine


def body_noisy_padding(rank, world_size, n):
    """DistributedSampler padding copies whose values differ slightly (a batch effect): still padding, first wins."""
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=3)
    index = torch.tensor(list(sampler))
    metric = IndexedMetric(CatMetric())
    metric.update(index.float() + rank * 1e-3, sample_index=index)
    return metric.compute()


@pytest.mark.parametrize("world_size", [2, 3])
def test_padding_copies_with_other_values_are_still_accepted(world_size):
    n = 3 * world_size + 1  # world_size - 1 padding copies
    for got in run_distributed(body_noisy_padding, world_size, n):
        assert got.shape == (n,)
        torch.testing.assert_close(got, torch.arange(n, dtype=torch.float32), atol=0.01, rtol=0)


def test_single_process_repeats():
    repeated = IndexedMetric(CatMetric())
    repeated.update(torch.tensor([1.0, 2.0]), sample_index=torch.tensor([0, 1]))
    repeated.update(torch.tensor([1.0]), sample_index=torch.tensor([0]))  # the same sample again: harmless
    assert torch.equal(repeated.compute(), torch.tensor([1.0, 2.0]))
    repeated.update(torch.tensor([5.0]), sample_index=torch.tensor([1]))  # another value under a used index
    with pytest.raises(ValueError, match=r"1 of 4 samples repeat an index with different values \(1 on rank 0"):
        repeated.compute()


# ------------------------------------------------------------------------------------------- single process
def test_single_process_matches_plain_metric_and_dedups():
    metric = IndexedMetric(BinaryAUROC(thresholds=None))
    preds, target = torch.tensor([0.1, 0.9, 0.4, 0.6]), torch.tensor([0, 1, 1, 0])
    metric.update(preds[2:], target[2:], sample_index=torch.tensor([2, 3]))
    metric.update(preds[:3], target=target[:3], sample_index=torch.tensor([0, 1, 2], dtype=torch.int32))
    reference = BinaryAUROC(thresholds=None)
    reference.update(preds, target)
    assert torch.equal(metric.compute(), reference.compute())
    metric.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert outcome(metric.compute) == outcome(BinaryAUROC(thresholds=None).compute)


def test_the_wrapped_metric_is_copied_and_left_alone():
    original = CatMetric()
    original.update(torch.tensor([5.0]))
    metric = IndexedMetric(original)
    metric.update(torch.tensor([1.0]), sample_index=torch.tensor([0]))
    assert torch.equal(metric.compute(), torch.tensor(1.0))
    assert torch.equal(original.compute(), torch.tensor(5.0))


@pytest.mark.parametrize(
    ("index", "match"),
    [
        (None, "Expected keyword argument `sample_index`"),
        (torch.tensor([[0, 1]]), r"Expected `sample_index` to be a 1-D integer tensor .* shape \(1, 2\)"),
        (torch.tensor([0.0, 1.0]), "Expected `sample_index` to be a 1-D integer tensor .* dtype torch.float32"),
        (torch.tensor([True, False]), "1-D integer tensor"),
        ([0, 1], "1-D integer tensor"),
        (torch.tensor([0, 1, 2]), r"one entry per sample along dim 0 \(3 samples .* `preds` has shape \(2,\)"),
    ],
)
def test_sample_index_validation(index, match):
    metric = IndexedMetric(BinaryAUROC())
    with pytest.raises(ValueError, match=match):
        metric.update(torch.tensor([0.2, 0.8]), torch.tensor([0, 1]), sample_index=index)


def test_argument_validation():
    metric = IndexedMetric(MeanMetric())
    with pytest.raises(TypeError, match=r"Arguments do not match MeanMetric\.update"):
        metric.update(torch.ones(2), torch.ones(2), torch.ones(2), sample_index=torch.arange(2))
    with pytest.raises(ValueError, match="one entry per sample"):
        metric.update(torch.tensor(1.0), sample_index=torch.arange(1))
    metric.update(torch.ones(2), weight=2.0, sample_index=torch.arange(2))
    with pytest.raises(ValueError, match="non-tensor arguments to be identical on every call"):
        metric.update(torch.ones(2), weight=3.0, sample_index=torch.arange(2))
    with pytest.raises(ValueError, match="the same tensor arguments on every call"):
        metric.update(torch.ones(2), weight=torch.ones(2), sample_index=torch.arange(2))
    with pytest.raises(ValueError, match="keep its dtype and trailing shape"):
        metric.update(torch.ones(2, dtype=torch.float64), weight=2.0, sample_index=torch.arange(2))
    with pytest.raises(TypeError, match="holding tensors"):
        IndexedMetric(MeanMetric()).update([torch.ones(1)], sample_index=torch.arange(1))
    metric.reset()  # a new epoch may use other arguments
    metric.update(torch.ones(2), weight=3.0, sample_index=torch.arange(2))
    assert torch.equal(metric.compute(), torch.tensor(1.0))


class Variadic(StockMetric):
    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, *args):
        self.n += len(args)

    def compute(self):
        return self.n


def test_constructor_validation():
    with pytest.raises(TypeError, match=r"named parameters only, but it takes \*args"):
        IndexedMetric(Variadic())
    with pytest.raises(TypeError, match=r"torchmetrics\.Metric"):
        IndexedMetric(lambda x: x)
    with pytest.raises(ValueError, match="`duplicates`"):
        IndexedMetric(CatMetric(), duplicates="last")
    with pytest.raises(ValueError, match="`update_batch_size`"):
        IndexedMetric(CatMetric(), update_batch_size=0)
    with pytest.raises(ValueError, match="`compute_on_rank`"):
        IndexedMetric(CatMetric(), compute_on_rank=-1)


def test_missing_optional_argument_on_some_calls_is_an_error_at_compute():
    metric = IndexedMetric(MeanMetric())
    metric.update(torch.ones(2), sample_index=torch.arange(2))
    metric.reset()
    metric._layout = None
    metric.update(torch.ones(2), sample_index=torch.arange(2))
    metric.input_weight.append(torch.ones(1))  # as if another rank passed `weight` for one sample
    with pytest.raises(ValueError, match="`weight` to be passed with every update on every rank, or never"):
        metric.compute()
