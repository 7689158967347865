"""The plan and the unpacking over many ranks, in process: records from ``describe``, gathered rows from ``pack``.

Every rank's entries are known here, so each result is checked against those entries themselves (concatenated with
stock's ``dim_zero_cat``, stacked, or as they are), and each error against the message its entry and check give:
the first offending entry in entry order, and its first failing check.
"""

import random

import pytest
import torch
from _helpers import describe
from torchmetrics.utilities.data import dim_zero_cat

from torchmetrics_varlen._engine import pack, record, unpack
from torchmetrics_varlen._engine.pack import Joined, Stacked
from torchmetrics_varlen._engine.plan import make_plan
from torchmetrics_varlen._engine.record import Ref
from torchmetrics_varlen.errors import SyncMismatchError

CPU = torch.device("cpu")
# Per entry: whether its ranks' data are concatenated (`cat`), as in `_entries`.
CAT = [True, True, True, True, False, True, True, True, True, False, False, False]


def _sync(per_rank, cat):
    """What every rank gets back from a gathered sync of ``per_rank``: the plan and the unpacked results."""
    table = torch.tensor([describe(entries, 3, "t") for entries in per_rank])
    plan = make_plan(table, "t", reduce="never", cat=cat)
    # Each rank packs into a send buffer of the transfer size, its padding filled with junk that must never escape.
    packed = [
        pack.pack(entries, plan, rank, torch.full((plan.max_bytes,), 0xA5, dtype=torch.uint8))
        for rank, entries in enumerate(per_rank)
    ]
    rows = torch.stack(packed) if plan.max_bytes else None
    return plan, unpack.unpack(rows, plan, [CPU] * len(cat), cat)


def _entries(rank):
    rng = random.Random(rank)
    gen = torch.Generator().manual_seed(rank)

    def values(*shape, dtype=torch.float32):
        return torch.randint(-99, 99, shape, generator=gen).to(dtype)

    vectors = [values(rng.randint(0, 6)) if rng.random() < 0.8 else values() for _ in range(rng.randint(0, 3))]
    mixed = [values(2, 2), values(3)] if rank % 3 == 0 else [values(rng.randint(1, 3), 2)]
    return [
        vectors,  # 1-d and 0-d float32 items, some ranks without any
        [values(rng.randint(0, 3), 2, 3, dtype=torch.int64) for _ in range(rng.randint(0, 2))],
        values(rank % 5, dtype=torch.float64),  # a `cat` tensor state of uneven length
        [values(rng.randint(0, 9)) for _ in range(rng.randint(1, 2))],  # float32 again: cut out with entry 0
        values(2) + rank,  # dense
        mixed,  # items that do not concatenate on some ranks: per-rank lists
        [],  # no rank has an item
        [torch.empty(0)],  # items, but no data
        values(rank % 3, 4, dtype=torch.int32),  # a 2-d `cat` tensor state, empty (0, 4) on some ranks
        values((rank + 2) % 4),  # not `cat`: per-rank tensors
        [values(1, 2 + rank % 2)],  # not `cat`, trailing dims that differ by rank: per-rank lists
        values(1, 1 + rank % 2),  # the same for a tensor state: per-rank tensors (a `cat` state raises, see below)
    ]


@pytest.mark.parametrize("index", ["int32", "int64", "sections", "default"])
@pytest.mark.parametrize("world", [2, 5, 17, 100])
def test_unpacked_entries_equal_the_ranks_entries(world, index, monkeypatch):
    if index in ("int32", "int64"):
        monkeypatch.setattr(unpack, "SLICE_MAX_SECTIONS", 0)  # the element index, however few the sections
    if index == "int64":
        monkeypatch.setattr(unpack, "INDEX32_ELEMENTS", 0)  # the wide element index of very large buffers
    if index == "sections":
        monkeypatch.setattr(unpack, "SLICE_MIN_AVERAGE", 0)  # the section-by-section cut of large sections
    per_rank = [_entries(rank) for rank in range(world)]
    _, results = _sync(per_rank, CAT)

    def joined(position):
        result = results[position]
        assert isinstance(result, Joined) and result.tensor is not None, result
        return result.tensor

    for position in (0, 1, 3):  # the items of every rank, concatenated as stock does
        expected = dim_zero_cat([item for entries in per_rank for item in entries[position]])
        assert joined(position).dtype == expected.dtype and torch.equal(joined(position), expected), position
    for position in (2, 8):
        expected = torch.cat([entries[position] for entries in per_rank])
        assert joined(position).dtype == expected.dtype and torch.equal(joined(position), expected), position
    assert isinstance(results[4], Stacked) and torch.equal(results[4].tensor, torch.stack([e[4] for e in per_rank]))
    # Rank 0's items do not concatenate: every rank's list comes back as it is.
    assert [[item.tolist() for item in piece] for piece in results[5]] == [
        [item.tolist() for item in entries[5]] for entries in per_rank
    ]
    assert isinstance(results[6], Joined) and results[6].tensor is None
    assert joined(7).shape == (0,) and joined(7).dtype == torch.float32
    for position in (9, 11):
        assert [piece.tolist() for piece in results[position]] == [entries[position].tolist() for entries in per_rank]
    assert [[item.tolist() for item in piece] for piece in results[10]] == [
        [item.tolist() for item in entries[10]] for entries in per_rank
    ]


