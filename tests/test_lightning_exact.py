"""``torchmetrics_varlen.lightning.ExactEvaluation`` in a real ``lightning.Trainer`` (DDP, gloo CPU ranks).

The Trainers run as in ``test_lightning.py`` (inside the suite's workers, Lightning's ``DDPStrategy`` told about the
existing process group). Nothing in the LightningModule or the data loaders knows about this package's sampler: the
callback alone must make Lightning's validation and test exact (19 validation samples in batches of 3: 4 and 3 batches
on 2 ranks, 3, 2 and 2 on 3), the logged collection must sync once, and a per-step collective in validation with
uneven step counts, or uneven training step counts, must raise ``UnevenStepsError`` on every rank instead of hanging.
"""

import os
import warnings

import pytest

pytest.importorskip("lightning", reason="lightning is not installed (pip install 'torchmetrics-varlen[lightning]')")

import lightning.pytorch as pl
import torch
from _helpers import sync_labels
from lightning.pytorch.strategies import DDPStrategy
from test_lightning import LIGHTNING_POOL, ExistingProcessGroup, MeanSquaredError, _data
from test_lightning import _trainer as lightning_trainer
from torch.utils.data import DataLoader
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryAveragePrecision
from torchmetrics.functional.classification import binary_accuracy, binary_auroc, binary_average_precision

import torchmetrics_varlen as tv
from torchmetrics_varlen.lightning import ExactEvaluation, UnevenStepsError

N_TRAIN, TRAIN_BATCH = 16, 4
N_VAL, N_TEST, EVAL_BATCH = 19, 17, 3


