"""The demo: the five field reports that started this project, each replayed on gloo CPU processes.

Every section runs the way people write it today (measured, not described), stock torchmetrics where it applies,
this package's fix, and the single-process truth. Ranks that would hang are stopped by the demo's own watchdog (a
deadline on the job, after which the spawned ranks are killed), and a rank that aborts runs in a process group of
its own, so one broken method cannot take the others down. The exit status is 0 only when every "ours" row matches
the truth or raises the error it promises.

``python -m benchmarks demo [--report N] [--world-size W]``; under ``torchrun`` the demo uses torchrun's
process group and skips the methods that would hang or abort the job.
"""

import gc
import os
import sys
import time
from types import ModuleType

import torch.distributed as dist

from benchmarks.demo import report1, report2, report3, report4, report5
from benchmarks.demo._common import Method, Rows, Section, failure_text

SECTIONS: dict[int, ModuleType] = {1: report1, 2: report2, 3: report3, 4: report4, 5: report5}


def _ready(rank: int, world_size: int) -> int:
    return rank


def _run_alone(method: Method, world_size: int) -> list[object] | str:
    """A method that breaks its process group, in a pool of its own; a hang is stopped by the watchdog."""
    from tests._workers import WorkerError, WorkerPool

    # The process-group timeout outlasts the watchdog: what stops a hang is the demo, not gloo.
    with WorkerPool(world_size, pg_timeout=max(60.0, 4 * method.watchdog), quiet=True) as pool:
        try:
            pool.run(_ready, deadline=120.0)  # started and in the process group: the watchdog times the job alone
            return pool.run(method.fn, deadline=method.watchdog if method.breaks == "hangs" else 60.0)
        except WorkerError as err:
            text = failure_text(err)
            return f"HANG: no progress in {method.watchdog:g} s, ranks killed" if text == "HANG" else text


def run_spawned(world_size: int, numbers: list[int]) -> bool:
    """Spawn gloo processes, run and print the sections; True when every "ours" row passed."""
    from tests._workers import WorkerError, WorkerPool

    ok = True
    shared = WorkerPool(world_size, pg_timeout=30.0, quiet=True)
    try:
        for number in numbers:
            module = SECTIONS[number]
            rows: Rows = {}
            for method in module.methods(world_size):
                if method.breaks:
                    rows[method.name] = _run_alone(method, world_size)
                    continue
                try:
                    rows[method.name] = shared.run(method.fn, deadline=60.0)
                except WorkerError as err:  # not expected: shown as measured, and the next method gets a new pool
                    rows[method.name] = failure_text(err)
                    shared = WorkerPool(world_size, pg_timeout=30.0, quiet=True)
            ok &= _show(module.render(world_size, rows))
    finally:
        shared.close()
    return ok


def run_under_torchrun(numbers: list[int]) -> bool:
    """Use the process group that ``torchrun`` set up; rank 0 prints. True when every "ours" row passed.

    The demo makes the job's process group when none exists, and then destroys every group before it returns.
    """
    if dist.is_initialized():
        return _sections_under_torchrun(numbers)
    dist.init_process_group("gloo")
    try:
        return _sections_under_torchrun(numbers)
    finally:
        # A process must not exit with gloo groups alive: their worker threads may still be releasing the last
        # collective (here the final all_gather_object) and its tensors, whose Python objects need the GIL. Once
        # the interpreter finalizes, such a thread is killed inside a C++ destructor and the process aborts with
        # "terminate called without an active exception" (SIGABRT) after printing its result. Destroying the groups
        # (every one: the world and the join side groups) joins those threads while the interpreter still runs.
        # Objects in reference cycles (a DDP model's reducer, metrics) may still hold a group: collected first, so
        # that destroying the groups really ends their threads.
        gc.collect()
        dist.destroy_process_group()


def _sections_under_torchrun(numbers: list[int]) -> bool:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ok = True
    for number in numbers:
        module = SECTIONS[number]
        rows: Rows = {}
        for method in module.methods(world_size):
            if method.breaks and world_size > 1:
                # Run the demo without torchrun to see these rows.
                rows[method.name] = (
                    "skipped: hangs under torchrun" if method.breaks == "hangs" else ("skipped: breaks the job's group")
                )
                continue
            result = method.fn(rank, world_size)
            gathered: list[object] = [None] * world_size
            dist.all_gather_object(gathered, result)
            rows[method.name] = gathered
        if rank == 0:
            ok &= _show(module.render(world_size, rows))
    flag: list[object] = [None] * world_size
    dist.all_gather_object(flag, ok)
    return all(bool(item) for item in flag)


def _show(section: Section) -> bool:
    print(section.text + "\n", flush=True)
    return section.ok


def main(world_size: int = 4, report: int | None = None) -> int:
    """Entry point of ``python -m benchmarks demo``: 0 when every "ours" row matched the truth."""
    numbers = [report] if report is not None else sorted(SECTIONS)
    start = time.monotonic()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    ok = run_under_torchrun(numbers) if under_torchrun else run_spawned(world_size, numbers)
    if not under_torchrun or int(os.environ["RANK"]) == 0:
        verdict = "every 'ours' row matches the truth" if ok else "FAILED: an 'ours' row does not match the truth"
        print(f"{verdict} ({time.monotonic() - start:.0f} s)", file=sys.stdout if ok else sys.stderr, flush=True)
    return 0 if ok else 1
