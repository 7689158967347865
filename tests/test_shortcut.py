"""A repeated small sync of the same metric, learnt (``_shortcut``): exact against single-process references, the
record it sends is the long way's, a change on any rank sends every rank the long way, and it is learnt only where
safe."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torchmetrics import Metric as StockMetric
from torchmetrics.classification import BinaryAccuracy, MulticlassStatScores
from torchmetrics.regression import MeanSquaredError

from tests._meters import CollectiveCounter
from torchmetrics_varlen import Metric, _cap, _policy, _protocol, _shortcut, _state_sync, _transport, rebase

STEPS = 7
CHANGED = (3, 4)  # steps at which the last rank syncs with another transfer cap in its environment
LONG_WAY = (0, CHANGED[0], CHANGED[-1] + 1)  # the steps whose headers differ from the previous step's


def _counts_update(self, step, rank):
    self.hits += torch.arange(3) * (rank + 1) + step
    self.n += torch.tensor(rank + step, dtype=torch.int32)
    self.err += torch.tensor(0.25 * (rank + 1) * step)
    self.top = torch.maximum(self.top, torch.tensor(step * (rank + 2) % 5))
    self.low = torch.minimum(self.low, torch.tensor([-rank - step, rank], dtype=torch.int16))


def _counts_states(self):
    self.add_state("hits", torch.zeros(3, dtype=torch.int64), "sum")
    self.add_state("n", torch.tensor(0, dtype=torch.int32), "sum")
    self.add_state("err", torch.tensor(0.0), "sum")
    self.add_state("top", torch.tensor(-5), "max")
    self.add_state("low", torch.zeros(2, dtype=torch.int16), "min")


class Counts(Metric):
    """Integer sums of several dtypes and shapes (one sum each), a float sum, a max and a min."""

    def __init__(self):
        super().__init__()
        _counts_states(self)

    update = _counts_update

    def compute(self):
        return self.hits, self.n, self.err, self.top, self.low


class StockCounts(StockMetric):
    """The same metric on stock torchmetrics: the single-process reference (it never syncs)."""

    def __init__(self):
        super().__init__(sync_on_compute=False)
        _counts_states(self)

    update = _counts_update

    def compute(self):
        return self.hits, self.n, self.err, self.top, self.low


def _counting_shortcuts():
    """Counts the syncs the shortcut finished (the list's length): its runs that returned the synced states."""
    taken = []
    original = _shortcut.Shortcut.run

    def counted(self, *args):
        result = original(self, *args)
        if isinstance(result, list):
            taken.append(1)
        return result

    _shortcut.Shortcut.run = counted
    return taken, original


def _steps_body(rank, world_size):
    taken, original = _counting_shortcuts()
    metric = Counts()
    try:
        for step in range(STEPS):
            metric.update(step, rank)
            if rank == world_size - 1 and step in CHANGED:
                os.environ["TORCHMETRICS_VARLEN_SYNC_CAP"] = "64MiB"
            before = len(taken)
            try:
                synced = metric.compute()
            finally:
                os.environ.pop("TORCHMETRICS_VARLEN_SYNC_CAP", None)
            metric._computed = None
            reference = StockCounts()
            for past in range(step + 1):
                for other in range(world_size):
                    reference.update(past, other)
            for got, expected, reduction in zip(synced, reference.compute(), reference._reductions.values()):
                # The dtype of stock's sync: its reduction of the stacked states (an int32 sum comes back int64).
                assert got.dtype == reduction(torch.stack([expected, expected])).dtype, (step, got, expected)
                assert got.shape == expected.shape and torch.equal(got, expected.to(got.dtype)), (step, got, expected)
            # The first sync learns and the later ones take the shortcut, except where a rank's header changed (the
            # last rank's cap, at the first changed step and at the step after the last): every rank then goes the
            # long way from the same table, and learns that sync for the next.
            assert (len(taken) > before) == (step not in LONG_WAY), (step, rank)
    finally:
        _shortcut.Shortcut.run = original
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_syncs_take_the_shortcut_and_are_exact(world_size):
    run_distributed(_steps_body, world_size)


def _stock_metrics_body(rank, world_size):
    taken, original = _counting_shortcuts()
    torch.manual_seed(7)
    data = [(torch.rand(5 + 3 * r), torch.randint(0, 2, (5 + 3 * r,))) for r in range(world_size)]
    classes = [(torch.randint(0, 4, (6 + r,)), torch.randint(0, 4, (6 + r,))) for r in range(world_size)]
    try:
        cases = [
            (BinaryAccuracy, {}, data),
            (MulticlassStatScores, {"num_classes": 4, "average": None}, classes),
            (MeanSquaredError, {}, data),
        ]
        for cls, kwargs, inputs in cases:
            ours, stock = rebase(cls)(**kwargs), cls(**kwargs, sync_on_compute=False)  # stock: all the data here
            for step in range(3):
                ours.update(*inputs[rank])
                for other in range(world_size):
                    stock.update(*inputs[other])
                got, expected = ours.compute(), stock.compute()
                ours._computed = None
                assert type(got) is type(expected) and got.dtype == expected.dtype, (cls, got, expected)
                assert torch.allclose(got, expected, rtol=0, atol=1e-6), (cls, step, got, expected)
                # The synced states themselves are stock's: same dtypes, shapes and values.
                with ours.sync_context():
                    for name in ours._defaults:
                        mine, theirs = getattr(ours, name), getattr(stock, name)
                        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (cls, name)
                        if not mine.is_floating_point():
                            assert torch.equal(mine, theirs), (cls, name, mine, theirs)
        assert len(taken) >= 3 * 3, taken  # every case's later syncs took it (its second, third and sync_context)
    finally:
        _shortcut.Shortcut.run = original
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_stock_metrics_on_the_shortcut_equal_stock_on_all_the_data(world_size):
    run_distributed(_stock_metrics_body, world_size)


def _record_body(rank, world_size):
    """What the shortcut sends is the record ``describe`` makes of the same states (the long way's)."""
    sent = []
    original = _transport.exchange_prepared

    def capture(send, *args, **kwargs):
        sent.append(send.clone())
        return original(send, *args, **kwargs)

    metric = Counts()
    kept = []  # every sync's synced states, as a metric whose compute returns a state would keep them
    _transport.exchange_prepared = capture
    try:
        for step in range(3):
            metric.update(step, rank)
            metric.sync()
            states = {name: getattr(metric, name) for name in metric._defaults}
            kept.append((states, {name: value.clone() for name, value in states.items()}))
            metric.unsync()
    finally:
        _transport.exchange_prepared = original
    assert len(sent) == 2, len(sent)  # the first sync learnt
    for states, copies in kept:  # later syncs made fresh tensors: the kept ones did not change
        for name, value in states.items():
            assert torch.equal(value, copies[name]), (name, value, copies[name])
    assert len({id(value) for states, _ in kept for value in states.values()}) == sum(len(s) for s, _ in kept)
    layout = _state_sync.sync_layout([metric], "compute")
    policy = _policy.policy_for(None, torch.device("cpu"), torch.device("cpu"))
    flags = _protocol.REDUCE_FLAGS[policy.reduce]
    expected = _protocol.describe(
        layout.entries, layout.context, "Counts.compute", flags, layout.aux, True, _cap.DEFAULT_CAP
    )
    assert sent[-1][: len(expected)].tolist() == expected
    assert not sent[-1][len(expected) :].any()  # zeros up to the group's agreed length
    dist.barrier()


@pytest.mark.parametrize("world_size", [2])
def test_the_shortcut_sends_the_record_describe_makes(world_size):
    run_distributed(_record_body, world_size)


class WithMean(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("total", torch.tensor(0), "sum")
        self.add_state("avg", torch.tensor(0.0), "mean")

    def update(self, value):
        self.total += 1
        self.avg += value

    def compute(self):
        return self.total


class WithCat(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("total", torch.tensor(0), "sum")
        self.add_state("seen", torch.zeros(2), "cat")

    def update(self, value):
        self.total += 1

    def compute(self):
        return self.total


def _not_learnt_body(rank, world_size):
    """Not learnt where the kept table or the record would change the outcome: `mean`, `cat`, a graph."""
    graph = Counts()
    graph.err = torch.tensor(1.0, requires_grad=True)
    for metric in (WithMean(), WithCat(), graph):
        if not isinstance(metric, Counts):
            metric.update(1.0)
        for _ in range(2):
            metric.sync()
            metric.unsync()
        label = f"{type(metric).__name__}.compute"
        assert _shortcut.lookup([metric], label) is None, type(metric).__name__
    learnt = Counts()
    for _ in range(2):
        learnt.sync()
        learnt.unsync()
    assert _shortcut.lookup([learnt], "Counts.compute") is not None
    dist.barrier()


@pytest.mark.parametrize("world_size", [2])
def test_the_shortcut_is_learnt_only_where_safe(world_size):
    run_distributed(_not_learnt_body, world_size)


def test_settings_read_the_environment_where_os_environ_writes(monkeypatch):
    # The learnt sync compares the raw environment values it read when it learnt; setting or deleting through
    # `os.environ` must change what it reads, and a rebound `os.environ` is read through its `get`.
    monkeypatch.delenv(_cap.SYNC_CAP_ENV, raising=False)
    unset = _shortcut._settings([{"sync_cap": None}], None)
    monkeypatch.setenv(_cap.SYNC_CAP_ENV, "1MiB")
    set_ = _shortcut._settings([{"sync_cap": None}], None)
    assert unset[-1] is None and set_[-1] is not None and set_ != unset
    assert _shortcut._settings([{"sync_cap": 5}, {"sync_cap": 3}], None)[0] == 3
    assert _shortcut._settings([{"sync_cap": 5}], 7)[0] == 7  # a collection's cap replaces the metrics'
    monkeypatch.setattr(os, "environ", {_cap.SYNC_CAP_ENV: "2MiB"})
    assert _shortcut._settings([{"sync_cap": None}], None)[-1] == "2MiB"


def _counted_body(rank, world_size):
    """The demo's and the benchmark's collective counter counts a learnt sync's one exchange."""
    taken, original = _counting_shortcuts()
    metric = rebase(BinaryAccuracy)()
    metric.update(torch.rand(4 + rank), torch.randint(0, 2, (4 + rank,)))
    counts = []
    try:
        for _ in range(3):
            with CollectiveCounter() as counter:
                metric.sync()
                metric.unsync()
            counts.append(counter.count)
    finally:
        _shortcut.Shortcut.run = original
    assert len(taken) == 2 and counts == [1, 1, 1], (taken, counts)  # the first sync learnt, the others took it
    assert _transport.gather_direct.__name__ == "gather_direct"  # put back
    dist.barrier()


@pytest.mark.parametrize("world_size", [2])
def test_the_collective_counter_counts_the_learnt_exchange(world_size):
    run_distributed(_counted_body, world_size)


class CountsApplied(Counts):
    """Counts whose `_apply_synced` is overridden: its syncs must run it, so they take the usual way."""

    def __init__(self):
        super().__init__()
        self.applied = 0

    def _apply_synced(self, states):
        self.applied += 1
        super()._apply_synced(states)


def _reference_counts(steps, world_size):
    reference = StockCounts()
    for step in range(steps):
        for other in range(world_size):
            reference.update(step, other)
    return reference.compute()


def _assert_counts(got, expected, where):
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs.to(mine.dtype)), (where, mine, theirs)


def _direct_body(rank, world_size):
    """`sync()` and `compute()` go from `Metric.sync` straight to the learnt sync, except where a setting or an
    override asks for the usual way; every result equals one process on all the data."""
    from torchmetrics_varlen import metric as metric_module

    taken, original = _counting_shortcuts()
    usual = []
    original_sync_states = metric_module.sync_states

    def counted_sync_states(*args, **kwargs):
        usual.append(1)
        return original_sync_states(*args, **kwargs)

    metric_module.sync_states = counted_sync_states
    try:
        metric, applied = Counts(), CountsApplied()
        for step in range(4):
            for each in (metric, applied):
                each.update(step, rank)
            expected = _reference_counts(step + 1, world_size)
            before, usual_before = len(taken), len(usual)
            _assert_counts(metric.compute(), expected, ("compute", step))
            metric._computed = None
            with metric.sync_context():
                _assert_counts(metric.compute(), expected, ("sync", step))
            metric._computed = None
            # The first sync learns (the usual way); every later one bypasses `sync_states`
            assert (len(taken) - before, len(usual) - usual_before) == ((1, 1) if step == 0 else (2, 0)), step
            usual_before = len(usual)
            _assert_counts(applied.compute(), expected, ("override", step))
            applied._computed = None
            assert applied.applied == step + 1 and len(usual) == usual_before + 1, step  # the override ran
        # Given a group, or an availability check, `sync` takes the usual way: it honours them
        metric.sync(process_group=dist.group.WORLD)
        _assert_counts(metric.compute(), expected, "group given")
        metric.unsync()
        usual_before = len(usual)
        metric._computed = None
        metric.sync(distributed_available=lambda: False)
        assert not metric._is_synced and len(usual) == usual_before
        metric.distributed_available_fn = lambda: False
        local = StockCounts()  # this rank's data alone
        for step in range(4):
            local.update(step, rank)
        _assert_counts(metric.compute(), local.compute(), "not available")
        assert not metric._is_synced and len(usual) == usual_before
    finally:
        _shortcut.Shortcut.run = original
        metric_module.sync_states = original_sync_states
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_goes_straight_to_the_learnt_sync_unless_told_otherwise(world_size):
    run_distributed(_direct_body, world_size)
