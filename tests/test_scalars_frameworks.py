"""ScalarLog where users log: a Lightning module (DDP, gloo), the plain-loop example and the Accelerate example."""

import importlib.util
import math
import sys
import time
import warnings

import pytest
import torch

from torchmetrics_varlen import ScalarLog

N_TRAIN, TRAIN_BATCH, N_VAL, EVAL_BATCH, LOG_EVERY = 16, 4, 19, 3, 2


def _lightning_body(rank, world_size):
    import lightning.pytorch as pl
    from _helpers import count_collectives
    from test_lightning import _data
    from torch.utils.data import DataLoader

    from torchmetrics_varlen.lightning import ExactEvaluation

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.train_scalars = ScalarLog(reduce={"samples": "sum"})
            self.val_scalars = ScalarLog(reduce={"val_samples": "sum"})
            self.windows, self.collectives = [], []

        def _loss(self, batch):
            x, y = batch[0], batch[1]
            return torch.nn.functional.mse_loss(self.layer(x).squeeze(1), y.float(), reduction="none")

        def training_step(self, batch, batch_idx):
            losses = self._loss(batch)
            self.train_scalars.update({"loss": losses.mean(), "samples": len(losses)}, weight=len(losses))
            if (batch_idx + 1) % LOG_EVERY == 0:  # once per logging interval, every key, one collective
                window = self.train_scalars.compute()
                self.log_dict({f"train_{key}": value for key, value in window.items()})
                self.windows.append(window)
                self.train_scalars.reset()
            return losses.mean()

        def validation_step(self, batch, batch_idx):
            losses = self._loss(batch)  # uneven step counts: ExactEvaluation gives every sample to one rank
            self.val_scalars.update({"val_loss": losses.mean(), "val_samples": len(losses)}, weight=len(losses))

        def on_validation_epoch_end(self):
            with count_collectives() as counts:
                logged = self.val_scalars.compute()
            self.collectives.append(sum(counts.values()))
            self.log_dict(logged)  # the one line: every key, exact, identical on every rank
            self.val_scalars.reset()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    from test_lightning_exact import _trainer

    model = Model()
    trainer = _trainer(world_size, [ExactEvaluation()], max_epochs=2)
    train, val = _data(N_TRAIN, 1), _data(N_VAL, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(train, batch_size=TRAIN_BATCH), DataLoader(val, batch_size=EVAL_BATCH))
    with torch.no_grad():  # one process, every validation sample, the final weights
        reference = model._loss(val.tensors[:2]).mean().item()
    logged = {key: float(value) for key, value in trainer.callback_metrics.items()}
    return {"logged": logged, "reference": reference, "windows": model.windows, "collectives": model.collectives}


@pytest.mark.parametrize("world_size", [2, 3])
def test_lightning_logs_every_key_exactly(world_size):
    pytest.importorskip("lightning")
    from conftest import run_distributed
    from test_lightning import LIGHTNING_POOL

    results = run_distributed(_lightning_body, world_size, deadline=180, env=LIGHTNING_POOL)
    for result in results:
        logged = result["logged"]
        assert math.isclose(logged["val_loss"], result["reference"], rel_tol=1e-6), (logged, result["reference"])
        assert logged["val_samples"] == N_VAL
        assert result["collectives"][0] in (1, 2) and result["collectives"][1:] == [1]  # keys known: one
        # The training windows: every step of every rank (Lightning's sampler pads to ceil(16 / W) per rank).
        per_rank = -(-N_TRAIN // world_size)
        assert sum(window["samples"] for window in result["windows"]) == 2 * world_size * per_rank
    assert all(result["logged"] == results[0]["logged"] for result in results)


def test_plain_loop_example_runs():
    from test_examples import _run

    out = _run([sys.executable, "examples/logged_scalars.py", "--world-size", "3", "--steps", "3"])
    assert out.count("loss over all ranks' samples") == 3
    assert "'samples': 144.0" in out and "aux_loss" in out  # 3 steps x (8 + 16 + 24) samples; rank 0's key


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_example_logs_the_exact_mean():
    from _helpers import run_torchrun

    returncode, stdout, stderr = run_torchrun(["examples/logged_scalars_accelerate.py"], 240)
    assert returncode == 0, f"exit {returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    assert "logged: {'value': 10.0, 'samples': 21.0, 'largest': 20.0}" in stdout  # one process: mean of 0..20


# ------------------------------------------------------------------------------ asynchronous logged scalars (#44)
EVERY = 3


def _async_lightning_body(rank, world_size, directory):
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from test_lightning_exact import _trainer
    from torch.utils.data import DataLoader, TensorDataset

    from torchmetrics_varlen.lightning import AsyncScalars

    class SlowLog(ScalarLog):
        """A sync slower than a training step: its row is still pending when Lightning logs the next step."""

        def _reduce_window(self, *args):
            time.sleep(0.3)
            return super()._reduce_window(*args)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.train_scalars = SlowLog(reduce={"samples": "sum", "y_max": "max"})

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x).squeeze(1), y)
            self.train_scalars.update({"loss": loss.detach(), "samples": len(y), "y_max": y.max()}, weight=len(y))
            self.log("lightning_loss", loss, on_step=True, on_epoch=False)  # Lightning's own row, every step
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Blocking(pl.Callback):
        """The reference: the same windows, computed at once and written at the same point, with the same step."""

        def on_train_batch_end(self, trainer, module, *args):
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            if (step + 1) % EVERY == 0:
                values = module.train_scalars.compute()
                module.train_scalars.reset()
                for logger in trainer.loggers:
                    logger.log_metrics(values, step)

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 3, generator=gen), torch.randn(32, generator=gen))
    rows = {}
    for kind in ("async", "blocking"):
        pl.seed_everything(0, verbose=False)
        callbacks = [AsyncScalars("train_scalars", every_n_steps=EVERY)] if kind == "async" else [Blocking()]
        logger = CSVLogger(directory, name=kind, version=0)
        trainer = _trainer(world_size, callbacks, max_epochs=2, logger=logger, log_every_n_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Model(), DataLoader(data, batch_size=2))
        if rank == 0:
            with open(f"{directory}/{kind}/version_0/metrics.csv") as file:
                rows[kind] = list(csv.DictReader(file))
    return rows


def test_lightning_async_scalars_are_the_blocking_rows_in_step_order(tmp_path):
    pytest.importorskip("lightning")
    from conftest import run_distributed
    from test_lightning import LIGHTNING_POOL

    rows = run_distributed(_async_lightning_body, 2, str(tmp_path), deadline=240, env=LIGHTNING_POOL)[0]

    def ours(table):
        return [(int(row["step"]), row["loss"], row["samples"], row["y_max"]) for row in table if row["loss"]]

    expected = ours(rows["blocking"])
    assert [step for step, *_ in expected] == [2, 5, 8, 11, 14]  # 16 steps (2 epochs of 8), every 3rd
    assert ours(rows["async"]) == expected  # the same values, as written (repr of the float: every bit)
    steps = [int(row["step"]) for row in rows["async"]]
    assert steps == sorted(steps), steps  # never a row older than one written before it
    assert sum(1 for row in rows["async"] if row["lightning_loss"]) == 16  # Lightning's own rows are all there
