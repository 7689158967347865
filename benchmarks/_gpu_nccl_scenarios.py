"""GPU check scenarios of issue 34: NCCL's cost of the broadcast route, the gather to one rank, shared GPUs.

* ``broadcast-min-measure``: what the broadcast route's threshold (``group.BROADCAST_MIN_BYTES``) weighs, on the
  job's backend: the padded gather of a state whose largest rank holds ``S`` bytes (the others ``S / 8``) against its
  route (one list ``all_gather`` on NCCL, which NCCL runs as one group of broadcasts; per-rank broadcasts elsewhere),
  medians over repeats, and the smallest ``S`` from which the route is as fast. NCCL's threshold (4 MiB) is a choice
  from its documented latency and bandwidth until this line, run on 2+ GPUs, measures it. One GPU: skipped (the
  ranks share it over gloo). ``--cpu``: the same code on gloo with small sizes, so CI runs it.
* ``to-one-rank-memory``: the first ``compute_on_rank`` of a skewed ``cat`` state on a fresh group: no ``gather``
  and no ``all_to_all_single`` on NCCL (both are point to point there, and every peer they name gets a connection
  and its buffers for the communicator's life), exact, and the destination's device memory after it, outside
  torch's allocator (NCCL's buffers) and reserved by torch.
* ``shared-gpu-hint``: one GPU, two processes: an NCCL group over both, neither bound nor ``set_device`` to its own
  GPU, so NCCL refuses them at the first collective ("Duplicate GPU detected"); the error the user sees names the
  fix (``torch.cuda.set_device(local_rank)`` or ``device_id=``). Only in the shared mode.
"""

import datetime
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics.aggregation import CatMetric

import torchmetrics_varlen as tv
from benchmarks._gpu_common import Ctx, NoteError, Scenario, SkipError, _close, counted
from torchmetrics_varlen._engine import comm, wait
from torchmetrics_varlen._engine.group import Facts, backend_of, decide, is_nccl, link

__all__ = ["SCENARIOS"]


