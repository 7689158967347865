"""The record: what every rank says it holds, as one ``int64`` row (pure: nothing here communicates).

A sync begins with every rank writing a record (:func:`describe`) and the ranks all-gathering them; the plan
(:mod:`.plan`) decides everything from that ``[world_size, words]`` table alone. A record is:

* a **header** (``H_*``): the protocol magic, a hash of *what* is synced (classes, states, reductions, phase), a
  readable label, flags (``FLAG_*``), the number of entries, a local problem found by :func:`describe` (so that every
  rank raises it together), the record's own length and this rank's transfer cap;
* one **slot** per entry (``ENTRY_LEN`` words): kind, dtype, element and item count, an auxiliary word (a ``mean``
  state's update count), the shape;
* optionally **data**: a few small dense states ride in the record itself (``FLAG_INLINE``; :func:`inline_data`,
  :func:`device_data`): the metadata exchange is then the whole sync.
"""

import array
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor


class Ref:
    """An entry that is the same object as an earlier entry (a state shared by a compute group): sent once."""

    def __init__(self, index: int) -> None:
        self.index = index


class ObjectList(list[Tensor]):
    """A list state of Python objects as it travels: ``uint8`` items, ``OBJECT_ITEMS`` in its slot (:mod:`.objects`)."""


class ObjectFailure(list[Tensor]):
    """A list state holding an item that cannot be pickled: reported in the record (``ERR_OBJECT``), never sent."""

    def __init__(self, item: int, type_name: str) -> None:
        super().__init__()
        self.item = item
        self.type_name = type_name


Entry = Tensor | list[Tensor]
LocalEntry = Tensor | list[Tensor] | Ref

MAGIC = 0x746D_766C_0004  # "tmvl", protocol version 4 (the flags of version 3 moved)
MAX_NDIM = 6
ALIGN = 16  # bytes: enough for every dtype, complex128 included, to be viewed in place
LABEL_WORDS = 3  # 24 bytes of the label travel in the record

# Header words.
H_MAGIC, H_CONTEXT, H_LABEL = 0, 1, 2
H_FLAGS, H_N, H_ERROR, H_ERROR_ENTRY, H_WORDS, H_CAP = (H_LABEL + LABEL_WORDS + i for i in range(6))
HEADER_LEN = H_CAP + 1
FLAG_GRAD = 1  # a local state carries a rank-local autograd graph: gather everything, as stock does, to keep it
FLAG_DIFF = 2  # a differentiable sync (``sync_grads=True`` in grad mode): every rank must agree
FLAG_INLINE = 4  # the record carries this rank's data after its slots
# TORCHMETRICS_VARLEN_REDUCE of the sending rank ("auto" sends neither): every rank must have the same.
FLAG_REDUCE_NEVER, FLAG_REDUCE_ALWAYS = 8, 16
REDUCE_FLAGS = MappingProxyType({"auto": 0, "never": FLAG_REDUCE_NEVER, "always": FLAG_REDUCE_ALWAYS})
REDUCE_MASK = FLAG_REDUCE_NEVER | FLAG_REDUCE_ALWAYS
FLAG_SHADOW = 32  # the record of a joined rank's Join worker: an empty batch of the metric it expects
FLAG_HOST_GRAD = 64  # a differentiable sync of CPU tensors where CUDA autograd can issue DDP buckets: refused
FLAG_CACHED = 128  # this rank's last result is still valid: when every rank's is, nothing more moves
# The most data a record carries (``FLAG_INLINE``): a few small dense states, synced by the metadata exchange alone.
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
MIXED_ITEMS = 15  # the ndim word of a list whose items do not concatenate to one tensor (``_item_shape_slots``)
OBJECT_ITEMS = 14  # the ndim word of an ``ObjectList``: never joined, its pieces decoded after the sync

# Local problems found by ``describe``; reported through the record so that every rank raises together.
ERR_NONE, ERR_NDIM, ERR_LIST_DTYPE, ERR_NOT_TENSOR, ERR_LAYOUT, ERR_DTYPE, ERR_DIM, ERR_OBJECT = range(8)
# After the slots of a record reporting ERR_OBJECT: the item's index and the start of its type's name.
OBJECT_DETAIL_WORDS = 6

_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
# Code 0 means "no dtype" (an empty list). Codes only grow at the end so that versions stay compatible.
DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name))
DTYPE_CODE = MappingProxyType({dtype: code for code, dtype in enumerate(DTYPES, start=1)})
# numpy's dtype of each torch dtype numpy has (not bfloat16 nor float8), taken from torch: no numpy import of ours.
_NUMPY_READS = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
)  # fmt: skip
NUMPY_DTYPES = MappingProxyType({dtype: torch.empty(0, dtype=dtype).numpy().dtype for dtype in _NUMPY_READS})


