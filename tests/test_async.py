"""``compute_async()``: exactly the blocking ``compute()`` at the call, off the calling thread, never a hang.

Every value is compared with a blocking ``compute()`` of the same metric at the same point (bit for bit) and, where
it is cheap to write, with one process's value on every rank's data. Faults run in real processes (``subprocess``),
so that their exits are real ones: a peer that makes fewer calls, a peer killed after a call, an exit with a sync
pending.
"""

import json
import math
import os
import random
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import (
    BinaryAUROC,
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassF1Score,
    MulticlassPrecision,
)
from torchmetrics.functional.classification import binary_auroc
from torchmetrics.retrieval import RetrievalMAP

import torchmetrics_varlen as tv

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- bit for bit
def same_bits(a, b):
    """Whether ``a`` and ``b`` are the same value bit for bit: types, dtypes, shapes, devices, NaN payloads, order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
            return False
        return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_bits(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def test_same_bits_tells_values_apart():
    assert same_bits({"a": 1.0, "b": torch.tensor([0.5])}, {"a": 1.0, "b": torch.tensor([0.5])})
    assert same_bits(math.nan, math.nan) and not same_bits(0.0, -0.0)
    assert not same_bits({"a": 1.0, "b": 2.0}, {"b": 2.0, "a": 1.0})  # order
    assert not same_bits(torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64))
    assert not same_bits(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))


# ------------------------------------------------------------------------------- async equals blocking, 50 windows
REDUCE = {"tokens": "sum", "grad_max": "max", "lr_min": "min"}


def _metrics():
    from test_objects import ObjectLog

    collection = tv.MetricCollection(
        {
            "acc": MulticlassAccuracy(num_classes=3),  # a compute group with prec and f1: states shared, moved once
            "prec": MulticlassPrecision(num_classes=3),
            "f1": MulticlassF1Score(num_classes=3),
            "auroc": MulticlassAUROC(num_classes=3, thresholds=None),  # list states, empty on an empty rank
        }
    )
    return {
        "scalars": tv.ScalarLog(reduce=REDUCE, sync_timeout=60),
        "scalars_nan_replaced": tv.ScalarLog(nan_strategy=7.5, sync_timeout=60),
        "scalars_nan_kept": tv.ScalarLog(nan_strategy="disable", sync_timeout=60),
        "auroc": tv.rebase(BinaryAUROC)(thresholds=None, sync_timeout=60),
        "retrieval": tv.rebase(RetrievalMAP)(sync_timeout=60),
        "objects": ObjectLog(sync_timeout=60),
        "collection": collection,
    }


def _scalar_update(rng, rank):
    """One update of a log: a tensor loss (sometimes NaN), numbers, keys that differ by rank and by update."""
    values = {
        "loss": torch.tensor(
            rng.choice([rng.random(), math.nan, -0.0]), dtype=rng.choice([torch.float32, torch.float64])
        )
    }
    values["tokens"] = rng.randrange(100)
    if rng.random() < 0.5:
        values["grad_max"] = rng.choice([rng.random() * 10, math.nan, math.inf])
    values[f"rank{rank}/{rng.randrange(3)}"] = rng.random()
    if rng.random() < 0.3:  # numbers only: the host's accumulators; else the update's first tensor's device
        values = {key: float(value) for key, value in values.items()}
    weight = rng.choice([1, rng.randrange(1, 9), {"loss": torch.tensor(float(rng.randrange(5)))}])
    return values, weight


def _update(name, metric, rng, rank):
    if name.startswith("scalars"):
        metric.update(*_scalar_update(rng, rank))
    elif name == "auroc":
        n = rng.randrange(1, 9)
        metric.update(torch.rand(n), torch.randint(0, 2, (n,)))
    elif name == "retrieval":
        n = rng.randrange(1, 9)
        metric.update(torch.rand(n), torch.randint(0, 2, (n,)).bool(), indexes=torch.randint(0, 4, (n,)))
    elif name == "objects":
        from test_objects import _item

        metric.update(_item(rng.randrange(50)))
    else:
        n = rng.randrange(1, 9)
        metric.update(torch.rand(n, 3), torch.randint(0, 3, (n,)))


def body_windows(rank, world_size, windows, seed):
    torch.manual_seed(seed + rank)
    rng = random.Random(seed + rank)  # this rank's data
    plan = random.Random(seed)  # what every rank does alike: empty ranks, resets, cached computes
    metrics = _metrics()
    mismatches, checked, raw = [], 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for window in range(windows):
            empty = plan.choice([None, None, 0, 1])  # a rank without updates this window
            fresh = plan.random() < 0.3
            cached_first = plan.random() < 0.2
            auroc_data = []
            for name, metric in metrics.items():
                if fresh:
                    metric.reset()
                if rank != empty:
                    for _ in range(rng.randrange(1, 4)):
                        if name == "auroc":
                            n = rng.randrange(1, 9)
                            preds, target = torch.rand(n), torch.randint(0, 2, (n,))
                            metric.update(preds, target)
                            auroc_data.append((preds, target))
                        else:
                            _update(name, metric, rng, rank)
            if cached_first:  # every rank's cache valid: a cached compute is still a sync every rank takes part in
                for metric in metrics.values():
                    metric.compute()
            futures = {name: metric.compute_async() for name, metric in metrics.items()}
            blocking = {name: metric.compute() for name, metric in metrics.items()}
            for name, metric in metrics.items():  # after the call: must not leak into its result
                if plan.random() < 0.5:
                    metric.reset() if plan.random() < 0.3 else _update(name, metric, rng, rank)
            for name, future in futures.items():
                got = future.result(timeout=120)
                checked += 1
                if not same_bits(got, blocking[name]):
                    mismatches.append((window, name, repr(got)[:300], repr(blocking[name])[:300]))
            raw.append((futures["auroc"].result(), [(p.tolist(), t.tolist()) for p, t in auroc_data]))
    return {"mismatches": mismatches, "checked": checked, "auroc": raw}


@pytest.mark.parametrize("seed", [0])
def test_async_equals_blocking_bit_for_bit_over_random_windows(seed):
    results = run_distributed(body_windows, 2, 50, seed, deadline=480)
    for result in results:
        assert result["checked"] == 50 * 7
        assert not result["mismatches"], result["mismatches"][:3]
    # The same on every rank (one process's values: the next test).
    assert all(same_bits(a[0], b[0]) for a, b in zip(results[0]["auroc"], results[1]["auroc"]))


def body_single_process_reference(rank, world_size):
    """ScalarLog and BinaryAUROC against one process on every rank's data (rank 1 of window 1 empty)."""
    rng = random.Random(rank)
    log = tv.ScalarLog(reduce=REDUCE, sync_timeout=60)
    auroc = tv.rebase(BinaryAUROC)(thresholds=None, sync_timeout=60)
    out = []
    for window in range(3):
        updates, data = [], []
        if not (window == 1 and rank == 1):
            for _ in range(3):
                values = {"loss": torch.tensor(rng.random()), "tokens": rng.randrange(50), f"r{rank}": rng.random()}
                weight = rng.randrange(1, 5)
                log.update(values, weight=weight)
                updates.append(({key: float(value) for key, value in values.items()}, weight))
                preds, target = torch.rand(5), torch.randint(0, 2, (5,))
                auroc.update(preds, target)
                data.append((preds, target))
        futures = (log.compute_async(), auroc.compute_async())
        log.reset()
        auroc.reset()
        everything = [None] * world_size
        dist.all_gather_object(everything, (updates, data))
        out.append((futures[0].result(60), futures[1].result(60), everything))
    return out


