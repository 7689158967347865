"""The routes: which entries leave the padded gather, for an all-reduce or for per-rank broadcasts.

``_plan.make_plan`` asks :func:`route_reduce` which dense states travel by all-reduce (whole reduce groups, when the
bytes saved pay for a collective, within the collective budget), then :func:`route_data` which entries go straight
into their results by one broadcast per rank (large uneven entries, and whatever the transfer cap does not let the
padded gather hold). Both decide from the plan's entries alone, so every rank routes alike; a routed entry is a copy
of its plan (``_with_route``), since plans and their dense entries are shared and never mutated.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from torchmetrics_varlen._entries import ROUTE_BCAST, ROUTE_GATHER, ROUTE_REDUCE, EntryPlan
from torchmetrics_varlen._protocol import align

# Reductions the plan can move by all-reduce (equal shape and dtype on every rank). Stock's `mean` is a sum / W.
OP_NONE, OP_SUM, OP_MAX, OP_MIN, OP_MEAN = 0, 1, 2, 3, 4
# How an entry rides its reduce group's buffer: as it is, bit-inverted (an integer `min` inside the `max` group:
# ~x = -x - 1 reverses the order without overflow), or split into a high and a low 32-bit half (an int64 sum inside a
# float64 sum group: each half sums exactly in float64 for up to 2**21 ranks).
ENC_PLAIN, ENC_INVERT, ENC_SPLIT = 0, 2, 3


@dataclass
class ReduceGroup:
    """Dense entries reduced by one all-reduce (sum or max) of a flat buffer of ``dtype``.

    Every sum and mean state shares one group (integers split into float64 halves when floats are summed too), every
    max and min state of an integer dtype another: at most two groups, whatever the number of states, of which the
    collective budget lets one be all-reduced when something is left to gather (see ``route_reduce``). Float max and min
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
    as ``torch.sum`` (which starts from ``+0.0``) gives (see ``_reductions.reduce_state``); only the rounding order of
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


def route_reduce(
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


def route_data(
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
