"""The demo: each section at world size 2 exits 0 with its "ours" rows matching the truth; the exit gate can fail."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_distributed

from benchmarks.demo import report2, report4

ROOT = Path(__file__).resolve().parents[1]

# Rows that must appear in each section's output (measured outcomes, not their numbers).
EXPECTED = {
    1: ["ours: MetricCollection", "ours: IndexedMetric + sample_index", "yes, exactly", "NO: auroc"],
    2: ["ours: SoftF1Loss(sync_grads=True)", "NO: 0.50 x the gradient", "NO: no gradient"],
    3: ["HANG: no progress in 8 s, ranks killed", "yes, on every rank"],
    4: ["NO: a mean of per-rank means", "ours: MetricCollection(MeanMetric)"],
    5: ["HANG: no progress in 8 s, ranks killed", "SyncTimeoutError after", "ranks [1]", "yes, on every rank"],
}


@pytest.mark.parametrize("report", sorted(EXPECTED))
def test_section_at_world_size_two(report):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    args = [sys.executable, "-m", "benchmarks", "demo", "--world-size", "2", "--report", str(report)]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    out = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\n{out[-3000:]}\n{result.stderr[-3000:]}"
    assert out.startswith(f"{report}. ") and "every 'ours' row matches the truth" in out, out
    for text in EXPECTED[report]:
        assert text in out, f"{text!r} missing from\n{out}"
    ours = [line for line in out.splitlines() if line.startswith("ours:") and "dist_reduce_fx" not in line]
    assert ours and all(" yes" in line or "Error after" in line for line in ours), out


def test_exit_gate_fails_on_a_wrong_ours_row():
    good = {"value": float(torch.cat([report4.correct(0), report4.correct(1)]).double().mean()), "warnings": []}
    rows = {method.name: [good, good] for method in report4.methods(2)}
    assert report4.render(2, rows).ok
    rows["ours: MetricCollection(MeanMetric)"] = [dict(good, value=good["value"] + 0.01)] * 2
    assert not report4.render(2, rows).ok
    rows["ours: MetricCollection(MeanMetric)"] = "HANG: no progress in 8 s, ranks killed"
    assert not report4.render(2, rows).ok


def test_section_two_gradient_equals_an_independent_single_process_gradient():
    """The DDP gradient of the "ours" method against the test's own single-process autograd on the whole batch."""
    results = run_distributed(report2.train_step, 2, kind="ours")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Flatten(0), torch.nn.Sigmoid()).double()
    x = torch.cat([report2.batch(0)[0], report2.batch(1)[0]])
    y = torch.cat([report2.batch(0)[1], report2.batch(1)[1]]).double()
    p = model(x)
    tp, fp, fn = (p * y).sum(), (p * (1 - y)).sum(), ((1 - p) * y).sum()
    (1 - 2 * tp / (2 * tp + fp + fn + 1e-8)).backward()
    expected = torch.cat([param.grad.flatten() for param in model.parameters()])
    for result in results:
        torch.testing.assert_close(result["grad"], expected)


_DESTROYS_ITS_GROUP = """
import torch.distributed as dist
from benchmarks.demo import run_under_torchrun

assert not dist.is_initialized()
ok = run_under_torchrun([4])
assert ok, "report 4 failed"
assert not dist.is_initialized(), "the demo left its process groups alive"
print("destroyed")
"""


def test_demo_under_torchrun_destroys_the_groups_it_made():
    """Exiting with gloo groups alive can abort the process (SIGABRT) after the demo printed its verdict.

    A gloo worker thread may still be releasing the last collective's tensors when the interpreter finalizes; it is
    then killed inside a C++ destructor ("terminate called without an active exception"). The demo destroys the
    groups it made, which joins those threads first. Checked in a fresh process with torchrun's environment.
    """
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONWARNINGS="ignore", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = [sys.executable, "-c", _DESTROYS_ITS_GROUP]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and "destroyed" in result.stdout, f"exit {result.returncode}\n{result.stderr[-3000:]}"
