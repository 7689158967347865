"""The sync engine: describe, exchange metadata, plan, move the data, unpack. Every sync of the package runs here.

The hook (:func:`~torchmetrics_varlen.gather_all_tensors`), :class:`~torchmetrics_varlen.Metric`, the collection,
:func:`~torchmetrics_varlen.compute_on_rank`, ``sync_grads`` and the Join shadow all call :func:`run`. What differs
between them is the data step:

* **gather + reduce + broadcast** (default): gathered entries travel in one padded ``all_gather_into_tensor``; dense
  states with a sum, max, min or mean reduction that the plan routes to all-reduce travel in one ``all_reduce`` per
  (op, dtype) bucket; states whose largest rank holds many bytes travel by one ``broadcast`` per rank straight into
  their results (:mod:`torchmetrics_varlen._broadcast`). Each rank then receives ``world_size x`` the largest rank's
  gathered bytes, ``1 x`` the reduced ones and the true sizes of the broadcast ones.
* **to one rank** (``dst``): the gathered entries travel in one ``gather`` to rank ``dst``, the routed ones by one
  ``all_to_all_single`` per rank holding data that sends to ``dst`` alone, straight into their results there; the
  other ranks get nothing back.
* **differentiable** (``grad``): the gather + reduce step inside one autograd function, whose backward runs one
  ``all_reduce`` of every gradient (see :class:`_DifferentiableStep`).

Collectives per sync: one metadata exchange (two when a rank's record outgrew the group's agreed record length),
then at most one gather, one all-reduce per reduce bucket, and per broadcast state one broadcast per rank holding
data (per chunk of the transfer cap), all decided from the exchanged metadata. Before them, when the sync receives
at least ``AGREE_MIN_BYTES``, one tiny all-gather in which every rank says whether it could allocate that: a rank out
of memory makes every rank raise :class:`~torchmetrics_varlen.SyncMemoryError` instead of hanging its peers.
"""

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen import (
    _broadcast,
    _buffers,
    _cap,
    _device_record,
    _plan,
    _policy,
    _protocol,
    _transport,
)
from torchmetrics_varlen._buffers import Joined, Reduced, Result, Stacked
from torchmetrics_varlen._plan import Plan
from torchmetrics_varlen._protocol import LocalEntry, Ref

# From this many bytes received per rank, the ranks agree that each could allocate them before any data moves (one
# tiny all-gather: under 3% of moving that much on gloo). Below it, a rank whose allocation fails raises alone, and
# its peers' timeout names it as missing.
AGREE_MIN_BYTES = 16 * 2**20


@dataclass
class Synced:
    """What a sync gives back: the plan every rank agreed on, and one result per entry.

    ``results`` is empty on the ranks other than ``dst`` of a one-rank sync. An entry that is the same object as an
    earlier one on every rank has result None.
    """

    plan: Plan
    results: list[Result | None]
    rank: int
    exchanged: "Exchanged | None" = None  # a sync whose data rode in the records: what the fast path learns from
    policy: _policy.TransportPolicy | None = None  # the policy it ran under (with ``exchanged``)


def first_device(entries: Sequence[LocalEntry]) -> torch.device | None:
    """The device of the first tensor among ``entries`` (list items included), else None.

    Local data: it never picks a backend (see :mod:`torchmetrics_varlen._policy`), only a device of the kind the
    facts equal on every rank picked, and where an entry's results go back to.
    """
    for entry in entries:
        if isinstance(entry, Tensor):
            return entry.device
        if isinstance(entry, list):
            for item in entry:
                if isinstance(item, Tensor):
                    return item.device
    return None


def entry_device(entry: LocalEntry, default: torch.device) -> torch.device:
    """The device an entry's results go back to: its own (a list's first item's), else ``default``."""
    if isinstance(entry, Tensor):
        return entry.device
    if isinstance(entry, list) and entry and isinstance(entry[0], Tensor):
        return entry[0].device
    return default


@dataclass
class Exchanged:
    """This rank's record and the exchanged ``[world_size, words]`` table of a sync (on the host).

    A :class:`~torchmetrics_varlen._device_record.DeviceRecord` holds the table as it arrived on the device too.
    """

    record: list[int]
    table: Tensor


