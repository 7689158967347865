"""The sync plan: what every rank decides from the exchanged records, the same on every rank.

``make_plan`` reads the ``[world_size, words]`` table of records (see :mod:`torchmetrics_varlen._protocol`) and
decides everything in tensor operations over it, with no Python loop over the ranks: errors (raised on every rank
alike), which dense states travel by all-reduce and which by gather (``_route``, the cost model and the collective
budget), each rank's byte layout, the transfer size, the dtype and trailing shape an empty rank takes. Plans are
cached by the table's digest: a per-step sync that sends the same slots reuses its plan.
"""

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from torchmetrics_varlen import _caches
from torchmetrics_varlen._protocol import (
    ALIGN,
    DTYPES,
    E_DIMS,
    E_DTYPE,
    E_KIND,
    E_NDIM,
    E_NUMEL,
    ENTRY_LEN,
    FLAG_DIFF,
    FLAG_GRAD,
    FLAG_HOST_GRAD,
    FLAG_INLINE,
    H_CAP,
    H_FLAGS,
    H_N,
    HEADER_LEN,
    KIND_LIST,
    KIND_REF,
    KIND_TENSOR,
    MAX_NDIM,
    SHAPE_WORDS,
    W_AUX,
    W_DIMS,
    W_HEAD,
    W_NUMEL,
    DenseGroup,
    align,
    check_headers,
    dense_layout,
    dtype_name,
    rank_lines,
    unpack_slots,
)
from torchmetrics_varlen.errors import SyncMismatchError

# Reductions the plan can move by all-reduce (equal shape and dtype on every rank). Stock's `mean` is a sum / W.
OP_NONE, OP_SUM, OP_MAX, OP_MIN, OP_MEAN = 0, 1, 2, 3, 4
# How an entry's data moves: inside the one padded gather, by an all-reduce of its reduce group, or by per-rank
# broadcasts straight into its result (``_route_data``).
ROUTE_GATHER, ROUTE_REDUCE, ROUTE_BCAST = 0, 1, 2


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


# How an entry rides its reduce group's buffer: as it is, bit-inverted (an integer `min` inside the `max` group:
# ~x = -x - 1 reverses the order without overflow), or split into a high and a low 32-bit half (an int64 sum inside a
# float64 sum group: each half sums exactly in float64 for up to 2**21 ranks).
ENC_PLAIN, ENC_INVERT, ENC_SPLIT = 0, 2, 3


@dataclass
class ReduceGroup:
    """Dense entries reduced by one all-reduce (sum or max) of a flat buffer of ``dtype``.

    Every sum and mean state shares one group (integers split into float64 halves when floats are summed too), every
    max and min state of an integer dtype another: at most two groups, whatever the number of states, of which the
    collective budget lets one be all-reduced when something is left to gather (see ``_route``). Float max and min
    states are never all-reduced (see ``reduce_dtype``).
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
    broadcast: list[int] = field(default_factory=list)  # the entries on ROUTE_BCAST, in order
    cap: int = 0  # the smallest transfer cap of the ranks (bytes): the most one broadcast moves
    # Derived facts that unpacking computes from the plan alone (a cached plan is unpacked again and again). Filled
    # lazily; two threads may fill one key, with the same value.
    memo: dict[object, object] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def alloc_bytes(self) -> int:
        """Bytes this sync allocates on every rank for what it receives: the padded rows, broadcast results.

        Kept once worked out: a cached plan serves sync after sync, and each asks.
        """
        total = self.world_size * self.max_bytes + sum(group.nbytes for group in self.reduce_groups)
        for index in self.broadcast:
            entry = self.entries[index]
            assert entry.dtype is not None  # only entries with data broadcast
            total += int(entry.numels.sum()) * entry.dtype.itemsize
        return total


# Moving a reducible group by all-reduce instead of inside the gather saves about (W - 2) x its bytes of traffic per
# rank (and W x its bytes of receive memory) but costs one more collective. Below this many bytes of saving, one
# collective's latency is worth more. Measured on gloo (docs page "Scale"): a tiny collective costs what a 150-300 KiB
# gather does; the threshold is lower, because at scale bytes and receive memory matter more than 0.2 ms.
REDUCE_MIN_SAVING = 64 * 2**10
_REDUCE_DTYPES = {torch.int64, torch.float32, torch.float64}  # all-reduce works on these on every backend


def reduce_dtype(op: int, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a dense state of ``dtype`` travels in when all-reduced with ``op``, or None to gather it.

    Integers (and bools) sum as int64, which is what ``torch.sum`` gives, so the result is bit-identical; their max
    and min are exact in int64. Float sums and means: half floats travel as float32, in which ``torch.sum``
    accumulates them too; NaN and infinities propagate in any order, and a sum of zeros is made ``+0.0`` afterwards,
    as ``torch.sum`` (which starts from ``+0.0``) gives (see ``_state_sync.reduce_state``); only the rounding order of
    finite sums on three or more ranks is the backend's. Float max and min are gathered: ``torch.max`` of the stacked
    ranks propagates NaN and keeps the first rank's zero of a ``-0.0``/``+0.0`` tie, which no backend's ``MAX``
    all-reduce does (gloo drops NaN). Complex and float8 states are gathered.
    """
    if op == OP_NONE or dtype.is_complex or (dtype.itemsize == 1 and dtype.is_floating_point):
        return None
    if dtype.is_floating_point:
        if op in (OP_MAX, OP_MIN):
            return None
        return torch.float64 if dtype == torch.float64 else torch.float32
    return None if op == OP_MEAN else torch.int64  # torch.mean refuses integers: gather, and raise as stock does


