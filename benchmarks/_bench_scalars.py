"""Logged scalars: a ScalarLog window against one ``all_reduce`` per key and ``all_gather_object`` of the dict.

Each rank logs ``keys`` scalars per window, half of them shared by every rank and half its own (a per-rank counter),
each a weighted mean. Three ways to get every key's exact weighted mean on every rank:

* **ours**: :class:`~torchmetrics_varlen.ScalarLog` ``compute()`` once the key layout is known (one exchange);
* **all_reduce per key**: what ``self.log(..., sync_dist=True)`` does, one ``all_reduce`` of ``[Σ w·v, Σ w]`` per
  key, over the union of the keys (which a real loop would first have to agree on: not counted here);
* **all_gather_object**: the dict of every rank by ``all_gather_object`` (pickled), reduced locally.

Reported per window: the median time on rank 0, the collectives, and the bytes rank 0 receives (``ByteMeter``).
"""

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from tests._meters import ByteMeter


def _local(rank: int, keys: int) -> dict[str, tuple[float, float]]:
    """This rank's window: key -> (Σ w·v, Σ w); half the keys shared, half this rank's own."""
    shared = (keys + 1) // 2
    names = [f"shared/{i}" for i in range(shared)] + [f"rank{rank}/{i}" for i in range(keys - shared)]
    return {name: (0.5 * (i + rank), 2.0 + rank) for i, name in enumerate(names)}


def _ours(log: Any) -> dict[str, Any]:
    log._computed = None  # a fresh sync of the same window, as the next window's compute() would run
    return dict(log.compute())


def _per_key(union: list[str], local: dict[str, tuple[float, float]]) -> dict[str, float]:
    out = {}
    for name in union:
        pair = torch.tensor(local.get(name, (0.0, 0.0)), dtype=torch.float64)
        dist.all_reduce(pair)
        out[name] = (pair[0] / pair[1]).item()
    return out


def _gather_object(local: dict[str, tuple[float, float]]) -> dict[str, float]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    totals: dict[str, list[float]] = {}
    for rank_dict in gathered:
        for name, (wv, w) in rank_dict.items():
            total = totals.setdefault(name, [0.0, 0.0])
            total[0] += wv
            total[1] += w
    return {name: wv / w for name, (wv, w) in totals.items()}


def _median_ms(fns: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median ms of each of ``fns`` after one warm-up call each, taking turns, every rank starting together."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: ours agrees its key layout here
        dist.barrier()
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


@contextlib.contextmanager
def _inner_gathers_seen() -> Iterator[None]:
    """``all_gather_object`` calls ``all_gather`` by its module's name: point that name at the meter's wrapper."""
    c10d = dist.distributed_c10d
    original = c10d.all_gather
    c10d.all_gather = dist.all_gather
    try:
        yield
    finally:
        c10d.all_gather = original


def body(rank: int, world_size: int, repeats: int, key_counts: list[int]) -> list[dict[str, Any]]:
    """One row per key count: each side's median ms, collectives and bytes received by rank 0."""
    from torchmetrics_varlen import ScalarLog

    rows = []
    for keys in key_counts:
        local = _local(rank, keys)
        union = sorted({name for r in range(world_size) for name in _local(r, keys)})
        log = ScalarLog()
        log.update({name: wv / w for name, (wv, w) in local.items()}, weight={n: w for n, (_, w) in local.items()})
        fns = {
            "ours": functools.partial(_ours, log),
            "all_reduce per key": functools.partial(_per_key, union, local),
            "all_gather_object": functools.partial(_gather_object, local),
        }
        timed = _median_ms(fns, max(3, repeats // (1 + keys // 100)))
        row: dict[str, Any] = {"keys": keys, "world_size": world_size}
        for side, fn in fns.items():
            dist.barrier()
            with ByteMeter() as meter, _inner_gathers_seen():
                fn()
            row[side] = {"ms": timed[side], "collectives": meter.collectives, "received": meter.received}
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]], repeats: int) -> str:
    """The rows as a text table (bytes received by rank 0 per window)."""
    sides = ("ours", "all_reduce per key", "all_gather_object")
    head = "| keys | ranks | " + " | ".join(f"{side:>18} ms | coll. | KiB recv." for side in sides) + " |"
    lines = [
        f"Logged scalars: one window's exact weighted mean of every key, half the keys per rank its own; median of up"
        f" to {repeats} windows, rank 0",
        "",
        head,
        "|" + "|".join("-" * len(cell) for cell in head.split("|")[1:-1]) + "|",
    ]
    for row in rows:
        cells = [f"{row['keys']:>4}", f"{row['world_size']:>5}"]
        for side in sides:
            value = row[side]
            cells.append(f"{value['ms']:>21.2f} | {value['collectives']:>5} | {value['received'] / 1024:>9.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(quick: bool, repeats: int) -> dict[str, Any]:
    """The cases on 2 and 4 gloo ranks (quick: 2 ranks, 1 and 100 keys); the table and the rows."""
    from tests._workers import WorkerPool

    key_counts = [1, 100] if quick else [1, 100, 3000]
    rows: list[dict[str, Any]] = []
    for world_size in [2] if quick else [2, 4]:
        with WorkerPool(world_size, pg_timeout=120.0) as pool:
            rows += pool.run(body, repeats, key_counts, deadline=600.0)[0]
    return {"rows": rows, "table": format_table(rows, repeats)}
