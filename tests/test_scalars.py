"""ScalarLog and sync_scalars against one process's torchmetrics aggregators fed every rank's updates in rank order."""

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from _meters import CollectiveCounter
from conftest import run_distributed
from torchmetrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric

from torchmetrics_varlen import ScalarLog, SyncMismatchError, SyncTimeoutError, sync_scalars

AGGREGATORS = {"mean": MeanMetric, "sum": SumMetric, "max": MaxMetric, "min": MinMetric}
REDUCE = {"tokens": "sum", "grad_max": "max", "lr_min": "min", "only_r1": "sum"}
INF = math.inf


def updates_of(rank, world_size, window=0):
    """A rank's updates: keys on some ranks only, the last rank of 2+ empty, weights of 0, NaN and infinities."""
    if world_size > 1 and rank == world_size - 1:
        return []
    out = []
    for step in range(3 + rank):
        x = 0.1 * (rank + 1) + 0.37 * step + window
        values = {"loss": torch.tensor(x, dtype=torch.float32), "tokens": 10 * step + rank, "grad_max": x * 3}
        values["lr_min"] = torch.tensor(1.0 / (step + 1), dtype=torch.float64)
        if rank == 0:
            values[f"task{step % 2}"] = x - 1  # keys that differ between updates and windows
            values["edge"] = [math.nan, INF, -INF, 2.0, math.nan][step % 5]
        if rank == 1:
            values["only_r1"] = float(step)
            values["weight0"] = 5.0  # its only weight is 0: 0 / 0
        weight = {"loss": step + rank + 1, "weight0": 0, "edge": [1, 1, 1, 0, 2][step % 5]}
        out.append((values, weight))
    return out