def test_async_equals_one_process_on_every_rank_data():
    for result in run_distributed(body_single_process_reference, 2, deadline=120):
        for logged, auroc, everything in result:
            sums = {}
            for updates, _ in everything:
                for values, weight in updates:
                    for key, value in values.items():
                        total = sums.setdefault(key, [0.0, 0.0])
                        total[0] += value if key == "tokens" else weight * value
                        total[1] += weight
            expected = {key: (s[0] if key == "tokens" else s[0] / s[1]) for key, s in sums.items()}
            assert logged == pytest.approx(expected, rel=1e-12)
            preds = torch.cat([p for _, data in everything for p, _ in data])
            target = torch.cat([t for _, data in everything for _, t in data])
            assert torch.equal(auroc, binary_auroc(preds, target))


# ---------------------------------------------------------------------------------------------------- overlap
def body_overlap(rank, world_size):
    metric = tv.rebase(SumMetric)(sync_timeout=60)
    metric.update(torch.tensor(float(rank + 1)))
    metric.compute_async().result(60)  # the first call makes the side group (a collective of the world): warm
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)
        called = time.time()
        metric.compute_async().result(60)
        return {"called": called}
    resolved = {}
    start = time.monotonic()
    future = metric.compute_async()
    returned = time.monotonic() - start
    done_at_return = future.done()
    future.add_done_callback(lambda _: resolved.setdefault("at", time.time()))
    value = future.result(60).item()
    time.sleep(0.05)  # the callback runs on the worker right after the result is set
    return {"returned": returned, "done_at_return": done_at_return, "resolved": resolved["at"], "value": value}


