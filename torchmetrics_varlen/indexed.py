"""``IndexedMetric``: exact evaluation whatever the sampler, by keying every sample with its dataset index."""

import copy
import functools
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics.utilities.data import dim_zero_cat

from torchmetrics_varlen.metric import Metric
from torchmetrics_varlen.onerank import one_rank_compute

__all__ = ["IndexedMetric"]

_INDEX_STATE = "sample_index"
_STATIC_STATE = "static_args"
_INPUT_PREFIX = "input_"
_DUPLICATE_RULES = ("first", "error")


def _no_process_group() -> bool:
    return False


def _cat(value: Any) -> Tensor | None:
    """A ``cat`` state as one tensor (local list or synced tensor), or None when it holds nothing."""
    if isinstance(value, Tensor):
        return value
    return dim_zero_cat(value) if value else None


def _tensor_bytes(tensor: Tensor) -> bytes:
    """The bytes of a ``uint8`` tensor (which may be a view into a larger transfer buffer)."""
    return bytes(tensor.detach().cpu().clone().untyped_storage())


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(item) for item in value)
    return False


def _rows_equal(first: Tensor, second: Tensor) -> Tensor:
    """Per row (dim 0): equal values, NaN equal to NaN."""
    same = first == second
    if first.is_floating_point() or first.is_complex():
        same |= first.isnan() & second.isnan()
    return same.flatten(1).all(1) if same.ndim > 1 else same


