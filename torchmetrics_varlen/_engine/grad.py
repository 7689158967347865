"""The differentiable data step: one autograd node for all states of a sync, whose backward is one all-reduce.

Forward: the data step on the detached local tensors. Every floating point output (a gathered block, a joined `cat`
state, per-rank pieces, an all-reduced sum) depends, element by element, on exactly one rank's input element (a sum on
every rank's). So this rank's input gradient is the sum over all ranks of their output gradients for its elements:
every rank lays its output gradients out rank-major (a reduced entry once), one all-reduce sums them, and each rank
keeps its own sections. The plan gives every rank's sizes, so no padding; a gradient that never arrived is zeros.

The node's outputs live on the policy's grad device (the accelerator's, also for CPU states), so autograd runs its
backward all-reduce on that device's thread, where DDP's hooks issue theirs; each output is then copied to its entry's
device outside the node. On NCCL the backward is waited for stream-ordered ("stream"): no CPU polling on autograd's
thread.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from torchmetrics_varlen._engine import comm, wait
from torchmetrics_varlen._engine.group import Link
from torchmetrics_varlen._engine.pack import Joined, Reduced, Result, Stacked
from torchmetrics_varlen._engine.plan import OP_SUM, ROUTE_REDUCE, Plan
from torchmetrics_varlen._engine.record import LocalEntry, Ref


@dataclass
class Step:
    """The data step of one sync, decided before it runs: ``move(devices)`` runs it, results on ``devices``."""

    entries: Sequence[LocalEntry]
    plan: Plan
    rank: int
    link: Link
    devices: list[torch.device]  # where each entry's results go back to
    move: Callable[[list[torch.device]], list[Result | None]]


def run(step: Step) -> list[Result | None]:
    """Run ``step`` differentiably: outputs require grad on every rank, whatever its local data."""
    inputs = [t for entry in step.entries if not isinstance(entry, Ref) for t in entry_tensors(entry)]
    # The anchor makes the outputs require grad on every rank, also on one whose states carry no graph (an empty
    # batch): the backward all-reduce must run on every rank, decided from the plan, never from local data.
    anchor = torch.empty(0, requires_grad=True)
    holder: list[list[Result | None]] = []
    policy = step.link.policy
    inner = replace(step, devices=[policy.grad_device or policy.device] * len(step.devices))
    outputs = _DifferentiableStep.apply(inner, holder, anchor, *inputs)  # type: ignore[no-untyped-call]
    owners = [index for index, result in enumerate(holder[0]) for _ in _outputs(result)]
    flat = [out.to(step.devices[index]) for out, index in zip(outputs, owners, strict=True)]
    return [_rebuild(result, flat) for result in holder[0]]


def _outputs(result: Result | None) -> list[Tensor]:
    if result is None:
        return []
    if isinstance(result, (Stacked, Reduced, Joined)):
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
    def forward(ctx: Any, step: Step, holder: list[Any], anchor: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        results = step.move(step.devices)
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
        step: Step = ctx.step
        policy, plan, device = step.link.policy, step.plan, step.link.policy.device
        dtype = torch.float32  # half-precision gradients are summed in float32; complex ones as complex
        for index, _, diff in ctx.sections:
            entry_dtype = plan.entries[index].dtype
            if diff and entry_dtype is not None:
                dtype = torch.promote_types(dtype, entry_dtype)
        parts = [
            grad.reshape(-1).to(device, dtype) if grad is not None else torch.zeros(n, dtype=dtype, device=device)
            for grad, (_, n, diff) in zip(grads, ctx.sections)
            if diff
        ]
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
        if flat.numel() > 0:  # sizes come from the plan: every rank skips alike
            link = replace(step.link, policy=replace(policy, wait=policy.grad_wait or policy.wait))  # NCCL: "stream"
            work = comm.all_reduce(flat, OP_SUM, link.group)
            wait.wait(work, link, device.type, f"backward of the {link.what}")
        own = _own_sections(flat, ctx.sections, step)
        input_grads: list[Tensor | None] = []
        for shape, in_dtype, in_device in ctx.input_meta:
            piece = own.pop(0) if own else None
            if piece is None or not differentiable_dtype(in_dtype):
                input_grads.append(None)
                continue
            piece = piece if in_dtype.is_complex or not piece.is_complex() else piece.real
            input_grads.append(piece.view(shape).to(device=in_device, dtype=in_dtype))
        return (None, None, None, *input_grads)


def entry_tensors(entry: LocalEntry) -> list[Tensor]:
    return [entry] if isinstance(entry, Tensor) else list(entry) if isinstance(entry, list) else []


def _own_sections(flat: Tensor, sections: list[tuple[int, int, bool]], step: Step) -> list[Tensor | None]:
    """This rank's gradient of each of its input tensors, in input order, cut from the all-reduced buffer."""
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
        tensors = entry_tensors(entry)
        if index not in starts:
            own.extend([None] * len(tensors))
            continue
        start, eplan = starts[index], step.plan.entries[index]
        if eplan.route != ROUTE_REDUCE:
            start += int(eplan.numels[: step.rank].sum())  # rank-major: the ranks before this one come first
        for tensor in tensors:
            own.append(flat[start : start + tensor.numel()])
            start += tensor.numel()
    return own
