"""The one-GPU half of the GPU check: a 1-rank NCCL world in which every engine path issues its real NCCL calls.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and the package skips every sync in a group of one, so
this check makes the package treat a group of one as a group to sync (one private name of the package, patched here
and nowhere else: the registry's ``state`` method, ``torchmetrics_varlen._engine.group.REGISTRY.state``; the
``small-sync`` scenario only wraps the engine's fast path to count it, and restores it). Nothing crosses ranks, so
ordering between ranks cannot show; what does: NCCL accepting every call the engine makes (the record exchange, the
padded gather, the all-reduce buckets, the per-rank broadcasts, the sends to one rank, the memory check), stream order
behind a kernel on a side stream, the backward all-reduce on the CUDA autograd thread, the group timeout read from
``ProcessGroupNCCL``'s options, the device memory a sync leaves allocated, ``TORCH_NCCL_BLOCKING_WAIT=1``. The other
half, two processes sharing the GPU over gloo, is ``python -m benchmarks.gpu_check`` under ``torchrun``;
``python -m nox -s gpu`` runs both.

Run from the repository root with a CUDA build of torch::

    python -m benchmarks.gpu_one_rank          # one GPU, NCCL, about 30 s
    python -m benchmarks.gpu_one_rank --cpu    # the same code on gloo and the CPU (CI runs this)

It prints one line per scenario (``PASS``, ``FAIL``, ``SKIP``, ``NOTE``) and a summary; the exit status is 1 if a
scenario failed.
"""

import argparse
import datetime
import gc
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics.aggregation import CatMetric
from torchmetrics.utilities.data import dim_zero_cat

import torchmetrics_varlen as tv
from benchmarks import _gpu_async_scenarios, _gpu_one_rank_nccl
from benchmarks._gpu_common import NoteError, SkipError
from torchmetrics_varlen import _engine
from torchmetrics_varlen._engine.group import REGISTRY, GroupState, Link, group_timeout

__all__ = ["force_sync_in_a_group_of_one", "main"]

GROUP_TIMEOUT = 123.0  # seconds the world is made with: the check reads it back from the backend's options


_SkipError = SkipError  # this machine cannot run the scenario (shared with the scenarios of _gpu_one_rank_nccl)


class _Dense(tv.Metric):
    """A float64 sum, an int64 count, a max and a min: every reduce bucket."""

    total: Tensor
    count: Tensor
    high: Tensor
    low: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("high", default=torch.tensor(-(2**62)), dist_reduce_fx="max")
        self.add_state("low", default=torch.tensor(2**62), dist_reduce_fx="min")

    def update(self, x: Tensor) -> None:
        scaled = (x * 1e6).long()
        self.total = self.total + x.double().sum()
        self.count = self.count + x.numel()
        self.high = torch.maximum(self.high, scaled.max())
        self.low = torch.minimum(self.low, scaled.min())

    def compute(self) -> Tensor:
        return torch.stack([self.total, self.count.double(), self.high.double(), self.low.double()])


def _dense_reference(x: Tensor) -> Tensor:
    scaled = (x.cpu() * 1e6).long()
    values = [x.cpu().double().sum().item(), x.numel(), scaled.max().item(), scaled.min().item()]
    return torch.tensor(values, dtype=torch.float64)


class _Cat(tv.Metric):
    values: list[Tensor]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, x: Tensor) -> None:
        self.values.append(x)

    def compute(self) -> Tensor:
        return dim_zero_cat(self.values)


def force_sync_in_a_group_of_one() -> None:
    """Make the package sync in a group of one: the one place the GPU checks patch a private name of the package.

    Every sync asks ``REGISTRY.state(group)`` whether there is anything to sync (``link``, ``Metric._distributed``,
    ``compute_on_rank``), and the registry answers None for a group of one. The method is replaced on the registry
    instance by one that answers with the group's state whatever its size: the state the registry made and keeps for
    the group (so ``REGISTRY.reset()`` still forgets it), read from its table after the original call made it.
    """
    registry = REGISTRY
    original = registry.state

    def state(group: Any) -> GroupState | None:
        found = original(group)  # makes and keeps the group's state, even for a group of one
        if found is not None or not dist.is_initialized():
            return found
        return registry._states.get(group if group is not None else dist.group.WORLD)

    registry.state = state  # type: ignore[method-assign]


def _dense_reduce(device: torch.device, mode: str) -> str:
    os.environ["TORCHMETRICS_VARLEN_REDUCE"] = mode  # "always": every eligible state by all-reduce
    try:
        x = torch.rand(1000, device=device)
        metric = _Dense().to(device)
        metric.update(x)
        got = metric.compute()
    finally:
        os.environ.pop("TORCHMETRICS_VARLEN_REDUCE", None)
    torch.testing.assert_close(got.cpu(), _dense_reference(x), rtol=1e-12, atol=0)
    return f"sum, count, max and min states on {got.device}, reduce mode {mode!r}: exact"


