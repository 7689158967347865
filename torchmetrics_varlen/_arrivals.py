"""Who is waiting where: names the missing ranks when a sync times out, at no cost when syncs are quick.

A rank that has waited more than ``NOTE_AFTER`` seconds at a metadata exchange writes one key to the process group's
store (the rendezvous store every process group has): which sync it waits at, numbered per process group. When the
timeout expires, the waiting rank reads every rank's key: ranks waiting at the same sync arrived; ranks noted at
another sync are named with it; ranks with no note never reached any sync of this package.
The store is reached through a private function of ``torch.distributed``; without it, the error names no ranks.
"""

from typing import Any

import torch.distributed as dist

NOTE_AFTER = 1.0  # seconds of waiting before a rank writes where it waits
_SEQUENCE: dict[Any, int] = {}


def next_sync_number(group: Any) -> int:
    """Count this rank's metadata exchanges per process group (equal across ranks that run the same syncs)."""
    key = group if group is not None else "world"
    _SEQUENCE[key] = _SEQUENCE.get(key, 0) + 1
    return _SEQUENCE[key]


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _key(global_rank: int) -> str:
    return f"torchmetrics_varlen/waiting/{global_rank}"


def note_waiting(number: int, what: str) -> None:
    """Write where this rank waits (called only after ``NOTE_AFTER`` seconds of waiting)."""
    store = _store()
    if store is not None:
        store.set(_key(dist.get_rank()), f"{number}|{what}")


def describe_missing(group: Any, number: int) -> str:
    """One sentence per other rank: arrived, waiting elsewhere, or never at a sync; empty if the store is unknown."""
    store = _store()
    if store is None:
        return ""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    missing, elsewhere = [], []
    for global_rank in ranks:
        if global_rank == me:
            continue
        key = _key(global_rank)
        if not store.check([key]):
            missing.append(global_rank)
            continue
        seen_number, _, seen_what = store.get(key).decode(errors="replace").partition("|")
        if int(seen_number) != number:
            elsewhere.append(f"rank {global_rank} waits at {seen_what} (its sync #{seen_number}, this is #{number})")
    parts = []
    if missing:
        parts.append(f"Missing: ranks {missing} never reached a torchmetrics_varlen sync while this rank waited.")
    parts += elsewhere
    return " ".join(parts)
