"""Notes in the store (issue 34 items 3 and 6): crashes told from normal exits, a constant number of store
operations per look whatever the world size, reads through a clone of the store with a bounded timeout."""

import datetime
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _metrics import Total
from conftest import run_distributed

from torchmetrics_varlen import SyncTimeoutError
from torchmetrics_varlen._engine import wait

ROOT = Path(__file__).resolve().parents[1]


class CountingStore:
    """A store that counts the operations asked of it (by name), passing each to the store it wraps."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        operation = getattr(self.store, name)

        def counted(*args):
            self.calls.append(name)
            return operation(*args)

        return counted


class DeadStore:
    """A store whose host process went away: every operation fails at once."""

    def __getattr__(self, name):
        def fail(*args):
            raise RuntimeError("Connection reset by peer")

        return fail


# ------------------------------------------------------------------------------- item 6: O(1) operations per look
def _note_every_rank(store, world_size, monkeypatch):
    """What ``world_size`` processes leave in ``store``: each wrote its first note once (as each process does)."""
    for rank in range(world_size):
        monkeypatch.setattr(wait.NOTES, "_listed", [])  # another process: it has not listed itself yet
        text = f"g|{rank}|sync" if rank % 2 else ""
        wait.NOTES.write("waiting" if rank % 2 else "exited", text or "ended", store, rank, "0.1")


@pytest.mark.parametrize("world_size", [2, 8, 64, 512])
def test_a_look_costs_two_store_operations_whatever_the_world_size(world_size, monkeypatch):
    # Before: three sequential `check`/`get` pairs per peer, 6 (W - 1) operations per look.
    store = dist.HashStore()
    _note_every_rank(store, world_size, monkeypatch)
    counting = CountingStore(store)
    peers = list(range(1, world_size))
    notes = wait.NOTES.read(counting, "0.1", peers)
    assert counting.calls == ["compare_set", "multi_get"]
    assert notes[1] == ("g|1|sync", "") and (world_size == 2 or notes[2] == ("", "ended"))


def test_peers_that_never_wrote_a_note_read_as_no_note_and_generations_never_mix(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(wait.NOTES, "_listed", [])
    wait.NOTES.write("exited", "ended", store, 3, "0.1")
    assert wait.NOTES.read(store, "0.1", [1, 3]) == {1: ("", ""), 3: ("", "ended")}
    # A restarted job, or a world initialised again, is another generation: the old note is not read.
    assert wait.NOTES.read(store, "1.1", [1, 3]) == {1: ("", ""), 3: ("", "")}


def body_store_calls_per_look(rank, world_size):
    """The last rank never syncs; the others count the store operations of each look at where the peers are."""
    if rank == world_size - 1:  # listed in the roster (it wrote a note once), its notes empty: still missing
        from torchmetrics_varlen._engine.group import REGISTRY

        wait.NOTES.write("waiting", "", wait.NOTES.store(), rank, REGISTRY.state(None).generation)
        time.sleep(6)
        return None
    counting = CountingStore(wait.NOTES.store())
    original = wait.NOTES.store
    wait.NOTES.store = lambda: counting
    try:
        metric = Total(sync_timeout=2)
        metric.update(torch.ones(2))
        with pytest.raises(SyncTimeoutError, match=rf"Missing: ranks \[{world_size - 1}\]"):
            metric.compute()
    finally:
        wait.NOTES.store = original
    reads = [call for call in counting.calls if call in ("compare_set", "multi_get", "get", "check")]
    return reads


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_look_on_gloo_costs_two_store_operations(world_size):
    results = run_distributed(body_store_calls_per_look, world_size, deadline=60, fresh=True)
    for reads in results[:-1]:
        # A look on finding a peer missing, and one more after NOTE_AFTER (a peer notes where it waits only then).
        assert reads == ["compare_set", "multi_get"] * 2, reads


# ------------------------------------------------------------------------------ reads through a bounded clone
def body_the_store_read_is_a_bounded_clone(rank, world_size):
    default = dist.distributed_c10d._get_default_store()
    clone = wait.NOTES.store()
    return {
        "clone": clone is not default,
        "timeout": clone.timeout == datetime.timedelta(seconds=wait.STORE_ANSWER),
        "default_untouched": default.timeout != clone.timeout,
        "same": wait.NOTES.store() is clone,
    }


def test_the_store_is_read_through_a_clone_with_a_short_timeout():
    # The thread per store operation is gone: a read waits at most STORE_ANSWER for a key, on a clone, so torch's own
    # store keeps its timeout. (A store host that is stopped, not dead, still delays the read until it resumes.)
    for result in run_distributed(body_the_store_read_is_a_bounded_clone, 2):
        assert result == {"clone": True, "timeout": True, "default_untouched": True, "same": True}


class RecordingStore:
    """A store that records which operations it is asked for and answers none that would wait."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name in ("get", "compare_set", "multi_get", "wait", "check", "add"):
                raise AssertionError(f"the exit note asked the store for an answer ({name})")

        return call


