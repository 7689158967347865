"""Object list states: a list of RLE-like dicts (or of strings) per rank, synced three ways.

* ``ours``: a :class:`torchmetrics_varlen.Metric` whose ``dist_reduce_fx=None`` list state holds the objects, synced
  (``sync()``, which loads every rank's objects): one pickle per rank, sizes in the records, bytes in one gather
  (or the broadcast route), one tiny all-gather confirming every rank loaded them.
* ``all_gather_object``: ``torch.distributed.all_gather_object`` of the whole list, flattened in rank order: what
  frameworks fall back to.
* ``stock``: torchmetrics' ``MeanAveragePrecision._gather_tuple_list`` (its object sync: one ``all_gather_object``,
  then every rank's list indexed by rank 0's length, so an uneven split drops or fails; ``items`` says how many
  came back). A plain stock metric leaves object states unsynced, each rank keeping its own.

Per path and rank: the median time of a sync, the collectives issued (``all_gather_object`` is two ``all_gather``
calls inside), the bytes received (counted for ours; for ``all_gather_object`` its padded buffer, ``W x`` the
largest rank's pickle), and the peak resident memory growth during one sync.
"""

import gc
import pickle
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["format_table", "run"]

PATHS = ("ours", "all_gather_object", "stock")


def _objects(kind: str, rank: int, count: int) -> list[Any]:
    """``count`` items of this rank: RLE-like mask dicts (pycocotools' shape) or file-name strings."""
    if kind == "str":
        return [f"images/{rank:04d}/frame_{index:07d}.jpg" for index in range(count)]
    gen = torch.Generator().manual_seed(rank)
    lengths = torch.randint(40, 160, (count,), generator=gen).tolist()
    blob = bytes(torch.randint(48, 112, (200,), generator=gen, dtype=torch.uint8).tolist())
    return [{"size": [480, 640], "counts": blob[: lengths[i]]} for i in range(count)]


def _counts(world_size: int, base: int, skewed: bool) -> list[int]:
    """Items per rank: ``base`` each, or (skewed) 4x on rank 0 and none on the last rank."""
    if not skewed:
        return [base] * world_size
    return [4 * base] + [base] * (world_size - 2) + [0]


def _sync_ours(items: list[Any]) -> Any:
    from torchmetrics_varlen import Metric

    class _Objects(Metric):
        def update(self) -> None: ...

        def compute(self) -> None: ...

    metric = _Objects()
    metric.add_state("items", default=[], dist_reduce_fx=None)
    state: list[Any] = metric.items  # type: ignore[assignment]
    state.extend(items)
    metric.sync()
    return vars(metric)["items"]  # the synced list: every rank's items


def _sync_all_gather_object(items: list[Any]) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [item for part in out for item in part]


def _sync_stock(items: list[Any]) -> list[Any]:
    from torchmetrics.detection.mean_ap import MeanAveragePrecision

    try:
        return MeanAveragePrecision._gather_tuple_list(items)  # type: ignore[arg-type]
    except IndexError:
        return []  # rank 0 held more than another rank: indexing that rank's list fails


_SYNCS = {"ours": _sync_ours, "all_gather_object": _sync_all_gather_object, "stock": _sync_stock}


def body_objects(rank: int, world_size: int, kind: str, base: int, skewed: bool, repeats: int) -> dict[str, Any]:
    """One rank: time, meter and measure each path on this rank's items."""
    from benchmarks._memory import _peak_bytes, _reset_peak, _rss_bytes, _trim
    from tests._meters import ByteMeter

    items = _objects(kind, rank, _counts(world_size, base, skewed)[rank])
    out: dict[str, Any] = {}
    for path, sync in _SYNCS.items():
        sync(items)  # warm-up
        times = []
        for _ in range(repeats):
            gc.collect()  # each path starts from a collected heap: the previous syncs' objects do not weigh on it
            dist.barrier()
            start = time.perf_counter()
            sync(items)
            times.append((time.perf_counter() - start) * 1000)
        gc.collect()
        _trim()
        dist.barrier()
        reset = _reset_peak()
        before = _rss_bytes()
        with ByteMeter() as meter:
            got = sync(items)
        peak = _peak_bytes(reset) - before
        received, collectives = meter.received, meter.collectives
        if path != "ours":  # all_gather_object's own all_gathers are not seen by the meter: its padded buffer
            sizes: list[Any] = [None] * world_size
            dist.all_gather_object(sizes, len(pickle.dumps(items)))
            received, collectives = world_size * (max(sizes) + 8), 2
        out[path] = {
            "ms": statistics.median(times),
            "collectives": collectives,
            "received": received,
            "peak": max(peak, 0),
            "items": len(got),
        }
        del got
    return out


def run(quick: bool = False, world_sizes: tuple[int, ...] = (2, 4), repeats: int | None = None) -> list[dict[str, Any]]:
    """Every case (kind, world size, split) on fresh gloo CPU ranks: one row per case and path.

    Time and collectives are rank 0's; received bytes and peak memory the largest over the ranks.
    """
    from tests._workers import WorkerPool

    repeats = repeats or (2 if quick else 5)
    cases = [("rle", 500 if quick else 5_000), ("str", 5_000 if quick else 50_000)]
    rows = []
    for world_size in world_sizes:
        with WorkerPool(world_size, pg_timeout=300.0, quiet=True) as pool:
            for kind, base in cases:
                for skewed in (False, True):
                    results = pool.run(body_objects, kind, base, skewed, repeats, deadline=900.0)
                    expected = sum(_counts(world_size, base, skewed))
                    for path in PATHS:
                        per_rank = [result[path] for result in results]
                        rows.append(
                            {
                                "kind": kind,
                                "per_rank": base,
                                "world_size": world_size,
                                "split": "skewed" if skewed else "even",
                                "path": path,
                                "ms": per_rank[0]["ms"],
                                "collectives": per_rank[0]["collectives"],
                                "received_max": max(r["received"] for r in per_rank),
                                "peak_max": max(r["peak"] for r in per_rank),
                                "items": per_rank[0]["items"],
                                "expected_items": expected,
                            }
                        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a plain-text table (the docs' benchmark page shows one run of it)."""
    head = f"{'case':<24} {'path':<18} {'ms':>9} {'coll.':>5} {'recv MB':>8} {'peak MB':>8} {'items':>14}"
    lines = [head, "-" * len(head)]
    for row in rows:
        case = f"{row['kind']} x{row['per_rank']} W={row['world_size']} {row['split']}"
        items = f"{row['items']}/{row['expected_items']}"
        lines.append(
            f"{case:<24} {row['path']:<18} {row['ms']:>9.1f} {row['collectives']:>5} "
            f"{row['received_max'] / 1e6:>8.2f} {row['peak_max'] / 1e6:>8.1f} {items:>14}"
        )
    return "\n".join(lines)
