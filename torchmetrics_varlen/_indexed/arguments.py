"""Argument capture: split an ``update`` call into per-sample tensors and per-call values, and keep one layout."""

import inspect
import pickle
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric as StockMetric

INDEX_NAME = "sample_index"


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(item) for item in value)
    return False


def check_sample_index(sample_index: Any) -> Tensor:
    """``sample_index`` as given, once checked to be a 1-D integer tensor."""
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
    return sample_index


class ArgumentCapture:
    """The wrapped metric's ``update`` signature, and how one call's arguments split into what is stored.

    Tensor arguments hold one row per sample and are stored per sample; every other argument is a per-call value that
    must not change between calls (it is pickled once and replayed). The layout of the first call (which tensor
    arguments, their dtype and trailing shape, the pickled per-call values) is kept, and every later call must match
    it, so that what the ranks gather can be stacked and replayed.
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
        """Bind a call; return its per-sample tensors and its pickled per-call values (checked against the layout).

        Returns:
            The tensors by parameter name, and the pickled per-call values when this is the first call of the layout
            (they must then be stored), else ``b""``.
        """
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
        values = sorted(repr(pickle.loads(item)) for item in encoded)
        raise ValueError(
            "Expected the non-tensor arguments to be identical on every call and every rank but got"
            f" {', '.join(values)}"
        )
    return pickle.loads(encoded.pop()) if encoded else {}  # type: ignore[no-any-return]
