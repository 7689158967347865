"""Python objects in list states: pickled into ``uint8`` items before the sync, loaded again after it.

A list state may hold any picklable objects (strings, bytes, tuples, dicts, numpy arrays, RLE masks), alone or mixed
with tensors. Before the record exchange, :func:`encode` turns such a rank's list into an :class:`~.record.ObjectList`:
the bytes of every tensor inside it, each one ``uint8`` item viewed where it lives (pickle's ``reducer_override``
takes them out, so a tensor never goes through pickle and keeps its dtype, shape and device), then one pickle of the
whole list. Its slot says "objects" (``OBJECT_ITEMS``), so every rank, an empty one too, learns from the records
which ranks' pieces to load; the items travel as any list state's, and :func:`decode_results` loads them after the
sync. An item pickle refuses is reported in the record (``ObjectFailure``): every rank raises before any data moves.
A pickle that fails to load is known to its loading rank only, so a sync that moved objects ends with one tiny
agreement (``move.agree``, with :func:`failure_words` and :func:`load_error`).

Unpickling runs code: only peers of the same job are trusted, as with ``torch.distributed``'s object collectives.
"""

import gc
import io
import math
import pickle
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen._engine.plan import EntryPlan
from torchmetrics_varlen._engine.record import (
    DTYPES,
    KIND_LIST,
    OBJECT_ITEMS,
    ObjectFailure,
    ObjectList,
    decode_text,
    encode_text,
    resolved,
)
from torchmetrics_varlen.errors import SyncMismatchError

_NAMES = MappingProxyType({dtype: str(dtype).removeprefix("torch.") for dtype in DTYPES})
_BY_NAME = MappingProxyType({name: dtype for dtype, name in _NAMES.items()})
_TYPE_WORDS = 5  # the start of a type's name in an agreement's words


