"""``IndexedMetric``: exact evaluation whatever the sampler, by keying every sample with its dataset index.

The class owns the states and wires together the parts in :mod:`torchmetrics_varlen._indexed`.
"""

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric as StockMetric

from torchmetrics_varlen import _indexed
from torchmetrics_varlen.metric import Metric
from torchmetrics_varlen.onerank import one_rank_compute
from torchmetrics_varlen.sampler import _is_int

__all__ = ["IndexedMetric"]

_INDEX_STATE = _indexed.INDEX_NAME
_STATIC_STATE = "static_args"
_UPDATES_STATE = "update_sizes"  # one (rank, samples) row per update: where each sample came from
_INPUT_PREFIX = "input_"


def _no_process_group() -> bool:
    return False


def _rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank and the world size of ``group`` (0 and 1 without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class IndexedMetric(Metric):
    """Evaluate any metric exactly as one process would, whatever the sampler, by the dataset index of each sample.

    Padding and the ranks' order change a distributed metric's value (see the "Exact evaluation" docs page). At
    ``compute()`` the inputs of all ranks are gathered, ordered by dataset index, each index kept once, and the wrapped
    metric is computed on them: bit for bit one process updating it with the whole data set in index order (or in
    ``update_batch_size`` batches), for any sampler, world size, padding, uneven or empty shards.

    ``update`` and ``forward`` take the wrapped metric's arguments plus the keyword ``sample_index``, a 1-D integer
    tensor with one dataset index per sample. Every tensor argument must hold one entry per sample along dim 0
    (retrieval ``indexes`` too, so query groups survive the reordering); other arguments are passed through, and must
    be identical on every call and every rank.

    **Duplicate rule.** With ``duplicates="first"`` (default) the first copy of each index wins: the one from the
    lowest rank's earliest ``update``. Copies with different values beyond what a padding sampler produces (fewer
    than ``world_size`` in all, never two on one rank) are refused as per-rank indices. ``duplicates="error"`` refuses
    any two copies of one index with different values (NaN equals NaN). Either raises ``ValueError`` on every rank.

    The inputs are kept as ``cat`` states, so memory grows with the data set. In a
    :class:`~torchmetrics_varlen.MetricCollection` the collection syncs its members together (``compute_on_rank`` is
    not used there). Not carried over: non-tensor per-sample arguments (rejected), ``higher_is_better``, plotting.

    Args:
        metric: the metric to evaluate, stock or :class:`~torchmetrics_varlen.Metric`; a copy is kept, reset, with its
            own sync disabled. Its ``update`` must have named parameters (no ``*args`` or ``**kwargs``).
        duplicates: ``"first"`` keeps the first copy of each index, ``"error"`` also checks that all copies agree.
        update_batch_size: feed the ordered data to the wrapped metric in updates of this many samples, to reproduce
            bit for bit a single-process loop with that batch size (float sums depend on it). None: one update.
        compute_on_rank: a rank that alone gathers the inputs and computes, then broadcasts the result (see
            :func:`~torchmetrics_varlen.compute_on_rank`). None: every rank gathers all inputs and computes.
        kwargs: the keyword arguments of :class:`~torchmetrics_varlen.Metric` (``sync_timeout``, ``process_group``,
            ``dist_sync_on_step``, ...).

    Raises:
        TypeError: ``metric`` is not a torchmetrics metric, or its ``update`` takes ``*args``/``**kwargs`` or a
            parameter named ``sample_index``.
        ValueError: an option has a wrong value.

    Example:
        Padding duplicates are counted once, and ``CatMetric`` returns the samples in dataset order:

        >>> import torch
        >>> from torchmetrics.aggregation import CatMetric
        >>> from torchmetrics_varlen.indexed import IndexedMetric
        >>> metric = IndexedMetric(CatMetric())
        >>> metric.update(torch.tensor([30.0, 10.0]), sample_index=torch.tensor([3, 1]))
        >>> metric.update(torch.tensor([20.0, 30.0]), sample_index=torch.tensor([2, 3]))  # 3 again: a padding copy
        >>> metric.compute()
        tensor([10., 20., 30.])

        Any metric, with its own arguments; conflicting copies can be made an error:

        >>> from torchmetrics.classification import BinaryAUROC
        >>> auroc = IndexedMetric(BinaryAUROC(thresholds=None), duplicates="error")
        >>> auroc.update(torch.tensor([0.9, 0.2]), torch.tensor([1, 0]), sample_index=torch.tensor([0, 1]))
        >>> auroc.update(torch.tensor([0.4, 0.9]), target=torch.tensor([1, 1]), sample_index=torch.tensor([2, 0]))
        >>> auroc.compute()
        tensor(1.)
    """

    full_state_update = False
    is_differentiable = False

    def __init__(
        self,
        metric: StockMetric,
        *,
        duplicates: str = "first",
        update_batch_size: int | None = None,
        compute_on_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(metric, StockMetric):
            raise TypeError(f"Expected `metric` to be a torchmetrics.Metric but got {type(metric).__name__}")
        if duplicates not in _indexed.RULES:
            raise ValueError(f"Expected `duplicates` to be one of {_indexed.RULES} but got {duplicates!r}")
        if update_batch_size is not None and not (_is_int(update_batch_size) and update_batch_size >= 1):
            raise ValueError(
                f"Expected `update_batch_size` to be a positive integer or None but got {update_batch_size!r}"
            )
        if compute_on_rank is not None and not (_is_int(compute_on_rank) and compute_on_rank >= 0):
            raise ValueError(
                f"Expected `compute_on_rank` to be a non-negative integer rank or None but got {compute_on_rank!r}"
            )
        self._arguments = _indexed.ArgumentCapture(metric)
        template = copy.deepcopy(metric)
        template.reset()
        template.sync_on_compute = template._to_sync = template.dist_sync_on_step = False
        template.distributed_available_fn = _no_process_group
        self.metric, self.duplicates = template, duplicates
        self.update_batch_size, self.compute_on_rank = update_batch_size, compute_on_rank
        self._input_names = self._arguments.input_names
        for name in self._input_names:
            self.add_state(_INPUT_PREFIX + name, default=[], dist_reduce_fx="cat")
        self.add_state(_INDEX_STATE, default=[], dist_reduce_fx="cat")
        self.add_state(_UPDATES_STATE, default=[], dist_reduce_fx="cat")
        self.add_state(_STATIC_STATE, default=[], dist_reduce_fx=None)

    def update(self, *args: Any, sample_index: Tensor | None = None, **kwargs: Any) -> None:
        """Store a batch: the wrapped metric's arguments and the dataset index of every sample.

        Args:
            args: positional arguments of the wrapped metric's ``update``.
            sample_index: 1-D integer tensor, the dataset index of each sample (one entry per row of every tensor
                argument).
            kwargs: keyword arguments of the wrapped metric's ``update``.
        """
        index = _indexed.check_sample_index(sample_index)
        samples = index.numel()
        tensors, first_static = self._arguments.split(args, kwargs, samples)
        if first_static:
            getattr(self, _STATIC_STATE).append(torch.frombuffer(bytearray(first_static), dtype=torch.uint8))
        if samples == 0:
            return
        for name, value in tensors.items():
            getattr(self, _INPUT_PREFIX + name).append(value.detach())
        getattr(self, _INDEX_STATE).append(index.detach().to(torch.int64))
        rank, _ = _rank_and_size(self.process_group)
        getattr(self, _UPDATES_STATE).append(torch.tensor([[rank, samples]], dtype=torch.int64, device=index.device))

    def reset(self) -> None:
        """Clear the stored samples (and the argument layout of the first call)."""
        super().reset()
        self._arguments.layout = None

    def _reduce_states(self, incoming_state: dict[str, Any]) -> None:
        super()._reduce_states(incoming_state)
        setattr(self, _STATIC_STATE, _indexed.distinct_static(getattr(self, _STATIC_STATE)))

    def compute(self) -> Any:
        """Order the inputs of all ranks by dataset index, keep each index once, and compute the wrapped metric."""
        static = _indexed.decode_static(getattr(self, _STATIC_STATE))
        index = _indexed.as_tensor(getattr(self, _INDEX_STATE))
        samples = 0 if index is None else index.numel()
        inputs = _indexed.gathered_inputs({n: getattr(self, _INPUT_PREFIX + n) for n in self._input_names}, samples)
        if index is None or samples == 0:
            return _indexed.replay(self.metric, self._arguments.signature, static, {}, None)  # as one process, no data
        order = _indexed.Dedup(index)
        if self.duplicates == "error":
            order.check_all_agree(inputs)
        else:
            ranks = _indexed.sample_ranks(_indexed.as_tensor(getattr(self, _UPDATES_STATE)), samples)
            order.check_padding_like(inputs, ranks, _rank_and_size(self.process_group)[1])
        take = order.take()
        ordered = {name: data[take.to(data.device)] for name, data in inputs.items()}
        del inputs
        return _indexed.replay(self.metric, self._arguments.signature, static, ordered, self.update_batch_size)

    def _wrap_compute(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        every_rank = super()._wrap_compute(compute)

        @functools.wraps(compute)
        def wrapped_compute(*args: Any, **kwargs: Any) -> Any:
            if self.compute_on_rank is None:
                return every_rank(*args, **kwargs)
            return one_rank_compute(self, self.compute_on_rank, functools.partial(every_rank, *args, **kwargs))

        return wrapped_compute
