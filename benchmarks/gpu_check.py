"""Run the key distributed scenarios on every visible GPU (NCCL), or on gloo CPU processes with ``--cpu``.

Launch it from the repository root through torchrun, one process per GPU (``python -m nox -s gpu`` counts the GPUs
and does this)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.gpu_check
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.gpu_check --cpu

Rank 0 prints one line per scenario: ``PASS``, ``FAIL``, ``SKIP`` (this machine cannot run it) or ``NOTE`` (a finding
about the platform, not a failure of this package), then a summary. The exit status is 0 only if no scenario failed.
Every rank generates every rank's data from one seed, so each scenario compares the distributed result with a
single-process reference computed on the concatenated data (torchmetrics' functional API, or plain torch).

Modes, chosen from what is visible:

* ``nccl``: a GPU per process (``LOCAL_WORLD_SIZE`` at most the GPU count): the job's group is NCCL, states live on
  ``cuda:LOCAL_RANK``; "CUDA states over gloo" runs on a ``dist.new_group(backend="gloo")`` side group.
* ``shared``: more processes than GPUs (one GPU, two processes). NCCL refuses two ranks on one device, so the job's
  group is gloo and the ranks share the GPU: every scenario runs with CUDA states over gloo.
* ``cpu`` (``--cpu``): gloo and CPU tensors. The scenarios about CUDA states run with CPU states or are skipped. CI runs
  this mode, so the code of every scenario runs on every change.

``--list`` prints the scenarios' names and what each covers, and runs nothing (no GPU or torchrun needed:
``python -m benchmarks.gpu_check --list``, or ``python -m nox -s gpu -- --list``). Without a GPU (and
without ``--cpu``) it says so and exits 0. The missing-rank scenario leaves a collective pending on
purpose, so the script ends its processes with ``os._exit`` after printing, instead of tearing the groups down.
"""

import argparse
import datetime
import faulthandler
import os
import sys
import threading
import traceback
import warnings

import torch
import torch.distributed as dist

import torchmetrics_varlen as tv
from benchmarks import (
    _gpu_device_scenarios,
    _gpu_join_scenarios,
    _gpu_nccl_scenarios,
    _gpu_object_scenarios,
    _gpu_route_scenarios,
    _gpu_scalars_scenarios,
    _gpu_scenarios,
    _gpu_timeout_scenarios,
)
from benchmarks._gpu_common import Ctx, NoteError, Scenario, SkipError

__all__ = ["NO_GPU_MESSAGE", "SCENARIOS", "Scenario", "main"]

# The missing-rank scenario leaves a collective pending on the job's group, and NCCL's watchdog may end the process
# at the group's timeout after it: the scenarios about timeouts run last, everything else before them.
_TIMEOUTS = ("late-rank", "missing-rank", "group-after-timeout")
SCENARIOS: tuple[Scenario, ...] = (
    *(scenario for scenario in _gpu_scenarios.SCENARIOS if scenario.name not in _TIMEOUTS),
    *_gpu_device_scenarios.SCENARIOS,  # issue 20, items 2-4: backend, device, autograd thread, stream
    *_gpu_join_scenarios.SCENARIOS,  # issue 20, item 1 and 7: Join with states on the device, the group switch
    *_gpu_route_scenarios.SCENARIOS,  # issue 22: the broadcast route and the memory check
    *_gpu_nccl_scenarios.SCENARIOS,  # issue 34: NCCL's broadcast threshold, the gather to one rank, shared GPUs
    *_gpu_scalars_scenarios.SCENARIOS,  # logged scalars: the record exchange on the device
    *_gpu_object_scenarios.SCENARIOS,  # issue 35: list states of objects holding device tensors
    # issue 20, items 5 and 6: group timeouts, blocking wait, a busy peer (each on a short-timeout group of its own)
    *_gpu_timeout_scenarios.SCENARIOS,
    *(scenario for scenario in _gpu_scenarios.SCENARIOS if scenario.name in _TIMEOUTS),
)

NO_GPU_MESSAGE = (
    "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False): nothing to check on NCCL. "
    "Run it with --cpu to try the same scenarios on gloo CPU processes."
)