@dataclass(frozen=True)
class Request:
    """One sync: what is synced, over which group, and how. Every caller builds one and hands it to :func:`run`.

    Args:
        entries: local tensors, lists of tensors, or references to an earlier entry.
        group: the process group.
        context: hash of what is synced (equal on every rank that syncs the same thing).
        label: readable name of the sync, for error messages.
        timeout: seconds to wait for the other ranks, or None.
        flags: header flags (``_protocol.FLAG_*``).
        aux: one auxiliary word per entry, visible to every rank in the plan.
        ops: per entry, the reduction applied afterwards (``_plan.OP_*``); None: gather everything.
        cat: per entry, whether its ranks' data are concatenated (come back :class:`Joined`).
        stop: looks at the exchanged table; True ends the sync there (every rank sees the same table).
        dst: gather to this rank only.
        grad: when a sync flagged ``FLAG_DIFF`` is differentiable (see ``_plan.make_plan``).
        names: names the entry at a position in error messages (a metric's state); "entry N" when None.
        device: the metric's device (``Metric.device``), equal on every rank: it picks the backend of a group with
            several, and where an entry without tensors gets its results. None only where no metric is known (the
            ``gather_all_tensors`` hook, whose one tensor is always there).
        cap: this rank's transfer cap in bytes (``Metric(sync_cap=...)``); None: the environment's or the default
            (see :mod:`torchmetrics_varlen._cap`). The plan takes the smallest of all ranks'.
        exchanged: the records were exchanged already (the fast path's table was not the learnt one,
            :mod:`torchmetrics_varlen._repeat`): the sync goes on from that table. ``record`` is what ``describe``
            makes of these entries.
    """

    entries: Sequence[LocalEntry]
    group: Any
    context: int
    label: str
    timeout: float | None
    flags: int = 0
    aux: Sequence[int] | None = None
    ops: Sequence[int] | None = None
    cat: Sequence[bool] | None = None
    stop: Callable[[Tensor], bool] | None = None
    dst: int | None = None
    grad: str = "if_graph"
    names: Callable[[int], str] | None = None
    device: torch.device | None = None
    cap: int | None = None
    exchanged: Exchanged | None = None


def run(request: Request) -> Synced | None:
    """Sync ``request.entries`` across ``request.group``; None when ``request.stop`` ended it after the exchange.

    The caller must have checked that a sync is needed (``_transport.world_of(group)`` is not None).
    """
    world = _transport.world_of(request.group)
    assert world is not None
    rank, _ = world
    local = first_device(request.entries)
    policy = _policy.policy_for(request.group, request.device, local)
    flags = request.flags | _protocol.REDUCE_FLAGS[policy.reduce]  # ranks that differ raise together
    if flags & _protocol.FLAG_DIFF:
        flags |= _host_grad_flag(request.entries, request.device)
    inline = request.dst is None and not flags & _protocol.FLAG_DIFF
    cap = request.cap if request.cap is not None else _cap.resolve_cap()
    what = f"sync of {request.label}"
    on_device = inline and _device_record.eligible(request.entries, policy.device)  # small states on the GPU
    if request.exchanged is not None:
        record, table = request.exchanged.record, request.exchanged.table
    else:
        record = _protocol.describe(
            request.entries, request.context, request.label, flags, request.aux, inline and not on_device, cap
        )
        if on_device:
            record = _device_record.attach(record, request.entries)
        table = _transport.exchange_records(record, request.group, policy.device, policy.wait, request.timeout, what)
    if request.stop is not None and request.stop(table):
        return None
    words = table.numpy()  # at least the group's first record length: the header is there
    described = _protocol.record_words(int(words[0, _protocol.H_N]))
    # The digest (the plan cache's key) covers headers and slots, not the data some records carry along.
    digest = hashlib.blake2b(words[:, :described].tobytes(), digest_size=32).digest()
    reduce = "never" if request.dst is not None else policy.reduce
    plan = _plan.make_plan(
        table, what, request.ops, reduce, digest, request.grad, request.cat, request.names, policy.broadcast_min
    )
    if plan.inline:  # the data came with the records: cut it out of the table
        results = inline_results(record, table, described, plan, policy.device)
        return Synced(plan, results, rank, Exchanged(record, table), policy)
    return Synced(plan, _data_step(request, plan, rank, policy, local, what), rank)