def reference(world_size, nan_strategy="warn", window=0):
    """One process, torchmetrics' aggregators per key in float64, every rank's updates in rank order."""
    metrics = {}
    for rank in range(world_size):
        for values, weight in updates_of(rank, world_size, window):
            for key, value in values.items():
                kind = REDUCE.get(key, "mean")
                if key not in metrics:
                    metrics[key] = AGGREGATORS[kind](nan_strategy=nan_strategy).set_dtype(torch.float64)
                value = torch.as_tensor(value, dtype=torch.float64)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if kind == "mean":
                        metrics[key].update(value, torch.tensor(float(weight.get(key, 1)), dtype=torch.float64))
                    else:
                        metrics[key].update(value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {key: metric.compute().item() for key, metric in metrics.items()}


def assert_matches(got, expected):
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for key, value in expected.items():
        assert isinstance(got[key], float)
        assert (
            math.isclose(got[key], value, rel_tol=1e-12)
            or (math.isnan(value) and math.isnan(got[key]))
            or got[key] == value
        ), (key, got[key], value)


def body_windows(rank, world_size, nan_strategy):
    log = ScalarLog(reduce=REDUCE, nan_strategy=nan_strategy, sync_timeout=60)
    results = []
    for window in range(3):
        for values, weight in updates_of(rank, world_size, window):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                log.update(values, weight)
        with CollectiveCounter() as counter:
            computed = log.compute()
        with CollectiveCounter() as again_counter:
            again = log.compute()  # every rank computes again: one collective, the same values
        same = list(again) == list(computed) and all(
            a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(again.values(), computed.values())
        )
        results.append({"values": computed, "collectives": counter.count, "cached": (same, again_counter.count)})
        log.reset()
    one_shot = sync_scalars({"loss": float(rank)}, weight=rank, reduce="mean")
    return {"windows": results, "one_shot": one_shot["loss"]}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("nan_strategy", ["warn", 7.5])
def test_scalar_log_matches_one_process(world_size, nan_strategy):
    for result in run_distributed(body_windows, world_size, nan_strategy, deadline=90):
        for window, got in enumerate(result["windows"]):
            assert_matches(got["values"], reference(world_size, nan_strategy, window))
            # Issue 43 item 1: a rank without updates takes part in the sync (none in a group of one).
            assert got["cached"] == (True, int(world_size > 1))
            # First window: new keys, one more exchange; afterwards the agreed layout: one collective per compute.
            expected = (0,) if world_size == 1 else (1, 2) if window == 0 else (1,)
            assert got["collectives"] in expected, got["collectives"]
        total_weight = sum(range(world_size))
        if total_weight:
            assert result["one_shot"] == pytest.approx(sum(r * r for r in range(world_size)) / total_weight)
        else:  # rank 0 alone, with weight 0: 0 / 0, as MeanMetric gives
            assert math.isnan(result["one_shot"])


WINDOWS = [range(500), range(500), range(2000, 4000), range(2000, 4000)]


def body_many_keys(rank, world_size):
    """500 keys per rank, half of them this rank's own; a later window brings 2,000 keys no rank had."""
    log = ScalarLog(reduce={f"s{i}": "sum" for i in range(4000)}, sync_timeout=60)
    counts, results = [], []
    for keys in WINDOWS:
        for i in keys:
            key = f"s{i}" if i % 2 else f"m{i}_{rank}"
            log.update({key: float(i * (rank + 1))}, weight=rank + 1)
        with CollectiveCounter() as counter:
            results.append(log.compute())
        counts.append(counter.count)
        log.reset()
    return {"counts": counts, "results": results}


@pytest.mark.parametrize("world_size", [2, 3])
def test_many_keys_cost_one_collective_once_known(world_size):
    for result in run_distributed(body_many_keys, world_size, deadline=90):
        assert result["counts"] == [2, 1, 2, 1]  # new keys (longer records): one more exchange; known keys: one
        for window, keys in enumerate(WINDOWS):
            expected = {}
            for rank in range(world_size):
                for i in keys:
                    if i % 2:
                        expected[f"s{i}"] = expected.get(f"s{i}", 0.0) + i * (rank + 1)
                    else:
                        expected[f"m{i}_{rank}"] = float(i * (rank + 1))
            assert result["results"][window] == pytest.approx(expected, rel=1e-12)


def body_disable(rank, world_size):
    log = ScalarLog(reduce={"m": "max"}, nan_strategy="disable")
    log.update({"m": math.nan if rank == 0 else 1.0, "x": 1.0, "inf": INF if rank == 0 else -INF})
    return log.compute()


def test_disable_keeps_nan_and_infinities_propagate():
    for result in run_distributed(body_disable, 2):
        assert math.isnan(result["m"]) and result["x"] == 1.0 and math.isnan(result["inf"])  # inf - inf


def body_mismatch(rank, world_size):
    log = ScalarLog(reduce={"loss": "sum" if rank == 1 else "mean"}, sync_timeout=30)
    log.update({"loss": 1.0, "acc": 0.5})
    try:
        log.compute()
    except SyncMismatchError as err:
        message = str(err)
    else:
        message = None
    after = sync_scalars({"acc": float(rank)}, sync_timeout=30)  # nobody was left inside a collective
    return {"message": message, "after": after["acc"]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_different_reductions_raise_on_every_rank(world_size):
    for result in run_distributed(body_mismatch, world_size, deadline=60):
        assert result["message"] is not None and "`loss`" in result["message"]
        assert "rank 1: 'sum'" in result["message"] and "rank 0: 'mean'" in result["message"]
        assert result["after"] == pytest.approx(sum(range(world_size)) / world_size)


def body_against_metric(rank, world_size):
    from _metrics import Total

    metric = ScalarLog(sync_timeout=30) if rank == 0 else Total(sync_timeout=30)
    metric.update({"a": 1.0} if rank == 0 else torch.ones(2))
    try:
        metric.compute()
    except SyncMismatchError as err:
        return str(err)
    return None


def test_a_rank_syncing_another_metric_raises_on_both():
    for message in run_distributed(body_against_metric, 2, deadline=60):
        assert message is not None and "ScalarLog.compute" in message


def body_missing(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    log = ScalarLog(process_group=group, sync_timeout=2)
    log.update({"loss": 1.0})
    if rank == 1:
        return None  # never computes
    try:
        log.compute()
    except SyncTimeoutError as err:
        return str(err)
    return "no error"


def test_a_rank_that_never_computes_is_named():
    results = run_distributed(body_missing, 2, deadline=60, fresh=True)
    assert "rank 1" in results[0].lower() or "ranks [1]" in results[0], results[0]


def test_local_use_and_argument_errors():
    log = ScalarLog()
    assert log.compute() == {}
    log.update({"a": torch.tensor([2.0]), "b": True}, weight={"a": 3})
    assert log.compute() == {"a": 2.0, "b": 1.0}
    import copy
    import pickle

    assert copy.deepcopy(log).compute() == pickle.loads(pickle.dumps(log)).compute() == log.compute()
    with pytest.raises(ValueError, match="real scalar"):
        log.update({"a": torch.ones(2)})
    with pytest.raises(TypeError, match="str"):
        log.update({1: 1.0})
    with pytest.raises(ValueError, match="`reduce`"):
        ScalarLog(reduce="median")
    with pytest.raises(ValueError, match="`nan_strategy`"):
        ScalarLog(nan_strategy="drop")
    with pytest.raises(RuntimeError, match="nan"):
        ScalarLog(nan_strategy="error").update({"a": math.nan})


def test_the_benchmark_counts_what_each_way_costs():
    from benchmarks._bench_scalars import body

    rows = run_distributed(body, 2, 1, [1, 100], deadline=120)[0]
    assert [row["keys"] for row in rows] == [1, 100]
    for row, union in zip(rows, [1, 150]):  # 100 keys per rank, half shared: 150 over 2 ranks
        assert row["ours"]["collectives"] == 1
        assert row["all_reduce per key"]["collectives"] == union
        assert row["all_gather_object"]["collectives"] == 2  # sizes, then the pickled dicts


def body_dense(rank, world_size):
    """Every rank has every key: its record carries the whole layout (a bitmap and every key's words)."""
    from torchmetrics_varlen._engine import scalar_codec as _scalar_record

    log = ScalarLog(reduce={"n": "sum", "hi": "max", "lo": "min"})
    out = []
    for window in range(2):
        for step in range(rank + 1):
            x = float(rank + step + window)
            log.update({"loss": x, "n": 1, "hi": x, "lo": -x}, weight=step + 1)
        record = _scalar_record.make_record(log._acc, log._layout, log._named, "x", 1 << 20)
        out.append({"dense": record[_scalar_record.S_SPARSE] == -1, "values": log.compute()})
        log.reset()
    return out


def test_ranks_holding_every_key_send_the_dense_layout():
    world_size = 3
    for result in run_distributed(body_dense, world_size):
        assert result[1]["dense"]  # the second window: every layout key, dense
        for window, got in enumerate(result):
            xs = [(float(r + s + window), s + 1) for r in range(world_size) for s in range(r + 1)]
            expected = {
                "loss": sum(x * w for x, w in xs) / sum(w for _, w in xs),
                "n": float(len(xs)),
                "hi": max(x for x, _ in xs),
                "lo": min(-x for x, _ in xs),
            }
            assert got["values"] == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------- the dtypes of an update, keys, numpy scalars
def test_each_value_and_weight_becomes_float64_on_its_own():
    # Before: one update's tensors were stacked first, so promoted to their common dtype: a bf16 loss next to an
    # int64 count of 1,000,003 logged 999,424; an fp16 weight turned a count of 100,000 into inf.
    log = ScalarLog(reduce={"tokens": "sum", "count": "sum", "exact": "sum"})
    log.update(
        {"loss": torch.tensor(0.5, dtype=torch.bfloat16), "tokens": torch.tensor(1_000_003)},
        weight=torch.tensor(2.0, dtype=torch.float16),
    )
    log.update({"count": torch.tensor(100_000), "exact": torch.tensor(16_777_217, dtype=torch.int32)})
    log.update({"loss": torch.tensor(2.0)}, weight={"loss": torch.tensor(65_504.0, dtype=torch.float16)})
    got = log.compute()
    assert got["tokens"] == 1_000_003.0 and got["count"] == 100_000.0 and got["exact"] == 16_777_217.0
    assert got["loss"] == (0.5 * 2.0 + 2.0 * 65_504.0) / (2.0 + 65_504.0)


def test_numpy_scalars_are_accepted_as_torchmetrics_accepts_them():
    np = pytest.importorskip("numpy")
    log = ScalarLog(reduce={"n": "sum"})
    log.update({"loss": np.float32(0.25), "n": np.int64(3)}, weight=np.int32(4))
    log.update({"loss": np.float16(1.0), "n": np.uint8(2)}, weight=np.float64(1.0))
    expected_loss = (0.25 * 4 + 1.0 * 1) / 5
    assert log.compute() == {"loss": expected_loss, "n": 5.0}


def test_a_key_utf8_cannot_encode_is_refused_at_update():
    # Before: accepted here, then a failure at compute() on that rank alone while its peers waited.
    log = ScalarLog()
    name = os.fsdecode(b"loss-\xff")  # what a non-UTF-8 file name decodes to: a lone surrogate
    with pytest.raises(ValueError, match="UTF-8"):
        log.update({name: 1.0})
    log.update({"fine": 1.0})
    assert log.compute() == {"fine": 1.0}