def test_the_call_returns_at_once_and_the_result_waits_for_the_peer():
    zero, one = run_distributed(body_overlap, 2, deadline=60)
    assert zero["returned"] < 0.1, zero  # a small fraction of rank 1's 300 ms
    assert not zero["done_at_return"]
    assert zero["resolved"] >= one["called"], (zero, one)
    assert zero["value"] == 3.0


# ----------------------------------------------------------------------- the worker never blocks the job's group
def body_ddp(rank, world_size, steps):
    """Pending syncs on the side group while DDP's backward all-reduces run on the world group, every step."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tv.ScalarLog(sync_timeout=60)
    count = tv.rebase(SumMetric)(sync_timeout=60)
    gen = torch.Generator().manual_seed(rank)
    pending, seen = [], []
    for _ in range(steps):
        n = 3 + rank + int(torch.randint(0, 4, (1,), generator=gen))
        x = torch.randn(n, 8, generator=gen)
        loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        log.update({"loss": loss.detach()}, weight=n)
        count.update(torch.tensor(float(n)))
        pending.append((log.compute_async(), count.compute_async()))
        log.reset()
        seen.append((float(loss.detach().double()), n))
    everything = [None] * world_size
    dist.all_gather_object(everything, seen)
    mismatches, total = [], 0.0
    for step, (logged, counted) in enumerate(pending):
        pairs = [everything[r][step] for r in range(world_size)]
        total += sum(n for _, n in pairs)
        expected = sum(n * loss for loss, n in pairs) / sum(n for _, n in pairs)
        got = logged.result(60)["loss"]
        if got != expected or counted.result(60).item() != total:
            mismatches.append((step, got, expected, counted.result().item(), total))
    return mismatches


def test_pending_syncs_across_ddp_backward_all_reduces():
    assert run_distributed(body_ddp, 2, 100, deadline=240) == [[], []]


# --------------------------------------------------------------------------------------------- in-flight bound
def body_in_flight(rank, world_size):
    """Rank 1 calls late: rank 0's third call waits for its oldest pending sync (max_in_flight=2)."""
    metric = tv.rebase(SumMetric)(sync_timeout=60, max_in_flight=2)
    metric.update(torch.tensor(1.0))
    metric.compute_async().result(60)  # the side group
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
    times, futures = [], []
    for _ in range(3):
        start = time.monotonic()
        futures.append(metric.compute_async())
        times.append(time.monotonic() - start)
    return {"times": times, "values": [f.result(60).item() for f in futures]}


