"""The example and the demo run as users start them: spawned by themselves, and under torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(args, timeout=180):
    # This checkout's package first (a script's own directory, not the root, is first on its path).
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=path)
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def test_ddp_soft_f1_example_trains():
    out = _run([sys.executable, "examples/ddp_soft_f1.py", "--world-size", "2", "--steps", "3"])
    assert out.count("global-batch soft-F1 loss") == 3
    assert "epoch soft-F1 loss over all ranks' samples" in out


def test_async_logging_example_prints_every_step_in_order():
    out = _run([sys.executable, "examples/async_logging.py", "--world-size", "2", "--steps", "6"])
    rows = [line for line in out.splitlines() if line.startswith("step ")]
    steps = [int(line.split()[1]) for line in rows]
    assert steps == sorted(steps) and steps.count(3) == 2 and len(rows) == 8, out  # 6 windows, 2 AUROCs
    assert all("'samples': 24.0" in line for line in rows if "scalars" in line), out  # 8 + 16 samples a step


@pytest.mark.parametrize("target", [["examples/ddp_soft_f1.py", "--steps", "3"], ["-m", "benchmarks", "demo"]])
def test_runs_unchanged_under_torchrun(target):
    out = _run([*TORCHRUN, *target])
    if "demo" in target:
        assert "ours: MetricCollection" in out and "yes, exactly" in out
        assert "skipped: hangs under torchrun" in out and "every 'ours' row matches the truth" in out
    else:
        assert "epoch soft-F1 loss" in out


def test_bench_quick_runs_and_reports_its_collectives(tmp_path):
    """The benchmark command end to end (small sizes): its JSON and table, not its timings."""
    import json

    json_path, table_path, plot_path = tmp_path / "bench.json", tmp_path / "table.rst", tmp_path / "bench.png"
    args = ["--quick", "--repeats", "2", "--memory-samples", "100000", "--json", str(json_path)]
    args += ["--plot", str(plot_path), "--skew-world-size", "3", "--skew-base", "2000", "--skew-factor", "4"]
    out = _run([sys.executable, "-m", "benchmarks", "bench", *args, "--table", str(table_path)], timeout=300)
    result = json.loads(json_path.read_text())
    cases = {row["case"]: row for row in result["rows"]}
    assert {"8-metric collection: sync only", "50 small metrics: sync only", "big cat state"} <= set(cases)
    for row in result["rows"]:  # 1 when data rides along; the big cat state: metadata + one broadcast per rank
        assert row["varlen_collectives"] <= (1 + 2 if row["case"] == "big cat state" else 2), row
    assert cases["8-metric collection: sync only"]["stock_collectives"] > 2
    assert cases["big cat state"]["floor_ms"] > 0
    memory = result["memory"]
    values = memory["all_gather"]["value"] + memory["one_rank"]["value"]
    assert len(set(values)) == 1, values  # the same AUROC on every rank, by both paths
    assert table_path.read_text().startswith("::\n") and "compute_on_rank(dst=0)" in out
    # The large-state cases: the skew case on the ranks asked for, the memory case; their tables and plots beside.
    skew, sync_memory = result["large"]["skew"], result["large"]["sync_memory"]
    assert skew["sizes"] == [2000, 2000, 8000] and skew["true_bytes"] == 12000 * 4
    assert skew["padded"]["received"] == [3 * 8000 * 4] * 3  # W x the largest, on every rank
    assert [row["world_size"] for row in sync_memory] == [2] and sum(sync_memory[0]["sizes"]) == 400_000
    for suffix in ("skew", "sync_memory"):
        assert (tmp_path / f"table_{suffix}.rst").read_text().startswith("::\n")
        assert (tmp_path / f"bench_{suffix}.png").read_bytes()[:4] == b"\x89PNG"
    assert "Skewed cat state: 3 gloo ranks" in out and "Memory of sync() alone" in out
    assert "Syncs off the critical path" in out and len(result["async"]) == 7
