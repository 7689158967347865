"""Accelerate with ``even_batches=False``: this package's metrics, gather hook and collection are exact.

The script part (``main``) runs under ``torchrun`` as Accelerate users start a script (``accelerate launch`` is a
wrapper of the same launcher), with ``Accelerator(cpu=True)`` on gloo. 21 samples in batches of 5 on 2 ranks:
``even_batches=False`` gives rank 0 three batches (11 samples) and rank 1 two (10), each sample once. The metrics
synced by this package must equal one process on the 21 samples, and so must Accelerate's own way on the same data
(the default ``even_batches=True`` loader, which repeats samples to even the batches, and ``gather_for_metrics``,
which drops them again).
"""

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

N, BATCH = 21, 5


def _data():
    gen = torch.Generator().manual_seed(7)
    target = torch.randint(0, 2, (N,), generator=gen)
    scores = torch.sigmoid(1.5 * (target.float() - 0.5) + torch.randn(N, generator=gen))
    return torch.utils.data.TensorDataset(scores, target, torch.arange(N))


def main():
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader
    from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryAveragePrecision
    from torchmetrics.functional.classification import binary_auroc

    import torchmetrics_varlen as tv

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
    loader = accelerator.prepare(DataLoader(_data(), batch_size=BATCH))
    ours = tv.rebase(BinaryAUROC)(thresholds=None)  # this package's metric
    hooked = BinaryAUROC(thresholds=None, dist_sync_fn=tv.gather_all_tensors)  # stock metric, our gather hook
    collection = tv.MetricCollection({"acc": BinaryAccuracy(), "ap": BinaryAveragePrecision(thresholds=None)})
    seen, batches = [], 0
    for scores, target, index in loader:
        batches += 1
        seen += index.tolist()
        ours.update(scores, target)
        hooked.update(scores, target)
        collection.update(scores, target)
    result = {
        "rank": accelerator.process_index,
        "batches": batches,
        "seen": seen,
        "ours": ours.compute().item(),
        "hooked": hooked.compute().item(),
        "collection": {name: value.item() for name, value in collection.compute().items()},
    }
    # Accelerate's own way on the same data: padded even batches, duplicates dropped by gather_for_metrics.
    accelerator.even_batches = True
    even_loader = accelerator.prepare(DataLoader(_data(), batch_size=BATCH))
    gathered = [accelerator.gather_for_metrics((s, t)) for s, t, _ in even_loader]
    scores = torch.cat([s for s, _ in gathered])
    target = torch.cat([t for _, t in gathered])
    result["gather_for_metrics"] = {"n": len(scores), "auroc": binary_auroc(scores, target, thresholds=None).item()}
    with open(os.path.join(sys.argv[-1], f"rank{accelerator.process_index}.json"), "w") as out:
        json.dump(result, out)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group: one left to the interpreter exit can abort it


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_uneven_batches_are_exact(tmp_path):
    from _helpers import run_torchrun
    from torchmetrics.functional.classification import binary_accuracy, binary_auroc, binary_average_precision

    returncode, stdout, stderr = run_torchrun([__file__, str(tmp_path)], 240)
    assert returncode == 0, f"exit {returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    results = [json.loads(path.read_text()) for path in sorted(Path(tmp_path).glob("rank*.json"))]
    assert [r["rank"] for r in results] == [0, 1]
    scores, target, _ = _data().tensors
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auroc = binary_auroc(scores, target).item()
        expected_collection = {
            "acc": binary_accuracy(scores, target).item(),
            "ap": binary_average_precision(scores, target).item(),
        }
    assert sorted(i for r in results for i in r["seen"]) == list(range(N)), "each sample exactly once"
    assert [r["batches"] for r in results] == [3, 2], "even_batches=False: uneven batch counts, no repeats"
    for result in results:
        assert result["ours"] == pytest.approx(auroc, abs=1e-6)
        assert result["hooked"] == pytest.approx(auroc, abs=1e-6)
        assert result["collection"] == pytest.approx(expected_collection, abs=1e-6)
        assert result["gather_for_metrics"] == pytest.approx({"n": N, "auroc": auroc}, abs=1e-6)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
