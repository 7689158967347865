"""The sync engine: one API for every sync, in two phases, over layers that import only downward.

Every sync of the package (a :class:`~torchmetrics_varlen.Metric`, a collection, the ``gather_all_tensors`` hook,
``compute_on_rank``, a ``ScalarLog``, the Join worker) is a :class:`Request` over a :class:`~.group.Link` (the group's
state, the policy, the timeout, a name for errors)::

    pending = start(request, link)   # describe, start the record exchange: returns at once
    synced = pending.finish()        # wait, plan, move the data, unpack
    synced = run(request, link)      # the blocking call: start(...).finish()

The steps, in the order of the functions below:

1. **Describe** (:func:`start`): this rank's record, an ``int64`` row (:mod:`.record`): header, one slot per entry,
   and for a few small dense states their data, on the host or, for states on an accelerator, on the device.
2. **Exchange the records** (collective 1): one all-gather at the group's agreed record length; when a header says
   that some rank's record is longer, every rank exchanges again at the longest length (:meth:`Pending.finish`).
3. **Plan** (:mod:`.plan`): from the identical table, every rank reaches the same decision, or raises the same
   error; plans are kept per group, keyed by the table's headers and slots.
4. **Allocate and pack** (:mod:`.pack`): when the sync receives much, one tiny all-gather first agrees that every
   rank could allocate it (a rank out of memory makes every rank raise instead of hanging its peers).
5. **Move the data** (:mod:`.move`): the reduce groups by all-reduce, the rest by one padded all-gather, large or
   skewed states by per-rank broadcasts into their results; to one rank by a gather and its pieces. A differentiable
   sync runs this step as one autograd node (:mod:`.grad`).
6. **Unpack** (:mod:`.unpack`): every rank's entries cut back out, padding dropped. Reducing them as stock
   torchmetrics does is the caller's (:mod:`.states`).

No rank branches on its local data before step 3, so no rank can skip a collective that its peers issue.

**The one fast path: the plan cache.** A request with a ``key`` (the local facts its header and slots follow from)
whose sync went the long way with its data in the records is *learnt*: its header and slots, every rank's, the plan.
The next request with that key sends the learnt header and slots with its data (from a send buffer kept with the
plan, on the device for device records); when every rank's headers and slots in the exchanged table are byte for
byte the learnt ones, the learnt plan is the plan, else the sync goes on the long way from that table. Both ways send
the same bytes, so a rank on one way and a peer on the other issue the same collectives. On a device the exchanged
headers come back by one non-blocking copy into pinned memory and an event waited for with the sync's timeout: no
stream synchronisation.

**The layers**, lowest first: pure, nothing communicates: :mod:`.record` (the record format), :mod:`.mismatch` (the
errors every rank raises alike), :mod:`.plan`, :mod:`.pack` and :mod:`.unpack` (buffers), :mod:`.objects` (Python
objects in list states), :mod:`.scalar_codec` (logged scalars' records); :mod:`.group` (the state each process group
keeps, the policy, the settings); :mod:`.comm` (the one module that starts collectives); :mod:`.wait` (the one that
waits for them: timeouts, named errors, notes in the store, process exit); :mod:`.grad` and :mod:`.move` (the data
step); this module (the API and the orchestration); :mod:`.states` (metrics' states in, reduced states out);
:mod:`.deferred` (the syncs ``compute_async()`` leaves pending, run by one worker thread on side groups).
"""

import array
import hashlib
import weakref
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from torchmetrics_varlen._engine import comm, grad, mismatch, move, record, unpack, wait
from torchmetrics_varlen._engine.group import (
    REGISTRY,
    Link,
    crosses_autograd_threads,
    group_timeout,
    is_nccl,
    link,
    sent_cap,
)
from torchmetrics_varlen._engine.pack import Result
from torchmetrics_varlen._engine.plan import Plan, make_plan
from torchmetrics_varlen._engine.record import MAX_WORDS, DenseGroup, LocalEntry, Ref
from torchmetrics_varlen.errors import SyncMismatchError

