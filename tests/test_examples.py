"""The example and the demo run as users start them: spawned by themselves, and under torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(args, timeout=180):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def test_ddp_soft_f1_example_trains():
    out = _run([sys.executable, "examples/ddp_soft_f1.py", "--world-size", "2", "--steps", "3"])
    assert out.count("global-batch soft-F1 loss") == 3
    assert "epoch soft-F1 loss over all ranks' samples" in out


@pytest.mark.parametrize("target", [["examples/ddp_soft_f1.py", "--steps", "3"], ["-m", "torchmetrics_varlen", "demo"]])
def test_runs_unchanged_under_torchrun(target):
    out = _run([*TORCHRUN, *target])
    if "demo" in target:
        assert "torchmetrics_varlen MetricCollection" in out and "yes, exactly" in out
        assert "skipped: aborts under torchrun" in out
    else:
        assert "epoch soft-F1 loss" in out
