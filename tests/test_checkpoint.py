"""``merged_state_dict`` / ``load_merged_state_dict``: saved on W ranks, resumed on W' ranks, equal to one process.

Every metric of ``_resume_cases`` (a sum, a max, a 2-D ``cat``, AUROC, a retrieval metric, ``IndexedMetric`` with
samples seen again after the resume, an object state, ``ScalarLog``, a collection with a compute group) is updated on
W in {1, 2, 3} spawned gloo ranks (some empty), saved by rank 0 with ``torch.save``, loaded on W' in {1, 2, 3, 4}
(more ranks than saved rows), computed right away and after more updates on the new ranks: both equal one process with
stock torchmetrics on the same batches. Then the errors (every rank raises, nothing loaded, no hang), and the table of
what stock torchmetrics does, which the docs page "Checkpoints and a new world size" shows.
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from _resume_cases import (
    assert_resumed,
    assert_same,
    build,
    compute_all,
    feed,
    rank_batches,
    reference,
    update_counts,
)
from conftest import run_distributed
from torchmetrics import Metric as StockMetric
from torchmetrics.aggregation import CatMetric, MaxMetric, SumMetric

import torchmetrics_varlen as tv
from torchmetrics_varlen import MergedStateError


def _local_states(metrics):
    """Every state of every metric, as plain values (to check that saving changes nothing)."""
    out = {}
    for name, metric in metrics.items():
        members = metric.items(keep_base=True) if isinstance(metric, tv.MetricCollection) else [(name, metric)]
        for key, member in members:
            for state in member._defaults:
                value = getattr(member, state)
                out[f"{name}.{key}.{state}"] = (
                    [v.tolist() if torch.is_tensor(v) else v for v in value]
                    if isinstance(value, list)
                    else value.tolist()
                )
            out[f"{name}.{key}.count"] = member._update_count
    return out


# --------------------------------------------------------------------------------------------------- bodies
def body_save(rank, world_size, path):
    metrics = build()
    feed(metrics, rank_batches("save", world_size, rank))
    before = _local_states(metrics)
    states = {name: tv.merged_state_dict(metric) for name, metric in metrics.items()}
    assert _local_states(metrics) == before, "merged_state_dict changed the metric"
    if rank == 0:
        torch.save(states, path)
    headers = {name: state["header"] for name, state in states.items()}
    return headers, compute_all(metrics)


def body_resume(rank, world_size, path):
    metrics = build()
    states = torch.load(path)  # weights_only: a merged state holds tensors, numbers, strings, lists and dicts only
    for name, metric in metrics.items():
        tv.load_merged_state_dict(metric, states[name])
    resumed = compute_all(metrics)
    feed(metrics, rank_batches("resume", world_size, rank))
    return resumed, compute_all(metrics), update_counts(metrics)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each saving world's file, made once: {W: (path, rank-0 headers, every rank's values before saving)}."""
    out = {}
    for world_size in (1, 2, 3):
        path = str(tmp_path_factory.mktemp(f"merged{world_size}") / "metrics.pt")
        results = run_distributed(body_save, world_size, path, deadline=180)
        out[world_size] = (path, results[0][0], [values for _, values in results])
    return out


@pytest.mark.parametrize("saved_on", [1, 2, 3])
def test_saving_is_exact_and_changes_nothing(saved, saved_on):
    _, headers, values = saved[saved_on]
    truth = reference([("save", saved_on)])
    for rank, got in enumerate(values):
        assert_same(got, truth, f"rank {rank} of {saved_on} before saving")
    assert headers["sum"] == {
        "format": "torchmetrics_varlen.merged_state_dict",
        "version": 1,
        "class": "torchmetrics.aggregation.SumMetric",
        "states": {"sum_value": "tensor/sum"},
        "world_size": saved_on,
    }
    assert headers["scalars"]["states"] == {"scalars": "scalar_log"}
    assert "children" not in headers["indexed"]  # its template never syncs: no state of its own
    assert set(headers["collection"]["members"]) == {"acc", "prec", "rec", "ap"}


@pytest.mark.parametrize("loaded_on", [1, 2, 3, 4])
@pytest.mark.parametrize("saved_on", [1, 2, 3])
def test_resume_on_another_world_size_equals_one_process(saved, saved_on, loaded_on):
    path = saved[saved_on][0]
    assert_resumed(run_distributed(body_resume, loaded_on, path, deadline=180), saved_on, loaded_on)


