"""The parts of :class:`~torchmetrics_varlen.IndexedMetric`, one section each: arguments, dedup, replay.

The gathered samples arrive in rank order, and on each rank in call order; a stable sort by dataset index keeps that
order among the copies of one index, so the first copy is the one from the lowest rank's earliest call.
"""

import copy
import inspect
import pickle
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric
from torchmetrics.utilities.data import dim_zero_cat

# ---------------------------------------------------------------------------------------------------------- arguments
INDEX_NAME = "sample_index"


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(item) for item in value)
    return isinstance(value, Tensor)


def check_sample_index(sample_index: Any) -> Tensor:
    """``sample_index`` as given, once checked to be a 1-D integer tensor."""
    if sample_index is None:
        raise ValueError(
            "Expected keyword argument `sample_index` (the dataset index of every sample, a 1-D integer tensor)"
            " but it was not given"
        )
    dtype = sample_index.dtype if isinstance(sample_index, Tensor) else None
    if dtype is None or sample_index.ndim != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        shape = tuple(sample_index.shape) if dtype is not None else type(sample_index).__name__
        raise ValueError(
            "Expected `sample_index` to be a 1-D integer tensor with one entry per sample but got shape"
            f" {shape} and dtype {dtype if dtype is not None else '-'}"
        )
    return sample_index  # type: ignore[no-any-return]  # a Tensor: `dtype` is None otherwise


