"""A real ``lightning.Trainer`` with DDP on 2 gloo CPU ranks logging torchmetrics_varlen metrics.

How the Trainer runs here: inside the test-suite's own spawned gloo workers (``run_distributed``), with Lightning's
``DDPStrategy`` and a ``ClusterEnvironment`` that reports the process group the worker already has. Lightning then
launches nothing and initialises nothing (it skips ``init_process_group`` when a group exists) but does everything
else as in any DDP run: wraps the model in ``DistributedDataParallel``, runs the loops, logs, and computes the
logged metric objects at epoch end. Lightning's own launchers would re-run the pytest command line in child processes
(``strategy="ddp"``) or need a free TCP port (``"ddp_spawn"``); the same module is run under ``torchrun`` with
``strategy="ddp"`` and Lightning's own environment detection by ``tests/test_torchrun.py`` (see ``main`` below).

Samplers: Lightning's default validation sampler is ``DistributedSampler(shuffle=False)``, which pads the 21 samples
to 22 by repeating sample 0. A distributed metric that is exact about what the ranks hold then counts sample 0 twice:
the logged value equals one process on the *padded* data, not on the data set. The tests check both setups against
the samples the ranks actually saw: with ``use_distributed_sampler=False`` and
:class:`~torchmetrics_varlen.UnpaddedDistributedSampler` every sample is seen once and the logged epoch values equal
one process on the full validation set; with Lightning's sampler they equal one process on the padded list.

Field report 5 (``self.log`` / ``compute()`` under ``if self.trainer.is_global_zero:``) must end in
``SyncTimeoutError`` on rank 0 within the configured sync timeout, not hang: those run in fresh pools (the timed-out
rank leaves a pending collective behind) under a hard outer deadline.
"""

import json
import os
import sys
import time
import traceback
import warnings

import pytest

pytest.importorskip("lightning", reason="lightning is not installed (pip install 'torchmetrics-varlen[lightning]')")

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _helpers import sync_labels
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryAveragePrecision
from torchmetrics.functional.classification import (
    binary_accuracy,
    binary_auroc,
    binary_average_precision,
)

import torchmetrics_varlen as tv

N_TRAIN, TRAIN_BATCH = 16, 4  # 8 samples, 2 batches per rank: DDP training needs equal step counts
N_VAL, VAL_BATCH = 21, 5  # not a multiple of the world size; unpadded shards of 11 and 10: 3 and 2 batches
LIGHTNING_POOL = {"TMV_TEST_POOL": "lightning"}  # a pool of its own: Lightning changes process-wide state


# --------------------------------------------------------------------------------------------------- metrics
class MeanSquaredError(tv.Metric):
    """A metric written on torchmetrics_varlen.Metric."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("sum_sq", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds, target):
        self.sum_sq += ((preds.double() - target.double()) ** 2).sum()
        self.count += target.numel()

    def compute(self):
        return self.sum_sq / self.count


class SampleCount(tv.Metric):
    """How many samples the ranks saw in all: 21 without padding, 22 with Lightning's padding sampler."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("count", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, target):
        self.count += target.numel()

    def compute(self):
        return self.count


def _data(n, seed):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 2, (n,), generator=gen)
    # Scores independent of the model: the reference is exact whatever training does to the weights.
    scores = torch.sigmoid(1.5 * (target.float() - 0.5) + torch.randn(n, generator=gen))
    return TensorDataset(torch.randn(n, 3, generator=gen), scores, target, torch.arange(n))


