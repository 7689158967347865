"""Lightning integration: exact multi-device validation and test in one line, and clear errors instead of hangs.

Import this module only where Lightning is installed (``pip install 'torchmetrics-varlen[lightning]'``); the rest of
the package never imports Lightning.
"""

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torchmetrics import Metric as StockMetric
from torchmetrics import MetricCollection as StockMetricCollection

from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine.group import link
from torchmetrics_varlen.checkpoint import MergedState, MergedStateError
from torchmetrics_varlen.sampler import UnpaddedDistributedSampler
from torchmetrics_varlen.scalars import ScalarLog

try:
    from lightning.pytorch import Callback
except ImportError:  # the package imports without Lightning; the callback says what is missing when it is made
    Callback = object  # type: ignore[misc,assignment]
    _LIGHTNING_ERROR: str | None = (
        "`torchmetrics_varlen.lightning.ExactEvaluation` needs Lightning: pip install 'torchmetrics-varlen[lightning]'"
    )
else:
    _LIGHTNING_ERROR = None

__all__ = ["AsyncScalars", "ExactEvaluation", "MetricCheckpoint", "UnevenStepsError"]

# Strategy methods that are collectives: inside an evaluation step with uneven per-rank step counts each one would
# wait forever on the ranks that still have batches (the others have left the loop).
_STRATEGY_COLLECTIVES = ("reduce", "all_gather", "broadcast", "barrier")


class UnevenStepsError(RuntimeError):
    """A collective in a loop whose ranks run different numbers of steps: raised on every rank instead of a hang."""