def test_max_in_flight_makes_the_next_call_wait_for_the_oldest():
    zero, _ = run_distributed(body_in_flight, 2, deadline=60)
    assert zero["values"] == [2.0, 2.0, 2.0]
    assert zero["times"][0] < 0.2 and zero["times"][1] < 0.2, zero  # two pending: no wait
    assert zero["times"][2] > 0.2, zero  # the third waited for rank 1's late first call


def test_max_in_flight_is_checked():
    with pytest.raises(ValueError, match="max_in_flight"):
        tv.rebase(SumMetric)(max_in_flight=0)
    with pytest.raises(ValueError, match="max_in_flight"):
        tv.MetricCollection([SumMetric()], max_in_flight=1.5)


def test_the_worker_runs_jobs_in_call_order_each_no_sooner_than_its_delay_after_the_call():
    from concurrent import futures
    from types import SimpleNamespace

    from torchmetrics_varlen._engine import deferred

    started: list[float] = []
    link: Any = SimpleNamespace(state=SimpleNamespace(broken=None), what="a test job")

    def job() -> Any:
        return deferred.Job(lambda side: started.append(time.monotonic()) or len(started), link, futures.Future())

    worker = deferred.Worker()  # a worker of its own: the process's one stays as it is
    jobs = [job()]
    worker.submit(jobs[0])
    jobs[0].future.result(timeout=10)
    jobs += [job(), job()]
    for queued in jobs[1:]:  # queued together: the third starts behind the second
        worker.submit(queued)
    assert [queued.future.result(timeout=10) for queued in jobs] == [1, 2, 3]
    assert all(start - queued.called >= deferred.START_AFTER_S for start, queued in zip(started, jobs)), started


# ------------------------------------------------------------------ processes of their own: real exits and deaths
SCRIPT_HEAD = """
import json, os, signal, sys, time
import torch
import torch.distributed as dist
from torchmetrics.aggregation import CatMetric, SumMetric
import torchmetrics_varlen as tv

rank, world_size, init_file, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def outcome(future, timeout=120):
    try:
        return {"value": future.result(timeout).tolist()}
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err)}
"""


def _run_ranks(tmp_path, body, world_size=2, timeout=120, between=None):
    """Run ``body`` (after ``SCRIPT_HEAD``) as ``world_size`` processes, each checked for its end in rank order.

    Returns each process's return code, stdout, stderr, the seconds it took (at most: seen when its turn came) and
    ``time.monotonic()`` then.
    """
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT_HEAD + textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world_size), str(tmp_path / "rdv"), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    watcher = threading.Thread(target=between, args=(procs,), daemon=True) if between else None
    if watcher:
        watcher.start()
    try:
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=max(timeout - (time.monotonic() - start), 1))
            outs.append((proc.returncode, out, err, time.monotonic() - start, time.monotonic()))
        return outs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def _result(out):
    line = next((line for line in out[1].splitlines() if line.startswith("RESULT ")), None)
    assert line is not None, f"exit {out[0]}\n{out[1][-2000:]}\n{out[2][-3000:]}"
    return json.loads(line.removeprefix("RESULT "))


UNEVEN = """
metric = tv.rebase(SumMetric)(sync_timeout=5)
futures, submitted = [], []
for call in range(10 if rank == 0 else 7):
    metric.update(torch.tensor(float(call + 1)))
    submitted.append(time.monotonic())
    futures.append(metric.compute_async())
    metric.reset()
results = []
for future, at in zip(futures, submitted):
    got = outcome(future)
    got["seconds"] = time.monotonic() - at
    results.append(got)
print("RESULT", json.dumps(results), flush=True)
"""


