"""What a sync costs on a GPU: time, collectives, host-device copies and memory held, ours against stock.

Two ways to run it, from the repository root, with a CUDA build of torch:

    python -m benchmarks.gpu_measure     # one GPU: a 1-rank NCCL world, the engine forced to sync
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.gpu_measure   # one GPU per rank

NCCL refuses two ranks on one GPU, and the package skips every sync in a group of one, so with a single process the
script makes the package sync in a group of one (``gpu_one_rank.force_sync_in_a_group_of_one``: the group registry
answers with the group's state whatever its size): the engine then issues its real NCCL calls on a 1-rank
communicator. Stock torchmetrics (1.9) issues its barrier and gathers in a group of one too, so W = 1 compares the
calls each side makes and their fixed costs, not the bytes that cross a network. With more processes than GPUs
the ranks share the GPU over gloo (CUDA states, host copies made by gloo). ``--cpu`` runs the same on gloo and CPU.

Per case it prints the median milliseconds of interleaved runs, and, from one profiled run, the collectives
(``c10d::`` operator calls, barriers included, which both ``torch.distributed`` and the process-group objects
dispatch through), the device-to-host and host-to-device copies (CUDA ``Memcpy`` activities) and the CPU-side CUDA
synchronizations.
"""

import argparse
import datetime
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.bench import eight_metric_members
from benchmarks.gpu_one_rank import force_sync_in_a_group_of_one


def _init(cpu: bool) -> tuple[torch.device, int, int]:
    single = "RANK" not in os.environ
    if single:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=120)
    if cpu:
        device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, timeout=timeout)
    else:
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", local % gpus)
        torch.cuda.set_device(device)
        backend = "nccl" if local_world <= gpus else "gloo"
        extra = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timeout, **extra)
    return device, dist.get_rank(), dist.get_world_size()