# ------------------------------------------------------------------------------------------ single process
def test_a_collection_and_a_mapping_save_every_member_with_one_header():
    metrics = tv.MetricCollection({"sum": SumMetric(), "cat": CatMetric()})
    metrics.update(torch.tensor([1.0, 2.0]))
    state = tv.merged_state_dict(metrics)
    assert state["header"]["members"] == {
        "cat": {"class": "torchmetrics.aggregation.CatMetric", "states": {"value": "list/cat"}},
        "sum": {"class": "torchmetrics.aggregation.SumMetric", "states": {"sum_value": "tensor/sum"}},
    }
    assert state["members"]["sum"] == {"states": {"sum_value": torch.tensor(3.0)}, "update_count": 1}
    named = tv.merged_state_dict({"a": SumMetric(), "b": metrics})
    assert named["header"]["class"] == "metrics" and set(named["members"]) == {"a", "b"}
    assert named["members"]["b"]["members"]["cat"]["states"]["value"].tolist() == [1.0, 2.0]


def test_the_merged_state_shares_no_memory_with_the_metric():
    metric = SumMetric()
    metric.update(torch.tensor(2.0))
    state = tv.merged_state_dict(metric)
    metric.update(torch.tensor(5.0))  # in place
    assert state["states"]["sum_value"].item() == 2.0
    resumed = SumMetric()
    tv.load_merged_state_dict(resumed, state)
    resumed.update(torch.tensor(1.0))
    assert state["states"]["sum_value"].item() == 2.0 and resumed.compute().item() == 3.0


def test_wrappers_save_their_child_metrics():
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.wrappers import ClasswiseWrapper

    def fresh():
        return ClasswiseWrapper(MulticlassAccuracy(num_classes=3, average=None))

    metric = fresh()
    metric.update(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2]))
    state = tv.merged_state_dict(metric)
    assert list(state["children"]) == ["metric"]
    resumed = fresh()
    tv.load_merged_state_dict(resumed, state)
    reference_metric = fresh()
    for m in (resumed, reference_metric):
        m.update(torch.tensor([1, 0]), torch.tensor([1, 1]))
    reference_metric.update(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2]))
    assert {k: v.item() for k, v in resumed.compute().items()} == {
        k: v.item() for k, v in reference_metric.compute().items()
    }


def test_reduced_states_take_the_dtype_and_device_of_the_metric():
    metric = SumMetric().set_dtype(torch.float64)
    metric.update(torch.tensor(1.5, dtype=torch.float64))
    state = tv.merged_state_dict(metric)
    resumed = SumMetric()  # float32
    tv.load_merged_state_dict(resumed, state)
    assert resumed.sum_value.dtype == torch.float32 and resumed.sum_value.item() == 1.5


