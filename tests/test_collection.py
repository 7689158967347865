"""`torchmetrics_varlen.MetricCollection`: one shot for all members, equal to one process, compute groups once."""

import pytest
import torch
from _helpers import assert_same, count_collectives, split
from conftest import run_distributed
from torchmetrics import MetricCollection as StockCollection
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassF1Score,
    MulticlassPrecision,
    MulticlassRecall,
)

from benchmarks.bench import (
    eight_metric_members,  # the benchmark's 8-metric case: what it times is checked
)
from torchmetrics_varlen import MetricCollection

SIZES = {"uneven": [70, 30, 55], "one_empty": [40, 0, 25], "first_empty": [0, 33, 20]}


def _update(collection, preds, target):
    for name, metric in collection.items(keep_base=True, copy_state=False):
        if name in ("mse", "mae", "pearson"):
            metric.update(preds[:, 0], target.float() / 4)
        else:
            metric.update(preds, target)


def body_eight_metrics(rank, world_size, scenario, compute_groups):
    sizes = SIZES[scenario][:world_size] if world_size > 1 else [50]
    gen = torch.Generator().manual_seed(21)
    preds = torch.softmax(torch.randn(sum(sizes), 5, generator=gen), -1)
    target = torch.randint(0, 5, (sum(sizes),), generator=gen)
    ours = MetricCollection(eight_metric_members(), compute_groups=compute_groups)
    mine = split(sizes, rank)
    for start in range(mine.start, mine.stop, 16):
        stop = min(start + 16, mine.stop)
        _update(ours, preds[start:stop], target[start:stop])
    with count_collectives() as counts:
        got = ours.compute()
    with count_collectives() as cached_counts:
        again = ours.compute()
    reference = StockCollection({k: m.__class__(**_kwargs(m)) for k, m in eight_metric_members().items()})
    for metric in reference.values(copy_state=False):
        metric.sync_on_compute = False
        metric._to_sync = False
    _update(reference, preds, target)
    return {
        "got": got,
        "again": again,
        "expected": reference.compute(),
        "calls": sum(counts.values()),
        "cached_calls": sum(cached_counts.values()),
        "groups": {k: sorted(v) for k, v in ours.compute_groups.items()},
    }


def _kwargs(metric):
    if isinstance(metric, MulticlassAUROC):
        return {"num_classes": 5, "thresholds": None}
    if hasattr(metric, "num_classes"):
        return {"num_classes": 5}
    return {}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scenario", sorted(SIZES))
@pytest.mark.parametrize("compute_groups", [True, False])
def test_eight_metric_collection_equals_single_process(world_size, scenario, compute_groups):
    for result in run_distributed(body_eight_metrics, world_size, scenario, compute_groups):
        assert_same(result["got"], result["expected"])
        assert_same(result["again"], result["expected"])
        assert result["calls"] == (0 if world_size == 1 else 2)
        # Every rank says every member's cache is valid: the records are all that move (issue 43 item 1).
        assert result["cached_calls"] == (0 if world_size == 1 else 1)


def body_compute_group_moves_once(rank, world_size):
    members = [MulticlassAccuracy(5), MulticlassPrecision(5), MulticlassRecall(5)]
    collection = MetricCollection(members)
    gen = torch.Generator().manual_seed(rank)
    collection.update(torch.randn(8 + rank, 5, generator=gen), torch.randint(0, 5, (8 + rank,), generator=gen))
    sent = []
    import torchmetrics_varlen._engine.pack as pack
    import torchmetrics_varlen._engine.record as record

    original = pack.pack

    def spy(entries, plan, rank_, buffer):
        sent.append(sum(1 for e in entries if not isinstance(e, record.Ref)))
        return original(entries, plan, rank_, buffer)

    pack.pack = spy
    try:
        collection.compute()
    finally:
        pack.pack = original
    states_per_member = len(members[0]._defaults)
    return {"sent": sent, "states": states_per_member, "groups": len(collection.compute_groups)}


def test_compute_group_state_is_sent_once():
    for result in run_distributed(body_compute_group_moves_once, 2):
        assert result["groups"] == 1
        assert result["sent"] == [result["states"]]  # one member's states, not three


def _classification():
    return {
        "acc": MulticlassAccuracy(num_classes=5),
        "prec": MulticlassPrecision(num_classes=5),
        "rec": MulticlassRecall(num_classes=5),
        "f1": MulticlassF1Score(num_classes=5, average="weighted"),
    }


