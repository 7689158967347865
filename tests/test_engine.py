"""The sync engine: all-reduce routing, collective and byte budgets, peer failures, stock result types, warnings."""

import contextlib
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _helpers import count_collectives, describe, engine_runs, forced_policy, split
from conftest import run_distributed
from torchmetrics.classification import BinaryAccuracy, MulticlassConfusionMatrix
from torchmetrics.utilities.data import dim_zero_cat

from torchmetrics_varlen import Metric, SoftF1Loss, SyncPeerError, SyncTimeoutError, rebase
from torchmetrics_varlen._engine import group as _group
from torchmetrics_varlen._engine import plan as _plan
from torchmetrics_varlen._engine import record as _record

_REDUCE_ALWAYS = {"TORCHMETRICS_VARLEN_REDUCE": "always"}


@contextlib.contextmanager
def count_received_bytes():
    """Bytes of the output buffers of this rank's collectives while the block runs (what the rank receives)."""
    received = [0]
    originals = {}

    def nbytes(tensor):
        return tensor.numel() * tensor.element_size()

    sizes = {
        "all_gather_into_tensor": lambda out, *a, **k: nbytes(out),
        "all_gather_single": lambda out, *a, **k: nbytes(out),
        "all_reduce": lambda tensor, *a, **k: nbytes(tensor),
        "broadcast": lambda tensor, *a, **k: nbytes(tensor),
        "gather": lambda tensor, gather_list=None, *a, **k: sum(map(nbytes, gather_list or [])),
        "all_gather": lambda outs, *a, **k: sum(map(nbytes, outs)),
    }
    for name, size in sizes.items():
        if not hasattr(dist, name):
            continue
        originals[name] = fn = getattr(dist, name)

        def wrapper(*args, _fn=fn, _size=size, **kwargs):
            received[0] += _size(*args, **kwargs)
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapper)
    try:
        yield received
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class AllReductions(Metric):
    """Dense states of every reducible kind and dtype, plus a `cat` list (always gathered)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("count", default=torch.zeros(5, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("small_count", default=torch.zeros(2, dtype=torch.int32), dist_reduce_fx="sum")
        self.add_state("flags", default=torch.zeros(3, dtype=torch.bool), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros(3, 2), dist_reduce_fx="sum")
        self.add_state("peak", default=torch.full((4,), -1e4, dtype=torch.float16), dist_reduce_fx="max")
        self.add_state("low", default=torch.full((2,), 10**6, dtype=torch.int32), dist_reduce_fx="min")
        self.add_state("rows", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.count += torch.bincount(x.long() % 5, minlength=5)
        self.small_count += torch.tensor([x.numel(), 1], dtype=torch.int32)
        self.flags |= torch.tensor([x.numel() > 2, x.numel() == 0, True])
        self.total += x.sum() * torch.ones(3, 2)
        if x.numel():
            self.peak = torch.maximum(self.peak, x.max().half().expand(4))
            self.low = torch.minimum(self.low, x.min().int().expand(2))
        self.rows.append(x)

    def compute(self):
        return {name: getattr(self, name) for name in ("count", "small_count", "flags", "total", "peak", "low")}


def body_all_reductions(rank, world_size, sizes):
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 50, (sum(sizes),), generator=gen).float()
    ours = AllReductions()
    ours.update(data[split(sizes, rank)])
    with count_collectives() as counts:
        ours.sync()
    synced = {name: getattr(ours, name) for name in (*ours.compute().keys(), "rows")}
    ours.unsync()
    # Stock's reduction of the per-rank states, computed on one process: every rank's states stacked, then reduced.
    per_rank = []
    for other in range(world_size):
        metric = AllReductions()
        metric.update(data[split(sizes, other)])
        per_rank.append(metric)
    expected = {
        name: AllReductions()._reductions[name](torch.stack([getattr(m, name) for m in per_rank]))
        for name in ("count", "small_count", "flags", "total", "peak", "low")
    }
    expected["rows"] = data
    return {"synced": synced, "expected": expected, "counts": dict(counts)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("env", [None, _REDUCE_ALWAYS], ids=["auto", "always"])
def test_reduced_states_equal_stock_reductions_bit_for_bit(world_size, env):
    sizes = [7, 0, 4][:world_size]
    for result in run_distributed(body_all_reductions, world_size, sizes, env=env):
        for name, expected in result["expected"].items():
            got = result["synced"][name]
            assert isinstance(got, torch.Tensor), (name, got)  # a synced `cat` list is one tensor, as with stock
            assert got.dtype == expected.dtype and got.shape == expected.shape, (name, got, expected)
            assert torch.equal(got, expected), (name, got, expected)  # integers and small float sums: exact
        # always: two reduce groups (sums, integer max/min; float max/min are gathered), but with a `cat` state to
        # gather the budget allows one all-reduce: the largest group; auto: states this small stay in the one gather.
        assert result["counts"].get("all_reduce", 0) == (1 if env else 0), result["counts"]
        assert sum(result["counts"].values()) == (3 if env else 2), result["counts"]


def body_confusion_matrix(rank, world_size, classes, stock):
    gen = torch.Generator().manual_seed(5)
    n = 400
    preds, target = torch.randint(0, classes, (n,), generator=gen), torch.randint(0, classes, (n,), generator=gen)
    cls = MulticlassConfusionMatrix if stock else rebase(MulticlassConfusionMatrix)
    metric = cls(num_classes=classes)
    sizes = [n // world_size] * world_size
    sizes[-1] += n - sum(sizes)
    metric.update(preds[split(sizes, rank)], target[split(sizes, rank)])
    metric.compute()  # warm-up: the group's record length settles
    metric.update(preds[:0], target[:0])
    with count_collectives() as counts, count_received_bytes() as received:
        got = metric.compute()
    single = MulticlassConfusionMatrix(num_classes=classes, sync_on_compute=False)
    single.update(preds, target)
    return {"equal": torch.equal(got, single.compute()), "bytes": received[0], "counts": dict(counts)}


@pytest.mark.parametrize("world_size", [3])
def test_large_sum_state_moves_by_all_reduce_not_gather(world_size):
    classes = 128  # a 128 KiB int64 state: on 3 ranks a gather receives 384 KiB, an all-reduce 128 KiB
    state = classes * classes * 8
    ours = run_distributed(body_confusion_matrix, world_size, classes, False)
    stock = run_distributed(body_confusion_matrix, world_size, classes, True)
    for mine, theirs in zip(ours, stock):
        assert mine["equal"] and theirs["equal"]
        assert sum(mine["counts"].values()) == 2 and mine["counts"]["all_reduce"] == 1, mine["counts"]
        assert mine["bytes"] < 1.2 * state, mine["bytes"]  # O(S), whatever the world size
        assert theirs["bytes"] >= world_size * state  # stock gathers W copies


def body_small_metric_bytes(rank, world_size):
    metric = rebase(BinaryAccuracy)()
    metric.update(torch.tensor([0.2, 0.8, 0.6][: rank + 1]), torch.tensor([0, 1, 1][: rank + 1]))
    with count_collectives() as counts, count_received_bytes() as received:
        metric.compute()
    return {"bytes": received[0], "collectives": sum(counts.values())}


def test_small_metric_whole_sync_is_under_8_kb_on_4_ranks():
    for result in run_distributed(body_small_metric_bytes, 4, fresh=True):
        assert result["collectives"] == 1  # four int64 sums ride in the records: the metadata exchange is the sync
        assert result["bytes"] <= 8 * 1024, result


def _waiting(wait):
    """The real policy's wait on gloo ("block"), or the polling that NCCL gets, forced on gloo."""
    return contextlib.nullcontext() if wait == "block" else forced_policy(wait=wait)


