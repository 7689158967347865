"""The sync protocol's records: what every rank says it holds (the plan all ranks decide from them: ``_plan``).

Every sync runs the same steps on every rank, whatever each holds (see :mod:`torchmetrics_varlen._engine`):

1. ``describe`` turns the local entries (a tensor, or a list of tensors) into an ``int64`` record: a header
   (protocol magic, what is being synced, a readable label, flags, local errors) and one slot per entry (kind, dtype,
   element count, item count, an auxiliary word, shape). Its length follows from the number of entries.
2. The records of all ranks are exchanged in one collective, at a length every rank of the group agrees on
   (see ``_transport.exchange_records``).
3. ``_plan.make_plan`` decides everything from that ``[world_size, words]`` table alone, in tensor operations over the
   table (no Python loop over ranks): errors (raised on every rank alike), which states travel by all-reduce and
   which by gather, each rank's byte layout, the transfer size, the dtype and trailing shape an empty rank takes.

No rank branches on its local data before step 3, so no rank can skip a collective its peers issue.
"""

import array
import functools
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from torchmetrics_varlen import _caches
from torchmetrics_varlen._cap import DEFAULT_CAP


class Ref:
    """An entry that is the same object as an earlier entry (a state shared by a compute group): sent once."""

    def __init__(self, index: int) -> None:
        self.index = index


class ObjectList(list[Tensor]):
    """A list state holding Python objects, as it travels: ``uint8`` items (see :mod:`torchmetrics_varlen._objects`).

    Its slot says so (``OBJECT_ITEMS`` in the ndim word), so every rank, an empty one too, knows from the exchanged
    records which ranks' pieces to decode.
    """


class ObjectFailure(list[Tensor]):
    """A list state holding an item that cannot be pickled: reported in the record (``ERR_OBJECT``), never sent.

    An empty list to the engine's types: the record's error stops every rank before any data moves.
    """

    def __init__(self, item: int, type_name: str) -> None:
        super().__init__()
        self.item = item
        self.type_name = type_name


Entry = Tensor | list[Tensor]
LocalEntry = Tensor | list[Tensor] | Ref

MAGIC = 0x746D_766C_0003  # "tmvl", protocol version 3
MAX_NDIM = 6
ALIGN = 16  # bytes: enough for every dtype, complex128 included, to be viewed in place
LABEL_WORDS = 3  # 24 bytes of the label travel in the record

# Header words.
H_MAGIC, H_CONTEXT, H_LABEL = 0, 1, 2
H_FLAGS, H_N, H_ERROR, H_ERROR_ENTRY, H_WORDS, H_CAP = (H_LABEL + LABEL_WORDS + i for i in range(6))
HEADER_LEN = H_CAP + 1
FLAG_GRAD = 2  # a local state carries a rank-local autograd graph: gather everything, as stock does, to keep it
FLAG_DIFF = 4  # a differentiable sync (``sync_grads=True`` in grad mode): every rank must agree
FLAG_INLINE = 8  # the record carries this rank's data after its slots (see ``_inline_words``)
# TORCHMETRICS_VARLEN_REDUCE of the sending rank ("auto" sends neither): the plan's routes follow it, so every rank
# must have the same (``_mismatch.check_headers``).
FLAG_REDUCE_NEVER, FLAG_REDUCE_ALWAYS = 16, 32
REDUCE_FLAGS = {"auto": 0, "never": FLAG_REDUCE_NEVER, "always": FLAG_REDUCE_ALWAYS}
REDUCE_MASK = FLAG_REDUCE_NEVER | FLAG_REDUCE_ALWAYS
FLAG_SHADOW = 64  # the record of a joined rank's Join worker: an empty batch of the metric it expects (_join_shadow)
# A differentiable sync whose tensors live on the CPU in a process that uses CUDA (_policy.crosses_autograd_threads):
# refused on every rank when any rank sets it (``_mismatch.refuse_host_grad``).
FLAG_HOST_GRAD = 128
# A sync of a few small dense states (sums, counts) carries the data in the records themselves: when every rank did
# so and every state is dense, the metadata exchange is the whole sync, one collective.
INLINE_MAX_BYTES = 256
# An entry's slot, as the plan reads it (``unpack_slots``).
E_KIND, E_DTYPE, E_NUMEL, E_ITEMS, E_AUX, E_NDIM, E_DIMS = 0, 1, 2, 3, 4, 5, 6
SLOT_LEN = E_DIMS + MAX_NDIM
# An entry's slot as it travels: 6 words. Word 0 packs kind (2 bits), dtype code (6), ndim (4) and the item count;
# then the element count, the auxiliary word, and the dims two per word (32 bits each).
W_HEAD, W_NUMEL, W_AUX, W_DIMS = 0, 1, 2, 3
ENTRY_LEN = W_DIMS + MAX_NDIM // 2
MAX_DIM = 2**31 - 1
SHAPE_WORDS = 1 + MAX_NDIM  # ndim and dims: one row of a list entry's item shape table