class IndexedMetric(Metric):
    """Evaluate any metric exactly as one process would, whatever the sampler, by the dataset index of each sample.

    ``torch.utils.data.DistributedSampler`` pads the data set so that every rank gets the same number of samples: some
    samples are evaluated twice, and a distributed metric counts them twice. Ranks also see the samples in an order
    that no single process would use, which changes order-sensitive results (``CatMetric``, float sums). Wrap the
    metric in ``IndexedMetric`` and pass the dataset index of every sample: at ``compute()`` the inputs of all ranks
    are gathered, ordered by dataset index, each index kept once, and the wrapped metric is computed on the ordered
    data, without any sync of its own. The result equals, bit for bit, that of one process that updates the wrapped
    metric once with the whole data set in index order (or in batches of ``update_batch_size``), for any sampler,
    world size, padding, uneven or empty shards.

    ``update`` and ``forward`` take the wrapped metric's arguments plus the keyword ``sample_index``, a 1-D integer
    tensor with one dataset index per sample. Every tensor argument must hold one entry per sample along dim 0
    (retrieval ``indexes`` are just another such argument, so query groups survive the reordering). Other arguments
    (numbers, strings, ...) are passed through to the wrapped metric; they must be identical on every call and every
    rank.

    **Duplicate rule.** With ``duplicates="first"`` (default) the first copy of each index wins: the copy from the
    lowest rank, and on that rank from the earliest ``update`` call. The padding copies of ``DistributedSampler`` are
    the same samples, so which one wins does not matter there. With ``duplicates="error"`` every copy is compared with
    the first one (a cheap check on the ordered data) and ``compute()`` raises ``ValueError`` on every rank when two
    copies of one index carry different values (NaN equals NaN).

    The inputs are kept as ``cat`` states, so memory grows with the data set like ``BinaryAUROC(thresholds=None)``
    does; with ``compute_on_rank=r`` only rank ``r`` gathers them (see
    :func:`~torchmetrics_varlen.compute_on_rank`). In a :class:`~torchmetrics_varlen.MetricCollection` the
    collection syncs its members together, so there ``compute_on_rank`` is not used; several ``IndexedMetric``
    members with the same arguments form one compute group and their inputs travel once.

    Limitations: non-tensor per-sample arguments (lists of strings for text metrics) are rejected; the wrapped
    metric's ``update`` must name its parameters; ``higher_is_better`` and plotting of the wrapped metric are not
    carried over.

    Args:
        metric: the metric to evaluate: a stock torchmetrics metric or a :class:`~torchmetrics_varlen.Metric`. A copy
            is kept, reset and with its own sync disabled; its ``update`` must have named parameters (no ``*args`` or
            ``**kwargs``).
        duplicates: ``"first"`` keeps the first copy of each index, ``"error"`` also checks that all copies agree.
        update_batch_size: feed the ordered data to the wrapped metric in updates of this many samples, to reproduce
            bit for bit a single-process loop with that batch size (float sums depend on it). None: one update.
        compute_on_rank: when set to a rank, ``compute()`` gathers the inputs to that rank only, computes there and
            broadcasts the result, so the other ranks never hold the whole data set. None: every rank gathers all
            inputs and computes (two collectives, the usual one-shot sync).
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
        if duplicates not in _DUPLICATE_RULES:
            raise ValueError(f"Expected `duplicates` to be one of {_DUPLICATE_RULES} but got {duplicates!r}")
        if update_batch_size is not None and (
            isinstance(update_batch_size, bool) or not isinstance(update_batch_size, int) or update_batch_size < 1
        ):
            raise ValueError(
                f"Expected `update_batch_size` to be a positive integer or None but got {update_batch_size!r}"
            )
        if compute_on_rank is not None and (
            isinstance(compute_on_rank, bool) or not isinstance(compute_on_rank, int) or compute_on_rank < 0
        ):
            raise ValueError(
                f"Expected `compute_on_rank` to be a non-negative integer rank or None but got {compute_on_rank!r}"
            )
        signature = inspect.signature(metric.update)
        params = list(signature.parameters.values())
        variadic = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if variadic:
            raise TypeError(
                f"Expected the `update` of {type(metric).__name__} to have named parameters only, but it takes"
                f" {', '.join('*' * (1 + (p.kind == p.VAR_KEYWORD)) + p.name for p in params if p.name in variadic)}:"
                " IndexedMetric must know every argument in advance to gather it from ranks that hold no data."
            )
        if any(p.name == _INDEX_STATE for p in params):
            raise TypeError(
                f"The `update` of {type(metric).__name__} has a parameter named `{_INDEX_STATE}`, which IndexedMetric"
                " reserves for the dataset index."
            )
        template = copy.deepcopy(metric)
        template.reset()
        template.sync_on_compute = False
        template._to_sync = False
        template.dist_sync_on_step = False
        template.distributed_available_fn = _no_process_group
        self.metric = template
        self.duplicates = duplicates
        self.update_batch_size = update_batch_size
        self.compute_on_rank = compute_on_rank
        self._signature = signature
        self._input_names = [p.name for p in params]
        for name in self._input_names:
            self.add_state(_INPUT_PREFIX + name, default=[], dist_reduce_fx="cat")
        self.add_state(_INDEX_STATE, default=[], dist_reduce_fx="cat")
        self.add_state(_STATIC_STATE, default=[], dist_reduce_fx=None)
        self._layout: tuple[frozenset[str], dict[str, tuple[torch.dtype, tuple[int, ...]]], bytes] | None = None

    def _wrapped_name(self) -> str:
        return type(self.metric).__name__

    # ---------------------------------------------------------------------------------------------------- update
    def update(self, *args: Any, sample_index: Tensor | None = None, **kwargs: Any) -> None:
        """Store a batch: the wrapped metric's arguments and the dataset index of every sample.

        Args:
            args: positional arguments of the wrapped metric's ``update``.
            sample_index: 1-D integer tensor, the dataset index of each sample (one entry per row of every tensor
                argument).
            kwargs: keyword arguments of the wrapped metric's ``update``.
        """
        if sample_index is None:
            raise ValueError(
                "Expected keyword argument `sample_index` (the dataset index of every sample, a 1-D integer tensor)"
                " but it was not given"
            )
        if (
            not isinstance(sample_index, Tensor)
            or sample_index.ndim != 1
            or sample_index.is_floating_point()
            or sample_index.is_complex()
            or sample_index.dtype == torch.bool
        ):
            shape = tuple(sample_index.shape) if isinstance(sample_index, Tensor) else type(sample_index).__name__
            dtype = sample_index.dtype if isinstance(sample_index, Tensor) else "-"
            raise ValueError(
                "Expected `sample_index` to be a 1-D integer tensor with one entry per sample but got shape"
                f" {shape} and dtype {dtype}"
            )
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(
                f"Arguments do not match {self._wrapped_name()}.update{self._signature}: {err}"
                " (pass `sample_index` as a keyword argument)"
            ) from err
        samples = sample_index.numel()
        tensors: dict[str, Tensor] = {}
        static: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if isinstance(value, Tensor):
                if value.ndim == 0 or value.shape[0] != samples:
                    raise ValueError(
                        f"Expected every tensor argument to have one entry per sample along dim 0 ({samples} samples"
                        f" in `sample_index`) but `{name}` has shape {tuple(value.shape)}"
                    )
                tensors[name] = value
            elif _holds_tensor(value):
                raise TypeError(
                    f"Expected argument `{name}` to be a tensor with one entry per sample, or a value without tensors"
                    f" that is the same on every call, but got a {type(value).__name__} holding tensors"
                )
            else:
                static[name] = value
        self._check_layout(tensors, static)
        if samples == 0:
            return
        for name, value in tensors.items():
            getattr(self, _INPUT_PREFIX + name).append(value.detach())
        getattr(self, _INDEX_STATE).append(sample_index.detach().to(torch.int64))

    def _check_layout(self, tensors: dict[str, Tensor], static: dict[str, Any]) -> None:
        """The same tensor arguments (dtype, trailing shape) and the same other arguments on every call."""
        try:
            encoded = pickle.dumps(static)
        except Exception as err:
            raise TypeError(f"Expected the non-tensor arguments to be picklable but got {static!r}: {err}") from err
        kinds = {name: (value.dtype, tuple(value.shape[1:])) for name, value in tensors.items() if value.numel() > 0}
        if self._layout is None:
            self._layout = (frozenset(tensors), kinds, encoded)
            getattr(self, _STATIC_STATE).append(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
            return
        names, known, first = self._layout
        if names != frozenset(tensors):
            raise ValueError(
                f"Expected the same tensor arguments on every call but got {sorted(tensors)} after {sorted(names)}"
            )
        if encoded != first:
            raise ValueError(
                f"Expected the non-tensor arguments to be identical on every call but got {static!r} after"
                f" {pickle.loads(first)!r}"
            )
        for name, kind in kinds.items():
            seen = known.setdefault(name, kind)
            if seen != kind:
                raise ValueError(
                    f"Expected `{name}` to keep its dtype and trailing shape on every call but got dtype {kind[0]} and"
                    f" shape (n, {', '.join(map(str, kind[1]))}) after dtype {seen[0]} and shape"
                    f" (n, {', '.join(map(str, seen[1]))})"
                )

    def reset(self) -> None:
        """Clear the stored samples (and the argument layout of the first call)."""
        super().reset()
        self._layout = None

    def _reduce_states(self, incoming_state: dict[str, Any]) -> None:
        super()._reduce_states(incoming_state)
        # `forward` adds the non-tensor arguments again at every step: keep each distinct value once.
        distinct: dict[bytes, Tensor] = {}
        for item in getattr(self, _STATIC_STATE):
            distinct.setdefault(_tensor_bytes(item), item)
        setattr(self, _STATIC_STATE, list(distinct.values()))

    # --------------------------------------------------------------------------------------------------- compute
    def _static_arguments(self) -> dict[str, Any]:
        encoded = {_tensor_bytes(item) for item in getattr(self, _STATIC_STATE)}
        if len(encoded) > 1:
            # Pickled by this job's own ranks (the trust model of torch.distributed's object collectives).
            values = sorted(repr(pickle.loads(item)) for item in encoded)
            raise ValueError(
                "Expected the non-tensor arguments to be identical on every call and every rank but got"
                f" {', '.join(values)}"
            )
        return pickle.loads(encoded.pop()) if encoded else {}  # type: ignore[no-any-return]

    def compute(self) -> Any:
        """Order the inputs of all ranks by dataset index, keep each index once, and compute the wrapped metric."""
        static = self._static_arguments()
        index = _cat(getattr(self, _INDEX_STATE))
        inputs: dict[str, Tensor] = {}
        samples = 0 if index is None else index.numel()
        for name in self._input_names:
            data = _cat(getattr(self, _INPUT_PREFIX + name))
            if data is None:
                continue  # an optional argument passed nowhere
            if data.shape[0] != samples:
                raise ValueError(
                    f"Expected `{name}` to be passed with every update on every rank, or never, but it holds"
                    f" {data.shape[0]} samples while `sample_index` holds {samples}"
                )
            inputs[name] = data
        metric = copy.deepcopy(self.metric)
        if index is None or samples == 0:
            return metric.compute()  # no data anywhere: as one process that never updated
        keys, order = torch.sort(index, stable=True)
        first = torch.ones(samples, dtype=torch.bool, device=keys.device)
        first[1:] = keys[1:] != keys[:-1]
        if self.duplicates == "error":
            self._check_duplicates(keys, order, first, inputs)
        take = order[first]
        ordered = {name: data[take.to(data.device)] for name, data in inputs.items()}
        del inputs
        total = int(take.numel())
        step = self.update_batch_size or total
        for start in range(0, total, step):
            bound = self._signature.bind_partial()
            bound.arguments.update(static)
            bound.arguments.update({name: data[start : start + step] for name, data in ordered.items()})
            metric.update(*bound.args, **bound.kwargs)
        return metric.compute()

    def _check_duplicates(self, keys: Tensor, order: Tensor, first: Tensor, inputs: dict[str, Tensor]) -> None:
        if bool(first.all()):
            return
        positions = torch.arange(keys.numel(), device=keys.device)
        group_start = torch.where(first, positions, torch.zeros_like(positions)).cummax(0).values
        copies = positions[~first]
        kept = group_start[copies]
        for name, data in inputs.items():
            device = data.device
            same = _rows_equal(data[order[copies].to(device)], data[order[kept].to(device)])
            if not bool(same.all()):
                bad = int(torch.nonzero(~same)[0, 0])
                where = int(copies[bad])
                raise ValueError(
                    f"Expected every copy of a sample to carry the same values (duplicates='error') but sample index"
                    f" {int(keys[where])} has `{name}` = {data[order[kept[bad]].to(device)].tolist()!r} in its first"
                    f" copy and {data[order[where].to(device)].tolist()!r} in another (from another rank or call)."
                    " Pass duplicates='first' to keep the first copy."
                )

    def _wrap_compute(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        every_rank = super()._wrap_compute(compute)

        @functools.wraps(compute)
        def wrapped_compute(*args: Any, **kwargs: Any) -> Any:
            dst = getattr(self, "compute_on_rank", None)
            if dst is None:
                return every_rank(*args, **kwargs)
            return one_rank_compute(self, dst, functools.partial(every_rank, *args, **kwargs))

        return wrapped_compute