class ExactEvaluation(Callback):  # type: ignore[misc,valid-type]
    """Make Lightning's multi-device validation and test exact: every sample is evaluated exactly once.

    Add it to the trainer, ``Trainer(callbacks=[ExactEvaluation()])``, and change nothing else. Where Lightning would
    shard a validation or test data loader with its padding ``DistributedSampler`` (which repeats samples so that
    every rank gets as many as rank 0), the loader gets an
    :class:`~torchmetrics_varlen.UnpaddedDistributedSampler` instead: the same strided split, each sample on exactly
    one rank, shuffled (seeded with ``PL_GLOBAL_SEED`` as Lightning seeds its own) when the loader shuffles. A loader
    with a custom sampler gets Lightning's own unrepeated wrapper. Training loaders and loaders that already carry a
    ``DistributedSampler`` are left as they are. Metrics logged with ``self.log(name, metric)`` (this package's or
    rebased ones) then give exactly the single-process value at epoch end.

    Ranks may then run different numbers of evaluation steps (21 samples in batches of 5 on 2 ranks: 3 and 2). That
    is harmless for metric objects and for ``self.log(..., sync_dist=True)`` with the default ``on_step=False`` (one
    reduction per name at epoch end), but a collective inside every step, ``self.log(..., on_step=True,
    sync_dist=True)``, ``self.all_gather`` or ``trainer.strategy.reduce`` in ``validation_step``, would wait forever on
    the ranks with more batches. The callback compares the step counts of all ranks at the start of each evaluation
    loop (one small exchange) and, when they differ, makes such a collective raise :class:`UnevenStepsError` on every
    rank at its first step instead. With equal counts (for example ``limit_val_batches``) nothing is checked.

    Training must run equal step counts on every rank (DDP's gradient all-reduce needs every rank at every step).
    Lightning's own training sampler guarantees that; with ``check_training=True`` (the default) the callback compares
    the counts at the start of each training epoch and raises :class:`UnevenStepsError` on every rank when they differ
    (a custom sampler or data split), instead of letting the fit hang at the first step one rank lacks.

    Args:
        check_training: compare the training step counts of all ranks at each training epoch start.

    Raises:
        ModuleNotFoundError: Lightning is not installed.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from torchmetrics_varlen.lightning import ExactEvaluation
        >>> trainer = Trainer(accelerator="cpu", devices=1, callbacks=[ExactEvaluation()], logger=False,
        ...                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        >>> any(isinstance(callback, ExactEvaluation) for callback in trainer.callbacks)
        True
    """

    def __init__(self, check_training: bool = True) -> None:
        if _LIGHTNING_ERROR is not None:
            raise ModuleNotFoundError(_LIGHTNING_ERROR)
        if not isinstance(check_training, bool):
            raise ValueError(f"Expected `check_training` to be a bool but got {check_training!r}")
        super().__init__()
        self.check_training = check_training
        self._uneven: str | None = None  # the per-rank step counts of the running evaluation loop, when they differ
        self._in_step = False
        self._patched: list[tuple[Any, str]] = []

    # ------------------------------------------------------------------------------------------------ set-up
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Route evaluation loaders through the unpadded sampler and guard the strategy's collectives."""
        self.teardown(trainer, pl_module, stage)  # a run that raised skips the teardown hook: never wrap twice
        connector = trainer._data_connector
        prepare = connector._prepare_dataloader
        self._patch(connector, "_prepare_dataloader", self._unpadded_prepare(trainer, connector, prepare))
        for name in _STRATEGY_COLLECTIVES:
            self._patch(trainer.strategy, name, self._guarded(name, getattr(trainer.strategy, name)))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Undo what :meth:`setup` patched (a later ``fit``/``validate``/``test`` patches again)."""
        while self._patched:
            owner, name = self._patched.pop()
            vars(owner).pop(name, None)  # the instance attribute goes; the class's method shows again

    def _patch(self, owner: Any, name: str, value: Callable[..., Any]) -> None:
        vars(owner)[name] = value
        self._patched.append((owner, name))

    def _unpadded_prepare(self, trainer: Any, connector: Any, prepare: Callable[..., Any]) -> Callable[..., Any]:
        from lightning.pytorch.trainer.states import RunningStage

        evaluating = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)

        def prepare_dataloader(dataloader: object, shuffle: bool, mode: Any) -> object:
            if mode not in evaluating or not isinstance(dataloader, DataLoader):
                return prepare(dataloader, shuffle, mode)
            if not connector._requires_distributed_sampler(dataloader):
                return prepare(dataloader, shuffle, mode)
            sampler = _unpadded_sampler(dataloader, shuffle and not trainer.overfit_batches, trainer)
            from lightning.pytorch.utilities.data import _update_dataloader

            return _update_dataloader(dataloader, sampler, mode=mode)

        return prepare_dataloader

    # ---------------------------------------------------------------------------------------- uneven steps
    def _guarded(self, name: str, collective: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self._in_step and self._uneven is not None:
                raise UnevenStepsError(
                    f"`trainer.strategy.{name}` was called inside an evaluation step, but the ranks run different"
                    f" numbers of evaluation steps ({self._uneven}; ExactEvaluation gives every sample to one rank"
                    " only): the ranks with more batches would wait forever for the others. Typical causes:"
                    " `self.log(..., on_step=True, sync_dist=True)`, `self.all_gather(...)` or"
                    " `self.trainer.strategy.reduce(...)` in `validation_step`/`test_step`. Log plain tensors with"
                    " `on_step=False` (reduced once at epoch end), log a metric object, or gather in"
                    " `on_validation_epoch_end`."
                )
            return collective(*args, **kwargs)

        return guarded

    def _compare_counts(self, trainer: Any, counts: Sequence[float], what: str) -> str | None:
        """Every rank's step counts, exchanged in one small all-gather; a description when they differ."""
        group = getattr(trainer.strategy, "process_group", None)  # Lightning's DDP strategies: the world
        sync_link = link(group, trainer.strategy.root_device, None, f"the {what} check of ExactEvaluation")
        if sync_link is None or not counts:
            return None
        table = _engine.agree([-1 if c == float("inf") else int(c) for c in counts], sync_link, what)
        if all(row == table[0] for row in table):
            return None
        rows = [row if len(counts) > 1 else row[0] for row in table]
        per_rank = ", ".join(f"rank {rank}: {row}" for rank, row in enumerate(rows))
        return f"{what} per rank: {per_rank}"

    def _on_evaluation_start(self, trainer: Any, counts: Sequence[float]) -> None:
        self._in_step = False
        self._uneven = self._compare_counts(trainer, counts, "steps")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """Compare the validation (or sanity-check) step counts of the ranks."""
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        self._on_evaluation_start(trainer, counts)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        """Compare the test step counts of the ranks."""
        self._on_evaluation_start(trainer, trainer.num_test_batches)

    def on_validation_batch_start(self, *args: Any, **kwargs: Any) -> None:
        """Mark the step: a strategy collective from here to the batch end is checked."""
        self._in_step = True

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """End of the checked step."""
        self._in_step = False

    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Raise :class:`UnevenStepsError` on every rank when the ranks would run different training step counts."""
        self._in_step = False
        if not self.check_training or trainer.world_size < 2:
            return
        uneven = self._compare_counts(trainer, [trainer.num_training_batches], "training steps")
        if uneven is not None:
            raise UnevenStepsError(
                f"The ranks would run different numbers of training steps ({uneven}): DDP's gradient all-reduce needs"
                " every rank at every step, so the ranks with more batches would wait forever. Give every rank the"
                " same number of training batches (Lightning's default `DistributedSampler`, `drop_last=True`, or"
                " `limit_train_batches`); `UnpaddedDistributedSampler` is for evaluation only."
            )


def _unpadded_sampler(dataloader: DataLoader[Any], shuffle: bool, trainer: Any) -> Any:
    """This rank's unpadded sampler, made from what Lightning would give its own ``DistributedSampler``."""
    kwargs = dict(trainer.distributed_sampler_kwargs)  # num_replicas and rank of the data-parallel group
    seed = int(os.getenv("PL_GLOBAL_SEED", "0"))  # Lightning's own seed of its distributed samplers
    if isinstance(dataloader.sampler, (SequentialSampler, RandomSampler)):
        return UnpaddedDistributedSampler(
            dataloader.dataset,  # type: ignore[arg-type]
            num_replicas=kwargs["num_replicas"],
            rank=kwargs["rank"],
            shuffle=shuffle,
            seed=seed,
        )
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper

    return UnrepeatedDistributedSamplerWrapper(dataloader.sampler, shuffle=shuffle, seed=seed, **kwargs)


