"""Memory of a sync: peak RSS growth per rank for ``BinaryAUROC(thresholds=None)``, all-gather vs one-rank compute.

``tracemalloc`` does not see torch's allocations and torch has no peak counter for CPU memory, so each rank measures
its own resident set: the peak (``VmHWM`` of ``/proc/self/status``, reset before the measured compute by writing
``5`` to ``/proc/self/clear_refs``) minus the resident size just before the compute. The C heap is trimmed (glibc
``malloc_trim``) before and after, so that pages freed earlier neither hide growth nor count as held. Where the peak
cannot be reset (not Linux, or not permitted), the growth of ``ru_maxrss`` over the process's earlier peak is
reported instead, a lower bound (``peak_method`` says which). Beside the measurements, ``received_bytes`` counts
the output buffers of the collectives each rank issued during the compute (what it receives into).
"""

import gc
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["measure_sync_memory"]

PATHS = ("all_gather", "one_rank")
_CHUNK = 1 << 18


class _Runner(Protocol):
    def run(self, fn: Callable[..., Any], *args: Any, deadline: float = ..., **kwargs: Any) -> list[Any]: ...


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    return _maxrss_bytes()  # no /proc: the best available figure


def _maxrss_bytes() -> int:
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024  # bytes on macOS, KiB elsewhere


def _trim() -> bool:
    """Return the C heap's free memory to the OS (glibc), so that freed pages neither hide growth nor count as held."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def _peak_bytes(reset: bool) -> int:
    kib = _status_kib("VmHWM") if reset else None
    return kib * 1024 if kib is not None else _maxrss_bytes()


def _auroc(rank: int, world_size: int, n_samples: int) -> Any:
    from torchmetrics.classification import BinaryAUROC

    from torchmetrics_varlen.metric import rebase

    metric = rebase(BinaryAUROC)(thresholds=None, validate_args=False)
    count = n_samples // world_size + (1 if rank < n_samples % world_size else 0)
    gen = torch.Generator().manual_seed(1000 + rank)
    for start in range(0, count, _CHUNK):  # in chunks: the data creation must not set the peak
        size = min(_CHUNK, count - start)
        metric.update(torch.rand(size, generator=gen), torch.randint(0, 2, (size,), generator=gen))
    return metric


def _compute(metric: Any, path: str, dst: int) -> Any:
    if path == "one_rank":
        from torchmetrics_varlen.onerank import compute_on_rank

        return compute_on_rank(metric, dst=dst)
    return metric.compute()


def _measure_rank(rank: int, world_size: int, path: str, n_samples: int, dst: int) -> dict[str, Any]:
    """One rank: fill a BinaryAUROC with this rank's share of ``n_samples``, then measure one ``compute()``."""
    from tests._meters import ByteMeter

    warm = _auroc(rank, world_size, 64)  # first syncs allocate lasting buffers: keep them out of the figures
    _compute(warm, "all_gather", dst)
    _compute(warm, "one_rank", dst)
    metric = _auroc(rank, world_size, n_samples)
    state_bytes = sum(t.numel() * t.element_size() for name in metric._defaults for t in getattr(metric, name))
    gc.collect()
    _trim()
    dist.barrier()
    reset = _reset_peak()
    before_peak = _peak_bytes(reset)
    before = _rss_bytes()
    start = time.perf_counter()
    with ByteMeter() as meter:  # wraps the collectives' Python functions only: no memory of its own
        value = _compute(metric, path, dst)
    seconds = time.perf_counter() - start
    peak = _peak_bytes(reset)
    gc.collect()
    _trim()
    after = _rss_bytes()
    growth = peak - before if reset else max(0, peak - before_peak)
    return {
        "peak_rss_growth_bytes": growth,
        "retained_rss_growth_bytes": after - before,
        "rss_before_bytes": before,
        "state_bytes": state_bytes,
        "received_bytes": meter.received,
        "seconds": seconds,
        "value": float(value),
        "peak_reset": reset,
    }


