"""The one fast path (``_repeat``): repeated small syncs take it and equal stock on all the data; switched off
(``TORCHMETRICS_VARLEN_FAST_PATH=0``), the core of the suite passes unchanged."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _helpers import fast_path_taken
from conftest import run_distributed
from torchmetrics.classification import BinaryAccuracy, MulticlassStatScores
from torchmetrics.regression import MeanSquaredError

from torchmetrics_varlen import _repeat, rebase

# The suite's core: the base class, the collection, the hook and stock parity (test_repeat.py tests the fast path
# itself, so it is left out).
CORE = ("test_metric.py", "test_collection.py", "test_gather_hook.py", "test_parity.py")


def _stock_metrics_body(rank, world_size):
    torch.manual_seed(7)
    data = [(torch.rand(5 + 3 * r), torch.randint(0, 2, (5 + 3 * r,))) for r in range(world_size)]
    classes = [(torch.randint(0, 4, (6 + r,)), torch.randint(0, 4, (6 + r,))) for r in range(world_size)]
    cases = [
        (BinaryAccuracy, {}, data),
        (MulticlassStatScores, {"num_classes": 4, "average": None}, classes),
        (MeanSquaredError, {}, data),
    ]
    with fast_path_taken() as taken:
        for cls, kwargs, inputs in cases:
            ours, stock = rebase(cls)(**kwargs), cls(**kwargs, sync_on_compute=False)  # stock: all the data here
            for step in range(3):
                ours.update(*inputs[rank])
                for other in range(world_size):
                    stock.update(*inputs[other])
                got, expected = ours.compute(), stock.compute()
                ours._computed = None
                assert type(got) is type(expected) and got.dtype == expected.dtype, (cls, got, expected)
                assert torch.allclose(got, expected, rtol=0, atol=1e-6), (cls, step, got, expected)
                with ours.sync_context():  # the synced states themselves are stock's: dtypes, shapes, values
                    for name in ours._defaults:
                        mine, theirs = getattr(ours, name), getattr(stock, name)
                        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (cls, name)
                        if not mine.is_floating_point():
                            assert torch.equal(mine, theirs), (cls, name, mine, theirs)
    dist.barrier()
    return sum(taken)


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_small_syncs_take_the_fast_path_and_equal_stock(world_size):
    for taken in run_distributed(_stock_metrics_body, world_size):
        assert taken >= 3 * 4, taken  # each case's syncs after its first (compute and sync_context, three steps)


def test_the_core_suite_passes_with_the_fast_path_switched_off():
    here = Path(__file__).parent
    env = {**os.environ, "TORCHMETRICS_VARLEN_FAST_PATH": "0"}  # read at import, in every spawned rank too
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *CORE]
    done = subprocess.run(command, cwd=here, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout.splitlines()[-1], done.stdout[-2000:]


def test_the_switch_is_read():
    code = "import torchmetrics_varlen._repeat as r; print(r.ENABLED)"
    env = {**os.environ, "TORCHMETRICS_VARLEN_FAST_PATH": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False" and _repeat.ENABLED
