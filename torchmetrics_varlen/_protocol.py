"""The sync protocol's records and plan: what every rank says it holds, and what all ranks decide from that.

Every sync runs the same steps on every rank, whatever each holds (see :mod:`torchmetrics_varlen._engine`):

1. ``describe`` turns the local entries (a tensor, or a list of tensors) into an ``int64`` record: a header
   (protocol magic, what is being synced, a readable label, flags, local errors) and one slot per entry (kind, dtype,
   element count, item count, an auxiliary word, shape). Its length follows from the number of entries.
2. The records of all ranks are exchanged in one collective, at a length every rank of the group agrees on
   (see ``_transport.exchange_records``).
3. ``make_plan`` decides everything from that ``[world_size, words]`` table alone, in tensor operations over the
   table (no Python loop over ranks): errors (raised on every rank alike), which states travel by all-reduce and
   which by gather, each rank's byte layout, the transfer size, the dtype and trailing shape an empty rank takes.

No rank branches on its local data before step 3, so no rank can skip a collective its peers issue.
"""

import array
import functools
import threading
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from torchmetrics_varlen.errors import SyncMismatchError


class Ref:
    """An entry that is the same object as an earlier entry (a state shared by a compute group): sent once."""

    def __init__(self, index: int) -> None:
        self.index = index


Entry = Tensor | list[Tensor]
LocalEntry = Tensor | list[Tensor] | Ref

MAGIC = 0x746D_766C_0002  # "tmvl", protocol version 2
MAX_NDIM = 6
ALIGN = 16  # bytes: enough for every dtype, complex128 included, to be viewed in place
LABEL_WORDS = 3  # 24 bytes of the label travel in the record

# Header words.
H_MAGIC, H_CONTEXT, H_LABEL = 0, 1, 2
H_FLAGS, H_N, H_ERROR, H_ERROR_ENTRY, H_WORDS = (H_LABEL + LABEL_WORDS + i for i in range(5))
HEADER_LEN = H_WORDS + 1
FLAG_GRAD = 2  # a local state carries a rank-local autograd graph: gather everything, as stock does, to keep it
FLAG_DIFF = 4  # a differentiable sync (``sync_grads=True`` in grad mode): every rank must agree
FLAG_INLINE = 8  # the record carries this rank's data after its slots (see ``_inline_words``)
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
ERR_NONE, ERR_NDIM, ERR_LIST_DTYPE, ERR_NOT_TENSOR, ERR_LAYOUT, ERR_DTYPE, ERR_DIM = 0, 1, 2, 3, 4, 5, 6
_ERROR_TEXT = {
    ERR_DIM: f"a tensor with a dimension larger than {MAX_DIM} (flatten it, or use a `cat` list state)",
    ERR_NDIM: f"a tensor with more than {MAX_NDIM} dimensions",
    ERR_LIST_DTYPE: "a list state whose tensors have different dtypes",
    ERR_NOT_TENSOR: "a list state holding something that is not a tensor",
    ERR_LAYOUT: "a sparse or otherwise non-strided tensor",
    ERR_DTYPE: "a tensor of a dtype the protocol cannot carry",
}

_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
# Code 0 means "no dtype" (an empty list). Codes only grow at the end so that versions stay compatible.
_DTYPES: list[torch.dtype] = [getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES, start=1)}
_ITEMSIZE = torch.tensor([0] + [dtype.itemsize for dtype in _DTYPES], dtype=torch.int64)


def context_hash(text: str) -> int:
    """A hash of what is being synced that is equal across processes (``hash()`` is salted per process)."""
    return zlib.crc32(text.encode())


@functools.lru_cache(maxsize=256)
def _encode_label(label: str) -> tuple[int, ...]:
    raw = label.encode()[: 8 * LABEL_WORDS].ljust(8 * LABEL_WORDS, b"\0")
    return tuple(int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8))


