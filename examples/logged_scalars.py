"""Log losses and counters from a plain DDP loop, exactly: weighted over every rank's samples, in one collective.

Each rank holds a different number of samples per batch, and only some ranks produce some keys (a loss term of
rank 0's batches, a per-rank counter). The usual recipe, ``all_reduce(loss); loss /= world_size``, averages per-rank
means; ``sync_scalars`` and ``ScalarLog`` weigh every sample once, as one process would.

    python examples/logged_scalars.py --world-size 2 --steps 6       # spawns its own processes
    torchrun --nproc-per-node 2 examples/logged_scalars.py --steps 6 # or under torchrun
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchmetrics_varlen import ScalarLog, sync_scalars


def train(rank: int, world_size: int, steps: int, log_every: int = 3) -> None:
    gen = torch.Generator().manual_seed(rank)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scalars = ScalarLog(reduce={"samples": "sum", "grad_norm": "max"})  # other keys: the weighted mean
    for step in range(1, steps + 1):
        x = torch.randn(8 * (rank + 1), 4, generator=gen)  # rank r sees 8 (r + 1) samples per step
        loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
        loss.backward()
        optimizer.step()
        values = {"loss": loss.detach(), "samples": len(x), "grad_norm": model.module.weight.grad.norm()}
        if rank == 0:
            values["aux_loss"] = 0.1 * loss.detach()  # a key only rank 0 produces
        scalars.update(values, weight=len(x))
        optimizer.zero_grad()
        # Per step, one line: the exact mean over this step's samples of all ranks (one collective, no barrier).
        step_loss = sync_scalars({"loss": loss.detach()}, weight=len(x))["loss"]
        if rank == 0:
            print(f"step {step}: loss over all ranks' samples {step_loss:.4f}")
        if step % log_every == 0:  # per logging window: every key of every rank, one collective once keys are known
            window = scalars.compute()
            scalars.reset()
            if rank == 0:
                print("window:", {key: round(value, 4) for key, value in window.items()})


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
