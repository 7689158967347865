"""The collective meters: how many collectives a block of code issues, and how many bytes they move.

:class:`CollectiveCounter` counts the ``torch.distributed`` collective calls made while it is active;
:class:`ByteMeter` also counts the bytes each collective receives and the buffers it uses. Both wrap the collectives'
Python functions for the duration of a ``with`` block (the package looks them up at call time). The tests use
them, and so do the demo and the benchmarks, which import them from the repository root as ``tests._meters``.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor

__all__ = ["ByteMeter", "CollectiveCounter"]


class CollectiveCounter:
    """Counts ``torch.distributed`` collective calls made while active (nested calls count once)."""

    NAMES = ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast")

    def __init__(self) -> None:
        self.count = 0
        self._originals: dict[str, Callable[..., Any]] = {}
        self._depth = 0

    def __enter__(self) -> "CollectiveCounter":
        for name in self.NAMES:
            if hasattr(dist, name):
                self._originals[name] = original = getattr(dist, name)
                setattr(dist, name, self._wrap(original))
        return self

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += self._depth == 0
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)


# Per collective: the parameter holding what it writes (received) and what it reads (sent). Lists count every item.
_BUFFERS: dict[str, tuple[str | None, str | None]] = {
    "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "all_gather_single": ("output_tensor", "input_tensor"),
    "_all_gather_base": ("output_tensor", "input_tensor"),
    "all_gather": ("tensor_list", "tensor"),
    "all_reduce": ("tensor", None),  # in place: its one buffer is what it receives
    "broadcast": ("tensor", None),
    "gather": ("gather_list", "tensor"),  # received on the destination rank only
    "reduce": ("tensor", None),
    "reduce_scatter": ("output", "input_list"),
    "all_to_all_single": ("output", "input"),
    "barrier": (None, None),
}


def _nbytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


def _own_bytes(name: str, arguments: Mapping[str, Any], out: int) -> int:
    """The part of a collective's output that this rank does not receive from a peer (its own slot, or a root's)."""
    group = arguments.get("group")
    if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
        return out // dist.get_world_size(group)
    if name == "all_gather":
        return _nbytes(arguments["tensor_list"][dist.get_rank(group)])
    if name == "broadcast":  # the root only sends: its buffer is its own data
        return out if arguments.get("src") == dist.get_rank() else 0
    if name == "gather" and out:  # only the destination has a list
        return _nbytes(arguments["gather_list"][dist.get_rank(group)])
    return 0  # a reduction's result comes from every rank


class ByteMeter:
    """Counts the collectives issued while active, the bytes they receive and the collective buffers they use.

    ``received`` sums each collective's output buffers (an all-gather's ``world_size x`` its input, an all-reduce's
    buffer, a gather's list on the destination rank, a broadcast's buffer on every rank, the root's included): what
    a rank receives and allocates. ``from_peers`` is the part of it that came from other ranks (no own slot of a
    gather, nothing on a broadcast's root). ``buffers`` sums every collective's output and (separate)
    input buffers over the whole block: an upper bound of the peak collective memory, and what both libraries
    really hold, since each keeps every received buffer of a sync until it reduces the states. ``largest`` is the
    largest single collective's output plus input. ``calls`` lists ``(name, received bytes)`` per collective, in
    order. Calls nested inside another wrapped call count once.

    Example:
        >>> with ByteMeter() as meter:
        ...     pass  # a sync here
        >>> meter.collectives, meter.received
        (0, 0)
    """

    def __init__(self) -> None:
        self.collectives = 0
        self.received = 0
        self.buffers = 0
        self.largest = 0
        self.from_peers = 0
        self.calls: list[tuple[str, int]] = []
        self._originals: dict[str, Callable[..., Any]] = {}
        self._depth = 0

    def __enter__(self) -> "ByteMeter":
        for name in _BUFFERS:
            if hasattr(dist, name):
                self._originals[name] = original = getattr(dist, name)
                setattr(dist, name, self._wrap(name, original, _BUFFERS[name]))
        return self

    def _wrap(self, name: str, fn: Callable[..., Any], buffers: tuple[str | None, str | None]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        out_name, in_name = buffers

        def measured(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                bound = signature.bind_partial(*args, **kwargs).arguments
                out = _nbytes(bound.get(out_name)) if out_name else 0
                sent = _nbytes(bound.get(in_name)) if in_name else 0
                self.collectives += 1
                self.received += out
                self.buffers += out + sent
                self.largest = max(self.largest, out + sent)
                self.from_peers += out - _own_bytes(name, bound, out)
                self.calls.append((name, out))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return measured

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)

    def as_dict(self) -> dict[str, int]:
        """The counts, as the JSON report stores them."""
        return {"collectives": self.collectives, "received": self.received, "buffers": self.buffers}
