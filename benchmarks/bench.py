"""The benchmark: stock torchmetrics and torchmetrics_varlen side by side, in one run, on gloo CPU processes.

Every case is measured in the same worker processes for both sides, the sides taking turns, as the median of repeated
syncs, with the collectives per sync counted by wrapping the ``torch.distributed`` functions. Compare ratios, not
absolute numbers: this machine is shared and noisy.
"""

import functools
import json
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from tests._meters import CollectiveCounter
from torchmetrics_varlen._engine.group import link
from torchmetrics_varlen._engine.states import metrics_device, sync_states

Case = dict[str, Any]
SMALL_SYNC_REPEATS = 300
# The 8-metric collection's stock sync takes 15 to 95 ms from one call to the next on this shared 2-core machine, ours
# 0.8 to 8 ms: a median of 25 moved the ratio by a third between runs. More samples, still interleaved (about 10 s).
COLLECTION_REPEATS = 100


def _median_ms(fns: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, tuple[float, int]]:
    """Median wall time in ms of each of ``fns``, and the collectives one call issues (the most seen in any call).

    One warm-up call of each is not measured (a group's first large sync takes one more metadata exchange).
    The functions take turns (stock, ours, floor, stock, ...), so that a change in the load of this shared machine
    during the run falls on every side alike and the ratios stay comparable.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    counts = dict.fromkeys(fns, 0)
    for fn in fns.values():  # warm-up, not measured: a group's first large sync takes one more metadata exchange
        dist.barrier()
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()  # start every rank together so the timing is the sync, not the stragglers
            with CollectiveCounter() as counter:
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1000)
            counts[name] = max(counts[name], counter.count)
    return {name: (statistics.median(times[name]), counts[name]) for name in fns}


def _cases(case: str, fns: Mapping[str, Callable[[], Any]], repeats: int) -> list[Case]:
    return [
        {"case": case, "side": side, "ms": ms, "collectives": calls}
        for side, (ms, calls) in _median_ms(fns, repeats).items()
    ]


def _on_each(fn: Callable[[Any], Any], collections: Mapping[str, Any]) -> dict[str, Callable[[], Any]]:
    """``fn`` bound to each side's collection: what ``_median_ms`` takes turns on."""
    return {side: functools.partial(fn, coll) for side, coll in collections.items()}


def _fresh_compute(collection: Any) -> Any:
    for metric in collection.values(copy_state=False):
        metric._computed = None  # force a fresh sync on the next compute()
    return collection.compute()


def eight_metric_members() -> dict[str, Any]:
    """Fresh instances of the 8-metric case's members (the issue's set; the tests check this very collection)."""
    from torchmetrics.classification import (
        MulticlassAccuracy,
        MulticlassAUROC,
        MulticlassF1Score,
        MulticlassPrecision,
        MulticlassRecall,
    )
    from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, PearsonCorrCoef

    return {
        "acc": MulticlassAccuracy(num_classes=5),
        "prec": MulticlassPrecision(num_classes=5),
        "rec": MulticlassRecall(num_classes=5),
        "f1": MulticlassF1Score(num_classes=5),
        "auroc": MulticlassAUROC(num_classes=5, thresholds=None),
        "mse": MeanSquaredError(),
        "mae": MeanAbsoluteError(),
        "pearson": PearsonCorrCoef(),
    }


def _eight_metrics(kind: str) -> Any:
    from torchmetrics import MetricCollection as Stock

    from torchmetrics_varlen import MetricCollection

    return (Stock if kind == "stock" else MetricCollection)(eight_metric_members())


