"""Issue 13: stock torchmetrics behaviours a drop-in must keep (cache, names, pickling, scripting, overrides)."""

import copy
import io
import pickle
import subprocess
import sys

import pytest
import torch
import torchmetrics
from _helpers import count_collectives, split
from _metrics import StockTotal as StockSum
from _metrics import Total as SumMetric
from conftest import run_distributed
from torchmetrics import MetricCollection as StockCollection
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MulticlassF1Score
from torchmetrics.regression import MeanSquaredError
from torchmetrics.retrieval import RetrievalMAP

import torchmetrics_varlen as tv
from torchmetrics_varlen import rebase


class OwnSyncDist(SumMetric):
    """Overrides ``_sync_dist`` (as MeanAveragePrecision does) and counts its calls."""

    calls = 0

    def _sync_dist(self, dist_sync_fn=None, process_group=None):
        type(self).calls += 1
        super()._sync_dist(process_group=process_group)


# --------------------------------------------------------------------------------------------- item 1 and 2
def _cached_compute_body(rank, world_size):
    metric = rebase(MulticlassAccuracy)(num_classes=3)
    data = torch.arange(7 * world_size) % 3
    mine = split([3 + r for r in range(world_size)], rank)
    metric.update(data[mine], torch.zeros_like(data[mine]))
    first = metric.compute()
    with count_collectives() as counts:
        if rank == 0:
            again = metric.compute()  # legal with stock: the cached value, no collective
        else:
            again = metric.compute()
    return {"calls": sum(counts.values()), "same": again is first}


@pytest.mark.parametrize("world_size", [2, 3])
def test_cached_compute_returns_the_cached_object_after_the_records(world_size):
    # Stock returns a valid cache with no collective; here every rank says its cache is valid in its record (issue
    # 43 item 1), and when all are, that is all that moves: one collective, and the very cached object comes back.
    for result in run_distributed(_cached_compute_body, world_size):
        assert result == {"calls": 1, "same": True}


def _stale_cache_body(rank, world_size):
    metric = SumMetric(sync_timeout=20)
    metric.update(torch.tensor([float(rank)]))
    first = metric.compute().item()
    if rank != 0:
        metric.update(torch.tensor([1.0]))  # rank 0's cache stays valid, the others' go stale
    return first, metric.compute().item()


def test_a_valid_cache_beside_stale_ones_takes_part_and_gets_the_new_value():
    # Before: rank 0 returned its cached value while rank 1 synced alone until its timeout (stock pairs rank 1's
    # sync with rank 0's next one: a value from another round). Now both sync, and both get this round's value.
    for first, second in run_distributed(_stale_cache_body, 2, fresh=True):
        assert (first, second) == (1.0, 2.0)


def _collection_body(rank, world_size):
    sizes = [5, 1, 8][:world_size]
    preds, target = torch.arange(14) % 3, torch.arange(14) % 2 + (torch.arange(14) % 5 == 0)
    mine = split(sizes, rank)
    members = {
        "stock": MulticlassAccuracy(num_classes=3),
        "rebased": rebase(MulticlassF1Score)(num_classes=3),
        "ours": SumMetric(),
    }
    ours = tv.MetricCollection(members, compute_groups=False)
    for name, metric in ours.items(keep_base=True):
        metric.update(preds[mine].float()) if name == "ours" else metric.update(preds[mine], target[mine])
    with count_collectives() as counts:
        got = ours.compute()
    with count_collectives() as cached:
        again = ours.compute()
    reference = {
        "stock": MulticlassAccuracy(num_classes=3)(preds[: sum(sizes)], target[: sum(sizes)]),
        "rebased": MulticlassF1Score(num_classes=3)(preds[: sum(sizes)], target[: sum(sizes)]),
        "ours": preds[: sum(sizes)].float().sum(),
    }
    equal = all(torch.allclose(got[k], reference[k]) and torch.equal(again[k], got[k]) for k in reference)
    return {"calls": sum(counts.values()), "cached_calls": sum(cached.values()), "equal": equal}


@pytest.mark.parametrize("world_size", [2, 3])
def test_collection_with_varlen_member_costs_two_collectives(world_size):
    for result in run_distributed(_collection_body, world_size):
        assert result["equal"]
        assert result["calls"] <= 2
        assert result["cached_calls"] == 1  # every rank's caches are valid: the records are all that move