def record_words(entries: int) -> int:
    """Length in words of a record of ``entries`` entries (header and slots)."""
    return HEADER_LEN + entries * ENTRY_LEN


MAX_WORDS = record_words(1 << 16)  # a record claiming more is not one of ours: the plan names the ranks


def context_hash(text: str) -> int:
    """A hash of what is being synced that is equal across processes (``hash()`` is salted per process)."""
    return zlib.crc32(text.encode())


def encode_text(text: str, words: int = LABEL_WORDS) -> list[int]:
    """The first ``8 * words`` bytes of ``text`` (UTF-8, undecodable characters replaced) as ``int64`` words."""
    raw = text.encode(errors="replace")[: 8 * words].ljust(8 * words, b"\0")
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def decode_text(words: Sequence[int]) -> str:
    """What :func:`encode_text` encoded (its trailing zero bytes dropped)."""
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)
    return raw.rstrip(b"\0").decode(errors="replace")


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the section alignment."""
    return -(-nbytes // ALIGN) * ALIGN


def shape_slots(shape: Sequence[int]) -> list[int]:
    """``[ndim, *dims]`` padded to ``SHAPE_WORDS``: a shape as it travels."""
    return [len(shape), *shape, *([0] * (MAX_NDIM - len(shape)))]


def header(context: int, label: str, flags: int, count: int, words: int, cap: int) -> list[int]:
    """A record's header words (no local problem)."""
    return [MAGIC, context, *encode_text(label), flags, count, ERR_NONE, -1, words, cap]


def describe(
    entries: Sequence[LocalEntry],
    context: int,
    label: str,
    flags: int,
    aux: Sequence[int] | None,
    inline: bool,
    cap: int,
) -> list[int]:
    """This rank's record: header, one slot per entry (``aux``: a word each, or zeros), small CPU data if ``inline``."""
    error, error_entry = ERR_NONE, -1
    slots: list[int] = []
    for index, entry in enumerate(entries):
        word = aux[index] if aux is not None else 0
        if isinstance(entry, Tensor):
            problem = _tensor_problem(entry.layout, entry.dtype, entry.shape)
            if problem == ERR_NONE:
                slots += _pack_slot(KIND_TENSOR, DTYPE_CODE[entry.dtype], entry.numel(), 1, word, entry.shape)
                continue
        elif isinstance(entry, Ref):
            slots += _pack_slot(KIND_REF, 0, 0, entry.index, word, ())
            continue
        elif isinstance(entry, list) and not isinstance(entry, ObjectFailure):
            problem, dtype, numel = _list_problem(entry)
            if problem == ERR_NONE:
                code = DTYPE_CODE[dtype] if dtype is not None else 0
                shape_words = [OBJECT_ITEMS] if isinstance(entry, ObjectList) else _item_shape_slots(entry)
                slots += _pack_slot(KIND_LIST, code, numel, len(entry), word, shape_words[1:], shape_words[0])
                continue
        else:
            problem = ERR_OBJECT if isinstance(entry, ObjectFailure) else ERR_NOT_TENSOR
        if error == ERR_NONE:  # the first problem is the one reported
            error, error_entry = problem, index
        slots += _pack_slot(0, 0, 0, 0, word, ())
    data = host_data(entries) if inline and error == ERR_NONE else None
    flags |= FLAG_INLINE if data is not None else 0
    if error == ERR_OBJECT:  # what every rank's message names rides where inline data would
        failure = entries[error_entry]
        assert isinstance(failure, ObjectFailure)
        data = [failure.item, *encode_text(failure.type_name, OBJECT_DETAIL_WORDS - 1)]
    words = record_words(len(entries)) + (len(data) if data is not None else 0)
    head = header(context, label, flags, len(entries), words, cap)
    head[H_ERROR], head[H_ERROR_ENTRY] = error, error_entry
    return head + slots + (data or [])


def object_detail(words: Sequence[int]) -> tuple[int, str]:
    """The item index and type name a record reporting ``ERR_OBJECT`` carries after its slots."""
    return int(words[0]), decode_text(words[1:OBJECT_DETAIL_WORDS])


def _tensor_problem(layout: torch.layout, dtype: torch.dtype, shape: Sequence[int]) -> int:
    if layout != torch.strided:
        return ERR_LAYOUT
    if dtype not in DTYPE_CODE:
        return ERR_DTYPE
    if len(shape) > MAX_NDIM:
        return ERR_NDIM
    return ERR_DIM if max(shape, default=0) > MAX_DIM else ERR_NONE