def _decode_label(words: Sequence[int]) -> str:
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)
    return raw.rstrip(b"\0").decode(errors="replace")


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the section alignment."""
    return -(-nbytes // ALIGN) * ALIGN


def dtype_name(code: int) -> str:
    """Readable name of a dtype code, for error messages."""
    return str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else "-"


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
) -> list[int]:
    """This rank's metadata record: a header plus one slot per entry (``aux``: one word per entry, or zeros).

    With ``inline``, small dense data rides along after the slots (``FLAG_INLINE``) where it can.
    """
    error, error_entry = ERR_NONE, -1
    slots: list[int] = []
    for index, entry in enumerate(entries):
        word = aux[index] if aux is not None else 0
        if isinstance(entry, Ref):
            slots += _pack_slot(KIND_REF, 0, 0, entry.index, word, ())
            continue
        problem = _entry_problem(entry)
        if problem != ERR_NONE:
            error, error_entry = (problem, index) if error == ERR_NONE else (error, error_entry)
            slots += _pack_slot(0, 0, 0, 0, word, ())
        elif isinstance(entry, Tensor):
            slots += _pack_slot(KIND_TENSOR, _DTYPE_CODE[entry.dtype], entry.numel(), 1, word, entry.shape)
        else:
            nonempty = [t for t in entry if t.numel() > 0]
            dtype_code = _DTYPE_CODE[(nonempty or entry)[0].dtype] if entry else 0
            numel = sum(t.numel() for t in entry)
            shape_words = _item_shape_slots(entry)
            slots += _pack_slot(KIND_LIST, dtype_code, numel, len(entry), word, shape_words[1:], shape_words[0])
    data = _inline_words(entries) if inline and error == ERR_NONE else None
    flags |= FLAG_INLINE if data is not None else 0
    words = record_words(len(entries)) + (len(data) if data is not None else 0)
    header = [MAGIC, context, *_encode_label(label), flags, len(entries), error, error_entry, words]
    return header + slots + (data or [])


def _inline_words(entries: Sequence[LocalEntry]) -> list[int] | None:
    """This rank's data laid out as the plan lays out dense groups (by dtype, 16-byte aligned), as int64 words.

    None when the entries are not all small non-empty CPU tensors: then the record carries no data. This runs on every
    small sync (a per-step metric), so the bytes are read through numpy, not assembled with tensor operations.
    """
    tensors: list[Tensor] = []
    for entry in entries:
        if not isinstance(entry, Tensor) or entry.numel() == 0:
            return None
        if entry.device.type != "cpu" or entry.dtype.itemsize > 8:
            return None
        tensors.append(entry)
    if not tensors:
        return None
    groups, total = _inline_layout(tuple((t.dtype, t.numel()) for t in tensors))
    if total > INLINE_MAX_BYTES:
        return None
    data = bytearray()
    try:
        for group in groups:
            data += bytes(group.start - len(data))  # the alignment padding before the group
            for index in group.indices:
                data += _raw_bytes(tensors[index])
    except (RuntimeError, TypeError):  # a tensor numpy cannot read: its data goes by the gather, which is always safe
        return None
    data += bytes(total - len(data))
    return array.array("q", data).tolist()


@functools.lru_cache(maxsize=256)
def _inline_layout(items: tuple[tuple[torch.dtype, int], ...]) -> "tuple[list[DenseGroup], int]":
    """:func:`dense_layout` of ``(dtype, numel)`` items, kept: a per-step metric asks at every step (read only)."""
    return dense_layout((index, dtype, numel) for index, (dtype, numel) in enumerate(items))


def _raw_bytes(tensor: Tensor) -> bytes:
    """The elements of a CPU tensor in row-major order, as bytes."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()  # numpy reads neither bit
    if tensor.dtype in _NUMPY_DTYPES:
        return tensor.numpy().tobytes()  # type: ignore[no-any-return]  # row-major, whatever the strides
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()  # type: ignore[no-any-return]  # bfloat16, float8


_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
_NUMPY_DTYPES |= {torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128}


MIXED_ITEMS = 15  # the ndim word of a list whose items do not concatenate to one tensor (``_item_shape_slots``)


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


