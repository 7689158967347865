"""`torchmetrics_varlen.Metric`: one-shot sync, exact on uneven/empty ranks, no double sync."""

import pytest
import torch
from _helpers import assert_same, count_collectives, outcome, quiet_compute, split
from conftest import run_distributed
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import BinaryAUROC, MulticlassAUROC
from torchmetrics.regression import MeanSquaredError
from torchmetrics.utilities import dim_zero_cat

from torchmetrics_varlen import Metric, SyncMismatchError, rebase


def product_reduce(stacked):
    return stacked.prod(dim=0)


class MixedStates(Metric):
    """States of every kind: tensor sum/max/min/custom, 2-D float cat list, int64 cat list, None-reduction list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("largest", default=torch.tensor(float("-inf")), dist_reduce_fx="max")
        self.add_state("smallest", default=torch.tensor(float("inf")), dist_reduce_fx="min")
        self.add_state("scale", default=torch.ones(2, dtype=torch.float64), dist_reduce_fx=product_reduce)
        self.add_state("rows", default=[], dist_reduce_fx="cat")
        self.add_state("ids", default=[], dist_reduce_fx="cat")
        self.add_state("chunks", default=[], dist_reduce_fx=None)

    def update(self, rows, ids):
        self.total += ids.numel()
        if rows.numel():
            self.largest = torch.maximum(self.largest, rows.max())
            self.smallest = torch.minimum(self.smallest, rows.min())
        self.scale = self.scale * 1.5
        self.rows.append(rows)
        self.ids.append(ids)
        self.chunks.append(rows.sum(dim=1, keepdim=True).T)  # shape (1, n): differs per update

    def compute(self):
        rows = dim_zero_cat(self.rows) if len(self.rows) else torch.empty(0, 3)
        ids = dim_zero_cat(self.ids) if len(self.ids) else torch.empty(0, dtype=torch.int64)
        return {
            "total": self.total,
            "largest": self.largest,
            "smallest": self.smallest,
            "rows": rows,
            "ids": ids,
            "chunks": torch.cat([c.reshape(-1) for c in self.chunks]) if self.chunks else torch.empty(0),
        }


SIZES = {
    "uneven": [7, 3, 5],
    "one_empty": [6, 0, 4],
    "first_empty": [0, 4, 2],
    "all_empty": [0, 0, 0],
}


def _mixed_data(n):
    gen = torch.Generator().manual_seed(11)
    return torch.randn(n, 3, generator=gen), torch.randint(-(10**15), 10**15, (n,), generator=gen)


def body_mixed_states(rank, world_size, scenario, batch=2):
    sizes = SIZES[scenario][:world_size]
    rows, ids = _mixed_data(sum(sizes))
    metric = MixedStates()
    mine = split(sizes, rank)
    for start in range(mine.start, mine.stop, batch):
        stop = min(start + batch, mine.stop)
        metric.update(rows[start:stop], ids[start:stop])
    with count_collectives() as counts:
        got = quiet_compute(metric)
    # One process, same batches in rank order (the `scale` state multiplies once per update on each rank).
    reference = MixedStates(sync_on_compute=False)
    for r in range(world_size):
        part = split(sizes, r)
        for start in range(part.start, part.stop, batch):
            stop = min(start + batch, part.stop)
            reference.update(rows[start:stop], ids[start:stop])
    expected = quiet_compute(reference)
    return {"got": got, "expected": expected, "counts": dict(counts)}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scenario", sorted(SIZES))
def test_mixed_states_equal_single_process(world_size, scenario):
    for result in run_distributed(body_mixed_states, world_size, scenario):
        assert_same(result["got"], result["expected"], exact=True)
        assert sum(result["counts"].values()) == (0 if world_size == 1 else 2)
        assert result["counts"].get("barrier", 0) == 0


STOCK = {
    "BinaryAUROC": (lambda **kw: rebase(BinaryAUROC)(thresholds=None, **kw), 1),
    "MulticlassAUROC": (lambda **kw: rebase(MulticlassAUROC)(num_classes=3, thresholds=None, **kw), 3),
    "MeanSquaredError": (lambda **kw: rebase(MeanSquaredError)(**kw), 0),
}
PLAIN_STOCK = {
    "BinaryAUROC": lambda: BinaryAUROC(thresholds=None),
    "MulticlassAUROC": lambda: MulticlassAUROC(num_classes=3, thresholds=None),
    "MeanSquaredError": MeanSquaredError,
}


def _stock_data(name, n):
    gen = torch.Generator().manual_seed(5)
    classes = STOCK[name][1]
    if classes == 1:
        return torch.rand(n, generator=gen), torch.randint(0, 2, (n,), generator=gen)
    if classes == 3:
        return torch.softmax(torch.randn(n, 3, generator=gen), -1), torch.randint(0, 3, (n,), generator=gen)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def body_rebased_stock(rank, world_size, name, scenario):
    sizes = SIZES[scenario][:world_size]
    factory = STOCK[name][0]
    preds, target = _stock_data(name, sum(sizes))
    metric = factory()
    mine = split(sizes, rank)
    for start in range(mine.start, mine.stop, 4):
        stop = min(start + 4, mine.stop)
        metric.update(preds[start:stop], target[start:stop])
    got = outcome(metric.compute)
    if not sum(sizes) and world_size > 1:
        # No rank has data: stock's own sync turns each empty `cat` list into `tensor([])` (one process keeps `[]`
        # and raises elsewhere), so the reference is stock itself on the same ranks.
        return {"got": got, "expected": outcome(PLAIN_STOCK[name]().compute)}
    reference = factory(sync_on_compute=False)
    if sum(sizes):
        reference.update(preds, target)
    return {"got": got, "expected": outcome(reference.compute)}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scenario", sorted(SIZES))
@pytest.mark.parametrize("name", sorted(STOCK))
def test_rebased_stock_metric_equals_single_process(world_size, scenario, name):
    for result in run_distributed(body_rebased_stock, world_size, name, scenario):
        assert_same(result["got"], result["expected"])


class SumOfSquares(Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, x):
        self.total += (x.double() ** 2).sum()
        self.count += x.numel()

    def compute(self):
        return self.total


def body_no_double_sync(rank, world_size):
    metric = SumOfSquares()
    metric.update(torch.full((rank + 1,), 2.0))
    expected_global = torch.tensor(4.0 * sum(r + 1 for r in range(world_size)), dtype=torch.float64)
    local_total = metric.total.clone()
    report = {}
    with count_collectives() as counts:
        metric.sync()
        report["after_sync"] = sum(counts.values())
        report["synced_total"] = metric.total.clone()
        metric.sync()  # a second sync is a no-op
        report["after_second_sync"] = sum(counts.values())
        report["compute_while_synced"] = metric.compute()
        report["after_compute"] = sum(counts.values())
        report["still_synced"] = metric._is_synced
        metric.unsync()
        report["restored_total"] = metric.total.clone()
        report["compute_after_unsync"] = metric.compute()  # cached everywhere: metadata only
        report["after_cached_compute"] = sum(counts.values())
    # sync_context restores local states even when its body raises.
    try:
        with metric.sync_context():
            raise ValueError("boom")
    except ValueError:
        pass
    report["after_failed_context_synced"] = metric._is_synced
    report["after_failed_context_total"] = metric.total.clone()
    report.update(local_total=local_total, expected_global=expected_global)
    return report


@pytest.mark.parametrize("world_size", [2, 3])
def test_manual_sync_holds_and_never_doubles(world_size):
    for r in run_distributed(body_no_double_sync, world_size):
        # Two small dense states ride in the records: one collective per sync.
        assert r["after_sync"] == 1
        assert r["after_second_sync"] == 1
        assert r["after_compute"] == 1
        assert r["still_synced"] is True
        torch.testing.assert_close(r["synced_total"], r["expected_global"])
        torch.testing.assert_close(r["compute_while_synced"], r["expected_global"])
        torch.testing.assert_close(r["restored_total"], r["local_total"])
        torch.testing.assert_close(r["compute_after_unsync"], r["expected_global"])
        # Every rank says its cache is valid: the records are all that move (stock: none; issue 43 item 1).
        assert r["after_cached_compute"] == 2
        assert r["after_failed_context_synced"] is False
        torch.testing.assert_close(r["after_failed_context_total"], r["local_total"])


ROUNDS = [  # per rank, what it adds before each compute(); None: no batch that round (issue 43 item 1's example)
    [1, 2, 4, 8, 16, 32, None],
    [10, None, 40, None, None, 320, None],
    [None, 5, None, 7, None, 9, None],
]


def body_running_metric_with_empty_rounds(rank, world_size):
    metric = rebase(SumMetric)(sync_timeout=20)
    got, calls = [], []
    for value in ROUNDS[rank]:
        if value is not None:
            metric.update(torch.tensor(float(value)))
        with count_collectives() as counts:
            got.append(metric.compute().item())
        calls.append(sum(counts.values()))
    return got, calls


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_without_a_batch_still_gets_the_value_of_the_round(world_size):
    # Before: a rank without a batch returned its cached value without syncing, so its peers' sync paired with its
    # next round: 11, 53 (truth 13) on one rank, 11, 11, 53 on the other, then a timeout. Now every rank takes part
    # in every round; where no rank updated anything, only the records move.
    added = [sum(ROUNDS[r][k] or 0 for r in range(world_size)) for k in range(len(ROUNDS[0]))]
    truth = [float(sum(added[: k + 1])) for k in range(len(added))]
    for got, calls in run_distributed(body_running_metric_with_empty_rounds, world_size, deadline=60):
        assert got == truth
        assert calls == [1] * len(truth)  # one small state: the records carry it, or say every cache is valid


class GlobalBatchMean(Metric):
    full_state_update = True

    def __init__(self, **kwargs):
        super().__init__(dist_sync_on_step=True, **kwargs)
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.values.append(x)

    def compute(self):
        return dim_zero_cat(self.values).mean() if len(self.values) else torch.tensor(float("nan"), dtype=torch.float64)


class GlobalBatchMeanReduceState(GlobalBatchMean):
    full_state_update = False


BATCH_MEANS = {True: GlobalBatchMean, False: GlobalBatchMeanReduceState}


def body_step_sync(rank, world_size, full_state_update):
    gen = torch.Generator().manual_seed(3)
    steps = 4
    # Per step, per rank batch sizes (uneven, sometimes empty).
    batch_sizes = [[(step + 2 * r) % 4 for r in range(world_size)] for step in range(steps)]
    batches = [[torch.randn(n, generator=gen, dtype=torch.float64) for n in row] for row in batch_sizes]
    metric = BATCH_MEANS[full_state_update]()
    step_values, step_expected = [], []
    for step in range(steps):
        step_values.append(metric(batches[step][rank]))
        everything = torch.cat(batches[step])
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        step_expected.append(everything.mean() if everything.numel() else nan)
    epoch = metric.compute()
    epoch_expected = torch.cat([torch.cat(b) for b in batches]).mean()
    local_items = sum(x.numel() for x in metric.values)
    return {
        "steps": step_values,
        "steps_expected": step_expected,
        "epoch": epoch,
        "epoch_expected": epoch_expected,
        "local_items": local_items,
        "local_expected": sum(batch_sizes[s][rank] for s in range(steps)),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("full_state_update", [True, False])
def test_step_sync_never_leaks_into_local_state(world_size, full_state_update):
    for r in run_distributed(body_step_sync, world_size, full_state_update):
        for got, expected in zip(r["steps"], r["steps_expected"]):
            torch.testing.assert_close(got, expected, equal_nan=True)
        torch.testing.assert_close(r["epoch"], r["epoch_expected"])
        assert r["local_items"] == r["local_expected"]


def body_phase_mismatch(rank, world_size):
    metric = GlobalBatchMean(sync_timeout=20)
    metric.update(torch.ones(2, dtype=torch.float64))
    try:
        if rank == 0:
            metric(torch.ones(1, dtype=torch.float64))  # a per-step sync
        else:
            metric.compute()  # an epoch compute
    except SyncMismatchError as err:
        message = str(err)
    else:
        message = None
    # The group is still usable: a matching sync afterwards works on every rank.
    after = SumOfSquares()
    after.update(torch.ones(1))
    return {"message": message, "after": after.compute().item()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_step_vs_epoch_mismatch_raises_on_every_rank(world_size):
    results = run_distributed(body_phase_mismatch, world_size, deadline=60)
    for r in results:
        assert r["message"] is not None
        assert "GlobalBatchMean.step" in r["message"] and "GlobalBatchMean.compute" in r["message"]
        assert r["after"] == world_size


def test_rebased_metric_unpickles_in_a_fresh_process(tmp_path):
    import pickle
    import subprocess
    import sys

    metric = rebase(BinaryAUROC)(thresholds=None)
    metric.update(torch.tensor([0.2, 0.9, 0.4]), torch.tensor([0, 1, 1]))
    path = tmp_path / "metric.pkl"
    path.write_bytes(pickle.dumps(metric))
    code = (
        f"import pickle, torchmetrics_varlen as tv; m = pickle.load(open({str(path)!r}, 'rb'));"
        " print(type(m).__name__, isinstance(m, tv.Metric), m.compute().item())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [
        "BinaryAUROC",  # the stock name, so that collection keys and logged names stay as they are
        "True",
        str(BinaryAUROC(thresholds=None)(torch.tensor([0.2, 0.9, 0.4]), torch.tensor([0, 1, 1])).item()),
    ]


def test_rebase_rejects_non_metrics_and_keeps_ours():
    with pytest.raises(TypeError, match=r"subclass of torchmetrics\.Metric"):
        rebase(int)
    assert rebase(SumOfSquares) is SumOfSquares
    assert rebase(BinaryAUROC) is rebase(BinaryAUROC)
