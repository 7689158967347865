"""``ShardedState`` through ``torch.distributed.checkpoint``: each rank writes its share, W' ranks read it exactly.

The metrics and data of ``_resume_cases``, saved with ``dcp.save`` on W in {1, 2, 3} spawned gloo ranks (each rank its
own chunks, empty ranks none) and loaded with ``dcp.load(..., planner=sharded_load_planner())`` on W' in {1, 2, 3, 4}:
right after the load and after more updates, every rank's values equal one process with stock torchmetrics on the
same batches. Then what is written (a chunk per non-empty rank, no zero-row chunk, nothing gathered), and the errors:
a mean state (nothing written), another metric's header, a missing shard, a stock metric's checkpoint, a forgotten
planner: raised on every rank, nothing loaded, no hang.
"""

import os
import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
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
from torch.distributed.checkpoint.api import CheckpointException
from torchmetrics.aggregation import CatMetric, MaxMetric, SumMetric

import torchmetrics_varlen as tv
from torchmetrics_varlen import MergedStateError


def body_save(rank, world_size, directory):
    metrics = build()
    feed(metrics, rank_batches("save", world_size, rank))
    model = torch.nn.Linear(2, 1)  # saved beside the metrics, as a training job does
    dcp.save({"model": model.state_dict(), "metrics": tv.ShardedState(metrics)}, checkpoint_id=directory)
    return compute_all(metrics)


def body_resume(rank, world_size, directory):
    metrics = build()
    model = torch.nn.Linear(2, 1)
    state = {"model": model.state_dict(), "metrics": tv.ShardedState(metrics)}
    dcp.load(state, checkpoint_id=directory, planner=tv.sharded_load_planner())
    resumed = compute_all(metrics)
    feed(metrics, rank_batches("resume", world_size, rank))
    return resumed, compute_all(metrics), update_counts(metrics)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for world_size in (1, 2, 3):
        directory = str(tmp_path_factory.mktemp(f"dcp{world_size}"))
        out[world_size] = (directory, run_distributed(body_save, world_size, directory, deadline=180))
    return out


def _metadata(directory):
    with open(os.path.join(directory, ".metadata"), "rb") as file:
        return pickle.load(file)


@pytest.mark.parametrize("saved_on", [1, 2, 3])
def test_each_rank_writes_its_own_share_and_an_empty_rank_none(saved, saved_on):
    directory, values = saved[saved_on]
    for rank, got in enumerate(values):
        assert_same(got, reference([("save", saved_on)]), f"rank {rank} of {saved_on} before saving")
    stored = _metadata(directory).state_dict_metadata
    sizes = [sum(len(batch) for batch in rank_batches("save", saved_on, rank)) for rank in range(saved_on)]
    # a 2-D cat state: each non-empty rank's rows at its offset; the sum: one row per rank; the model: one copy
    cat = next(md for key, md in stored.items() if key.startswith("metrics.") and getattr(md, "size", None) == (3, 3))
    offsets = [sum(sizes[:rank]) for rank in range(saved_on)]
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in cat.chunks) == sorted(
        ((offsets[r], 0), (n, 3)) for r, n in enumerate(sizes) if n
    )
    assert len(stored["model.weight"].chunks) == 1
    files = sorted(name for name in os.listdir(directory) if name.endswith(".distcp"))
    assert len(files) == saved_on  # every rank wrote its own file: nothing gathered to one rank


@pytest.mark.parametrize("loaded_on", [1, 2, 3, 4])
@pytest.mark.parametrize("saved_on", [1, 2, 3])
def test_resume_through_dcp_on_another_world_size_equals_one_process(saved, saved_on, loaded_on):
    directory = saved[saved_on][0]
    assert_resumed(run_distributed(body_resume, loaded_on, directory, deadline=180), saved_on, loaded_on)