KIND_TENSOR, KIND_LIST, KIND_REF = 1, 2, 3


def record_words(entries: int) -> int:
    """Length in words of a record of ``entries`` entries."""
    return HEADER_LEN + entries * ENTRY_LEN


# Local problems found by ``describe``; reported through the record so that every rank raises together.
ERR_NONE, ERR_NDIM, ERR_LIST_DTYPE, ERR_NOT_TENSOR, ERR_LAYOUT, ERR_DTYPE, ERR_DIM, ERR_OBJECT = 0, 1, 2, 3, 4, 5, 6, 7
# After the slots of a record reporting ERR_OBJECT: the item's index and the start of its type's name, so that every
# rank's message names them.
OBJECT_DETAIL_WORDS = 6

_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
# Code 0 means "no dtype" (an empty list). Codes only grow at the end so that versions stay compatible.
DTYPES: list[torch.dtype] = [getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES, start=1)}
_ITEMSIZE = torch.tensor([0] + [dtype.itemsize for dtype in DTYPES], dtype=torch.int64)


def context_hash(text: str) -> int:
    """A hash of what is being synced that is equal across processes (``hash()`` is salted per process)."""
    return zlib.crc32(text.encode())


@functools.lru_cache(maxsize=256)
def _encode_label(label: str, words: int = LABEL_WORDS) -> tuple[int, ...]:
    raw = label.encode()[: 8 * words].ljust(8 * words, b"\0")
    return tuple(int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8))


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the section alignment."""
    return -(-nbytes // ALIGN) * ALIGN


def shape_slots(shape: Sequence[int]) -> list[int]:
    """``[ndim, *dims]`` padded to ``SHAPE_WORDS``: a shape as it travels."""
    return [len(shape), *shape, *([0] * (MAX_NDIM - len(shape)))]


def describe(
    entries: Sequence[LocalEntry],
    context: int,
    label: str,
    flags: int = 0,
    aux: Sequence[int] | None = None,
    inline: bool = False,
    cap: int = DEFAULT_CAP,
) -> list[int]:
    """This rank's metadata record: a header plus one slot per entry (``aux``: one word per entry, or zeros).

    With ``inline``, small dense data rides along after the slots (``FLAG_INLINE``) where it can. ``cap`` is this
    rank's transfer cap in bytes (see :mod:`torchmetrics_varlen._cap`); the plan takes the smallest of all ranks'.
    """
    error, error_entry = ERR_NONE, -1
    slots: list[int] = []
    for index, entry in enumerate(entries):
        word = aux[index] if aux is not None else 0
        if isinstance(entry, Tensor):
            problem, head, numel, dims = _tensor_slot(entry.layout, entry.dtype, entry.shape)
            if problem == ERR_NONE:
                slots += (head, numel, word, *dims)
                continue
        elif isinstance(entry, Ref):
            slots += _pack_slot(KIND_REF, 0, 0, entry.index, word, ())
            continue
        elif isinstance(entry, list) and not isinstance(entry, ObjectFailure):
            problem, dtype, numel = _list_problem(entry)
            if problem == ERR_NONE:
                dtype_code = _DTYPE_CODE[dtype] if dtype is not None else 0
                shape_words = [OBJECT_ITEMS] if isinstance(entry, ObjectList) else _item_shape_slots(entry)
                slots += _pack_slot(KIND_LIST, dtype_code, numel, len(entry), word, shape_words[1:], shape_words[0])
                continue
        else:
            problem = ERR_OBJECT if isinstance(entry, ObjectFailure) else ERR_NOT_TENSOR
        if error == ERR_NONE:  # the first problem is the one reported
            error, error_entry = problem, index
        slots += _pack_slot(0, 0, 0, 0, word, ())
    data = _inline_words(entries) if inline and error == ERR_NONE else None
    flags |= FLAG_INLINE if data is not None else 0
    if error == ERR_OBJECT:  # what every rank's message names rides where inline data would
        failure = entries[error_entry]
        assert isinstance(failure, ObjectFailure)
        data = _object_detail(failure)
    words = record_words(len(entries)) + (len(data) if data is not None else 0)
    header = [MAGIC, context, *_encode_label(label), flags, len(entries), error, error_entry, words, cap]
    return header + slots + (data or [])


def _object_detail(failure: ObjectFailure) -> list[int]:
    """The words after the slots of a record reporting ``ERR_OBJECT``: the item's index and its type's name."""
    return [failure.item, *_encode_label(failure.type_name, OBJECT_DETAIL_WORDS - 1)]


def object_detail(words: Sequence[int]) -> tuple[int, str]:
    """The item index and type name of :func:`_object_detail`'s words."""
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words[1:OBJECT_DETAIL_WORDS])
    return int(words[0]), raw.rstrip(b"\0").decode(errors="replace")


