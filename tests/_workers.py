"""Spawn gloo CPU worker processes that can be reused for many jobs and never hang their parent.

The test-suite's worker pool (see ``conftest.py``); the demo and the benchmarks use it too, imported from the
repository root as ``tests._workers``. Each worker joins a process group through a ``file://`` rendezvous in a fresh
temporary directory (no ports), with a process-group timeout. :meth:`WorkerPool.run` sends one job to every rank and
waits until a deadline; if a rank fails, the others get a short grace period and then the whole pool is killed,
because ranks left inside a collective would pair their next collective with the wrong peer.
"""

import datetime
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["WorkerError", "WorkerPool"]

_GRACE_SECONDS = 5.0


class WorkerError(RuntimeError):
    """A job failed on at least one rank, or did not finish before its deadline; the pool is closed."""


def _worker_main(
    rank: int,
    world_size: int,
    init_file: str,
    pg_timeout: float,
    inbox: Any,
    outbox: Any,
    env: dict[str, str],
    log_file: str | None,
) -> None:
    os.environ.update(env)
    if log_file is not None:  # keep a crashing library's noise out of the parent's output; the parent shows the tail
        fd = os.open(f"{log_file}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share few cores: one thread each avoids oversubscription
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # every failure must reach the parent as text
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` spawned processes in one gloo process group, running jobs on every rank at once.

    Args:
        world_size: number of ranks.
        pg_timeout: timeout of the process group, in seconds (collectives that wait longer raise).
        env: extra environment variables for the workers.
        quiet: send the workers' stderr to a log file; its tail is shown when a job fails.
    """

    def __init__(
        self, world_size: int, pg_timeout: float = 60.0, env: dict[str, str] | None = None, quiet: bool = False
    ) -> None:
        if world_size < 1:
            raise ValueError(f"Expected `world_size` to be at least 1 but got {world_size}")
        self.world_size = world_size
        self._tmpdir = tempfile.mkdtemp(prefix="tmv-pool-")
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        init_file = os.path.join(self._tmpdir, "rendezvous")
        self._log_file = log = os.path.join(self._tmpdir, "stderr") if quiet else None
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, world_size, init_file, pg_timeout, self._inboxes[rank], self._outbox, env or {}, log),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self.closed = False

    def run(self, fn: Callable[..., Any], *args: Any, deadline: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results in rank order.

        Raises:
            WorkerError: a rank raised (its traceback is in the message), a worker died, or the deadline passed.
        """
        if self.closed:
            raise WorkerError("this WorkerPool is closed")
        name = getattr(fn, "__qualname__", repr(fn))
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        end = time.monotonic() + deadline
        while len(results) + len(failures) < self.world_size:
            now = time.monotonic()
            if failures:
                end = min(end, now + _GRACE_SECONDS)
            if now > end:
                break
            try:
                rank, ok, value = self._outbox.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
                if dead and not failures:
                    failures.update({r: f"worker process died (exit code {self._procs[r].exitcode})" for r in dead})
                continue
            (results if ok else failures)[rank] = value
        if failures or len(results) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
            failures = {rank: text + self._log_tail(rank) for rank, text in failures.items()}
            self.close()
            parts = [f"{name} failed on {self.world_size} rank(s)"]
            if missing:
                parts.append(f"ranks {missing} did not finish within the deadline ({deadline:g} s) and were killed")
            parts += [f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items())]
            raise WorkerError("\n".join(parts))
        return [results[rank] for rank in range(self.world_size)]

    def _log_tail(self, rank: int, lines: int = 5) -> str:
        if self._log_file is None or not os.path.exists(f"{self._log_file}.{rank}"):
            return ""
        with open(f"{self._log_file}.{rank}", errors="replace") as log:
            tail = log.read().splitlines()[-lines:]
        return "\n[stderr] " + "\n[stderr] ".join(tail) if tail else ""

    def close(self) -> None:
        """Stop the workers (politely if idle, by force otherwise) and remove the rendezvous directory."""
        if self.closed:
            return
        self.closed = True
        for inbox in self._inboxes:
            try:
                inbox.put(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, end - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
