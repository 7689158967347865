"""The one fast path (``_repeat``): a repeated small sync sends what the long way sends, takes the learnt plan only
for the learnt table, and hands off to the long way otherwise, exact against single-process references."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from _helpers import fast_path_taken
from conftest import run_distributed
from torchmetrics.classification import BinaryAccuracy
from torchmetrics.utilities.data import dim_zero_cat

from torchmetrics_varlen import _device_record, _plan, _repeat, _transport, rebase


def _sent_records(metric, syncs, fast):
    """The records ``metric``'s ``syncs`` syncs sent (each as a list of words), with the fast path on or off."""
    sent = []
    original = _transport.exchange_records

    def recording(record, *args):
        sent.append(list(record))
        return original(record, *args)

    _transport.exchange_records, enabled, _repeat.ENABLED = recording, _repeat.ENABLED, fast
    try:
        for _ in range(syncs):
            metric.sync()
            metric.unsync()
    finally:
        _transport.exchange_records, _repeat.ENABLED = original, enabled
    return sent


def _same_bytes_body(rank, world_size, device_record):
    """The fast path's records are the long way's, byte for byte, for host and (forced onto the CPU) device records."""
    _device_record.ON_THE_CPU_TOO = device_record
    try:
        metric = rebase(BinaryAccuracy)()
        metric.update(torch.rand(7 + rank), torch.randint(0, 2, (7 + rank,)))
        with fast_path_taken() as taken:
            fast = _sent_records(metric, 3, fast=True)
        long_way = _sent_records(metric, 3, fast=False)
    finally:
        _device_record.ON_THE_CPU_TOO = False
    assert taken == [True, True], taken  # the first sync learnt, the next two took the fast path
    assert fast == long_way, (fast, long_way)
    stock = BinaryAccuracy(sync_on_compute=False)
    torch.manual_seed(0)
    metric.reset()
    for other in range(world_size):
        preds, target = torch.rand(9 + other), torch.randint(0, 2, (9 + other,))
        stock.update(preds, target)
        if other == rank:
            metric.update(preds, target)
    for _ in range(3):  # learnt, then the fast path: stock on all the data each time
        metric._computed = None
        assert torch.equal(metric.compute(), stock.compute())
    dist.barrier()


@pytest.mark.parametrize("device_record", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_fast_path_sends_the_long_ways_bytes_and_equals_stock(world_size, device_record):
    run_distributed(_same_bytes_body, world_size, device_record)


class _Group:  # a stand-in process group: the guard only holds it weakly and compares identity
    pass


def _template(group, states, settings):
    template = _repeat.Template(
        classes=_CLASSES,
        group=weakref.ref(group),
        settings=settings,
        states=tuple((state.dtype, state.shape) for state in states),
        device=torch.device("cpu"),
        device_record=False,
        prefix=[],
        inline=([], 0),
        table=b"",
        plan=None,
    )
    _repeat._keep((id(_CLASSES), "label", id(group)), template)
    return template


_CLASSES = object()


def test_the_guard_takes_the_template_only_for_the_learnt_facts():
    group = _Group()
    states = [torch.zeros(3), torch.zeros((), dtype=torch.int64)]
    settings = ("policy", 1 << 20)  # compared for equality only
    template = _template(group, states, settings)
    assert _repeat.lookup(_CLASSES, "label", group, lambda: settings, states) is template
    changed = [
        [torch.zeros(3, dtype=torch.float64), states[1]],  # a dtype
        [torch.zeros(4), states[1]],  # a shape
        [torch.zeros(3, requires_grad=True), states[1]],  # a graph
        [torch.zeros(3).to_sparse(), states[1]],  # a layout
        [states[0], states[0]],  # one object twice (it would travel as a Ref)
        [[1.0, 2.0], states[1]],  # not a tensor
    ]
    for other in changed:
        assert _repeat.lookup(_CLASSES, "label", group, lambda: settings, other) is None, other
    assert _repeat.lookup(_CLASSES, "other label", group, lambda: settings, states) is None
    assert _repeat.lookup(_CLASSES, "label", _Group(), lambda: settings, states) is None
    assert _repeat.lookup(_CLASSES, "label", group, lambda: (settings[0], 1 << 21), states) is None  # another cap
    assert _repeat.lookup(object(), "label", group, lambda: settings, states) is None


def test_a_destroyed_groups_template_is_never_taken():
    group = _Group()
    states = [torch.zeros(2)]
    settings = ("policy", 1)
    template = _template(group, states, settings)
    del group
    gc.collect()
    assert template.group() is None  # a group made later, even at the same address, is not the learnt one
    assert all(_repeat.lookup(_CLASSES, "label", _Group(), lambda: settings, states) is None for _ in range(50))


def test_the_fast_path_switched_off_takes_nothing():
    group = _Group()
    states = [torch.zeros(2)]
    _template(group, states, ("policy", 1))
    enabled, _repeat.ENABLED = _repeat.ENABLED, False
    try:
        assert _repeat.lookup(_CLASSES, "label", group, lambda: ("policy", 1), states) is None
    finally:
        _repeat.ENABLED = enabled


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
