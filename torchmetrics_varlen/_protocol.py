"""The sync protocol, read top to bottom: describe, exchange metadata, plan, pack, exchange data, unpack.

Every rank runs the same steps in the same order whatever it holds:

1. ``describe`` turns the local entries (a tensor, or a list of tensors) into one fixed-size ``int64`` record:
   a header (protocol magic, what is being synced, a readable label, local errors) and one slot per entry
   (kind, dtype, element count, item count, shape).
2. The records of all ranks are exchanged in one collective (see :mod:`torchmetrics_varlen._transport`).
3. ``make_plan`` decides everything from that table alone: errors (raised on every rank alike), each rank's byte
   layout, the padded transfer size, the dtype and trailing shape an empty rank takes from its peers.
4. ``pack`` (:mod:`torchmetrics_varlen._buffers`) copies the local entries into one ``uint8`` buffer, each section
   aligned so it can be viewed as its dtype.
5. One collective moves every rank's buffer.
6. ``unpack`` (same module) cuts each rank's sections back out as views with their true shape and dtype: padding
   never escapes.

No rank branches on its local data before step 3, so no rank can skip a collective its peers issue.
"""

import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from torchmetrics_varlen.errors import SyncMismatchError


class Ref:
    """An entry that is the same object as an earlier entry (a state shared by a compute group): sent once."""

    def __init__(self, index: int) -> None:
        self.index = index


Entry = Tensor | list[Tensor]
LocalEntry = Tensor | list[Tensor] | Ref

MAGIC = 0x746D_766C_0001  # "tmvl", protocol version 1
MAX_NDIM = 6
ALIGN = 16  # bytes: enough for every dtype, complex128 included, to be viewed in place
LABEL_WORDS = 3  # 24 bytes of the label travel in the record

# Header slots.
H_MAGIC, H_CONTEXT, H_LABEL = 0, 1, 2
H_SYNCED, H_N, H_ERROR, H_ERROR_ENTRY = (H_LABEL + LABEL_WORDS + i for i in range(4))
HEADER_LEN = H_ERROR_ENTRY + 1
# Entry slots.
E_KIND, E_DTYPE, E_NUMEL, E_ITEMS, E_NDIM, E_DIMS = 0, 1, 2, 3, 4, 5
ENTRY_LEN = 5 + MAX_NDIM

KIND_TENSOR, KIND_LIST, KIND_REF = 1, 2, 3
# Entry slots a record always has room for, so that records are equal in size on every rank whatever each holds.
# Syncs of more entries take one more metadata exchange, sized from the first one's headers.
RECORD_SLOTS = 128

# Local problems found by ``describe``; reported through the record so that every rank raises together.
ERR_NONE, ERR_NDIM, ERR_LIST_DTYPE, ERR_NOT_TENSOR, ERR_LAYOUT, ERR_DTYPE = 0, 1, 2, 3, 4, 5
_ERROR_TEXT = {
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


def context_hash(text: str) -> int:
    """A hash of what is being synced that is equal across processes (``hash()`` is salted per process)."""
    return zlib.crc32(text.encode())


def _encode_label(label: str) -> list[int]:
    raw = label.encode()[: 8 * LABEL_WORDS].ljust(8 * LABEL_WORDS, b"\0")
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _decode_label(words: Sequence[int]) -> str:
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)
    return raw.rstrip(b"\0").decode(errors="replace")


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def dtype_name(code: int) -> str:
    """Readable name of a dtype code, for error messages."""
    return str(_DTYPES[code - 1]).replace("torch.", "") if code > 0 else "-"


def _shape_slots(shape: Sequence[int]) -> list[int]:
    return [len(shape), *shape, *([0] * (MAX_NDIM - len(shape)))]