def body_peer_crash(rank, world_size, wait):
    assert _group.REGISTRY.state(None).policy(torch.device("cpu"), None).wait == "block"  # gloo's, unless forced
    metric = rebase(BinaryAccuracy)(sync_timeout=30)
    metric.update(torch.tensor([0.2, 0.8]), torch.tensor([0, 1]))
    before = {name: getattr(metric, name).clone() for name in metric._defaults}
    if rank == world_size - 1:
        dist.destroy_process_group()  # this rank's connections close, as when its process dies
        return None
    try:
        with _waiting(wait):
            metric.compute()
    except SyncPeerError as err:
        after = {name: getattr(metric, name) for name in metric._defaults}
        intact = all(torch.equal(before[name], after[name]) for name in before) and not metric._is_synced
        return {"message": str(err), "cause": type(err.__cause__).__name__, "intact": intact}
    return {"message": "no error"}


@pytest.mark.parametrize("wait", ["block", "poll"])
def test_crashed_peer_is_reported_as_such_and_states_stay_local(wait):
    for rank, result in enumerate(run_distributed(body_peer_crash, 3, wait, fresh=True, deadline=60)):
        if rank == 2:
            continue
        assert "lost a peer during the sync" in result["message"], result
        assert result["cause"] == "RuntimeError" and result["intact"]


