"""`UnpaddedDistributedSampler`: every sample exactly once over all ranks, shards within one of each other."""

import itertools

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics.aggregation import CatMetric, SumMetric

from torchmetrics_varlen import gather_all_tensors
from torchmetrics_varlen.sampler import UnpaddedDistributedSampler

SIZES = [0, 1, 2, 3, 4, 5, 7, 10, 16, 17, 100, 1003]
WORLDS = [1, 2, 3, 4, 7, 8]
EPOCHS = [0, 1, 5]


def _shards(n, world, shuffle, epoch, seed=0):
    dataset = list(range(n))
    samplers = [UnpaddedDistributedSampler(dataset, world, rank, shuffle=shuffle, seed=seed) for rank in range(world)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return samplers, [list(sampler) for sampler in samplers]


@pytest.mark.parametrize(("n", "world"), list(itertools.product(SIZES, WORLDS)))
def test_every_index_exactly_once_and_balanced(n, world):
    for shuffle, epoch in itertools.product([False, True], EPOCHS):
        samplers, shards = _shards(n, world, shuffle, epoch)
        flat = [i for shard in shards for i in shard]
        assert sorted(flat) == list(range(n)), (n, world, shuffle, epoch)  # union is everything, no duplicates
        sizes = [len(shard) for shard in shards]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == [len(sampler) for sampler in samplers]  # __len__ is exact on every rank
        assert sizes == sorted(sizes, reverse=True)  # the larger shards are the first ranks, like DistributedSampler
        assert all(isinstance(i, int) for i in flat)
        if n < world:
            assert sizes == [1] * n + [0] * (world - n)
        if not shuffle:
            assert shards == [list(range(rank, n, world)) for rank in range(world)]


@pytest.mark.parametrize(("n", "world"), list(itertools.product(SIZES, WORLDS)))
def test_drop_in_for_distributed_sampler(n, world):
    # Same strided assignment and the same permutation as DistributedSampler: each shard is DistributedSampler's shard
    # minus its padding tail (the repeated samples that make every rank the same size).
    dataset = list(range(n))
    for shuffle, epoch in itertools.product([False, True], EPOCHS):
        for rank in range(world):
            ours = UnpaddedDistributedSampler(dataset, world, rank, shuffle=shuffle, seed=3)
            theirs = DistributedSampler(dataset, world, rank, shuffle=shuffle, seed=3, drop_last=False)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            mine = list(ours)
            assert mine == list(theirs)[: len(mine)]


@pytest.mark.parametrize("world", WORLDS)
def test_same_seed_and_epoch_give_same_shards(world):
    for n, epoch in itertools.product([0, 3, 17, 1003], EPOCHS):
        for shuffle in (False, True):
            assert _shards(n, world, shuffle, epoch, seed=11)[1] == _shards(n, world, shuffle, epoch, seed=11)[1]
            # The sampler is re-iterable: a second pass yields the same indices.
            samplers, shards = _shards(n, world, shuffle, epoch, seed=11)
            assert [list(sampler) for sampler in samplers] == shards


@pytest.mark.parametrize("world", WORLDS)
def test_shuffle_depends_on_epoch_and_seed(world):
    for n in (10, 17, 1003):
        order = {}
        for epoch in EPOCHS:
            _, shards = _shards(n, world, True, epoch)
            order[epoch] = [i for shard in shards for i in shard]
        assert len({tuple(o) for o in order.values()}) == len(EPOCHS), n  # every epoch its own order
        _, other_seed = _shards(n, world, True, 0, seed=1)
        assert [i for shard in other_seed for i in shard] != order[0]
        _, unshuffled = _shards(n, world, False, 0)
        assert [i for shard in unshuffled for i in shard] != order[0]
        # Without shuffle the epoch changes nothing.
        assert _shards(n, world, False, 0)[1] == _shards(n, world, False, 5)[1]


def test_shuffle_uses_seed_plus_epoch():
    dataset = list(range(50))
    sampler = UnpaddedDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7)
    sampler.set_epoch(4)
    generator = torch.Generator()
    generator.manual_seed(11)
    assert list(sampler) == torch.randperm(50, generator=generator).tolist()


def test_length_follows_the_dataset():
    dataset = list(range(5))
    sampler = UnpaddedDistributedSampler(dataset, num_replicas=2, rank=1)
    assert (len(sampler), list(sampler)) == (2, [1, 3])
    dataset.extend(range(5, 8))
    assert (len(sampler), list(sampler)) == (4, [1, 3, 5, 7])