def test_layout_of_uneven_lists():
    # Three ranks, a joined `cat` list (no shape tables) and a list that is not `cat` (one 56-byte shape row per
    # item, padded to 64), each section aligned to 16 bytes.
    per_rank = [
        [[torch.ones(3)], [torch.ones(1)]],
        [[torch.ones(5), torch.ones(2)], [torch.ones(1)]],
        [[], [torch.ones(1)]],
    ]
    plan, _ = _sync(per_rank, [True, False])
    joined, listed = plan.entries
    assert joined.table_bytes.tolist() == [0, 0, 0] and listed.table_bytes.tolist() == [64, 64, 64]
    assert joined.offsets.tolist() == [0, 0, 0] and listed.offsets.tolist() == [16, 32, 0]
    assert plan.nbytes.tolist() == [96, 112, 80] and plan.max_bytes == 112


def _last_rank_differs(world, usual, last):
    return [usual() if rank < world - 1 else last() for rank in range(world)]


ERROR_CASES = {
    # The first entry in entry order is reported, even when a later one fails an earlier check.
    "dtype before a later kind": (
        lambda: [torch.ones(2), torch.ones(3), torch.ones(1)],
        lambda: [torch.ones(4), torch.ones(3, dtype=torch.int64), [torch.ones(1)]],
        "t: expected `entry 1` to have one dtype on every rank that holds data, but got ['float32', 'int64']."
        " Cast the state to one dtype on every rank.",
    ),
    # Within an entry, the kind is checked before the dtype.
    "kind before dtype": (
        lambda: [torch.ones(2), torch.ones(3)],
        lambda: [torch.ones(2), [torch.ones(3, dtype=torch.int64)]],
        "t: expected `entry 1` to be a tensor on every rank or a list on every rank, but it is a tensor on some ranks"
        " and a list on others. Register the state with the same default on every rank.",
    ),
    "ndim before a later reference": (
        lambda: [torch.ones(2), torch.ones(2), torch.ones(2)],
        lambda: [torch.ones(2, 2), Ref(2), torch.ones(2)],
        "t: expected `entry 0` to have the same number of dimensions on every rank that holds data, but got [1, 2].",
    ),
    # `cat` data that cannot be concatenated: a list's items and a tensor state whose trailing dims differ by rank
    # (ranks without data do not count, as torch.cat skips stock's zero-length vectors for empty ranks).
    "cat list trailing dims": (
        lambda: [torch.ones(2), [torch.ones(4, 3)]],
        lambda: [torch.ones(2), [torch.ones(1, 4), torch.ones(2, 4)]],
        "t: expected `entry 1` (dist_reduce_fx='cat') to have the same shape after the first dimension on every rank"
        " that holds data, since the ranks' data are concatenated along the first dimension, but the ranks differ."
        " Give the state the same trailing dims on every rank.",
    ),
    "cat tensor trailing dims": (
        lambda: [torch.ones(2, 3), torch.ones(0)],
        lambda: [torch.ones(5, 4), torch.ones(0, 7)],
        "t: expected `entry 0` (dist_reduce_fx='cat') to have the same shape after the first dimension on every rank"
        " that holds data, since the ranks' data are concatenated along the first dimension, but the ranks differ."
        " Give the state the same trailing dims on every rank.",
    ),
    "reference to itself": (
        lambda: [torch.ones(2), torch.ones(3)],
        lambda: [torch.ones(3), Ref(1)],
        "t: entry 1 refers to a later entry; this is a torchmetrics_varlen bug.",
    ),
    # Empty ranks need not agree on the dtype, and a 0-d tensor counts as 1-d: the first problem is entry 2's.
    "empty and 0-d ranks agree": (
        lambda: [torch.ones(2), torch.ones(3), torch.ones(2, 2)],
        lambda: [torch.empty(0, dtype=torch.int64), torch.tensor(1.0), torch.ones(2, 3, dtype=torch.float64)],
        "t: expected `entry 2` to have one dtype on every rank that holds data, but got ['float32', 'float64']."
        " Cast the state to one dtype on every rank.",
    ),
}


@pytest.mark.parametrize("world", [2, 20])
@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_first_offending_entry_is_reported(case, world):
    usual, last, message = ERROR_CASES[case]
    per_rank = _last_rank_differs(world, usual, last)
    table = torch.tensor([describe(entries, 3, "t") for entries in per_rank])
    with pytest.raises(SyncMismatchError) as info:
        make_plan(table, "t", cat=[True] * len(per_rank[0]))
    lines = str(info.value).split("\n")
    assert lines[0] == message
    if "refers to" not in message:  # the other messages list what every rank held: shape (or joined shape), dtype
        assert len(lines) == 2 + world and lines[2].startswith("  rank 0: t, ") and "dtype=" in lines[-1]


