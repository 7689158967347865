"""Syncs off the critical path: a training loop's logged syncs, blocking ``compute()`` against ``compute_async()``.

Each step computes for a fixed time (a 4 ms sleep: the accelerator's work, during which the host thread is free), then
updates a :class:`~torchmetrics_varlen.ScalarLog` of 100 keys (0-d tensors, one weight) and syncs it, every step; in the
second case also an 8-metric collection (updated every step, synced every 10 steps). Three loops, in the same processes,
taking turns: **none** (the updates, no sync: the floor), **blocking** (``compute()`` then ``reset()``), **async**
(``compute_async()`` then ``reset()``; the finished futures are read after each step, and every one by the end of the
loop, which the time includes). With a **straggler**, one rank chosen at random at each step (the same choice on every
rank) computes 4 ms longer. One more row runs the collection case with an 8 ms step: the worker's Python then has more
room while the loop waits.

Reported for rank 0: milliseconds per step (the median over the repeats of the loop's mean), and the share of the
blocking sync's time that left the loop, ``1 - (async - none) / (blocking - none)``, computed within each repeat (its
three loops ran back to back, so a slower spell of a shared machine weighs on all three) and reported as the median over
the repeats, with their quartiles: on a busy 2-core machine one repeat's share can be far from the next one's. With a
straggler the blocking loop also waits for the slow rank at every sync: that wait leaves the loop only as far as
``max_in_flight`` syncs may be pending.
"""

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

STEPS = 200
COMPUTE_S = 0.004
LONGER_COMPUTE_S = 0.008  # one more row: the collection case with a longer step (more room for the worker's Python)
KEYS = 100
COLLECTION_EVERY = 10


def _loop(
    rank: int, mode: str, steps: int, straggler: bool, collection: Any, in_flight: int, compute_s: float = COMPUTE_S
) -> float:
    """One loop of ``steps`` of ``compute_s`` compute each; seconds per step (async: the last futures read included)."""
    from torchmetrics_varlen import ScalarLog

    log = ScalarLog(max_in_flight=in_flight)
    if collection is not None:
        collection.reset()
        collection.max_in_flight = in_flight
    plan = torch.Generator().manual_seed(1)  # the straggler of each step: the same on every rank
    data = torch.Generator().manual_seed(rank)
    pending: deque[Any] = deque()
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        slow = int(torch.randint(0, dist.get_world_size(), (1,), generator=plan))
        time.sleep(compute_s * (2 if straggler and slow == rank else 1))
        values = torch.rand(KEYS, generator=data)
        log.update({f"k{i}": values[i] for i in range(KEYS)}, weight=8 + rank)
        if collection is not None:
            preds = torch.softmax(torch.randn(16, 5, generator=data), -1)
            target = torch.randint(0, 5, (16,), generator=data)
            for name, metric in collection.items(keep_base=True, copy_state=False):
                if name in ("mse", "mae", "pearson"):
                    metric.update(preds[:, 0], target.float() / 4)
                else:
                    metric.update(preds, target)
        syncs = [log] + ([collection] if collection is not None and (step + 1) % COLLECTION_EVERY == 0 else [])
        for synced in syncs:
            if mode == "blocking":
                synced.compute()
            elif mode == "async":
                pending.append(synced.compute_async())
            synced.reset()
        while pending and pending[0].done():
            pending.popleft().result()
    while pending:
        pending.popleft().result()
    return (time.perf_counter() - start) / steps


def body(
    rank: int, world_size: int, steps: int, repeats: int, members: Callable[[], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every case's rows: ms per step of each loop, median over ``repeats`` turns; ``members``: the collection's."""
    from torchmetrics_varlen import MetricCollection

    rows = []
    scalars, both = "ScalarLog, 100 keys", "+ 8-metric collection / 10 steps"
    cases = [(scalars, straggler, in_flight, COMPUTE_S) for straggler in (False, True) for in_flight in (2, 8)]
    cases += [(both, False, 2, COMPUTE_S), (both, True, 8, COMPUTE_S), (both, False, 2, LONGER_COMPUTE_S)]
    for name, straggler, in_flight, compute_s in cases:
        collection = MetricCollection(members()) if name.startswith("+") else None
        times: dict[str, list[float]] = {"none": [], "blocking": [], "async": []}
        _loop(rank, "async", 10, straggler, collection, in_flight, compute_s)  # warm-up: the side group, the layout
        offs = []
        for _ in range(repeats):
            for mode, seconds in times.items():
                seconds.append(_loop(rank, mode, steps, straggler, collection, in_flight, compute_s))
            offs.append(off_the_loop(times["none"][-1], times["blocking"][-1], times["async"][-1]))
        ms = {mode: 1000 * statistics.median(seconds) for mode, seconds in times.items()}
        off = {"off_the_loop": statistics.median(offs), "off_the_loop_quartiles": quartiles(offs)}
        case = {"case": name, "compute_ms": 1000 * compute_s, "straggler": straggler, "max_in_flight": in_flight}
        rows.append({**case, **ms, **off})
    return rows


def off_the_loop(none: float, blocking: float, spent: float) -> float:
    """One repeat's share of the blocking sync's time that left the loop (NaN where blocking cost nothing)."""
    cost = blocking - none
    return 1 - (spent - none) / cost if cost > 0 else float("nan")


def quartiles(shares: list[float]) -> tuple[float, float]:
    """The lower and upper quartiles of the repeats' shares (one repeat: its share twice)."""
    cuts = statistics.quantiles(shares, n=4) if len(shares) > 1 else shares * 3
    return cuts[0], cuts[2]


def format_table(rows: list[dict[str, Any]], steps: int, repeats: int) -> str:
    """The rows as a text table."""
    head = (
        f"| {'case':<34} | compute ms | straggler | in flight | none ms/step | blocking ms/step | async ms/step |"
        " off the loop (quartiles) |"
    )
    lines = [
        f"Syncs off the critical path: {steps} steps, each a fixed compute then a {KEYS}-key ScalarLog synced; 2 gloo"
        f" ranks, rank 0, median of {repeats} loops each (off the loop: the median and quartiles of the {repeats}"
        " repeats' shares)",
        "",
        head,
        "|" + "|".join("-" * len(cell) for cell in head.split("|")[1:-1]) + "|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']:<34} | {row['compute_ms']:>10g} | {'yes' if row['straggler'] else 'no':>9} |"
            f" {row['max_in_flight']:>9} |"
            f" {row['none']:>12.2f} | {row['blocking']:>16.2f} | {row['async']:>13.2f} |"
            f" {share(row['off_the_loop'], row['off_the_loop_quartiles']):>24} |"
        )
    return "\n".join(lines)


def share(median: float, low_high: tuple[float, float]) -> str:
    """``"61% (52-70%)"``: the median share and its quartiles, in percent."""
    return f"{median:.0%} ({100 * low_high[0]:.0f}-{low_high[1]:.0%})"


def run(quick: bool, repeats: int, members: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The cases on 2 gloo ranks (quick: 40 steps, one repeat); the table and the rows.

    ``members`` makes the collection's members (the benchmark's 8-metric set).
    """
    from tests._workers import WorkerPool

    steps, repeats = (40, 1) if quick else (STEPS, max(3, min(repeats, 9)))
    with WorkerPool(2, pg_timeout=120.0) as pool:
        rows = pool.run(body, steps, repeats, members, deadline=600.0)[0]
    return {"rows": rows, "table": format_table(rows, steps, repeats)}