class LitModel(pl.LightningModule):
    """Logs metric objects (on_step and on_epoch) in training and validation, and a collection's compute()."""

    def __init__(self, positive_control=False):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.positive_control = positive_control
        self.train_acc = tv.rebase(BinaryAccuracy)()
        self.train_mse = MeanSquaredError()
        self.val_auroc = tv.rebase(BinaryAUROC)(thresholds=None)
        self.val_mse = MeanSquaredError()
        self.val_count = SampleCount()
        self.val_metrics = tv.MetricCollection(
            {"acc": BinaryAccuracy(), "ap": BinaryAveragePrecision(thresholds=None), "auroc": BinaryAUROC()},
            prefix="valcol_",
        )
        self.seen = {"train": [], "val": []}
        self.last_batch = {}

    def training_step(self, batch, batch_idx):
        x, scores, target, index = batch
        self.seen["train"].append(index)
        self.last_batch["train"] = (scores, target)
        self.train_acc(scores, target)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.train_mse(scores, target)
        self.log("train_mse", self.train_mse, on_step=True, on_epoch=True)
        return self.layer(x).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        x, scores, target, index = batch
        self.layer(x)  # through DDP's forward, with different numbers of validation batches on the ranks
        self.seen["val"].append(index)
        self.last_batch["val"] = (scores, target)
        self.val_auroc(scores, target)
        self.log("val_auroc", self.val_auroc, on_step=True, on_epoch=True)
        self.val_mse(scores, target)
        self.log("val_mse", self.val_mse, on_step=True, on_epoch=True)
        self.val_count.update(target)
        # sync_dist is ignored for metric objects: the metric syncs itself, Lightning must not reduce it again.
        self.log("val_count", self.val_count, on_step=False, on_epoch=True, sync_dist=True)
        self.val_metrics.update(scores, target)
        if self.positive_control:
            # A plain tensor with sync_dist: Lightning reduces this one itself (the double-reduction detector sees it).
            self.log("val_batches", torch.tensor(1.0), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)

    def on_validation_epoch_end(self):
        # Every rank runs this: one coalesced sync for the whole collection, plain (global) tensors logged.
        self.log_dict(self.val_metrics.compute())
        self.val_metrics.reset()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ExistingProcessGroup(ClusterEnvironment):
    """Tells Lightning about the process group this process already belongs to; Lightning creates no processes."""

    @property
    def creates_processes_externally(self):
        return True

    @property
    def main_address(self):
        return "127.0.0.1"

    @property
    def main_port(self):
        return 0  # never used: Lightning does not initialise a group that exists

    @staticmethod
    def detect():
        return dist.is_available() and dist.is_initialized()

    def world_size(self):
        return dist.get_world_size()

    def set_world_size(self, size):
        assert size == dist.get_world_size(), (size, dist.get_world_size())

    def global_rank(self):
        return dist.get_rank()

    def set_global_rank(self, rank):
        assert rank == dist.get_rank(), (rank, dist.get_rank())

    def local_rank(self):
        return dist.get_rank()

    def node_rank(self):
        return 0


def _trainer(strategy, world_size, **settings):
    """A quiet CPU Trainer of one epoch on ``strategy``; ``settings`` add to or replace the Trainer's arguments."""
    quiet = {"max_epochs": 1, "num_sanity_val_steps": 0, "logger": False, "enable_checkpointing": False}
    quiet |= {"enable_progress_bar": False, "enable_model_summary": False}
    return pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, **(quiet | settings))


def _loaders(rank, world_size, unpadded):
    train, val = _data(N_TRAIN, 1), _data(N_VAL, 2)
    if unpadded:
        train_sampler = DistributedSampler(train, world_size, rank, shuffle=False)
        val_sampler = tv.UnpaddedDistributedSampler(val, world_size, rank)
        return (
            DataLoader(train, batch_size=TRAIN_BATCH, sampler=train_sampler),
            DataLoader(val, batch_size=VAL_BATCH, sampler=val_sampler),
        )
    # Lightning replaces the samplers by DistributedSampler (padding) itself.
    return DataLoader(train, batch_size=TRAIN_BATCH), DataLoader(val, batch_size=VAL_BATCH)


