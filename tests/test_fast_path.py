"""The one fast path, the plan cache: a repeated small sync sends what the long way sends, takes the learnt plan only
where every rank's exchanged headers and slots are the learnt ones, and hands off to the long way otherwise; exact
against stock torchmetrics on all the data, with host records and with device records (forced onto the CPU: CI has no
GPU), and whichever way each rank goes."""

import pytest
import torch
import torch.distributed as dist
from _helpers import count_collectives, fast_path_taken, forced_policy
from conftest import run_distributed
from torchmetrics.classification import BinaryAccuracy, MulticlassStatScores
from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, R2Score

from torchmetrics_varlen import MetricCollection, _engine, rebase
from torchmetrics_varlen._engine.group import REGISTRY

CASES = [
    (BinaryAccuracy, {}, lambda n, g: (torch.rand(n, generator=g), torch.randint(0, 2, (n,), generator=g))),
    (
        MulticlassStatScores,
        {"num_classes": 3, "average": None},
        lambda n, g: (torch.randint(0, 3, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)),
    ),
    (MeanSquaredError, {}, lambda n, g: (torch.rand(n, generator=g), torch.rand(n, generator=g))),
]


def _sent_rows(metric, syncs):
    """The rows ``metric``'s next ``syncs`` syncs sent in their record exchange."""
    from torchmetrics_varlen._engine import comm

    sent = []
    original = comm.gather_equal

    def recording(output, local, group, backend=""):
        sent.append(local.clone())
        return original(output, local, group, backend)

    comm.gather_equal = recording
    try:
        for _ in range(syncs):
            metric.sync()
            metric.unsync()
    finally:
        comm.gather_equal = original
    return sent


def body_same_bytes_and_stock(rank, world_size, device_records):
    """The fast path's rows are the long way's, word for word; every compute equals stock on all the data."""
    with forced_policy(device_records=device_records):
        metric = rebase(BinaryAccuracy)()
        metric.update(torch.rand(7 + rank), torch.randint(0, 2, (7 + rank,)))
        with fast_path_taken() as taken:
            fast = _sent_rows(metric, 3)
        REGISTRY.state(None).learnt.clear()  # forget what was learnt: the long way each time
        dist.barrier()
        with fast_path_taken() as untaken:
            long_way = _sent_rows(metric, 1)
        assert taken == [True, True], taken  # the first sync learnt, the next two took the fast path
        assert untaken == [], untaken
        assert all(torch.equal(row, long_way[0]) for row in fast), (fast, long_way)
        stock = BinaryAccuracy(sync_on_compute=False)
        torch.manual_seed(0)
        metric.reset()
        for other in range(world_size):
            preds, target = torch.rand(9 + other), torch.randint(0, 2, (9 + other,))
            stock.update(preds, target)
            if other == rank:
                metric.update(preds, target)
        for _ in range(3):  # learnt, then the fast path: stock on all the data each time
            metric._computed = None
            assert torch.equal(metric.compute(), stock.compute())


