"""Presence notes in the store (issue 34 items 2, 3, 6): bounded store calls, crashes told from normal exits, and a
constant number of store operations per look whatever the world size."""

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

from torchmetrics_varlen import SyncTimeoutError, _presence

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


class FrozenStore:
    """A store whose host process is frozen: no operation ever answers (within this test)."""

    def __getattr__(self, name):
        return lambda *args: time.sleep(30)


# ------------------------------------------------------------------------------- item 6: O(1) operations per look
def _note_every_rank(store, world_size, monkeypatch):
    """What ``world_size`` processes leave in ``store``: each wrote its first note once (as each process does)."""
    for rank in range(world_size):
        monkeypatch.setattr(_presence, "_LISTED", [])  # another process: it has not listed itself yet
        _presence.write(store, "waiting" if rank % 2 else "busy", f"g|{rank}|sync" if rank % 2 else "steps", rank)
        store.add(_presence._key("beat", rank), 0)


@pytest.mark.parametrize("world_size", [2, 8, 64, 512])
def test_a_look_costs_two_store_operations_whatever_the_world_size(world_size, monkeypatch):
    # Before: three sequential `check`/`get` pairs per peer, 6 (W - 1) operations per look.
    store = dist.HashStore()
    _note_every_rank(store, world_size, monkeypatch)
    counting = CountingStore(store)
    peers = list(range(1, world_size))
    notes = _presence.read_notes(counting, peers)
    assert counting.calls == ["compare_set", "multi_get"]
    assert notes[1][0] == "g|1|sync" and (world_size == 2 or notes[2][2] == "steps")
    counting.calls.clear()
    assert _presence.beats(counting, peers) == [0] * len(peers)
    assert counting.calls == ["multi_get"]


def test_peers_that_never_wrote_a_note_read_as_no_note(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(_presence, "_LISTED", [])
    _presence.write(store, "exited", "normal", 3)
    assert _presence.read_notes(store, [1, 3]) == {1: ("", "", ""), 3: ("", "normal", "")}


def body_store_calls_per_look(rank, world_size):
    """The last rank never syncs; the others count the store operations of each look at where the peers are."""
    if rank == world_size - 1:
        _presence.write(_presence.store(), "busy", "")  # listed, notes empty: read by multi_get, still missing
        time.sleep(6)
        return None
    counting = CountingStore(_presence.store())
    original_store, original_where = _presence.store, _presence.where_peers_are
    per_look = []

    def where(store, group, note):
        before = len(counting.calls)
        found = original_where(store, group, note)
        per_look.append(len(counting.calls) - before)
        return found

    _presence.store, _presence.where_peers_are = (lambda: counting), where
    try:
        metric = Total(sync_timeout=2)
        metric.update(torch.ones(2))
        with pytest.raises(SyncTimeoutError, match=rf"Missing: ranks \[{world_size - 1}\]"):
            metric.compute()
    finally:
        _presence.store, _presence.where_peers_are = original_store, original_where
    return per_look


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_look_on_gloo_costs_two_store_operations(world_size):
    results = run_distributed(body_store_calls_per_look, world_size, deadline=60, fresh=True)
    for per_look in results[:-1]:
        assert per_look and set(per_look) == {2}, per_look


# ------------------------------------------------------------------------------- item 2: a store that never answers
def body_frozen_store(rank, world_size):
    """Rank 0 never syncs (frozen, as the process hosting the store); the others find the store silent."""
    if rank == 0:
        time.sleep(12)
        return None
    original = _presence.store
    _presence.store = FrozenStore
    start = time.monotonic()
    try:
        metric = Total(sync_timeout=2)
        metric.update(torch.ones(2))
        metric.compute()
    except SyncTimeoutError as err:
        return {"message": str(err), "seconds": time.monotonic() - start}
    finally:
        _presence.store = original
    return None


def test_a_store_that_never_answers_still_ends_the_wait_in_time():
    # Before: the diagnosis after the timeout blocked in the store until its own timeout (the group's: minutes).
    results = run_distributed(body_frozen_store, 3, deadline=60, fresh=True)
    for result in results[1:]:
        assert result is not None, "expected SyncTimeoutError"
        assert "The store did not answer" in result["message"], result["message"]
        assert result["seconds"] < 2 + _presence.STORE_ANSWER + 3, result


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