# ------------------------------------------------------------------------------------------------------ errors
class MeanState(tv.Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("avg", default=torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, x):
        self.avg = x.mean()

    def compute(self):
        return self.avg


def body_mean_refused(rank, world_size, directory):
    metric = MeanState()
    metric.update(torch.tensor([1.0]))
    try:
        dcp.save({"metrics": tv.ShardedState(metric)}, checkpoint_id=directory)
    except MergedStateError as err:
        return str(err)
    return None


def test_a_mean_state_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    errors = run_distributed(body_mean_refused, 2, str(tmp_path), deadline=60)
    assert all(error is not None and "dist_reduce_fx='mean'" in error for error in errors), errors
    assert os.listdir(tmp_path) == []


def _catch(fn):
    try:
        fn()
    except (Exception, CheckpointException) as err:  # CheckpointException: DCP's own, a BaseException
        return f"{type(err).__name__}: {err}"
    return None


def body_save_pair(rank, world_size, directory, stock):
    total, rows = tv.rebase(SumMetric)(), tv.rebase(CatMetric)()
    total.update(torch.tensor(float(rank + 1)))
    rows.update(torch.arange(rank + 1.0))
    if stock:  # what a user saves today: the metrics themselves (nn.Module state dicts, persistent states)
        total.persistent(True)
        rows.persistent(True)
        dcp.save({"metrics": {"total": total.state_dict(), "rows": rows.state_dict()}}, checkpoint_id=directory)
    else:
        dcp.save({"metrics": tv.ShardedState({"total": total, "rows": rows})}, checkpoint_id=directory)


def body_load_pair(rank, world_size, directory, case):
    total = tv.rebase(MaxMetric)() if case == "other" else tv.rebase(SumMetric)()
    rows = tv.rebase(CatMetric)()
    total.update(torch.tensor(9.0))  # what a failed load must leave as it is
    state = {"metrics": tv.ShardedState({"total": total, "rows": rows})}
    planner = None if case == "no_planner" else tv.sharded_load_planner()
    error = _catch(lambda: dcp.load(state, checkpoint_id=directory, planner=planner))
    local = getattr(total, next(iter(total._defaults)))  # this rank's own state (compute() would sync it)
    unchanged = local.item() == 9.0 and total._update_count == 1 and rows._update_count == 0
    return error, unchanged


def _drop_chunk(directory, rank):
    """Rewrite the checkpoint's metadata without the rows rank ``rank`` wrote of the `cat` state (a lost shard)."""
    path = os.path.join(directory, ".metadata")
    with open(path, "rb") as file:
        metadata = pickle.load(file)
    rows = next(md for key, md in metadata.state_dict_metadata.items() if key.startswith("metrics.m1"))
    offset = sum(range(1, rank + 1))  # rank r wrote r + 1 rows
    rows.chunks = [chunk for chunk in rows.chunks if chunk.offsets[0] != offset]
    with open(path, "wb") as file:
        pickle.dump(metadata, file)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("other", r"MergedStateError: .*differs at members\.total\.class: saved '.*SumMetric', expected '.*MaxMetric'"),
        ("lost_chunk", r"MergedStateError: .*share of rank 1 of 3 \(state `value` .*: 2 rows from row 1\) is missing"),
        ("lost_file", r"CheckpointException: .*No such file"),
        ("stock", r"CheckpointException: .*Expected a sharded state of metrics .* under `metrics`.*a stock metric"),
        (
            "no_planner",
            r"CheckpointException: .*TypeError: Expected `torch.distributed.checkpoint.load\(.*sharded_load_planner",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_raises_on_every_rank_and_loads_nothing(tmp_path, case, message):
    directory = str(tmp_path)
    run_distributed(body_save_pair, 3, directory, case == "stock", deadline=60)
    if case == "lost_chunk":
        _drop_chunk(directory, 1)
    elif case == "lost_file":
        os.remove(os.path.join(directory, "__1_0.distcp"))
    results = run_distributed(body_load_pair, 2, directory, case, deadline=60)
    for rank, (error, unchanged) in enumerate(results):
        assert error is not None and re.search(message, error, re.DOTALL), (rank, error)
        assert unchanged, f"rank {rank}: a failed load changed the metrics"


def test_without_a_process_group_the_state_is_one_process_s(tmp_path):
    metric = tv.rebase(CatMetric)()
    metric.update(torch.tensor([1.0, 2.0]))
    dcp.save({"m": tv.ShardedState(metric)}, checkpoint_id=str(tmp_path), no_dist=True)
    resumed = tv.rebase(CatMetric)()
    dcp.load(
        {"m": tv.ShardedState(resumed)}, checkpoint_id=str(tmp_path), planner=tv.sharded_load_planner(), no_dist=True
    )
    resumed.update(torch.tensor([3.0]))
    assert resumed.compute().tolist() == [1.0, 2.0, 3.0]
