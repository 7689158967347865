"""Replay: feed the ordered, deduplicated samples to a fresh copy of the wrapped metric, as one process would."""

import copy
import inspect
from typing import Any

from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics.utilities.data import dim_zero_cat


def as_tensor(value: Any) -> Tensor | None:
    """A ``cat`` state as one tensor (local list or synced tensor), or None when it holds nothing."""
    if isinstance(value, Tensor):
        # A `cat` list no rank held an item of comes back from a sync as stock's `tensor([])`: it holds nothing.
        return value if value.numel() > 0 or value.ndim > 1 else None
    return dim_zero_cat(value) if value else None


def gathered_inputs(states: dict[str, Any], samples: int) -> dict[str, Tensor]:
    """The per-sample inputs by parameter name; each must hold one row per stored sample (or be absent)."""
    inputs: dict[str, Tensor] = {}
    for name, value in states.items():
        data = as_tensor(value)
        if data is None:
            continue  # an optional argument passed nowhere
        if data.shape[0] != samples:
            raise ValueError(
                f"Expected `{name}` to be passed with every update on every rank, or never, but it holds"
                f" {data.shape[0]} samples while `sample_index` holds {samples}"
            )
        inputs[name] = data
    return inputs


def replay(
    template: StockMetric,
    signature: inspect.Signature,
    static: dict[str, Any],
    ordered: dict[str, Tensor],
    batch_size: int | None,
) -> Any:
    """Update a copy of ``template`` with ``ordered`` (in batches of ``batch_size``, or at once) and compute it."""
    metric = copy.deepcopy(template)
    total = next((int(data.shape[0]) for data in ordered.values()), 0)
    step = batch_size or total
    for start in range(0, total, max(step, 1)):
        bound = signature.bind_partial()
        bound.arguments.update(static)
        bound.arguments.update({name: data[start : start + step] for name, data in ordered.items()})
        metric.update(*bound.args, **bound.kwargs)
    return metric.compute()
