"""Every private internal of torchmetrics (and torch) this package relies on, checked on its own.

A torchmetrics or torch release that renames or changes one of these fails here, by name, instead of producing a
silent wrong number somewhere else.
"""

import inspect

import pytest
import torch
import torchmetrics
from torchmetrics import Metric as StockMetric
from torchmetrics import MetricCollection as StockCollection
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision
from torchmetrics.utilities.data import dim_zero_cat

VERSION = f"torchmetrics {torchmetrics.__version__}"


def _fail(name):
    return f"{VERSION} changed `{name}`; torchmetrics_varlen needs updating"


def test_metric_state_registries():
    metric = SumMetric()
    assert isinstance(metric._defaults, dict) and "sum_value" in metric._defaults, _fail("Metric._defaults")
    assert isinstance(metric._reductions, dict), _fail("Metric._reductions")
    assert callable(metric._reductions["sum_value"]), _fail("Metric._reductions values")

    class Lists(StockMetric):
        def __init__(self):
            super().__init__()
            self.add_state("items", default=[], dist_reduce_fx="cat")

        def update(self, x):
            self.items.append(x)

        def compute(self):
            return dim_zero_cat(self.items)

    # The coalesced sync recognises `cat` states by identity with dim_zero_cat.
    assert Lists()._reductions["items"] is dim_zero_cat, _fail("dist_reduce_fx='cat' -> dim_zero_cat")


def test_metric_sync_flags_and_caches():
    metric = SumMetric()
    for name in ("_is_synced", "_cache", "_computed", "_to_sync", "_should_unsync", "_forward_cache"):
        assert hasattr(metric, name), _fail(f"Metric.{name}")
    assert metric._is_synced is False and metric._cache is None, _fail("Metric._is_synced/_cache defaults")
    assert metric._to_sync is metric.sync_on_compute, _fail("Metric._to_sync")
    metric.update(torch.tensor(2.0))
    value = metric.compute()
    assert metric._computed is not None and torch.equal(metric._computed, value), _fail("Metric._computed cache")


def test_forward_marks_step_syncs_by_should_unsync():
    # Metric._sync_phase tells a per-step sync from an epoch compute by `_should_unsync` being False in forward.
    seen = []

    class Spy(SumMetric):
        def compute(self):
            seen.append(self._should_unsync)
            return super().compute()

    metric = Spy()
    metric(torch.tensor(1.0))
    metric.compute()
    assert seen == [False, True], _fail("Metric._should_unsync during forward")


def test_sync_dist_and_wrap_compute_signatures():
    parameters = list(inspect.signature(StockMetric._sync_dist).parameters)
    assert parameters[:3] == ["self", "dist_sync_fn", "process_group"], _fail("Metric._sync_dist signature")
    assert callable(getattr(StockMetric, "_wrap_compute", None)), _fail("Metric._wrap_compute")
    metric = SumMetric()
    # The instance's compute is the wrapped one; the class attribute is the raw compute the collection calls.
    assert metric.compute is not SumMetric.compute, _fail("Metric.compute wrapping in __init__")
    assert callable(metric.distributed_available_fn), _fail("Metric.distributed_available_fn")


def test_squeeze_if_scalar():
    from torchmetrics.utilities.data import _squeeze_if_scalar

    assert _squeeze_if_scalar(torch.tensor([3.0])).ndim == 0, _fail("utilities.data._squeeze_if_scalar")


def test_metric_getstate_returns_a_dict():
    state = SumMetric().__getstate__()
    assert isinstance(state, dict), _fail("Metric.__getstate__")


def test_collection_internals():
    collection = StockCollection([MulticlassAccuracy(num_classes=3), MulticlassPrecision(num_classes=3)])
    collection.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
    assert collection._groups_checked is True, _fail("MetricCollection._groups_checked")
    assert isinstance(collection._groups, dict), _fail("MetricCollection._groups")
    assert len(collection.compute_groups) == 1, _fail("compute groups sharing states")
    first, second = (m for _, m in collection.items(keep_base=True, copy_state=False))
    # Compute groups share state objects; the one-shot sync sends a shared object once.
    assert first.tp is second.tp, _fail("compute-group members sharing state objects")
    assert callable(getattr(collection, "_compute_and_reduce", None)), _fail("MetricCollection._compute_and_reduce")


def test_torch_join_internals():
    from torch.distributed.algorithms.join import Join, _JoinConfig

    config = _JoinConfig.construct_disabled_join_config()
    assert config.enable is False and hasattr(config, "is_first_joinable"), "torch changed _JoinConfig"
    source = inspect.getsource(Join.__init__)
    # join.py moves the metric's hook to the front of Join._join_hooks, found on the stack while Join is built.
    assert "_join_hooks" in source and "_set_joinable_configs" in source, "torch changed Join.__init__"


@pytest.mark.parametrize("name", ["_get_default_store"])
def test_torch_distributed_private_functions(name):
    import torch.distributed.distributed_c10d as c10d

    assert callable(getattr(c10d, name, None)), f"torch changed torch.distributed.distributed_c10d.{name}"
