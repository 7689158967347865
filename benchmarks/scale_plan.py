"""The scale benchmark without processes: planning time and the bytes a plan implies, for up to 1024 ranks.

Every rank derives the same plan from the ``[world_size, words]`` metadata table, so what a sync moves per rank
follows from the table alone: the metadata exchange receives ``world_size x`` the agreed record, the padded gather
``world_size x plan.max_bytes``, each all-reduce its bucket. Stock torchmetrics syncs state by state (a barrier, an
all-gather of the shape unless the state is 0-d, an all-gather of the state), so its bytes follow from the states'
sizes. Both models are checked against the bytes measured on real processes where both exist.
"""

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen._engine.group import BROADCAST_MIN_BYTES, DEFAULT_CAP, INITIAL_WORDS, MIN_WORDS, sent_cap
from torchmetrics_varlen._engine.move import AGREE_MIN_BYTES
from torchmetrics_varlen._engine.pack import chunk_elements, pack
from torchmetrics_varlen._engine.plan import OP_MAX, OP_MEAN, OP_NONE, OP_SUM, Plan, make_plan
from torchmetrics_varlen._engine.record import LocalEntry, context_hash, describe
from torchmetrics_varlen._engine.unpack import unpack

Row = dict[str, Any]
CAT_ENTRIES, DENSE_ENTRIES = 8, 16
_DENSE_SHAPES = [(), (5,), (5, 5), (10,)]
_DENSE_DTYPES = [torch.float32, torch.int64, torch.float64, torch.float32]
_DENSE_OPS = [OP_SUM, OP_SUM, OP_MAX, OP_MEAN]


def synthetic_entries(rank: int) -> list[LocalEntry]:
    """Rank ``rank``'s entries: 8 ``cat`` lists of 1-3 float32 items of uneven lengths, then 16 small dense states."""
    entries: list[LocalEntry] = []
    for j in range(CAT_ENTRIES):
        items = 1 + (rank + j) % 3
        entries.append([torch.ones(10 + (7 * rank + 13 * j + 5 * i) % 50) for i in range(items)])
    for j in range(DENSE_ENTRIES):
        entries.append(torch.ones(_DENSE_SHAPES[j % 4], dtype=_DENSE_DTYPES[j % 4]))
    return entries


def synthetic_ops() -> tuple[list[int], list[bool]]:
    """The reductions (``plan.OP_*``) and ``cat`` flags of :func:`synthetic_entries`."""
    ops = [OP_NONE] * CAT_ENTRIES + [_DENSE_OPS[j % 4] for j in range(DENSE_ENTRIES)]
    return ops, [True] * CAT_ENTRIES + [False] * DENSE_ENTRIES


def record_words(words: int, settled: bool = False) -> int:
    """Words of a record as it travels: the group's agreed length, at least the first one.

    ``settled``: after a window of syncs like this one, when the length is at least the least one.
    """
    return max(MIN_WORDS if settled else INITIAL_WORDS, words)