def _small_sync(device: torch.device) -> str:
    """A small metric's states ride in the record on the device: one collective, exact."""
    from torchmetrics.classification import BinaryAccuracy

    preds, target = torch.rand(50, device=device), torch.randint(0, 2, (50,), device=device)
    metric = tv.rebase(BinaryAccuracy)().to(device)
    metric.update(preds, target)
    calls: list[str] = []
    names = (
        "all_gather_single",
        "all_gather_into_tensor",
        "all_gather",
        "all_reduce",
        "broadcast",
        "all_to_all_single",
    )
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    # The fast path is the engine's plan cache: a learnt request's results come from `_fast_results`, which answers
    # None where the exchanged headers are not the learnt ones (the sync then goes the long way).
    fast: list[bool] = []
    original_fast = _engine._fast_results

    def fast_results(learnt: Any, table: Tensor, request: _engine.Request, link: Link) -> _engine.Synced | None:
        out = original_fast(learnt, table, request, link)
        fast.append(out is not None)
        return out

    _engine._fast_results = fast_results
    try:
        got = metric.compute()
        first_calls = list(calls)
        for _ in range(3):  # the same sync again: the fast path, its data in the learnt record
            metric._computed = None
            again = metric.compute()
            torch.testing.assert_close(again, got, rtol=0, atol=0)
    finally:
        _engine._fast_results = original_fast
        for name, fn in originals.items():
            setattr(dist, name, fn)
    reference = BinaryAccuracy().to(device)  # stock, one process, the same data
    reference.update(preds, target)
    torch.testing.assert_close(got, reference.compute(), rtol=0, atol=0)
    if len(first_calls) != 1 or len(calls) != 4:
        raise AssertionError(f"4 small syncs of {got.device} states issued {calls}: expected one all-gather each")
    if fast != [True] * 3:
        raise AssertionError(f"the repeated syncs took the fast path {fast}: expected [True, True, True]")
    return f"rebase(BinaryAccuracy) on {got.device}: one collective ({calls[0]}), exact; repeated: the fast path"


def _routes(device: torch.device) -> str:
    """A big cat state (the broadcast route, chunked by a 1 MiB cap), the hook, and compute_on_rank."""
    x = torch.rand(3_000_000, device=device)
    big = _Cat(sync_cap="1MiB").to(device)
    big.update(x[:1000])
    big.update(x[1000:])
    torch.testing.assert_close(big.compute(), x, rtol=0, atol=0)
    pieces = tv.gather_all_tensors(x[:4099].cpu())  # a CPU tensor: the buffers live on the bound device
    torch.testing.assert_close(torch.cat(pieces), x[:4099].cpu(), rtol=0, atol=0)
    one = tv.rebase(CatMetric)().to(device)
    one.update(x[:5000])
    got = tv.compute_on_rank(one, dst=0)
    torch.testing.assert_close(got, x[:5000], rtol=0, atol=0)
    return "12 MB cat state by broadcast (1 MiB chunks), gather_all_tensors of a CPU tensor, compute_on_rank: exact"


def _side_stream(device: torch.device) -> str:
    if device.type != "cuda":
        raise _SkipError("needs CUDA streams")
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    metric = _Dense().to(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(5e8))  # type: ignore[no-untyped-call]  # the data is written only after this kernel: a missing wait reads zeros
        x = torch.full((1 << 20,), 0.5, device=device)
        metric.update(x)
        got = metric.compute().cpu()
    torch.testing.assert_close(got, _dense_reference(torch.full((1 << 20,), 0.5)), rtol=1e-12, atol=0)
    return "update and sync inside torch.cuda.stream(side) behind a long kernel: exact"


def _autograd_thread(device: torch.device) -> str:
    if device.type != "cuda":
        raise _SkipError("needs the CUDA autograd thread")
    seen: dict[str, set[int]] = {"ours": set(), "grad": set()}
    real = dist.all_reduce

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen["ours"].add(threading.get_ident())
        return real(*args, **kwargs)

    probs = torch.rand(16, device=device, requires_grad=True)
    probs.register_hook(lambda grad: seen["grad"].add(threading.get_ident()))  # type: ignore[no-untyped-call]
    loss_fn = tv.SoftF1Loss().to(device)
    dist.all_reduce = spy
    try:
        loss_fn(probs, (torch.rand(16, device=device) > 0.5).float()).backward()  # type: ignore[no-untyped-call]
    finally:
        dist.all_reduce = real
    if not seen["ours"] or seen["ours"] != seen["grad"]:
        raise AssertionError(f"backward all-reduce from threads {seen['ours']}, CUDA autograd thread {seen['grad']}")
    return "SoftF1Loss(sync_grads=True) on the GPU: its backward all-reduce issued from the CUDA autograd thread"


def _memory_after_compute(device: torch.device) -> str:
    if device.type != "cuda":
        raise _SkipError("needs CUDA memory statistics")
    gc.collect()
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    metric = tv.rebase(CatMetric)().to(device)
    metric.update(torch.rand(16 * 2**20, device=device))  # 64 MiB
    value = metric.compute()
    del value, metric
    gc.collect()
    torch.cuda.synchronize(device)
    held = (torch.cuda.memory_allocated(device) - baseline) / 2**20
    if held > 1:
        raise AssertionError(f"{held:.1f} MiB of device memory still allocated after compute() and its result went")
    return f"a 64 MiB CatMetric's compute(), result and metric dropped: {held:.1f} MiB allocated above the start"


