"""The collectives of a sync: metadata exchange, padded gather, all-reduce, gather to one rank, broadcast.

Each is started asynchronously and waited for through :func:`torchmetrics_varlen._waits.wait_work` (a timed wait on
gloo, polling elsewhere), so every collective of the package has the same timeout behaviour on every backend (see
:mod:`torchmetrics_varlen._waits`). Each process group also keeps its agreed record length here (:class:`_GroupState`,
which holds what waiting keeps of the group too).

Collectives are looked up on ``torch.distributed`` at call time, so tests can count them by wrapping those functions.
"""

import array
import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torchmetrics_varlen import (
    _caches,
    _device_record,
    _mismatch,
    _plan,
    _policy,
    _presence,
    _protocol,
    _to_rank,
    _waits,
)
from torchmetrics_varlen.errors import SyncMemoryError

ProcessGroup = Any  # torch.distributed.ProcessGroup; kept loose because its import path moved between torch releases


def world_of(group: ProcessGroup | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` within ``group``, or None when no sync is needed (no process group, or a group of one)."""
    if not _DISTRIBUTED:
        return None
    default = dist.group.WORLD  # None: not initialized (what `dist.is_initialized()` asks; every sync asks)
    if default is None:
        return None
    pg = group if group is not None else default
    last = _LAST_WORLD[0]
    if last is not None and last[0]() is pg:  # the group asked last: no weak-key lookup (every sync asks)
        return last[1]
    try:
        world = _WORLDS[pg]
    except (KeyError, TypeError):  # not seen yet, or a group that cannot be weakly referenced
        world_size = dist.get_world_size(group)
        world = None if world_size <= 1 else (dist.get_rank(group), world_size)
        with contextlib.suppress(TypeError):
            _WORLDS[pg] = world
    with contextlib.suppress(TypeError):
        _LAST_WORLD[0] = (weakref.ref(pg), world)
    return world


_DISTRIBUTED = dist.is_available()  # built with torch.distributed: fixed for the process
# A group's ranks never change, and every sync asks more than once: kept per group object, weakly (a destroyed
# group takes its entry along; one made later is looked up afresh).
_WORLDS: "weakref.WeakKeyDictionary[Any, tuple[int, int] | None]" = weakref.WeakKeyDictionary()
_LAST_WORLD: "list[tuple[weakref.ref[Any], tuple[int, int] | None] | None]" = [None]
_caches.register("_transport._WORLDS: a group's rank and size never change, and every sync asks", _WORLDS.clear)
_caches.register(
    "_transport._LAST_WORLD: the group asked last, without a weak-key lookup", lambda: _LAST_WORLD.__setitem__(0, None)
)


def _gather_equal(output: Tensor, local: Tensor, group: ProcessGroup | None) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=True)


# ------------------------------------------------------------------------------------------------- metadata
# Records are as long as the sync needs, but a collective needs one size on every rank, whatever each rank syncs.
# So each group has an agreed record length, equal on all its ranks because each rank derives it from the tables
# that all ranks saw (every rank of a group runs the same syncs in the same order):
#
# * records are sent at that length, at first room for 30 entries (1,528 bytes: one exchange for most collections);
# * when a header (always within it) says that some rank needs more, every rank exchanges again at the longest
#   length, and the group keeps it;
# * every RECORD_WINDOW syncs the length shrinks to the longest record of that window, but not below MIN_WORDS.
#
# So a per-step metric's records soon shrink to what it sends (472 bytes for a few small states), and a job that
# alternates a large sync (a collection at the end of an epoch) with many small ones pays the second exchange at most
# once per large sync.
INITIAL_WORDS = _protocol.record_words(30)
MIN_WORDS = _protocol.record_words(8)
MAX_WORDS = _protocol.record_words(1 << 16)  # a larger "need" is not a record of ours: make_plan names the ranks
RECORD_WINDOW = 64


@dataclass
class _GroupState(_waits.GroupWaits):
    """A group's agreed record length and what the current window of syncs needed (the same on all its ranks).

    Also what waiting keeps of the group (:class:`~torchmetrics_varlen._waits.GroupWaits`: its syncs so far, its
    timeouts and the limits derived from them).
    """

    size: int = 0  # the group's world size (it never changes): every exchange sizes its table by it
    words: int = INITIAL_WORDS
    longest: int = 0  # the longest record of the current window
    left: int = RECORD_WINDOW  # syncs left in the window

    def count_sync(self) -> int:
        """Count a new sync of the group (its number names where a rank waits); the length to send its record at."""
        self.syncs += 1
        return self.words

    def learn_longest(self, needed: int) -> None:
        """Every rank saw that the longest record of this sync has ``needed`` words."""
        self.words = max(self.words, needed)
        self.longest = max(self.longest, needed)
        self.left -= 1
        if self.left == 0:
            self.words, self.longest, self.left = max(self.longest, MIN_WORDS), 0, RECORD_WINDOW


# Keyed by the group object, weakly: a group destroyed (``destroy_process_group()``) takes its state along, and a group
# made afterwards starts fresh even where it gets the same name, as on its other ranks.
_GROUPS: "weakref.WeakKeyDictionary[Any, _GroupState]" = weakref.WeakKeyDictionary()
_caches.register("_transport._GROUPS: each group's agreed record length, which every rank derives alike", _GROUPS.clear)
# Guards the table of groups: the Join worker thread syncs on its own group while the main thread syncs on others.
# A group's own state needs no lock: only the thread that syncs on a group uses it (its collectives are ordered).
_LOCK = threading.Lock()


def group_state(group: ProcessGroup | None) -> _GroupState:
    """The state of ``group`` (its agreed record length, what waiting keeps), the same object while the group lives."""
    pg = group if group is not None else dist.group.WORLD
    with _LOCK:
        state = _GROUPS.get(pg)
        if state is None:  # the group's first sync
            state = _GROUPS[pg] = _GroupState(size=dist.get_world_size(group))
        return state


def _wait(
    work: Any, group: ProcessGroup | None, wait: str, timeout: float | None, what: str, device_type: str = "cpu"
) -> None:
    """Wait for ``work`` of a collective of ``group`` (see :func:`torchmetrics_varlen._waits.wait_work`)."""
    _waits.wait_work(work, group_state(group), group, wait, timeout, what, device_type)


def exchange_records(
    record: Sequence[int], group: ProcessGroup | None, device: torch.device, wait: str, timeout: float | None, what: str
) -> Tensor:
    """Collective 1 (rarely 2): every rank's record, as a ``[world_size, words]`` int64 CPU tensor.

    ``words`` is the group's agreed length: a record's own length is in its header (``H_WORDS``), zeros follow.
    """
    _presence.arm_exit_note()
    state = group_state(group)
    words = state.count_sync()
    table = _exchange_at(record, words, state, group, device, wait, timeout, what)
    return exchange_again_if_longer(table, record, state, words, group, device, wait, timeout, what)


def exchange_again_if_longer(
    table: Tensor,
    record: Sequence[int],
    state: _GroupState,
    words: int,
    group: ProcessGroup | None,
    device: torch.device,
    wait: str,
    timeout: float | None,
    what: str,
) -> Tensor:
    """The exchanged ``table`` (sent at ``words``), exchanged again at the longest record's length where one is longer.

    Records the longest length with the group's state (every rank saw the same table, so they all agree on it).
    """
    # Every sync runs these checks: on a few words, Python lists are several times quicker than tensor operations.
    heads = table.numpy()
    magic = heads[:, _protocol.H_MAGIC].tolist()
    ours = magic.count(_protocol.MAGIC) == len(magic)  # else make_plan raises, naming the ranks
    needed = max(heads[:, _protocol.H_WORDS].tolist()) if ours else words
    if ours and words < needed <= MAX_WORDS:  # decided from the headers: every rank takes this branch together
        table = _exchange_at(record, needed, state, group, device, wait, timeout, what)
    state.learn_longest(needed if needed <= MAX_WORDS else words)  # a larger claim is no record of ours: not learnt
    return table  # at the agreed length: the plan reads each record's length from its header


def _exchange_at(
    record: Sequence[int],
    words: int,
    state: _GroupState,
    group: Any,
    device: torch.device,
    wait: str,
    timeout: float | None,
    what: str,
) -> Tensor:
    local = _device_record.local_record(record, words, device)  # data already on the device rides there
    if local is None:
        padded = array.array("q", record[:words])
        padded.frombytes(bytes(8 * (words - len(padded))))
        local = torch.frombuffer(padded, dtype=torch.int64)  # no copy
        local = local if device.type == "cpu" else local.to(device)
    table = torch.empty(state.size * words, dtype=torch.int64, device=device)  # gloo takes only the flat form
    work = _start_with_hint(_gather_equal, table, local, group)
    _waits.wait_work(work, state, group, wait, timeout, what, device.type)
    table = table.view(state.size, words)
    if isinstance(record, _device_record.DeviceRecord):
        record.received = table  # its results are cut out of the table where it arrived
    return table if device.type == "cpu" else table.cpu()


def _start_with_hint(start: Callable[..., Any], output: Tensor, local: Tensor, group: ProcessGroup | None) -> Any:
    """Start the record exchange; a backend's refusal gets the fix where the facts say that GPUs are shared.

    The first collective on a device creates NCCL's communicator there, which is where NCCL refuses two ranks on one
    GPU, on every rank of the node at once (see ``_policy.shared_gpu_hint``).
    """
    try:
        return start(output, local, group)
    except RuntimeError as err:
        hint = _policy.shared_gpu_hint_for(group, output.device, str(err))
        if not hint:
            raise
        try:
            hinted = type(err)(f"{err}\n{hint}")
        except Exception:  # an exception type that takes no message: a plain RuntimeError carries the hint
            hinted = RuntimeError(f"{err}\n{hint}")
        raise hinted from err


# ----------------------------------------------------------------------------------------------------- data
def gather_rows(
    buffer: Tensor,
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    output: Tensor | None = None,
) -> Tensor:
    """Every rank's ``uint8`` buffer (equal sizes) as a ``[world_size, bytes]`` tensor (``output``, if given)."""
    world_size = dist.get_world_size(group)
    if output is None:
        output = torch.empty(world_size * buffer.numel(), dtype=torch.uint8, device=buffer.device)
    _wait(_gather_equal(output, buffer, group), group, wait, timeout, what, buffer.device.type)
    return output.view(world_size, buffer.numel())


def broadcast_all(
    sections: list[tuple[int, Tensor]],
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Broadcast each ``(src, tensor)`` from rank ``src`` of ``group`` in place: all started at once, then waited for.

    Every rank passes the same sources and sizes in the same order (they come from the plan). ``meanwhile`` runs
    once they are started, before the wait.
    """
    works = [
        (dist.broadcast(tensor, src=_global_rank(group, src), group=group, async_op=True), tensor.device.type)
        for src, tensor in sections
    ]
    _wait_all(works, group, wait, timeout, what, meanwhile)


def gather_rounds(
    rounds: list[list[Tensor]],
    rank: int,
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Each round (one tensor per rank, sizes from the plan) by one list ``all_gather``: started at once, then waited.

    NCCL runs an ``all_gather`` into tensors of unequal sizes as one group of broadcasts, one per rank
    (``ProcessGroupNCCL::allgather``), where separate broadcasts would run one after the other: ``W`` ring broadcasts
    in series. Every rank passes the same sizes in the same order; its own tensor is its input and its output.
    """
    works = [
        (dist.all_gather(parts, parts[rank], group=group, async_op=True), parts[rank].device.type) for parts in rounds
    ]
    _wait_all(works, group, wait, timeout, what, meanwhile)


def send_to_rank(
    pieces: list[_to_rank.Piece],
    dst: int,
    group: ProcessGroup | None,
    device: torch.device,
    wait: str,
    timeout: float | None,
    what: str,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Move each piece of a one-rank sync's broadcast route to rank ``dst`` (see :mod:`torchmetrics_varlen._to_rank`).

    One ``all_to_all_single`` per piece, all started at once, then waited for; on NCCL one list ``all_gather`` per
    piece, each waited for before the next reuses the other ranks' scratch buffer. Collectives, waited for like every
    other (gloo's point-to-point works cannot be polled, and a timed wait ends them). ``meanwhile`` runs once the
    first are started, before the wait.
    """
    rank = dist.get_rank(group)
    nothing = torch.empty(1, dtype=torch.uint8, device=device)[:0]  # a valid pointer to no bytes
    if _policy.point_to_point(group, device.type):
        works = [(_to_rank.all_to_all(piece, rank, dst, group, nothing), device.type) for piece in pieces]
        _wait_all(works, group, wait, timeout, what, meanwhile)
        return
    scratch = torch.empty(_to_rank.scratch_bytes(pieces, rank, dst), dtype=torch.uint8, device=device)
    for number, piece in enumerate(pieces):
        work = _to_rank.all_gather(piece, rank, group, scratch, nothing)
        _wait_all([(work, device.type)], group, wait, timeout, what, meanwhile if number == 0 else None)
    if not pieces and meanwhile is not None:
        meanwhile()


def agree_allocation(
    failure: BaseException | None,
    nbytes: int,
    group: ProcessGroup | None,
    device: torch.device,
    wait: str,
    timeout: float | None,
    what: str,
) -> None:
    """One tiny all-gather of whether each rank could allocate what the sync receives; raise on all if one failed.

    ``failure`` is this rank's allocation error, or None. Raises :class:`SyncMemoryError` naming the failing ranks
    (this rank's error as the cause), on every rank alike, before any data moved.
    """
    world_size = dist.get_world_size(group)
    local = torch.tensor([0 if failure is None else 1], dtype=torch.int64, device=device)
    table = torch.empty(world_size, dtype=torch.int64, device=device)
    _wait(_gather_equal(table, local, group), group, wait, timeout, f"{what} (memory check)", device.type)
    failing = table.cpu().nonzero().flatten().tolist()
    if failing:
        raise SyncMemoryError(
            _mismatch.memory_message(what, failing, nbytes, failure, dist.get_rank(group))
        ) from failure


def gather_words(
    words: Sequence[int], group: ProcessGroup | None, device: torch.device, wait: str, timeout: float | None, what: str
) -> Tensor:
    """One tiny all-gather of ``words`` (as many on every rank): the ``[world_size, len(words)]`` table, on the CPU."""
    world_size = dist.get_world_size(group)
    local = torch.tensor(list(words), dtype=torch.int64, device=device)
    table = torch.empty(world_size * len(words), dtype=torch.int64, device=device)
    _wait(_gather_equal(table, local, group), group, wait, timeout, what, device.type)
    return table.view(world_size, len(words)).cpu()


_OPS = {_plan.OP_SUM: "SUM", _plan.OP_MAX: "MAX", _plan.OP_MIN: "MIN"}


def all_reduce(
    buffers: list[tuple[Tensor, int]], group: ProcessGroup | None, wait: str, timeout: float | None, what: str
) -> None:
    """All-reduce each ``(buffer, op)`` in place: all started at once, then waited for."""
    works = [
        (dist.all_reduce(buffer, op=getattr(dist.ReduceOp, _OPS[op]), group=group, async_op=True), buffer.device.type)
        for buffer, op in buffers
    ]
    _wait_all(works, group, wait, timeout, what)


def _wait_all(
    works: list[tuple[Any, str]],
    group: ProcessGroup | None,
    wait: str,
    timeout: float | None,
    what: str,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Run ``meanwhile`` (the works are started), then wait for each ``(work, device type)`` in order."""
    if meanwhile is not None:
        meanwhile()
    for work, device_type in works:
        _wait(work, group, wait, timeout, what, device_type)


def _global_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def gather_to_rank(
    buffer: Tensor, dst: int, group: Any, wait: str, timeout: float | None, what: str, output: Tensor | None = None
) -> Tensor | None:
    """Every rank's ``uint8`` buffer (equal sizes) to rank ``dst`` of ``group`` only: ``[world_size, bytes]`` there.

    ``output``: rank ``dst``'s receive buffer (``world_size x bytes``), if allocated already. On NCCL, where a
    ``gather`` is point to point (``_to_rank``), it is the padded ``all_gather`` (at most the cap, as the plan
    routes), whose rows the other ranks drop at once.
    """
    rank = dist.get_rank(group)
    if not _policy.point_to_point(group, buffer.device.type):  # NCCL's gather is point to point: see `_to_rank`
        rows_everywhere = gather_rows(buffer, group, wait, timeout, what, output if rank == dst else None)
        return rows_everywhere if rank == dst else None  # the other ranks' copy goes at once
    rows = None
    if rank == dst:
        world_size = dist.get_world_size(group)
        if output is None:
            output = torch.empty(world_size * buffer.numel(), dtype=torch.uint8, device=buffer.device)
        output = output.view(world_size, buffer.numel())
        rows = list(output.unbind(0))
    else:
        output = None
    work = dist.gather(buffer, rows, dst=_global_rank(group, dst), group=group, async_op=True)
    _wait(work, group, wait, timeout, what, buffer.device.type)
    return output


def broadcast_bytes(
    data: bytes | None, src: int, group: Any, device: torch.device, wait: str, timeout: float | None
) -> bytes:
    """The bytes ``data`` of rank ``src`` to every rank of ``group`` (a size, then the bytes: two broadcasts)."""
    rank = dist.get_rank(group)
    what = f"broadcast of the result from rank {src}"
    size = torch.tensor([len(data) if rank == src and data is not None else 0], dtype=torch.int64, device=device)
    work = dist.broadcast(size, src=_global_rank(group, src), group=group, async_op=True)
    _wait(work, group, wait, timeout, what, device.type)
    if rank == src:
        assert data is not None
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    work = dist.broadcast(payload, src=_global_rank(group, src), group=group, async_op=True)
    _wait(work, group, wait, timeout, what, device.type)
    if rank == src and data is not None:
        return data
    return payload.cpu().numpy().tobytes()  # `bytes(storage)` iterates in Python: 1.4 µs a byte


def run_collective(
    start: Callable[[], Any], group: Any, wait: str, timeout: float | None, what: str, device_type: str = "cpu"
) -> None:
    """Start a collective (``start`` returns its work) and wait for it the ``wait`` way, like every other."""
    _wait(start(), group, wait, timeout, what, device_type)