def test_dataloader_yields_each_sample_once():
    data = TensorDataset(torch.arange(23))
    seen = []
    for rank in range(4):
        loader = DataLoader(data, batch_size=4, sampler=UnpaddedDistributedSampler(data, 4, rank, shuffle=True))
        seen += [int(x) for (batch,) in loader for x in batch]
    assert sorted(seen) == list(range(23))


def test_needs_num_replicas_and_rank_without_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"`num_replicas` and `rank` not given.*pass `num_replicas` and `rank`"):
        UnpaddedDistributedSampler(range(4))
    with pytest.raises(ValueError, match=r"^`rank` not given.*init_process_group"):
        UnpaddedDistributedSampler(range(4), num_replicas=2)
    with pytest.raises(ValueError, match=r"^`num_replicas` not given"):
        UnpaddedDistributedSampler(range(4), rank=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_replicas": 2, "rank": 2}, r"Expected `rank` to be in \[0, num_replicas\) = \[0, 2\) but got 2"),
        ({"num_replicas": 2, "rank": -1}, r"Expected `rank` to be in \[0, num_replicas\).* but got -1"),
        ({"num_replicas": 2, "rank": 1.0}, r"Expected `rank` .* but got 1.0"),
        ({"num_replicas": 2, "rank": True}, r"Expected `rank` .* but got True"),
        ({"num_replicas": 0, "rank": 0}, r"Expected `num_replicas` to be a positive integer but got 0"),
        ({"num_replicas": "2", "rank": 0}, r"Expected `num_replicas` to be a positive integer but got '2'"),
        ({"num_replicas": 2, "rank": 0, "shuffle": 1}, r"Expected `shuffle` to be a bool but got 1"),
        ({"num_replicas": 2, "rank": 0, "seed": 0.5}, r"Expected `seed` to be an int but got 0.5"),
    ],
)
def test_argument_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UnpaddedDistributedSampler(range(4), **kwargs)


def test_set_epoch_and_dataset_validation():
    sampler = UnpaddedDistributedSampler(range(4), num_replicas=1, rank=0, shuffle=True)
    with pytest.raises(ValueError, match=r"Expected `epoch` to be an int but got '1'"):
        sampler.set_epoch("1")
    with pytest.raises(TypeError, match=r"Expected `dataset` to have a length"):
        UnpaddedDistributedSampler(iter(range(4)), num_replicas=1, rank=0)


def body_metric_over_sampler(rank, world_size, n, batch_size=64):
    values = torch.randn(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    data = TensorDataset(values)
    results = {}
    for name, sampler in [
        ("unpadded", UnpaddedDistributedSampler(data, shuffle=True, seed=9)),  # num_replicas/rank from the group
        ("padded", DistributedSampler(data, shuffle=True, seed=9, drop_last=False)),
    ]:
        if name == "unpadded":
            assert (sampler.num_replicas, sampler.rank) == (world_size, rank)
        sampler.set_epoch(2)
        total = SumMetric(dist_sync_fn=gather_all_tensors).set_dtype(torch.float64)
        count = SumMetric(dist_sync_fn=gather_all_tensors).set_dtype(torch.float64)
        collected = CatMetric(dist_sync_fn=gather_all_tensors).set_dtype(torch.float64)
        batches = 0
        for (batch,) in DataLoader(data, batch_size=batch_size, sampler=sampler):
            total.update(batch)
            count.update(torch.ones_like(batch))
            collected.update(batch)
            batches += 1
        results[name] = {
            "sum": total.compute(),
            "count": count.compute(),
            "cat": collected.compute(),
            "local": len(sampler),
            "batches": batches,
        }
    results["reference"] = {"sum": values.sum(), "count": torch.tensor(float(n), dtype=torch.float64), "cat": values}
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_metric_over_unpadded_sampler_equals_single_process(world_size):
    n = 1003
    results = run_distributed(body_metric_over_sampler, world_size, n)
    locals_ = [result["unpadded"]["local"] for result in results]
    assert sum(locals_) == n
    assert max(locals_) - min(locals_) <= 1
    padded_total = -(-n // world_size) * world_size  # 1004 on 2 ranks, 1005 on 3
    for result in results:
        ref, ours, padded = result["reference"], result["unpadded"], result["padded"]
        assert ours["count"].item() == n
        torch.testing.assert_close(ours["sum"], ref["sum"], rtol=1e-12, atol=1e-12)
        assert ours["cat"].shape == (n,)
        # Every sample exactly once: the gathered values are a permutation of the dataset.
        assert torch.equal(ours["cat"].sort().values, ref["cat"].sort().values)
        # The stock sampler pads with duplicates: the metric counts samples that are not in the dataset.
        assert padded["count"].item() == padded_total
        assert padded["cat"].shape == (padded_total,)
        assert not torch.allclose(padded["sum"], ref["sum"])