def body_groups_with_empty_rank(rank, world_size, scenario):
    """Compute groups form from local data: ranks with data merge them, an empty rank does not. Still exact."""
    sizes = SIZES[scenario][:world_size]
    gen = torch.Generator().manual_seed(8)
    preds = torch.randn(sum(sizes), 5, generator=gen)
    target = torch.randint(0, 5, (sum(sizes),), generator=gen)
    ours = MetricCollection(_classification())
    mine = split(sizes, rank)
    for start in range(mine.start, mine.stop, 16):
        ours.update(preds[start : min(start + 16, mine.stop)], target[start : min(start + 16, mine.stop)])
    with count_collectives() as counts:
        got = ours.compute()
    reference = StockCollection(_classification())
    reference.update(preds, target)
    expected = reference.compute()
    return {"got": got, "expected": expected, "calls": sum(counts.values()), "groups": len(ours.compute_groups)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("scenario", sorted(SIZES))
def test_compute_groups_formed_on_some_ranks_only(world_size, scenario):
    results = run_distributed(body_groups_with_empty_rank, world_size, scenario)
    for result in results:
        assert_same(result["got"], result["expected"])
        assert result["calls"] == 2
    group_counts = {result["groups"] for result in results}
    if scenario != "uneven":
        assert len(group_counts) == 2  # the layouts really differed between ranks


def body_members_computed_one_by_one(rank, world_size, scenario):
    """As Lightning's `log_dict(collection)` does at epoch end: each member's own compute(), member after member."""
    sizes = SIZES[scenario][:world_size]
    gen = torch.Generator().manual_seed(5)
    preds = torch.softmax(torch.randn(sum(sizes), 5, generator=gen), -1)
    target = torch.randint(0, 5, (sum(sizes),), generator=gen)
    ours = MetricCollection(eight_metric_members())
    mine = split(sizes, rank)
    if sizes[rank]:  # an empty rank updates nothing (a batch of none does not reshape)
        _update(ours, preds[mine], target[mine])
    members = dict(ours.items(keep_base=False, copy_state=False))  # what Lightning's log_dict iterates
    with count_collectives() as counts:
        got = {name: metric.compute() for name, metric in members.items()}
    # After a reset (Lightning's at epoch end) and new updates, the next member compute syncs once again.
    ours.reset()
    if sizes[rank]:
        _update(ours, preds[mine], target[mine])
    with count_collectives() as again_counts:
        again = {name: metric.compute() for name, metric in members.items()}
    # A deep copy (Lightning's checkpointing, `clone()`) keeps the one-shot member compute.
    copy = ours.clone()
    copy.reset()
    if sizes[rank]:
        _update(copy, preds[mine], target[mine])
    with count_collectives() as copy_counts:
        copied = {name: metric.compute() for name, metric in copy.items(keep_base=False, copy_state=False)}
    reference = StockCollection({k: m.__class__(**_kwargs(m)) for k, m in eight_metric_members().items()})
    for metric in reference.values(copy_state=False):
        metric.sync_on_compute = False
        metric._to_sync = False
    _update(reference, preds, target)
    expected = reference.compute()
    return {
        "got": got,
        "again": again,
        "copied": copied,
        "expected": expected,
        "calls": [sum(counts.values()), sum(again_counts.values()), sum(copy_counts.values())],
    }


@pytest.mark.parametrize("scenario", ["uneven", "one_empty"])
def test_members_computed_one_by_one_sync_the_collection_once(scenario):
    # The first member's compute syncs the collection (metadata + data: 2 collectives); each later one finds every
    # rank's caches valid, so only the records move (1 each). Without the one-shot: 8 syncs of 2 collectives.
    for result in run_distributed(body_members_computed_one_by_one, 3, scenario):
        assert_same(result["got"], result["expected"])
        assert_same(result["copied"], result["expected"])
        assert_same(result["again"], result["expected"])
        assert result["calls"] == [2 + 7] * 3, result["calls"]


def body_one_member_of_a_partly_used_collection(rank, world_size):
    """Only one member is updated and computed: the never-updated one (AUROC of nothing raises) must not break it."""
    from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

    gen = torch.Generator().manual_seed(3)
    scores, target = torch.rand(9, generator=gen), torch.randint(0, 2, (9,), generator=gen)
    ours = MetricCollection({"acc": BinaryAccuracy(), "auroc": BinaryAUROC(thresholds=None)})
    mine = split([6, 3], rank)
    ours["acc"].update(scores[mine], target[mine])
    return {"acc": ours["acc"].compute(), "expected": BinaryAccuracy()(scores, target)}


def test_one_member_computed_while_another_was_never_updated():
    for result in run_distributed(body_one_member_of_a_partly_used_collection, 2):
        assert_same(result["acc"], result["expected"])