class _Pickler(pickle.Pickler):
    """Pickles a list state's items, taking every tensor out into ``tensors`` (in its place: a :func:`_tensor_ref`).

    ``reducer_override`` rather than ``persistent_id``: pickle skips it for strings, bytes, numbers, dicts, lists and
    tuples, which is most of what object states hold (``persistent_id`` is asked about every object, 3x the time).
    """

    def __init__(self, file: io.BytesIO, tensors: list[Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor):
            return NotImplemented
        if obj.layout != torch.strided or obj.dtype not in _NAMES:
            raise pickle.PicklingError(f"a {obj.layout} tensor of dtype {obj.dtype} cannot travel as its bytes")
        self.tensors.append(obj)
        return _tensor_ref, (len(self.tensors) - 1, _NAMES[obj.dtype], tuple(obj.shape), obj.device.type)


def _tensor_ref(index: int, dtype_name: str, shape: tuple[int, ...], device_type: str) -> Tensor:
    """A tensor taken out of a pickle (``_Pickler``); the unpickler that loads it puts its own method in its place."""
    raise pickle.UnpicklingError("a tensor taken out of a torchmetrics_varlen object pickle is loaded by its sync")


def encode(items: list[Any], always: bool = False) -> list[Any] | ObjectList | ObjectFailure:
    """A list state as it travels: itself (tensors only, unless ``always``), its ObjectList, or an item's failure."""
    if not always and all(isinstance(item, Tensor) for item in items):
        return items
    tensors: list[Tensor] = []
    file = io.BytesIO()
    try:
        _Pickler(file, tensors).dump(items)
    except Exception:  # whatever pickle raised: the record names the item, every rank raises
        return _failure(items)
    # Each tensor's elements as a flat ``uint8`` view where it lives (a copy only where not contiguous), then the
    # pickle's own buffer, no copy: the tensor holds the memoryview and with it the buffer
    payloads = [resolved(tensor.detach()).contiguous().reshape(-1).view(torch.uint8) for tensor in tensors]
    return ObjectList([*payloads, torch.frombuffer(file.getbuffer(), dtype=torch.uint8)])


def _failure(items: list[Any]) -> ObjectFailure:
    """The first item pickle refuses, on its own (the failure path only)."""
    for index, item in enumerate(items):
        try:
            _Pickler(io.BytesIO(), []).dump(item)
        except Exception:
            return ObjectFailure(index, type_name(item))
    return ObjectFailure(len(items), type_name(items))  # only the list as a whole (a cycle through it): name it


def type_name(item: Any) -> str:
    """``module.QualName`` of an item's type (builtins by name alone), for messages."""
    kind = type(item)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


class _Unpickler(pickle.Unpickler):
    """Loads one rank's pickle, its tensors from the items that came with it; notes the classes it looks up."""

    def __init__(self, data: bytes, payloads: Sequence[Tensor], device: torch.device) -> None:
        super().__init__(io.BytesIO(data))
        self.payloads, self.device, self.looked_up = payloads, device, "an object"

    def find_class(self, module: str, name: str) -> Any:
        if name == "_tensor_ref" and module == __name__:
            return self.tensor  # the tensors of this pickle travelled beside it, as this unpickler's payloads
        self.looked_up = name if module == "builtins" else f"{module}.{name}"
        return super().find_class(module, name)

    def load(self) -> Any:
        # Loading makes many containers (a dict per RLE mask): the collector would run its passes over the whole heap
        # during it, several times per sync and more as the heap grows. It runs afterwards, when due.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return super().load()
        finally:
            if collecting:
                gc.enable()

    def tensor(self, index: int, dtype_name: str, shape: tuple[int, ...], device_type: str) -> Tensor:
        """The tensor at ``index`` (see ``_Pickler``): a view of its bytes where they are aligned for its dtype."""
        dtype = _BY_NAME[dtype_name]
        device = torch.device(device_type) if device_type != self.device.type else self.device
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        raw = self.payloads[index]
        if raw.storage_offset() % dtype.itemsize:  # its bytes start unaligned for the dtype in the received buffer
            raw = raw.clone()
        return raw.view(dtype).view(shape).to(device)


def object_positions(entries: Sequence[EntryPlan]) -> list[int]:
    """The entries some rank sent as objects: known from the exchanged records, so equal on every rank."""
    return [
        index
        for index, eplan in enumerate(entries)
        if eplan.kind == KIND_LIST and not eplan.dense and bool((eplan.shapes[:, 0] == OBJECT_ITEMS).any())
    ]


class LoadFailure:
    """A pickle this rank could not load: which state, from which rank, the type, and pickle's error."""

    def __init__(self, position: int, source: int, type_name: str, error: BaseException) -> None:
        self.position, self.source, self.type_name, self.error = position, source, type_name, error


def decode_results(
    results: list[Any], entries: Sequence[EntryPlan], positions: Sequence[int], device: torch.device
) -> LoadFailure | None:
    """Load every object rank's piece of the entries at ``positions`` in ``results``, in place.

    Each becomes that rank's list of objects (its tensors on ``device`` where they came from a device of its kind);
    the other ranks' pieces stay lists of tensors. Returns the first failure, or None.
    """
    for position in positions:
        pieces, flags = results[position], (entries[position].shapes[:, 0] == OBJECT_ITEMS).tolist()
        if not isinstance(pieces, list):
            continue  # a state shared with an earlier one on every rank: loaded there
        for rank, (piece, is_objects) in enumerate(zip(pieces, flags, strict=True)):
            if not is_objects or not isinstance(piece, list) or not piece:
                continue
            *payloads, blob = piece
            unpickler = _Unpickler(blob.cpu().numpy().tobytes(), payloads, device)
            try:
                pieces[rank] = unpickler.load()
            except Exception as error:  # every rank raises it after the agreement
                return LoadFailure(position, rank, unpickler.looked_up, error)
    return None


def failure_words(failure: LoadFailure | None) -> list[int]:
    """What a rank says in the agreement that every rank loaded every object: nothing failed, or what did."""
    if failure is None:
        return [0] * (3 + _TYPE_WORDS)
    return [1, failure.position, failure.source, *encode_text(failure.type_name, _TYPE_WORDS)]


def agreed_error(
    table: list[list[int]], names: Callable[[int], str], what: str, failure: LoadFailure | None
) -> SyncMismatchError | None:
    """The error every rank raises when the agreement's table (one row of :func:`failure_words` per rank) says so."""
    failing = [rank for rank, row in enumerate(table) if row[0]]
    if not failing:
        return None
    _, position, source, *name_words = table[failing[0]]
    return load_error(failing[0], position, source, decode_text(name_words), names, what, failure)


def load_error(
    rank: int,
    position: int,
    source: int,
    loaded: str,
    names: Callable[[int], str],
    what: str,
    failure: LoadFailure | None,
) -> SyncMismatchError:
    """The error every rank raises when rank ``rank`` could not load rank ``source``'s objects of a state."""
    cause = f" ({type(failure.error).__name__}: {failure.error})" if failure is not None else ""
    error = SyncMismatchError(
        f"{what}: expected every rank to load the objects of list state `{names(position)}`, but rank {rank} could"
        f" not load rank {source}'s pickle, at a `{loaded}`{cause}. Every rank must run the same code: the classes"
        " of the objects a list state holds must be importable, and load alike, on every rank."
    )
    if failure is not None:
        error.__cause__ = failure.error
    return error
