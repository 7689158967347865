"""Shared fixtures: reusable gloo worker pools that never hang the test run.

Test bodies are module-level functions ``body(rank, world_size, **kwargs)`` run on every rank through
:func:`run_distributed`. Pools are cached per world size and reused across tests (a process start costs seconds);
a failing or timed-out body kills its pool, and the next test gets a fresh one.
"""

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests._workers import WorkerError, WorkerPool

sys.path.insert(0, str(Path(__file__).parent))  # lets spawned workers import the test modules that hold the bodies

PG_TIMEOUT = 60.0
DEFAULT_DEADLINE = 90.0
_POOLS: dict[tuple[int, tuple[tuple[str, str], ...]], WorkerPool] = {}


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    deadline: float = DEFAULT_DEADLINE,
    fresh: bool = False,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; fail the test on any rank's error.

    ``fresh=True`` runs in a pool of its own that is closed afterwards (for bodies that break their process group on
    purpose, or need a different environment).
    """
    key = (world_size, tuple(sorted((env or {}).items())))
    if fresh:
        pool = WorkerPool(world_size, PG_TIMEOUT, env=env)
    else:
        pool = _POOLS.get(key)
        if pool is None or pool.closed:
            pool = _POOLS[key] = WorkerPool(world_size, PG_TIMEOUT, env=env)
    try:
        return pool.run(_on_fresh_record_lengths, fn, *args, deadline=deadline, **kwargs)
    except WorkerError as err:
        pytest.fail(str(err), pytrace=False)
    finally:
        if fresh:
            pool.close()


def _on_fresh_record_lengths(rank: int, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a test body as in a fresh process group: a pooled group's record lengths follow its earlier syncs (they
    shrink after a window of small ones), which would make collective counts depend on the tests that ran before."""
    from torchmetrics_varlen._engine.group import REGISTRY

    REGISTRY.reset()  # on every rank before the body's first sync, so the ranks still agree
    return fn(rank, world_size, *args, **kwargs)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the long randomized tests")
    parser.addoption("--fuzz-cases", type=int, default=300, help="cases in the randomized differential test")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
