"""The scale benchmark end to end in its quick mode: the structure of its report and bytes that follow from the sizes.

No timing is asserted. The byte checks recompute, from the states' sizes alone, what each side must receive per rank,
so they fail if the meter, the plan model or the routing of reducible states breaks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.scale_plan import stock_bytes
from benchmarks.scale_procs import case_sizes

ROOT = Path(__file__).resolve().parents[1]


def _run(args, timeout):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def test_scale_quick_report(tmp_path):
    json_path, table_path, plot_path = tmp_path / "scale.json", tmp_path / "scale.rst", tmp_path / "scale.png"
    args = ["bench", "--scale", "--quick", "--json", str(json_path), "--table", str(table_path)]
    out = _run([sys.executable, "-m", "benchmarks", *args, "--plot", str(plot_path)], timeout=240)
    result = json.loads(json_path.read_text())
    assert result["world_sizes"] == [2, 4]
    assert set(result) >= {"bytes", "extended", "model_checks", "planner", "latency"}
    rows = {(row["case"], row["world_size"], row["side"]): row for row in result["bytes"]}
    assert {case for case, _, _ in rows} == set(result["cases"]) and len(rows) == 4 * 2 * 2
    for row in result["bytes"]:
        for key in ("collectives", "received", "buffers", "largest"):
            assert len(row[key]) == row["world_size"], row  # one figure per rank

    classes = case_sizes(quick=True)["classes"]
    matrix = f"MulticlassConfusionMatrix({classes})"
    state = torch.zeros(classes, classes, dtype=torch.int64)
    for world in (2, 4):
        # Stock: a shape gather and a state gather per rank, whatever W: world x (16 + state bytes).
        assert rows[(matrix, world, "stock")]["received"] == [world * (16 + state.numel() * 8)] * world
        assert rows[(matrix, world, "stock")]["received"] == [stock_bytes([state], world)["received"]] * world
    ours = rows[(matrix, 4, "varlen")]
    # Ours on 4 ranks: the matrix by all-reduce (its bytes once), plus the metadata; fewer bytes than stock.
    assert all(state.numel() * 8 <= got < 2 * state.numel() * 8 for got in ours["received"]), ours
    assert max(ours["received"]) < min(rows[(matrix, 4, "stock")]["received"])
    assert ours["collectives"] == [2] * 4  # metadata + one all-reduce
    assert all(check["matches"] for check in result["model_checks"]), result["model_checks"]
    assert [row["world_size"] for row in result["planner"]] == [8, 64]
    assert all(row["plan_unpack_ms"] > 0 for row in result["planner"])
    assert {"stock compute", "varlen compute", "floor", "bare", "sync_speedup"} <= set(result["latency"][0])
    assert all(row["bare"] > 0 and row["bare_to_floor"] == row["bare"] / row["floor"] for row in result["latency"])
    assert "bare/1 gather" in table_path.read_text()
    assert table_path.read_text().startswith("::\n") and "Bytes per rank" in out
    assert plot_path.read_bytes()[:4] == b"\x89PNG"


def test_scale_flag_is_listed():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "bench", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0 and "--scale" in result.stdout and "--no-skew" in result.stdout