def _feed_eight(collection: Any, rank: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    for start in range(0, n, 64):
        size = min(64, n - start)
        preds = torch.softmax(torch.randn(size, 5, generator=gen), -1)
        target = torch.randint(0, 5, (size,), generator=gen)
        for name, metric in collection.items(keep_base=True, copy_state=False):
            if name in ("mse", "mae", "pearson"):
                metric.update(preds[:, 0], target.float() / 4)
            else:
                metric.update(preds, target)


def _small_metrics(kind: str, count: int) -> Any:
    from torchmetrics import MetricCollection as Stock
    from torchmetrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric

    from torchmetrics_varlen import MetricCollection

    kinds = [MeanMetric, SumMetric, MaxMetric, MinMetric]
    members: dict[str, Any] = {f"m{i}": kinds[i % len(kinds)]() for i in range(count)}
    return (Stock if kind == "stock" else MetricCollection)(members, compute_groups=False)


def _sync_only(collection: Any) -> None:
    """Just the state sync of every member, as each side does it inside compute()."""
    members = list(collection.values(copy_state=False))
    if type(collection).__module__.startswith("torchmetrics_varlen"):
        # As the collection's compute() syncs (`MetricCollection._sync_and_compute`), without computing after it.
        sync_link = link(None, metrics_device(members), collection.sync_timeout, "sync of MetricCollection")
        assert sync_link is not None  # the benchmark runs on 2+ ranks
        sync_states(members, sync_link, phase="collection", label="MetricCollection", cap=collection.sync_cap)
        return
    for metric in members:  # stock: each member syncs its own states, then restores them
        metric.sync()
        metric.unsync()


def body_collections(
    rank: int, world_size: int, repeats: int, small_counts: list[int], collection_repeats: int | None = None
) -> list[Case]:
    """8-metric collection, N small metrics, compute groups: stock vs ours, compute() with a fresh sync each time.

    ``collection_repeats``: samples of the 8-metric cases (default ``repeats``).
    """
    from torchmetrics import MetricCollection as Stock
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision

    from torchmetrics_varlen import MetricCollection

    sides = ("stock", "varlen")
    eight = {kind: _eight_metrics(kind) for kind in sides}
    for coll in eight.values():
        _feed_eight(coll, rank, 700 + 300 * rank)  # uneven batches and totals
    times = collection_repeats or repeats
    cases = _cases("8-metric collection: compute()", _on_each(_fresh_compute, eight), times)
    cases += _cases("8-metric collection: sync only", _on_each(_sync_only, eight), times)
    for count in small_counts:
        small = {kind: _small_metrics(kind, count) for kind in sides}
        for coll in small.values():
            for i, metric in enumerate(coll.values(copy_state=False)):
                metric.update(torch.arange(rank + i + 1, dtype=torch.float32))
        # A sync of a few small states takes well under a millisecond, where this machine's noise is largest: more
        # samples, still interleaved, so the median is steady.
        times = max(repeats, SMALL_SYNC_REPEATS) if count <= 5 else repeats
        cases += _cases(f"{count} small metrics: compute()", _on_each(_fresh_compute, small), times)
        cases += _cases(f"{count} small metrics: sync only", _on_each(_sync_only, small), times)
    grouped: dict[str, Any] = {}
    for kind in sides:
        members = [MulticlassAccuracy(5), MulticlassPrecision(5), MulticlassF1Score(5)]
        grouped[kind] = coll = (Stock if kind == "stock" else MetricCollection)(members)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            coll.update(torch.randn(50, 5, generator=gen), torch.randint(0, 5, (50,), generator=gen))
    cases += _cases("compute-group collection (3 members)", _on_each(_fresh_compute, grouped), repeats)
    return cases


def body_big_cat(rank: int, world_size: int, repeats: int, sizes: list[int]) -> list[Case]:
    """One float32 `cat` state of uneven size per rank: stock sync, ours, and the floor (one equal-size gather)."""
    from torchmetrics.aggregation import CatMetric

    from torchmetrics_varlen import rebase

    local = torch.randn(sizes[rank % len(sizes)])
    fns: dict[str, Callable[[], Any]] = {}
    for kind, cls in (("stock", CatMetric), ("varlen", rebase(CatMetric))):
        metric = cls()
        metric.update(local)

        def sync_once(m: Any = metric) -> None:
            m.sync()
            m.unsync()

        fns[kind] = sync_once
    longest = max(sizes[r % len(sizes)] for r in range(world_size))
    send = torch.zeros(longest)
    receive = torch.empty(world_size * longest)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fns["floor"] = lambda: gather(receive, send)
    return _cases("big cat state", fns, repeats)


def _ratio_rows(cases: list[Case]) -> list[Case]:
    by_case: dict[str, dict[str, Case]] = {}
    for case in cases:
        by_case.setdefault(case["case"], {})[case["side"]] = case
    rows = []
    for name, sides in by_case.items():
        ours = sides["varlen"]
        row = {"case": name, "stock_ms": sides["stock"]["ms"], "stock_collectives": sides["stock"]["collectives"]}
        row.update(varlen_ms=ours["ms"], varlen_collectives=ours["collectives"])
        row["speedup_vs_stock"] = sides["stock"]["ms"] / max(ours["ms"], 1e-9)
        if "floor" in sides:
            row["floor_ms"] = sides["floor"]["ms"]
            row["ratio_to_floor"] = ours["ms"] / max(sides["floor"]["ms"], 1e-9)
        rows.append(row)
    return rows


def format_table(rows: list[Case], world_size: int, repeats: int, collection_repeats: int | None = None) -> str:
    """Markdown-style table of the results (``collection_repeats``: the 8-metric cases' samples, if not ``repeats``)."""
    lines = [
        f"Sync benchmark: {world_size} gloo CPU processes, median of {repeats} syncs"
        f" ({collection_repeats or repeats} for the 8-metric collection, {SMALL_SYNC_REPEATS} for 1-5 small metrics),"
        " rank 0's timings",
        "",
        f"| {'case':<40} | {'stock ms':>9} | {'stock coll.':>11} | {'ours ms':>8} | {'ours coll.':>10} |"
        f" {'speed-up':>8} | {'floor ms':>8} | {'ours/floor':>10} |",
        f"|{'-' * 42}|{'-' * 11}|{'-' * 13}|{'-' * 10}|{'-' * 12}|{'-' * 10}|{'-' * 10}|{'-' * 12}|",
    ]
    for row in rows:
        floor = f"{row['floor_ms']:>8.2f}" if "floor_ms" in row else f"{'-':>8}"
        to_floor = f"{row['ratio_to_floor']:>9.2f}x" if "ratio_to_floor" in row else f"{'-':>10}"
        lines.append(
            f"| {row['case']:<40} | {row['stock_ms']:>9.2f} | {row['stock_collectives']:>11} |"
            f" {row['varlen_ms']:>8.2f} | {row['varlen_collectives']:>10} | {row['speedup_vs_stock']:>7.1f}x |"
            f" {floor} | {to_floor} |"
        )
    return "\n".join(lines)


def format_memory_table(report: dict[str, Any]) -> str:
    """Table of :func:`~benchmarks._memory.measure_sync_memory`: peak RSS growth per rank and path."""
    mib = 1024.0 * 1024.0
    ranks = range(report["world_size"])
    state_mib = max(report["state_bytes"]) / mib
    lines = [
        f"Memory of one compute(): {report['metric']}, {report['n_samples']:,} samples over {report['world_size']}"
        f" ranks ({state_mib:.1f} MiB of state per rank); peak resident-memory growth during compute(), per rank"
        f" ({report['peak_method']})",
        "",
        f"| {'path':<28} | " + " | ".join(f"{f'rank {rank} MiB':>10}" for rank in ranks) + f" | {'AUROC':>8} |",
        f"|{'-' * 30}|" + "|".join("-" * 12 for _ in ranks) + f"|{'-' * 10}|",
    ]
    names = {"all_gather": "all-gather compute()", "one_rank": f"compute_on_rank(dst={report['dst']})"}
    for path, name in names.items():
        peaks = report[path]["peak_rss_growth_bytes"]
        cells = " | ".join(f"{peak / mib:>10.1f}" for peak in peaks)
        lines.append(f"| {name:<28} | {cells} | {report[path]['value'][0]:>8.5f} |")
    return "\n".join(lines)


def plot(rows: list[Case], path: str) -> None:
    """Collectives and latency against the number of metrics (1-2 states each), stock vs ours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    small = [row for row in rows if row["case"].endswith("small metrics: sync only")]
    counts = [int(row["case"].split()[0]) for row in small]
    order = sorted(range(len(counts)), key=counts.__getitem__)
    counts = [counts[i] for i in order]
    small = [small[i] for i in order]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for side, style in (("stock", "o-"), ("varlen", "s-")):
        label = "stock torchmetrics" if side == "stock" else "torchmetrics_varlen"
        left.plot(counts, [row[f"{side}_collectives"] for row in small], style, label=label)
        right.plot(counts, [row[f"{side}_ms"] for row in small], style, label=label)
    left.set(xlabel="metrics in the collection (1-2 states each)", ylabel="collectives per sync", yscale="log")
    right.set(xlabel="metrics in the collection (1-2 states each)", ylabel="ms per sync (median)", yscale="log")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(
    world_size: int,
    repeats: int,
    json_path: str | None,
    plot_path: str | None,
    quick: bool,
    table_path: str | None = None,
    memory_samples: int | None = None,
    skew: dict[str, Any] | None = None,
) -> int:
    """Entry point of ``python -m benchmarks bench``.

    ``memory_samples`` (default 4M, 400k with ``quick``; 0 skips it) sizes the memory case: ``BinaryAUROC`` computed
    by all-gather and by :func:`~torchmetrics_varlen.compute_on_rank`, peak resident memory per rank. It needs at
    least 2 ranks.

    ``skew``: keyword arguments of :func:`benchmarks.skew.run` (``world_size``, ``base``, ``factor``)
    for the skew case and the memory case of ``sync()`` alone, run in their own processes after the others; ``None``
    skips both. Their tables and plots go beside ``table_path`` and ``plot_path`` (``<name>_skew``,
    ``<name>_sync_memory``), their results into the JSON under ``"large"``.
    """
    from benchmarks._memory import measure_sync_memory
    from tests._workers import WorkerPool

    small_counts = [1, 10, 50] if quick else [1, 5, 10, 25, 50]
    cat_sizes = [200_000, 150_000] if quick else [2_000_000, 1_500_000]
    if memory_samples is None:
        memory_samples = 400_000 if quick else 4_000_000
    memory = None
    with WorkerPool(world_size, pg_timeout=120.0) as pool:
        collection_repeats = repeats if quick else max(repeats, COLLECTION_REPEATS)
        cases = pool.run(body_collections, repeats, small_counts, collection_repeats, deadline=600.0)[0]
        cases += pool.run(body_big_cat, repeats, cat_sizes, deadline=600.0)[0]
        if memory_samples > 0 and world_size >= 2:
            memory = measure_sync_memory(world_size, memory_samples, dst=0, pool=pool)
    rows = _ratio_rows(cases)
    table = format_table(rows, world_size, repeats, collection_repeats)
    if memory is not None:
        table += "\n\n" + format_memory_table(memory)
    from benchmarks import _bench_scalars

    scalars = _bench_scalars.run(quick, repeats)  # logged scalars: ScalarLog vs per-key all_reduce vs gather_object
    table += "\n\n" + scalars["table"]
    from benchmarks import _bench_async  # a training loop's logged syncs: blocking against compute_async()

    overlap = _bench_async.run(quick, repeats, eight_metric_members)
    table += "\n\n" + overlap["table"]
    print(table)
    large = None
    if skew is not None:
        from benchmarks import skew as large_states

        large = large_states.run(quick, table_path=table_path, plot_path=plot_path, **skew)
    from benchmarks import _bench_objects  # list states of Python objects: ours, all_gather_object, stock

    objects = _bench_objects.run(quick, world_sizes=(2,) if quick else (2, 4))
    print(_bench_objects.format_table(objects))
    if table_path:
        with open(table_path, "w") as out:  # a literal block, included by docs/benchmarks.rst
            out.write("::\n\n" + "\n".join(f"    {line}".rstrip() for line in table.splitlines()) + "\n")
    result = {"world_size": world_size, "repeats": repeats, "rows": rows, "memory": memory, "large": large}
    result["scalars"] = scalars["rows"]
    result["async"] = overlap["rows"]
    result["objects"] = objects
    print(json.dumps(result, indent=1))
    if json_path:
        with open(json_path, "w") as out:
            json.dump(result, out, indent=1)
    if plot_path:
        plot(rows, plot_path)
    return 0