LEARNT_KEPT = 64  # a job syncs a handful of small layouts per step; more than this is no repeated sync


@dataclass(slots=True)
class Request:
    """One sync: what is synced and how. Every caller builds one and hands it to :func:`start` or :func:`sync`."""

    entries: Sequence[LocalEntry]  # local tensors, lists of tensors, or references to an earlier entry
    context: int  # hash of what is synced (equal on every rank that syncs the same thing)
    label: str  # readable name of the sync, in the record
    flags: int = 0  # header flags (``record.FLAG_*``)
    aux: Sequence[int] | None = None  # one auxiliary word per entry, visible to every rank in the plan
    ops: Sequence[int] | None = None  # per entry, the reduction applied afterwards (``plan.OP_*``); None: gather all
    cat: Sequence[bool] | None = None  # per entry, whether its ranks' data are concatenated (come back ``Joined``)
    names: Callable[[int], str] | None = None  # the entry at a position in error messages; "entry N" when None
    # The metric's device, equal on every rank (None: the hook): where an entry without tensors goes
    device: torch.device | None = None
    # This rank's transfer cap in bytes (None: the environment's or the default); the plan takes the ranks' smallest
    cap: int | None = None
    dst: int | None = None  # gather to this rank only (``compute_on_rank``)
    grad: str = "if_graph"  # when a sync flagged ``FLAG_DIFF`` is differentiable: "always" or "if_graph"
    stop: Callable[[Tensor], bool] | None = None  # looks at the exchanged table (equal on every rank); True ends there
    key: Hashable | None = None  # the local facts the header and slots follow from (hashable; None: not learnt)


@dataclass(eq=False)
class Synced:
    """What a sync gives back: the plan every rank agreed on, one result per entry, and this rank's rank."""

    plan: Plan
    # Empty on the ranks other than ``dst`` of a one-rank sync; None for an entry that is the same object as an earlier
    # one on every rank. None until asked for where the data rode in the records: cut from ``blocks`` then
    _results: list[Result | None] | None
    rank: int
    # Where the data rode in the records: each dense group's ``[world_size, elements]`` block (the states layer reduces
    # a whole group at once)
    blocks: list[tuple[DenseGroup, Tensor]] = field(default_factory=list)

    @property
    def results(self) -> list[Result | None]:
        """One result per entry."""
        if self._results is None:
            self._results = unpack.stacked(self.plan, self.blocks)
        return self._results


@dataclass
class _Record:
    """A record: its host words (header, slots, host data), and data words on a device after them (device records)."""

    words: list[int]
    tail: Tensor | None = None


@dataclass
class _Learnt:
    """A repeated sync, learnt: this rank's header and slots, every rank's, the plan, and the buffers kept with them."""

    prefix: list[int]
    headers: bytes  # every rank's header and slots
    plan: Plan
    layout: tuple[list[DenseGroup], int]  # where each state's bytes go in the data words
    device: torch.device
    longest: int  # the longest record among every rank's learnt ones
    send: Tensor | None = None  # the send row at ``words``, the prefix in place
    words: int = 0
    views: list[Tensor] = field(default_factory=list)  # each dense group's place in ``send``, of its dtype
    host: Tensor | None = None  # pinned host memory for the exchanged headers (device records)


# ---------------------------------------------------------------------------------------------------------- API
def run(request: Request, link: Link) -> Synced | None:
    """Run a sync to its end (None when ``request.stop`` ended it after the exchange)."""
    return start(request, link).finish()


def start(request: Request, link: Link) -> "Pending":
    """Describe this rank's entries and start the record exchange; :meth:`Pending.finish` does the rest."""
    state = link.state
    wait.NOTES.arm(state)
    words = state.count_sync()
    learnt = state.learnt.get(request.key) if request.key is not None else None
    send = _fast_row(learnt, request, words) if learnt is not None else None
    rec = None
    if send is None:
        learnt, rec = None, _describe(request, link)
        send = _row(rec, words, link.policy.device)
    table, work = _gather(send, words, link)
    return Pending(request, link, rec, words, table, work, learnt)