@pytest.mark.parametrize("device_records", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_fast_path_sends_the_long_ways_bytes_and_equals_stock(world_size, device_records):
    run_distributed(body_same_bytes_and_stock, world_size, device_records)


def body_one_rank_forgets(rank, world_size):
    """Rank 0 forgets what it learnt before every sync (the long way); the others take the fast path."""
    torch.manual_seed(1)
    data = [(torch.rand(5 + 2 * r), torch.randint(0, 2, (5 + 2 * r,))) for r in range(world_size)]
    metric, stock = rebase(BinaryAccuracy)(), BinaryAccuracy(sync_on_compute=False)
    taken, counts = [], []
    for _ in range(4):
        metric.update(*data[rank])
        for other in range(world_size):
            stock.update(*data[other])
        if rank == 0:
            REGISTRY.state(None).learnt.clear()
        with fast_path_taken() as this, count_collectives() as collectives:
            got = metric.compute()
        taken += this
        counts.append(sum(collectives.values()))
        assert torch.equal(got, stock.compute())
    return taken, counts


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_on_the_long_way_and_peers_on_the_fast_path_sync_together(world_size):
    # Whether a rank takes the fast path is its own business: both ways send the same bytes, so every rank issues
    # the same one collective, whichever way its peers go.
    for rank, (taken, counts) in enumerate(run_distributed(body_one_rank_forgets, world_size)):
        assert taken == ([] if rank == 0 else [True, True, True]), (rank, taken)
        assert counts == [1, 1, 1, 1], counts


def body_a_rank_changes_its_states(rank, world_size):
    """Per-step syncs while the last rank's state changes shape at step 2 and back at step 4."""
    ours = rebase(MulticlassStatScores)(num_classes=3, average=None)
    gen = torch.Generator().manual_seed(5 + rank)
    taken, values = [], []
    for step in range(6):
        ours.update(torch.randint(0, 3, (6,), generator=gen), torch.randint(0, 3, (6,), generator=gen))
        if rank == world_size - 1 and step in (2, 3):  # a state of another shape on one rank: the table differs
            ours.tp = ours.tp.reshape(1, 3)
        with fast_path_taken() as this:
            try:
                values.append(ours.compute().tolist())
            except Exception as err:  # the ranks' shapes cannot be stacked: raised alike on every rank
                values.append(type(err).__name__)
        if rank == world_size - 1 and step in (2, 3):
            ours.tp = ours.tp.reshape(3)
        taken.append(this)
    return taken, values


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_table_that_differs_hands_off_to_the_long_way_on_every_rank(world_size):
    results = run_distributed(body_a_rank_changes_its_states, world_size)
    for rank, (taken, values) in enumerate(results):
        assert taken[0] == [], taken  # the first sync learns
        assert taken[1] == [True], taken
        # Steps 2 and 3: the last rank's record differs. Its peers sent the learnt record and saw another table (the
        # long way from it); the last rank had not learnt this one: no fast path for it at step 2.
        if rank != world_size - 1:
            assert taken[2] == [False] and taken[3] == [False], taken
        assert values[2] == values[3] == "SyncMismatchError", values
        assert taken[5] == [True], taken  # the learnt table is back
        assert values[:2] == results[0][1][:2] and values[4:] == results[0][1][4:]  # every rank the same values


def body_device_record_longer_than_the_agreed_length(rank, world_size):
    """64 small per-step syncs shrink the agreed record length; then a collection whose device record is longer."""
    with forced_policy(device_records=True):
        step = rebase(BinaryAccuracy)()
        for _ in range(80):
            step.update(torch.rand(4), torch.randint(0, 2, (4,)))
            step.compute()
            step._computed = None
        words = REGISTRY.state(None).words
        gen = torch.Generator().manual_seed(3)
        preds, target = torch.rand(12, generator=gen), torch.rand(12, generator=gen)
        members = {"mse": MeanSquaredError(), "mae": MeanAbsoluteError(), "r2": R2Score()}
        ours = MetricCollection({name: rebase(type(metric))() for name, metric in members.items()})
        mine = slice(4 * rank, 4 * rank + 4)
        ours.update(preds[mine], target[mine])
        with count_collectives() as counts:
            got = ours.compute()
    expected = {name: metric(preds[: 4 * world_size], target[: 4 * world_size]) for name, metric in members.items()}
    return words, got, expected, sum(counts.values())


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_device_record_longer_than_the_agreed_length_is_exchanged_again(world_size):
    # Issue 43 item 6: the device path copied header and data into a buffer of the agreed length and raised on every
    # rank; now it sends what fits and exchanges again at the longest length, as the host path does.
    from torchmetrics_varlen._engine.group import INITIAL_WORDS

    for words, got, expected, collectives in run_distributed(
        body_device_record_longer_than_the_agreed_length, world_size
    ):
        assert words < INITIAL_WORDS  # the per-step syncs shrank it
        assert collectives == 2  # the records at the agreed length, then at the longest: the data rode in them
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6)


def body_not_learnt(rank, world_size):
    """Syncs that must not be learnt: a differentiable one, a `mean` state, a list state."""
    from torchmetrics.aggregation import CatMetric

    from torchmetrics_varlen import SoftF1Loss

    learnt = []
    loss = SoftF1Loss(dist_sync_on_step=True)
    for _ in range(2):
        probs = torch.rand(3, requires_grad=True)
        loss(probs, torch.ones(3)).backward()
    learnt.append(len(REGISTRY.state(None).learnt))
    cat = rebase(CatMetric)()
    for _ in range(3):
        cat.update(torch.rand(2))
        cat.compute()
        cat._computed = None
    learnt.append(len(REGISTRY.state(None).learnt))
    return learnt


def test_differentiable_and_list_syncs_are_not_learnt():
    for learnt in run_distributed(body_not_learnt, 2):
        assert learnt == [0, 0]


def body_cases(rank, world_size):
    taken = []
    for cls, kwargs, data in CASES:
        ours, stock = rebase(cls)(**kwargs), cls(**kwargs, sync_on_compute=False)
        for step in range(3):
            inputs = [data(4 + 3 * r + step, torch.Generator().manual_seed(10 * r + step)) for r in range(world_size)]
            ours.update(*inputs[rank])
            for other in range(world_size):
                stock.update(*inputs[other])
            with fast_path_taken() as this:
                got = ours.compute()
            ours._computed = None
            taken += this
            expected = stock.compute()
            assert got.dtype == expected.dtype and got.shape == expected.shape, (cls, got, expected)
            assert torch.allclose(got, expected, rtol=0, atol=1e-6), (cls, step, got, expected)
            with ours.sync_context():  # the synced states themselves are stock's: dtypes, shapes, values
                for name in ours._defaults:
                    mine, theirs = getattr(ours, name), getattr(stock, name)
                    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (cls, name)
                    if not mine.is_floating_point():
                        assert torch.equal(mine, theirs), (cls, name, mine, theirs)
    return taken


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_small_syncs_take_the_fast_path_and_equal_stock(world_size):
    for taken in run_distributed(body_cases, world_size):
        assert taken and all(taken), taken


def test_the_learnt_entries_are_bounded():
    assert _engine.LEARNT_KEPT <= 64
