"""GPU check scenarios of the data routes for large and skewed states (issue 22), each a function every rank runs.

On NCCL the broadcast route moves CUDA slices of the result by ``broadcast``, chunked by the transfer cap, a one-rank
compute moves them to its destination by ``all_to_all_single``, and the memory check is an ``all_gather`` of one word
per rank on the job's device: none of it can run in CI. In ``--cpu`` mode the same code runs with CPU states on gloo,
so CI covers it.
"""

import torch
from torchmetrics.aggregation import CatMetric
from torchmetrics.classification import BinaryAUROC
from torchmetrics.functional.classification import binary_auroc

import torchmetrics_varlen as tv
from benchmarks._gpu_common import Ctx, Scenario, _close, _on
from torchmetrics_varlen._engine import move
from torchmetrics_varlen.onerank import compute_on_rank

__all__ = ["SCENARIOS"]


def _skewed(world_size: int, small: int) -> list[int]:
    """Rank 0 holds 8x the others; the last rank of three or more holds nothing."""
    return [small * 8 if rank == 0 else 0 if rank == world_size - 1 > 1 else small for rank in range(world_size)]


def _skewed_broadcast(ctx: Ctx) -> str:
    sizes = _skewed(ctx.world_size, 200_000)  # rank 0: 6.1 MiB per float32 state, past NCCL's 4 MiB threshold too
    gen = torch.Generator().manual_seed(22)
    preds, target = torch.rand(sum(sizes), generator=gen), torch.randint(0, 2, (sum(sizes),), generator=gen)
    auroc = tv.rebase(BinaryAUROC)(thresholds=None).to(ctx.device)
    values = tv.rebase(CatMetric)(sync_cap="1MiB").to(ctx.device)  # chunks of 1 MiB
    local_preds, local_target = ctx.local((preds, target), sizes)
    if sizes[ctx.rank]:
        auroc.update(local_preds, local_target)
        values.update(local_preds)
    got = auroc.compute()
    _close("BinaryAUROC", got, binary_auroc(preds, target, thresholds=None))
    _on("BinaryAUROC", got, ctx.device)
    joined = values.compute()
    _close("CatMetric", joined, preds, rtol=0, atol=0)
    _on("CatMetric", joined, ctx.device)
    return f"skewed cat states by per-rank broadcasts (1 MiB chunks), samples per rank {sizes}: as one process"


def _skewed_to_one_rank(ctx: Ctx) -> str:
    sizes = _skewed(ctx.world_size, 200_000)
    gen = torch.Generator().manual_seed(24)
    preds, target = torch.rand(sum(sizes), generator=gen), torch.randint(0, 2, (sum(sizes),), generator=gen)
    auroc = BinaryAUROC(thresholds=None).to(ctx.device)
    values = tv.rebase(CatMetric)(sync_cap="1MiB").to(ctx.device)  # chunks of 1 MiB
    local_preds, local_target = ctx.local((preds, target), sizes)
    if sizes[ctx.rank]:
        auroc.update(local_preds, local_target)
        values.update(local_preds)
    dst = ctx.world_size - 1  # the rank with the fewest samples gathers the big one's
    got = compute_on_rank(auroc, dst=dst)
    _close("BinaryAUROC", got, binary_auroc(preds, target, thresholds=None))
    _on("BinaryAUROC", got, ctx.device)
    joined = compute_on_rank(values, dst=dst)
    _close("CatMetric", joined, preds, rtol=0, atol=0)
    _on("CatMetric", joined, ctx.device)
    return f"skewed cat states to rank {dst} only (all_to_all_single, 1 MiB chunks), samples {sizes}: as one process"


def _allocation_fails(ctx: Ctx) -> str:
    sizes = [move.AGREE_MIN_BYTES // 4 // ctx.world_size + 1000] * ctx.world_size
    gen = torch.Generator().manual_seed(23)
    data = torch.rand(sum(sizes), generator=gen)
    metric = tv.rebase(CatMetric)().to(ctx.device)
    (local,) = ctx.local((data,), sizes)
    metric.update(local)
    original = move.allocate  # where a sync allocates what it receives: looked up at call time

    def refuse(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise torch.OutOfMemoryError(f"CUDA out of memory (forced by the check): {numel} elements of {dtype}")

    failing = ctx.world_size - 1
    if ctx.rank == failing:
        move.allocate = refuse
    message = ""
    try:
        metric.compute()
    except tv.SyncMemoryError as err:
        message = str(err)
    finally:
        move.allocate = original
    if f"ranks [{failing}] could not allocate" not in message:
        raise AssertionError(f"expected SyncMemoryError naming rank {failing} on every rank, got {message!r}")
    metric._computed = None
    _close("CatMetric after the failure", metric.compute(), data, rtol=0, atol=0)
    return f"rank {failing} failed to allocate: every rank raised SyncMemoryError; the next sync was exact"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("skewed-broadcast", "a skewed cat state by per-rank broadcasts, chunked by the cap", _skewed_broadcast),
    Scenario(
        "skewed-to-one-rank",
        "compute_on_rank of skewed cat states: each rank's true bytes to the destination only",
        _skewed_to_one_rank,
    ),
    Scenario("allocation-fails", "one rank cannot allocate: SyncMemoryError on every rank", _allocation_fails),
)
