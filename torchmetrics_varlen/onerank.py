"""One-rank compute: gather the states to one rank only, compute there, broadcast the result to every rank.

The protocol of every other sync (see the "How the sync works" docs page), with the data step replaced by a gather
to the destination rank, which reduces the states as a normal sync does, computes, and sends the outcome (the value,
or the exception it raised) to every rank. This module calls no collective itself.
"""

import io
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric

from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine import move
from torchmetrics_varlen._engine.group import default_timeout, link
from torchmetrics_varlen._engine.record import FLAG_CACHED
from torchmetrics_varlen._engine.states import Layout, every_rank_cached, layout, reduce_results, run
from torchmetrics_varlen.metric import Metric

__all__ = ["compute_on_rank"]


def compute_on_rank(metric: StockMetric, dst: int = 0) -> Any:
    """Compute a metric from the states of every rank on rank ``dst`` only, and return the result on every rank.

    Call it on every rank instead of ``metric.compute()``. The states travel to ``dst`` alone (their true sizes,
    however skewed the ranks), which computes as ``compute()`` would and broadcasts the result: the other ranks never
    hold the whole data set. For metrics whose states grow with the data (``BinaryAUROC(thresholds=None)``, retrieval).

    * The result is the value ``compute()`` returns after a normal sync, bit for bit: any nesting of tensors in dicts,
      lists and tuples, on the metric's device on every rank, without autograd history.
    * Works with stock metrics and :class:`~torchmetrics_varlen.Metric` subclasses, on uneven and empty ranks; the
      metric's own ``dist_sync_fn`` is not used. The ``compute()`` cache takes part as in ``compute()``.
    * An error while computing on ``dst`` is raised on every rank (same type and message), never a hang.
    * Without a process group, in a group of one, with ``sync_on_compute=False``, or on a metric already synced by
      ``sync()``, this is ``metric.compute()``.

    Args:
        metric: the metric to compute; its ``process_group`` is used (the default group when None).
        dst: rank, within the metric's process group, that gathers the states and computes.

    Returns:
        What ``metric.compute()`` returns after a sync, on every rank.

    Raises:
        ValueError: ``dst`` is not a rank of the group (on every rank alike when every rank passes the same ``dst``).
        TypeError: ``metric`` is not a torchmetrics metric.

    Example:
        Without a process group this is a plain ``compute()``:

        >>> import torch
        >>> from torchmetrics.classification import BinaryAUROC
        >>> from torchmetrics_varlen.onerank import compute_on_rank
        >>> metric = BinaryAUROC(thresholds=None)
        >>> metric.update(torch.tensor([0.1, 0.8, 0.6, 0.3]), torch.tensor([0, 1, 1, 0]))
        >>> compute_on_rank(metric, dst=0)  # in a job: on every rank, instead of metric.compute()
        tensor(1.)
    """
    if not isinstance(metric, StockMetric):
        raise TypeError(f"Expected `metric` to be a torchmetrics.Metric but got {type(metric).__name__}")
    return one_rank_compute(metric, dst, metric.compute)


def one_rank_compute(metric: StockMetric, dst: int, local: Callable[[], Any]) -> Any:
    """:func:`compute_on_rank` with the fallback ``local`` called when no sync is needed (shared with IndexedMetric)."""
    timeout = getattr(metric, "sync_timeout", None) if isinstance(metric, Metric) else default_timeout()
    phase = f"onerank{dst}." + ("compute" if metric._should_unsync else "step")
    label = f"{type(metric).__name__}.{phase}"
    # The backend and device come from the metric's device, never from the states (a rank whose list states are
    # empty would pick another backend of a "cpu:gloo,cuda:nccl" group).
    sync_link = link(metric.process_group, metric.device, timeout, f"sync of {label}")
    if isinstance(dst, bool) or not isinstance(dst, int) or dst < 0:
        raise ValueError(f"Expected `dst` to be a non-negative integer rank but got {dst!r}")
    if sync_link is not None and dst >= sync_link.size:
        raise ValueError(f"Expected `dst` to be a rank of the process group (0 to {sync_link.size - 1}) but got {dst}")
    if sync_link is None or not metric._to_sync or metric._is_synced or not metric.distributed_available_fn():
        return local()
    flags = FLAG_CACHED if metric._computed is not None and metric.compute_with_cache else 0
    if metric._update_count == 0:  # `update_called` is deprecated in torchmetrics
        warnings.warn(
            f"The ``compute`` method of metric {type(metric).__name__} was called before the ``update`` method"
            " which may lead to errors, as metric states have not yet been updated.",
            UserWarning,
            stacklevel=3,
        )
    # dst is part of what is synced (the phase): ranks that disagree on it raise instead of pairing wrongly.
    sync_layout = layout([metric], phase)
    synced = run(sync_layout, sync_link, label, flags, dst=dst, stop=every_rank_cached)
    if synced is None:  # every rank's cached result is valid: it is the global value
        return metric._computed
    outcome = _compute_here(metric, sync_layout, synced) if sync_link.rank == dst else None
    # The others wait for the destination's result up to the group's own timeout: it is computing, not missing.
    data = _encode_outcome(outcome) if outcome is not None else None
    received = move.share(data, dst, replace(sync_link, timeout=None))
    ok, value = outcome if outcome is not None else torch.load(io.BytesIO(received), weights_only=False)
    if outcome is None and ok:  # the destination keeps its own objects
        value = _map_tensors(value, lambda tensor: tensor.to(metric.device))
    if not ok:
        raise value
    if metric.compute_with_cache:
        metric._computed = value
    return value


def _compute_here(metric: StockMetric, sync_layout: Layout, synced: _engine.Synced) -> tuple[bool, Any]:
    """On the destination: reduce the states (dropping the gathered buffers), compute; any error is the outcome."""
    try:
        names = [name for _, name in sync_layout.classes.keys]
        states = dict(zip(names, reduce_results(sync_layout, synced, sync_layout.state_name)))
        saved = {name: getattr(metric, name) for name in names}
        try:
            for name in names:
                setattr(metric, name, states.pop(name))
            result = Metric._finish(type(metric).compute(metric))  # the unwrapped compute: no second sync
        finally:
            for name, value in saved.items():
                setattr(metric, name, value)
        return True, result
    except Exception as err:  # raised on every rank after the broadcast
        return False, err


def _map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, dict):
        mapped = {key: _map_tensors(item, fn) for key, item in value.items()}
        try:
            return type(value)(mapped)
        except TypeError:  # a dict subclass with another constructor (defaultdict): a plain dict
            return mapped
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map_tensors(item, fn) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def _portable(tensor: Tensor) -> Tensor:
    """A detached CPU tensor that owns exactly its own bytes (pickling a view would send its whole storage)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _encode_outcome(outcome: tuple[bool, Any]) -> bytes:
    """The destination's outcome as bytes (``torch.save``); an unpicklable one becomes an error to raise."""

    def dumps(value: Any) -> bytes:
        stream = io.BytesIO()
        torch.save(value, stream)
        return stream.getvalue()

    ok, value = outcome
    if ok:
        try:
            return dumps((True, _map_tensors(value, _portable)))
        except Exception as err:  # an unpicklable result: every rank raises instead
            value = RuntimeError(
                f"one-rank compute: the result ({type(value).__name__}) cannot be sent to the other ranks: {err}"
            )
    try:
        return dumps((False, value))
    except Exception:
        return dumps((False, RuntimeError(f"{type(value).__name__}: {value}")))