@functools.lru_cache(maxsize=1024)
def _tensor_slot(layout: torch.layout, dtype: torch.dtype, shape: torch.Size) -> tuple[int, int, int, tuple[int, ...]]:
    """A tensor's problem code, and its slot's head word, element count and dim words (``_pack_slot``), kept.

    Every sync describes every state; states keep their dtype and shape from step to step.
    """
    problem = _tensor_problem(layout, dtype, shape)
    if problem != ERR_NONE:
        return problem, 0, 0, ()
    head, numel, _, *dims = _pack_slot(KIND_TENSOR, _DTYPE_CODE[dtype], math.prod(shape), 1, 0, shape)
    return ERR_NONE, head, numel, tuple(dims)


def _inline_words(entries: Sequence[LocalEntry]) -> list[int] | None:
    """This rank's data laid out as the plan lays out dense groups (by dtype, 16-byte aligned), as int64 words.

    None when the entries are not all small non-empty CPU tensors: then the record carries no data. This runs on every
    small sync (a per-step metric), so the bytes are read through numpy, not assembled with tensor operations.
    """
    tensors: list[Tensor] = []
    items: list[tuple[torch.dtype, int]] = []
    for entry in entries:
        if not isinstance(entry, Tensor) or not entry.is_cpu or entry.dtype.itemsize > 8:
            return None
        numel = entry.numel()
        if numel == 0:
            return None
        tensors.append(entry)
        items.append((entry.dtype, numel))
    if not tensors:
        return None
    groups, total = inline_layout(tuple(items))
    if total > INLINE_MAX_BYTES:
        return None
    return inline_data(tensors, groups, total)


def inline_data(tensors: Sequence[Tensor], groups: "Sequence[DenseGroup]", total: int) -> list[int] | None:
    """The data words of small CPU tensors laid out in ``groups`` (``total`` bytes); None where one cannot be read."""
    data = bytearray()
    try:
        for group in groups:
            data += bytes(group.start - len(data))  # the alignment padding before the group
            for index in group.indices:
                data += raw_bytes(tensors[index])
    except (RuntimeError, TypeError):  # a tensor numpy cannot read: its data goes by the gather, which is always safe
        return None
    data += bytes(total - len(data))
    return array.array("q", data).tolist()


@functools.lru_cache(maxsize=256)
def inline_layout(items: tuple[tuple[torch.dtype, int], ...]) -> "tuple[list[DenseGroup], int]":
    """:func:`dense_layout` of ``(dtype, numel)`` items, kept: a per-step metric asks at every step (read only)."""
    return dense_layout((index, dtype, numel) for index, (dtype, numel) in enumerate(items))


def raw_bytes(tensor: Tensor) -> bytes:
    """The elements of a CPU tensor in row-major order, as bytes."""
    try:  # the usual state: one call. numpy() refuses a tensor that needs grad, a conj or neg bit, or bfloat16
        return tensor.numpy().tobytes()  # type: ignore[no-any-return]  # row-major, whatever the strides
    except (RuntimeError, TypeError):
        pass
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()  # numpy reads neither bit
    if tensor.dtype in NUMPY_DTYPES:
        return tensor.numpy().tobytes()  # type: ignore[no-any-return]  # row-major, whatever the strides
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()  # type: ignore[no-any-return]  # bfloat16, float8


# numpy's dtype of each torch dtype numpy has (not bfloat16 nor float8), taken from torch: no numpy import of ours.
_NUMPY_READS = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
)  # fmt: skip
NUMPY_DTYPES = {dtype: torch.empty(0, dtype=dtype).numpy().dtype for dtype in _NUMPY_READS}


MIXED_ITEMS = 15  # the ndim word of a list whose items do not concatenate to one tensor (``_item_shape_slots``)
OBJECT_ITEMS = 14  # the ndim word of an ``ObjectList``: never joined, its pieces decoded after the sync


def _item_shape_slots(items: Sequence[Tensor]) -> list[int]:
    """The shape a list's items concatenate to, as ``dim_zero_cat`` joins them, in the slot's shape words.

    ``[1]`` for scalars and vectors, ``[ndim, 0, *trailing]`` for items that share their trailing dims,
    ``[MIXED_ITEMS]`` otherwise. It lets every rank join a ``cat`` list of all ranks from the metadata alone, without
    reading item shape tables.
    """
    shapes = {tuple(item.shape) if item.ndim > 1 else () for item in items}
    if shapes <= {()}:
        return shape_slots((0,))
    trailing = {shape[1:] for shape in shapes}
    if len(trailing) > 1 or () in shapes:
        return [MIXED_ITEMS] + [0] * MAX_NDIM
    return shape_slots((0, *trailing.pop()))


