"""One-GPU scenarios of NCCL's names, the gather to one rank and the watchdog (``benchmarks.gpu_one_rank`` runs them).

Each takes the device of the 1-rank world (``cuda:0`` on NCCL, the CPU with ``--cpu``) and returns its line:

* ``nccl2-group``: a group made with torch's ``nccl2`` backend (torch >= 2.14) gets NCCL's policy (polling waits,
  device buffers, grouped rounds, no point-to-point collective), and its syncs are exact. ``--cpu``: the decision
  from the same facts, without a group.
* ``to-one-rank-memory``: the first ``compute_on_rank`` on a fresh NCCL group issues no ``gather`` and no
  ``all_to_all_single`` (NCCL runs both point to point), and the line reports the root's device memory after it,
  outside torch's allocator (NCCL's own buffers) and reserved by torch. With one rank there is no peer, so no
  point-to-point connection could show here: the figure is the baseline a several-GPU run compares with.
* ``default-mode-watchdog``: with NCCL's default asynchronous error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING``
  unset), a collective that never completes ends in our ``SyncTimeoutError`` before the watchdog ends the process at
  the group's timeout. A 1-rank world has no rank to be missing, so the collective is held back instead: a kernel
  that sleeps past the group's timeout is queued on the stream just before it, so NCCL's stream waits (what the
  watchdog sees is the same: a work not completed by the group's timeout). It runs in a child process
  (``python -m benchmarks.gpu_one_rank --watchdog-child``), which the watchdog is expected to end. A real missing
  rank needs two GPUs, and ends the process that runs the check: the torchrun check cannot run it.
"""

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics.aggregation import CatMetric

import torchmetrics_varlen as tv
from benchmarks._gpu_common import NoteError, SkipError, counted
from torchmetrics_varlen._engine.group import Facts, decide, link

__all__ = ["SCENARIOS", "watchdog_child"]

WATCHDOG_GROUP = 20.0  # the child's group timeout, seconds
WATCHDOG_SYNC = 3.0  # the child's sync_timeout


def _counting(names: tuple[str, ...]) -> tuple[list[str], dict[str, Any]]:
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, counted(calls, name, fn))
    return calls, originals


def _nccl2_group(device: torch.device) -> str:
    if device.type != "cuda":
        policy = decide(Facts("nccl2", torch.device("cpu"), current_cuda=0))
        return f"(decided from facts, no group) nccl2: wait {policy.wait}, buffers on {policy.device}"
    try:
        group = dist.new_group(backend="nccl2", timeout=datetime.timedelta(seconds=60))
    except (ValueError, RuntimeError, AssertionError) as err:  # torch < 2.14 has no such backend (2.11 asserts)
        raise SkipError(f"torch {torch.__version__} makes no nccl2 group: {str(err).splitlines()[0][:120]}") from err
    group_link = link(group, torch.device("cpu"), None, "nccl2-group")  # a group of one syncs: forced by the caller
    if group_link is None:
        raise AssertionError("the 1-rank nccl2 group is not synced: force_sync_in_a_group_of_one was not applied")
    policy = group_link.policy
    got = (policy.wait, policy.device.type, policy.grouped_broadcasts, policy.point_to_point)
    if got != ("poll", "cuda", True, False):
        raise AssertionError(f"nccl2 group ({dist.get_backend(group)}): policy {policy}")
    x = torch.rand(3_000_000, device=device)
    big = tv.rebase(CatMetric)(process_group=group, sync_cap="1MiB").to(device)
    big.update(x)
    torch.testing.assert_close(big.compute(), x, rtol=0, atol=0)
    one = tv.rebase(CatMetric)(process_group=group).to(device)
    one.update(x[:5000])
    torch.testing.assert_close(tv.compute_on_rank(one, dst=0), x[:5000], rtol=0, atol=0)
    return (
        f"backend {dist.get_backend(group)!r}: wait poll, buffers on {policy.device}, grouped rounds, no"
        " point-to-point; a 12 MB cat state (1 MiB rounds) and compute_on_rank: exact"
    )


