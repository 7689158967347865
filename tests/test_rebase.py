"""`rebase` and `Metric` beside stock: names, pickling, scripting, task wrappers, `_sync_dist` overrides."""

import copy
import io
import pickle
import subprocess
import sys

import pytest
import torch
import torchmetrics
from conftest import run_distributed
from torchmetrics.aggregation import MeanMetric
from torchmetrics.classification import BinaryAccuracy, MulticlassAccuracy, MulticlassAUROC
from torchmetrics.regression import MeanSquaredError
from torchmetrics.retrieval import RetrievalMAP

from torchmetrics_varlen import Metric, MetricCollection, SoftF1Loss, rebase

STOCK = [
    (BinaryAccuracy, {}),
    (MulticlassAccuracy, {"num_classes": 3}),
    (MulticlassAUROC, {"num_classes": 3}),
    (MeanSquaredError, {}),
    (RetrievalMAP, {}),
    (MeanMetric, {}),
]


def _scripts(metric):
    try:
        torch.jit.script(metric)
    except Exception as err:  # compared with stock's behaviour, whatever it is
        return type(err).__name__
    return "ok"


@pytest.mark.parametrize(("cls", "kwargs"), STOCK, ids=[cls.__name__ for cls, _ in STOCK])
def test_scripting_behaves_as_stock(cls, kwargs):
    assert _scripts(rebase(cls)(**kwargs)) == _scripts(cls(**kwargs))


def test_metric_subclasses_script():
    assert _scripts(SoftF1Loss()) == "ok"


@pytest.mark.parametrize(("cls", "kwargs"), STOCK, ids=[cls.__name__ for cls, _ in STOCK])
def test_rebased_class_keeps_the_stock_name(cls, kwargs):
    rebased = rebase(cls)
    assert rebased.__name__ == cls.__name__ and rebased.__qualname__ == cls.__qualname__
    ours = MetricCollection([rebased(**kwargs)])
    theirs = torchmetrics.MetricCollection([cls(**kwargs)])
    assert list(ours.keys()) == list(theirs.keys())


def test_compute_groups_given_by_stock_names_are_accepted():
    members = [rebase(MulticlassAccuracy)(num_classes=3), rebase(MulticlassAUROC)(num_classes=3)]
    collection = MetricCollection(members, compute_groups=[["MulticlassAccuracy"], ["MulticlassAUROC"]])
    assert sorted(collection.keys()) == ["MulticlassAUROC", "MulticlassAccuracy"]


class UserMetric(Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x):
        self.total += x.sum()

    def compute(self):
        return self.total


@pytest.mark.parametrize(
    "make",
    [lambda: rebase(MulticlassAccuracy)(num_classes=3), lambda: rebase(RetrievalMAP)(), UserMetric],
    ids=["rebased", "rebased-retrieval", "user"],
)
def test_pickle_deepcopy_and_torch_save_keep_the_class(make):
    metric = make()
    for clone in (pickle.loads(pickle.dumps(metric)), copy.deepcopy(metric)):
        assert type(clone) is type(metric)
    buffer = io.BytesIO()
    torch.save(torch.nn.ModuleList([metric]), buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)[0]) is type(metric)


def test_rebased_image_metric_unpickles_in_a_fresh_process(tmp_path):
    image = pytest.importorskip("torchmetrics.image")
    metric = rebase(image.PeakSignalNoiseRatio)(data_range=1.0)
    metric.update(torch.full((1, 1, 4, 4), 0.5), torch.full((1, 1, 4, 4), 0.25))
    path = tmp_path / "metric.pkl"
    path.write_bytes(pickle.dumps(metric))
    code = f"import pickle; m = pickle.load(open({str(path)!r}, 'rb')); print(type(m).__name__, float(m.compute()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    stock = image.PeakSignalNoiseRatio(data_range=1.0)
    stock.update(torch.full((1, 1, 4, 4), 0.5), torch.full((1, 1, 4, 4), 0.25))
    assert out.stdout.split() == ["PeakSignalNoiseRatio", str(float(stock.compute()))]


def test_task_wrappers_are_refused_with_the_class_to_rebase():
    with pytest.raises(TypeError, match=r"rebase\(BinaryAUROC\)"):
        rebase(torchmetrics.AUROC)


class OverridesSyncDist(Metric):
    """A subclass whose `_sync_dist` adds something: compute() must go through it, as sync() does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.calls = 0

    def _sync_dist(self, dist_sync_fn=None, process_group=None):
        self.calls += 1
        super()._sync_dist(process_group=process_group)

    def update(self, x):
        self.total += x.sum()

    def compute(self):
        return self.total


def body_sync_dist_override(rank, world_size):
    metric = OverridesSyncDist()
    metric.update(torch.tensor([float(rank + 1)]))
    value = metric.compute()
    return {"value": value.item(), "calls": metric.calls}


@pytest.mark.parametrize("world_size", [2, 3])
def test_compute_goes_through_a_sync_dist_override(world_size):
    for result in run_distributed(body_sync_dist_override, world_size):
        assert result == {"value": float(sum(range(1, world_size + 1))), "calls": 1}
