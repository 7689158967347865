"""Log scalars exactly with Accelerate: ``accelerate launch examples/logged_scalars_accelerate.py``.

Accelerate's ``gather``/``reduce`` of a per-rank loss averages per-rank means; a ``ScalarLog`` updated with each
batch's size gives the mean over every sample of every rank, whatever the ranks hold (here ``even_batches=False``:
21 samples in batches of 5, so on 2 ranks one rank runs a batch more than the other).
"""

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from torchmetrics_varlen import ScalarLog


def main() -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
    data = TensorDataset(torch.arange(21, dtype=torch.float64))
    loader = accelerator.prepare(DataLoader(data, batch_size=5))
    scalars = ScalarLog(reduce={"samples": "sum", "largest": "max"})
    for (x,) in loader:
        scalars.update({"value": x.mean(), "samples": len(x), "largest": x.max()}, weight=len(x))
    logged = scalars.compute()  # the same dict on every rank: log it from the main process
    if accelerator.is_main_process:
        print("logged:", logged)  # value: 10.0, the mean of 0..20
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