class CatAndMean(Metric):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("values", default=[], dist_reduce_fx="cat")
        self.add_state("avg", default=torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, x):
        self.values.append(x)
        self.avg = x.float().mean()

    def compute(self):
        return dim_zero_cat(self.values).sum()


def body_cat_type_and_mean_warning(rank, world_size, updates):
    metric = CatAndMean()
    for step in range(updates[rank]):
        metric.update(torch.arange(3) + 10 * rank + step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metric.sync()
        synced = metric.values
        metric.unsync()
        metric.compute()
    mean_warnings = [str(w.message) for w in caught if "dist_reduce_fx='mean'" in str(w.message)]
    expected = torch.cat([torch.arange(3) + 10 * r + s for r in range(world_size) for s in range(updates[r])])
    return {"type": type(synced).__name__, "equal": torch.equal(synced, expected), "warnings": mean_warnings}


@pytest.mark.parametrize("world_size", [2, 3])
def test_synced_cat_list_is_one_tensor_and_mean_of_means_warns_once(world_size):
    uneven = run_distributed(body_cat_type_and_mean_warning, world_size, [2, 1, 3][:world_size])
    even = run_distributed(body_cat_type_and_mean_warning, world_size, [2] * world_size)
    for result in uneven + even:
        assert result["type"] == "Tensor" and result["equal"]
    for result in uneven:  # sync() and compute() both sync: one warning, naming the state and the fix
        assert len(result["warnings"]) == 1, result["warnings"]
        assert "`avg` of CatAndMean" in result["warnings"][0] and "sum state and a count state" in result["warnings"][0]
    assert all(not result["warnings"] for result in even)


def body_soft_f1_collectives(rank, world_size):
    torch.manual_seed(rank)
    probs = torch.rand(3 + rank, requires_grad=True)
    target = (torch.rand(3 + rank) > 0.5).long()
    loss_fn = SoftF1Loss()
    with count_collectives() as forward:
        loss = loss_fn(probs, target)
    with count_collectives() as backward:
        loss.backward()
    with torch.no_grad():  # validation: states without a graph
        loss_fn.update(probs, target)
    epoch = loss_fn.compute()  # grad mode is on here, as in a training loop's epoch end
    return {
        "forward": dict(forward),
        "backward": dict(backward),
        "epoch_requires_grad": epoch.requires_grad,
        "grad_finite": bool(probs.grad.isfinite().all()),
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("env", [None, _REDUCE_ALWAYS], ids=["auto", "always"])
def test_soft_f1_loss_is_coalesced_and_epoch_values_carry_no_graph(world_size, env):
    for result in run_distributed(body_soft_f1_collectives, world_size, env=env):
        assert sum(result["forward"].values()) <= 2, result["forward"]
        assert result["backward"] == {"all_reduce": 1}, result["backward"]
        assert result["grad_finite"]
        assert not result["epoch_requires_grad"]


class SquaredSum(Metric):
    """A loss over a `cat` state: sum of squares of every rank's values."""

    def __init__(self, sync_grads=True, **kwargs):
        super().__init__(dist_sync_on_step=True, sync_grads=sync_grads, **kwargs)
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.values.append(x)

    def compute(self):
        return (dim_zero_cat(self.values) ** 2).sum() if len(self.values) else torch.tensor(0.0)


def body_cat_gradients(rank, world_size, sizes, sync_grads=True):
    x = torch.linspace(-1, 1, sizes[rank], dtype=torch.float64).requires_grad_(True)
    with count_collectives() as counts:
        loss = SquaredSum(sync_grads=sync_grads)(x)
        loss.backward()
    return {"grad": x.grad, "x": x.detach(), "counts": dict(counts)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_cat_state_gradients_are_exact(world_size):
    # Every rank's loss is the global sum of squares; summed over ranks the gradient of x is W * 2x (DDP's mean
    # then gives the single-process gradient 2x).
    for result in run_distributed(body_cat_gradients, world_size, [4, 0, 3][:world_size]):
        torch.testing.assert_close(result["grad"], world_size * 2 * result["x"], rtol=0, atol=1e-12)
        assert sum(result["counts"].values()) == 3, result["counts"]  # metadata + gather; backward all-reduce


def test_int64_sums_split_into_float64_halves_are_bit_identical():
    # In process: what an all-reduce of the encoded halves gives (their float64 sum) decodes to torch.sum's int64
    # result, extreme values and wrap-around included.
    from torchmetrics_varlen._engine.pack import _encode
    from torchmetrics_varlen._engine.plan import ENC_INVERT, ENC_SPLIT
    from torchmetrics_varlen._engine.unpack import _decode

    info = torch.iinfo(torch.int64)
    ranks = [
        torch.tensor([info.max, 2**53 + 1, -7, 0, info.min]),
        torch.tensor([1, 2**53 + 1, -(2**40), 5, -1]),
        torch.tensor([info.max, 3, 2**62, -(2**33) - 1, info.min]),
    ]
    encoded = sum(_encode(r, ENC_SPLIT, torch.float64, torch.device("cpu")) for r in ranks)
    assert torch.equal(_decode(encoded, ENC_SPLIT), torch.stack(ranks).sum(0))
    inverted = torch.stack([_encode(r, ENC_INVERT, torch.int64, torch.device("cpu")) for r in ranks]).max(0).values
    assert torch.equal(_decode(inverted, ENC_INVERT), torch.stack(ranks).min(0).values)


def body_late_and_missing(rank, world_size, wait):
    import time

    metric = rebase(BinaryAccuracy)(sync_timeout=10)
    metric.update(torch.tensor([0.9, 0.2]), torch.tensor([1, rank % 2]))
    if rank == world_size - 1:
        time.sleep(3)  # late by less than the sync timeout: nobody may fail
    with _waiting(wait):
        value = metric.compute()
    metric.update(torch.tensor([0.7]), torch.tensor([1]))
    before = {name: getattr(metric, name).clone() for name in metric._defaults}
    if rank == world_size - 1:
        return {"value": value}  # never arrives at the second sync
    metric.sync_timeout = 2
    try:
        with _waiting(wait):
            metric.compute()
    except SyncTimeoutError as err:
        intact = all(torch.equal(before[name], getattr(metric, name)) for name in before) and not metric._is_synced
        return {"value": value, "error": str(err), "intact": intact}
    return {"value": value, "error": None}


@pytest.mark.parametrize("wait", ["block", "poll"])
def test_late_rank_is_waited_for_and_missing_rank_is_named_with_states_intact(wait):
    results = run_distributed(body_late_and_missing, 2, wait, fresh=True, deadline=60)
    single = BinaryAccuracy()
    single.update(torch.tensor([0.9, 0.2, 0.9, 0.2]), torch.tensor([1, 0, 1, 1]))
    for rank, result in enumerate(results):
        assert torch.equal(result["value"], single.compute())
        if rank == 0:
            assert "Missing: ranks [1]" in result["error"] and result["intact"], result


@pytest.mark.parametrize("world_size", [2, 3])
def test_cat_state_keeps_the_rank_local_graph_without_sync_grads(world_size):
    # As stock: this rank's section of the joined state is its own tensor, so the gradient is the local one, 2x.
    for result in run_distributed(body_cat_gradients, world_size, [4, 0, 3][:world_size], False):
        if result["x"].numel():
            torch.testing.assert_close(result["grad"], 2 * result["x"], rtol=0, atol=1e-12)
        assert sum(result["counts"].values()) == 2, result["counts"]  # no backward collective


@pytest.mark.parametrize("world", [8, 256, 1024])
@pytest.mark.parametrize("with_cat", [True, False])
def test_collective_budget_whatever_the_states(world, with_cat):
    # In process, from the plan: sum, mean and max states large enough to be all-reduced on many ranks, with or
    # without `cat` lists to gather: at most 3 collectives (metadata + gather + 1 all-reduce, or metadata + 2).
    def entries(rank):
        dense = [torch.zeros(64), torch.zeros(64, dtype=torch.int64), torch.zeros(64), torch.zeros(32)]
        lists = [[torch.ones(rank % 5 + 1)] for _ in range(3)] if with_cat else []
        return lists + dense

    ops = [_plan.OP_NONE] * (3 if with_cat else 0) + [
        _plan.OP_SUM,
        _plan.OP_SUM,
        _plan.OP_MEAN,
        _plan.OP_MAX,
    ]
    cat = [True] * (3 if with_cat else 0) + [False] * 4
    table = torch.tensor([describe(entries(rank), 7, "budget") for rank in range(world)])
    plan = _plan.make_plan(table, "budget", ops, cat=cat)
    collectives = 1 + (plan.max_bytes > 0) + len(plan.reduce_groups)
    assert collectives <= 3, (collectives, [group.op for group in plan.reduce_groups], plan.max_bytes)
    if world >= 256:
        assert plan.reduce_groups  # on many ranks the sums do go by all-reduce


class ManySums(Metric):
    """40 scalar sum states: a record of 270 words, longer than a group's first record length."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for i in range(40):
            self.add_state(f"s{i}", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x):
        for i in range(40):
            setattr(self, f"s{i}", getattr(self, f"s{i}") + x.sum() * (i + 1))

    def compute(self):
        return torch.stack([getattr(self, f"s{i}") for i in range(40)])


def body_record_lengths(rank, world_size):

    group = dist.new_group()  # a group of its own: its record length starts at the first one
    small = rebase(BinaryAccuracy)(process_group=group)
    small.update(torch.tensor([0.9, 0.2, 0.7][: rank + 1]), torch.tensor([1, 0, 0][: rank + 1]))
    wide = ManySums(process_group=group)
    wide.update(torch.arange(rank + 2, dtype=torch.float32))
    log = []

    def sync(metric):
        metric._computed = None
        with count_collectives() as counts, count_received_bytes() as received:
            value = metric.compute()
        log.append((type(metric).__name__, sum(counts.values()), received[0]))
        return value

    values = {"small": sync(small), "wide": sync(wide)}  # syncs 1 and 2
    # The window of syncs 1-64 holds the wide one, so the length stays until the next window ends, after sync 128.
    for _ in range(2 * _group.RECORD_WINDOW - 1):  # syncs 3 .. 129
        sync(small)
    sync(wide)  # after the window: the length shrank, the wide record needs a second exchange again
    lengths = {"first": _group.INITIAL_WORDS, "least": _group.MIN_WORDS, "window": _group.RECORD_WINDOW}
    return {"log": log, "values": values, **lengths}


@pytest.mark.parametrize("world_size", [2, 3])
def test_records_are_sized_to_the_sync_and_shrink_after_a_window(world_size):
    results = run_distributed(body_record_lengths, world_size)
    single_small, single_wide = BinaryAccuracy(), ManySums()
    for rank in range(world_size):
        single_small.update(torch.tensor([0.9, 0.2, 0.7][: rank + 1]), torch.tensor([1, 0, 0][: rank + 1]))
        single_wide.update(torch.arange(rank + 2, dtype=torch.float32))
    wide_bytes = (_record.HEADER_LEN + 40 * 6 + 20) * 8  # header, slots, and 40 float32 sums riding in 20 words
    for result in results:
        first, least = result["first"] * 8, result["least"] * 8
        assert torch.equal(result["values"]["small"], single_small.compute())
        torch.testing.assert_close(result["values"]["wide"], single_wide.compute())
        log = result["log"]
        assert log[0] == ("BinaryAccuracy", 1, world_size * first)  # one exchange at the first length is the sync
        assert log[1] == ("ManySums", 2, world_size * (first + wide_bytes))  # a second exchange at the longest length
        assert log[2] == ("BinaryAccuracy", 1, world_size * wide_bytes)  # the group keeps the longer length ...
        assert log[2 * result["window"] - 1] == log[2]  # ... through the window after the one that needed it ...
        assert log[-2] == ("BinaryAccuracy", 1, world_size * least)  # ... then shrinks to what the window needed
        assert log[-1] == ("ManySums", 2, world_size * (least + wide_bytes))


def test_docs_state_the_record_lengths_that_travel():
    # The pages that size records in bytes must give the lengths that the test above measures on the wire.
    first, least = f"{_group.INITIAL_WORDS * 8:,}", f"{_group.MIN_WORDS * 8:,}"
    docs = Path(__file__).resolve().parents[1] / "docs"
    for page in ("scale.rst", "how_the_sync_works.rst"):
        text = " ".join((docs / page).read_text().split())
        assert re.findall(r"room for 30 \w+ at first \(([\d,]+) bytes\)", text) == [first], page
        assert re.findall(r"not below ([\d,]+) bytes \(room for 8 \w+\)", text) == [least], page
    text = " ".join((docs / "logged_scalars.rst").read_text().split())
    assert re.findall(r"\(([\d,]+) bytes at first\)", text) == [first, first]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),  # the conjugate bit, which numpy cannot read
        torch._neg_view(torch.tensor([1.0, -2.0])),  # the negative bit
        torch.arange(6.0).reshape(2, 3).T,  # not contiguous
        torch.tensor(7, dtype=torch.int16).expand(3),  # stride 0
        torch.tensor([1.5, -2.25], dtype=torch.bfloat16),  # no numpy dtype
        torch.tensor([0.5, 1.0], requires_grad=True) * 2,  # carries a graph
        torch.tensor(True),
    ],
)
def test_inline_data_is_the_tensor_in_row_major_order(tensor):
    record = describe([tensor], 1, "inline", inline=True)
    assert record[_record.H_FLAGS] & _record.FLAG_INLINE
    data = torch.tensor(record[_record.record_words(1) :], dtype=torch.int64).view(torch.uint8)
    expected = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(data[: expected.numel()], expected)
    assert not data[expected.numel() :].any()  # the padding to 16 bytes is zeros


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.int64),
        (torch.bool, torch.float16, torch.complex64, torch.int8),
        (torch.bfloat16, torch.float32),  # numpy has no bfloat16: the tensor way
    ],
)
def test_inline_results_are_every_ranks_states_stacked(dtypes):
    from torchmetrics_varlen._engine import unpack

    shapes = [(), (3,), (2, 2), (1,)]
    ranks = [
        [(torch.arange(math.prod(s)) * (rank + 1) - 2).reshape(s).to(d) for s, d in zip(shapes, dtypes)]
        for rank in range(3)
    ]
    records = [describe(entries, 5, "inline", inline=True) for entries in ranks]
    words = max(map(len, records)) + 6  # the group's agreed length: zeros after each record
    table = torch.tensor([record + [0] * (words - len(record)) for record in records])
    plan = _plan.make_plan(table, "inline")
    assert plan.inline
    meta_words = _record.record_words(len(dtypes))
    rows = table[:, meta_words:].contiguous().view(torch.uint8)  # every rank's data bytes, after header and slots
    blocks = unpack.unpack_inline(rows, plan)  # one [world_size, elements] block per dense group (one per dtype)
    for group, block in blocks:
        expected = torch.stack([torch.cat([entries[i].reshape(-1) for i in group.indices]) for entries in ranks])
        assert block.dtype == expected.dtype and torch.equal(block, expected), (group, block)
    assert sorted(i for group, _ in blocks for i in group.indices) == list(range(len(dtypes)))
    results = unpack.stacked(plan, blocks)
    for index, result in enumerate(results):
        expected = torch.stack([entries[index] for entries in ranks])
        assert result.tensor.dtype == expected.dtype and torch.equal(result.tensor, expected), (index, result)


# ------------------------------------------------------------------- an agreement beside another sync (issue 45)
def body_agreement_beside_a_sync(rank, world_size, which):
    """Rank 0 runs a standalone agreement (a checkpoint's load check) while the others sync a metric."""
    from torchmetrics_varlen import SyncMismatchError, _engine
    from torchmetrics_varlen._engine.group import link

    metric = rebase(BinaryAccuracy)()
    metric.update(torch.tensor([0.9, 0.2]), torch.tensor([1, 0]))
    try:
        if rank == 0:
            sync_link = link(None, torch.device("cpu"), 30, "test")
            _engine.agree([1, 2, 3][:which], sync_link, "a load check")
        else:
            metric.compute()
    except SyncMismatchError as err:
        return str(err)
    return None


@pytest.mark.parametrize("which", [1, 3])
def test_an_agreement_beside_another_sync_is_a_named_error_on_every_rank(which):
    # A bare all-gather of a few words beside a sync's record exchange made gloo abort the process ("Received data
    # size doesn't match expected size"): an agreement outside a sync travels as a record, so every rank raises.
    for rank, message in enumerate(run_distributed(body_agreement_beside_a_sync, 2, which, fresh=True, deadline=60)):
        assert message is not None and "different things" in message, (rank, message)


def body_one_entry_point(rank, world_size):
    """Counts the calls of ``_engine.run``, looked up at call time, through a rebased metric's and the hook's syncs."""
    from torchmetrics_varlen import gather_all_tensors

    calls = []
    with engine_runs(lambda request, link: calls.append(link.what)):
        metric = rebase(BinaryAccuracy)()
        metric.update(torch.rand(3 + rank), torch.randint(0, 2, (3 + rank,)))
        metric.compute()
        after_compute = len(calls)
        metric.compute()  # the cached value: still one sync (only the records move)
        after_cached = len(calls)
        gather_all_tensors(torch.arange(rank + 1))
        return after_compute, after_cached, len(calls)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_sync_enters_the_engine_through_run_once(world_size):
    """``_engine.run`` is the one blocking entry point: each compute() and each hook call reaches it exactly once."""
    for after_compute, after_cached, after_hook in run_distributed(body_one_entry_point, world_size):
        if world_size == 1:  # no sync at all on one rank, as with stock
            assert (after_compute, after_cached, after_hook) == (0, 0, 0)
        else:
            assert (after_compute, after_cached, after_hook) == (1, 2, 3)
