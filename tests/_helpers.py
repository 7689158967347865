"""Helpers shared by test bodies (imported inside spawned ranks)."""

import contextlib
import dataclasses
import warnings
import weakref
from collections import Counter

import torch
import torch.distributed as dist

COLLECTIVES = (
    "_all_gather_base",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
)


@contextlib.contextmanager
def count_collectives(calls=None):
    """Count calls of torch.distributed collectives made while the block runs (calls nested inside others once).

    ``calls``: a list each call's positional arguments are appended to.
    """
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    depth = [0]

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                counts[name] += 1
                if calls is not None:
                    calls.append(args)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def engine_runs(see):
    """Call ``see(request, link)`` before each ``_engine.run`` while the block runs (callers look it up at each call).

    ``_engine.run`` is the one blocking entry point of every metric and hook sync (tests/test_engine.py counts it).
    """
    from torchmetrics_varlen import _engine

    original = _engine.run

    def watched(request, link):
        see(request, link)
        return original(request, link)

    _engine.run = watched
    try:
        yield
    finally:
        _engine.run = original


@contextlib.contextmanager
def sync_labels():
    """The labels of this package's syncs while the block runs, in order: one per metadata exchange.

    Every sync starts with one record exchange: :func:`_engine.start` (a request's sync, the fast path's too) or
    :func:`_engine.exchange` (a record the caller brings: ``ScalarLog``). The label is the link's ``what`` without its
    "sync of " prefix.
    """
    from torchmetrics_varlen import _engine

    labels: list = []
    originals = {"start": _engine.start, "exchange": _engine.exchange}

    def wrap(fn):
        def started(words_or_request, link, *args):
            labels.append(link.what.removeprefix("sync of "))
            return fn(words_or_request, link, *args)

        return started

    for name, fn in originals.items():
        setattr(_engine, name, wrap(fn))
    try:
        yield labels
    finally:
        for name, fn in originals.items():
            setattr(_engine, name, fn)


@contextlib.contextmanager
def fast_path_taken():
    """Yields a list that gets, per sync that reached the fast path's exchange, whether it took the learnt plan.

    A sync whose key was learnt sends the learnt header and slots; once the records are exchanged the engine compares
    every rank's with the learnt ones (``_engine._fast_results``): the learnt plan's results, or None (the long way).
    """
    from torchmetrics_varlen import _engine

    taken = []
    original = _engine._fast_results

    def counted(*args):
        out = original(*args)
        taken.append(out is not None)
        return out

    _engine._fast_results = counted
    try:
        yield taken
    finally:
        _engine._fast_results = original


def _forget_policies():
    """Every group's cached policies, dropped (``GroupState.policy`` asks ``decide`` again at its next call)."""
    from torchmetrics_varlen._engine.group import REGISTRY

    states = getattr(REGISTRY, "_states", None)
    if states is None:  # no way to reach the states: forget the groups altogether (on every rank alike)
        REGISTRY.reset()
        return
    for state in list(states.values()):
        state.policies.clear()


@contextlib.contextmanager
def forced_policy(**fields):
    """Syncs inside the block run under the policy the real facts give with ``fields`` replaced (tests only).

    The package has no switch for this: ``group.decide`` is replaced in this process (``GroupState.policy`` looks it
    up at every call that misses its cache), and every group's cached policies are dropped on entry and on exit. So
    a body can take the path another backend takes on gloo (``grouped_broadcasts=True``, ``point_to_point=False``,
    ``device_records=True``, ``wait="poll"``, ...). It applies to every thread of the process, and to every rank that
    enters it: a rank outside such a block decides for itself. Yields the policy of a CPU metric on the world group.
    """
    from torchmetrics_varlen._engine import group

    original = group.decide

    def decide(facts):
        return dataclasses.replace(original(facts), **fields)

    group.decide = decide
    _forget_policies()
    try:
        state = group.REGISTRY.state(None) if dist.is_initialized() else None
        yield state.policy(torch.device("cpu"), None) if state is not None else None
    finally:
        group.decide = original
        _forget_policies()


class MadeUpGroup:
    """A made-up process group: what a group's state reads of one (``bound_device_id``), no process group needed."""

    def __init__(self, bound=None):
        self.bound_device_id = bound


def group_state(pg=None, backend="gloo", rank=0, size=2):
    """A group's state as the registry makes one, for a made-up process group (``MadeUpGroup``) and backend.

    The state refers to its group weakly, as the registry's states do: the state holds ``pg`` here, so that it stays
    alive as long as the state.
    """
    from torchmetrics_varlen._engine.group import GroupState

    pg = MadeUpGroup() if pg is None else pg
    state = GroupState(weakref.ref(pg), rank, size, backend, "0.1", "made-up")
    state.held_group = pg
    return state


def describe(entries, context, label, flags=0, aux=None, inline=False, cap=None):
    """A record of ``entries`` as ``record.describe`` writes it; ``cap`` None: the default transfer cap."""
    from torchmetrics_varlen._engine import group, record

    return record.describe(entries, context, label, flags, aux, inline, group.DEFAULT_CAP if cap is None else cap)


def split(sizes, rank):
    """This rank's slice of data laid out rank after rank."""
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def quiet_compute(metric):
    """compute() with torchmetrics' 'compute before update' warning silenced (empty ranks are the point here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return metric.compute()


def outcome(fn):
    """The value of fn(), or the name of the exception it raised (the single-process reference may raise too)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except Exception as err:  # comparing behaviour, including errors, with one process
        return type(err).__name__


def assert_same(got, expected, exact=False):
    """Equal values (tensors, dicts, lists, or error names) with equal dtypes and shapes."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), (got, expected)
        for key in expected:
            assert_same(got[key], expected[key], exact)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), (got, expected)
        for g, e in zip(got, expected):
            assert_same(g, e, exact)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), (got, expected)
        assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
        if exact:
            assert torch.equal(got, expected) or (got.isnan() == expected.isnan()).all(), (got, expected)
        else:
            torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-5, atol=1e-6)
    else:
        assert got == expected, (got, expected)


def run_torchrun(args, timeout, nproc=2, **env_overrides):
    """``python -m torch.distributed.run --standalone`` (c10d on a free port) in a session of its own.

    Returns ``(returncode, stdout, stderr)``; on timeout the whole session (torchrun and its workers) is killed and
    the test fails with the output so far.
    """
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node"]
    root = str(Path(__file__).resolve().parents[1])
    # The script's own folder heads its sys.path, not the working directory: the repository root goes on
    # PYTHONPATH, so that the workers import this checkout's package, not another installed copy.
    path = os.pathsep.join(part for part in (root, os.environ.get("PYTHONPATH", "")) if part)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": path, **env_overrides}
    proc = subprocess.Popen(
        [*command, str(nproc), *args],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the process group this call started: torchrun and its workers
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout} s\n{stdout[-3000:]}\n{stderr[-5000:]}", pytrace=False)
    return proc.returncode, stdout, stderr