# -------------------------------------------------------------------------------------------------------- runner
def _stuck(name: str, rank: int, seconds: float) -> None:
    """Watchdog: a scenario that hangs ends the process with a FAIL line and every thread's stack."""
    print(f"FAIL    {name:<24} rank {rank} still running after {seconds:g} s (a hang); exiting", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(3)


def _run_one(ctx: Ctx, scenario: Scenario) -> tuple[str, str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchmetrics' "compute before update" on empty ranks, deprecations
            return "PASS", scenario.run(ctx)
    except SkipError as skip:
        return "SKIP", str(skip)
    except NoteError as note:
        return "NOTE", str(note)
    except Exception as err:  # a failed check or an error of the package: reported, the other scenarios still run
        traceback.print_exc()
        lines = str(err).strip().splitlines() or [""]
        return "FAIL", f"{type(err).__name__}: {lines[0][:300]}"


def _combine(verdicts: list[tuple[str, str]]) -> tuple[str, str]:
    """One verdict for all ranks: a failure on any rank fails the scenario; else a note; else rank 0's word."""
    for status in ("FAIL", "NOTE"):
        hits = [(rank, detail) for rank, (s, detail) in enumerate(verdicts) if s == status]
        if hits:
            rank, detail = hits[0]
            others = f" (ranks {[r for r, _ in hits]})" if len(hits) > 1 else ""
            return status, f"rank {rank}: {detail}{others}"
    return verdicts[0]


def _run_scenarios(ctx: Ctx, scenarios: tuple[Scenario, ...], watchdog: float) -> list[tuple[str, str, str]]:
    """Run ``scenarios`` in order on every rank; rank 0 prints a line per scenario. Returns (name, status, detail)."""
    results = []
    for scenario in scenarios:
        timer = threading.Timer(watchdog, _stuck, args=(scenario.name, ctx.rank, watchdog))
        timer.daemon = True
        timer.start()
        try:
            status, detail = _combine(ctx.gather_objects(_run_one(ctx, scenario)))
        finally:
            timer.cancel()
        results.append((scenario.name, status, detail))
        if ctx.rank == 0:
            print(f"{status:<7} {scenario.name:<24} {detail}", flush=True)
    return results


def _setup(cpu: bool, pg_timeout: float) -> Ctx:
    """Pick the mode, initialise the job's group and the two gloo groups."""
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    timeout = datetime.timedelta(seconds=pg_timeout)
    if cpu:
        torch.set_num_threads(1)  # ranks share the cores
        mode, backend, device = "cpu", "gloo", torch.device("cpu")
    else:
        gpus = torch.cuda.device_count()
        if local_world <= gpus:
            mode, backend, device = "nccl", "nccl", torch.device("cuda", local_rank)
        else:  # NCCL refuses two ranks on one device
            mode, backend, device = "shared", "gloo", torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    side_gloo = dist.new_group(backend="gloo", timeout=timeout)
    return Ctx(mode, dist.get_rank(), world_size, device, control, side_gloo)


def _header(ctx: Ctx) -> str:
    import torchmetrics

    if ctx.device.type == "cuda":
        gpus = f"{torch.cuda.device_count()} GPU(s) per node ({torch.cuda.get_device_name(ctx.device)})"
        if ctx.mode == "shared":
            gpus += f", ranks sharing {ctx.device} (NCCL needs a GPU per rank: the job group is gloo)"
    else:
        gpus = "CPU only"
    return (
        f"gpu_check: mode {ctx.mode} (job group {ctx.backend}), {ctx.world_size} ranks, {gpus}; torch"
        f" {torch.__version__}, torchmetrics {torchmetrics.__version__}, torchmetrics_varlen {tv.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the check on this rank; return the exit status (0: nothing failed).

    With ``--list`` it prints each scenario's name and summary and returns 0 (no GPU, torchrun or group needed).
    Without a GPU and without ``--cpu`` it prints :data:`NO_GPU_MESSAGE` and returns 0 at once. Otherwise it must run
    under torchrun with at least 2 processes; ``python -m benchmarks.gpu_check`` then ends each process
    with ``os._exit`` (the missing-rank scenario leaves a collective pending on purpose).

    Example:
        >>> from benchmarks.gpu_check import SCENARIOS
        >>> [scenario.name for scenario in SCENARIOS][:3]
        ['uneven-empty-hook', 'uneven-empty-rebased', 'collection']
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    parser.add_argument("--cpu", action="store_true", help="gloo and CPU tensors: the CI mode, no GPU needed")
    parser.add_argument("--watchdog", type=float, default=120.0, help="seconds before a scenario counts as hung")
    parser.add_argument("--pg-timeout", type=float, default=180.0, help="process-group timeout in seconds")
    parser.add_argument("--list", action="store_true", help="print the scenarios' names and what each covers, run none")
    args = parser.parse_args(argv)
    if args.list:  # no GPU, no torchrun, no process group needed
        if os.environ.get("RANK", "0") == "0":
            for scenario in SCENARIOS:
                print(f"{scenario.name:<24} {scenario.summary}", flush=True)
        return 0
    if not args.cpu and not torch.cuda.is_available():
        if os.environ.get("RANK", "0") == "0":
            print(NO_GPU_MESSAGE, flush=True)
        return 0
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(f"gpu_check: launch it through torchrun, for example:\n  {_LAUNCH}", file=sys.stderr)
        return 2
    if int(os.environ["WORLD_SIZE"]) < 2:
        print(f"gpu_check: needs at least 2 processes (got 1), for example:\n  {_LAUNCH}", file=sys.stderr)
        return 2
    # Every metric without an explicit sync_timeout gets a short one: a defect shows as an error, not a long hang.
    os.environ.setdefault("TORCHMETRICS_VARLEN_SYNC_TIMEOUT", "60")
    ctx = _setup(args.cpu, args.pg_timeout)
    if ctx.rank == 0:
        print(_header(ctx), flush=True)
    results = _run_scenarios(ctx, SCENARIOS, args.watchdog)
    counts = {status: sum(1 for _, s, _ in results if s == status) for status in ("PASS", "FAIL", "SKIP", "NOTE")}
    if ctx.rank == 0:
        print(
            f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped,"
            f" {counts['NOTE']} note(s)",
            flush=True,
        )
    return 1 if counts["FAIL"] else 0


_LAUNCH = "python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.gpu_check"


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: a group may hold the collective the missing rank never joined