class AsyncScalars(Callback):  # type: ignore[misc,valid-type]
    """Log a LightningModule's :class:`~torchmetrics_varlen.ScalarLog` windows without waiting for the other ranks.

    ``Trainer(callbacks=[AsyncScalars()])``; the training steps update the module's ``ScalarLog`` attributes as usual.
    Every ``every_n_steps`` optimizer steps each log gets ``compute_async()`` and ``reset()``; its values go to every
    logger of the Trainer, labelled with the step that produced them, once the sync has finished, always before any
    logger writes a later step (loggers such as W&B drop older rows) and at the end of training, where a failed sync
    raises its error on every rank.

    Args:
        names: the module's ``ScalarLog`` attributes to log (default: every ``ScalarLog`` attribute of the module).
        every_n_steps: optimizer steps per window (default: the Trainer's ``log_every_n_steps``).

    Raises:
        ModuleNotFoundError: Lightning is not installed.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from torchmetrics_varlen.lightning import AsyncScalars
        >>> trainer = Trainer(accelerator="cpu", devices=1, callbacks=[AsyncScalars("train_scalars")], logger=False)
        >>> any(isinstance(callback, AsyncScalars) for callback in trainer.callbacks)
        True
    """

    def __init__(self, *names: str, every_n_steps: int | None = None) -> None:
        if _LIGHTNING_ERROR is not None:
            raise ModuleNotFoundError(_LIGHTNING_ERROR)
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"Expected `every_n_steps` to be a positive int or None but got {every_n_steps!r}")
        super().__init__()
        self.names, self.every_n_steps = names, every_n_steps
        self._logs: list[ScalarLog] = []
        self._pending: list[tuple[int, list[Any]]] = []  # (step, futures), oldest first
        self._writers: list[tuple[Any, Callable[..., Any]]] = []  # (logger, its own log_metrics)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Find the logs; make each logger write what is pending for earlier steps before a row of its own."""
        self.teardown(trainer, pl_module, stage)
        for name in self.names:
            if not isinstance(getattr(pl_module, name, None), ScalarLog):
                raise ValueError(f"Expected `{name}` to be a ScalarLog attribute of {type(pl_module).__name__}")
        self._logs = [getattr(pl_module, name) for name in self.names]
        self._logs = self._logs or [child for child in pl_module.children() if isinstance(child, ScalarLog)]
        for logger in trainer.loggers:
            self._writers.append((logger, logger.log_metrics))
            vars(logger)["log_metrics"] = functools.partial(self._log_metrics, logger.log_metrics)

    def _log_metrics(self, original: Callable[..., Any], metrics: Any, step: int | None = None) -> Any:
        self._write(before=step)
        return original(metrics, step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        """Write the finished windows; at the end of a window, start its syncs and reset the logs."""
        self._write(ready=True)
        if trainer.fit_loop._should_accumulate():
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # how Lightning labels this batch's rows
        if (step + 1) % (self.every_n_steps or trainer.log_every_n_steps or 1) == 0:
            self._pending.append((step, [log.compute_async() for log in self._logs]))
            for log in self._logs:
                log.reset()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Write every pending window."""
        self._write()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Write every pending window, then give the loggers their own ``log_metrics`` back."""
        try:
            self._write()
        finally:
            while self._writers:
                logger, _ = self._writers.pop()
                vars(logger).pop("log_metrics", None)

    def _write(self, ready: bool = False, before: int | None = None) -> None:
        """Write the pending windows in step order: the finished ones (``ready``), or those before ``before``."""
        while self._pending and (before is None or self._pending[0][0] < before):
            step, pending = self._pending[0]
            if ready and not all(future.done() for future in pending):
                return
            self._pending.pop(0)
            values = {key: value for future in pending for key, value in future.result().items()}
            for _, write in self._writers:
                write(values, step)


# ------------------------------------------------------------------------------------------------------ checkpoints
CHECKPOINT_KEY = "torchmetrics_varlen_metrics"


def module_metrics(module: Any) -> dict[str, Any]:
    """The metrics and collections of a module by attribute path, each once (not those inside another metric)."""
    found: dict[str, Any] = {}
    for name, child in module.named_modules():
        if isinstance(child, (StockMetric, StockMetricCollection)) and not any(
            name.startswith(f"{outer}.") for outer in found
        ):
            found[name] = child
    return found


class MetricCheckpoint(Callback):  # type: ignore[misc,valid-type]
    """Make the metrics of a LightningModule survive ``Trainer.fit(ckpt_path=...)`` on another number of processes.

    Add it to the trainer, ``Trainer(callbacks=[MetricCheckpoint()])``, and change nothing else. Every checkpoint the
    trainer writes (``ModelCheckpoint``, ``trainer.save_checkpoint``, mid-epoch ones included) then holds the global
    state of every metric and ``MetricCollection`` of the LightningModule, as one process that saw every rank's
    updates would hold it (:func:`~torchmetrics_varlen.merged_state_dict`, one sync for all of them, on every rank
    while Lightning builds the checkpoint; rank 0 writes it). Resuming with ``ckpt_path`` on any number of processes
    gives it back exactly: the first rank holds the global state, the others start from their defaults
    (:func:`~torchmetrics_varlen.load_merged_state_dict`), so the epoch's metric equals one process on all the data
    seen before and after the resume. Without the callback Lightning writes rank 0's states (or none: states are not
    persistent by default) and each new rank reloads them: the partial epoch is lost or counted once per rank.

    States that cannot be merged (``dist_reduce_fx="mean"``, custom functions) are refused with
    :class:`~torchmetrics_varlen.MergedStateError` when the trainer sets up, on every rank. The metrics must keep
    their attribute names between the runs.

    Args:
        strict: a checkpoint without the metrics' states (written without this callback, or ``weights_only``) raises
            :class:`~torchmetrics_varlen.MergedStateError`; with ``strict=False`` the metrics start from their
            defaults instead.

    Raises:
        ModuleNotFoundError: Lightning is not installed.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from torchmetrics_varlen.lightning import MetricCheckpoint
        >>> trainer = Trainer(accelerator="cpu", devices=1, callbacks=[MetricCheckpoint()], logger=False,
        ...                   enable_progress_bar=False, enable_model_summary=False)
        >>> any(isinstance(callback, MetricCheckpoint) for callback in trainer.callbacks)
        True
    """

    def __init__(self, strict: bool = True) -> None:
        if _LIGHTNING_ERROR is not None:
            raise ModuleNotFoundError(_LIGHTNING_ERROR)
        if not isinstance(strict, bool):
            raise ValueError(f"Expected `strict` to be a bool but got {strict!r}")
        super().__init__()
        self.strict = strict

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Refuse, before training, metrics whose states cannot be merged."""
        MergedState(module_metrics(pl_module))

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Add the metrics' global state to the checkpoint (every rank takes part; rank 0 writes it)."""
        checkpoint[CHECKPOINT_KEY] = MergedState(module_metrics(pl_module)).state_dict()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Give the first rank the metrics' global state and the others their defaults (every rank takes part)."""
        state = checkpoint.get(CHECKPOINT_KEY)
        metrics = module_metrics(pl_module)
        if state is None:
            if self.strict:
                raise MergedStateError(
                    "Expected the checkpoint to hold the metrics' states written by MetricCheckpoint but it holds none"
                    " (written without the callback, or with weights_only=True). Pass MetricCheckpoint(strict=False)"
                    " to start the metrics from their defaults."
                )
            for metric in metrics.values():
                metric.reset()
            return
        MergedState(metrics).load_state_dict(state)