def _to_one_rank_memory(device: torch.device) -> str:
    nccl = device.type == "cuda"
    group = dist.new_group(backend="nccl" if nccl else "gloo", timeout=datetime.timedelta(seconds=60))
    x = torch.rand(2_000_000, device=device)
    metric = tv.rebase(CatMetric)(process_group=group, sync_cap="1MiB").to(device)
    metric.update(x)
    dist.all_reduce(torch.zeros(1, device=device), group=group)  # the communicator's own setup: not measured
    if nccl:
        torch.cuda.synchronize(device)
        free_before, total = torch.cuda.mem_get_info(device)
        reserved_before = torch.cuda.memory_reserved(device)
    calls, originals = _counting(("gather", "all_to_all_single", "all_gather", "all_gather_into_tensor"))
    try:
        got = tv.compute_on_rank(metric, dst=0)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    torch.testing.assert_close(got, x, rtol=0, atol=0)
    point_to_point = sorted({name for name in calls if name in ("gather", "all_to_all_single")})
    if nccl and point_to_point:
        raise AssertionError(f"compute_on_rank on NCCL issued {point_to_point}: point to point there")
    if not nccl:
        return f"gloo: compute_on_rank issued {calls} (gather and all-to-all allowed off NCCL), exact"
    del got
    torch.cuda.synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    torch_growth = (torch.cuda.memory_reserved(device) - reserved_before) / 2**20
    outside = (free_before - free_after) / 2**20 - torch_growth
    return (
        f"first compute_on_rank on a fresh NCCL group (8 MB cat, W=1): collectives {calls}, no point-to-point;"
        f" root device memory +{outside:.1f} MiB outside torch's allocator (NCCL), +{torch_growth:.1f} MiB reserved"
        f" by torch, {free_after / 2**30:.2f} of {total / 2**30:.2f} GiB free"
    )


def _default_mode_watchdog(device: torch.device) -> str:
    if device.type != "cuda":
        raise SkipError("NCCL's watchdog only")
    defaults = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")  # unset: NCCL's default mode
    env = {name: value for name, value in os.environ.items() if name not in defaults}
    env["MASTER_PORT"] = str(int(os.environ.get("MASTER_PORT", "29541")) + 7)
    command = [sys.executable, "-m", "benchmarks.gpu_one_rank", "--watchdog-child"]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WATCHDOG_GROUP * 4 + 60)
    ended = time.monotonic()
    lines = dict(line.split(" ", 1) for line in child.stdout.splitlines() if " " in line)
    if "ERROR" not in lines or "START" not in lines:
        raise AssertionError(f"the child printed {child.stdout!r}, exit {child.returncode}: {child.stderr[-300:]!r}")
    waited, named = lines["ERROR"].split()
    if waited == "none":
        raise AssertionError("the held sync returned without an error: the collective was not held back")
    lived = ended - float(lines["START"])
    if named != "watchdog-named":
        raise AssertionError(f"SyncTimeoutError after {waited} s does not say that the watchdog may end the process")
    if "SURVIVED" in lines or child.returncode == 0:
        # Seen on an H200 with torch 2.11 (a 1-rank communicator, the collective held behind a sleeping kernel): the
        # process outlived the group's timeout by 40 s. The error says "may": this reports what the machine does.
        raise NoteError(
            f"SyncTimeoutError after {waited} s; the watchdog did not end the process within"
            f" {WATCHDOG_GROUP * 3:g} s of a {WATCHDOG_GROUP:g} s group timeout (exit {child.returncode})"
        )
    return (
        f"default async error handling, group timeout {WATCHDOG_GROUP:g} s, sync_timeout {WATCHDOG_SYNC:g} s:"
        f" SyncTimeoutError after {waited} s (says the watchdog ends the process), then the watchdog ended it"
        f" {lived:.1f} s after the sync began (exit {child.returncode})"
    )


def watchdog_child(force_sync_in_a_group_of_one: Callable[[], None]) -> int:
    """The child of ``default-mode-watchdog``: a sync whose collective is held past the group's timeout.

    ``force_sync_in_a_group_of_one`` is ``gpu_one_rank``'s, which runs this (``--watchdog-child``).
    """
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    timeout = datetime.timedelta(seconds=WATCHDOG_GROUP)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timeout, device_id=device)
    force_sync_in_a_group_of_one()
    clock_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 2_000_000) or 2_000_000
    held = {"done": False}

    def hold(fn: Any) -> Any:
        def held_back(*args: Any, **kwargs: Any) -> Any:
            if not held["done"]:  # the first collective waits behind a kernel that outlives the group's timeout
                held["done"] = True
                torch.cuda._sleep(int(WATCHDOG_GROUP * 4 * clock_khz * 1000))  # type: ignore[no-untyped-call]
            return fn(*args, **kwargs)

        return held_back

    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, hold(getattr(dist, name)))
    metric = tv.rebase(CatMetric)(sync_timeout=WATCHDOG_SYNC).to(device)
    metric.update(torch.rand(1000, device=device))
    start = time.monotonic()
    print(f"START {start}", flush=True)
    try:
        metric.compute()
        print("ERROR none no-error", flush=True)
    except tv.SyncTimeoutError as err:
        named = "watchdog-named" if "watchdog may end this process" in str(err) else "not-named"
        print(f"ERROR {time.monotonic() - start:.1f} {named}", flush=True)
    time.sleep(WATCHDOG_GROUP * 3)  # the watchdog ends the process before this
    print("SURVIVED yes", flush=True)
    os._exit(0)


SCENARIOS = {
    "nccl2-group": _nccl2_group,
    "to-one-rank-memory": _to_one_rank_memory,
    "default-mode-watchdog": _default_mode_watchdog,
}
