"""Train a small classifier with DDP on gloo CPU, with a soft-F1 loss over the global batch.

Every rank holds a different amount of data (so ranks run different numbers of steps): the loss is synced across
ranks at every step, and ``torchmetrics_varlen.join`` lets ranks that ran out of data shadow
the others, so nothing hangs.

    python examples/ddp_soft_f1.py --world-size 2 --steps 5      # spawns its own processes
    torchrun --nproc-per-node 2 examples/ddp_soft_f1.py --steps 5 # or under torchrun
"""

import argparse
import datetime
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchmetrics_varlen
from torchmetrics_varlen import MetricCollection
from torchmetrics_varlen.losses import SoftF1Loss


def make_data(rank: int, world_size: int, steps: int, batch_size: int = 16):
    """Rank r gets fewer batches than rank 0 (uneven data), from one shared synthetic problem."""
    gen = torch.Generator().manual_seed(1234)
    weights = torch.randn(8, generator=gen)
    n_batches = max(steps - rank, 1)
    gen.manual_seed(rank)
    batches = []
    for _ in range(n_batches):
        x = torch.randn(batch_size - rank, 8, generator=gen)
        y = (x @ weights + 0.3 * torch.randn(x.shape[0], generator=gen) > 0).float()
        batches.append((x, y))
    return batches


def train(rank: int, world_size: int, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # Join shadows per-step syncs, which a differentiable gather cannot offer: sync_grads=False inside Join, and the
    # loss is scaled by the world size so that DDP's mean gives the single-process gradient.
    loss_fn = SoftF1Loss(sync_grads=False)
    epoch_metrics = MetricCollection({"loss": SoftF1Loss(dist_sync_on_step=False, sync_grads=False)})
    with torchmetrics_varlen.join(model, loss_fn):
        for step, (x, y) in enumerate(make_data(rank, world_size, steps)):
            probs = torch.sigmoid(model(x).squeeze(-1))
            loss = loss_fn(probs, y)  # the soft-F1 loss of this step's global batch
            (loss * world_size).backward()
            optimizer.step()
            optimizer.zero_grad()
            epoch_metrics.update(probs.detach(), y)
            if rank == 0:
                print(f"step {step}: global-batch soft-F1 loss {loss.item():.4f}", flush=True)
    summary = epoch_metrics.compute()  # every rank takes part; the value is the same everywhere
    if rank == 0:
        print(f"epoch soft-F1 loss over all ranks' samples: {summary['loss'].item():.4f}", flush=True)


def _spawned(rank: int, world_size: int, steps: int, init_file: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        train(rank, world_size, steps)
    finally:
        gc.collect()  # a DDP model in a reference cycle holds the group: freed first, destroying ends its threads
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args.steps)
        finally:
            gc.collect()
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.world_size, args.steps, os.path.join(tmp, "rendezvous")), nprocs=args.world_size)


if __name__ == "__main__":
    main()