def test_a_peer_with_fewer_calls_is_named_and_both_processes_exit(tmp_path):
    zero, one = _run_ranks(tmp_path, UNEVEN)
    assert zero[0] == 0 and one[0] == 0, (zero[2][-3000:], one[2][-3000:])
    assert zero[3] < 60 and one[3] < 60  # both exit in bounded time
    got, theirs = _result(zero), _result(one)
    assert [r["value"] for r in got[:7]] == [r["value"] for r in theirs] == [2.0 * (c + 1) for c in range(7)]
    eighth = got[7]
    assert eighth["error"] in ("SyncTimeoutError", "SyncPeerError"), eighth
    assert "ranks [1]" in eighth["message"], eighth["message"]
    assert eighth["seconds"] < 5 + 10, eighth  # the sync's timeout, and a look at the notes
    for later in got[8:]:  # every later future of that metric: the same kind of error, at once
        assert later["error"] == eighth["error"] and "earlier pending sync" in later["message"], later
    assert "unfinished" not in zero[2], zero[2][-2000:]


KILLED = """
metric = tv.rebase(CatMetric)(sync_timeout=60)
metric.update(torch.arange(4.0) + rank)
print("WARM", outcome(metric.compute_async()), flush=True)  # makes the side group; every rank
metric.update(torch.rand(2_000_000 if rank == 1 else 10))  # rank 1's data cannot ride in the records
if rank == 1:
    metric.compute_async()
    time.sleep(0.3)  # the worker is inside the exchange, waiting for rank 0
    os.kill(os.getpid(), signal.SIGKILL)
while not os.path.exists(os.path.join(workdir, "dead")):
    time.sleep(0.05)
before = [t.clone() for t in metric.value]
got = outcome(metric.compute_async(), timeout=90)
after = metric.value
got["intact"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
metric.update(torch.ones(2))
got["local"] = len(metric.value)
print("RESULT", json.dumps({k: v for k, v in got.items() if k != "value"}), flush=True)
"""


def test_a_peer_killed_after_a_call_is_a_peer_error_and_states_stay(tmp_path):
    def mark_dead(procs):
        procs[1].wait(timeout=120)
        (tmp_path / "dead").write_text("")

    zero, one = _run_ranks(tmp_path, KILLED, between=mark_dead)
    assert one[0] == -9
    got = _result(zero)
    assert got["error"] == "SyncPeerError", got
    assert "lost a peer" in got["message"], got["message"]
    assert got["intact"] and got["local"] == 3, got
    assert zero[0] == 0, zero[2][-3000:]


PENDING_AT_EXIT = """
metric = tv.rebase(SumMetric)(sync_timeout=3)
metric.update(torch.tensor(1.0))
metric.compute_async().result(60)  # the side group
if rank == 1:
    time.sleep(20)  # alive, never making the call: rank 0 exits with it pending
    sys.exit(0)
metric.compute_async()
print("RESULT", json.dumps({"exiting": time.monotonic()}), flush=True)
"""


def test_an_exit_with_a_sync_pending_is_bounded_and_says_what_was_lost(tmp_path):
    zero, _ = _run_ranks(tmp_path, PENDING_AT_EXIT)
    assert zero[0] == 0, zero[2][-3000:]
    exited_after = zero[4] - _result(zero)["exiting"]  # one clock for every process (CLOCK_MONOTONIC)
    assert exited_after < 3 + 10, exited_after  # its sync's timeout, a look at the notes; never rank 1's 20 s
    assert "compute_async() sync(s) pending" in zero[2] and "SyncTimeoutError" in zero[2], zero[2][-2000:]
    assert "sync of SumMetric.compute (compute_async)" in zero[2]


