"""One-GPU scenarios of syncs off the critical path (``benchmarks.gpu_one_rank`` runs them, in its 1-rank world).

Each takes the world's device (``cuda:0`` on NCCL, the CPU with ``--cpu``) and returns its line:

* ``async-no-host-sync``: ``ScalarLog.update`` (device tensors, Python numbers, per-key device weights) and
  ``compute_async()`` under ``torch.cuda.set_sync_debug_mode("error")``: no host synchronisation on the calling
  thread; the result is a blocking ``compute()``'s at the same point, bit for bit. Then a rebased ``BinaryAUROC`` on
  the device: ``compute_async()`` equals ``compute()`` bit for bit, on the device (its sync reads the states through
  host copies on the worker thread, so it is not run under the debug mode, which is process-wide).
* ``async-step-time``: a small training loop with a per-step ``ScalarLog`` sync, milliseconds per step with no sync,
  with ``compute()`` (on the job's group: NCCL) and with ``compute_async()`` (on the gloo side group, from the worker
  thread). A report, not a bound.

With ``--cpu`` the same code runs on gloo and the CPU, without the debug mode.
"""

import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torchmetrics.classification import BinaryAUROC

import torchmetrics_varlen as tv

__all__ = ["SCENARIOS"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return list(a) == list(b) and all(struct.pack("<d", a[k]) == struct.pack("<d", b[k]) for k in a)
    return bool(
        a.dtype == b.dtype
        and a.device == b.device
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _no_host_sync(device: torch.device) -> str:
    cuda = device.type == "cuda"
    log = tv.ScalarLog(reduce={"tokens": "sum", "peak": "max"}, nan_strategy="ignore").to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    eight = torch.tensor(8.0, device=device)  # made before the check: a tensor from a Python number is a copy
    log.update({"loss": torch.tensor(0.5, device=device)}, weight=2)  # warm: the side group, the first key set
    log.compute_async().result(60)
    log.reset()
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(20):
            loss = torch.rand((), device=device, generator=gen)
            values: dict[str, Any] = {"loss": loss, "tokens": 64 + step, "peak": loss * 3, "nan": loss / 0 * 0}
            log.update(values, weight={"loss": eight, "tokens": 1})
        future = log.compute_async()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    blocking = log.compute()  # the same window, at the same point (it first waits for the pending sync)
    got = future.result(60)
    if not _same(got, blocking):
        raise AssertionError(f"ScalarLog: compute_async {got} != compute {blocking}")
    auroc = tv.rebase(BinaryAUROC)(thresholds=None).to(device)
    auroc.update(torch.rand(1000, device=device, generator=gen), torch.rand(1000, device=device, generator=gen) > 0.5)
    pending = auroc.compute_async()
    auroc_blocking = auroc.compute()
    auroc.update(torch.rand(10, device=device), torch.ones(10, dtype=torch.bool, device=device))  # not in the result
    if not _same(pending.result(60), auroc_blocking):
        raise AssertionError("BinaryAUROC: compute_async != compute")
    mode = "under set_sync_debug_mode('error')" if cuda else "(CPU: no sync debug mode)"
    return f"ScalarLog.update and compute_async {mode}; ScalarLog and BinaryAUROC bit for bit as compute()"


def _step_time(device: torch.device) -> str:
    steps = 200 if device.type == "cuda" else 40
    model = torch.nn.Linear(1024, 1024).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 1024, device=device)
    times = {}
    for mode in ("none", "blocking", "async", "none", "blocking", "async"):  # twice each, the second counts
        log = tv.ScalarLog(reduce={"tokens": "sum"}).to(device)
        pending: deque[Any] = deque()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            log.update({"loss": loss.detach(), "tokens": 512}, weight=512)
            if mode == "blocking":
                log.compute()
            elif mode == "async":
                pending.append(log.compute_async())
            log.reset()
            while pending and pending[0].done():
                pending.popleft().result()
        while pending:
            pending.popleft().result()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times[mode] = 1000 * (time.perf_counter() - start) / steps
    return ", ".join(f"{mode} {ms:.3f} ms/step" for mode, ms in times.items()) + f" ({steps} steps, W = 1)"


SCENARIOS: dict[str, Callable[[torch.device], str]] = {
    "async-no-host-sync": _no_host_sync,
    "async-step-time": _step_time,
}