# ------------------------------------------------------------------------------------------------------ item 3
SCRIPTED = [
    (MulticlassAccuracy, {"num_classes": 3}),
    (BinaryAUROC, {}),
    (MeanSquaredError, {}),
    (RetrievalMAP, {}),
    (StockSum, {}),
]


def _scripts(metric):
    try:
        torch.jit.script(metric)
    except Exception as error:
        return type(error).__name__
    return "ok"


@pytest.mark.parametrize(("cls", "kwargs"), SCRIPTED, ids=lambda c: getattr(c, "__name__", ""))
def test_jit_script_like_stock(cls, kwargs):
    assert _scripts(rebase(cls)(**kwargs)) == _scripts(cls(**kwargs))


def test_jit_script_varlen_subclass():
    assert _scripts(SumMetric()) == _scripts(StockSum()) == "ok"


# ------------------------------------------------------------------------------------------------------ item 4
def _pickled_metrics():
    metrics = [rebase(StockSum)(), rebase(RetrievalMAP)(), rebase(MulticlassAccuracy)(num_classes=3), SumMetric()]
    try:
        from torchmetrics.image import PeakSignalNoiseRatio
    except ImportError:
        pass
    else:
        metrics.append(rebase(PeakSignalNoiseRatio)(data_range=1.0))
    return metrics


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_rebased_classes_pickle(how):
    for metric in _pickled_metrics():
        if isinstance(metric, (StockSum, SumMetric)):
            metric.update(torch.tensor([2.0, 3.0]))
        if how == "pickle":
            copied = pickle.loads(pickle.dumps(metric))
        elif how == "deepcopy":
            copied = copy.deepcopy(metric)
        else:
            buffer = io.BytesIO()
            torch.save(torch.nn.ModuleDict({"m": metric}), buffer)
            buffer.seek(0)
            copied = torch.load(buffer, weights_only=False)["m"]
        assert type(copied) is type(metric)
        assert isinstance(copied, tv.Metric)
        if isinstance(metric, (StockSum, SumMetric)):
            copied.update(torch.tensor([1.0]))
            assert copied.compute().item() == 6.0


