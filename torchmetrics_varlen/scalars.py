"""Logged scalars (losses, accuracies, counters), reduced exactly across ranks in one collective."""

import numbers
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics.utilities import rank_zero_warn

from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine import scalar_codec as _rec
from torchmetrics_varlen._engine.group import link, sent_cap
from torchmetrics_varlen.gather import gather_all_tensors
from torchmetrics_varlen.metric import Metric

__all__ = ["ScalarLog", "sync_scalars"]

Number = float | int | bool | Tensor
_NAN_STRATEGIES = ("error", "warn", "ignore", "disable")


class ScalarLog(Metric):
    r"""Named scalars accumulated over a logging window and reduced over every update of every rank, exactly.

    ``update({"loss": loss, "acc": acc}, weight=batch_size)`` adds one update per key; ``compute()`` returns a dict
    with every key that any rank updated since the last ``reset()``, each reduced over all updates of all ranks that
    had it, as one process would: ``"mean"`` (the default) is the weighted mean :math:`\sum w\,v / \sum w` (not a
    mean of per-rank means); ``"sum"``, ``"max"`` and ``"min"`` take no weight.

    Keys (any ``str`` UTF-8 encodes) may differ between ranks and windows; a rank that updated nothing takes part and
    gets the same dict. Each value and weight becomes float64 on its own; the results are Python floats, the same on
    every rank. Tensor updates accumulate on their device until the window is read. NaN is handled as by torchmetrics'
    aggregators (``nan_strategy``), infinities propagate. **One collective per** ``compute()`` (names travel once): a
    rank that never calls it makes the others raise :class:`~torchmetrics_varlen.SyncTimeoutError`, different
    reductions of a key raise :class:`~torchmetrics_varlen.SyncMismatchError` on every rank. See "Logged scalars".

    Args:
        reduce: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for every key, or a mapping from key to one of them
            (keys not in it take ``"mean"``).
        nan_strategy: as for :class:`torchmetrics.aggregation.MeanMetric`: ``"warn"`` (drop NaN values, with a
            warning), ``"error"``, ``"ignore"`` (drop silently), ``"disable"`` (keep them: the key's result is NaN) or
            a float that replaces them (weight 1, as in torchmetrics); a ``"mean"`` key's NaN weight is a NaN value.
        kwargs: keyword arguments of :class:`~torchmetrics_varlen.Metric` (``process_group``, ``sync_timeout``, ...).

    Example:
        >>> import torch
        >>> from torchmetrics_varlen import ScalarLog
        >>> log = ScalarLog(reduce={"tokens": "sum", "grad_norm": "max"})
        >>> log.update({"loss": torch.tensor(2.0), "tokens": 30, "grad_norm": 1.5}, weight=30)
        >>> log.update({"loss": 0.5, "tokens": 10, "grad_norm": 0.7}, weight=10)
        >>> log.compute()  # loss: (2.0 * 30 + 0.5 * 10) / 40
        {'loss': 1.625, 'tokens': 40.0, 'grad_norm': 1.5}
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(
        self, reduce: str | Mapping[str, str] = "mean", nan_strategy: str | float = "warn", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        names = [reduce] if isinstance(reduce, str) else list(reduce.values()) if isinstance(reduce, Mapping) else None
        if names is None or any(name not in _rec.REDUCTIONS for name in names):
            raise ValueError(
                f"Expected `reduce` to be one of {_rec.REDUCTIONS} or a mapping from key to one of them but got"
                f" {reduce!r}"
            )
        self.reduce = reduce if isinstance(reduce, str) else dict(reduce)
        if not isinstance(nan_strategy, float) and nan_strategy not in _NAN_STRATEGIES:
            raise ValueError(
                f"Expected `nan_strategy` to be a float or one of {_NAN_STRATEGIES} but got {nan_strategy!r}"
            )
        self.nan_strategy = nan_strategy
        self._acc = _rec.Accumulator()
        self._layout = _rec.Layout()  # agreed with the other ranks at the syncs so far; kept across resets
        self._named: set[str] = set()  # keys whose name and reduction this rank has sent
        self._global: dict[str, float] | None = None

    def _codes(self, keys: list[str]) -> list[int]:
        if isinstance(self.reduce, str):
            return [_rec.REDUCTIONS.index(self.reduce) + 1] * len(keys)
        return [_rec.REDUCTIONS.index(self.reduce.get(key, "mean")) + 1 for key in keys]

    def update(self, values: Mapping[str, Number], weight: Number | Mapping[str, Number] = 1) -> None:
        """Add one value per key (a float, int or one-element tensor), with a weight (one, or one per key)."""
        if not isinstance(values, Mapping):
            raise TypeError(f"Expected `values` to be a mapping from str keys to scalars but got {type(values)}")
        keys = list(values)
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"Expected the keys of `values` to be str but got {key!r}")
            if key not in self._acc.index:  # a new key: its name travels in UTF-8, checked here on this rank
                try:
                    key.encode()
                except UnicodeEncodeError as err:
                    raise ValueError(
                        f"Expected the keys of `values` to be encodable in UTF-8 (their names travel so) but got"
                        f" {key!r} ({err.reason} at position {err.start}): decode file names with"
                        " `os.fsdecode(...).encode('utf-8', 'surrogateescape').decode('utf-8', 'replace')`, or pick"
                        " another name."
                    ) from err
        weights = [weight.get(key, 1) for key in keys] if isinstance(weight, Mapping) else [weight] * len(keys)
        both = _floats([values[key] for key in keys] + weights, keys)  # host numbers, or one tensor on a device
        v, w = both[: len(keys)], both[len(keys) :]
        codes = self._codes(keys)
        if isinstance(both, Tensor):
            self._acc.add_tensor(keys, codes, v, w, self.nan_strategy)
        else:
            self._acc.add(keys, codes, *self._handle_nan(keys, np.asarray(codes, dtype=np.int64), v, w))

    def _handle_nan(self, keys: list[str], codes: Any, v: Any, w: Any) -> tuple[Any, Any]:
        """Values and weights with NaN handled as ``nan_strategy`` says (as torchmetrics' aggregation metrics)."""
        nans = np.isnan(v) | ((codes == _rec.MEAN) & np.isnan(w))
        if self.nan_strategy == "disable" or not nans.any():
            return v, w
        named = [key for key, nan in zip(keys, nans.tolist()) if nan]
        if self.nan_strategy == "error":
            raise RuntimeError(f"Encountered `nan` values in ScalarLog keys {named}")
        if isinstance(self.nan_strategy, float):
            return np.where(nans, self.nan_strategy, v), np.where(nans, 1.0, w)
        if self.nan_strategy == "warn":
            rank_zero_warn(f"Encountered `nan` values in ScalarLog keys {named}. Will be removed.", UserWarning)
        return np.where(nans, _rec.FIRST[codes], v), np.where(nans, 0.0, w)  # dropped: still updated, at the identity

    def forward(self, values: Mapping[str, Number], weight: Number | Mapping[str, Number] = 1) -> None:
        """Same as :meth:`update` (a logging window is reduced by :meth:`compute`, never per call)."""
        self.update(values, weight)

    def compute(self) -> dict[str, float]:
        """Every key updated on some rank since the last ``reset()``, reduced over all ranks (Python floats)."""
        return dict(self._global if self._global is not None else _rec.local_results(self._read(self._acc.read())))

    def compute_async(self) -> "Future[dict[str, float]]":
        """Start this window's sync and return at once: a future of exactly the dict ``compute()`` returns now.

        As :meth:`torchmetrics_varlen.Metric.compute_async`; ``reset()`` may follow at once. A blocking ``compute()``
        of this log first waits for its pending syncs (the agreed key layout grows in their order).

        Example:
            >>> from torchmetrics_varlen import ScalarLog
            >>> log = ScalarLog()
            >>> log.update({"loss": 2.0}, weight=3)
            >>> future = log.compute_async()  # no process group: computed at once
            >>> log.reset()
            >>> future.result()
            {'loss': 2.0}
        """
        return super().compute_async()

    def _async_run(self, label: str) -> tuple[Callable[[Any], Any], list[Any]] | None:
        if type(self)._sync_dist is not ScalarLog._sync_dist:
            return None
        reading = self._acc.read()
        return lambda side: self._reduce_window(self._read(reading), side), reading.events

    def _read(self, reading: _rec.Reading) -> _rec.Accumulator:
        """A reading folded into one accumulator; NaN that tensor updates dropped is warned about now."""
        acc, nan = reading.folded()
        if nan and self.nan_strategy == "warn":
            rank_zero_warn(f"Encountered `nan` values in ScalarLog keys {nan}. Will be removed.", UserWarning)
        return acc

    def reset(self) -> None:
        """Start a new window (the agreed key layout is kept: known keys' names never travel again)."""
        super().reset()
        self._acc, self._global = _rec.Accumulator(), None

    def _sync_dist(self, dist_sync_fn: Callable[..., Any] = gather_all_tensors, process_group: Any = None) -> None:
        label = f"{type(self).__name__}.compute"
        sync_link = link(process_group or self.process_group, self.device, self.sync_timeout, f"sync of {label}")
        if sync_link is None:
            return
        wait(list(self._tv_pending))  # the key layout grows in the order of the syncs
        self._tv_pending.clear()
        self._global = self._reduce_window(self._read(self._acc.read()), sync_link)

    def _reduce_window(self, acc: _rec.Accumulator, sync_link: Any) -> dict[str, float]:
        """One exchange of the window ``acc`` over ``sync_link``; the agreed key layout grows by its new keys."""
        label = f"{type(self).__name__}.compute"
        record = _rec.make_record(acc, self._layout, self._named, label, sent_cap(self.sync_cap))
        new_names, new_codes, results = _engine.exchange(
            list(record), sync_link, lambda table: _rec.reduce_table(table, self._layout, sync_link.what)
        )
        self._layout.extend(new_names, new_codes)
        self._named.update(acc.index)
        return dict(results)

    def unsync(self, should_unsync: bool = True) -> None:
        """Go back to this rank's own accumulators (see :meth:`torchmetrics_varlen.Metric.unsync`)."""
        super().unsync(should_unsync)
        if not self._is_synced:
            self._global = None

    @staticmethod
    def _finish(value: Any) -> Any:
        # A fresh dict of Python floats: nothing to clone or squeeze (walking thousands of keys costs milliseconds).
        return value

    def _warn_before_update(self) -> None:
        """No "compute before update" warning: a rank without updates is expected here (keys differ by rank)."""


def sync_scalars(
    values: Mapping[str, Number],
    weight: Number | Mapping[str, Number] = 1,
    reduce: str | Mapping[str, str] = "mean",
    process_group: Any = None,
    **kwargs: Any,
) -> dict[str, float]:
    """Reduce one set of named scalars over all ranks, exactly: a one-window :class:`ScalarLog` in one line.

    The replacement of ``all_reduce(loss); loss /= world_size`` (a mean of per-rank means): pass each rank's own mean
    and its sample count as ``weight``. One collective; every rank gets the same dict (pass ``{}`` with nothing to
    log). Names travel at every call: for keys logged again and again, a :class:`ScalarLog` sends them once.

    Args:
        values: this rank's scalars by name (floats, ints or one-element tensors).
        weight: one weight, or one per key (``"mean"`` keys only): a batch's sample or token count.
        reduce: ``"mean"``, ``"sum"``, ``"max"``, ``"min"``, or a mapping from key to one of them (default ``"mean"``).
        process_group: the group to reduce over (default: the world).
        kwargs: keyword arguments of :class:`ScalarLog` (``nan_strategy``, ``sync_timeout``).

    Returns:
        Every key of any rank, reduced over the ranks that had it, as Python floats (float64).

    Example:
        >>> from torchmetrics_varlen import sync_scalars
        >>> sync_scalars({"loss": 0.25, "correct": 7}, weight=8, reduce={"correct": "sum"})  # a group of one
        {'loss': 0.25, 'correct': 7.0}
    """
    log = ScalarLog(reduce=reduce, process_group=process_group, **kwargs)
    log.update(values, weight)
    return log.compute()


def _item_name(i: int, keys: list[str]) -> tuple[str, str]:
    """What item ``i`` of ``_floats``' items is, for a message: ``("values", key)`` or ``("weight", key)``."""
    return ("values", keys[i]) if i < len(keys) else ("weight", keys[i - len(keys)])


def _floats(items: list[Any], keys: list[str]) -> Any:
    """``items`` (the values of ``keys``, then their weights) as float64: a host array, or a tensor on a device.

    On the first tensor's device not the CPU, the rest uploaded from pinned memory without blocking. Each item becomes
    float64 on its own: stacking first rounds to a common dtype (an int64 1,000,003 beside a bf16 loss: 999,424).
    """
    out = np.empty(len(items))
    device: torch.device | None = None  # the first accelerator's; the CPU's for CPU tensors only
    for i, item in enumerate(items):  # every update runs this per key: the common types are tested first, by identity
        if type(item) is float or type(item) is int:
            out[i] = item
        elif isinstance(item, Tensor):
            if item.numel() != 1 or item.is_complex():
                what, key = _item_name(i, keys)
                raise ValueError(
                    f"Expected `{what}` of key {key!r} to be a real scalar (one element) but got a tensor of shape"
                    f" {tuple(item.shape)} and dtype {item.dtype}"
                )
            if item.is_cpu:
                out[i] = item.item()  # exact in float64 (wider dtypes: rounded once, as by `.to(torch.float64)`)
                device = device or item.device
            elif device is None or device.type == "cpu":
                device = item.device
        elif isinstance(item, numbers.Real):  # bool, numpy numbers (numpy registers its own as Real)
            out[i] = float(item)
        else:
            what, key = _item_name(i, keys)
            raise TypeError(f"Expected `{what}` of key {key!r} to be a float, int or 0-d tensor but got {item!r}")
    if device is None or device.type == "cpu":
        return out if device is None else torch.from_numpy(out)
    parts = list(torch.from_numpy(out).pin_memory().to(device, non_blocking=True))
    for i, item in enumerate(items):
        if isinstance(item, Tensor) and item.device.type != "cpu":
            parts[i] = item.detach().reshape(()).to(device, torch.float64, non_blocking=True)
    return torch.stack(parts)
