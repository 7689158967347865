"""The process-global caches of the sync path, and :func:`reset`, which empties them all (tests).

Every cache registers itself here with one line saying why it exists; :func:`described` lists them. None holds
anything a sync could not make again: emptied between two syncs, the next one only costs more. Two registries are
not caches and are not emptied: the Join worker's side groups and the groups ``mesh_group`` flattened, each made
once by a collective of every rank, so forgetting them on some ranks only would desynchronise the job.
"""

from collections.abc import Callable

__all__ = ["described", "register", "reset"]

_CACHES: list[tuple[str, Callable[[], object]]] = []


def register(why: str, clear: Callable[[], object]) -> None:
    """Add a cache: ``why`` it exists (one line), and how to empty it."""
    _CACHES.append((why, clear))


def reset() -> None:
    """Empty every registered cache of this process (tests: as in a fresh process, on every rank alike)."""
    for _, clear in _CACHES:
        clear()


def described() -> list[str]:
    """One line per registered cache: why it exists."""
    return [why for why, _ in _CACHES]