def describe(entries: Sequence[LocalEntry], context: int, label: str, synced: bool = False) -> list[int]:
    """Build this rank's metadata record: a header plus one slot per entry (callers pad it to a fixed size)."""
    error, error_entry = ERR_NONE, -1
    slots: list[int] = []
    for index, entry in enumerate(entries):
        slot = [0] * ENTRY_LEN
        if isinstance(entry, Ref):
            slot[E_KIND], slot[E_ITEMS] = KIND_REF, entry.index
            slots.extend(slot)
            continue
        problem = _entry_problem(entry)
        if problem != ERR_NONE and error == ERR_NONE:
            error, error_entry = problem, index
        if problem == ERR_NONE and isinstance(entry, Tensor):
            slot[E_KIND], slot[E_DTYPE] = KIND_TENSOR, _DTYPE_CODE[entry.dtype]
            slot[E_NUMEL], slot[E_ITEMS] = entry.numel(), 1
            slot[E_NDIM : E_NDIM + 1 + MAX_NDIM] = _shape_slots(entry.shape)
        elif problem == ERR_NONE:
            nonempty = [t for t in entry if t.numel() > 0]
            dtype_code = _DTYPE_CODE[(nonempty or entry)[0].dtype] if entry else 0
            slot[E_KIND], slot[E_DTYPE], slot[E_ITEMS] = KIND_LIST, dtype_code, len(entry)
            slot[E_NUMEL] = sum(t.numel() for t in entry)
        slots.extend(slot)
    header = [MAGIC, context, *_encode_label(label), int(synced), len(entries), error, error_entry]
    return header + slots


def _entry_problem(entry: Entry) -> int:
    if isinstance(entry, Tensor):
        if entry.layout != torch.strided:
            return ERR_LAYOUT
        if entry.dtype not in _DTYPE_CODE:
            return ERR_DTYPE
        return ERR_NDIM if entry.ndim > MAX_NDIM else ERR_NONE
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


@dataclass
class EntryPlan:
    """What every rank knows about one entry after the metadata exchange."""

    kind: int
    dtype: torch.dtype | None  # the common dtype of the non-empty ranks; None when every rank is empty
    own_dtypes: list[torch.dtype | None]  # per rank: what it sent (kept when no rank holds data)
    numels: list[int]  # per rank
    items: list[int]  # per rank
    shapes: list[tuple[int, ...]]  # per rank (tensor entries)
    empty_shape: tuple[int, ...] | None  # shape an empty rank takes: (0, *trailing dims of the first non-empty rank)
    offsets: list[int]  # per rank: byte offset of this entry's section in that rank's buffer
    table_bytes: list[int]  # per rank: bytes of the item shape table (list entries)
    refs: list[int]  # per rank: index of the earlier entry this one repeats, or -1
    dense: bool = False  # a tensor of the same shape and dtype on every rank: moved in a dtype group, see DenseGroup


@dataclass
class DenseGroup:
    """Dense entries of one dtype, back to back at the same offset in every rank's buffer.

    Most metric states (sums, counts, confusion matrices) are dense. Packing them with one ``cat`` and cutting them
    out of the gathered rows as ``[world_size, *shape]`` blocks costs a few tensor operations per group instead of
    several per entry and rank, which is what makes syncing a hundred small states cheap.
    """

    dtype: torch.dtype
    start: int  # byte offset, equal on every rank
    indices: list[int]  # entry indices
    numels: list[int]  # elements per entry

    @property
    def nbytes(self) -> int:
        """Bytes the group occupies in each rank's buffer."""
        return sum(self.numels) * self.dtype.itemsize


@dataclass
class Plan:
    """The decision every rank reaches from the same metadata table."""

    world_size: int
    entries: list[EntryPlan]
    nbytes: list[int]  # per rank: used bytes of its buffer
    all_synced: bool
    any_synced: bool
    groups: list[DenseGroup]

    @property
    def max_bytes(self) -> int:
        """Transfer size per rank: the largest buffer, so equal-size transports need no more padding."""
        return max(self.nbytes)


_PLANS: dict[bytes, Plan] = {}
PLAN_CACHE_SIZE = 64


