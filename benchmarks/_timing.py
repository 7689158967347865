"""Interleaved timing, shared by the scale benchmark and the skew case.

:func:`interleaved_medians` runs the functions in turns (in :mod:`benchmarks.scale_procs` and :mod:`benchmarks.skew`),
so that a change in the load of a shared machine falls on all of them alike.
"""

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist


def interleaved_medians(fns: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median ms of each function, the functions taking turns (load changes fall on all alike); one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()  # every rank starts together: the time is the sync, not the stragglers
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}