def _data_step(
    request: Request,
    plan: Plan,
    rank: int,
    policy: _policy.TransportPolicy,
    local: torch.device | None,
    what: str,
) -> list[Result | None]:
    """Move the data the plan lays out: plainly, or as one autograd node."""
    fallback = request.device or local or policy.device
    devices = [entry_device(entry, fallback) for entry in request.entries]
    step = _Step(
        request.entries, plan, request.group, rank, policy, devices, request.cat, request.timeout, what, request.dst
    )
    return _DifferentiableStep.run(step) if plan.differentiable else step.move()


def inline_results(
    record: Sequence[int], table: Tensor, meta_words: int, plan: Plan, device: torch.device
) -> list[Result | None]:
    """The results of a sync whose data rode in the records: from the table where this rank's record was sent."""
    received = record.received if isinstance(record, _device_record.DeviceRecord) else None
    if received is None:
        return _buffers.unpack_inline(table, meta_words, plan)
    rows = received[:, meta_words:].view(torch.uint8)  # on the device: no copy back to it
    return _buffers.unpack(rows, plan, [device] * len(plan.entries))


def _host_grad_flag(entries: Sequence[LocalEntry], device: torch.device | None) -> int:
    """``FLAG_HOST_GRAD`` for a differentiable sync of CPU tensors in a process that uses CUDA, else 0 (``_policy``)."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # no CUDA: no CUDA autograd thread either
        return 0
    devices = [t.device for entry in entries if not isinstance(entry, Ref) for t in _entry_tensors(entry)]
    crosses = _policy.crosses_autograd_threads([*devices, *([device] if device is not None else [])], True)
    return _protocol.FLAG_HOST_GRAD if crosses else 0


@dataclass
class _Step:
    """The data step of one sync: everything it needs, decided before it runs."""

    entries: Sequence[LocalEntry]
    plan: Plan
    group: Any
    rank: int
    policy: _policy.TransportPolicy  # where the buffers live, how the collectives are waited for
    devices: list[torch.device]  # where each entry's results go back to
    cat: Sequence[bool] | None
    timeout: float | None
    what: str
    dst: int | None

    def move(self) -> list[Result | None]:
        """Allocate, pack, run the collectives, unpack (see the module docstring for the variants)."""
        plan, device, wait = self.plan, self.policy.device, self.policy.wait
        agree = plan.alloc_bytes >= AGREE_MIN_BYTES  # from the plan: every rank agrees, or none does
        failure: BaseException | None = None
        reduced: list[Tensor] = []
        received: dict[int, Tensor] = {}
        sources: dict[int, Tensor] = {}
        later: list[tuple[Tensor, Tensor]] = []
        output = None
        try:
            reduced = _buffers.pack_reduced(self.entries, plan, device)
            if self.dst in (None, self.rank):  # to one rank: only that rank receives
                received = _broadcast.allocate(plan, device)
                if plan.max_bytes > 0:
                    output = _broadcast.empty(plan.world_size * plan.max_bytes, torch.uint8, device)
            # This rank's data of the routed entries, copied where it cannot be sent as it is (into its section of
            # the result, or a buffer of its own size on a one-rank sync's other ranks): allocations too.
            if plan.broadcast:
                sources, later = _broadcast.own_data(self.entries, plan, self.rank, received, device)
        except (RuntimeError, MemoryError) as err:  # an allocator's error: CPU, CUDA (torch.OutOfMemoryError) alike
            if not agree:
                raise
            failure = err
        if agree:  # raises on every rank if one failed, before any data moves
            _transport.agree_allocation(failure, plan.alloc_bytes, self.group, device, wait, self.timeout, self.what)
        if reduced:
            ops = [group.op for group in plan.reduce_groups]
            _transport.all_reduce(list(zip(reduced, ops)), self.group, wait, self.timeout, self.what)
        rows = None
        if plan.max_bytes > 0:
            buffer = _buffers.pack(self.entries, plan, self.rank, device)
            if self.dst is None:
                rows = _transport.gather_rows(buffer, self.group, wait, self.timeout, self.what, output)
            else:
                rows = _transport.gather_to_rank(buffer, self.dst, self.group, wait, self.timeout, self.what, output)
        if plan.broadcast:
            meanwhile = functools.partial(_broadcast.copy_later, later)  # this rank's copy, while the data moves
            if self.dst is None and self.policy.grouped_broadcasts:  # NCCL: a round of broadcasts in one group
                rounds = _broadcast.rounds(plan, received, sources, self.rank)
                _transport.gather_rounds(rounds, self.rank, self.group, wait, self.timeout, self.what, meanwhile)
            elif self.dst is None:
                sections = _broadcast.sections(plan, received, sources, self.rank)
                _transport.broadcast_all(sections, self.group, wait, self.timeout, self.what, meanwhile)
            else:
                transfers = _broadcast.to_rank(plan, received, sources, self.rank, self.dst)
                _transport.send_to_rank(
                    transfers, self.dst, self.group, device, wait, self.timeout, self.what, meanwhile
                )
        if self.dst is not None and self.rank != self.dst:
            return []
        results = _buffers.unpack(rows, plan, self.devices, self.cat, received)
        for index, value in _buffers.unpack_reduced(reduced, plan, self.devices).items():
            results[index] = value
        return results


# ------------------------------------------------------------------------------------------------ differentiable
# Forward: the data step on the detached local tensors. Every floating point output (a gathered block, a joined `cat`
# state, per-rank pieces, an all-reduced sum) depends, element by element, on exactly one rank's input element (a
# sum on every rank's). So the gradient of this rank's input is the sum over all ranks of their output gradients for
# this rank's elements: every rank lays its output gradients out rank-major (rank 0's elements, rank 1's, ...; a
# reduced entry once), one all-reduce sums them, and each rank keeps its own sections. Every rank knows every rank's
# sizes from the plan, so the buffer needs no padding; a gradient that never arrived counts as zeros.


def _outputs(result: Result | None) -> list[Tensor]:
    if result is None:
        return []
    if isinstance(result, (Stacked, Reduced)):
        return [result.tensor]
    if isinstance(result, Joined):
        return [result.tensor] if result.tensor is not None else []
    return [t for piece in result for t in (piece if isinstance(piece, list) else [piece])]


def _rebuild(result: Result | None, outputs: list[Tensor]) -> Result | None:
    if result is None:
        return None
    if isinstance(result, Stacked):
        return Stacked(outputs.pop(0))
    if isinstance(result, Reduced):
        return Reduced(outputs.pop(0))
    if isinstance(result, Joined):
        return Joined(outputs.pop(0) if result.tensor is not None else None)
    return [[outputs.pop(0) for _ in piece] if isinstance(piece, list) else outputs.pop(0) for piece in result]


def differentiable_dtype(dtype: torch.dtype | None) -> bool:
    """Whether outputs of ``dtype`` carry gradients through the differentiable step (floating point and complex)."""
    return dtype is not None and (dtype.is_floating_point or dtype.is_complex)


class _DifferentiableStep(torch.autograd.Function):
    """The data step as one autograd node; backward is one all-reduce of every gradient."""

    @staticmethod
    def run(step: _Step) -> list[Result | None]:
        """Run ``step`` differentiably: outputs require grad on every rank, whatever its local data."""
        inputs = [t for entry in step.entries if not isinstance(entry, Ref) for t in _entry_tensors(entry)]
        # The anchor makes the outputs require grad on every rank, also on one whose states carry no graph (an empty
        # batch): the backward all-reduce must run on every rank, decided from the plan, never from local data.
        anchor = torch.empty(0, requires_grad=True)
        holder: list[list[Result | None]] = []
        # The node's outputs live on the policy's grad device (the accelerator's, also for CPU states), so autograd
        # runs its backward all-reduce on that device's thread, where DDP's hooks issue theirs; each output is then
        # copied to its entry's own device, a differentiable copy outside the node.
        inner = replace(step, devices=[step.policy.grad_device or step.policy.device] * len(step.devices))
        outputs = _DifferentiableStep.apply(inner, holder, anchor, *inputs)  # type: ignore[no-untyped-call]
        results = holder[0]
        owners = [index for index, result in enumerate(results) for _ in _outputs(result)]
        flat = [out.to(step.devices[index]) for out, index in zip(outputs, owners)]
        return [_rebuild(result, flat) for result in results]

    @staticmethod
    def forward(ctx: Any, step: _Step, holder: list[Any], anchor: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        results = step.move()
        holder.append(results)
        plan = step.plan
        outputs: list[Tensor] = []
        sections: list[tuple[int, int, bool]] = []  # per output: (entry, numel, differentiable)
        for index, result in enumerate(results):
            for tensor in _outputs(result):
                # Fresh tensors, not views of the receive buffer: views made inside a custom Function refuse in-place.
                outputs.append(tensor.clone())
                sections.append((index, tensor.numel(), differentiable_dtype(plan.entries[index].dtype)))
        ctx.step, ctx.sections = step, sections
        ctx.input_meta = [(t.shape, t.dtype, t.device) for t in inputs]
        ctx.mark_non_differentiable(*(out for out, (_, _, diff) in zip(outputs, sections) if not diff))
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        step: _Step = ctx.step
        plan = step.plan
        dtype = torch.float32  # half-precision gradients are summed in float32; complex ones as complex
        for index, _, diff in ctx.sections:
            entry_dtype = plan.entries[index].dtype
            if diff and entry_dtype is not None:
                dtype = torch.promote_types(dtype, entry_dtype)
        parts = [
            (
                grad.reshape(-1).to(step.policy.device, dtype)
                if grad is not None
                else torch.zeros(n, dtype=dtype, device=step.policy.device)
            )
            for grad, (_, n, diff) in zip(grads, ctx.sections)
            if diff
        ]
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=step.policy.device)
        if flat.numel() > 0:  # sizes come from the plan: every rank skips alike
            _transport.run_collective(
                lambda: torch.distributed.all_reduce(flat, group=step.group, async_op=True),
                step.group,
                step.policy.grad_wait or step.policy.wait,  # "stream" on NCCL: no CPU polling on autograd's thread
                step.timeout,
                f"backward of the {step.what}",
                step.policy.device.type,
            )
        own = _own_sections(flat, ctx.sections, step)
        input_grads: list[Tensor | None] = []
        for shape, in_dtype, device in ctx.input_meta:
            piece = own.pop(0) if own else None
            if piece is None or not (in_dtype.is_floating_point or in_dtype.is_complex):
                input_grads.append(None)
                continue
            piece = piece if in_dtype.is_complex or not piece.is_complex() else piece.real
            input_grads.append(piece.view(shape).to(device=device, dtype=in_dtype))
        return (None, None, None, *input_grads)


def _entry_tensors(entry: LocalEntry) -> list[Tensor]:
    return [entry] if isinstance(entry, Tensor) else list(entry) if isinstance(entry, list) else []


def _own_sections(flat: Tensor, sections: list[tuple[int, int, bool]], step: _Step) -> list[Tensor | None]:
    """This rank's gradient of each of its input tensors, in input order, cut from the all-reduced buffer."""
    plan = step.plan
    starts: dict[int, int] = {}
    cursor = 0
    for index, numel, diff in sections:
        if diff:
            starts.setdefault(index, cursor)
            cursor += numel
    own: list[Tensor | None] = []
    for index, entry in enumerate(step.entries):
        if isinstance(entry, Ref):
            continue
        tensors = _entry_tensors(entry)
        eplan = plan.entries[index]
        if index not in starts:
            own.extend([None] * len(tensors))
            continue
        start = starts[index]
        if eplan.route != _plan.ROUTE_REDUCE:
            start += int(eplan.numels[: step.rank].sum())  # rank-major: the ranks before this one come first
        for tensor in tensors:
            own.append(flat[start : start + tensor.numel()])
            start += tensor.numel()
    return own