_PLANS: dict[tuple[bytes, tuple[int, ...], str], Plan] = {}
# Plans (and the dense entries they share) are never mutated once made: a routed entry is a copy (``_with_route``).
_PLANS_LOCK = threading.Lock()  # the Join worker thread plans too
PLAN_CACHE_SIZE = 64
_caches.register(
    "_plan._PLANS: a metric synced again and again sends the same table, and a lookup costs less than a plan",
    _PLANS.clear,
)


def make_plan(
    table: Tensor,
    what: str,
    ops: Sequence[int] | None = None,
    reduce: str = "auto",
    digest: bytes | None = None,
    grad: str = "if_graph",
    cat: Sequence[bool] | None = None,
    names: Callable[[int], str] | None = None,
    broadcast_min: int | None = None,
) -> Plan:
    """Check the gathered records and lay out the data exchange; raise `SyncMismatchError` on every rank alike.

    ``ops`` gives, per entry, the reduction the caller applies afterwards (equal on every rank, since it follows
    from the synced layout whose hash every record carries); ``reduce`` is "auto" (cost model), "never" or
    "always". ``grad`` says when a sync that every rank asked to be differentiable (``FLAG_DIFF``) really is:
    "always" (a per-step sync in grad mode: the result is a loss) or "if_graph" (only when some rank's states carry
    a graph). ``digest`` identifies the table: a metric synced again and again sends the same table, and a plan
    looked up costs less than one made. Plans are never mutated after this; a table that raises is never cached.
    ``names`` names the entry at a position in error messages (a metric's state: ``"BinaryAUROC.preds"``).
    ``broadcast_min`` enables the broadcast route (``_route_data``) for entries whose largest rank holds at least
    that many bytes (the policy's cost model); None keeps every entry in the gather (a sync to one rank).
    """
    routes = (*(ops or ()), -1, *(cat or ()), -1, -1 if broadcast_min is None else broadcast_min)
    key = (digest, routes, reduce + grad) if digest is not None else None
    if key is not None:
        with _PLANS_LOCK:
            plan = _PLANS.get(key)  # type: ignore[arg-type]
        if plan is not None:
            return plan
    plan = _make_plan(table, what, ops, reduce, grad, cat, names or _entry_name, broadcast_min)
    if key is not None:
        with _PLANS_LOCK:
            if len(_PLANS) >= PLAN_CACHE_SIZE:
                del _PLANS[next(iter(_PLANS))]  # the oldest
            _PLANS[key] = plan  # type: ignore[index]
    return plan


def refuse_host_grad(what: str, ranks: list[int]) -> None:
    """Raise on every rank: a differentiable sync of CPU tensors in a process that uses CUDA (see ``_policy``)."""
    raise ValueError(
        f"{what}: expected the tensors of a differentiable sync (`sync_grads=True` in grad mode) on the device the"
        f" gradients come from, but ranks {ranks} hold them on the CPU while their process uses CUDA. Their backward"
        " all-reduce would wait for copies on the CPU's autograd thread while DDP issues its gradient all-reduces from"
        " the CUDA thread, and the two can reach the process group in a different order on different ranks (a hang"
        " or mixed-up gradients). Keep the metric on the model's device (`metric.to(device)`, updated with CUDA"
        " tensors rather than `.cpu()` copies), or sync without gradients (`sync_grads=False`)."
    )


