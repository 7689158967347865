"""Real Lightning and Accelerate runs checkpointed on 2 CPU processes and resumed on 3: the metrics stay exact.

Lightning: ``Trainer.fit`` on 2 gloo ranks (in the suite's workers, as in ``test_lightning.py``) writes a mid-epoch
checkpoint with ``ModelCheckpoint(every_n_train_steps=2)`` and stops; ``Trainer.fit(ckpt_path=...)`` on 3 ranks finishes
the epoch. With ``MetricCheckpoint`` the epoch's logged metrics equal one process on every sample the ranks updated
with, before the checkpoint and after the resume (each rank records them); without it (the control) they equal one
process on the samples after the resume only: the partial epoch is lost.

Accelerate: the script part (``main``) runs under ``torchrun`` on 2 processes, updates on the first samples, and saves
with ``accelerator.save_state`` (the metrics registered as ``MergedState``); then on 3 processes ``load_state`` and
the rest of the samples: the result equals one process on all of them.
"""

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

N_TRAIN, TRAIN_BATCH, STOP_AT = 24, 2, 2  # 6 batches per rank on 2 ranks, 4 on 3; checkpoint after 2 steps


def _data(n=N_TRAIN, seed=5):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 2, (n,), generator=gen)
    scores = torch.sigmoid(1.5 * (target.float() - 0.5) + torch.randn(n, generator=gen))
    return torch.utils.data.TensorDataset(torch.randn(n, 3, generator=gen), scores, target, torch.arange(n))


def _expected(seen):
    """One process, stock torchmetrics functions, on the samples seen (every rank's, in any order: order-free)."""
    from torchmetrics.functional.classification import binary_accuracy, binary_auroc, binary_average_precision

    _, scores, target, _ = _data().tensors
    index = torch.tensor(seen, dtype=torch.long)
    s, t = scores[index], target[index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "auroc": binary_auroc(s, t).item(),
            "positives": float(t.sum()),
            "col_acc": binary_accuracy(s, t).item(),
            "col_ap": binary_average_precision(s, t).item(),
        }


# ---------------------------------------------------------------------------------------------------- Lightning
def _lightning_model():
    import lightning.pytorch as pl
    from torchmetrics.aggregation import SumMetric
    from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryAveragePrecision

    import torchmetrics_varlen as tv

    class Model(pl.LightningModule):
        """Plain Lightning code: metric objects updated in training_step and logged per epoch."""

        def __init__(self, stop_at=None):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.auroc = tv.rebase(BinaryAUROC)(thresholds=None)
            self.positives = tv.rebase(SumMetric)()
            self.col = tv.MetricCollection({"acc": BinaryAccuracy(), "ap": BinaryAveragePrecision(thresholds=None)})
            self.stop_at = stop_at
            self.seen, self.seen_at_stop = [], None

        def training_step(self, batch, batch_idx):
            x, scores, target, index = batch
            self.seen += index.tolist()
            self.auroc.update(scores, target)
            self.positives.update(target.float())
            self.col.update(scores, target)
            self.log("auroc", self.auroc, on_step=False, on_epoch=True)
            self.log("positives", self.positives, on_step=False, on_epoch=True)
            self.log_dict({f"col_{k}": v for k, v in self.col.items()}, on_step=False, on_epoch=True)
            return self.layer(x).pow(2).mean()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.stop_at is not None and self.trainer.global_step == self.stop_at:
                self.seen_at_stop = list(self.seen)  # what the checkpoint written at this step holds
                self.trainer.should_stop = True

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Model


