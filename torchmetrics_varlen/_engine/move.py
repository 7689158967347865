"""The data step of a sync (:func:`data_step`: steps 4-6 of the engine), and the engine's small exchanges.

:func:`agree` is one tiny all-gather (the memory check, the objects loaded, the members of side groups);
:func:`share` sends one rank's bytes to every rank (``compute_on_rank``'s result).
"""

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from torchmetrics_varlen._engine import comm, grad, pack, unpack, wait
from torchmetrics_varlen._engine.group import Link
from torchmetrics_varlen._engine.mismatch import memory_message
from torchmetrics_varlen._engine.pack import Result
from torchmetrics_varlen._engine.plan import Plan
from torchmetrics_varlen._engine.record import LocalEntry
from torchmetrics_varlen.errors import SyncMemoryError

# From this many bytes received per rank, the ranks agree that each could allocate them before any data moves (one
# tiny all-gather: under 3% of moving that much on gloo).
AGREE_MIN_BYTES = 16 * 2**20


def data_step(
    entries: Sequence[LocalEntry],
    plan: Plan,
    link: Link,
    *,
    device: torch.device | None,
    cat: Sequence[bool] | None,
    dst: int | None,
) -> list[Result | None]:
    """Move the data the plan lays out; results on each entry's device (``device``, the metric's, for one without)."""
    local = next((t.device for entry in entries for t in grad.entry_tensors(entry)), None)
    fallback = device or local or link.policy.device
    devices = [_entry_device(entry, fallback) for entry in entries]
    run = functools.partial(_move, entries, plan, link, cat=cat, dst=dst)
    if plan.differentiable:
        return grad.run(grad.Step(entries, plan, link.state.rank, link, devices, run))
    return run(devices)


def _entry_device(entry: LocalEntry, default: torch.device) -> torch.device:
    """The device an entry's results go back to: its own (a list's first item's), else ``default``."""
    if isinstance(entry, Tensor):
        return entry.device
    if isinstance(entry, list) and entry and isinstance(entry[0], Tensor):
        return entry[0].device
    return default


