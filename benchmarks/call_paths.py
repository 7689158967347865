"""How much of the package a sync walks through: modules, functions and calls, traced with ``sys.setprofile``.

Two gloo CPU processes; rank 0 traces, and counts the Python calls into ``torchmetrics_varlen`` (modules, distinct
functions, calls) of three things: the first ``compute()`` of ``rebase(BinaryAccuracy)``, a repeated one (the
states changed, the metadata not), and ``gather_all_tensors`` of an uneven 1-D tensor. Run from the repository root
against whichever checkout is importable::

    python benchmarks/call_paths.py
"""

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PACKAGE = "torchmetrics_varlen"


def _traced(fn: Callable[[], Any]) -> tuple[int, int, int]:
    """(modules, functions, calls) of the package that ``fn()`` runs."""
    calls: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith(PACKAGE):
                calls.append((module, frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return len({module for module, _ in calls}), len(set(calls)), len(calls)


def _body(rank: int, world_size: int, store_dir: str, out: Any) -> None:
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    from torchmetrics.classification import BinaryAccuracy

    import torchmetrics_varlen as tv

    metric = tv.rebase(BinaryAccuracy)()
    metric.update(torch.rand(10 + rank), torch.randint(0, 2, (10 + rank,)))
    rows = {"first compute()": _traced(metric.compute)}
    metric.update(torch.rand(5), torch.randint(0, 2, (5,)))
    rows["repeated compute()"] = _traced(metric.compute)
    uneven = torch.rand(7 + 5 * rank)
    rows["gather_all_tensors, uneven 1-D"] = _traced(lambda: tv.gather_all_tensors(uneven))
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    """Print one row per traced case: modules, functions and calls of the package."""
    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as store_dir:
        mp.start_processes(_body, args=(2, store_dir, out), nprocs=2, start_method="spawn")  # type: ignore[attr-defined,no-untyped-call]
        rows = out.get(timeout=60)
    import torchmetrics_varlen

    print(f"checkout: {os.path.dirname(torchmetrics_varlen.__file__)}")
    print(f"{'case':<34} {'modules':>8} {'functions':>10} {'calls':>7}")
    for case, (modules, functions, calls) in rows.items():
        print(f"{case:<34} {modules:>8} {functions:>10} {calls:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