def _list_problem(items: Sequence[object]) -> tuple[int, torch.dtype | None, int]:
    """A list's problem code, its items' dtype (the non-empty ones', else the first's; None if empty), its elements."""
    dtypes: set[torch.dtype] = set()
    numel = 0
    for item in items:
        if not isinstance(item, Tensor):
            return ERR_NOT_TENSOR, None, 0
        problem = _tensor_problem(item.layout, item.dtype, item.shape)
        if problem != ERR_NONE:
            return problem, None, 0
        count = item.numel()
        if count:
            dtypes.add(item.dtype)
            numel += count
    if len(dtypes) > 1:
        return ERR_LIST_DTYPE, None, 0
    first = items[0].dtype if items and isinstance(items[0], Tensor) else None
    return ERR_NONE, dtypes.pop() if dtypes else first, numel


def _item_shape_slots(items: Sequence[Tensor]) -> list[int]:
    """The shape a list's items concatenate to (as ``dim_zero_cat`` joins them), in a slot's shape words.

    ``[1]``: scalars and vectors; ``[ndim, 0, *trailing]``: shared trailing dims; else ``[MIXED_ITEMS]``.
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


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype of a code (None for 0: an empty list sent no dtype)."""
    return DTYPES[code - 1] if code > 0 else None


# ------------------------------------------------------------------------------------------------- dense layout
@dataclass
class DenseGroup:
    """Dense entries of one dtype, back to back at one offset in each rank's buffer (or record data), moved as one."""

    dtype: torch.dtype
    start: int  # byte offset, equal on every rank
    indices: list[int]
    numels: list[int]

    @property
    def nbytes(self) -> int:
        """Bytes the group occupies in each rank's buffer."""
        return sum(self.numels) * self.dtype.itemsize


def dense_layout(items: Iterable[tuple[int, torch.dtype, int]]) -> tuple[list[DenseGroup], int]:
    """``(index, dtype, numel)`` items grouped by dtype in order of appearance, 16-byte aligned; and their bytes."""
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


def inline_layout(tensors: Sequence[Tensor]) -> tuple[list[DenseGroup], int] | None:
    """The data layout of a record carrying ``tensors``; None when they cannot ride in a record.

    They ride when all are non-empty, strided, of at most 8-byte elements, on one device, ``INLINE_MAX_BYTES`` in all.
    """
    if not tensors:
        return None
    device = tensors[0].device
    for tensor in tensors:
        if tensor.numel() == 0 or tensor.dtype.itemsize > 8 or tensor.device != device:
            return None
        if tensor.layout != torch.strided or tensor.dtype not in DTYPE_CODE:
            return None
    groups, total = dense_layout((i, t.dtype, t.numel()) for i, t in enumerate(tensors))
    return (groups, total) if total <= INLINE_MAX_BYTES else None


def host_data(entries: Sequence[LocalEntry]) -> list[int] | None:
    """This rank's data words for a record, where every entry is a small dense CPU tensor; else None."""
    if not all(isinstance(entry, Tensor) and entry.is_cpu for entry in entries):
        return None
    tensors: list[Tensor] = list(entries)  # type: ignore[arg-type]
    layout = inline_layout(tensors)
    return inline_data(tensors, *layout) if layout is not None else None


def inline_data(tensors: Sequence[Tensor], groups: Sequence[DenseGroup], total: int) -> list[int] | None:
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


def device_data(tensors: Sequence[Tensor], groups: Sequence[DenseGroup], total: int) -> Tensor | None:
    """:func:`inline_data` on a device, by device-side copies only; None where a dtype cannot be viewed as bytes."""
    device = tensors[0].device
    pieces: list[Tensor] = []
    used = 0
    try:
        for group in groups:
            if group.start > used:  # the alignment padding before a group
                pieces.append(torch.zeros(group.start - used, dtype=torch.uint8, device=device))
                used = group.start
            for index in group.indices:
                data = resolved(tensors[index].detach()).reshape(-1).view(torch.uint8)
                pieces.append(data)
                used += data.numel()
    except RuntimeError:
        return None
    if total > used:
        pieces.append(torch.zeros(total - used, dtype=torch.uint8, device=device))
    return torch.cat(pieces).view(torch.int64)


def resolved(tensor: Tensor) -> Tensor:
    """``tensor`` with its conjugate and negative bits resolved: its bytes are its values (a copy only where set)."""
    return tensor.resolve_conj().resolve_neg() if tensor.is_conj() or tensor.is_neg() else tensor


def raw_bytes(tensor: Tensor) -> bytes:
    """The elements of a CPU tensor in row-major order, as bytes."""
    try:  # the usual state: one call. numpy() refuses a tensor that needs grad, a conj or neg bit, or bfloat16
        return tensor.numpy().tobytes()  # type: ignore[no-any-return]  # row-major, whatever the strides
    except (RuntimeError, TypeError):
        pass
    tensor = resolved(tensor.detach())
    if tensor.dtype in NUMPY_DTYPES:
        return tensor.numpy().tobytes()  # type: ignore[no-any-return]
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()  # type: ignore[no-any-return]  # bfloat16, float8
