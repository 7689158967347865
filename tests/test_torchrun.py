"""A real ``lightning.Trainer(strategy="ddp", accelerator="cpu", devices=2)`` under ``torchrun``, as users run it.

Lightning detects torchrun's environment and initialises the gloo process group itself (env://), the path that the
in-process tests of ``test_lightning.py`` skip. The logged epoch values must equal one process on the full validation
set. The demo and the example under torchrun are tested by ``test_examples.py``. The rendezvous is ``--standalone``
(c10d on a free port), so parallel runs on one machine cannot collide, and the run has a hard timeout: a hang fails
the test instead of stalling the suite.
"""

import importlib.util
import json
from pathlib import Path

import pytest
from _helpers import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds; a healthy run takes 10-25 s on 2 cores


def _torchrun(args):
    returncode, stdout, stderr = run_torchrun(args, TIMEOUT)
    assert returncode == 0, f"exit {returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return stdout


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_lightning_ddp_strategy_under_torchrun(tmp_path):
    from test_lightning import N_VAL, check_fit_results

    # UnpaddedDistributedSampler (Lightning's padding sampler is checked in-process by test_lightning.py).
    out = _torchrun(["tests/test_lightning.py", str(tmp_path)])
    written = sorted(tmp_path.glob("rank*.json"))
    assert [path.name for path in written] == ["rank0.json", "rank1.json"], out[-3000:]
    results = [json.loads(path.read_text()) for path in written]
    assert [row["rank"] for row in results] == [0, 1]
    expected = check_fit_results(results, unpadded=True)
    assert expected["val_count"] == N_VAL
