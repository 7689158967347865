"""The GPU check (``benchmarks.gpu_check``) in its CI mode: every scenario's code runs on gloo.

``--cpu`` runs every scenario under ``torchrun`` on 2 gloo CPU processes: each must print PASS, except the ones only a
GPU can run (SKIP) and the group-after-timeout finding (NOTE where the backend cannot reuse the group). Without
``--cpu`` and without a GPU the check says so and exits 0, which is what ``nox -s gpu`` relies on here. The rendezvous
is ``--standalone`` (c10d on a free port, no fixed port) and each run has a hard timeout that kills its whole session.
"""

from pathlib import Path

import pytest
from _helpers import run_torchrun

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[1]
MODULE = ["-m", "benchmarks.gpu_check"]
TIMEOUT = 180  # seconds; a healthy --cpu run takes about 35 s on 2 shared cores
# What --cpu cannot stand in for
GPU_ONLY = {"mixed-devices", "device-id-no-set-device", "sync-in-cuda-stream", "shared-gpu-hint"}
FINDINGS = {"group-after-timeout"}  # PASS where the backend can reuse the group, NOTE (a finding) where it cannot


def _torchrun(args, tmp_path, **env_overrides):
    env = {"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path), **env_overrides}
    return run_torchrun([*MODULE, *args], TIMEOUT, **env)


def _verdicts(stdout):
    """``{scenario: (status, detail)}`` from the lines rank 0 printed."""
    verdicts = {}
    for line in stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in {"PASS", "FAIL", "SKIP", "NOTE"}:
            name, _, detail = rest.strip().partition(" ")
            assert name not in verdicts, f"{name} printed twice:\n{stdout}"
            verdicts[name] = (status, detail.strip())
    return verdicts


def test_every_scenario_passes_on_gloo_cpu(tmp_path):
    code, stdout, stderr = _torchrun(["--cpu"], tmp_path)
    output = f"{stdout[-4000:]}\n{stderr[-4000:]}"
    assert code == 0, f"exit {code}\n{output}"
    verdicts = _verdicts(stdout)
    assert list(verdicts) == [scenario.name for scenario in gpu_check.SCENARIOS], output
    for name, (status, detail) in verdicts.items():
        allowed = {"SKIP"} if name in GPU_ONLY else {"PASS", "NOTE"} if name in FINDINGS else {"PASS"}
        assert status in allowed, f"{name}: {status} {detail}\n{output}"
        assert detail, f"{name} printed no detail"
    assert "names rank 1" in verdicts["missing-rank"][1]
    assert "no error" in verdicts["late-rank"][1]
    assert "mode cpu (job group gloo), 2 ranks" in stdout
    assert "gpu_check: " in stdout.splitlines()[-1] and " 0 failed" in stdout.splitlines()[-1], output


def test_list_prints_every_scenario_without_gpu_or_torchrun(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert gpu_check.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [scenario.name for scenario in gpu_check.SCENARIOS]
    names = {line.split()[0] for line in lines}
    # issue 20's scenarios about where a sync runs
    assert {"two-backend-empty-rank", "device-id-no-set-device", "sync-grads-cpu-states"} <= names
    assert {"sync-grads-cuda-states", "sync-in-cuda-stream"} <= names
    # issue 20's Join and timeout scenarios
    assert {"join-device-states", "join-plain-metrics-first", "join-metrics-alone"} <= names
    assert {"timeout-group-shorter", "timeout-group-longer", "timeout-blocking-wait", "busy-compute-on-rank"} <= names
    # the scenarios that leave a collective pending on the job's group come last
    assert [line.split()[0] for line in lines][-2:] == ["missing-rank", "group-after-timeout"]


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    code, stdout, stderr = _torchrun([], tmp_path, CUDA_VISIBLE_DEVICES="")
    assert code == 0, f"exit {code}\n{stdout}\n{stderr[-3000:]}"
    assert stdout.count(gpu_check.NO_GPU_MESSAGE) == 1, stdout  # said once, by rank 0
    assert not _verdicts(stdout)


def _fails(ctx):
    raise AssertionError("got 1 but one process gives 2")


def _skips(ctx):
    raise gpu_check.SkipError("needs a GPU")


def _notes(ctx):
    raise gpu_check.NoteError("not reusable")


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        (lambda ctx: "fine", ("PASS", "fine")),
        (_fails, ("FAIL", "AssertionError: got 1 but one process gives 2")),
        (_skips, ("SKIP", "needs a GPU")),
        (_notes, ("NOTE", "not reusable")),
    ],
)
def test_each_outcome_is_reported(run, expected, capsys):
    assert gpu_check._run_one(None, gpu_check.Scenario("x", "x", run)) == expected


def test_one_failing_rank_fails_the_scenario():
    combine = gpu_check._combine
    assert combine([("PASS", "a"), ("PASS", "b")]) == ("PASS", "a")
    assert combine([("PASS", "a"), ("FAIL", "boom")]) == ("FAIL", "rank 1: boom")
    assert combine([("FAIL", "x"), ("NOTE", "n"), ("FAIL", "y")]) == ("FAIL", "rank 0: x (ranks [0, 2])")
    assert combine([("PASS", "a"), ("NOTE", "n")]) == ("NOTE", "rank 1: n")
    assert combine([("SKIP", "gpu"), ("SKIP", "gpu")]) == ("SKIP", "gpu")


def test_the_one_rank_half_runs_on_gloo_cpu(tmp_path):
    # One process, a 1-rank world forced to sync: the code of every scenario of the one-GPU mode's NCCL half.
    import subprocess
    import sys

    env = {"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path), "MASTER_PORT": "0", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_one_rank", "--cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verdicts = _verdicts(done.stdout)
    from benchmarks import gpu_one_rank

    assert list(verdicts) == list(gpu_one_rank.SCENARIOS), done.stdout
    cuda_only = {"side-stream", "autograd-thread", "memory-after-compute", "blocking-wait-group"}
    cuda_only |= {"default-mode-watchdog", "no-stream-sync"}
    for name, (status, detail) in verdicts.items():
        assert status == ("SKIP" if name in cuda_only else "PASS"), (name, status, detail)
    assert "123 s read from the gloo backend's options" in verdicts["group-timeout"][1]