def test_the_exit_note_only_writes(monkeypatch):
    # Issue 43 item 10: at interpreter exit the note is written without waiting for any answer of the store (a store
    # host that is stopped or slow must not hold the exiting process): writes only, to the bounded clone.
    notes = wait.Notes()
    first, second = RecordingStore(), RecordingStore()
    notes._armed = [(first, 1, "g1"), (second, 1, "g2")]
    monkeypatch.setattr(wait, "_exit_kind", lambda: "ended")
    notes._at_exit()
    for store in (first, second):
        assert store.calls and set(store.calls) <= {"set", "multi_set", "append"}, store.calls


def body_exit_notes_are_armed_on_the_clone(rank, world_size):
    metric = Total()
    metric.update(torch.ones(2))
    metric.compute()
    default = dist.distributed_c10d._get_default_store()
    return [
        (store is not default, store.timeout == datetime.timedelta(seconds=wait.STORE_ANSWER))
        for store, _, _ in wait.NOTES._armed
    ]


def test_the_exit_note_goes_to_the_bounded_clone():
    # Issue 43 item 10: on Python 3.12+ the exit note used the default store, whose timeout is the group's.
    for armed in run_distributed(body_exit_notes_are_armed_on_the_clone, 2):
        assert armed and all(armed_on == (True, True) for armed_on in armed), armed


def body_dead_store(rank, world_size):
    """Rank 0 never syncs; the others find the store gone when their timeout expired: an error naming no rank."""
    if rank == 0:
        time.sleep(8)
        return None
    original = wait.NOTES.store
    wait.NOTES.store = DeadStore
    start = time.monotonic()
    try:
        metric = Total(sync_timeout=2)
        metric.update(torch.ones(2))
        metric.compute()
    except SyncTimeoutError as err:
        return {"message": str(err), "seconds": time.monotonic() - start}
    finally:
        wait.NOTES.store = original
    return None


def test_a_store_that_went_away_still_ends_the_wait_in_time():
    results = run_distributed(body_dead_store, 3, deadline=60, fresh=True)
    for result in results[1:]:
        assert result is not None, "expected SyncTimeoutError"
        assert "waited 2 s" in result["message"] and "Missing" not in result["message"], result["message"]
        assert result["seconds"] < 6, result


# ------------------------------------------------------------------------------- item 3: a crash is not a normal exit
RANK_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from _metrics import Total
    from torchmetrics_varlen import SyncPeerError, SyncTimeoutError

    rank, world_size, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    metric = Total(sync_timeout=60)
    metric.update(torch.ones(2))
    metric.compute()
    if rank == world_size - 1:
        raise ValueError("a bug in this rank's own code")  # uncaught: the process ends with exit code 1
    metric.update(torch.ones(2))
    try:
        metric.compute()
    except (SyncTimeoutError, SyncPeerError) as err:
        print("RESULT", type(err).__name__, str(err).replace(chr(10), " "))
    else:
        print("RESULT no error")
    """
)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_peer_that_crashed_is_named_as_crashed(world_size, tmp_path):
    # Before: every exit left "normal", so a crash read "exited normally (...: nothing crashed)".
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    init = str(tmp_path / "rdv")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world_size), init],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert procs[-1].returncode == 1 and "a bug in this rank's own code" in outputs[-1][1]
    for out, err in outputs[:-1]:
        line = next((line for line in out.splitlines() if line.startswith("RESULT")), err[-2000:])
        assert line.startswith("RESULT SyncPeerError"), line
        assert f"ranks [{world_size - 1} (ValueError)] exited after an uncaught exception" in line, line
        assert "nothing crashed" not in line, line
