"""Save metrics on some number of processes, resume them on another, and get one process's value.

torchrun --nproc-per-node 2 examples/checkpoint_resume.py save DIR     # 60 samples, then a checkpoint
torchrun --nproc-per-node 3 examples/checkpoint_resume.py resume DIR   # 40 more samples on 3 processes
"""

import os
import sys

import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC
from torchmetrics.functional.classification import binary_accuracy, binary_auroc

import torchmetrics_varlen as tv

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
phase, directory = sys.argv[1], sys.argv[2]
path = os.path.join(directory, "metrics.pt")

metrics = tv.MetricCollection({"acc": BinaryAccuracy(), "auroc": BinaryAUROC(thresholds=None)})
gen = torch.Generator().manual_seed(0)
scores, target = torch.rand(100, generator=gen), torch.randint(0, 2, (100,), generator=gen)
samples = torch.arange(0, 60) if phase == "save" else torch.arange(60, 100)  # before / after the checkpoint

if phase == "resume":
    tv.load_merged_state_dict(metrics, torch.load(path))  # every rank; the first one takes the saved state
mine = samples[rank::world]  # this rank's share
metrics.update(scores[mine], target[mine])
if phase == "save":
    state = tv.merged_state_dict(metrics)  # every rank: one sync, the global state on every rank
    if rank == 0:
        torch.save(state, path)
else:
    result = {name: round(value.item(), 6) for name, value in metrics.compute().items()}
    truth = {"acc": binary_accuracy(scores, target).item(), "auroc": binary_auroc(scores, target).item()}
    if rank == 0:
        print(f"resumed on {world} processes: {result}")
        print(f"one process on all 100 samples: { {name: round(value, 6) for name, value in truth.items()} }")
dist.destroy_process_group()
