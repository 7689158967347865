"""Log every step without waiting for the other ranks: ``compute_async()`` in a plain DDP loop.

Each step updates a ``ScalarLog`` and starts its sync with ``compute_async()``; the loop goes on at once. Finished
windows are printed in step order, each labelled with the step that produced it, and every pending one is printed
before the loop ends. Every few steps a metric over all samples so far (``BinaryAUROC``) is computed the same way.
The values are exactly what ``compute()`` would have returned at each call, on every rank.

    python examples/async_logging.py --world-size 2 --steps 6       # spawns its own processes
    torchrun --nproc-per-node 2 examples/async_logging.py --steps 6 # or under torchrun
"""

import argparse
import os
import tempfile
from collections import deque

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchmetrics.classification import BinaryAUROC

from torchmetrics_varlen import ScalarLog, rebase


def train(rank: int, world_size: int, steps: int, eval_every: int = 3) -> None:
    gen = torch.Generator().manual_seed(rank)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scalars = ScalarLog(reduce={"samples": "sum"})  # "loss": the weighted mean over every rank's samples
    auroc = rebase(BinaryAUROC)(thresholds=None)
    pending: deque = deque()  # (step, what, future), oldest first

    def write(block: bool) -> None:  # the finished rows, in step order; all of them when `block`
        while pending and (block or pending[0][2].done()):
            step, what, future = pending.popleft()
            value = future.result()
            if rank == 0:
                print(f"step {step} {what}: {value if isinstance(value, dict) else round(value.item(), 4)}")

    for step in range(1, steps + 1):
        x = torch.randn(8 * (rank + 1), 4, generator=gen)  # rank r sees 8 (r + 1) samples per step
        y = (x.sum(1) > 0).long()
        scores = model(x).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, y.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scalars.update({"loss": loss.detach(), "samples": len(x)}, weight=len(x))
        auroc.update(scores.detach().sigmoid(), y)
        pending.append((step, "scalars", scalars.compute_async()))  # returns at once: the sync runs elsewhere
        scalars.reset()  # at once too: the pending sync owns a copy of the window
        if step % eval_every == 0:
            pending.append((step, "auroc so far", auroc.compute_async()))
        write(block=False)
    write(block=True)


def _spawned(rank: int, world_size: int, steps: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        train(rank, world_size, steps)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args.steps)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.world_size, args.steps, os.path.join(tmp, "rendezvous")), nprocs=args.world_size)


if __name__ == "__main__":
    main()