# ------------------------------------------------------------------------------------------------------ errors
class MeanState(tv.Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("avg", default=torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, x):
        self.avg = x.mean()

    def compute(self):
        return self.avg


class CustomState(StockMetric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx=lambda stacked: stacked.sum(0))

    def update(self, x):
        self.total += x.sum()

    def compute(self):
        return self.total


class PerRank(StockMetric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("kept", default=torch.tensor(0.0), dist_reduce_fx=None)

    def update(self, x):
        self.kept += x.sum()

    def compute(self):
        return self.kept


def test_unmergeable_states_are_refused_by_name():
    with pytest.raises(MergedStateError, match=r"state `avg` has dist_reduce_fx='mean'.*Keep a sum state"):
        tv.merged_state_dict(MeanState())
    with pytest.raises(MergedStateError, match=r"state `total` has a custom dist_reduce_fx \(CustomState"):
        tv.MergedState(CustomState())
    with pytest.raises(MergedStateError, match=r"dist_reduce_fx=None on a tensor state"):
        tv.ShardedState(PerRank())
    collection = tv.MetricCollection({"ok": SumMetric(), "bad": MeanState()})
    with pytest.raises(MergedStateError, match=r"MetricCollection\['bad'\]"):
        tv.merged_state_dict(collection)
    with pytest.raises(TypeError, match="Expected a torchmetrics Metric or MetricCollection"):
        tv.merged_state_dict(torch.nn.Linear(2, 2))


def body_refused(rank, world_size, path, kind):
    metric = MeanState() if kind == "mean" else CustomState()
    metric.update(torch.tensor([float(rank)]))
    try:
        state = tv.merged_state_dict(metric)
    except MergedStateError as err:
        return str(err)
    if rank == 0:
        torch.save(state, path)
    return None


@pytest.mark.parametrize("kind", ["mean", "custom"])
def test_refused_on_every_rank_before_anything_is_written(tmp_path, kind):
    path = str(tmp_path / "never.pt")
    errors = run_distributed(body_refused, 3, path, kind, deadline=60)
    assert all(error is not None and "mergeable" in error for error in errors), errors
    assert not os.path.exists(path)


def body_mismatch(rank, world_size, path, case):
    saved = SumMetric() if case != "scalars" else tv.ScalarLog(reduce="sum")
    if case == "scalars":
        saved.update({"loss": 1.0})
    else:
        saved.update(torch.tensor(float(rank + 1)))
    state = tv.merged_state_dict(saved)
    if case == "stock":
        saved.persistent(True)
        state = saved.state_dict()  # what Lightning and Accelerate write
    target = {"other": tv.rebase(MaxMetric)(), "stock": SumMetric(), "scalars": tv.ScalarLog(reduce="max")}.get(
        case, SumMetric()
    )
    if case == "one_rank":  # only rank 1 gets a state of another metric
        target = SumMetric()
        other = tv.merged_state_dict(tv.rebase(MaxMetric)())  # on every rank: a collective
        state = other if rank == 1 else state
    elif case == "newer":
        state = dict(state, header=dict(state["header"], version=99))
    elif case == "truncated":
        state = dict(state, states={})
    kept = torch.tensor(7.0) if not isinstance(target, tv.ScalarLog) else None
    if kept is not None:
        target.update(kept)
    before = _local_states({"t": target}) if not isinstance(target, tv.ScalarLog) else None
    try:
        tv.load_merged_state_dict(target, state)
    except MergedStateError as err:
        if before is not None:
            assert _local_states({"t": target}) == before, "a failed load changed the metric"
        return str(err)
    return None


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("other", r"differs at class: saved 'torchmetrics.aggregation.SumMetric', expected .*MaxMetric"),
        ("stock", r"without its header: a stock `state_dict\(\)` holds one rank's states"),
        ("scalars", r"key 'loss' .* saved with reduce='sum' but this ScalarLog reduces it with 'max'"),
        ("newer", r"format version 1 or older .* got version 99"),
        ("truncated", r"to hold what its header lists"),
        ("one_rank", r"ranks \[1\]"),
    ],
)
def test_a_state_that_does_not_fit_raises_on_every_rank_and_loads_nothing(case, message):
    errors = run_distributed(body_mismatch, 2, "", case, deadline=60)
    assert all(error is not None for error in errors), errors
    assert any(__import__("re").search(message, error) for error in errors), errors


def body_synced(rank, world_size):
    metric = tv.rebase(SumMetric)()
    metric.update(torch.tensor(float(rank + 1)))
    with metric.sync_context():  # every rank holds the global sum: saving it now would count it twice
        try:
            tv.merged_state_dict(metric)
        except MergedStateError as err:
            return str(err)
    return None


def test_a_synced_metric_is_refused_on_every_rank():
    errors = run_distributed(body_synced, 2, deadline=60)
    assert all(error is not None and "it is synced" in error for error in errors), errors


# --------------------------------------------------------------------------------------- what stock does
def _stock_pair():
    return SumMetric(), CatMetric()


def body_stock_save(rank, world_size, directory, how):
    """Rank r adds r + 1 to a SumMetric and r + 1 rows to a CatMetric; saved as users do today, or merged."""
    import torch.distributed.checkpoint as dcp

    total, rows = _stock_pair()
    if how != "default":
        total.persistent(True)
        rows.persistent(True)
    total.update(torch.tensor(float(rank + 1)))
    rows.update(torch.ones(rank + 1))
    if how in ("dcp", "dcp_fresh"):
        dcp.save({"total": total, "rows": rows}, checkpoint_id=directory)
    elif how == "sharded":
        dcp.save({"metrics": tv.ShardedState({"total": total, "rows": rows})}, checkpoint_id=directory)
    elif how == "merged":
        state = {"total": tv.merged_state_dict(total), "rows": tv.merged_state_dict(rows)}
        if rank == 0:
            torch.save(state, os.path.join(directory, "metrics.pt"))
    elif rank == 0:  # the file Lightning and Accelerate write: rank 0's `state_dict()`
        torch.save({"total": total.state_dict(), "rows": rows.state_dict()}, os.path.join(directory, "metrics.pt"))
    dist.barrier()