def _entry_name(index: int) -> str:
    return f"entry {index}"


def _make_plan(
    table: Tensor,
    what: str,
    ops: Sequence[int] | None,
    reduce: str,
    grad: str,
    cat: Sequence[bool] | None,
    names: Callable[[int], str],
    broadcast_min: int | None,
) -> Plan:
    world = table.shape[0]
    check_headers(table, what, names)
    count = int(table[0, H_N])
    packed = table[:, HEADER_LEN : HEADER_LEN + count * ENTRY_LEN].reshape(world, count, ENTRY_LEN)
    differs = any_along(packed != packed[:1], dim=0)  # [count, ENTRY_LEN]
    differs[:, W_AUX] = False  # everything but the auxiliary word decides whether an entry is dense
    same = (~any_along(differs, dim=1)).tolist()
    first = unpack_slots(packed[0]).tolist() if count else []
    dense = [same[i] and first[i][E_KIND] == KIND_TENSOR and first[i][E_NUMEL] > 0 for i in range(count)]
    uneven = [index for index in range(count) if not dense[index]]  # only these need every rank's slot unpacked
    planned, data_bytes = _plan_uneven(packed, uneven, cat, table, what, names) if uneven else ([], None)
    unevens = iter(planned)
    entries = [_dense_entry(tuple(first[i]), world) if dense[i] else next(unevens) for i in range(count)]
    flags = table[:, H_FLAGS]
    inline = count > 0 and bool((flags & FLAG_INLINE).all()) and all(entry.dense for entry in entries)
    if inline:
        reduce = "never"  # the data came with the records: nothing is left to move
    any_graph = bool((flags & FLAG_GRAD).any())
    differentiable = bool((flags & FLAG_DIFF).all()) and (grad == "always" or any_graph)
    if differentiable and bool((flags & FLAG_HOST_GRAD).any()):
        refuse_host_grad(what, (flags & FLAG_HOST_GRAD).nonzero().flatten().tolist())
    if any_graph and not differentiable:
        reduce = "never"  # the local slot gets this rank's own tensor back, with its graph, as stock does
    reduce_groups = _route(entries, ops, world, reduce, differentiable)
    cap = int(table[:, H_CAP].min())
    groups, nbytes = _layout(entries, uneven, data_bytes, world)
    broadcast: list[int] = []
    if not inline and broadcast_min is not None and world > 1:
        # Most syncs move small states: one check of the largest section and of the gather's size keeps them here.
        largest = int(data_bytes.max()) if data_bytes is not None else 0
        if largest >= broadcast_min or world * int(nbytes.max()) > cap:
            broadcast = _route_data(entries, data_bytes, uneven, world, cap, broadcast_min)
            groups, nbytes = _layout(entries, uneven, data_bytes, world)
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
        broadcast=broadcast,
        cap=cap,
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
    members: dict[str, list[tuple[int, int, torch.dtype]]] = {"sum": [], "max": []}
    for index, (entry, op) in enumerate(zip(entries, ops, strict=True)):
        eligible = entry.dense and entry.dtype is not None and index not in shared
        if differentiable and op in (OP_MAX, OP_MIN):
            eligible = False  # the gradient of a max goes to one rank's element: the gathered stack keeps it
        transport = reduce_dtype(op, entry.dtype) if eligible and entry.dtype is not None else None
        if transport is None:
            continue
        kind = "sum" if op in (OP_SUM, OP_MEAN) else "max"  # max and min: integers only (see `reduce_dtype`)
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


def _layout(
    entries: list[EntryPlan], uneven: list[int], data_bytes: Tensor | None, world: int
) -> tuple[list[DenseGroup], Tensor]:
    """Lay out each rank's gather buffer; return the dense groups and each rank's used bytes (``[W]``).

    The dense groups come first, then each uneven entry's section: its item shape table, and its data unless the
    entry is broadcast.
    """
    gathered_dense = [
        (index, entry.dtype, int(entry.numels[0]))
        for index, entry in enumerate(entries)
        if entry.dense and entry.route == ROUTE_GATHER and entry.dtype is not None  # a dense entry has a dtype
    ]
    groups, used = dense_layout(gathered_dense)
    if data_bytes is None:
        return groups, torch.full((world,), used, dtype=torch.int64)
    planned = [entries[index] for index in uneven]  # routed entries are copies: take them from `entries`
    kept = torch.tensor([entry.route != ROUTE_BCAST for entry in planned]).unsqueeze(1)
    tables = torch.stack([entry.table_bytes for entry in planned])  # type: ignore[misc]  # set by _plan_uneven
    return groups, _layout_uneven(planned, tables + data_bytes * kept, world, used)