def plan_bytes(plan: Plan, words: int, settled: bool = False) -> Row:
    """Per rank: collectives, bytes received and collective buffers that ``plan`` implies (as ``ByteMeter`` counts).

    Example:
        >>> table = torch.tensor([describe([torch.zeros(3)], 1, "x", 0, None, False, DEFAULT_CAP)] * 4)
        >>> plan_bytes(make_plan(table, "x"), table.shape[1])["gather"]
        64
    """
    world = plan.world_size
    words = record_words(words, settled)
    metadata = world * words * 8
    gather = 0 if plan.inline else world * plan.max_bytes  # inline: the data came with the records
    max_bytes = 0 if plan.inline else plan.max_bytes
    reduce = sum(group.nbytes for group in plan.reduce_groups)
    broadcasts = broadcast = 0  # per-rank broadcasts into the results: every section once, in chunks of the cap
    for index in plan.broadcast:
        entry = plan.entries[index]
        assert entry.dtype is not None  # only entries with data are broadcast
        chunk = chunk_elements(plan.cap, entry.dtype.itemsize)
        for count in entry.numels.tolist():
            broadcast += count * entry.dtype.itemsize
            broadcasts += -(-count // chunk)
    # The memory check: one int64 per rank, when the sync receives enough to be worth it (see _sync.move).
    check = 0 if plan.inline or plan.alloc_bytes < AGREE_MIN_BYTES else world * 8
    return {
        "collectives": 1 + (max_bytes > 0) + len(plan.reduce_groups) + broadcasts + (check > 0),
        "metadata": metadata,
        "gather": gather,
        "reduce": reduce,
        "received": metadata + gather + reduce + broadcast + check,
        "buffers": metadata + words * 8 + gather + max_bytes + reduce + broadcast + check + (8 if check else 0),
    }


def stock_bytes(states: Sequence[Tensor], world: int) -> Row:
    """Per rank: what stock torchmetrics' state-by-state sync of equal-shape ``states`` receives on ``world`` ranks.

    Example:
        >>> stock_bytes([torch.zeros(10, dtype=torch.int64)], 4)["received"]  # shapes (4 x 8) + data (4 x 80)
        352
    """
    received = buffers = collectives = 0
    for state in states:
        nbytes = state.numel() * state.element_size()
        shape = 8 * state.ndim  # an int64 tensor of the shape, gathered first unless the state is 0-d
        received += world * (shape + nbytes)
        buffers += (world + 1) * (shape + nbytes)
        collectives += 2 + (state.ndim > 0)  # barrier, shape gather, data gather
    return {"collectives": collectives, "received": received, "buffers": buffers}


def metric_plan_bytes(metric: Any, world: int, settled: bool = False) -> Row:
    """Per rank, ours: the bytes of one sync of ``metric``'s states on ``world`` ranks holding states like these.

    ``settled``: once the group's record length has shrunk to such syncs.
    """
    from torchmetrics_varlen._engine.states import layout

    sync_layout = layout([metric], "compute")
    classes, cap = sync_layout.classes, sent_cap(sync_layout.cap)  # the cap the engine's record carries
    record = describe(sync_layout.entries, sync_layout.context, "scale", 0, sync_layout.aux, True, cap)
    table = torch.tensor([record] * world, dtype=torch.int64)
    broadcast_min = BROADCAST_MIN_BYTES["gloo"]
    plan = make_plan(table, "scale", classes.ops, "auto", cat=classes.cat, broadcast_min=broadcast_min)
    return plan_bytes(plan, len(record), settled)


def time_planner(world: int, runs: int) -> Row:
    """Median ms of ``make_plan`` (no plan cache) and ``unpack`` over ``world`` synthetic ranks; the plan's bytes."""
    per_rank = [synthetic_entries(rank) for rank in range(world)]
    ops, cat = synthetic_ops()
    context = context_hash("synthetic")
    table = torch.tensor([describe(entries, context, "synthetic", 0, None, False, DEFAULT_CAP) for entries in per_rank])
    plan = make_plan(table, "synthetic", ops, "auto", cat=cat)
    cpu = torch.device("cpu")
    packed = [
        pack(entries, plan, rank, torch.zeros(plan.max_bytes, dtype=torch.uint8))
        for rank, entries in enumerate(per_rank)
    ]
    rows = torch.stack(packed) if plan.max_bytes else None
    devices = [cpu] * len(ops)
    plan_ms: list[float] = []
    unpack_ms: list[float] = []
    total_ms: list[float] = []
    for _ in range(runs):
        start = time.perf_counter()
        plan = make_plan(table, "synthetic", ops, "auto", cat=cat)
        middle = time.perf_counter()
        unpack(rows, plan, devices, cat)
        end = time.perf_counter()
        plan_ms.append((middle - start) * 1000)
        unpack_ms.append((end - middle) * 1000)
        total_ms.append((end - start) * 1000)
    return {
        "world_size": world,
        "plan_ms": statistics.median(plan_ms),
        "unpack_ms": statistics.median(unpack_ms),
        "plan_unpack_ms": statistics.median(total_ms),
        **plan_bytes(plan, table.shape[1]),
    }


def planner_rows(worlds: Sequence[int], runs: int) -> list[Row]:
    """:func:`time_planner` for each world size, on one intra-op thread (torchrun's default for several ranks).

    Several intra-op threads on a shared machine made single plans take 15x their usual time now and then.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [time_planner(world, runs) for world in worlds]
    finally:
        torch.set_num_threads(threads)


def extended_rows(worlds: Sequence[int], quick: bool) -> list[Row]:
    """Bytes per rank up to large world sizes, from the plan (ours) and stock's per-state protocol (stock).

    For the cases whose states have one shape on every rank (a confusion matrix, FID-like sums, BinaryAccuracy),
    where both models are exact. The 8-metric collection's ``cat`` states differ by rank: measured only.
    """
    from benchmarks.scale_procs import SETTLED_CASE, build_case, case_names

    rows: list[Row] = []
    for name in case_names(quick)[1:]:
        stock = build_case(name, "stock", 0, quick)
        ours = build_case(name, "varlen", 0, quick)
        states = [getattr(stock, state) for state in stock._reductions]
        for world in worlds:
            rows.append({"case": name, "world_size": world, "side": "stock", **stock_bytes(states, world)})
            ours_bytes = metric_plan_bytes(ours, world, settled=name == SETTLED_CASE)
            rows.append({"case": name, "world_size": world, "side": "varlen", **ours_bytes})
    return rows