@dataclass(eq=False)
class Pending:
    """A started sync: its record exchange is in flight. :meth:`finish` waits for it and does the rest."""

    request: Request
    link: Link
    rec: _Record | None
    words: int
    table: Tensor
    work: Any
    learnt: _Learnt | None

    def finish(self) -> Synced | None:
        """Wait for the exchange, plan, move the data and unpack; None when ``request.stop`` ended the sync."""
        link, request, state, learnt = self.link, self.request, self.link.state, self.learnt
        wait.wait(self.work, link, link.policy.device.type)
        table = self.table.view(state.size, self.words)
        if learnt is not None:
            fast = _fast_results(learnt, table, request, link)
            if fast is not None:
                return fast
        host = _host_table(table, link)
        rec = self.rec
        if rec is None:  # the long way from a table the learnt sync exchanged: its record is what it sent
            assert learnt is not None
            rec = _Record(host[state.rank, : len(learnt.prefix) + learnt.layout[1] // 8].tolist())
        table, host = _again_if_longer(table, host, rec, self.words, link)
        if request.stop is not None and request.stop(torch.from_numpy(host)):
            return None
        plan = _plan(host, request, link)
        if plan.inline:
            synced = _inline(table, host, plan, state.rank)
            if request.key is not None:
                _learn(request, rec, host, plan, link)
            return synced
        results = move.data_step(request.entries, plan, link, device=request.device, cat=request.cat, dst=request.dst)
        return Synced(plan, results, state.rank)


# ------------------------------------------------------------------------------------------------ 1. describe
def _describe(request: Request, link: Link) -> _Record:
    """This rank's record; small dense states ride in it, on the host or on their device."""
    flags = request.flags | record.REDUCE_FLAGS[link.policy.reduce]  # ranks that differ raise together
    if flags & record.FLAG_DIFF:  # CPU tensors where CUDA autograd issues DDP's buckets: FLAG_HOST_GRAD
        own = [t for entry in request.entries if not isinstance(entry, Ref) for t in grad.entry_tensors(entry)]
        devices = [t.device for t in own] + ([request.device] if request.device is not None else [])
        cuda_autograd = is_nccl(link.policy.backend, "cuda") or any(device.type == "cuda" for device in devices)
        flags |= record.FLAG_HOST_GRAD if crosses_autograd_threads(devices, cuda_autograd) else 0
    inline = request.dst is None and not flags & record.FLAG_DIFF
    tensors = [entry for entry in request.entries if isinstance(entry, Tensor)]
    on_device = inline and link.policy.device_records and len(tensors) == len(request.entries) and bool(tensors)
    cap = request.cap if request.cap is not None else sent_cap(None)
    words = record.describe(
        request.entries, request.context, request.label, flags, request.aux, inline and not on_device, cap
    )
    if not on_device or words[record.H_ERROR] != record.ERR_NONE or tensors[0].device != link.policy.device:
        return _Record(words)
    layout = record.inline_layout(tensors)
    tail = record.device_data(tensors, *layout) if layout is not None else None
    if tail is None:
        return _Record(words)
    words[record.H_FLAGS] |= record.FLAG_INLINE
    words[record.H_WORDS] += tail.numel()
    return _Record(words, tail)


def _row(rec: _Record, words: int, device: torch.device) -> Tensor:
    """The ``words``-long row this rank sends (its record, cut or padded with zeros), on ``device``."""
    host = array.array("q", rec.words[:words])
    host.frombytes(bytes(8 * (words - len(host))))
    row = torch.frombuffer(host, dtype=torch.int64)  # no copy
    if device.type != "cpu":  # uploaded from pinned memory without blocking the host
        row = row.pin_memory().to(device, non_blocking=True)
    if rec.tail is not None and len(rec.words) < words:
        room = min(rec.tail.numel(), words - len(rec.words))
        row[len(rec.words) : len(rec.words) + room].copy_(rec.tail[:room])
    return row


# ---------------------------------------------------------------------------------------- 2. exchange records
def _gather(send: Tensor, words: int, link: Link) -> tuple[Tensor, Any]:
    """Start the all-gather of every rank's ``words``-long row: the flat table it fills, and its work."""
    state = link.state
    table = torch.empty(state.size * words, dtype=torch.int64, device=link.policy.device)
    return table, comm.gather_equal(table, send, state.pg, state.backend)


def _exchanged(rec: _Record, words: int, link: Link) -> tuple[Tensor, Any]:
    """Every rank's record at ``words`` long, waited for: the table and its host copy (:func:`_host_table`)."""
    table, work = _gather(_row(rec, words, link.policy.device), words, link)
    wait.wait(work, link, link.policy.device.type)
    table = table.view(link.state.size, words)
    return table, _host_table(table, link)


def _host_table(table: Tensor, link: Link, into: Tensor | None = None) -> Any:
    """The exchanged table (or as many first columns as ``into`` holds) as a numpy array on the host."""
    if table.device.type == "cpu":
        return table.numpy()
    # Into pinned memory (``into``, a learnt sync's, else fresh), waited for by an event: no stream synchronisation
    part = table if into is None else table[:, : into.shape[1]]
    host = torch.empty(part.shape, dtype=torch.int64, pin_memory=True) if into is None else into
    host.copy_(part, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    wait.wait_event(event, link)
    return host.numpy()


def _again_if_longer(table: Tensor, host: Any, rec: _Record, words: int, link: Link) -> tuple[Tensor, Any]:
    """Exchange again at the longest record's length where one is longer than ``words`` (decided from headers)."""
    ours = bool((host[:, record.H_MAGIC] == record.MAGIC).all())  # else the plan raises, naming the ranks
    needed = int(host[:, record.H_WORDS].max()) if ours else words
    if ours and words < needed <= MAX_WORDS:
        table, host = _exchanged(rec, needed, link)
    link.state.learn_longest(needed if needed <= MAX_WORDS else words)  # a larger claim is no record of ours
    return table, host


# ---------------------------------------------------------------------------------------------------- 3. plan
def _plan(host: Any, request: Request, link: Link) -> Plan:
    """The plan of the exchanged table: from the group's plan cache, keyed by every rank's headers and slots."""
    described = record.record_words(int(host[0, record.H_N]))
    if (host[:, record.H_MAGIC] == record.MAGIC).all() and host.shape[1] >= described:
        headers = np.ascontiguousarray(host[:, :described])
        digest = hashlib.blake2b(headers.tobytes(), digest_size=32).digest()
    else:
        digest = b""  # a foreign record: the plan raises
    reduce = "never" if request.dst is not None else link.policy.reduce
    broadcast_min = link.policy.broadcast_min
    key = (digest, tuple(request.ops or ()), tuple(request.cat or ()), reduce, request.grad, broadcast_min)
    plan = link.state.plans.get(key) if digest else None
    if plan is None:
        table = torch.from_numpy(np.ascontiguousarray(host))
        plan = make_plan(table, link.what, request.ops, reduce, request.grad, request.cat, request.names, broadcast_min)
        if digest:
            link.state.keep_plan(key, plan)
    return plan


def _inline(table: Tensor, host: Any, plan: Plan, rank: int) -> Synced:
    """The results of a sync whose data rode in the records: views of the table where it arrived (no copy back)."""
    meta = record.record_words(len(plan.entries))
    rows = torch.from_numpy(host[:, meta:]) if table.device.type == "cpu" else table[:, meta:]
    return Synced(plan, None, rank, unpack.unpack_inline(rows.view(torch.uint8), plan))


# ------------------------------------------------------------------------------------------- the fast path
def _learn(request: Request, rec: _Record, host: Any, plan: Plan, link: Link) -> None:
    """Keep what a long-way sync with its data in the records made, under ``request.key``."""
    tensors = [entry for entry in request.entries if isinstance(entry, Tensor)]
    if len(tensors) != len(request.entries) or not rec.words[record.H_FLAGS] & record.FLAG_INLINE:
        return
    layout = record.inline_layout(tensors)
    if layout is None:
        return
    headers = np.ascontiguousarray(host[:, : record.record_words(len(tensors))])
    prefix = rec.words[: headers.shape[1]]
    longest = int(headers[:, record.H_WORDS].max())
    learnt = link.state.learnt
    learnt[request.key] = _Learnt(prefix, headers.tobytes(), plan, layout, tensors[0].device, longest)
    if len(learnt) > LEARNT_KEPT:
        learnt.popitem(last=False)


def _fast_row(learnt: _Learnt, request: Request, words: int) -> Tensor | None:
    """The row a learnt sync sends, kept with it: the learnt prefix and this sync's data; None where it cannot."""
    tensors: list[Tensor] = request.entries  # type: ignore[assignment]  # a key is learnt for tensors only
    meta = len(learnt.prefix)
    groups, total = learnt.layout
    if meta + total // 8 > words:  # its data needs a longer record than the group's: the long way exchanges twice
        return None
    if learnt.send is None or learnt.words != words:  # on a device: uploaded once
        send = _row(_Record(learnt.prefix), words, learnt.device)
        data = send[meta : meta + total // 8].view(torch.uint8)
        learnt.words, learnt.send = words, send
        learnt.views = [data[group.start : group.start + group.nbytes].view(group.dtype) for group in groups]
    for group, view in zip(groups, learnt.views):
        members = [tensors[index] for index in group.indices]
        if any(t.device != learnt.device or t.requires_grad or t.is_conj() or t.is_neg() for t in members):
            return None
        if all(t.dim() == 0 for t in members):  # 0-d states (counts, sums): one op for the group
            torch.stack(members, out=view)
        else:
            torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in members], out=view)
    return learnt.send


def _fast_results(learnt: _Learnt, table: Tensor, request: Request, link: Link) -> Synced | None:
    """The learnt plan's results when every rank's headers and slots are the learnt ones, else None."""
    state, meta = link.state, len(learnt.prefix)
    if table.device.type != "cpu" and (learnt.host is None or learnt.host.shape != (state.size, meta)):
        learnt.host = torch.empty((state.size, meta), dtype=torch.int64, pin_memory=True)  # kept: pinning costs
    host = _host_table(table, link, learnt.host)
    if host[:, :meta].tobytes() != learnt.headers:
        return None
    state.learn_longest(learnt.longest)
    return _inline(table, host, learnt.plan, state.rank)  # views of this sync's table: only the send row is kept


# ----------------------------------------------------------------------------------------- the other syncs
def exchange(words: list[int], link: Link, decode: Callable[[Any], tuple[Any, int]]) -> Any:
    """A sync whose record the caller brings (a header without entries, then its payload): ``decode`` of the table.

    ``decode`` gets the exchanged table (numpy, every rank's record at the agreed length) and returns its result and
    the next record's length (names that travel once: see :meth:`~.group.GroupState.settle`).
    """
    state = link.state
    before = (state.words, state.longest, state.left)
    wait.NOTES.arm(state)
    count, rec = state.count_sync(), _Record(words)
    host = _again_if_longer(*_exchanged(rec, count, link), rec, count, link)[1]
    result, next_words = decode(host)
    state.settle(before, next_words)
    return result


AGREE = record.context_hash("torchmetrics_varlen.agree")


def agree(words: Sequence[int], link: Link, what: str) -> list[list[int]]:
    """Small integers every rank brings, as many on each (``what`` names them): every rank's, in one exchange.

    An agreement outside a sync travels as a record (a header, then the words): a peer at another sync at that point
    meets it in the same exchange, and every rank raises ``SyncMismatchError`` (a bare all-gather of another size
    would abort the process on gloo). Inside a sync, where every rank already agreed on what runs, ``move.agree``
    sends the words alone.
    """
    count = len(words)
    head = record.header(AGREE ^ count, what, 0, 0, record.HEADER_LEN + count, sent_cap(None))  # no entries

    def decode(table: Any) -> tuple[list[list[int]], int]:
        mismatch.check_headers(torch.from_numpy(table[:, : record.HEADER_LEN].copy()), f"{link.what} ({what})")
        return table[:, record.HEADER_LEN : record.HEADER_LEN + count].tolist(), len(head) + count

    return exchange([*head, *words], link, decode)  # type: ignore[no-any-return]


def side_link(of: Link, timeout: float | None) -> Link:
    """A link over the side group of ``of``'s group: a gloo group of the same ranks, made on first use.

    The Join worker syncs there from its own thread (NCCL must not be driven from two threads; a gloo group of its own
    keeps its collectives out of the job's order). Making it is a collective of the whole world (for a subgroup, one
    tiny all-gather on the world says which groups to make, then ``new_subgroups_by_enumeration``): every rank of the
    world makes it at the same point, each with its own group (the slices of a ``DeviceMesh`` together).
    """
    state = of.state
    if state.side is None:
        seconds = group_timeout(state.pg, of.policy.device.type)
        state.side = comm.new_side_group(_side_partition(of), seconds)
    side = REGISTRY.state(state.side)
    assert side is not None  # the same ranks as `of`'s group: more than one
    return Link(side, side.policy(torch.device("cpu"), None), timeout, of.what)


def _side_partition(of: Link) -> list[list[int]] | None:
    """Every rank's group of the side groups being made now (None: the world's own), from one exchange on the world."""
    ranks = dist.get_process_group_ranks(of.group)
    if of.group is dist.group.WORLD or len(ranks) == dist.get_world_size():
        return None
    world = link(None, of.policy.device, of.timeout, f"{of.what} (the Join side group)")
    assert world is not None
    mine = [min(ranks), zlib.crc32(array.array("q", ranks).tobytes())]
    partition: dict[tuple[int, int], list[int]] = {}
    for rank, (leader, digest) in enumerate(agree(mine, world, "members")):
        partition.setdefault((leader, digest), []).append(rank)
    wrong = [group for (_, crc), group in partition.items() if zlib.crc32(array.array("q", group).tobytes()) != crc]
    if wrong:  # every rank sees the same table: every rank raises alike
        raise SyncMismatchError(
            f"{of.what}: expected every rank of each process group to enter a `join` on it at the same time (its side"
            f" group is made by the whole world at once), but only ranks {wrong[0]} of a group did. Enter `join` on"
            " every rank of the world at the same point (each rank with its own group)."
        )
    return sorted(partition.values())


def flattened_group(mesh: Any, dims: tuple[str, ...], slices: Callable[[], list[list[int]]]) -> Any:
    """This rank's group of the slices of ``mesh`` along ``dims``, made once (a collective of the whole world)."""
    key = (id(mesh), dims)
    found = REGISTRY.flattened.get(key)
    if found is not None and found[0]() is mesh:
        return found[1]
    group = comm.new_subgroups(slices())
    REGISTRY.flattened[key] = (weakref.ref(mesh), group)
    return group


def count_running(joinable: Any) -> Any:
    """Start ``Join``'s count of the running ranks (returns its work, or None outside an enabled ``Join``)."""
    return comm.notify_join(joinable)


def running(work: Any, link: Link) -> int:
    """How many ranks are still running, once ``Join``'s count (from :func:`count_running`) completed."""
    wait.wait(work, link, "cpu", f"{link.what} (Join's count of the running ranks)")
    return int(work.get_future().value()[0].item())