# -------------------------------------------------------------------------------------------------- the benchmark
def test_the_benchmark_rows_run():
    from benchmarks import _bench_async
    from benchmarks.bench import eight_metric_members

    rows = run_distributed(_bench_async.body, 2, 8, 3, eight_metric_members, deadline=240)[0]
    assert [(row["case"][:9], row["compute_ms"], row["straggler"], row["max_in_flight"]) for row in rows] == [
        ("ScalarLog", 4, False, 2),
        ("ScalarLog", 4, False, 8),
        ("ScalarLog", 4, True, 2),
        ("ScalarLog", 4, True, 8),
        ("+ 8-metri", 4, False, 2),
        ("+ 8-metri", 4, True, 8),
        ("+ 8-metri", 8, False, 2),
    ]
    assert all(row[mode] > row["compute_ms"] for row in rows for mode in ("none", "blocking", "async"))
    assert all(low <= row["off_the_loop"] <= high for row in rows for low, high in [row["off_the_loop_quartiles"]])
    assert "off the loop (quartiles)" in _bench_async.format_table(rows, 8, 3)


def test_the_bounds_benchmark_replaces_only_the_logs_job_and_only_within_each_form():
    from benchmarks import async_bounds

    result = run_distributed(async_bounds.body, 2, 20, 3, deadline=240)[0]  # 20 steps: two collection syncs
    # A log's result within each form: the library's job gives the key, the two replacements nothing.
    assert result["keys"] == {"as is": 1, "bare all-gather": 0, "none": 0}
    assert all(len(shares) == 3 for shares in result["shares"].values())
    assert all(result["ms"][mode] > 4 for mode in ("none", "blocking", *async_bounds.FORMS))
    assert "| bare all-gather " in async_bounds.format_table(result, 20, 3)
    assert run_distributed(body_bounds_restored, 2, deadline=60) == [{"k": 0.5}] * 2  # the library's job after it


def body_bounds_restored(rank, world_size):
    from benchmarks import async_bounds

    with async_bounds._log_job("none"):
        pass
    log = tv.ScalarLog()
    log.update({"k": float(rank)})
    return log.compute_async().result()


# ----------------------------------------------------------------- what cannot leave the calling thread: at once
def body_at_once(rank, world_size):
    from torchmetrics.classification import BinaryAccuracy
    from torchmetrics.wrappers import MinMaxMetric

    wrapper = tv.rebase(MinMaxMetric)(BinaryAccuracy())  # its compute syncs the wrapped metric: the caller's thread
    wrapper.update(torch.tensor([0.9, 0.1 + rank]), torch.tensor([1, 0]))
    custom = tv.rebase(SumMetric)(dist_sync_fn=lambda tensor, group=None: [tensor, tensor])  # a gather of its own
    custom.update(torch.tensor(1.0 + rank))
    out = {}
    for name, metric in (("wrapper", wrapper), ("custom", custom)):
        future = metric.compute_async()
        out[name] = (future.done(), same_bits(future.result(), metric.compute()))
    return out


def test_what_cannot_leave_the_calling_thread_is_computed_at_once():
    for result in run_distributed(body_at_once, 2, deadline=60):
        assert result == {"wrapper": (True, True), "custom": (True, True)}


def body_join(rank, world_size):
    """A join drives the side group from its own thread: it waits for the pending syncs there, and queues none."""
    step_metric = tv.rebase(SumMetric)(dist_sync_on_step=True, sync_timeout=60)
    other = tv.rebase(SumMetric)(sync_timeout=60)
    other.update(torch.tensor(1.0))
    before = other.compute_async()  # pending when the join starts
    with tv.join(step_metric):
        inside = other.compute_async()  # at once, on the metric's own group: the join drives the side group
        done_inside = inside.done()
        for _ in range(2 + rank):  # uneven steps: rank 1 runs one more, rank 0's worker shadows it on the side group
            step_metric(torch.tensor(1.0))
    after = other.compute_async()
    values = [future.result(60).item() for future in (before, inside, after)]
    return {"values": values, "done_inside": done_inside, "epoch": step_metric.compute().item()}


def test_a_join_waits_for_pending_syncs_and_queues_none_on_its_side_group():
    for result in run_distributed(body_join, 2, deadline=90, fresh=True):
        assert result == {"values": [2.0, 2.0, 2.0], "done_inside": True, "epoch": 5.0}