def _timed(ctx: Ctx, run: Callable[[], None], repeats: int) -> float:
    """The median milliseconds of ``run`` over ``repeats``, every rank starting together."""
    times = []
    for _ in range(repeats + 1):  # the first run warms up (a communicator's first use of a size)
        dist.barrier(group=ctx.control)
        start = time.perf_counter()
        run()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def _route_costs(ctx: Ctx, big: int, repeats: int) -> tuple[float, float]:
    """(padded gather ms, the route's ms) for a state of ``big`` bytes on rank 0, ``big // 8`` on the others."""
    # The job's group as a metric on this device syncs over it: its policy, and the engine's collectives and waits.
    job = link(None, ctx.device, None, "broadcast-min-measure")
    assert job is not None  # the job's group: more than one rank
    policy, state = job.policy, job.state
    device, rank, world = policy.device, ctx.rank, ctx.world_size
    sizes = [big if src == 0 else big // 8 for src in range(world)]
    padded = torch.ones(big, dtype=torch.uint8, device=device)
    rows = torch.empty(world * big, dtype=torch.uint8, device=device)
    parts = [torch.ones(n, dtype=torch.uint8, device=device) for n in sizes]

    def gather() -> None:  # the padded gather, as the data step runs it
        wait.wait(comm.gather_equal(rows, padded, state.pg, state.backend), job, device.type)

    def route() -> None:  # one round of the broadcast route, as the data step runs it
        if policy.grouped_broadcasts:
            wait.wait_all([(comm.all_gather(parts, rank, state.pg), device.type)], job)
        else:
            wait.wait_all([(comm.broadcast(part, src, state.pg), device.type) for src, part in enumerate(parts)], job)

    return _timed(ctx, gather, repeats), _timed(ctx, route, repeats)


def _broadcast_min_measure(ctx: Ctx) -> str:
    if ctx.mode == "shared":
        raise SkipError("needs a GPU per rank (2+ GPUs): one GPU's ranks share it over gloo")
    cpu = ctx.mode == "cpu"
    sizes = [2**k for k in ((12, 14, 16, 18) if cpu else (14, 16, 18, 20, 22, 24, 26))]
    costs = {big: _route_costs(ctx, big, 3 if cpu else 10) for big in sizes}
    wins = [route <= gather for gather, route in costs.values()]
    first = next((big for index, big in enumerate(sizes) if all(wins[index:])), None)  # and at every larger size
    table = ", ".join(f"{_size(big)} {gather:.3g}/{route:.3g}" for big, (gather, route) in costs.items())
    backend = backend_of(dist.group.WORLD)
    threshold = decide(Facts(backend, ctx.device, current_cuda=max(ctx.device.index or 0, 0)))
    return (
        f"{backend}, {ctx.world_size} ranks, largest rank S and the others S/8, padded gather/route ms: {table};"
        f" the route is as fast from {_size(first) if first else 'none of these'} on (threshold in use:"
        f" {_size(threshold.broadcast_min)})"
    )


def _size(nbytes: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if nbytes >= size:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


def _counting(calls: list[str]) -> dict[str, Any]:
    originals = {}
    for name in ("gather", "all_to_all_single", "all_gather", "all_gather_into_tensor", "broadcast"):
        if hasattr(dist, name):
            originals[name] = fn = getattr(dist, name)
            setattr(dist, name, counted(calls, name, fn))
    return originals


def _to_one_rank_memory(ctx: Ctx) -> str:
    group = dist.new_group(backend=ctx.backend, timeout=datetime.timedelta(seconds=120))
    sizes = [400_000 if rank == 0 else 50_000 for rank in range(ctx.world_size)]
    data = torch.rand(sum(sizes), generator=torch.Generator().manual_seed(34))
    metric = tv.rebase(CatMetric)(process_group=group).to(ctx.device)
    (local,) = ctx.local((data,), sizes)
    metric.update(local)
    cuda = ctx.device.type == "cuda"
    dist.all_reduce(torch.zeros(1, device=ctx.device), group=group)  # the communicator's own setup: not measured
    if cuda:
        torch.cuda.synchronize(ctx.device)
        free_before, _ = torch.cuda.mem_get_info(ctx.device)
        reserved_before = torch.cuda.memory_reserved(ctx.device)
    calls: list[str] = []
    originals = _counting(calls)
    try:
        got = tv.compute_on_rank(metric, dst=0)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    _close("CatMetric to rank 0", got, data, rtol=0, atol=0)
    nccl = is_nccl(ctx.backend, ctx.device.type)
    point_to_point = sorted({name for name in calls if name in ("gather", "all_to_all_single")})
    if nccl and point_to_point:
        raise AssertionError(f"compute_on_rank on NCCL issued {point_to_point}: point to point there")
    if not cuda or ctx.rank != 0:
        return f"{ctx.backend}: compute_on_rank issued {sorted(set(calls))}, exact"
    del got
    torch.cuda.synchronize(ctx.device)
    free_after, total = torch.cuda.mem_get_info(ctx.device)
    torch_growth = (torch.cuda.memory_reserved(ctx.device) - reserved_before) / 2**20
    outside = (free_before - free_after) / 2**20 - torch_growth
    return (
        f"{ctx.backend}, W={ctx.world_size}, first compute_on_rank (1.6 MB on rank 0, 0.2 MB on the others):"
        f" {sorted(set(calls))}, exact; destination's device memory +{outside:.1f} MiB outside torch's allocator"
        f" (NCCL), +{torch_growth:.1f} MiB reserved by torch, {free_after / 2**30:.2f} of {total / 2**30:.2f} GiB"
        " free (on one GPU shared by the ranks, the others' use shows too)"
    )


def _shared_gpu_hint(ctx: Ctx) -> str:
    if ctx.mode != "shared":
        raise SkipError("needs two ranks on one GPU (the shared mode)")
    try:
        group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=60))
    except Exception as err:  # a backend that creates its communicator at once refuses here, before any sync
        raise NoteError(f"NCCL refused the group itself: {str(err).splitlines()[0][:200]}") from err
    metric = tv.rebase(CatMetric)(process_group=group)  # CPU states: the buffers on the current device, cuda:0
    metric.update(torch.rand(100))
    try:
        metric.compute()
    except Exception as err:
        message = str(err)
        if "set_device(" not in message or "device_id=" not in message:
            raise AssertionError(f"the error names no fix: {message[-300:]!r}") from err
        return f"two ranks on {torch.cuda.current_device()} over NCCL: {type(err).__name__} naming set_device/device_id"
    raise NoteError("NCCL accepted two ranks on one GPU: nothing to refuse on this platform")


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("broadcast-min-measure", "padded gather against the broadcast route, by size", _broadcast_min_measure),
    Scenario("to-one-rank-memory", "compute_on_rank without point-to-point on NCCL; root memory", _to_one_rank_memory),
    Scenario("shared-gpu-hint", "two ranks on one GPU over NCCL: the error names the fix", _shared_gpu_hint),
)