def body_lightning(rank, world_size, directory, resume, with_callback):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from test_lightning import ExistingProcessGroup, _trainer
    from torch.utils.data import DataLoader

    from torchmetrics_varlen.lightning import MetricCheckpoint

    model = _lightning_model()(stop_at=None if resume else STOP_AT)
    callbacks = [MetricCheckpoint()] if with_callback else []
    if not resume:
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=STOP_AT, save_top_k=-1))
    strategy = DDPStrategy(cluster_environment=ExistingProcessGroup(), process_group_backend="gloo")
    trainer = _trainer(strategy, world_size, callbacks=callbacks, enable_checkpointing=not resume)
    loader = DataLoader(_data(), batch_size=TRAIN_BATCH)  # Lightning shards it (DistributedSampler)
    ckpt = os.path.join(directory, f"epoch=0-step={STOP_AT}.ckpt") if resume else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader, ckpt_path=ckpt)
    logged = {name: float(value) for name, value in trainer.callback_metrics.items()}
    return {"seen": model.seen_at_stop if not resume else model.seen, "logged": logged}


needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")


@pytest.fixture(scope="module")
def lightning_checkpoint(tmp_path_factory):
    from conftest import run_distributed
    from test_lightning import LIGHTNING_POOL

    directory = str(tmp_path_factory.mktemp("lightning"))
    saved = run_distributed(body_lightning, 2, directory, False, True, deadline=240, env=LIGHTNING_POOL)
    assert os.path.exists(os.path.join(directory, f"epoch=0-step={STOP_AT}.ckpt")), os.listdir(directory)
    return directory, [i for result in saved for i in result["seen"]]


@needs_lightning
def test_lightning_mid_epoch_checkpoint_on_2_resumed_on_3_is_exact(lightning_checkpoint):
    from conftest import run_distributed
    from test_lightning import LIGHTNING_POOL

    directory, before = lightning_checkpoint
    assert len(before) == 2 * STOP_AT * TRAIN_BATCH  # 2 ranks, 2 steps of 2 samples each
    resumed = run_distributed(body_lightning, 3, directory, True, True, deadline=240, env=LIGHTNING_POOL)
    after = [i for result in resumed for i in result["seen"]]
    assert after, "the resumed epoch ran no step"
    expected = _expected(before + after)
    for rank, result in enumerate(resumed):
        assert result["logged"] == pytest.approx(expected, abs=1e-6), (rank, result["logged"], expected)


@needs_lightning
def test_lightning_without_the_callback_loses_the_partial_epoch(lightning_checkpoint):
    from conftest import run_distributed
    from test_lightning import LIGHTNING_POOL

    directory, before = lightning_checkpoint
    resumed = run_distributed(body_lightning, 3, directory, True, False, deadline=240, env=LIGHTNING_POOL)
    after = [i for result in resumed for i in result["seen"]]
    lost = _expected(after)
    assert lost != pytest.approx(_expected(before + after), abs=1e-6)  # the control can tell them apart
    for result in resumed:
        assert result["logged"] == pytest.approx(lost, abs=1e-6)


