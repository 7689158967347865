"""Helpers shared by test bodies (imported inside spawned ranks)."""

import contextlib
import warnings
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
def sync_labels():
    """The labels of this package's syncs while the block runs, in order: one per metadata exchange.

    A sync exchanges its records once (``exchange_records``); ``what``, its sixth argument, is "sync of <label>".
    """
    from torchmetrics_varlen import _transport

    labels: list = []
    originals = {"exchange_records": _transport.exchange_records}

    def wrap(fn):
        def exchange(*args):
            labels.append(args[5].removeprefix("sync of "))
            return fn(*args)

        return exchange

    for name, fn in originals.items():
        setattr(_transport, name, wrap(fn))
    try:
        yield labels
    finally:
        for name, fn in originals.items():
            setattr(_transport, name, fn)


@contextlib.contextmanager
def fast_path_taken():
    """Yields a list that gets, per sync that reached the fast path's exchange, whether it took the learnt plan."""
    from torchmetrics_varlen import _repeat

    taken = []
    original = _repeat.sync

    def counted(*args):
        out = original(*args)
        taken.append(isinstance(out, list))
        return out

    _repeat.sync = counted
    try:
        yield taken
    finally:
        _repeat.sync = original


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
    env = dict(os.environ, PYTHONWARNINGS="ignore", **env_overrides)
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