def body_stock_load(rank, world_size, directory, how):
    import torch.distributed.checkpoint as dcp

    total, rows = _stock_pair()
    if how != "default":
        total.persistent(True)
        rows.persistent(True)
    if how == "dcp_fresh":  # a fresh CatMetric's empty list names no item to load into
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            dcp.load({"total": total, "rows": rows}, checkpoint_id=directory)
        except (Exception, CheckpointException) as err:
            return "raised", "Missing key in checkpoint state_dict: rows.value." in str(err)
    if how == "sharded":
        state = {"metrics": tv.ShardedState({"total": total, "rows": rows})}
        dcp.load(state, checkpoint_id=directory, planner=tv.sharded_load_planner())
    elif how == "dcp":
        # DCP loads a list state item by item, into items of the saved sizes: shaped as the checkpoint says
        saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
        rows.value = [torch.empty(saved[key].size) for key in sorted(saved) if key.startswith("rows.value.")]
        dcp.load({"total": total, "rows": rows}, checkpoint_id=directory)
    else:
        state = torch.load(os.path.join(directory, "metrics.pt"))
        load = tv.load_merged_state_dict if how == "merged" else lambda metric, sd: metric.load_state_dict(sd)
        load(total, state["total"])
        load(rows, state["rows"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        total.update(torch.tensor(0.0))  # a step with nothing to add, so that every rank syncs
        rows.update(torch.ones(0))
        return total.compute().item(), rows.compute().numel()


# The docs' table (docs/checkpoints.rst): saved on 2 ranks (the truth: a sum of 3 and 3 rows), loaded on 1, 2, 3.
STOCK_TABLE = {
    "default": {1: (0.0, 0), 2: (0.0, 0), 3: (0.0, 0)},  # states are not persistent: the partial epoch is lost
    "persistent": {1: (1.0, 1), 2: (2.0, 2), 3: (3.0, 3)},  # W' x rank 0's share
    "dcp": {1: (1.0, 2), 2: (2.0, 4), 3: (3.0, 6)},  # one rank's copy per key (rank 0's sum, rank 1's rows)
    "dcp_fresh": {w: ("raised", True) for w in (1, 2, 3)},  # into a fresh CatMetric: "Missing key"
    "merged": {1: (3.0, 3), 2: (3.0, 3), 3: (3.0, 3)},  # the fix
    "sharded": {1: (3.0, 3), 2: (3.0, 3), 3: (3.0, 3)},  # the fix, through DCP
}


@pytest.mark.parametrize("how", list(STOCK_TABLE))
def test_what_stock_torchmetrics_does_across_a_new_world_size(tmp_path, how):
    directory = str(tmp_path)
    run_distributed(body_stock_save, 2, directory, how, deadline=120)
    for world_size, expected in STOCK_TABLE[how].items():
        results = run_distributed(body_stock_load, world_size, directory, how, deadline=120)
        assert results == [expected] * world_size, (how, world_size, results)


# ----------------------------------------------------------------------------------------------------- the example
def test_the_docs_example_resumes_on_another_number_of_processes(tmp_path):
    """``examples/checkpoint_resume.py`` (shown by the docs page): saved on 2 processes, resumed on 3."""
    import ast

    from _helpers import run_torchrun

    outputs = []
    for phase, processes in (("save", 2), ("resume", 3)):
        returncode, stdout, stderr = run_torchrun(
            ["examples/checkpoint_resume.py", phase, str(tmp_path)], 240, nproc=processes
        )
        assert returncode == 0, f"{phase}: exit {returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
        outputs.append(stdout)
    lines = dict(line.split(": ", 1) for line in outputs[1].splitlines() if ": {" in line)
    resumed, truth = (
        ast.literal_eval(lines["resumed on 3 processes"]),
        ast.literal_eval(lines["one process on all 100 samples"]),
    )
    assert resumed == truth and set(resumed) == {"acc", "auroc"}