def make_plan(table: list[list[int]], what: str, digest: bytes | None = None) -> Plan:
    """Check the gathered records and lay out the data exchange; raise `SyncMismatchError` on every rank alike.

    ``digest`` identifies the table (see ``gather.exchange_records``): a metric synced again and again sends the same
    table each time (same shapes, same ranks synced), and laying out a hundred states costs more than looking its
    plan up. Plans are never mutated after this; a table that raises is never cached.
    """
    plan = _PLANS.get(digest) if digest is not None else None
    if plan is None:
        plan = _make_plan(table, what)
        if digest is not None:
            if len(_PLANS) >= PLAN_CACHE_SIZE:
                del _PLANS[next(iter(_PLANS))]  # the oldest
            _PLANS[digest] = plan
    return plan


def _make_plan(table: list[list[int]], what: str) -> Plan:
    world = len(table)
    _check_headers(table, what)
    entries: list[EntryPlan] = []
    groups: dict[torch.dtype, DenseGroup] = {}
    for index in range(table[0][H_N]):
        base = HEADER_LEN + index * ENTRY_LEN
        slots = [row[base : base + ENTRY_LEN] for row in table]
        first = slots[0]
        if first[E_KIND] == KIND_TENSOR and first[E_NUMEL] > 0 and all(slot == first for slot in slots[1:]):
            plan = _dense_entry(tuple(first), world)
            assert plan.dtype is not None
            group = groups.setdefault(plan.dtype, DenseGroup(plan.dtype, 0, [], []))
            group.indices.append(index)
            group.numels.append(first[E_NUMEL])
        else:
            plan = _plan_entry(slots, index, table, what)
        entries.append(plan)
    # Dense groups first, so that they sit at the same offset in every rank's buffer; then the uneven entries.
    used = 0
    for group in groups.values():
        group.start = used
        used = _align(used + group.nbytes)
    nbytes = [used] * world
    for plan in entries:
        if plan.dense:
            continue
        for rank in range(world):
            plan.offsets.append(nbytes[rank])
            section = plan.table_bytes[rank]
            if plan.dtype is not None:
                section += _align(plan.numels[rank] * plan.dtype.itemsize)
            nbytes[rank] += section
    synced = [bool(row[H_SYNCED]) for row in table]
    return Plan(world, entries, nbytes, all(synced), any(synced), list(groups.values()))


@functools.lru_cache(maxsize=1024)
def _dense_entry(slot: tuple[int, ...], world: int) -> EntryPlan:
    # Shared between entries and syncs, so never mutated: a dense entry's place is its group's business.
    dtype = _DTYPES[slot[E_DTYPE] - 1]
    shape = tuple(slot[E_DIMS : E_DIMS + slot[E_NDIM]])
    return EntryPlan(
        kind=KIND_TENSOR,
        dtype=dtype,
        own_dtypes=[dtype] * world,
        numels=[slot[E_NUMEL]] * world,
        items=[1] * world,
        shapes=[shape] * world,
        empty_shape=None,
        offsets=[],
        table_bytes=[0] * world,
        refs=[-1] * world,
        dense=True,
    )


def _rank_lines(table: list[list[int]], entry: int | None = None) -> str:
    lines = []
    for rank, row in enumerate(table):
        text = f"  rank {rank}: {_decode_label(row[H_LABEL : H_LABEL + LABEL_WORDS]) or '?'}"
        if entry is not None and entry < row[H_N]:
            slot = row[HEADER_LEN + entry * ENTRY_LEN : HEADER_LEN + (entry + 1) * ENTRY_LEN]
            if slot[E_KIND] == KIND_LIST:
                items, numel = slot[E_ITEMS], slot[E_NUMEL]
                text += f", list of {items} tensors, {numel} elements, dtype={dtype_name(slot[E_DTYPE])}"
            elif slot[E_KIND] == KIND_TENSOR:
                shape = tuple(slot[E_DIMS : E_DIMS + slot[E_NDIM]])
                text += f", shape={shape}, dtype={dtype_name(slot[E_DTYPE])}"
        lines.append(text)
    return "\n".join(lines)


