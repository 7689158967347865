"""Every private internal of torchmetrics (and torch) this package relies on, checked on its own.

A torchmetrics or torch release that renames or changes one of these fails here, by name, instead of producing a
silent wrong number somewhere else. Each test says which part of torchmetrics_varlen needs the internal. All of them
run in this process, without a process group: the internals are exercised directly (``_sync_dist`` with a fake
gather), so this file takes well under a second.
"""

import inspect

import pytest
import torch
import torchmetrics
from torchmetrics import Metric as StockMetric
from torchmetrics import MetricCollection as StockCollection
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_mean, dim_zero_min, dim_zero_sum

VERSION = f"torchmetrics {torchmetrics.__version__}"


def _fail(name):
    return f"{VERSION} changed `{name}`; torchmetrics_varlen needs updating"


def product(stacked):
    return stacked.prod(dim=0)


class AllKinds(StockMetric):
    """One state per kind of reduction the coalesced sync handles."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("average", default=torch.tensor(0.0), dist_reduce_fx="mean")
        self.add_state("largest", default=torch.tensor(float("-inf")), dist_reduce_fx="max")
        self.add_state("smallest", default=torch.tensor(float("inf")), dist_reduce_fx="min")
        self.add_state("items", default=[], dist_reduce_fx="cat")
        self.add_state("chunks", default=[], dist_reduce_fx=None)
        self.add_state("scale", default=torch.ones(2), dist_reduce_fx=product)

    def update(self, x):
        self.total += x.sum()
        self.average = x.mean()
        self.largest = torch.maximum(self.largest, x.max())
        self.smallest = torch.minimum(self.smallest, x.min())
        self.items.append(x)
        self.chunks.append(x)
        self.scale = self.scale * 2

    def compute(self):
        return self.total


# ------------------------------------------------------------------------------------------- Metric: states
def test_reductions_registry_maps_to_the_dim_zero_functions():
    # _sync.states.layout_text / _sync.states.reduce_state read Metric._reductions; `cat` states are recognised by
    # identity with dim_zero_cat, and the other reductions are called on the stacked per-rank values.
    reductions = AllKinds()._reductions
    assert isinstance(reductions, dict), _fail("Metric._reductions")
    assert list(reductions) == ["total", "average", "largest", "smallest", "items", "chunks", "scale"], _fail(
        "Metric._reductions order (registration order)"
    )
    expected = {
        "total": dim_zero_sum,
        "average": dim_zero_mean,
        "largest": dim_zero_max,
        "smallest": dim_zero_min,
        "items": dim_zero_cat,
        "chunks": None,
        "scale": product,
    }
    for name, fn in expected.items():
        assert reductions[name] is fn, _fail(f"Metric._reductions[{name!r}] (dist_reduce_fx -> function)")
    stacked = torch.tensor([[1.0, 5.0], [3.0, 2.0]])
    assert torch.equal(reductions["total"](stacked), torch.tensor([4.0, 7.0])), _fail("dim_zero_sum")
    assert torch.equal(reductions["largest"](stacked), torch.tensor([3.0, 5.0])), _fail("dim_zero_max")


def test_defaults_registry():
    # local_state_copy, Join's empty states and MetricCollection read Metric._defaults: the state names and defaults.
    metric = AllKinds()
    assert isinstance(metric._defaults, dict), _fail("Metric._defaults")
    assert list(metric._defaults) == list(metric._reductions), _fail("Metric._defaults keys")
    assert metric._defaults["items"] == [] and torch.equal(metric._defaults["total"], torch.tensor(0.0)), _fail(
        "Metric._defaults values"
    )
    metric.update(torch.ones(2))
    assert metric._defaults["items"] == [], _fail("Metric._defaults must not alias the live list state")


def test_states_are_plain_attributes_not_buffers():
    # collection._set_states writes states straight into the instance __dict__, as nn.Module.__setattr__ would.
    metric = AllKinds()
    assert "total" in vars(metric) and "total" not in dict(metric.named_buffers()), _fail("add_state storage")


# ----------------------------------------------------------------------------------- Metric: sync bookkeeping
def test_sync_flags_and_caches_have_their_initial_values():
    metric = SumMetric()
    for name in ("_is_synced", "_cache", "_computed", "_to_sync", "_should_unsync", "_forward_cache", "_update_count"):
        assert hasattr(metric, name), _fail(f"Metric.{name}")
    assert metric._is_synced is False, _fail("Metric._is_synced default")
    assert metric._cache is None, _fail("Metric._cache default")
    # `Metric.sync`/`unsync` write the flag, the cache and the states straight into the instance dict
    assert {"_is_synced", "_cache"} <= set(vars(metric)), _fail("Metric._is_synced / _cache as plain attributes")
    assert metric._computed is None, _fail("Metric._computed default")
    assert metric._forward_cache is None, _fail("Metric._forward_cache default")
    assert metric._should_unsync is True, _fail("Metric._should_unsync default")
    assert metric._to_sync is metric.sync_on_compute is True, _fail("Metric._to_sync (follows sync_on_compute)")
    assert SumMetric(sync_on_compute=False)._to_sync is False, _fail("Metric._to_sync (follows sync_on_compute)")
    assert metric.dist_sync_fn is None, _fail("Metric.dist_sync_fn default (None means the stock gather)")
    assert metric.process_group is None and callable(metric.distributed_available_fn), _fail(
        "Metric.process_group / distributed_available_fn"
    )
    # `Metric._distributed` skips calling the default, which asks what `_sync.group.REGISTRY.state` asks again
    assert metric.distributed_available_fn is torchmetrics.metric.jit_distributed_available, _fail(
        "Metric.distributed_available_fn default (torchmetrics.metric.jit_distributed_available)"
    )
    assert metric.compute_with_cache is True and metric.dist_sync_on_step is False, _fail(
        "Metric.compute_with_cache / dist_sync_on_step"
    )


def test_update_count_update_called_and_compute_cache():
    # The wrapped compute warns on `not update_called` and caches in `_computed`; update must clear that cache.
    metric = SumMetric()
    assert metric._update_count == 0 and metric.update_called is False, _fail("Metric._update_count / update_called")
    metric.update(torch.tensor(2.0))
    metric.update(torch.tensor(3.0))
    assert metric._update_count == 2 and metric.update_called is True, _fail("Metric._update_count increments")
    value = metric.compute()
    assert metric._computed is not None and torch.equal(metric._computed, value), _fail("Metric._computed cache")
    metric.update(torch.tensor(1.0))
    assert metric._computed is None, _fail("Metric._computed cleared by update")
    metric.reset()
    assert metric._update_count == 0 and metric._computed is None, _fail("Metric.reset of _update_count/_computed")


@pytest.mark.parametrize("full_state_update", [True, False])
@pytest.mark.parametrize("dist_sync_on_step", [True, False])
def test_forward_marks_its_batch_compute(full_state_update, dist_sync_on_step):
    # Metric._sync_phase tells a per-step sync from an epoch compute by `_should_unsync` being False inside forward,
    # and the wrapped compute syncs in forward only if `_to_sync` (= dist_sync_on_step there) says so.
    seen = []

    class Spy(SumMetric):
        def compute(self):
            seen.append((self._should_unsync, self._to_sync))
            return super().compute()

    Spy.full_state_update = full_state_update
    metric = Spy(dist_sync_on_step=dist_sync_on_step)
    batch_value = metric(torch.tensor(4.0))
    assert seen == [(False, dist_sync_on_step)], _fail("Metric._should_unsync/_to_sync during forward")
    # forward restores the epoch settings and keeps the batch value where Lightning's on_step logging reads it
    assert (metric._should_unsync, metric._to_sync, metric._is_synced) == (True, True, False), _fail(
        "Metric._should_unsync/_to_sync/_is_synced after forward"
    )
    assert metric._computed is None, _fail("Metric._computed after forward")
    assert torch.equal(metric._forward_cache, batch_value), _fail("Metric._forward_cache")
    assert metric._update_count == 1, _fail("Metric._update_count after forward")
    metric.compute()
    assert seen[-1] == (True, True), _fail("Metric._should_unsync/_to_sync in an epoch compute")


def test_stock_sync_dist_calls_the_gather_per_state_with_a_group_keyword():
    # Metric._sync_dist falls back to the stock per-state path for a custom dist_sync_fn and for sync_grads: it must
    # call `fn(tensor, group=...)` once per state and reduce the gathered list as before.
    calls = []

    def fake_gather(tensor, group=None):
        calls.append(group)
        return [tensor, tensor]  # two ranks holding the same data

    metric = AllKinds()
    metric.update(torch.tensor([1.0, 3.0]))
    metric.update(torch.tensor([2.0]))
    parameters = list(inspect.signature(StockMetric._sync_dist).parameters)
    assert parameters[:3] == ["self", "dist_sync_fn", "process_group"], _fail("Metric._sync_dist signature")
    metric._sync_dist(fake_gather, process_group="the-group")
    assert calls and set(calls) == {"the-group"}, _fail("Metric._sync_dist passes group= to dist_sync_fn")
    assert torch.equal(metric.total, torch.tensor(12.0)), _fail("Metric._sync_dist sum reduction")
    assert torch.equal(metric.largest, torch.tensor(3.0)), _fail("Metric._sync_dist max reduction")
    assert torch.equal(dim_zero_cat(metric.items), torch.tensor([1.0, 3.0, 2.0, 1.0, 3.0, 2.0])), _fail(
        "Metric._sync_dist cat reduction"
    )
    assert torch.equal(metric.scale, torch.full((2,), 16.0)), _fail("Metric._sync_dist custom reduction")


def test_stock_sync_dist_gathers_an_empty_cat_list_as_an_empty_tensor():
    # The `dist_sync_fn=gather_all_tensors` hook on stock metrics relies on this: a rank without data still calls the
    # gather (with a zero-element tensor) for an empty `cat` list, so it takes part in every collective. torchmetrics
    # before 1.4 skipped the call on that rank alone: the other ranks waited in the gather for ever.
    calls = []

    def fake_gather(tensor, group=None):
        calls.append(tensor)
        return [tensor, tensor]

    metric = AllKinds()  # never updated: both list states are empty
    metric._sync_dist(fake_gather)
    empty = [t for t in calls if t.numel() == 0]
    assert len(calls) == 6 and len(empty) == 1, _fail(
        "Metric._sync_dist with an empty `cat` list (the empty rank must still call dist_sync_fn)"
    )


def test_stock_sync_dist_sends_the_empty_placeholder_on_the_metric_device():
    # Where the hook runs (docs "Where it runs"): the placeholder an empty rank sends is on the metric's device, as the
    # data of its peers are when the metric was moved there. A device no tensor of this test is on stands for the GPU.
    calls = []

    def fake_gather(tensor, group=None):
        calls.append(tensor)
        return [tensor, tensor]

    metric = AllKinds()
    metric._device = torch.device("meta")  # what `.to(device)` records; the states themselves stay where they are
    metric._sync_dist(fake_gather)
    empty = [t for t in calls if t.numel() == 0]
    assert [t.device for t in empty] == [torch.device("meta")], _fail("Metric._sync_dist's empty-list placeholder")


def test_wrap_compute_is_the_hook_that_wraps_compute():
    # torchmetrics_varlen.Metric overrides _wrap_compute; the stock __init__ must route compute through it.
    wrapped = []

    class Hooked(SumMetric):
        def _wrap_compute(self, compute):
            wrapped.append(compute.__name__)
            return super()._wrap_compute(compute)

    metric = Hooked()
    assert wrapped == ["compute"], _fail("Metric._wrap_compute called by __init__")
    assert metric.compute is not Hooked.compute, _fail("Metric.compute wrapping in __init__")
    # The class attribute stays the raw compute, which the collection calls on global states.
    metric.update(torch.tensor(2.0))
    assert torch.equal(type(metric).compute(metric), torch.tensor(2.0)), _fail("raw Metric.compute")


def test_sync_methods_keep_their_signatures():
    # torchmetrics_varlen.Metric overrides sync / unsync / sync_context with the same parameters (callers such as
    # torchmetrics wrappers and Lightning pass them by keyword).
    expected = {
        "sync": ["self", "dist_sync_fn", "process_group", "should_sync", "distributed_available"],
        "unsync": ["self", "should_unsync"],
        "sync_context": [
            "self",
            "dist_sync_fn",
            "process_group",
            "should_sync",
            "should_unsync",
            "distributed_available",
        ],
    }
    for name, parameters in expected.items():
        assert list(inspect.signature(getattr(StockMetric, name)).parameters) == parameters, _fail(
            f"Metric.{name} signature"
        )


def test_sync_and_unsync_restore_local_states_through_cache():
    # torchmetrics_varlen.Metric re-implements sync/unsync with `_cache` and `_is_synced`, as the stock ones do.
    metric = SumMetric()
    metric.update(torch.tensor(2.0))
    metric.sync(dist_sync_fn=lambda t, group=None: [t, t], distributed_available=lambda: True)
    assert metric._is_synced is True and isinstance(metric._cache, dict), _fail("Metric.sync -> _is_synced/_cache")
    assert torch.equal(metric.sum_value, torch.tensor(4.0)), _fail("Metric.sync")
    metric.unsync()
    assert metric._is_synced is False and metric._cache is None, _fail("Metric.unsync -> _is_synced/_cache")
    assert torch.equal(metric.sum_value, torch.tensor(2.0)), _fail("Metric.unsync restores local states")


def test_reduce_states_merges_an_incoming_state():
    # IndexedMetric._reduce_states extends it (merge_state, and forward with full_state_update=False).
    metric = SumMetric()
    metric.update(torch.tensor(2.0))
    metric._reduce_states({"sum_value": torch.tensor(5.0)})
    assert torch.equal(metric.sum_value, torch.tensor(7.0)), _fail("Metric._reduce_states")


def test_metric_getstate_returns_a_dict():
    # Metric.__getstate__ is extended to drop the Join state before pickling.
    state = SumMetric().__getstate__()
    assert isinstance(state, dict), _fail("Metric.__getstate__")


# -------------------------------------------------------------------------------------------------- utilities
def test_utility_functions():
    from torchmetrics.utilities import distributed
    from torchmetrics.utilities.data import _squeeze_if_scalar
    from torchmetrics.utilities.prints import rank_zero_warn

    assert _squeeze_if_scalar(torch.tensor([3.0])).ndim == 0, _fail("utilities.data._squeeze_if_scalar")
    assert _squeeze_if_scalar(torch.tensor([3.0, 4.0])).ndim == 1, _fail("utilities.data._squeeze_if_scalar")
    assert callable(rank_zero_warn), _fail("utilities.prints.rank_zero_warn")
    # is_coalescing_sync_fn recognises the stock gather by identity, so metrics given it explicitly coalesce too.
    gather = distributed.gather_all_tensors
    assert list(inspect.signature(gather).parameters)[:2] == ["result", "group"], _fail(
        "utilities.distributed.gather_all_tensors signature"
    )


# ----------------------------------------------------------------------------------------- MetricCollection
def _collection(compute_groups=True):
    return StockCollection(
        {
            "acc": MulticlassAccuracy(num_classes=3),
            "prec": MulticlassPrecision(num_classes=3),
            "f1": MulticlassF1Score(num_classes=3),
        },
        compute_groups=compute_groups,
    )


PREDS, TARGET = torch.tensor([0, 1, 2, 2, 1]), torch.tensor([0, 1, 1, 2, 0])


def test_collection_compute_group_bookkeeping():
    collection = _collection()
    assert collection._enable_compute_groups is True, _fail("MetricCollection._enable_compute_groups")
    assert _collection(compute_groups=False)._enable_compute_groups is False, _fail(
        "MetricCollection._enable_compute_groups"
    )
    assert collection._groups_checked is False, _fail("MetricCollection._groups_checked before the first update")
    collection.update(PREDS, TARGET)
    assert collection._groups_checked is True, _fail("MetricCollection._groups_checked")
    assert isinstance(collection._groups, dict), _fail("MetricCollection._groups")
    assert sorted(map(sorted, collection._groups.values())) == [["acc", "f1", "prec"]], _fail(
        "MetricCollection._groups (compute groups formed from equal states)"
    )
    assert collection.compute_groups == collection._groups, _fail("MetricCollection.compute_groups")


def test_collection_members_of_a_group_share_state_objects():
    # The one-shot sync sends a state object shared by a compute group once (a Ref on the wire).
    collection = _collection()
    collection.update(PREDS, TARGET)
    collection.update(PREDS, TARGET)
    members = dict(collection.items(keep_base=True, copy_state=False))
    assert collection._state_is_copy is False, _fail("MetricCollection._state_is_copy after copy_state=False")
    assert members["acc"].tp is members["prec"].tp is members["f1"].tp, _fail(
        "compute-group members sharing state objects"
    )
    list(collection.items(keep_base=True, copy_state=True))
    assert collection._state_is_copy is True, _fail("MetricCollection._state_is_copy after copy_state=True")
    assert members["acc"].tp is not members["prec"].tp, _fail("MetricCollection.items(copy_state=True)")


def test_collection_compute_and_reduce_returns_each_members_own_compute():
    # torchmetrics_varlen.MetricCollection.compute sets every member's `_computed` from the global states, then lets
    # `_compute_and_reduce("compute")` collect `member.compute()`. It must return each member's own cached value:
    # torchmetrics 1.2.0 to 1.4.0 copied the first member's `_computed` to the whole compute group (and returned the
    # accuracy as precision and F1).
    parameters = list(inspect.signature(StockCollection._compute_and_reduce).parameters)
    assert parameters[:2] == ["self", "method_name"], _fail("MetricCollection._compute_and_reduce signature")
    collection = _collection()
    collection.update(PREDS, TARGET)
    sentinels = {}
    for index, (name, member) in enumerate(collection.items(keep_base=True, copy_state=False)):
        sentinels[name] = member._computed = torch.tensor(float(index))
    result = collection._compute_and_reduce("compute")
    assert result == sentinels, _fail("MetricCollection._compute_and_reduce (members' own cached compute)")


def test_collection_compute_twice_is_stable():
    # The same defect seen from stock usage: a second compute() must not return the group leader's value for all.
    collection = _collection()
    collection.update(PREDS, TARGET)
    first = {k: v.clone() for k, v in collection.compute().items()}
    second = collection.compute()
    assert len({round(v.item(), 6) for v in first.values()}) > 1, "test data no longer separates the metrics"
    for name in first:
        assert torch.equal(first[name], second[name]), _fail(f"MetricCollection compute cache ({name})")


# ------------------------------------------------------------------------------------------------------ torch
def test_torch_join_internals():
    from torch.distributed.algorithms.join import Join, _JoinConfig

    config = _JoinConfig.construct_disabled_join_config()
    assert config.enable is False and hasattr(config, "is_first_joinable"), "torch changed _JoinConfig"
    assert config._replace(enable=True).enable is True, "torch changed _JoinConfig (join.py uses _replace)"
    # join.py's `join` hands Join one joinable standing for the model and the metrics, and gives each member the
    # config Join sets (the `_join_config` attribute that `Join.notify_join_context` reads).
    assert "_join_config" in inspect.getsource(Join._set_joinable_configs), "torch changed Join._set_joinable_configs"
    assert "_join_config" in inspect.getsource(Join.notify_join_context), "torch changed Join.notify_join_context"
    # (No check of `Join._joinables` any more: it served the plain-`Join` rescue, which the runtime dropped; nothing
    # of torchmetrics_varlen reads it now.)
    # With a DDP model, the join's count of running ranks is started on DDP's forward by a forward pre-hook and
    # handed to DDP's reducer as DDP's own notify would (DDP then is not the first joinable).
    from torch.nn.parallel import DistributedDataParallel

    pre_forward = inspect.getsource(DistributedDataParallel._pre_forward)
    assert "_set_forward_pass_work_handle" in pre_forward and "_divide_by_initial_world_size" in pre_forward, (
        "torch changed DistributedDataParallel._pre_forward"
    )


def test_process_group_bound_device_id():
    # _sync.group.bound_device reads it: init_process_group(device_id=...) sets it, new_group inherits it.
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    assert "bound_device_id" in dir(dist.ProcessGroup), "torch removed ProcessGroup.bound_device_id"
    source = inspect.getsource(c10d._new_group_with_tag)
    assert "default_pg.bound_device_id" in source, "torch changed how new_group inherits the bound device"


@pytest.mark.parametrize("name", ["_get_default_store"])
def test_torch_distributed_private_functions(name):
    import torch.distributed.distributed_c10d as c10d

    assert callable(getattr(c10d, name, None)), f"torch changed torch.distributed.distributed_c10d.{name}"


def test_wrapped_compute_is_an_instance_attribute_dropped_by_pickling():
    # MetricCollection wraps each member's `compute` instance attribute (one sync for members computed one by one,
    # as Lightning's log_dict does) and wraps deep copies again: torchmetrics keeps the wrapped compute in the instance
    # dict and drops it from the pickled state, rebuilding it in __setstate__.
    import copy

    metric = SumMetric()
    assert "compute" in vars(metric) and callable(vars(metric)["compute"]), _fail("Metric.compute instance attribute")
    assert "compute" not in metric.__getstate__(), _fail("Metric.__getstate__")
    clone = copy.deepcopy(metric)
    assert "compute" in vars(clone) and vars(clone)["compute"] is not vars(metric)["compute"], _fail("__setstate__")
    metric.update(torch.tensor(2.0))
    assert vars(metric)["compute"]() == 2.0 and metric._should_unsync, _fail("Metric._should_unsync")