def _group_timeout(device: torch.device) -> str:
    seconds = group_timeout(dist.group.WORLD, device.type)
    if seconds != GROUP_TIMEOUT:
        raise AssertionError(f"read {seconds} s from the group's options, made with {GROUP_TIMEOUT:g} s")
    return f"{seconds:g} s read from the {dist.get_backend()} backend's options"


def _blocking_wait(device: torch.device) -> str:
    if device.type != "cuda":
        raise _SkipError("NCCL only")
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    try:
        group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=30))
    finally:
        os.environ.pop("TORCH_NCCL_BLOCKING_WAIT", None)
    x = torch.rand(100, device=device)
    metric = _Dense(process_group=group).to(device)
    metric.update(x)
    torch.testing.assert_close(metric.compute().cpu(), _dense_reference(x), rtol=1e-12, atol=0)
    return "a group made with TORCH_NCCL_BLOCKING_WAIT=1: polled, then waited for, exact"


def _no_stream_sync(device: torch.device) -> str:
    """A repeated small sync of CUDA states runs under ``set_sync_debug_mode("error")``: no stream synchronisation.

    The first sync learns (its record and plan); each repeated ``sync()``/``unsync()`` then copies its data into the
    kept send buffer, all-gathers, copies the headers into pinned memory without blocking and waits for an event.
    """
    if device.type != "cuda":
        raise SkipError("a CUDA device: the stream synchronisations to count are CUDA's")
    from torchmetrics.classification import BinaryAccuracy

    metric = tv.rebase(BinaryAccuracy)().to(device)
    metric.update(torch.rand(50, device=device), torch.randint(0, 2, (50,), device=device))
    metric.sync()
    metric.unsync()  # learnt
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            metric.sync()
            synced = [metric.tp.clone(), metric.fp.clone()]
            metric.unsync()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(synced[0], metric.tp) and torch.equal(synced[1], metric.fp)  # a group of one: the same
    return "5 repeated syncs of BinaryAccuracy's CUDA states under set_sync_debug_mode('error'): no stream sync"


SCENARIOS: dict[str, Callable[[torch.device], str]] = {
    "no-stream-sync": _no_stream_sync,
    "group-timeout": _group_timeout,
    "dense-reduce-auto": lambda device: _dense_reduce(device, "auto"),
    "dense-reduce-always": lambda device: _dense_reduce(device, "always"),
    "small-sync": _small_sync,
    "routes": _routes,
    "side-stream": _side_stream,
    "autograd-thread": _autograd_thread,
    "memory-after-compute": _memory_after_compute,
    "blocking-wait-group": _blocking_wait,
    **_gpu_one_rank_nccl.SCENARIOS,  # issue 34: nccl2, the gather to one rank, the watchdog in default mode
    **_gpu_async_scenarios.SCENARIOS,  # issue 44: compute_async without host syncs, step time blocking vs async
}


def _run(name: str, scenario: Callable[[torch.device], str], device: torch.device) -> str:
    try:
        status, detail = "PASS", scenario(device)
    except _SkipError as skip:
        status, detail = "SKIP", str(skip)
    except NoteError as note:  # a finding about the machine, not a failure of the package
        status, detail = "NOTE", str(note)
    except Exception as err:  # a failed check or an error of the package: reported, the others still run
        traceback.print_exc()
        status, detail = "FAIL", f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
    print(f"{status:<7} {name:<24} {detail}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    """Run every scenario in a 1-rank world (NCCL on ``cuda:0``, or gloo with ``--cpu``); 1 if one failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_one_rank", description=__doc__)
    parser.add_argument("--cpu", action="store_true", help="gloo and the CPU: the same code, no GPU needed")
    parser.add_argument("--watchdog-child", action="store_true", help=argparse.SUPPRESS)  # default-mode-watchdog's
    args = parser.parse_args(argv)
    if args.watchdog_child:
        return _gpu_one_rank_nccl.watchdog_child(force_sync_in_a_group_of_one)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_one_rank: no CUDA GPU is visible; run it with --cpu to check the script on gloo", flush=True)
        return 0
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
    backend, bound = ("gloo", None) if args.cpu else ("nccl", device)
    dist.init_process_group(backend, rank=0, world_size=1, timeout=timeout, device_id=bound)
    force_sync_in_a_group_of_one()
    print(f"gpu_one_rank: {dist.get_backend()} on {device}, torch {torch.__version__}", flush=True)
    statuses = [_run(name, scenario, device) for name, scenario in SCENARIOS.items()]
    failed = statuses.count("FAIL")
    print(f"gpu_one_rank: {statuses.count('PASS')} passed, {failed} failed, {statuses.count('SKIP')} skipped")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