class ArgumentCapture:
    """The wrapped metric's ``update`` signature, and how one call's arguments split into what is stored.

    Tensor arguments hold one row per sample; other arguments are per-call values, pickled once and replayed. The first
    call's layout binds every later call, so that what the ranks gather can be stacked and replayed.
    """

    def __init__(self, metric: StockMetric) -> None:
        self.wrapped_name = type(metric).__name__
        self.signature = inspect.signature(metric.update)
        params = list(self.signature.parameters.values())
        variadic = [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if variadic:
            raise TypeError(
                f"Expected the `update` of {self.wrapped_name} to have named parameters only, but it takes"
                f" {', '.join('*' * (1 + (p.kind == p.VAR_KEYWORD)) + p.name for p in variadic)}:"
                " IndexedMetric must know every argument in advance to gather it from ranks that hold no data."
            )
        if any(p.name == INDEX_NAME for p in params):
            raise TypeError(
                f"The `update` of {self.wrapped_name} has a parameter named `{INDEX_NAME}`, which IndexedMetric"
                " reserves for the dataset index."
            )
        self.input_names = [p.name for p in params]
        self.layout: tuple[frozenset[str], dict[str, tuple[torch.dtype, tuple[int, ...]]], bytes] | None = None

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any], samples: int) -> tuple[dict[str, Tensor], bytes]:
        """Bind a call: its tensors by name, and its pickled per-call values on the first call (else ``b""``)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(
                f"Arguments do not match {self.wrapped_name}.update{self.signature}: {err}"
                " (pass `sample_index` as a keyword argument)"
            ) from err
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
        return tensors, self._check_layout(tensors, static)

    def _check_layout(self, tensors: dict[str, Tensor], static: dict[str, Any]) -> bytes:
        """The same tensor arguments (dtype, trailing shape) and the same other arguments on every call."""
        try:
            encoded = pickle.dumps(static)
        except Exception as err:
            raise TypeError(f"Expected the non-tensor arguments to be picklable but got {static!r}: {err}") from err
        kinds = {name: (value.dtype, tuple(value.shape[1:])) for name, value in tensors.items() if value.numel() > 0}
        if self.layout is None:
            self.layout = (frozenset(tensors), kinds, encoded)
            return encoded
        names, known, first = self.layout
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
        return b""


def tensor_bytes(tensor: Tensor) -> bytes:
    """The bytes of a ``uint8`` tensor (which may be a view into a larger transfer buffer)."""
    return tensor.detach().cpu().numpy().tobytes()  # type: ignore[no-any-return]  # `bytes(storage)` iterates in Python


def distinct_static(items: list[Tensor]) -> list[Tensor]:
    """The pickled per-call values, each distinct one once (``forward`` adds them again at every step)."""
    distinct: dict[bytes, Tensor] = {}
    for item in items:
        distinct.setdefault(tensor_bytes(item), item)
    return list(distinct.values())


def decode_static(items: list[Tensor]) -> dict[str, Any]:
    """The per-call values every rank stored; they must be one and the same."""
    encoded = {tensor_bytes(item) for item in items}
    if len(encoded) > 1:
        # Pickled by this job's own ranks (the trust model of torch.distributed's object collectives).
        raise ValueError(
            "Expected the non-tensor arguments to be identical on every call and every rank but got"
            f" {', '.join(sorted(repr(pickle.loads(item)) for item in encoded))}"
        )
    return pickle.loads(encoded.pop()) if encoded else {}  # type: ignore[no-any-return]


# -------------------------------------------------------------------------------------------------------------- dedup
RULES = ("first", "error")


def sample_ranks(updates: Tensor | None, samples: int) -> Tensor | None:
    """The rank of every sample, from the ``(rank, samples)`` row each update stored; None if they do not add up."""
    if updates is None or updates.numel() == 0:
        return None
    ranks, sizes = updates[:, 0], updates[:, 1]
    if int(sizes.sum()) != samples:
        return None  # states set by hand (or loaded from elsewhere): no rank information to rely on
    return torch.repeat_interleave(ranks, sizes)


class Dedup:
    """The dataset ``index`` of every gathered sample (in gather order: rank, then call), sorted, copies located."""

    def __init__(self, index: Tensor) -> None:
        self.keys, self.order = torch.sort(index, stable=True)
        samples = self.keys.numel()
        self.first = torch.ones(samples, dtype=torch.bool, device=self.keys.device)
        self.first[1:] = self.keys[1:] != self.keys[:-1]
        positions = torch.arange(samples, device=self.keys.device)
        group_start = torch.where(self.first, positions, torch.zeros_like(positions)).cummax(0).values
        self.copies = positions[~self.first]  # sorted positions of the copies that are dropped
        self.kept = group_start[self.copies]  # sorted position of the copy kept for each of them

    def take(self) -> Tensor:
        """Gather positions of the samples to keep, in dataset index order."""
        return self.order[self.first]

    def _differs(self, data: Tensor) -> Tensor:
        """Per dropped copy: whether its row differs from the kept copy's (NaN equal to NaN)."""
        first, second = data[self.order[self.copies].to(data.device)], data[self.order[self.kept].to(data.device)]
        same = first == second
        if first.is_floating_point() or first.is_complex():
            same |= first.isnan() & second.isnan()
        return ~(same.flatten(1).all(1) if same.ndim > 1 else same)

    def check_all_agree(self, inputs: dict[str, Tensor]) -> None:
        """``duplicates="error"``: every copy carries the values of the copy that is kept."""
        if self.copies.numel() == 0:
            return
        for name, data in inputs.items():
            differs = self._differs(data)
            if bool(differs.any()):
                bad = int(torch.nonzero(differs)[0, 0])
                where, kept = int(self.copies[bad]), int(self.kept[bad])
                device = data.device
                raise ValueError(
                    f"Expected every copy of a sample to carry the same values (duplicates='error') but sample index"
                    f" {int(self.keys[where])} has `{name}` = {data[self.order[kept].to(device)].tolist()!r} in its"
                    f" first copy and {data[self.order[where].to(device)].tolist()!r} in another (from another rank or"
                    " call). Pass duplicates='first' to keep the first copy."
                )

    def check_padding_like(self, inputs: dict[str, Tensor], ranks: Tensor | None, world_size: int) -> None:
        """``duplicates="first"``: refuse copies with other values beyond what a padding sampler produces."""
        if self.copies.numel() == 0:
            return
        differs = torch.zeros(self.copies.numel(), dtype=torch.bool, device=self.keys.device)
        for data in inputs.values():
            differs |= self._differs(data).to(differs.device)
        conflicts = int(differs.sum())
        if conflicts == 0:
            return  # identical copies: dropping them loses nothing
        within: dict[int, int] = {}
        if ranks is not None:
            sorted_ranks = ranks.to(self.order.device)[self.order]
            # A copy's predecessor in sorted order is an earlier copy of the same index (rank order, then call order).
            same_rank = (sorted_ranks[self.copies] == sorted_ranks[self.copies - 1]) & differs
            found = torch.unique(sorted_ranks[self.copies][same_rank], return_counts=True)
            within = {int(rank): int(count) for rank, count in zip(*found)}
        if not within and conflicts < world_size:
            return  # as much as padding can produce: the copies are taken for the same samples
        counts = ", ".join(f"{count} on rank {rank}" for rank, count in sorted(within.items()))
        where = f" ({counts} repeat an index that the same rank already used)" if within else ""
        raise ValueError(
            "Expected `sample_index` to hold dataset indices (each sample's index in the whole data set, the same on"
            f" every rank) but {conflicts} of {self.keys.numel()} samples repeat an index with different values"
            f"{where}. A padding sampler repeats fewer than world_size = {world_size} samples in all and never one"
            " within a rank, so these look like per-rank indices, and duplicates='first' would silently drop them."
            " Pass the index of each sample in the whole data set (the indices the sampler yields, not positions"
            " within a rank's shard or batch); duplicates='error' shows the first conflicting sample."
        )


# ------------------------------------------------------------------------------------------------------------- replay
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