def _entry_problem(entry: Entry) -> int:
    if isinstance(entry, Tensor):
        if entry.layout != torch.strided:
            return ERR_LAYOUT
        if entry.dtype not in _DTYPE_CODE:
            return ERR_DTYPE
        if entry.ndim > MAX_NDIM:
            return ERR_NDIM
        return ERR_DIM if max(entry.shape, default=0) > MAX_DIM else ERR_NONE
    if not isinstance(entry, list):
        return ERR_NOT_TENSOR
    dtypes = set()
    for item in entry:
        if not isinstance(item, Tensor):
            return ERR_NOT_TENSOR
        problem = _entry_problem(item)
        if problem != ERR_NONE:
            return problem
        if item.numel() > 0:
            dtypes.add(item.dtype)
    return ERR_LIST_DTYPE if len(dtypes) > 1 else ERR_NONE


# ---------------------------------------------------------------------------------------------------------- plan
# Reductions the plan can move by all-reduce (equal shape and dtype on every rank). Stock's `mean` is a sum / W.
OP_NONE, OP_SUM, OP_MAX, OP_MIN, OP_MEAN = 0, 1, 2, 3, 4
ROUTE_GATHER, ROUTE_REDUCE = 0, 1


@dataclass
class EntryPlan:
    """What every rank knows about one entry after the metadata exchange. Per-rank fields are ``[W]`` tensors."""

    kind: int
    dtype: torch.dtype | None  # the common dtype of the non-empty ranks; None when every rank is empty
    dtype_codes: Tensor  # per rank: the dtype it sent (kept when no rank holds data)
    numels: Tensor
    items: Tensor
    shapes: Tensor  # [W, SHAPE_WORDS] (tensor entries)
    refs: Tensor  # per rank: index of the earlier entry this one repeats, or -1
    empty_shape: tuple[int, ...] | None  # shape an empty rank takes: (0, *trailing dims of the first non-empty rank)
    offsets: Tensor | None = None  # per rank: byte offset of this entry's section (gathered, not dense)
    table_bytes: Tensor | None = None  # per rank: bytes of the item shape table (list entries)
    dense: bool = False  # a tensor of the same shape and dtype on every rank
    shape: tuple[int, ...] = ()  # dense entries: the common shape
    route: int = ROUTE_GATHER

    def shape_of(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s shape (tensor entries)."""
        row = self.shapes[rank].tolist()
        return tuple(row[1 : 1 + row[0]])


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


# How an entry rides its reduce group's buffer: as it is, negated (a float `min` inside a `max` group), bit-inverted
# (an integer `min`: ~x = -x - 1 reverses the order without overflow), or split into a high and a low 32-bit half
# (an int64 sum inside a float64 sum group: each half sums exactly in float64 for up to 2**21 ranks).
ENC_PLAIN, ENC_NEGATE, ENC_INVERT, ENC_SPLIT = 0, 1, 2, 3


@dataclass
class ReduceGroup:
    """Dense entries reduced by one all-reduce (sum or max) of a flat buffer of ``dtype``.

    Every sum and mean state shares one group (integers split into float64 halves when floats are summed too), every
    max and min state of a float dtype one, and of an integer dtype another: at most three groups, whatever the number
    of states, of which the collective budget lets at most two be all-reduced (see ``_route``).
    """

    op: int
    dtype: torch.dtype  # the transport dtype
    indices: list[int] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)  # elements of each entry in the buffer (twice for ENC_SPLIT)
    encodings: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the all-reduced buffer."""
        return sum(self.numels) * self.dtype.itemsize


@dataclass
class Plan:
    """The decision every rank reaches from the same metadata table."""

    world_size: int
    entries: list[EntryPlan]
    nbytes: Tensor  # per rank: used bytes of its gather buffer
    max_bytes: int  # transfer size per rank of the padded gather
    flags: Tensor  # per rank: header flags
    aux: Tensor  # [W, entries]: the auxiliary words
    groups: list[DenseGroup]
    reduce_groups: list[ReduceGroup]
    differentiable: bool = False  # the data step runs inside an autograd function (see ``_engine``)
    inline: bool = False  # every rank's data came in its record (``FLAG_INLINE``): no data step


# Moving a reducible group by all-reduce instead of inside the gather saves about (W - 2) x its bytes of traffic per
# rank (and W x its bytes of receive memory) but costs one more collective. Below this many bytes of saving, one
# collective's latency is worth more. Measured on gloo (docs page "Scale"): a tiny collective costs what a 150-300 KiB
# gather does; the threshold is lower, because at scale bytes and receive memory matter more than 0.2 ms.
REDUCE_MIN_SAVING = 64 * 2**10
_REDUCE_DTYPES = {torch.int64, torch.float32, torch.float64}  # all-reduce works on these on every backend


def reduce_dtype(op: int, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a dense state of ``dtype`` travels in when all-reduced with ``op``, or None to gather it.

    Integers (and bools) sum as int64, which is what ``torch.sum`` gives, so the result is bit-identical. Max and min
    are exact in any wider type. Half floats travel as float32. Complex and float8 states are gathered.
    """
    if op == OP_NONE or dtype.is_complex or (dtype.itemsize == 1 and dtype.is_floating_point):
        return None
    if dtype.is_floating_point:
        return torch.float64 if dtype == torch.float64 else torch.float32
    return None if op == OP_MEAN else torch.int64  # torch.mean refuses integers: gather, and raise as stock does


_PLANS: dict[tuple[bytes, tuple[int, ...], str], Plan] = {}
_PLANS_LOCK = threading.Lock()  # the Join worker thread plans too
PLAN_CACHE_SIZE = 64


def make_plan(
    table: Tensor,
    what: str,
    ops: Sequence[int] | None = None,
    reduce: str = "auto",
    digest: bytes | None = None,
    grad: str = "if_graph",
    cat: Sequence[bool] | None = None,
) -> Plan:
    """Check the gathered records and lay out the data exchange; raise `SyncMismatchError` on every rank alike.

    ``ops`` gives, per entry, the reduction the caller applies afterwards (equal on every rank, since it follows
    from the synced layout whose hash every record carries); ``reduce`` is "auto" (cost model), "never" or
    "always". ``grad`` says when a sync that every rank asked to be differentiable (``FLAG_DIFF``) really is:
    "always" (a per-step sync in grad mode: the result is a loss) or "if_graph" (only when some rank's states carry
    a graph). ``digest`` identifies the table: a metric synced again and again sends the same table, and a plan
    looked up costs less than one made. Plans are never mutated after this; a table that raises is never cached.
    """
    key = (digest, (*(ops or ()), -1, *(cat or ())), reduce + grad) if digest is not None else None
    if key is not None:
        with _PLANS_LOCK:
            plan = _PLANS.get(key)  # type: ignore[arg-type]
        if plan is not None:
            return plan
    plan = _make_plan(table, what, ops, reduce, grad, cat)
    if key is not None:
        with _PLANS_LOCK:
            if len(_PLANS) >= PLAN_CACHE_SIZE:
                del _PLANS[next(iter(_PLANS))]  # the oldest
            _PLANS[key] = plan  # type: ignore[index]
    return plan


def _make_plan(
    table: Tensor, what: str, ops: Sequence[int] | None, reduce: str, grad: str, cat: Sequence[bool] | None
) -> Plan:
    world = table.shape[0]
    check_headers(table, what)
    count = int(table[0, H_N])
    packed = table[:, HEADER_LEN : HEADER_LEN + count * ENTRY_LEN].reshape(world, count, ENTRY_LEN)
    differs = any_along(packed != packed[:1], dim=0)  # [count, ENTRY_LEN]
    differs[:, W_AUX] = False  # everything but the auxiliary word decides whether an entry is dense
    same = (~any_along(differs, dim=1)).tolist()
    first = unpack_slots(packed[0]).tolist() if count else []
    dense = [same[i] and first[i][E_KIND] == KIND_TENSOR and first[i][E_NUMEL] > 0 for i in range(count)]
    uneven = [index for index in range(count) if not dense[index]]  # only these need every rank's slot unpacked
    planned, sections = _plan_uneven(packed, uneven, cat, table, what) if uneven else ([], None)
    unevens = iter(planned)
    entries = [_dense_entry(tuple(first[i]), world) if dense[i] else next(unevens) for i in range(count)]
    flags = table[:, H_FLAGS]
    inline = count > 0 and bool((flags & FLAG_INLINE).all()) and all(entry.dense for entry in entries)
    if inline:
        reduce = "never"  # the data came with the records: nothing is left to move
    any_graph = bool((flags & FLAG_GRAD).any())
    differentiable = bool((flags & FLAG_DIFF).all()) and (grad == "always" or any_graph)
    if any_graph and not differentiable:
        reduce = "never"  # the local slot gets this rank's own tensor back, with its graph, as stock does
    reduce_groups = _route(entries, ops, world, reduce, differentiable)
    gathered_dense = [
        (index, entry.dtype, int(entry.numels[0]))
        for index, entry in enumerate(entries)
        if entry.dense and entry.route == ROUTE_GATHER and entry.dtype is not None  # a dense entry has a dtype
    ]
    groups, used = dense_layout(gathered_dense)
    nbytes = _layout_uneven(planned, sections, world, used)
    return Plan(
        world_size=world,
        entries=entries,
        nbytes=nbytes,
        max_bytes=int(nbytes.max()) if world else 0,
        flags=table[:, H_FLAGS].clone(),
        aux=packed[:, :, W_AUX].clone(),
        groups=groups,
        reduce_groups=reduce_groups,
        differentiable=differentiable,
        inline=inline,
    )


def _route(
    entries: list[EntryPlan], ops: Sequence[int] | None, world: int, reduce: str, differentiable: bool
) -> list[ReduceGroup]:
    """Choose the all-reduced entries: whole (op, dtype) buckets, when the bytes saved pay for a collective."""
    if ops is None or reduce == "never":
        return []
    # A state some ranks share with an earlier entry (a compute group formed on some ranks only) needs the earlier
    # entry's per-rank pieces, which an all-reduce does not keep.
    refs = [entry.refs for entry in entries if not entry.dense]
    every_ref = torch.cat(refs) if refs else torch.empty(0, dtype=torch.int64)
    shared = set(every_ref[every_ref >= 0].tolist())
    members: dict[str, list[tuple[int, int, torch.dtype]]] = {"sum": [], "max_float": [], "max_int": []}
    for index, (entry, op) in enumerate(zip(entries, ops, strict=True)):
        eligible = entry.dense and entry.dtype is not None and index not in shared
        if differentiable and op in (OP_MAX, OP_MIN):
            eligible = False  # the gradient of a max goes to one rank's element: the gathered stack keeps it
        transport = reduce_dtype(op, entry.dtype) if eligible and entry.dtype is not None else None
        if transport is None:
            continue
        kind = "sum" if op in (OP_SUM, OP_MEAN) else "max_float" if transport.is_floating_point else "max_int"
        members[kind].append((index, op, transport))
    groups = [_reduce_group(kind, found, entries) for kind, found in members.items() if found]
    chosen = [group for group in groups if reduce == "always" or (world - 2) * group.nbytes >= REDUCE_MIN_SAVING]
    # The collective budget: metadata + gather + one all-reduce, or metadata + two all-reduces when nothing is left
    # to gather. Past it, only the largest group is all-reduced and the others ride in the gather.
    routed = {index for group in chosen for index in group.indices}
    gathers = any(
        index not in routed and (entry.dense or bool((entry.numels > 0).any())) for index, entry in enumerate(entries)
    )
    if len(chosen) > (1 if gathers else 2):
        chosen = [max(chosen, key=lambda group: group.nbytes)]
    for group in chosen:
        for index in group.indices:
            entries[index] = _with_route(entries[index], ROUTE_REDUCE)
    return chosen


def _reduce_group(kind: str, members: list[tuple[int, int, torch.dtype]], entries: list[EntryPlan]) -> ReduceGroup:
    dtypes = {transport for _, _, transport in members}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    group = ReduceGroup(OP_SUM if kind == "sum" else OP_MAX, dtype)
    for index, op, transport in members:
        numel = int(entries[index].numels[0])
        if op == OP_MIN:
            encoding = ENC_NEGATE if transport.is_floating_point else ENC_INVERT
        else:
            encoding = ENC_SPLIT if transport == torch.int64 and dtype == torch.float64 else ENC_PLAIN
        group.indices.append(index)
        group.numels.append(2 * numel if encoding == ENC_SPLIT else numel)
        group.encodings.append(encoding)
    return group


def _with_route(entry: EntryPlan, route: int) -> EntryPlan:
    # Dense entries are shared between plans (cached), so a routed one is a copy.
    copy = EntryPlan(**{name: getattr(entry, name) for name in entry.__dataclass_fields__})
    copy.route = route
    return copy


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


def _layout_uneven(uneven: list[EntryPlan], sections: Tensor | None, world: int, start: int) -> Tensor:
    """Per-rank offsets of the uneven entries (``[m, W]`` section bytes) after the dense groups: one cumulative sum."""
    if sections is None:
        return torch.full((world,), start, dtype=torch.int64)
    ends = start + sections.cumsum(dim=0)
    for entry, offsets in zip(uneven, (ends - sections).unbind(0), strict=True):
        entry.offsets = offsets
    return ends[-1]


@functools.lru_cache(maxsize=1024)
def _dense_entry(slot: tuple[int, ...], world: int) -> EntryPlan:
    # Shared between entries and syncs, so never mutated: a dense entry's place is its group's business.
    dtype = _DTYPES[slot[E_DTYPE] - 1]
    ones = torch.ones(world, dtype=torch.int64)
    return EntryPlan(
        kind=KIND_TENSOR,
        dtype=dtype,
        dtype_codes=ones * slot[E_DTYPE],
        numels=ones * slot[E_NUMEL],
        items=ones,
        shapes=torch.tensor([slot[E_NDIM:]] * world, dtype=torch.int64),
        refs=-ones,
        empty_shape=None,
        dense=True,
        shape=tuple(slot[E_DIMS : E_DIMS + slot[E_NDIM]]),
    )


def any_along(mask: Tensor, dim: int) -> Tensor:
    """``mask.any(dim)``: a bool reduction along one dimension takes a slow path on the CPU, 10x this one."""
    return mask.view(torch.uint8).amax(dim=dim).view(torch.bool)


def all_along(mask: Tensor, dim: int) -> Tensor:
    """``mask.all(dim)``, as fast as :func:`any_along`."""
    return mask.view(torch.uint8).amin(dim=dim).view(torch.bool)


def _first(mask: Tensor) -> Tensor:
    """Per row of ``[m, W]``: the first rank where ``mask`` holds (0 where it never does)."""
    return mask.view(torch.uint8).argmax(dim=1)  # argmax gives the first of equal maxima


def _plan_uneven(
    packed: Tensor, indices: list[int], cat: Sequence[bool] | None, table: Tensor, what: str
) -> tuple[list[EntryPlan], Tensor]:
    """The entries ``indices``, whose slots differ between ranks (uneven sizes, empty ranks, lists, shared objects).

    ``packed`` holds every entry's slots (``[W, entries, ENTRY_LEN]``). Returns the plans and each entry's section
    bytes on each rank (``[m, W]``). Every check and size is one tensor operation over all of them (a fixed number per
    sync, not per entry and rank); Python only builds the ``EntryPlan`` objects from the results. The first offending
    entry raises, as if the entries were checked one by one.
    """
    # Entry-major (``[m, ENTRY_LEN, W]``): the plan reduces over ranks, which is fastest along contiguous memory.
    planes = packed.permute(1, 2, 0).index_select(0, torch.tensor(indices, dtype=torch.int64))
    head = planes[:, W_HEAD]
    is_ref = (head & 3) == KIND_REF
    refs = torch.where(is_ref, head >> 12, -1)
    sends = ~is_ref  # a rank repeating an earlier entry sends nothing for it
    head, numels, dims = head * sends, planes[:, W_NUMEL] * sends, planes[:, W_DIMS:] * sends.unsqueeze(1)
    kinds, codes, items = head & 3, (head >> 2) & 63, head >> 12
    halves = torch.stack([dims & 0xFFFF_FFFF, dims >> 32], dim=2).flatten(1, 2)
    shapes = torch.cat([((head >> 8) & 15).unsqueeze(1), halves], dim=1)  # [m, SHAPE_WORDS, W]
    column = torch.arange(len(indices))
    nonempty, with_items = numels > 0, items > 0
    holder = _first(nonempty)  # each entry's first rank with data: its dtype and shape are the entry's
    lead = shapes[column, :, holder]  # [m, SHAPE_WORDS]
    # Only ranks with data must agree on the dtype. A 0-d tensor counts as a 1-d tensor of one element: a one-item
    # `cat` list arrives 0-d, a longer one 1-d.
    ndims = shapes[:, 0].clamp(min=1)
    has_tensor, has_list = any_along(kinds == KIND_TENSOR, dim=1), any_along(kinds == KIND_LIST, dim=1)
    problems = torch.stack(
        [
            any_along(refs >= torch.tensor(indices).unsqueeze(1), dim=1),
            has_tensor & has_list,
            any_along(nonempty & (codes != codes[column, holder].unsqueeze(1)), dim=1),
            has_tensor & any_along(nonempty & (ndims != lead[:, :1].clamp(min=1)), dim=1),
        ]
    )  # [check, m], in the order each entry is checked
    if bool(problems.any()):
        _raise_uneven(problems, indices, codes, ndims, nonempty, table, what)
    # A `cat` list whose items concatenate alike on every rank (the same shape words, not MIXED_ITEMS, on every rank
    # with items) is joined from its slots' shape words alone: no rank sends its item shape table. Not when another
    # entry refers to it, since then its per-rank pieces may be needed.
    referenced = set(refs[refs >= 0].tolist())
    joined = [bool(cat[index]) and index not in referenced if cat is not None else False for index in indices]
    alike = all_along(shapes == shapes[column, :, _first(with_items)].unsqueeze(2), dim=1) & (shapes[:, 0] <= MAX_NDIM)
    shared = torch.tensor(joined) & all_along(alike | ~with_items, dim=1) & ~any_along(is_ref, dim=1)
    aligned = -ALIGN  # x + ALIGN - 1 & -ALIGN is align(x): bit operations, cheaper than a division
    table_bytes = (items * (SHAPE_WORDS * 8) + ALIGN - 1 & aligned) * (has_list & ~shared).unsqueeze(1)
    holds = any_along(nonempty, dim=1).tolist()
    dtypes = [
        _DTYPES[code - 1] if held else None for code, held in zip(codes[column, holder].tolist(), holds, strict=True)
    ]
    itemsizes = torch.tensor([dtype.itemsize if dtype is not None else 0 for dtype in dtypes]).unsqueeze(1)
    sections = table_bytes + (numels * itemsizes + ALIGN - 1 & aligned)  # a referring rank's numel is 0
    entries = []
    per_entry = zip(
        *(part.unbind(0) for part in (codes, numels, items, shapes.transpose(1, 2), refs, table_bytes)), strict=True
    )
    for row, tensor, listed, dtype, fields in zip(
        lead.tolist(), has_tensor.tolist(), has_list.tolist(), dtypes, per_entry, strict=True
    ):
        kind = KIND_TENSOR if tensor else KIND_LIST if listed else KIND_REF
        empty_shape = (0, *row[2 : 1 + row[0]]) if kind == KIND_TENSOR and dtype is not None else None
        entry_codes, entry_numels, entry_items, entry_shapes, entry_refs, entry_table = fields
        entries.append(
            EntryPlan(
                kind=kind,
                dtype=dtype,
                dtype_codes=entry_codes,
                numels=entry_numels,
                items=entry_items,
                shapes=entry_shapes,
                refs=entry_refs,
                empty_shape=empty_shape,
                table_bytes=entry_table,
            )
        )
    return entries, sections


def _raise_uneven(
    problems: Tensor, indices: list[int], codes: Tensor, ndims: Tensor, nonempty: Tensor, table: Tensor, what: str
) -> None:
    """Raise `SyncMismatchError` for the first entry with a problem (``problems``: ``[check, m]``), its first check.

    ``codes``, ``ndims`` and ``nonempty`` are ``[m, W]``.
    """
    position = problems.any(dim=0).tolist().index(True)
    check, index = problems[:, position].tolist().index(True), indices[position]
    if check == 0:
        raise SyncMismatchError(f"{what}: entry {index} refers to a later entry; this is a torchmetrics_varlen bug.")
    lines = rank_lines(table, index)
    if check == 1:
        raise SyncMismatchError(f"{what}: entry {index} is a tensor on some ranks and a list on others.\n" + lines)
    found = sorted(set((codes if check == 2 else ndims)[position][nonempty[position]].tolist()))
    if check == 2:
        raise SyncMismatchError(
            f"{what}: expected entry {index} to have one dtype on every rank that holds data, but got"
            f" {sorted(dtype_name(c) for c in found)}. Cast the state to one dtype on every rank.\n" + lines
        )
    raise SyncMismatchError(
        f"{what}: expected entry {index} to have the same number of dimensions on every rank that holds"
        f" data, but got {found}.\n" + lines
    )


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype of a code (None for 0: an empty list sent no dtype)."""
    return _DTYPES[code - 1] if code > 0 else None


def rank_lines(table: Tensor, entry: int | None = None) -> str:
    """One line per rank saying what it synced (and, with ``entry``, what it held there): error messages."""
    lines = []
    for rank, row in enumerate(table.tolist()):
        text = f"  rank {rank}: {_decode_label(row[H_LABEL : H_LABEL + LABEL_WORDS]) or '?'}"
        if entry is not None and entry < row[H_N] and len(row) >= record_words(entry + 1):
            packed = row[HEADER_LEN + entry * ENTRY_LEN : HEADER_LEN + (entry + 1) * ENTRY_LEN]
            slot = unpack_slots(torch.tensor(packed, dtype=torch.int64)).tolist()
            if slot[E_KIND] == KIND_LIST:
                items, numel = slot[E_ITEMS], slot[E_NUMEL]
                text += f", list of {items} tensors, {numel} elements, dtype={dtype_name(slot[E_DTYPE])}"
            elif slot[E_KIND] == KIND_TENSOR:
                shape = tuple(slot[E_DIMS : E_DIMS + slot[E_NDIM]])
                text += f", shape={shape}, dtype={dtype_name(slot[E_DTYPE])}"
        lines.append(text)
    return "\n".join(lines)


def check_headers(table: Tensor, what: str) -> None:
    """Raise `SyncMismatchError` (on every rank alike) when the ranks are not syncing the same thing."""
    if not bool((table[:, H_MAGIC] == MAGIC).all()):
        bad = (table[:, H_MAGIC] != MAGIC).nonzero().flatten().tolist()
        raise SyncMismatchError(
            f"{what}: ranks {bad} are not running the torchmetrics_varlen sync protocol (version {MAGIC & 0xFFFF}) at"
            " this point. Every rank must call the same sync in the same order; mixing torchmetrics_varlen versions or"
            " stock collectives at the same step is not supported."
        )
    keys = table[:, [H_CONTEXT, H_N]]
    if not bool((keys == keys[:1]).all()):
        raise SyncMismatchError(
            f"{what}: ranks are syncing different things at the same time (different metric, state layout, or phase:"
            " per-step sync vs epoch compute). Every rank must sync the same metrics in the same order.\n"
            + rank_lines(table)
        )
    diff = (table[:, H_FLAGS] & FLAG_DIFF) != 0
    if bool(diff.any()) and not bool(diff.all()):
        raise SyncMismatchError(
            f"{what}: ranks {diff.nonzero().flatten().tolist()} run a differentiable sync (`sync_grads=True` in grad"
            " mode) and the others do not; the backward pass would wait for them. Run the same code on every rank"
            " (same `sync_grads`, same `torch.no_grad()` context).\n" + rank_lines(table)
        )
    failing = (table[:, H_ERROR] != ERR_NONE).nonzero().flatten().tolist()
    if failing:
        rank = failing[0]
        error, entry = int(table[rank, H_ERROR]), int(table[rank, H_ERROR_ENTRY])
        raise SyncMismatchError(
            f"{what}: rank {rank} holds {_ERROR_TEXT.get(error, 'an unsupported value')} in entry {entry}; it cannot"
            " be synced.\n" + rank_lines(table, entry)
        )