def test_ranks_without_data_take_the_plan_of_those_with_data():
    # An int64 rank with no data does not decide the dtype; its empty piece takes the others' dtype and trailing dims.
    per_rank = [[torch.empty(0, 3, dtype=torch.int64)], [torch.ones(2, 3)], [torch.ones(1, 3)]]
    plan, results = _sync(per_rank, [False])
    assert plan.entries[0].dtype == torch.float32 and plan.entries[0].empty_shape == (0, 3)
    assert [(tuple(t.shape), t.dtype) for t in results[0]] == [((0, 3), torch.float32)] + [
        (tuple(t.shape), torch.float32) for t in (per_rank[1][0], per_rank[2][0])
    ]


LIST_PROBLEMS = {
    # (the last rank's entries, the words of the message): `describe` checks each item as it checks a tensor state
    "an item that is no tensor": ([torch.ones(2), [torch.ones(1), 3.0]], "a list state holding something that is not"),
    "items of two dtypes": ([torch.ones(2), [torch.ones(1), torch.ones(2, dtype=torch.int64)]], "different dtypes"),
    "a sparse item": ([torch.ones(2), [torch.ones(2), torch.ones(2).to_sparse()]], "non-strided"),
    "an item of too many dims": ([torch.ones(2), [torch.ones((1,) * (record.MAX_NDIM + 1))]], "more than"),
    "a state that is no tensor nor list": ([torch.ones(2), "text"], "not a tensor"),
}


@pytest.mark.parametrize("case", sorted(LIST_PROBLEMS))
def test_a_rank_whose_list_state_cannot_travel_is_named(case):
    last, words = LIST_PROBLEMS[case]
    per_rank = [[torch.ones(2), [torch.ones(3)]], [torch.ones(2), [torch.zeros(0), torch.ones(1)]], last]
    table = torch.tensor([describe(entries, 3, "t") for entries in per_rank])
    with pytest.raises(SyncMismatchError, match="rank 2 holds") as raised:
        make_plan(table, "t", reduce="never", cat=[False, True])
    assert words in str(raised.value) and "in `entry 1`" in str(raised.value)


def test_the_record_of_a_list_state_counts_its_items_and_takes_the_dtype_of_its_data():
    # An empty first item does not set the dtype; a list of empty items only keeps its first item's.
    entries = [[torch.zeros(0), torch.ones(2, 3, dtype=torch.int32), torch.ones(1, 3, dtype=torch.int32)]]
    entries.append([torch.zeros(0, dtype=torch.float64)])
    table = torch.tensor([describe(entries, 3, "t")] * 2)
    plan = make_plan(table, "t", reduce="never", cat=[True, True])
    joined, empty = plan.entries
    assert joined.dtype == torch.int32 and joined.numels.tolist() == [9, 9] and joined.items.tolist() == [3, 3]
    assert empty.dtype is None and record.dtype_of(int(empty.dtype_codes[0])) == torch.float64


def test_the_fast_header_check_passes_exactly_the_tables_the_full_check_passes(monkeypatch):
    # Every sync first asks a few numpy comparisons whether all headers agree; the full check (its torch path, the
    # messages) runs only where they do not. Each field of one rank's header changed alone: both must judge alike.
    from torchmetrics_varlen._engine import mismatch

    base = record.header(record.context_hash("t"), "t", record.FLAG_REDUCE_NEVER, 2, record.HEADER_LEN + 20, 4096)
    changes = {
        "magic": (record.H_MAGIC, [0, record.MAGIC ^ 1]),
        "context": (record.H_CONTEXT, [base[record.H_CONTEXT] + 1]),
        "count": (record.H_N, [3]),
        "differentiable": (record.H_FLAGS, [base[record.H_FLAGS] | record.FLAG_DIFF]),
        "reduce setting": (record.H_FLAGS, [record.FLAG_REDUCE_ALWAYS, 0]),
        "flags that may differ": (record.H_FLAGS, [base[record.H_FLAGS] | record.FLAG_CACHED | record.FLAG_INLINE]),
        "cap": (record.H_CAP, [0, -1, 1 << 20]),
        "error": (record.H_ERROR, [record.ERR_DTYPE]),
        "words": (record.H_WORDS, [record.HEADER_LEN + 90]),
        "label": (record.H_LABEL, [base[record.H_LABEL] + 1]),
    }

    def passes(table, fast):
        with monkeypatch.context() as patched:
            if not fast:
                patched.setattr(mismatch, "_headers_agree", lambda header: False)
            try:
                mismatch.check_headers(table, "t")
            except SyncMismatchError:
                return False
            return True

    judged = 0
    for column, values in changes.values():
        for value in values:
            for changed_rank in range(3):
                rows = [list(base) for _ in range(3)]
                rows[changed_rank][column] = value
                table = torch.tensor(rows)
                full = passes(table, fast=False)
                assert passes(table, fast=True) == full
                assert mismatch._headers_agree(table.numpy()) == full
                judged += not full
    assert judged > 0 and passes(torch.tensor([base] * 3), fast=True)
