"""A peer's end under the three launchers ranks are started with: the survivors' errors claim only what the ended
rank's exit note could see (issue 47).

Three ranks; rank 1 syncs once, then crashes (an uncaught ``ValueError``) or returns early (a clean exit); ranks 0
and 2 sync once more and write the error they got to a file. The launchers: ``torchrun`` (each rank a plain script),
``torch.multiprocessing.spawn`` and ``multiprocessing.Process`` (the spawn start method). Every run rendezvouses
through a file in a fresh temporary directory, has a process-group timeout, and a parent deadline that kills every
rank. Run as a script, this module is one rank under ``torchrun``.
"""

import ast
import datetime
import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from _helpers import run_torchrun
from _metrics import Total
from conftest import PG_TIMEOUT

from torchmetrics_varlen import SyncError
from torchmetrics_varlen._engine import wait

ROOT = Path(__file__).resolve().parents[1]
WORLD = 3
ENDING = 1  # the rank that ends after the first sync
DEADLINE = 240  # seconds for a run, from the start to every rank's end; a healthy one takes 10-30 s on 2 busy cores
GRACE = 30  # seconds torch.multiprocessing.spawn leaves the other ranks after one failed, before it terminates them
CRASH = "a bug in this rank's own code"
# What no message may claim: the exit notes never see a clean exit (see wait._exit_kind).
CLAIMS = ("nothing crashed", "exited normally", "no crash", "without an error")


def rank_main(rank, world_size, init_file, out_dir, ending):
    """One rank: a sync on every rank; then rank ``ENDING`` crashes or returns, the others sync once more."""
    timeout = datetime.timedelta(seconds=PG_TIMEOUT)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
    )
    metric = Total(sync_timeout=30)
    metric.update(torch.ones(2))
    metric.compute()  # every rank
    if rank == ENDING:
        if ending == "crash":
            raise ValueError(CRASH)  # caught by neither this function nor its caller
        return  # a clean early end (as a rank whose `fit` is over): it syncs no more
    metric.update(torch.ones(2))
    try:
        metric.compute()  # as under `if trainer.is_global_zero:`
        result = {"type": "no error", "message": ""}
    except SyncError as err:
        result = {"type": type(err).__name__, "message": str(err)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------------- launchers
def _torchrun(tmp_path, ending):
    """The ranks under ``torchrun``: this module as each worker's script. Returns (return code, stderr)."""
    args = ["tests/test_exits.py", str(tmp_path / "rdv"), str(tmp_path), ending]
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])  # this checkout's package, and the tests' helpers
    returncode, _, stderr = run_torchrun(args, DEADLINE, nproc=WORLD, PYTHONPATH=path)
    return returncode, stderr


def _spawn(tmp_path, ending):
    """The ranks under ``torch.multiprocessing.spawn``. Returns the launcher's exception (None when it raised none)."""
    context = torch_mp.spawn(
        rank_main, args=(WORLD, str(tmp_path / "rdv"), str(tmp_path), ending), nprocs=WORLD, join=False
    )
    end = time.monotonic() + DEADLINE
    try:
        # As `spawn(join=True)` does, with a deadline, and a grace before the other ranks are terminated: it stops
        # them as soon as one failed, and the survivors' messages are what this test reads.
        while not context.join(timeout=1.0, grace_period=GRACE):
            if time.monotonic() > end:
                pytest.fail(f"the ranks did not end within {DEADLINE} s", pytrace=False)
    except torch_mp.ProcessRaisedException as err:
        return err
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return None


