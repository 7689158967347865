"""A repeated small sync: the learnt record is describe's, the learnt results are unpack_inline's, and a sync whose
metadata changed on any rank goes the long way on every rank, exact against single-process references."""

import math

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torchmetrics.utilities.data import dim_zero_cat

from torchmetrics_varlen import _buffers, _plan, _protocol, _repeat

SHAPES = [(), (3,), (2, 2), (1,)]
DTYPES = [
    (torch.int64, torch.int64, torch.int64, torch.int64),
    (torch.float32, torch.int64, torch.bool, torch.float16),
    (torch.complex64, torch.int8, torch.float64, torch.int32),
]


def _entries(dtypes, scale):
    return [(torch.arange(math.prod(s)) * scale - 2).reshape(s).to(d) for s, d in zip(SHAPES, dtypes)]


def _table(records):
    words = max(map(len, records)) + 6  # the group's agreed length: zeros after each record
    return torch.tensor([list(record) + [0] * (words - len(record)) for record in records])


def _learnt(ranks, aux=None, ops=None, cat=None):
    """A template learnt from the sync of ``ranks`` (rank 0's view), and that sync's table."""
    records = [_protocol.describe(entries, 5, "repeat", 0, aux, inline=True) for entries in ranks]
    table = _table(records)
    plan = _plan.make_plan(table, "repeat", ops)
    assert plan.inline
    described = _protocol.record_words(len(ranks[0]))
    key = (5, "repeat", 0, _protocol.DEFAULT_CAP, None)
    _repeat.learn(key, ranks[0], records[0], aux, ops, cat, "if_graph", table.numpy(), described, plan)
    template = _repeat.lookup(key)
    assert template is not None
    return template, described


@pytest.mark.parametrize("dtypes", DTYPES)
def test_the_learnt_record_is_the_one_describe_makes(dtypes):
    template, _ = _learnt([_entries(dtypes, rank + 1) for rank in range(2)], aux=[0, 3, 0, 1])
    for scale in (5, -7):  # other data, same metadata
        entries = _entries(dtypes, scale)
        entries[1] = entries[1].expand(2, 3)[1]  # a view: the bytes are read in row-major order
        expected = _protocol.describe(entries, 5, "repeat", 0, [0, 3, 0, 1], inline=True)
        assert list(_repeat.record(template, entries, [0, 3, 0, 1], None, None, "if_graph")) == expected


def test_a_record_that_the_template_does_not_fit_is_made_by_describe():
    template, _ = _learnt([_entries(DTYPES[1], rank + 1) for rank in range(2)], aux=[0, 0, 0, 0])
    entries = _entries(DTYPES[1], 2)
    args = ([0, 0, 0, 0], None, None, "if_graph")
    assert _repeat.record(template, entries, *args) is not None
    changed = [
        [entries[0].double(), *entries[1:]],  # another dtype
        [entries[0], torch.zeros(4), *entries[2:]],  # another shape
        [*entries[:3], [entries[3]]],  # a list
        [entries[0], entries[1].to_sparse(), *entries[2:]],  # not strided
        entries[:3],  # fewer entries
    ]
    for other in changed:
        assert _repeat.record(template, other, *args) is None
    assert _repeat.record(template, entries, [0, 1, 0, 0], None, None, "if_graph") is None  # other aux words
    assert _repeat.record(template, entries, [0, 0, 0, 0], [1, 1, 1, 1], None, "if_graph") is None  # other ops
    assert _repeat.record(template, entries, [0, 0, 0, 0], None, None, "always") is None  # another grad mode


@pytest.mark.parametrize("dtypes", DTYPES)
def test_the_learnt_results_are_unpack_inlines(dtypes):
    template, described = _learnt([_entries(dtypes, rank + 1) for rank in range(3)])
    ranks = [_entries(dtypes, 10 - 4 * rank) for rank in range(3)]  # other data, same metadata
    table = _table([_protocol.describe(entries, 5, "repeat", 0, inline=True) for entries in ranks])
    learnt = _repeat.results(template, table.numpy(), described)
    plan = _plan.make_plan(table, "repeat")
    assert learnt is not None and plan.groups == template.plan.groups and template.plan.inline
    for got, expected in zip(learnt, _buffers.unpack_inline(table, described, plan)):
        assert got.tensor.dtype == expected.tensor.dtype and torch.equal(got.tensor, expected.tensor)


def test_a_table_whose_headers_or_slots_changed_is_not_taken_from_the_template():
    template, described = _learnt([_entries(DTYPES[0], rank + 1) for rank in range(2)])
    same = [_entries(DTYPES[0], 3) for _ in range(2)]
    assert _repeat.results(
        template, _table([_protocol.describe(e, 5, "repeat", 0, inline=True) for e in same]).numpy(), described
    )
    others = [
        [
            _protocol.describe(same[0], 5, "repeat", 0, inline=True),
            _protocol.describe(same[1], 6, "repeat", 0, inline=True),
        ],
        [
            _protocol.describe(same[0], 5, "repeat", 0, inline=True),
            _protocol.describe(same[1], 5, "other", 0, inline=True),
        ],
        [
            _protocol.describe(same[0], 5, "repeat", 0, inline=True),
            _protocol.describe(same[1], 5, "repeat", 0, [0, 0, 7, 0], inline=True),
        ],
        [_protocol.describe(e, 5, "repeat", 0, inline=True) for e in [same[0], same[1], same[0]]],  # three ranks
    ]
    for records in others:
        assert _repeat.results(template, _table(records).numpy(), described) is None


# ---------------------------------------------------------------------------------------------------- distributed
def _repeated_syncs_body(rank, world_size):
    """Repeated syncs of a metric with a sum and a dense `cat` tensor state; the last rank changes its `cat` length at
    step 3 and back at step 5: exact against the references at every step, and only new metadata is described."""
    from torchmetrics_varlen import Metric

    class Steps(Metric):
        def __init__(self):
            super().__init__()
            self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")
            self.add_state("seen", default=torch.zeros(3), dist_reduce_fx="cat")

        def update(self, step):
            self.total = self.total + step * (rank + 1)
            width = 5 if rank == world_size - 1 and step in (3, 4) else 3
            self.seen = torch.arange(width, dtype=torch.float32) + 10 * rank + step

        def compute(self):
            return self.total, self.seen

    described = []
    original = _protocol.describe

    def counting(*args, **kwargs):
        described.append(1)
        return original(*args, **kwargs)

    metric = Steps()
    _protocol.describe = counting
    try:
        for step in range(8):
            metric.update(step)
            described.clear()
            metric.sync()
            total, seen = metric.total, metric.seen
            metric.unsync()
            totals = [sum(s * (r + 1) for s in range(step + 1)) for r in range(world_size)]
            widths = [5 if r == world_size - 1 and step in (3, 4) else 3 for r in range(world_size)]
            pieces = [torch.arange(w, dtype=torch.float32) + 10 * r + step for r, w in zip(range(world_size), widths)]
            assert total.dtype == torch.int64 and int(total) == sum(totals), (step, total)
            assert torch.equal(seen, dim_zero_cat(pieces)), (step, seen)
            # Only the last rank's record is new at steps 3 and 4 (the others' records come from the template, and
            # every rank then plans from the table); at step 5 the metadata is the learnt one again on every rank.
            if step > 0:
                assert bool(described) == (rank == world_size - 1 and step in (3, 4)), (step, described)
    finally:
        _protocol.describe = original
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_per_step_syncs_are_exact_while_a_rank_changes_its_states(world_size):
    run_distributed(_repeated_syncs_body, world_size)