class SyncRecorder:
    """Records this package's syncs (one metadata exchange each) and the collectives of Lightning's logging."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "gather")

    def __init__(self):
        self.syncs = []
        self.lightning_reductions = 0  # collectives issued from Lightning's logging (its `sync_dist` reduction)

    def __enter__(self):
        self._labels = sync_labels()
        self.syncs = self._labels.__enter__()
        self._originals = {name: getattr(dist, name) for name in self.NAMES}

        def wrap(fn):
            def collective(*args, **kwargs):
                if any("logger_connector" in frame.filename for frame in traceback.extract_stack()):
                    self.lightning_reductions += 1
                return fn(*args, **kwargs)

            return collective

        for name, fn in self._originals.items():
            setattr(dist, name, wrap(fn))
        return self

    def __exit__(self, *exc):
        self._labels.__exit__(*exc)
        for name, fn in self._originals.items():
            setattr(dist, name, fn)


def _fit(strategy, rank, world_size, unpadded, positive_control=False):
    model = LitModel(positive_control=positive_control)
    trainer = _trainer(strategy, world_size, use_distributed_sampler=not unpadded)
    train_loader, val_loader = _loaders(rank, world_size, unpadded)
    with warnings.catch_warnings(), SyncRecorder() as recorder:
        warnings.simplefilter("ignore")
        trainer.fit(model, train_loader, val_loader)
    as_float = {name: float(value) for name, value in trainer.callback_metrics.items()}
    logged = {name: float(value) for name, value in trainer.logged_metrics.items()}
    return {
        "callback": as_float,
        "logged": logged,
        "seen": {stage: torch.cat(parts).tolist() for stage, parts in model.seen.items()},
        "last_batch": {stage: [t.tolist() for t in pair] for stage, pair in model.last_batch.items()},
        "syncs": recorder.syncs,
        "lightning_reductions": recorder.lightning_reductions,
    }


def body_fit(rank, world_size, unpadded, positive_control=False):
    strategy = DDPStrategy(cluster_environment=ExistingProcessGroup(), process_group_backend="gloo")
    return _fit(strategy, rank, world_size, unpadded, positive_control)


# ------------------------------------------------------------------------------------------------ reference
def expected_epoch_values(seen_train, seen_val):
    """One process on exactly the samples the ranks saw (duplicates included), with stock torchmetrics functions."""
    _, s_train, t_train, _ = _data(N_TRAIN, 1).tensors
    _, s_val, t_val, _ = _data(N_VAL, 2).tensors
    s_train, t_train = s_train[seen_train], t_train[seen_train]
    s_val, t_val = s_val[seen_val], t_val[seen_val]
    return {
        "train_acc_epoch": binary_accuracy(s_train, t_train).item(),
        "train_mse_epoch": ((s_train.double() - t_train.double()) ** 2).mean().item(),
        "val_auroc_epoch": binary_auroc(s_val, t_val).item(),
        "val_mse_epoch": ((s_val.double() - t_val.double()) ** 2).mean().item(),
        "val_count": float(len(seen_val)),
        "valcol_acc": binary_accuracy(s_val, t_val).item(),
        "valcol_ap": binary_average_precision(s_val, t_val).item(),
        "valcol_auroc": binary_auroc(s_val, t_val, thresholds=None).item(),
    }


def expected_step_values(last_batch):
    """The on_step values: the rank's own last batch, computed locally (per-step values are not synced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a batch of one class: AUROC warns and returns 0
        s, t = (torch.tensor(v) for v in last_batch["train"])
        sv, tv_ = (torch.tensor(v) for v in last_batch["val"])
        return {
            "train_acc_step": binary_accuracy(s, t).item(),
            "train_mse_step": ((s.double() - t.double()) ** 2).mean().item(),
            "val_auroc_step": binary_auroc(sv, tv_).item(),
            "val_mse_step": ((sv.double() - tv_.double()) ** 2).mean().item(),
        }


# One sync per metric object and epoch, the collection once, in the order Lightning computes them.
EXPECTED_SYNCS = sorted(
    [
        "MetricCollection",
        "BinaryAUROC.compute",
        "MeanSquaredError.compute",
        "SampleCount.compute",
        "BinaryAccuracy.compute",
        "MeanSquaredError.compute",
    ]
)