def _check_headers(table: list[list[int]], what: str) -> None:
    if any(row[H_MAGIC] != MAGIC for row in table):
        bad = [rank for rank, row in enumerate(table) if row[H_MAGIC] != MAGIC]
        raise SyncMismatchError(
            f"{what}: ranks {bad} are not running the torchmetrics_varlen sync protocol (version {MAGIC & 0xFFFF}) at"
            " this point. Every rank must call the same sync in the same order; mixing torchmetrics_varlen versions or"
            " stock collectives at the same step is not supported."
        )
    if len({(row[H_CONTEXT], row[H_N]) for row in table}) > 1:
        raise SyncMismatchError(
            f"{what}: ranks are syncing different things at the same time (different metric, state layout, or phase:"
            " per-step sync vs epoch compute). Every rank must sync the same metrics in the same order.\n"
            + _rank_lines(table)
        )
    for rank, row in enumerate(table):
        if row[H_ERROR] != ERR_NONE:
            raise SyncMismatchError(
                f"{what}: rank {rank} holds {_ERROR_TEXT.get(row[H_ERROR], 'an unsupported value')} in entry"
                f" {row[H_ERROR_ENTRY]}; it cannot be synced.\n" + _rank_lines(table, row[H_ERROR_ENTRY])
            )


def _plan_entry(slots: list[list[int]], index: int, table: list[list[int]], what: str) -> EntryPlan:
    refs = [slot[E_ITEMS] if slot[E_KIND] == KIND_REF else -1 for slot in slots]
    if any(ref >= index for ref in refs):
        raise SyncMismatchError(f"{what}: entry {index} refers to a later entry; this is a torchmetrics_varlen bug.")
    slots = [slot if slot[E_KIND] != KIND_REF else [0] * ENTRY_LEN for slot in slots]
    kinds = {slot[E_KIND] for slot in slots} - {0}
    if len(kinds) > 1:
        raise SyncMismatchError(
            f"{what}: entry {index} is a tensor on some ranks and a list on others.\n" + _rank_lines(table, index)
        )
    kind = kinds.pop() if kinds else KIND_REF
    nonempty = [slot for slot in slots if slot[E_NUMEL] > 0]
    dtype_codes = {slot[E_DTYPE] for slot in nonempty}  # only ranks with data must agree
    if len(dtype_codes) > 1:
        raise SyncMismatchError(
            f"{what}: expected entry {index} to have one dtype on every rank that holds data, but got"
            f" {sorted(dtype_name(c) for c in dtype_codes)}. Cast the state to one dtype on every rank.\n"
            + _rank_lines(table, index)
        )
    shapes = [tuple(slot[E_DIMS : E_DIMS + slot[E_NDIM]]) for slot in slots]
    empty_shape = None
    if kind == KIND_TENSOR and nonempty:
        # A 0-d tensor counts as a 1-d tensor of one element: a one-item `cat` list arrives 0-d, a longer one 1-d.
        ndims = {max(slot[E_NDIM], 1) for slot in nonempty}
        if len(ndims) > 1:
            raise SyncMismatchError(
                f"{what}: expected entry {index} to have the same number of dimensions on every rank that holds"
                f" data, but got {sorted(ndims)}.\n" + _rank_lines(table, index)
            )
        first = nonempty[0]
        empty_shape = (0, *first[E_DIMS + 1 : E_DIMS + first[E_NDIM]])
    return EntryPlan(
        kind=kind,
        dtype=_DTYPES[dtype_codes.pop() - 1] if dtype_codes else None,
        own_dtypes=[_DTYPES[slot[E_DTYPE] - 1] if slot[E_DTYPE] else None for slot in slots],
        numels=[slot[E_NUMEL] for slot in slots],
        items=[slot[E_ITEMS] for slot in slots],
        shapes=shapes,
        empty_shape=empty_shape,
        offsets=[],
        table_bytes=[_align(slot[E_ITEMS] * (1 + MAX_NDIM) * 8) if kind == KIND_LIST else 0 for slot in slots],
        refs=refs,
    )
