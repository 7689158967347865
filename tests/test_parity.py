"""Issue 13: the same public calls on stock torchmetrics and on each way in (hook, rebase, subclass) agree.

Every rank holds data of the same shape (stock's own requirement), so stock is the reference: values, result types,
``state_dict``, collection keys, pickling and scripting must be equal.
"""

import copy
import pickle

import pytest
import torch
import torchmetrics
from conftest import run_distributed
from torchmetrics import MetricCollection as StockCollection
from torchmetrics.aggregation import MeanMetric
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy
from torchmetrics.regression import MeanSquaredError
from torchmetrics.retrieval import RetrievalMAP

import torchmetrics_varlen as tv


class _Pairs:
    """A user metric with a sum and a ``cat`` state, written once for both bases."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, preds, target):
        self.total += (preds - target).abs().sum()
        self.values.append(preds - target)

    def compute(self):
        return self.total / torchmetrics.utilities.dim_zero_cat(self.values).numel()


class StockPairs(_Pairs, torchmetrics.Metric):
    """On stock torchmetrics."""


class OurPairs(_Pairs, tv.Metric):
    """On ``torchmetrics_varlen.Metric`` (the subclass way)."""


def _optional(module, name, **kwargs):
    try:
        return getattr(__import__(module, fromlist=[name]), name), kwargs
    except ImportError:
        return None


CASES = {
    "MulticlassAccuracy": (MulticlassAccuracy, {"num_classes": 3}),
    "BinaryAUROC": (BinaryAUROC, {"thresholds": None}),
    "MeanSquaredError": (MeanSquaredError, {}),
    "RetrievalMAP": (RetrievalMAP, {}),
    "MeanMetric": (MeanMetric, {}),
    "PeakSignalNoiseRatio": _optional("torchmetrics.image", "PeakSignalNoiseRatio", data_range=1.0),
    "CharErrorRate": _optional("torchmetrics.text", "CharErrorRate"),
}
CASES = {name: case for name, case in CASES.items() if case is not None}
WAYS = ("hook", "rebase", "subclass")


def _make(name, way):
    """(stock metric, our metric) for a case and a way in."""
    if way == "subclass":
        return StockPairs(), OurPairs()
    cls, kwargs = CASES[name]
    if way == "hook":
        return cls(**kwargs), cls(dist_sync_fn=tv.gather_all_tensors, **kwargs)
    return cls(**kwargs), tv.rebase(cls)(**kwargs)


def _batch(name, rank, step):
    """Inputs of equal shape on every rank, different values."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    if name == "CharErrorRate":
        words = ["hello world", "varlen metrics", "uneven ranks", "cat states"]
        return ([words[(rank + step) % 4]], [words[(rank + 2 * step) % 4]]), {}
    if name == "MeanMetric":
        return (torch.rand(6, generator=gen),), {}
    if name == "PeakSignalNoiseRatio":
        return (torch.rand(2, 1, 4, 4, generator=gen), torch.rand(2, 1, 4, 4, generator=gen)), {}
    if name == "MulticlassAccuracy":
        return (torch.randint(0, 3, (6,), generator=gen), torch.randint(0, 3, (6,), generator=gen)), {}
    target = torch.randint(0, 2, (6,), generator=gen)
    if name == "RetrievalMAP":
        return (torch.rand(6, generator=gen), target), {"indexes": torch.arange(6) // 3 + 2 * rank}
    return (torch.rand(6, generator=gen), target.float() if name in ("MeanSquaredError", "subclass") else target), {}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _same_calls(metric, name, rank):
    """The sequence of public calls; what it returns is compared between stock and ours."""
    seen = {}
    args, kwargs = _batch(name, rank, 0)
    seen["forward"] = metric(*args, **kwargs)
    args, kwargs = _batch(name, rank, 1)
    metric.update(*args, **kwargs)
    seen["compute"] = metric.compute()
    seen["compute_again"] = metric.compute()
    metric.sync()
    seen["synced_types"] = {state: type(getattr(metric, state)).__name__ for state in metric._defaults}
    metric.unsync()
    seen["state_dict"] = dict(metric.state_dict())
    metric.reset()
    args, kwargs = _batch(name, rank, 2)
    metric.update(*args, **kwargs)
    seen["after_reset"] = metric.compute()
    return seen


def _parity_body(rank, world_size):
    out = {}
    for way in WAYS:
        for name in CASES if way != "subclass" else ["subclass"]:
            stock, ours = _make(name, way)
            expected, got = _same_calls(stock, name, rank), _same_calls(ours, name, rank)
            out[(way, name)] = {key: _equal(got[key], expected[key]) for key in expected}
            out[(way, name)]["types"] = all(type(got[k]) is type(expected[k]) for k in expected)
    return out


@pytest.fixture(scope="module")
def parity():
    return run_distributed(_parity_body, 2)


@pytest.mark.parametrize("way", WAYS)
def test_values_types_and_state_dict_equal_stock(parity, way):
    for result in parity:
        for (how, name), checks in result.items():
            if how == way:
                assert {k: v for k, v in checks.items() if k != "synced_types"} == dict.fromkeys(
                    checks.keys() - {"synced_types"}, True
                ), name


@pytest.mark.parametrize("way", WAYS)
def test_state_types_after_sync_equal_stock(parity, way):
    for result in parity:
        for (how, name), checks in result.items():
            if how == way:
                assert checks["synced_types"], name


@pytest.mark.parametrize("way", WAYS)
def test_collection_keys_pickling_and_scripting_equal_stock(way):
    names = list(CASES) if way != "subclass" else ["subclass"]
    pairs = [_make(name, way) for name in names]
    stock_keys = list(StockCollection([stock for stock, _ in pairs], compute_groups=False).keys())
    if way == "subclass":  # two classes of different names: the key is the class name, by stock's rule
        stock_keys = [name.replace("Stock", "Our") for name in stock_keys]
    assert list(tv.MetricCollection([ours for _, ours in pairs], compute_groups=False).keys()) == stock_keys
    for stock, ours in pairs:
        assert _outcome(lambda m: pickle.loads(pickle.dumps(m)), ours) == _outcome(
            lambda m: pickle.loads(pickle.dumps(m)), stock
        )
        assert _outcome(copy.deepcopy, ours) == _outcome(copy.deepcopy, stock)
        assert _outcome(torch.jit.script, ours) == _outcome(torch.jit.script, stock), type(stock).__name__


def _outcome(fn, metric):
    try:
        fn(metric)
    except Exception as error:
        return type(error).__name__
    return "ok"