def test_rebased_class_unpickles_in_a_fresh_process(tmp_path):
    path = tmp_path / "metric.pkl"
    metric = rebase(RetrievalMAP)()
    metric.update(torch.tensor([0.2, 0.9, 0.4]), torch.tensor([0, 1, 1]), indexes=torch.tensor([0, 0, 0]))
    path.write_bytes(pickle.dumps(metric))
    code = (
        "import pickle, sys, torchmetrics_varlen as tv; m = pickle.loads(open(sys.argv[1], 'rb').read());"
        " print(type(m).__name__, isinstance(m, tv.Metric), round(m.compute().item(), 4))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["RetrievalMAP", "True", str(round(RetrievalMAP()(*_retrieval()).item(), 4))]


def _rebased_classes():
    return [rebase(BinaryAUROC), rebase(RetrievalMAP), rebase(MulticlassAccuracy), rebase(StockSum)]


class SubOfRebased(rebase(StockSum)):
    """A class of its own deriving from a rebased one: pickled by reference, like any module-level class."""


@pytest.mark.parametrize("how", ["pickle", "multiprocessing", "deepcopy"])
def test_rebased_class_objects_pickle_to_the_same_class(how):
    # Issue 19 item 1: torchmetrics' test pool (and mp.spawn, pickled configs) sends the metric *class* to workers.
    import multiprocessing.reduction

    for cls in [*_rebased_classes(), SubOfRebased]:
        if how == "pickle":
            copied = pickle.loads(pickle.dumps(cls))
        elif how == "multiprocessing":
            copied = pickle.loads(multiprocessing.reduction.ForkingPickler.dumps(cls))
        else:
            copied = copy.deepcopy(cls)
        assert copied is cls, (cls, copied)


def test_rebased_class_pickles_when_swapped_in_under_the_stock_name(monkeypatch):
    # Code that swaps rebased classes in under the stock names (as torchmetrics' suite runner does) must still pickle
    # them: pickle's own lookup of the base by reference would find the rebased class and refuse.
    import torchmetrics.classification.accuracy as accuracy_module
    from torchmetrics.classification.accuracy import BinaryAccuracy

    rebased = rebase(BinaryAccuracy)
    monkeypatch.setattr(accuracy_module, "BinaryAccuracy", rebased)
    assert pickle.loads(pickle.dumps(rebased)) is rebased
    metric = rebased()
    metric.update(torch.tensor([0.9, 0.2, 0.7]), torch.tensor([1, 0, 0]))
    copied = pickle.loads(pickle.dumps(metric))
    assert type(copied) is rebased
    assert copied.compute() == BinaryAccuracy()(torch.tensor([0.9, 0.2, 0.7]), torch.tensor([1, 0, 0]))


def _build_and_compute(cls):
    """Run in a spawned process: the class arrives pickled, as torchmetrics' test pool sends it."""
    metric = cls()
    metric.update(*_retrieval())
    return type(metric).__name__, type(metric).__module__, isinstance(metric, tv.Metric), metric.compute().item()


def test_rebased_class_crosses_to_a_spawned_process():
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        name, module, ours, value = pool.apply(_build_and_compute, (rebase(RetrievalMAP),))
    assert (name, module, ours) == ("RetrievalMAP", "torchmetrics_varlen.metric", True)
    assert value == pytest.approx(RetrievalMAP()(*_retrieval()).item())


def test_rebased_class_keeps_stock_metaclass_behaviour():
    cls = rebase(BinaryAUROC)
    assert isinstance(cls, type(BinaryAUROC))  # still an ABCMeta class: isinstance/ABC checks unchanged
    assert issubclass(cls, BinaryAUROC) and issubclass(cls, tv.Metric)


def _retrieval():
    return torch.tensor([0.2, 0.9, 0.4]), torch.tensor([0, 1, 1]), torch.tensor([0, 0, 0])


# ------------------------------------------------------------------------------------------------ items 5 and 6
def test_rebase_keeps_names_and_collection_keys():
    classes = [(MulticlassAccuracy, {"num_classes": 3}), (BinaryAUROC, {}), (RetrievalMAP, {})]
    for cls, _ in classes:
        assert (rebase(cls).__name__, rebase(cls).__qualname__) == (cls.__name__, cls.__qualname__)
    stock = StockCollection([cls(**kw) for cls, kw in classes])
    ours = tv.MetricCollection([rebase(cls)(**kw) for cls, kw in classes])
    assert list(ours.keys()) == list(stock.keys())
    groups = [["MulticlassAccuracy"], ["BinaryAUROC", "RetrievalMAP"]]
    assert StockCollection([rebase(cls)(**kw) for cls, kw in classes], compute_groups=groups).compute_groups


def test_rebase_task_wrapper_names_the_class_to_rebase():
    with pytest.raises(TypeError, match="BinaryAUROC/MulticlassAUROC/MultilabelAUROC"):
        rebase(torchmetrics.AUROC)


# ------------------------------------------------------------------------------------------------------ item 7
def _own_sync_dist_body(rank, world_size):
    OwnSyncDist.calls = 0
    metric = OwnSyncDist()
    metric.update(torch.tensor([float(rank + 1)]))
    with count_collectives() as counts:
        value = metric.compute()
    return {"calls": OwnSyncDist.calls, "collectives": sum(counts.values()), "value": value.item()}


def test_compute_honours_sync_dist_override():
    for result in run_distributed(_own_sync_dist_body, 2):
        assert result == {"calls": 1, "collectives": result["collectives"], "value": 3.0}
        assert result["collectives"] <= 2


def _own_sync_dist_in_collection_body(rank, world_size):
    OwnSyncDist.calls = 0
    collection = tv.MetricCollection({"own": OwnSyncDist(), "plain": SumMetric()})
    collection.update(torch.tensor([float(rank + 1)]))
    values = collection.compute()
    return {"calls": OwnSyncDist.calls, "own": values["own"].item(), "plain": values["plain"].item()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_collection_member_with_its_own_sync_dist_syncs_through_it(world_size):
    total = float(sum(range(1, world_size + 1)))
    for result in run_distributed(_own_sync_dist_in_collection_body, world_size):
        assert result == {"calls": 1, "own": total, "plain": total}


# ---------------------------------------------------------------------------------------------------- _finish
def test_compute_returns_the_cached_object_unaliased_like_stock():
    for metric in (StockSum(), SumMetric()):
        metric.update(torch.tensor([1.0]))
        value = metric.compute()
        assert metric.compute() is value
        assert value.data_ptr() != metric.total.data_ptr()