def _finish(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _medians(fns: dict[str, Callable[[], Any]], repeats: int, device: torch.device) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
        _finish(device)
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            _finish(device)
            start = time.perf_counter()
            fn()
            _finish(device)
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def _profile(fn: Callable[[], Any], device: torch.device) -> dict[str, int]:
    """Collectives, copies and CPU-side synchronizations of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    _finish(device)
    with profile(activities=activities) as prof:
        fn()
        _finish(device)
    counts = {"collectives": 0, "DtoH": 0, "HtoD": 0, "host syncs": 0}
    for event in prof.events():
        name = event.name
        if name.startswith("c10d::"):
            counts["collectives"] += 1
        elif "Memcpy DtoH" in name:
            counts["DtoH"] += 1
        elif "Memcpy HtoD" in name:
            counts["HtoD"] += 1
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            counts["host syncs"] += 1
    counts["host syncs"] -= 1 if device.type == "cuda" else 0  # the profiled run's own final synchronize
    return counts


def _fresh_compute(metric: Any) -> Any:
    members = list(metric.values(copy_state=False)) if hasattr(metric, "values") else [metric]
    for member in members:
        member._computed = None
    out = metric.compute()
    return out


def _sync_once(metric: Any) -> None:
    metric.sync()
    metric.unsync()


def _small(device: torch.device, rank: int) -> dict[str, Any]:
    from torchmetrics.classification import BinaryAccuracy

    import torchmetrics_varlen as tv

    metrics = {"stock": BinaryAccuracy().to(device), "ours": tv.rebase(BinaryAccuracy)().to(device)}
    for metric in metrics.values():
        metric.update(torch.rand(10 + rank, device=device), torch.randint(0, 2, (10 + rank,), device=device))
    return metrics


def _eight(device: torch.device, rank: int) -> dict[str, Any]:
    from torchmetrics import MetricCollection as Stock

    from torchmetrics_varlen import MetricCollection

    # The benchmark's collection, each side its own instances.
    out = {
        "stock": Stock(eight_metric_members()).to(device),
        "ours": MetricCollection(eight_metric_members()).to(device),
    }
    gen = torch.Generator().manual_seed(rank)
    n = 700 + 300 * rank
    for start in range(0, n, 64):
        size = min(64, n - start)
        preds = torch.softmax(torch.randn(size, 5, generator=gen), -1).to(device)
        target = torch.randint(0, 5, (size,), generator=gen).to(device)
        for coll in out.values():
            for name, metric in coll.items(keep_base=True, copy_state=False):
                if name in ("mse", "mae", "pearson"):
                    metric.update(preds[:, 0], target.float() / 4)
                else:
                    metric.update(preds, target)
    return out


def _floor(device: torch.device, world: int, nbytes: int) -> Callable[[], Any]:
    local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    received = torch.empty(world * nbytes, dtype=torch.uint8, device=device)
    return functools.partial(dist.all_gather_into_tensor, received, local)


def _memory_held(device: torch.device) -> dict[str, float]:
    """GPU memory a rebased CatMetric's compute() leaves allocated once its result and states are dropped."""
    from torchmetrics.aggregation import CatMetric

    import torchmetrics_varlen as tv

    gc.collect()
    _finish(device)
    baseline = torch.cuda.memory_allocated(device)
    metric = tv.rebase(CatMetric)().to(device)
    metric.update(torch.rand(16 * 2**20, device=device))  # 64 MiB
    value = metric.compute()
    del value, metric
    gc.collect()
    _finish(device)
    after = torch.cuda.memory_allocated(device)
    stock_metric = CatMetric().to(device)
    stock_metric.update(torch.rand(16 * 2**20, device=device))
    value = stock_metric.compute()
    del value, stock_metric
    gc.collect()
    _finish(device)
    after_stock = torch.cuda.memory_allocated(device)
    return {"ours MiB held": (after - baseline) / 2**20, "stock MiB held": (after_stock - after) / 2**20}


def main() -> int:
    """Measure every case on this rank; rank 0 prints the rows (and writes ``--json``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device, rank, world = _init(args.cpu)
    if world == 1:
        force_sync_in_a_group_of_one()
    import torchmetrics

    import torchmetrics_varlen as tv

    head = (
        f"gpu_measure: {dist.get_backend()} W={world} on {device}"
        f" ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), torch {torch.__version__},"
        f" torchmetrics {torchmetrics.__version__}, torchmetrics_varlen {tv.__version__}"
    )
    report: dict[str, Any] = {"head": head, "cases": {}}
    small = _small(device, rank)
    state_bytes = sum(t.numel() * t.element_size() for t in (small["ours"].tp, small["ours"].fp, small["ours"].tn))
    state_bytes += small["ours"].fn.numel() * small["ours"].fn.element_size()
    eight = _eight(device, rank)
    fns: dict[str, dict[str, Callable[[], Any]]] = {
        "small metric sync": {
            "floor": _floor(device, world, state_bytes),
            **{side: functools.partial(_sync_once, m) for side, m in small.items()},
        },
        "small metric compute()": {side: functools.partial(_fresh_compute, m) for side, m in small.items()},
        "8-metric collection compute()": {side: functools.partial(_fresh_compute, m) for side, m in eight.items()},
    }
    for case, sides in fns.items():
        repeats = args.repeats if "small" in case else max(args.repeats // 4, 20)
        ms = _medians(sides, repeats, device)
        counts = {side: _profile(fn, device) for side, fn in sides.items()}
        report["cases"][case] = {side: {"ms": ms[side], **counts[side]} for side in sides}
    if device.type == "cuda":
        report["memory"] = _memory_held(device)
    if rank == 0:
        print(head, flush=True)
        for case, sides in report["cases"].items():
            floor = sides.get("floor", {}).get("ms")
            for side, row in sides.items():
                ratio = f" ({row['ms'] / floor:.2f}x floor)" if floor and side != "floor" else ""
                print(
                    f"{case:<30} {side:<6} {row['ms']:8.3f} ms{ratio:<16} collectives {row['collectives']:>3}"
                    f"  DtoH {row['DtoH']:>3}  HtoD {row['HtoD']:>3}  host syncs {row['host syncs']:>3}",
                    flush=True,
                )
        if "memory" in report:
            print(f"memory after compute() of a 64 MiB CatMetric, result dropped: {report['memory']}", flush=True)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(report, out, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
