"""A repeated small sync (the one fast path): the learnt results are unpack_inline's, and a sync whose metadata
changed on any rank goes the long way on every rank, exact against single-process references."""

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
    meta_words = _protocol.record_words(len(ranks[0]))
    key = (5, "repeat", 0, _protocol.DEFAULT_CAP, None)
    _repeat.learn(key, records[0], ops, cat, "if_graph", table.numpy(), meta_words, plan)
    template = _repeat.lookup(key)
    assert template is not None
    return template, meta_words


@pytest.mark.parametrize("dtypes", DTYPES)
def test_the_learnt_results_are_unpack_inlines(dtypes):
    template, meta_words = _learnt([_entries(dtypes, rank + 1) for rank in range(3)])
    ranks = [_entries(dtypes, 10 - 4 * rank) for rank in range(3)]  # other data, same metadata
    table = _table([_protocol.describe(entries, 5, "repeat", 0, inline=True) for entries in ranks])
    learnt = _repeat.results(template, table.numpy(), meta_words, None, None, "if_graph")
    plan = _plan.make_plan(table, "repeat")
    assert learnt is not None and plan.groups == template.plan.groups and template.plan.inline
    for got, expected in zip(learnt, _buffers.unpack_inline(table, meta_words, plan)):
        assert got.tensor.dtype == expected.tensor.dtype and torch.equal(got.tensor, expected.tensor)


def test_a_table_whose_headers_or_slots_changed_is_not_taken_from_the_template():
    template, meta_words = _learnt([_entries(DTYPES[0], rank + 1) for rank in range(2)])
    same = [_entries(DTYPES[0], 3) for _ in range(2)]
    words = _table([_protocol.describe(e, 5, "repeat", 0, inline=True) for e in same]).numpy()
    assert _repeat.results(template, words, meta_words, None, None, "if_graph")
    # The plan's other inputs are compared too: other ops, `cat` flags or grad mode go the long way.
    assert _repeat.results(template, words, meta_words, [1, 1, 1, 1], None, "if_graph") is None
    assert _repeat.results(template, words, meta_words, None, [True] * 4, "if_graph") is None
    assert _repeat.results(template, words, meta_words, None, None, "always") is None
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
        assert _repeat.results(template, _table(records).numpy(), meta_words, None, None, "if_graph") is None


# ---------------------------------------------------------------------------------------------------- distributed
def _repeated_syncs_body(rank, world_size):
    """Repeated syncs of a metric with a sum and a dense `cat` tensor state; the last rank changes its `cat` length at
    step 3 and back at step 5: exact against the references at every step, and only new tables are planned."""
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

    planned = []
    original = _plan.make_plan

    def counting(*args, **kwargs):
        planned.append(1)
        return original(*args, **kwargs)

    metric = Steps()
    _plan.make_plan = counting
    try:
        for step in range(8):
            metric.update(step)
            planned.clear()
            metric.sync()
            total, seen = metric.total, metric.seen
            metric.unsync()
            totals = [sum(s * (r + 1) for s in range(step + 1)) for r in range(world_size)]
            widths = [5 if r == world_size - 1 and step in (3, 4) else 3 for r in range(world_size)]
            pieces = [torch.arange(w, dtype=torch.float32) + 10 * r + step for r, w in zip(range(world_size), widths)]
            assert total.dtype == torch.int64 and int(total) == sum(totals), (step, total)
            assert torch.equal(seen, dim_zero_cat(pieces)), (step, seen)
            # Every rank plans the first table, and the tables of steps 3 and 4, where the last rank's `cat` state is
            # longer (uneven, so its data travels by the gather and nothing is learnt); at step 5 the learnt table is
            # back and taken from the template.
            assert bool(planned) == (step in (0, 3, 4)), (step, planned)
    finally:
        _plan.make_plan = original
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_per_step_syncs_are_exact_while_a_rank_changes_its_states(world_size):
    run_distributed(_repeated_syncs_body, world_size)