def allocate(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocate what a sync receives into (one place, so a test can make it fail on one rank)."""
    return torch.empty(numel, dtype=dtype, device=device)


def _move(
    entries: Sequence[LocalEntry],
    plan: Plan,
    link: Link,
    devices: list[torch.device],
    cat: Sequence[bool] | None,
    dst: int | None,
) -> list[Result | None]:
    """Allocate, pack, run the collectives, unpack."""
    state, device, rank = link.state, link.policy.device, link.state.rank
    agree_first = plan.alloc_bytes >= AGREE_MIN_BYTES  # from the plan: every rank agrees, or none does
    failure: BaseException | None = None
    reduced: list[Tensor] = []
    received: dict[int, Tensor] = {}
    sources: dict[int, Tensor] = {}
    later: list[tuple[Tensor, Tensor]] = []
    output = None
    try:
        reduced = pack.pack_reduced(entries, plan, device)
        if dst in (None, rank):  # to one rank: only that rank receives
            received = pack.allocate(plan, device, allocate)
            if plan.max_bytes > 0:
                output = allocate(plan.world_size * plan.max_bytes, torch.uint8, device)
        if plan.broadcast:
            sources, later = pack.own_data(entries, plan, rank, received, device, allocate)
    except (RuntimeError, MemoryError) as err:  # an allocator's error: CPU, CUDA (torch.OutOfMemoryError) alike
        if not agree_first:
            raise
        failure = err
    if agree_first:  # raises on every rank if one failed, before any data moves
        failing = [r for r, row in enumerate(agree([0 if failure is None else 1], link, "memory check")) if row[0]]
        if failing:
            raise SyncMemoryError(memory_message(link.what, failing, plan.alloc_bytes, failure, rank)) from failure
    if reduced:
        ops = [group.op for group in plan.reduce_groups]
        wait.wait_all([(comm.all_reduce(buffer, op, state.pg), device.type) for buffer, op in zip(reduced, ops)], link)
    rows = None
    if plan.max_bytes > 0:
        buffer = pack.pack(entries, plan, rank, state.send_buffer(plan.max_bytes, device))
        rows = _gather_rows(buffer, output, dst, link)
    if plan.broadcast:
        _route(plan, received, sources, later, dst, link)
    if dst is not None and rank != dst:
        return []
    results = unpack.unpack(rows, plan, devices, cat, received)
    for index, value in unpack.unpack_reduced(reduced, plan, devices).items():
        results[index] = value
    return results


def _gather_rows(buffer: Tensor, output: Tensor | None, dst: int | None, link: Link) -> Tensor | None:
    """Every rank's send buffer as ``[world_size, bytes]`` rows (on ``dst`` only for a one-rank sync).

    NCCL runs a ``gather`` point to point: there a one-rank sync takes the padded all-gather (at most the cap, as the
    plan routes), whose rows the other ranks drop at once.
    """
    state, size = link.state, buffer.numel()
    to_all = dst is None or not link.policy.point_to_point
    if output is None and (to_all or state.rank == dst):
        output = allocate(state.size * size, torch.uint8, buffer.device)
    if to_all:
        assert output is not None
        wait.wait(comm.gather_equal(output, buffer, state.pg, state.backend), link, buffer.device.type)
    else:
        rows = list(output.view(state.size, size).unbind(0)) if output is not None else None
        wait.wait(comm.gather(buffer, rows, dst, state.pg), link, buffer.device.type)  # type: ignore[arg-type]
    if dst is not None and state.rank != dst:
        return None
    assert output is not None
    return output.view(state.size, size)


def _route(
    plan: Plan,
    received: dict[int, Tensor],
    sources: dict[int, Tensor],
    later: list[tuple[Tensor, Tensor]],
    dst: int | None,
    link: Link,
) -> None:
    """The broadcast route: per-rank broadcasts into the results, or, to one rank, its pieces."""
    state, device, rank = link.state, link.policy.device, link.state.rank
    meanwhile = functools.partial(pack.copy_later, later)  # this rank's own copy into its sections, while data moves
    if dst is None and link.policy.grouped_broadcasts:  # NCCL: a round of broadcasts as one list all-gather
        for number, round_ in enumerate(pack.rounds(plan, received, sources, rank)):
            if round_.whole is not None:  # straight into the result: no temporary
                work = comm.gather_equal(round_.whole, round_.parts[rank], state.pg, state.backend)
            else:  # one round in flight: whatever temporary the backend makes of it, one (at most the cap) is alive
                work = comm.all_gather(round_.parts, rank, state.pg)
            wait.wait_all([(work, device.type)], link, meanwhile if number == 0 else None)
    elif dst is None:
        sections = pack.sections(plan, received, sources, rank)
        wait.wait_all([(comm.broadcast(part, src, state.pg), device.type) for src, part in sections], link, meanwhile)
    else:
        pieces = pack.pieces(plan, received, sources, rank, dst)
        nothing = torch.empty(1, dtype=torch.uint8, device=device)[:0]  # a valid pointer to no bytes
        if link.policy.point_to_point:
            works = [(comm.to_rank(piece, rank, dst, state.pg, nothing), device.type) for piece in pieces]
            wait.wait_all(works, link, meanwhile)
            return
        scratch = torch.empty(pack.scratch_bytes(pieces, rank, dst), dtype=torch.uint8, device=device)
        for number, piece in enumerate(pieces):  # each waited for before the next reuses the scratch buffer
            work = comm.to_rank_grouped(piece, rank, state.pg, scratch, nothing)
            wait.wait_all([(work, device.type)], link, meanwhile if number == 0 else None)
        if not pieces:
            meanwhile()


# ----------------------------------------------------------------------------------------- small exchanges
def agree(words: Sequence[int], link: Link, what: str) -> list[list[int]]:
    """One tiny all-gather of ``words`` (as many on every rank): every rank's, as lists of ints."""
    state, device = link.state, link.policy.device
    local = torch.tensor(list(words), dtype=torch.int64, device=device)
    table = torch.empty(state.size * len(words), dtype=torch.int64, device=device)
    work = comm.gather_equal(table, local, state.pg, state.backend)
    wait.wait(work, link, device.type, f"{link.what} ({what})")
    return table.view(state.size, len(words)).cpu().tolist()  # type: ignore[no-any-return]


def share(data: bytes | None, src: int, link: Link) -> bytes:
    """The bytes ``data`` of rank ``src`` to every rank (a size, then the bytes: two broadcasts)."""
    state, device = link.state, link.policy.device
    what = f"broadcast of the result from rank {src}"
    mine = data if state.rank == src else None
    size = torch.tensor([len(mine) if mine is not None else 0], dtype=torch.int64, device=device)
    wait.wait(comm.broadcast(size, src, state.pg), link, device.type, what)
    if mine is not None:
        payload = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    wait.wait(comm.broadcast(payload, src, state.pg), link, device.type, what)
    return mine if mine is not None else payload.cpu().numpy().tobytes()  # not `bytes(storage)`: it iterates in Python
