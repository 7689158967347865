"""List states holding Python objects: every rank's items in rank order, as one process holds them; errors on every
rank, never a hang."""

import warnings

import numpy as np
import pytest
import torch
from _helpers import count_collectives, split
from conftest import run_distributed
from torchmetrics.utilities import dim_zero_cat

import torchmetrics_varlen as tv
from torchmetrics_varlen import Metric, SyncMismatchError, compute_on_rank


def _keep(items):
    return items


class ObjectLog(Metric):
    """One list state per reduction, each holding what ``update`` is given (objects, tensors or both)."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("plain", default=[], dist_reduce_fx=None)
        self.add_state("joined", default=[], dist_reduce_fx="cat")
        self.add_state("custom", default=[], dist_reduce_fx=_keep)

    def update(self, item):
        self.plain.append(item)
        self.joined.append(item)
        self.custom.append(item)

    def compute(self):
        return {"plain": list(self.plain), "joined": self.joined, "custom": list(self.custom)}


def _item(index):
    """An object of one of several kinds, tensors inside some (dtype, shape and non-contiguity kept)."""
    gen = torch.Generator().manual_seed(index)
    kind = index % 7
    if kind == 0:
        return f"image-{index}"
    if kind == 1:  # an RLE mask as pycocotools makes them
        return {"size": [4, 5], "counts": bytes(range(index % 11, index % 11 + 9))}
    if kind == 2:
        return ({"size": [2, 3], "counts": b"ab"}, index, None)
    if kind == 3:
        return {"boxes": torch.rand(index % 4, 4, generator=gen), "labels": torch.arange(index % 4, dtype=torch.int8)}
    if kind == 4:
        return (torch.randn(3, 2, generator=gen).to(torch.bfloat16).t(), torch.tensor(True), torch.zeros(0, 3))
    if kind == 5:
        return np.arange(index, dtype=np.int16)
    return torch.randint(0, 9, (index % 3 + 1,), generator=gen)  # a plain tensor beside the objects


def _same(got, expected):
    assert type(got) is type(expected), (got, expected)
    if isinstance(expected, torch.Tensor):
        assert (got.dtype, got.shape, got.device) == (expected.dtype, expected.shape, expected.device)
        assert torch.equal(got, expected)
    elif isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype and np.array_equal(got, expected)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            _same(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            _same(a, b)
    else:
        assert got == expected


SIZES = {"uneven": [5, 0, 3], "first_empty": [0, 4, 2], "all_empty": [0, 0, 0], "one_each": [1, 1, 1]}


def body_objects(rank, world_size, scenario, dst):
    sizes = SIZES[scenario][:world_size]
    items = [_item(i) for i in range(sum(sizes))]
    metric = ObjectLog()
    for item in items[split(sizes, rank)]:
        metric.update(item)
    with count_collectives() as counts:
        got = metric.compute() if dst is None else compute_on_rank(metric, dst)
    reference = ObjectLog(distributed_available_fn=lambda: False)  # one process on all the items
    for item in items:
        reference.update(item)
    expected = reference.compute()
    if expected["joined"] == [] and world_size > 1:
        expected["joined"] = torch.tensor([])  # stock's value of a `cat` list empty on every rank
    return {"got": got, "expected": expected, "counts": dict(counts), "local": len(metric.plain)}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scenario", sorted(SIZES))
@pytest.mark.parametrize("dst", [None, 1])
def test_object_states_equal_one_process(world_size, scenario, dst):
    if dst is not None and dst >= world_size:
        pytest.skip("no such rank")
    for result in run_distributed(body_objects, world_size, scenario, dst):
        _same(result["got"], result["expected"])
        assert "all_gather_object" not in result["counts"] and "broadcast_object_list" not in result["counts"]


def body_collectives_do_not_grow(rank, world_size, count, cap):
    metric = ObjectLog(sync_cap=cap)
    for index in range(count * (rank + 1)):  # skewed: the last rank holds the most
        metric.update({"size": [7, 7], "counts": bytes(index % 251 for _ in range(300)), "id": index})
    with count_collectives() as counts:
        got = metric.compute()
    total = sum(count * (r + 1) for r in range(world_size))
    return {"counts": dict(counts), "ids": [item["id"] for item in got["plain"]], "total": total}


@pytest.mark.parametrize("cap", [None, 1024])
def test_objects_move_in_a_fixed_number_of_collectives(cap):
    # 10x the items, the same collectives: sizes in the records, bytes in the one gather (or the broadcast route
    # under the cap's chunks). One extra tiny all-gather confirms every rank loaded the objects.
    counts = []
    for count in (3, 30):
        results = run_distributed(body_collectives_do_not_grow, 2, count, cap)
        for result in results:
            ids = [i for r in range(2) for i in range(count * (r + 1))]
            assert result["ids"] == ids
        counts.append(results[0]["counts"])
    if cap is None:
        assert counts[0] == counts[1]
    assert all("all_gather_object" not in c for c in counts)


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object does not pickle")


def body_unpicklable(rank, world_size, kind):
    metric = ObjectLog()
    metric.update("fine")
    if rank == world_size - 1:
        if kind == "nested":  # pickle takes it, but its bytes cannot travel beside the pickle (the docs say so)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's prototype warning for the strided layout
                nested = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(2.0)])
            metric.update({"boxes": nested})
        else:
            metric.update(Unpicklable())
    return _mismatch_message(metric)


def _mismatch_message(metric):
    """The SyncMismatchError that ``metric.compute()`` raised on this rank, else "no error"."""
    try:
        metric.compute()
    except SyncMismatchError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["unpicklable", "nested"])
def test_unpicklable_item_raises_on_every_rank(world_size, kind):
    for message in run_distributed(body_unpicklable, world_size, kind):
        assert "ObjectLog.plain" in message, message
        assert f"rank {world_size - 1}" in message and "item 1" in message
        assert ("Unpicklable" if kind == "unpicklable" else "dict") in message, message


class LoadsOnRankZeroOnly:
    """Pickles anywhere; loading fails on every rank but 0 (as a class missing from some ranks' code would)."""

    def __init__(self, value):
        self.value = value

    def __setstate__(self, state):
        import torch.distributed as dist

        if dist.get_rank() != 0:
            raise ImportError("this class cannot be loaded here")
        self.__dict__.update(state)


def body_load_failure(rank, world_size):
    metric = ObjectLog()
    if rank == 0:
        metric.update(LoadsOnRankZeroOnly(3))
    return _mismatch_message(metric)


@pytest.mark.parametrize("world_size", [2, 3])
def test_load_failure_on_one_rank_raises_on_every_rank(world_size):
    for message in run_distributed(body_load_failure, world_size):
        assert "ObjectLog.plain" in message and "rank 1 could not load rank 0's pickle" in message, message
        assert "LoadsOnRankZeroOnly" in message


def body_tensor_devices(rank, world_size):
    metric = ObjectLog()
    metric.update({"mask": torch.ones(2, 3, dtype=torch.bool), "rank": rank})
    got = metric.compute()["plain"]
    return [(item["rank"], item["mask"].dtype, tuple(item["mask"].shape), item["mask"].device.type) for item in got]


def test_tensors_inside_objects_come_back_as_tensors():
    for result in run_distributed(body_tensor_devices, 2):
        assert result == [(0, torch.bool, (2, 3), "cpu"), (1, torch.bool, (2, 3), "cpu")]


def test_tensor_only_lists_are_unchanged_by_the_object_path():
    metric = ObjectLog()
    metric.update(torch.arange(3))
    assert torch.equal(dim_zero_cat(metric.joined), torch.arange(3))


def body_tensors_on_one_rank_objects_on_another(rank, world_size, dst):
    per_rank = [[torch.arange(3.0), torch.ones(2, 2)], ["a", {"b": torch.tensor([1, 2])}], []][:world_size]
    metric = ObjectLog()
    for item in per_rank[rank]:
        metric.update(item)
    got = metric.compute() if dst is None else compute_on_rank(metric, dst)
    reference = ObjectLog(distributed_available_fn=lambda: False)
    for item in [item for items in per_rank for item in items]:
        reference.update(item)
    return {"got": got, "expected": reference.compute()}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dst", [None, 1])
def test_tensors_on_one_rank_and_objects_on_another(world_size, dst):
    # The records show the mix on every rank alike: every rank sends those states again, as objects
    for result in run_distributed(body_tensors_on_one_rank_objects_on_another, world_size, dst):
        _same(result["got"], result["expected"])


def test_object_benchmark_smoke():
    from benchmarks._bench_objects import body_objects

    # skewed on 2 ranks: 80 items on rank 0, none on rank 1; stock's way (MeanAveragePrecision's) drops them all
    for result in run_distributed(body_objects, 2, "rle", 20, True, 1):
        assert result["ours"]["items"] == result["all_gather_object"]["items"] == 80
        assert result["stock"]["items"] == 0


def body_gpu_check_scenario(rank, world_size):
    from benchmarks._gpu_common import Ctx
    from benchmarks._gpu_object_scenarios import _object_states

    return _object_states(Ctx("cpu", rank, world_size, torch.device("cpu"), None, None))


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gpu_check_object_scenario_on_cpu(world_size):
    for detail in run_distributed(body_gpu_check_scenario, world_size):
        assert "object list states" in detail


# ------------------------------------------------------- synced states save as stock's do (issue 45's finding)
def body_synced_states_save(rank, world_size):
    import io

    from torchmetrics.retrieval import RetrievalMAP

    metric = tv.rebase(RetrievalMAP)()
    metric.update(torch.rand(2 + rank), torch.arange(2 + rank) % 2, indexes=torch.tensor([rank] * (2 + rank)))
    with metric.sync_context():
        states = {"preds": metric.preds, "target": metric.target, "indexes": metric.indexes}
        torch.save(states, io.BytesIO())  # refused when the items viewed one buffer as several dtypes
        held = max(item.untyped_storage().nbytes() for items in states.values() for item in items)
        own = max(sum(item.nbytes for item in items) for items in states.values())
        saved = {name: [item.clone() for item in items] for name, items in states.items()}
    return saved, held <= own


@pytest.mark.parametrize("world_size", [2, 3])
def test_synced_list_states_save_and_hold_only_their_own_memory(world_size):
    results = run_distributed(body_synced_states_save, world_size)
    for saved, held in results:
        assert held  # no item keeps a larger receive buffer alive
        assert [len(items) for items in saved.values()] == [world_size] * 3  # one item per rank's update
        for name in saved:  # the same items on every rank
            for item, first in zip(saved[name], results[0][0][name], strict=True):
                assert torch.equal(item, first)