def _module_class():
    import lightning.pytorch as pl
    from torchmetrics.aggregation import CatMetric, SumMetric

    import torchmetrics_varlen as tv

    class MeanState(tv.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("avg", default=torch.tensor(0.0), dist_reduce_fx="mean")

        def update(self, x):
            self.avg = x.mean()

        def compute(self):
            return self.avg

    class Module(pl.LightningModule):
        def __init__(self, mean=False):
            super().__init__()
            self.head = torch.nn.Sequential(torch.nn.Linear(2, 2))
            self.total = SumMetric()
            self.indexed = tv.IndexedMetric(CatMetric())  # its template is inside it, not a metric of the module
            self.col = tv.MetricCollection({"a": SumMetric(), "b": CatMetric()})
            if mean:
                self.avg = MeanState()

    return Module


@needs_lightning
def test_metric_checkpoint_finds_each_metric_once_and_refuses_what_cannot_be_merged():
    from torchmetrics_varlen import MergedStateError
    from torchmetrics_varlen.lightning import CHECKPOINT_KEY, MetricCheckpoint, module_metrics

    Module = _module_class()  # noqa: N806
    assert list(module_metrics(Module())) == ["total", "indexed", "col"]
    with pytest.raises(MergedStateError, match="dist_reduce_fx='mean'"):
        MetricCheckpoint().setup(None, Module(mean=True), "fit")

    module = Module()
    module.total.update(torch.tensor(4.0))
    checkpoint = {}
    MetricCheckpoint().on_save_checkpoint(None, module, checkpoint)
    assert checkpoint[CHECKPOINT_KEY]["members"]["total"]["states"]["sum_value"].item() == 4.0
    resumed = Module()
    MetricCheckpoint().on_load_checkpoint(None, resumed, checkpoint)
    assert resumed.total.compute().item() == 4.0 and resumed.total._update_count == 1
    with pytest.raises(MergedStateError, match=r"holds none .* MetricCheckpoint\(strict=False\)"):
        MetricCheckpoint().on_load_checkpoint(None, Module(), {})
    kept = Module()
    kept.total.update(torch.tensor(1.0))
    MetricCheckpoint(strict=False).on_load_checkpoint(None, kept, {})
    assert kept.total._update_count == 0  # started from its defaults


# --------------------------------------------------------------------------------------------------- Accelerate
N_FIRST = 9  # samples before the checkpoint (on 2 processes); the rest after the resume (on 3)


def main():
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader, Subset
    from torchmetrics.aggregation import SumMetric
    from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryAveragePrecision

    import torchmetrics_varlen as tv

    phase, directory = sys.argv[-2], sys.argv[-1]
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    metrics = {
        "auroc": tv.rebase(BinaryAUROC)(thresholds=None),
        "positives": tv.rebase(SumMetric)(),
        "col": tv.MetricCollection({"acc": BinaryAccuracy(), "ap": BinaryAveragePrecision(thresholds=None)}),
    }
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(tv.MergedState(metrics))
    indices = range(N_FIRST) if phase == "save" else range(N_FIRST, N_TRAIN)
    if phase == "resume":
        accelerator.load_state(directory)
    loader = accelerator.prepare(DataLoader(Subset(_data(), list(indices)), batch_size=TRAIN_BATCH))
    seen = []
    for _, scores, target, index in loader:
        seen += index.tolist()
        metrics["auroc"].update(scores, target)
        metrics["positives"].update(target.float())
        metrics["col"].update(scores, target)
    if phase == "save":
        accelerator.save_state(directory)
        values = None
    else:
        col = metrics["col"].compute()
        values = {"auroc": metrics["auroc"].compute().item(), "positives": metrics["positives"].compute().item()}
        values.update({f"col_{key}": value.item() for key, value in col.items()})
    with open(os.path.join(directory, f"{phase}{accelerator.process_index}.json"), "w") as out:
        json.dump({"seen": seen, "values": values}, out)
    accelerator.wait_for_everyone()
    accelerator.end_training()


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_save_state_on_2_load_state_on_3_is_exact(tmp_path):
    from _helpers import run_torchrun

    for phase, processes in (("save", 2), ("resume", 3)):
        returncode, stdout, stderr = run_torchrun([__file__, phase, str(tmp_path)], 240, nproc=processes)
        assert returncode == 0, f"{phase}: exit {returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    assert (tmp_path / "custom_checkpoint_0.pkl").exists()
    saved = [json.loads(path.read_text()) for path in sorted(Path(tmp_path).glob("save*.json"))]
    resumed = [json.loads(path.read_text()) for path in sorted(Path(tmp_path).glob("resume*.json"))]
    assert len(saved) == 2 and len(resumed) == 3
    seen = [i for result in saved + resumed for i in result["seen"]]
    assert sorted(seen) == list(range(N_TRAIN)), "each sample once (even_batches=False)"
    expected = _expected(seen)
    for rank, result in enumerate(resumed):
        assert result["values"] == pytest.approx(expected, abs=1e-6), (rank, result["values"], expected)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