def _route_data(
    entries: list[EntryPlan], data_bytes: Tensor | None, uneven: list[int], world: int, cap: int, broadcast_min: int
) -> list[int]:
    """Move entries to per-rank broadcasts (``ROUTE_BCAST``), straight into their results; returns them, in order.

    The padded gather moves and allocates ``world_size x`` the largest rank's bytes, and a joined ``cat`` state is then
    copied out of it; ``W`` broadcasts, one per rank that holds data, move the true sizes into the result itself, at
    the cost of ``W - 1`` more collectives. The cost model (measured on gloo, docs page "How the sync works"): a tiny
    broadcast costs what moving ``broadcast_min`` bytes does, so an uneven entry whose largest rank holds at least
    that many bytes is broadcast. Then the cap: while the padded gather would still allocate more than ``cap``
    (``world_size x`` its largest rank's bytes), the largest remaining entry holding data moves too, dense ones
    included. An entry that refers to another, or that another refers to, stays in the gather (its per-rank pieces
    are cut from the gathered rows). Decided from the plan alone: every rank routes alike.
    """
    referenced: set[int] = set()
    for entry in entries:
        if not entry.dense:
            referenced.update(entry.refs[entry.refs >= 0].tolist())
    per_rank = torch.zeros(world, dtype=torch.int64)  # what each rank's padded section holds, aligned
    candidates: list[tuple[int, int, Tensor]] = []  # (total bytes, index, per-rank bytes)
    positions = {index: position for position, index in enumerate(uneven)}
    for index, entry in enumerate(entries):
        if entry.route != ROUTE_GATHER:
            continue
        if entry.dense:
            assert entry.dtype is not None
            sizes = torch.full((world,), align(int(entry.numels[0]) * entry.dtype.itemsize), dtype=torch.int64)
        else:
            assert data_bytes is not None
            sizes = data_bytes[positions[index]]
            assert entry.table_bytes is not None
            per_rank += entry.table_bytes  # shape tables always ride in the gather
        movable = entry.dtype is not None and index not in referenced and not bool((entry.refs >= 0).any())
        if movable and not entry.dense and int(sizes.max()) >= broadcast_min:
            entries[index] = _with_route(entry, ROUTE_BCAST)
            continue
        per_rank += sizes
        if movable and int(sizes.max()) > 0:
            candidates.append((int(sizes.sum()), index, sizes))
    candidates.sort(key=lambda found: -found[0])  # the largest first: fewest entries moved
    for _, index, sizes in candidates:
        if world * int(per_rank.max()) <= cap:
            break
        entries[index] = _with_route(entries[index], ROUTE_BCAST)
        per_rank -= sizes
    return [index for index, entry in enumerate(entries) if entry.route == ROUTE_BCAST]