def _pack_slot(
    kind: int, dtype_code: int, numel: int, items: int, aux: int, dims: Sequence[int], ndim: int | None = None
) -> tuple[int, ...]:
    """An entry's slot as it travels (see ``W_*``); ``ndim`` defaults to ``len(dims)``."""
    ndim = len(dims) if ndim is None else ndim
    d = (*dims, 0, 0, 0, 0, 0, 0)  # at most MAX_NDIM dims, padded with zeros
    head = kind | dtype_code << 2 | ndim << 8 | items << 12
    return head, numel, aux, d[0] | d[1] << 32, d[2] | d[3] << 32, d[4] | d[5] << 32


def unpack_slots(packed: Tensor) -> Tensor:
    """``[..., ENTRY_LEN]`` slots as they travel to ``[..., SLOT_LEN]`` slots indexed by ``E_*``."""
    head = packed[..., W_HEAD]
    dims = packed[..., W_DIMS:]
    low, high = dims & 0xFFFF_FFFF, dims >> 32
    fields = [head & 3, (head >> 2) & 63, packed[..., W_NUMEL], head >> 12, packed[..., W_AUX], (head >> 8) & 15]
    return torch.cat([torch.stack(fields, dim=-1), torch.stack([low, high], dim=-1).flatten(-2)], dim=-1)


def _tensor_problem(layout: torch.layout, dtype: torch.dtype, shape: Sequence[int]) -> int:
    if layout != torch.strided:
        return ERR_LAYOUT
    if dtype not in _DTYPE_CODE:
        return ERR_DTYPE
    if len(shape) > MAX_NDIM:
        return ERR_NDIM
    return ERR_DIM if max(shape, default=0) > MAX_DIM else ERR_NONE


def _list_problem(items: Sequence[object]) -> tuple[int, torch.dtype | None, int]:
    """A list state's problem code, the dtype of its items (of the non-empty ones), and its number of elements.

    One pass over the items, each checked as a tensor state is (kept per dtype and shape: a `cat` state's batches
    share them). The dtype is the first item's where every item is empty, None for an empty list.
    """
    dtypes: set[torch.dtype] = set()
    numel = 0
    for item in items:
        if not isinstance(item, Tensor):
            return ERR_NOT_TENSOR, None, 0
        problem, _, count, _ = _tensor_slot(item.layout, item.dtype, item.shape)
        if problem != ERR_NONE:
            return problem, None, 0
        if count:
            dtypes.add(item.dtype)
            numel += count
    if len(dtypes) > 1:
        return ERR_LIST_DTYPE, None, 0
    first = items[0].dtype if items and isinstance(items[0], Tensor) else None
    return ERR_NONE, dtypes.pop() if dtypes else first, numel


# ------------------------------------------------------------------------------------------------- dense layout
@dataclass
class DenseGroup:
    """Dense gathered entries of one dtype, back to back at the same offset in every rank's buffer.

    Most metric states (sums, counts, confusion matrices) are dense. Packing them with one ``cat`` and cutting them
    out of the gathered rows as ``[world_size, *shape]`` blocks costs a few tensor operations per group instead of
    several per entry and rank.
    """

    dtype: torch.dtype
    start: int  # byte offset, equal on every rank
    indices: list[int]
    numels: list[int]

    @property
    def nbytes(self) -> int:
        """Bytes the group occupies in each rank's buffer."""
        return sum(self.numels) * self.dtype.itemsize


def dense_layout(items: Iterable[tuple[int, torch.dtype, int]]) -> tuple[list[DenseGroup], int]:
    """``(index, dtype, numel)`` items grouped by dtype in order of first appearance, each group 16-byte aligned.

    Returns the groups (with their start offsets) and the bytes they take. The plan lays out the dense part of every
    rank's gather buffer with it, and ``_inline_words`` the data a record carries: one layout, so the two agree.
    """
    groups: dict[torch.dtype, DenseGroup] = {}
    for index, dtype, numel in items:
        group = groups.setdefault(dtype, DenseGroup(dtype, 0, [], []))
        group.indices.append(index)
        group.numels.append(numel)
    used = 0
    for group in groups.values():
        group.start = used
        used = align(used + group.nbytes)
    return list(groups.values()), used


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype of a code (None for 0: an empty list sent no dtype)."""
    return DTYPES[code - 1] if code > 0 else None


_caches.register(
    "_protocol._encode_label: a label's words, the same at every sync of a metric", _encode_label.cache_clear
)
_caches.register("_protocol._tensor_slot: a tensor kind's slot words, the same at every sync", _tensor_slot.cache_clear)
_caches.register(
    "_protocol.inline_layout: a small record's data layout, the same at every step", inline_layout.cache_clear
)