class ExactModel(pl.LightningModule):
    """Plain Lightning code: metric objects and a collection logged in validation and test, nothing else."""

    def __init__(self, step_sync=False):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.step_sync = step_sync
        self.val_auroc = tv.rebase(BinaryAUROC)(thresholds=None)
        self.val_mse = MeanSquaredError()
        self.val_metrics = tv.MetricCollection(
            {"acc": BinaryAccuracy(), "ap": BinaryAveragePrecision(thresholds=None)}, prefix="valcol_"
        )
        self.test_mse = MeanSquaredError()
        self.seen = {"val": [], "test": []}
        self.val_samplers = []

    def on_validation_epoch_start(self):
        self.val_samplers.append(type(self.trainer.val_dataloaders.sampler).__name__)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        x, scores, target, index = batch
        self.seen["val"].append(index)
        self.val_auroc(scores, target)
        self.log("val_auroc", self.val_auroc)
        self.val_mse.update(scores, target)
        self.log("val_mse", self.val_mse)
        self.val_metrics.update(scores, target)
        self.log_dict(self.val_metrics)  # members computed by Lightning at epoch end: one sync for all
        # A plain tensor with sync_dist and the default on_step=False: reduced once at epoch end, fine when uneven.
        self.log("val_batches", torch.tensor(1.0), reduce_fx="sum", sync_dist=True)
        if self.step_sync:  # a collective on every step: hangs when the ranks run different step counts
            self.log("val_loss", self.layer(x).pow(2).mean(), on_step=True, on_epoch=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        _, scores, target, index = batch
        self.seen["test"].append(index)
        self.test_mse.update(scores, target)
        self.log("test_mse", self.test_mse)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(world_size, callbacks, **kwargs):
    strategy = DDPStrategy(cluster_environment=ExistingProcessGroup(), process_group_backend="gloo")
    return lightning_trainer(strategy, world_size, callbacks=callbacks, **kwargs)


def body_exact(rank, world_size):
    model = ExactModel()
    trainer = _trainer(world_size, [ExactEvaluation()])
    # Plain loaders, as in any single-device script: Lightning shards them (the callback without padding).
    train = DataLoader(_data(N_TRAIN, 1), batch_size=TRAIN_BATCH)
    val = DataLoader(_data(N_VAL, 2), batch_size=EVAL_BATCH)
    test = DataLoader(_data(N_TEST, 3), batch_size=EVAL_BATCH, shuffle=True)
    with warnings.catch_warnings(), sync_labels() as labels:
        warnings.simplefilter("ignore")
        trainer.fit(model, train, val)
        fit_values = {name: float(value) for name, value in trainer.callback_metrics.items()}
        val_sampler = trainer.val_dataloaders.sampler
        trainer.test(model, test)
        test_values = {name: float(value) for name, value in trainer.callback_metrics.items()}
        test_sampler = trainer.test_dataloaders.sampler
        # A custom sampler (here a reversed order): Lightning's own unrepeated wrapper around it.
        fit_seen = len(model.seen["val"])
        trainer.validate(model, DataLoader(_data(N_VAL, 2), batch_size=EVAL_BATCH, sampler=list(range(N_VAL))[::-1]))
        custom_values = {name: float(value) for name, value in trainer.callback_metrics.items()}
    samplers = [type(val_sampler).__name__, type(test_sampler).__name__, test_sampler.shuffle]
    return {
        "fit": fit_values,
        "test": test_values,
        "custom": custom_values,
        "samplers": [*samplers, model.val_samplers[-1]],
        "custom_seen": torch.cat(model.seen["val"][fit_seen:]).tolist(),
        "seen": {stage: torch.cat(parts).tolist() for stage, parts in model.seen.items()},
        "batches": [trainer.num_val_batches[0], trainer.num_test_batches[0]],
        "syncs": labels,
        "seed": int(os.getenv("PL_GLOBAL_SEED", "0")),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_exact_evaluation_logs_single_process_values(world_size):
    from conftest import run_distributed

    results = run_distributed(body_exact, world_size, deadline=150, env=LIGHTNING_POOL)
    _, s_val, t_val, _ = _data(N_VAL, 2).tensors
    _, s_test, t_test, _ = _data(N_TEST, 3).tensors
    expected_fit = {  # one process on the whole validation set, stock torchmetrics functions
        "val_auroc": binary_auroc(s_val, t_val).item(),
        "val_mse": ((s_val.double() - t_val.double()) ** 2).mean().item(),
        "valcol_acc": binary_accuracy(s_val, t_val).item(),
        "valcol_ap": binary_average_precision(s_val, t_val).item(),
    }
    expected_test = {"test_mse": ((s_test.double() - t_test.double()) ** 2).mean().item()}
    seen_val = [i for r in results for i in r["seen"]["val"][: len(r["seen"]["val"]) - len(r["custom_seen"])]]
    assert sorted(i for r in results for i in r["custom_seen"]) == list(range(N_VAL)), "custom sampler: each once"
    seen_test = [i for r in results for i in r["seen"]["test"]]
    assert sorted(seen_val) == list(range(N_VAL)), "every validation sample exactly once, no padding"
    assert sorted(seen_test) == list(range(N_TEST)), "every test sample exactly once, no padding"
    assert seen_test != sorted(seen_test), "the test loader shuffles: the unpadded sampler must shuffle too"
    val_batches = [r["batches"][0] for r in results]
    assert len(set(val_batches)) > 1, f"the point of the test: ranks with fewer batches ({val_batches})"
    for rank, result in enumerate(results):
        assert result["fit"]["val_batches"] == sum(val_batches), rank  # Lightning's epoch-end reduction, uneven
        assert result["samplers"] == [
            "UnpaddedDistributedSampler",
            "UnpaddedDistributedSampler",
            True,
            "UnrepeatedDistributedSamplerWrapper",
        ]
        for name, value in expected_fit.items():  # `validate` with the custom sampler
            assert result["custom"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), (rank, name)
        for name, value in expected_fit.items():
            assert result["fit"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), (rank, name)
        for name, value in expected_test.items():
            assert result["test"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), (rank, name)
        # One sync per logged metric object and one for the whole logged collection, the same on every rank:
        # validation in fit and in validate (AUROC, MSE, the collection), the test MSE. Lightning computes the
        # collection's two members one after the other: the first syncs the collection, the second finds every
        # rank's caches valid and exchanges the records alone (a rank never returns a cache without a sync).
        validation = ["BinaryAUROC.compute", "MeanSquaredError.compute", "MetricCollection", "MetricCollection"]
        expected_syncs = sorted([*validation, *validation, "MeanSquaredError.compute"])
        metric_syncs = [label for label in result["syncs"] if "check of ExactEvaluation" not in label]  # agreements
        assert sorted(metric_syncs) == expected_syncs, (rank, result["syncs"])


def _outcome(fit):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit()
    except UnevenStepsError as err:
        return str(err)
    return None


def body_uneven_steps(rank, world_size):
    val = DataLoader(_data(N_VAL, 2), batch_size=EVAL_BATCH)
    train = DataLoader(_data(N_TRAIN, 1), batch_size=TRAIN_BATCH)
    outcomes = {}
    # Positive control: with equal step counts (limit_val_batches) a per-step sync is fine and runs.
    even = _trainer(world_size, [ExactEvaluation()], limit_val_batches=3)
    outcomes["even"] = _outcome(lambda: even.fit(ExactModel(step_sync=True), train, val))
    outcomes["logged"] = "val_loss_epoch" in even.callback_metrics
    # Uneven validation step counts (4 and 3) and a sync_dist on every step: an error on every rank, not a hang.
    uneven = _trainer(world_size, [ExactEvaluation()])
    outcomes["uneven_val"] = _outcome(lambda: uneven.fit(ExactModel(step_sync=True), train, val))
    # Uneven training step counts (a data split of the user's: 17 samples, 3 and 2 batches): refused at epoch start.
    sampler = tv.UnpaddedDistributedSampler(_data(N_TRAIN + 1, 1), world_size, rank)
    uneven_train = DataLoader(_data(N_TRAIN + 1, 1), batch_size=TRAIN_BATCH, sampler=sampler)
    trainer = _trainer(world_size, [ExactEvaluation()], use_distributed_sampler=False)
    outcomes["uneven_train"] = _outcome(lambda: trainer.fit(ExactModel(), uneven_train, val))
    return outcomes


def test_uneven_steps_raise_on_every_rank_instead_of_hanging():
    from conftest import run_distributed

    results = run_distributed(body_uneven_steps, 2, deadline=150, env=LIGHTNING_POOL)
    for rank, result in enumerate(results):
        assert result["even"] is None and result["logged"], (rank, result["even"])
        assert result["uneven_val"] is not None, rank
        assert "rank 0: 4, rank 1: 3" in result["uneven_val"] and "on_step=True, sync_dist=True" in result["uneven_val"]
        assert result["uneven_train"] is not None, rank
        assert "rank 0: 3, rank 1: 2" in result["uneven_train"]


def test_lightning_internals_the_callback_relies_on():
    # ExactEvaluation wraps the data connector's `_prepare_dataloader(dataloader, shuffle, mode)`, asks
    # `_requires_distributed_sampler` whether Lightning would shard a loader, and rebuilds it with `_update_dataloader`.
    import inspect

    from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
    from lightning.pytorch.utilities.data import _update_dataloader

    assert list(inspect.signature(_DataConnector._prepare_dataloader).parameters) == [
        "self",
        "dataloader",
        "shuffle",
        "mode",
    ]
    assert list(inspect.signature(_DataConnector._requires_distributed_sampler).parameters) == ["self", "dataloader"]
    assert list(inspect.signature(_update_dataloader).parameters)[:3] == ["dataloader", "sampler", "mode"]