def measure_sync_memory(
    world_size: int = 2, n_samples: int = 4_000_000, dst: int = 0, pool: _Runner | None = None
) -> dict[str, Any]:
    """Peak memory per rank of ``BinaryAUROC(thresholds=None).compute()`` on gloo CPU ranks: all-gather vs one rank.

    Each rank holds its share of ``n_samples`` random scores and labels (uneven by one sample at most). The
    ``all_gather`` path is the package's one-shot sync (every rank gathers every state and computes), the
    ``one_rank`` path is :func:`~torchmetrics_varlen.onerank.compute_on_rank` (rank ``dst`` gathers and computes, the
    result is broadcast). Both paths run in the same worker processes, one after the other, each measured from a
    reset peak.

    Args:
        world_size: number of gloo CPU ranks to spawn.
        n_samples: samples over all ranks.
        dst: the computing rank of the one-rank path.
        pool: an existing :class:`~tests._workers.WorkerPool` of ``world_size`` ranks (or anything
            with its ``run`` method) to use instead of spawning one; it is left open.

    Returns:
        ``{"world_size", "n_samples", "dst", "metric", "peak_method", "all_gather": {...}, "one_rank": {...}}``,
        each path holding per-rank lists (index = rank): ``peak_rss_growth_bytes`` (peak resident memory during the
        compute above the resident memory before it), ``retained_rss_growth_bytes`` (after it, garbage collected and
        the heap trimmed: buffers kept for reuse, such as the cached CPU send buffer), ``received_bytes`` (the output
        buffers of its collectives during the compute, counted), ``seconds``, and ``value`` (the AUROC, equal on
        every rank and for both paths), plus ``max_peak_rss_growth_bytes`` and ``max_non_dst_peak_rss_growth_bytes``
        (max over the ranks other than ``dst``); ``state_bytes`` per rank at the top level.

    Example:
        Spawns processes, so not run as a doctest:

        >>> from benchmarks._memory import measure_sync_memory
        >>> report = measure_sync_memory(world_size=2, n_samples=4_000_000)  # doctest: +SKIP
        >>> report["one_rank"]["max_non_dst_peak_rss_growth_bytes"] < report["all_gather"]["max_peak_rss_growth_bytes"]
        ... # doctest: +SKIP
        True
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"Expected `world_size` to be an integer of at least 2 but got {world_size!r}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"Expected `n_samples` to be a positive integer but got {n_samples!r}")
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world_size:
        raise ValueError(f"Expected `dst` to be a rank in [0, {world_size}) but got {dst!r}")
    own_pool = None
    if pool is None:
        from tests._workers import WorkerPool

        pool = own_pool = WorkerPool(world_size, pg_timeout=300.0, quiet=True)
    deadline = 120.0 + n_samples / 20_000
    try:
        results = {path: pool.run(_measure_rank, path, n_samples, dst, deadline=deadline) for path in PATHS}
    finally:
        if own_pool is not None:
            own_pool.close()
    return _report(world_size, n_samples, dst, results)


def _report(world_size: int, n_samples: int, dst: int, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What :func:`measure_sync_memory` returns, from each path's per-rank results of :func:`_measure_rank`."""
    report: dict[str, Any] = {
        "world_size": world_size,
        "n_samples": n_samples,
        "dst": dst,
        "metric": "BinaryAUROC(thresholds=None)",
        "peak_method": "VmHWM reset" if all(r["peak_reset"] for rs in results.values() for r in rs) else "ru_maxrss",
    }
    for path, per_rank in results.items():
        received = [r["received_bytes"] for r in per_rank]
        peaks = [r["peak_rss_growth_bytes"] for r in per_rank]
        report[path] = {
            "peak_rss_growth_bytes": peaks,
            "retained_rss_growth_bytes": [r["retained_rss_growth_bytes"] for r in per_rank],
            "received_bytes": received,
            "seconds": [r["seconds"] for r in per_rank],
            "value": [r["value"] for r in per_rank],
            "max_peak_rss_growth_bytes": max(peaks),
            "max_non_dst_peak_rss_growth_bytes": max(p for rank, p in enumerate(peaks) if rank != dst),
        }
        report["state_bytes"] = [r["state_bytes"] for r in per_rank]
    return report