def _processes(tmp_path, ending):
    """The ranks as ``multiprocessing.Process`` objects (spawn start). Returns their exit codes."""
    ctx = multiprocessing.get_context("spawn")
    args = (WORLD, str(tmp_path / "rdv"), str(tmp_path), ending)
    procs = [ctx.Process(target=rank_main, args=(rank, *args)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    end = time.monotonic() + DEADLINE
    try:
        for proc in procs:
            proc.join(timeout=max(0.0, end - time.monotonic()))
        assert not any(proc.is_alive() for proc in procs), f"the ranks did not end within {DEADLINE} s"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [proc.exitcode for proc in procs]


# -------------------------------------------------------------------------------------------- what they claim
def _results(tmp_path, log=""):
    found = {}
    for rank in range(WORLD):
        if rank != ENDING:
            path = tmp_path / f"rank{rank}.json"
            assert path.exists(), f"rank {rank} wrote no result\n{log[-5000:]}"
            found[rank] = json.loads(path.read_text())
    return found


def _check_no_false_claim(message):
    lowered = message.lower()
    for claim in CLAIMS:
        assert claim not in lowered, (claim, message)


def _check_crash_named(results):
    """The exit note saw the exception: the survivors say that rank crashed, with its type, and nothing else."""
    for rank, result in results.items():
        message = result["message"]
        assert result["type"] == "SyncPeerError", (rank, result)
        assert f"ranks [{ENDING} (ValueError)] exited after an uncaught exception" in message, message
        assert "may have crashed" not in message and "fewer syncs" not in message, message
        _check_no_false_claim(message)


def _check_cannot_tell(results, reason):
    """The exit note saw no exception: the survivors say the process ended, may have crashed, then the other cause."""
    for rank, result in results.items():
        message = result["message"]
        assert result["type"] == "SyncTimeoutError", (rank, result)
        assert f"rank {rank} waited at this sync while the processes of ranks [{ENDING}] ended." in message, message
        assert f"Ranks [{ENDING}] may have crashed: {reason}" in message, message
        # The crash and where its traceback is come first; the uneven syncs only after them.
        assert message.index("may have crashed") < message.index("traceback") < message.index("fewer syncs"), message
        assert message.index("fewer syncs") < message.index("is_global_zero"), message
        assert "uncaught exception" not in message.replace("no uncaught exception", ""), message
        _check_no_false_claim(message)


MULTIPROCESSING = "they are multiprocessing workers, whose launcher (`multiprocessing`, `torch.multiprocessing.spawn`)"
PLAIN = "no uncaught exception reached their interpreters, but a script or launcher that catches the exception itself"


def test_torchrun_a_crash_is_named_with_its_type(tmp_path):
    returncode, stderr = _torchrun(tmp_path, "crash")
    assert returncode != 0 and f"ValueError: {CRASH}" in stderr, (returncode, stderr[-5000:])  # rank 1 crashed
    _check_crash_named(_results(tmp_path, stderr))


def test_torchrun_a_clean_early_exit_is_not_called_clean(tmp_path):
    # No exception reached the interpreter; a script that catches its own and ends with sys.exit(1) reads the same.
    returncode, stderr = _torchrun(tmp_path, "return")
    assert returncode == 0, (returncode, stderr[-5000:])
    _check_cannot_tell(_results(tmp_path, stderr), PLAIN)


def test_spawn_a_crash_is_not_called_a_clean_exit(tmp_path):
    # Before: "ranks [1] exited normally (their processes ended without an error: nothing crashed)".
    raised = _spawn(tmp_path, "crash")
    assert raised is not None and raised.error_index == ENDING and CRASH in str(raised), raised  # rank 1 crashed
    _check_cannot_tell(_results(tmp_path, str(raised)), MULTIPROCESSING)


def test_spawn_a_clean_early_exit_is_not_called_clean(tmp_path):
    assert _spawn(tmp_path, "return") is None
    _check_cannot_tell(_results(tmp_path), MULTIPROCESSING)


def test_process_a_crash_is_not_called_a_clean_exit(tmp_path):
    exitcodes = _processes(tmp_path, "crash")
    assert exitcodes == [0, 1, 0], exitcodes  # rank 1 crashed; the survivors caught their error
    _check_cannot_tell(_results(tmp_path), MULTIPROCESSING)


def test_process_a_clean_early_exit_is_not_called_clean(tmp_path):
    assert _processes(tmp_path, "return") == [0, 0, 0]
    _check_cannot_tell(_results(tmp_path), MULTIPROCESSING)


# ------------------------------------------------------------------------------------------ without processes
def test_the_exit_note_says_only_what_the_process_saw(monkeypatch):
    monkeypatch.delattr(sys, "last_exc", raising=False)
    monkeypatch.delattr(sys, "last_value", raising=False)
    monkeypatch.setattr(wait.multiprocessing, "parent_process", lambda: None)
    assert wait._exit_kind() == "ended"  # a plain interpreter: no exception seen
    monkeypatch.setattr(wait.multiprocessing, "parent_process", lambda: object())
    assert wait._exit_kind() == "ended multiprocessing"  # a worker whose launcher catches its exception
    monkeypatch.setattr(sys, "last_value", KeyError("k"), raising=False)
    assert wait._exit_kind() == "exception KeyError"  # an exception reached the top of the main thread


def test_a_timeout_says_which_ended_peers_may_have_crashed():
    exited = [("1", 1, "ended"), ("2", 2, "ended multiprocessing"), ("3", 3, "exception ValueError")]
    text = wait.describe({"missing": [("4", 4, "")], "elsewhere": [], "exited": exited})
    assert "Missing: ranks [4]" in text and "Ended: the processes of ranks [1, 2] ended." in text, text
    assert f"Ranks [1] may have crashed: {PLAIN}" in text and f"Ranks [2] may have crashed: {MULTIPROCESSING}" in text
    assert "Crashed: ranks [3 (ValueError)] exited after an uncaught exception" in text, text
    _check_no_false_claim(text)


def _texts(path):
    """The string constants of a module (implicitly concatenated literals joined, f-strings' literal parts)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield " ".join(node.value.split())


def test_no_text_of_the_package_claims_a_clean_exit():
    # Messages and docstrings alike: no exit note records a clean exit (see wait._exit_kind), so nothing may claim one.
    for path in sorted((ROOT / "torchmetrics_varlen").rglob("*.py")):
        for text in _texts(path):
            lowered = text.lower()
            assert not [claim for claim in CLAIMS if claim in lowered], (path.name, text)


if __name__ == "__main__":  # one rank under torchrun: `tests/test_exits.py <rendezvous file> <out dir> <ending>`
    rank = int(os.environ["RANK"])
    if rank != ENDING:
        # The agent stops every other worker (SIGTERM to its session) within `--monitor-interval` (0.1 s) of one
        # that failed; the survivors' messages are what the test reads.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank_main(rank, int(os.environ["WORLD_SIZE"]), *sys.argv[1:])