def _reduce_group(kind: str, members: list[tuple[int, int, torch.dtype]], entries: list[EntryPlan]) -> ReduceGroup:
    dtypes = {transport for _, _, transport in members}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    group = ReduceGroup(OP_SUM if kind == "sum" else OP_MAX, dtype)
    for index, op, transport in members:
        numel = int(entries[index].numels[0])
        if op == OP_MIN:
            encoding = ENC_INVERT
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
    dtype = DTYPES[slot[E_DTYPE] - 1]
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
    packed: Tensor,
    indices: list[int],
    cat: Sequence[bool] | None,
    table: Tensor,
    what: str,
    names: Callable[[int], str],
) -> tuple[list[EntryPlan], Tensor]:
    """The entries ``indices``, whose slots differ between ranks (uneven sizes, empty ranks, lists, shared objects).

    ``packed`` holds every entry's slots (``[W, entries, ENTRY_LEN]``). Returns the plans and each entry's data
    bytes on each rank (``[m, W]``, aligned; the item shape tables' bytes are in each plan's ``table_bytes``). Every
    check and size is one tensor operation over all of them (a fixed number per sync, not per entry and rank); Python
    only builds the ``EntryPlan`` objects from the results. The first offending entry raises, as if the entries were
    checked one by one.
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
    catted = torch.tensor([cat is not None and bool(cat[index]) for index in indices])
    problems = torch.stack(
        [
            any_along(refs >= torch.tensor(indices).unsqueeze(1), dim=1),
            has_tensor & has_list,
            any_along(nonempty & (codes != codes[column, holder].unsqueeze(1)), dim=1),
            has_tensor & any_along(nonempty & (ndims != lead[:, :1].clamp(min=1)), dim=1),
            _cat_conflicts(shapes, nonempty, catted),
        ]
    )  # [check, m], in the order each entry is checked
    if bool(problems.any()):
        _raise_uneven(problems, indices, codes, ndims, nonempty, table, what, names)
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
        DTYPES[code - 1] if held else None for code, held in zip(codes[column, holder].tolist(), holds, strict=True)
    ]
    itemsizes = torch.tensor([dtype.itemsize if dtype is not None else 0 for dtype in dtypes]).unsqueeze(1)
    data_bytes = numels * itemsizes + ALIGN - 1 & aligned  # a referring rank's numel is 0
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
    return entries, data_bytes


def _cat_conflicts(shapes: Tensor, nonempty: Tensor, catted: Tensor) -> Tensor:
    """Per `cat` entry: whether the ranks with data join to different dims after the first (``[m]``).

    ``shapes`` is ``[m, SHAPE_WORDS, W]``: a tensor's ``[ndim, *dims]``, a list's ``[ndim, 0, *trailing]`` of what its
    items concatenate to (``MIXED_ITEMS`` when they do not: such a list is left to the join, see
    ``_state_sync._cat_items``). A 0-d tensor joins as a vector. Ranks without data are left out: ``torch.cat`` skips
    the zero-length vectors stock sends for empty ranks.
    """
    ndims = shapes[:, 0].clamp(min=1)
    known = nonempty & (ndims <= MAX_NDIM)
    lead = shapes[torch.arange(shapes.shape[0]), :, _first(known)]  # [m, SHAPE_WORDS]
    used = torch.arange(2, SHAPE_WORDS) < 1 + lead[:, :1].clamp(min=1)  # the words of the dims after the first
    differ = any_along((shapes[:, 2:] != lead[:, 2:].unsqueeze(2)) & used.unsqueeze(2), dim=1)
    return catted & any_along(known & (differ | (ndims != lead[:, :1].clamp(min=1))), dim=1)


def _raise_uneven(
    problems: Tensor,
    indices: list[int],
    codes: Tensor,
    ndims: Tensor,
    nonempty: Tensor,
    table: Tensor,
    what: str,
    names: Callable[[int], str],
) -> None:
    """Raise `SyncMismatchError` for the first entry with a problem (``problems``: ``[check, m]``), its first check.

    ``codes``, ``ndims`` and ``nonempty`` are ``[m, W]``. The message names the entry (``names``) and lists each
    rank's shape and dtype there.
    """
    position = problems.any(dim=0).tolist().index(True)
    check, index = problems[:, position].tolist().index(True), indices[position]
    name = names(index)
    if check == 0:
        raise SyncMismatchError(f"{what}: {name} refers to a later entry; this is a torchmetrics_varlen bug.")
    lines = "\nEach rank's value:\n" + rank_lines(table, index)
    if check == 1:
        raise SyncMismatchError(
            f"{what}: expected `{name}` to be a tensor on every rank or a list on every rank, but it is a tensor on"
            " some ranks and a list on others. Register the state with the same default on every rank." + lines
        )
    if check == 4:
        raise SyncMismatchError(
            f"{what}: expected `{name}` (dist_reduce_fx='cat') to have the same shape after the first dimension on"
            " every rank that holds data, since the ranks' data are concatenated along the first dimension, but the"
            " ranks differ. Give the state the same trailing dims on every rank." + lines
        )
    found = sorted(set((codes if check == 2 else ndims)[position][nonempty[position]].tolist()))
    if check == 2:
        raise SyncMismatchError(
            f"{what}: expected `{name}` to have one dtype on every rank that holds data, but got"
            f" {sorted(dtype_name(c) for c in found)}. Cast the state to one dtype on every rank." + lines
        )
    raise SyncMismatchError(
        f"{what}: expected `{name}` to have the same number of dimensions on every rank that holds"
        f" data, but got {found}." + lines
    )


_caches.register(
    "_plan._dense_entry: a dense entry's plan, shared by every sync with that slot (read only)",
    _dense_entry.cache_clear,
)