def check_fit_results(results, unpadded, positive_control=False):
    """Assertions shared with the torchrun run of this module."""
    world_size = len(results)
    seen_train = [i for r in results for i in r["seen"]["train"]]
    seen_val = [i for r in results for i in r["seen"]["val"]]
    assert sorted(seen_train) == list(range(N_TRAIN)), "training data must be split evenly, each sample once"
    if unpadded:
        assert sorted(seen_val) == list(range(N_VAL)), "UnpaddedDistributedSampler: every sample exactly once"
    else:
        # Lightning's DistributedSampler pads 21 samples to 22 with a repeat of sample 0.
        padded_len = -(-N_VAL // world_size) * world_size
        assert len(seen_val) == padded_len and sorted(set(seen_val)) == list(range(N_VAL))
    expected = expected_epoch_values(seen_train, seen_val)
    for rank, result in enumerate(results):
        for name, value in expected.items():
            # Epoch values: the same on every rank, and equal to one process on the data the ranks held.
            assert result["callback"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), (rank, name)
            assert result["logged"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), (rank, name)
        for name, value in expected_step_values(result["last_batch"]).items():
            assert result["logged"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), (rank, name)
        assert sorted(result["syncs"]) == EXPECTED_SYNCS, (rank, result["syncs"])
        # Lightning's own reduction of logged values never touched a metric (only the positive control, if any).
        if positive_control:
            assert result["lightning_reductions"] > 0, "the positive control was not seen: the check is blind"
        else:
            assert result["lightning_reductions"] == 0, "Lightning reduced a logged metric value a second time"
    return expected


# ------------------------------------------------------------------------------------------------------ tests
def test_trainer_ddp_with_unpadded_sampler_logs_single_process_values():
    from conftest import run_distributed

    results = run_distributed(body_fit, 2, True, deadline=120, env=LIGHTNING_POOL)
    expected = check_fit_results(results, unpadded=True)
    # And those are the values of one process on the whole validation set.
    full = expected_epoch_values(list(range(N_TRAIN)), list(range(N_VAL)))
    assert expected == pytest.approx(full)
    assert expected["val_count"] == N_VAL


def test_trainer_ddp_with_lightning_sampler_counts_the_padding():
    from conftest import run_distributed

    results = run_distributed(body_fit, 2, False, True, deadline=120, env=LIGHTNING_POOL)
    expected = check_fit_results(results, unpadded=False, positive_control=True)
    assert expected["val_count"] == N_VAL + 1  # exact about what the ranks held: the padded duplicate included
    # Positive control of the double-reduction check: a plain tensor logged with sync_dist=True is reduced by
    # Lightning (and summed over both ranks' batches: 3 + 3 with padding), while none of the metrics were.
    assert all(r["callback"]["val_batches"] == 6.0 for r in results)


# ------------------------------------------------------------------------------- field report 5: rank 0 only
class GlobalZeroOnly(pl.LightningModule):
    """Field report 5: metrics computed over the whole validation set and logged on rank 0 only."""

    def __init__(self, log_object, sync_timeout=None):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.log_object = log_object
        self.val_auroc = tv.rebase(BinaryAUROC)(thresholds=None, sync_timeout=sync_timeout)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.val_auroc.update(batch[1], batch[2])

    def on_validation_epoch_end(self):
        if self.trainer.is_global_zero:  # the bug: a sync that only rank 0 reaches
            if self.log_object:
                self.log("val_auroc", self.val_auroc)  # computed (and synced) by Lightning at epoch end
            else:
                self.log("val_auroc", self.val_auroc.compute())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def body_global_zero_only(rank, world_size, log_object, sync_timeout):
    strategy = DDPStrategy(cluster_environment=ExistingProcessGroup(), process_group_backend="gloo")
    trainer = _trainer(strategy, world_size, use_distributed_sampler=False)
    model = GlobalZeroOnly(log_object, sync_timeout)
    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, *_loaders(rank, world_size, unpadded=True))
    except tv.SyncTimeoutError as err:
        return {"error": "SyncTimeoutError", "message": str(err), "seconds": time.monotonic() - start}
    except Exception as err:  # any other outcome is a failure, reported with its type
        return {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize(
    ("log_object", "timeout_from"),
    [(False, "argument"), (True, "environment")],
    ids=["compute-under-is_global_zero", "log-metric-object-under-is_global_zero"],
)
def test_rank_zero_only_logging_raises_sync_timeout_instead_of_hanging(log_object, timeout_from):
    from conftest import run_distributed

    env = {"TORCHMETRICS_VARLEN_SYNC_TIMEOUT": "2"} if timeout_from == "environment" else {}
    sync_timeout = 2 if timeout_from == "argument" else None
    start = time.monotonic()
    # fresh: the timed-out rank leaves a pending collective in its process group. deadline: the hard outer limit.
    results = run_distributed(body_global_zero_only, 2, log_object, sync_timeout, deadline=60, fresh=True, env=env)
    assert time.monotonic() - start < 60
    rank0 = results[0]
    assert rank0["error"] == "SyncTimeoutError", rank0
    assert "waited 2 s" in rank0["message"] and "is_global_zero" in rank0["message"]
    assert "Missing: ranks [1]" in rank0["message"]
    assert rank0["seconds"] < 30  # the whole fit, including the 2 s wait
    assert results[1]["error"] is None  # rank 1 never synced: it finished its own fit


# ------------------------------------------------------------------------------------ torchrun entry point
def main():
    """Under ``torchrun --nproc-per-node 2 tests/test_lightning.py``: ``strategy="ddp"`` as users run it.

    Lightning detects torchrun's environment and initialises the process group itself (env://). Each rank writes its
    results to ``rank<N>.json`` in the folder given as the last argument (one file per rank: lines that two ranks print
    to one pipe can interleave); ``tests/test_torchrun.py`` checks them with :func:`check_fit_results`.
    """
    unpadded = "--lightning-sampler" not in sys.argv
    out_dir = sys.argv[-1]
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    result = _fit("ddp", rank, world_size, unpadded)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump({"rank": rank, **result}, out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
