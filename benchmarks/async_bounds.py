"""What bounds the async benchmark's collection case: the log's own sync, as it is, as one bare all-gather, and absent.

The collection case of ``python -m benchmarks bench``'s async table (a 4 ms step, a 100-key ``ScalarLog`` synced every
step, an 8-metric collection every 10 steps, ``max_in_flight=2``, no straggler, 2 gloo ranks) leaves less of its
blocking time off the loop than the log alone does. Here the log's ``compute_async()`` job (what the worker thread
runs) takes three forms, one per loop, all within each repeat, in an order that rotates from one repeat to the next:

* **as is**: the library's job (fold the window, build the record, one all-gather, check the table and reduce it);
* **bare all-gather**: one all-gather of as many words as the log's record (218) on the same side group, and nothing of
  ours around it: the least any sync of the log must do;
* **none**: no job at all (the future resolves with an empty dict).

Each repeat also runs the loop without syncs and the blocking one, which give each form's share of the blocking
sync's time that left the loop, as the bench computes it. The two replacements return wrong values on purpose: they
measure what the log's sync costs the loop, and exist only in this command's processes. The collection's job stays as
it is throughout. One repeat's share varies widely on a busy machine: run 40 repeats (about 6 minutes) to tell forms
apart by a few points. Run from the repository root::

    python -m benchmarks.async_bounds [--repeats 40]
"""

import argparse
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import _bench_async

FORMS = ("as is", "bare all-gather", "none")
BARE_WORDS = 218  # the 100-key log's record once its keys are known: header, bitmap, two words per key


@contextmanager
def _log_job(form: str) -> Iterator[None]:
    """Within the block, every ``ScalarLog.compute_async()`` of this process queues the job of ``form``."""
    from torchmetrics_varlen import ScalarLog

    library = ScalarLog.__dict__["_async_run"]

    def bare(side: Any) -> dict[str, float]:
        words = torch.zeros(BARE_WORDS, dtype=torch.int64)
        dist.all_gather([torch.empty_like(words) for _ in range(side.size)], words, group=side.group)
        return {}

    def replaced(self: ScalarLog, label: str) -> tuple[Callable[[Any], Any], list[Any]]:
        events = self._acc.read().events  # the call's own cost stays: the accumulators are still read
        return (bare if form == "bare all-gather" else lambda side: {}), events

    ScalarLog._async_run = library if form == "as is" else replaced  # type: ignore[method-assign]
    try:
        yield
    finally:
        ScalarLog._async_run = library  # type: ignore[method-assign]


def body(rank: int, world_size: int, steps: int, repeats: int) -> dict[str, Any]:
    """Each form's shares (one per repeat), the loops' seconds per step, and the keys of each form's last result."""
    from benchmarks.bench import eight_metric_members
    from torchmetrics_varlen import MetricCollection, ScalarLog

    collection = MetricCollection(eight_metric_members())
    _bench_async._loop(rank, "async", 10, False, collection, 2)  # warm-up: the side group, the layouts
    shares: dict[str, list[float]] = {form: [] for form in FORMS}
    seconds: dict[str, list[float]] = {mode: [] for mode in ("none", "blocking", *FORMS)}
    keys = {}
    for repeat in range(repeats):
        none = _bench_async._loop(rank, "none", steps, False, collection, 2)
        blocking = _bench_async._loop(rank, "blocking", steps, False, collection, 2)
        seconds["none"].append(none)
        seconds["blocking"].append(blocking)
        for form in FORMS[repeat % len(FORMS) :] + FORMS[: repeat % len(FORMS)]:
            with _log_job(form):
                spent = _bench_async._loop(rank, "async", steps, False, collection, 2)
                log = ScalarLog()
                log.update({"k": float(rank)})
                keys[form] = len(log.compute_async().result())
            seconds[form].append(spent)
            shares[form].append(_bench_async.off_the_loop(none, blocking, spent))
    return {"shares": shares, "ms": {mode: 1000 * statistics.median(s) for mode, s in seconds.items()}, "keys": keys}


def format_table(result: dict[str, Any], steps: int, repeats: int) -> str:
    """The forms as a text table: ms per step and the median share off the loop, with its quartiles."""
    lines = [
        f"What bounds the collection case: {steps} steps of 4 ms, a 100-key ScalarLog synced every step and an 8-metric"
        f" collection every 10, max_in_flight 2, 2 gloo ranks, rank 0, {repeats} repeats (the forms' order rotated)",
        f"no sync: {result['ms']['none']:.2f} ms/step; blocking: {result['ms']['blocking']:.2f} ms/step",
        "",
        "| the log's compute_async() job | async ms/step | off the loop (quartiles) |",
        "|-------------------------------|---------------|--------------------------|",
    ]
    for form in FORMS:
        shares = result["shares"][form]
        off = _bench_async.share(statistics.median(shares), _bench_async.quartiles(shares))
        lines.append(f"| {form:<29} | {result['ms'][form]:>13.2f} | {off:>24} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the forms on 2 gloo ranks and print the table."""
    from tests._workers import WorkerPool

    parser = argparse.ArgumentParser(prog="python -m benchmarks.async_bounds", description=__doc__)
    parser.add_argument("--repeats", type=int, default=40, help="repeats of the five loops (default 40)")
    parser.add_argument(
        "--steps", type=int, default=_bench_async.STEPS, help=f"steps per loop (default {_bench_async.STEPS})"
    )
    args = parser.parse_args(argv)
    for flag, value in (("--repeats", args.repeats), ("--steps", args.steps)):
        if value < 1:
            parser.error(f"Expected `{flag}` to be at least 1 but got {value}")
    with WorkerPool(2, pg_timeout=120.0) as pool:
        result = pool.run(body, args.steps, args.repeats, deadline=60.0 + 0.2 * args.steps * args.repeats)[0]
    print(format_table(result, args.steps, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
