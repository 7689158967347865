"""`gather_all_tensors(..., sync_grads=True)`: gradients equal one process on the concatenated data.

Relations checked (rank ``s`` computes loss ``L_s`` from the gathered pieces, ``x_r`` is rank ``r``'s input):

* in general ``grad x_r = sum_s dL_s/dx_r``, computed in one process as the gradient of ``sum_s L_s``;
* when every rank computes the same ``L``: ``grad x_r = world_size * dL/dx_r``;
* DDP (gradients averaged over ranks) with ``sync_grads=True``: parameter gradients equal one process's gradient of
  ``L`` over the whole batch; with the default ``sync_grads=False`` (only the local slot carries a graph) they are that
  gradient divided by ``world_size``.
"""

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed

from torchmetrics_varlen import SyncMismatchError, gather_all_tensors

DEADLINE = 60.0
TOL = {"rtol": 1e-10, "atol": 1e-12}

# Per-rank input shapes: uneven along dim 0 (and other dims), one empty rank where the world allows it.
SHAPES = {
    "vector": {1: [(5,)], 2: [(0,), (6,)], 3: [(5,), (0,), (7,)]},
    "rows": {1: [(4, 3)], 2: [(3, 3), (0, 3)], 3: [(4, 3), (0, 3), (2, 3)]},
    "ragged": {1: [(2, 3)], 2: [(2, 3), (1, 5)], 3: [(2, 3), (4, 1), (0, 2)]},
    "zero_dim": {1: [()], 2: [(), (4,)], 3: [(3,), (), (0,)]},
}

_COLLECTIVES = (
    "all_gather_single", "all_gather_into_tensor", "all_gather", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "send", "recv",
)  # fmt: skip


class _CountCollectives:
    """Count the `torch.distributed` collectives called while active (transport looks them up at call time)."""

    def __enter__(self):
        self.count = 0
        self._saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

        def wrap(fn):
            def counted(*args, **kwargs):
                self.count += 1
                return fn(*args, **kwargs)

            return counted

        for name, fn in self._saved.items():
            setattr(dist, name, wrap(fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _numel(shape):
    n = 1
    for size in shape:
        n *= size
    return n


def _piece_shapes(shapes):
    """True shapes of the gathered pieces: an empty rank takes the trailing shape of the first rank with data."""
    first = next((s for s in shapes if _numel(s) > 0), None)
    return [s if _numel(s) > 0 or first is None else (0, *first[1:]) for s in shapes]


def _loss(pieces, s, world_size, per_rank):
    """A nonlinear loss coupling all samples (soft F1 plus mean square); with ``per_rank`` it differs per rank and
    leaves one peer's piece unused (its gradient never arrives and must count as zeros)."""
    if per_rank and world_size > 1:
        pieces = [p.detach() if r == (s + 1) % world_size else p for r, p in enumerate(pieces)]
    x = torch.cat([p.reshape(-1) for p in pieces])
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    target = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(99)).to(x.dtype)
    prob = torch.sigmoid(x)
    loss = 1 - 2 * (prob * target).sum() / (prob.sum() + target.sum()) + (x**2).mean()
    if per_rank:
        weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(1000 + s), dtype=x.dtype)
        loss = (1 + s) * loss + (weight * torch.tanh(x)).sum()
    return loss


def body_gradients(rank, world_size, scenario, per_rank, dtype_name="float64", no_grad_rank=None):
    dtype = getattr(torch, dtype_name)
    shapes = SHAPES[scenario][world_size]
    numels = [_numel(s) for s in shapes]
    everything = torch.randn(sum(numels), generator=torch.Generator().manual_seed(7), dtype=dtype)
    start = sum(numels[:rank])
    if numels[rank]:
        local = everything[start : start + numels[rank]].clone().view(shapes[rank])
    else:
        local = torch.tensor([], dtype=dtype)  # what torchmetrics sends for an empty `cat` list
    local.requires_grad_(rank != no_grad_rank)

    with _CountCollectives() as forward:
        gathered = gather_all_tensors(local, sync_grads=True)
    loss = _loss(gathered, rank, world_size, per_rank)
    with _CountCollectives() as backward:
        loss.backward()

    reference = everything.clone().requires_grad_(True)
    ref_pieces = [p.view(s) for p, s in zip(reference.split(numels), _piece_shapes(shapes), strict=True)]
    if per_rank:
        total = sum(_loss(ref_pieces, s, world_size, True) for s in range(world_size))
        total.backward()
        expected = reference.grad
    else:
        _loss(ref_pieces, 0, world_size, False).backward()
        expected = world_size * reference.grad  # every rank computes the same loss: the contributions add up
    return {
        "shapes": [tuple(p.shape) for p in gathered],
        "expected_shapes": _piece_shapes(shapes),
        "requires_grad": [p.requires_grad for p in gathered],
        "values": [p.detach().reshape(-1) for p in gathered],
        "expected_values": list(everything.split(numels)),
        "loss": loss.detach(),
        "expected_loss": _loss(ref_pieces, rank, world_size, per_rank).detach(),
        "grad": None if local.grad is None else local.grad.reshape(-1),
        "grad_shape": None if local.grad is None else tuple(local.grad.shape),
        "local_shape": tuple(local.shape),
        "expected_grad": expected[start : start + numels[rank]],
        "collectives": (forward.count, backward.count),
    }


def _check_gradients(results, world_size, no_grad_rank=None):
    for rank, res in enumerate(results):
        assert res["shapes"] == res["expected_shapes"]
        assert all(res["requires_grad"])
        for got, expected in zip(res["values"], res["expected_values"], strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(res["loss"], res["expected_loss"], **TOL)
        if rank == no_grad_rank:
            assert res["grad"] is None
        else:
            assert res["grad_shape"] == res["local_shape"]
            torch.testing.assert_close(res["grad"], res["expected_grad"], **TOL)
        # One metadata and one data exchange forward, one all_reduce backward; no process group, nothing at all.
        assert res["collectives"] == ((2, 1) if world_size > 1 else (0, 0))


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scenario", sorted(SHAPES))
@pytest.mark.parametrize("per_rank", [False, True], ids=["same_loss", "per_rank_loss"])
def test_gradient_is_sum_over_ranks(world_size, scenario, per_rank):
    results = run_distributed(body_gradients, world_size, scenario, per_rank, deadline=DEADLINE)
    _check_gradients(results, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_complex_gradients(world_size):
    results = run_distributed(body_gradients, world_size, "rows", True, "complex128", deadline=DEADLINE)
    _check_gradients(results, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("no_grad_rank", [0, 1])
def test_rank_without_grad_does_not_hang(world_size, no_grad_rank):
    # In "vector" the empty rank is 0 for world 2 and 1 for world 3: both an empty and a non-empty rank get no grad.
    results = run_distributed(body_gradients, world_size, "vector", True, no_grad_rank=no_grad_rank, deadline=DEADLINE)
    _check_gradients(results, world_size, no_grad_rank)


def _soft_f1_loss(logits, target):
    prob = torch.sigmoid(logits)
    f1 = 2 * (prob * target).sum(0) / (prob.sum(0) + target.sum(0))
    return 1 - f1.mean() + (logits**2).mean()


def body_ddp(rank, world_size, sync_grads):
    sizes = {1: [6], 2: [7, 0], 3: [5, 0, 4]}[world_size]
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(sum(sizes), 4, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 2, (sum(sizes), 3), generator=gen).double()
    start = sum(sizes[:rank])

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    reference = torch.nn.Linear(4, 3).double()
    reference.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)

    out = ddp(features[start : start + sizes[rank]])  # the empty rank's model sees a batch of size 0
    gathered = gather_all_tensors(out, sync_grads=sync_grads)
    loss = _soft_f1_loss(torch.cat(gathered), target)
    if not sync_grads:
        # Without sync_grads an empty rank's loss does not touch its model; DDP needs every rank's backward.
        loss = loss + 0.0 * out.sum()
    loss.backward()

    _soft_f1_loss(reference(features), target).backward()
    return {
        "grads": [p.grad for p in model.parameters()],
        "expected": [p.grad for p in reference.parameters()],
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("sync_grads", [True, False])
def test_ddp_parameter_gradients(world_size, sync_grads):
    scale = 1.0 if sync_grads else 1.0 / world_size
    for res in run_distributed(body_ddp, world_size, sync_grads, deadline=DEADLINE):
        for got, expected in zip(res["grads"], res["expected"], strict=True):
            torch.testing.assert_close(got, scale * expected, **TOL)


def body_fallback(rank, world_size):
    sizes = [3, 0, 2][:world_size]
    everything = torch.arange(sum(sizes)) * 10**12
    start = sum(sizes[:rank])
    # The empty rank sends torch.tensor([]) (float32): the peers' int64 decides, on every rank alike.
    local = everything[start : start + sizes[rank]] if sizes[rank] else torch.tensor([])
    with _CountCollectives() as counter:
        ints = gather_all_tensors(local, sync_grads=True)
    floats = torch.linspace(0, 1, sizes[rank] + 1, dtype=torch.float64)[1:].requires_grad_(True)
    with torch.no_grad():
        no_grad = gather_all_tensors(floats, sync_grads=True)
    return {
        "values": ints,
        "expected": list(everything.split(sizes)),
        "requires_grad": [p.requires_grad for p in ints],
        "peers_require_grad": [p.requires_grad for r, p in enumerate(no_grad) if r != rank],
        "own_is_input": (ints[rank] is local, no_grad[rank] is floats),
        "collectives": counter.count,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_non_float_and_no_grad_fall_back_to_plain_gather(world_size):
    for rank, res in enumerate(run_distributed(body_fallback, world_size, deadline=DEADLINE)):
        for got, expected in zip(res["values"], res["expected"], strict=True):
            assert got.dtype == torch.int64
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert not any(res["requires_grad"])
        assert not any(res["peers_require_grad"])
        # As without sync_grads, a rank with data gets its own object back (under no_grad: its own graph, only).
        assert res["own_is_input"] == (rank != 1, rank != 1)
        assert res["collectives"] == 2


def body_mixed_sync_grads(rank, world_size):
    x = torch.ones(rank + 1, dtype=torch.float64, requires_grad=True)
    try:
        gather_all_tensors(x, sync_grads=rank == 0)
    except SyncMismatchError as err:
        return str(err)
    return None


@pytest.mark.parametrize("world_size", [2, 3])
def test_mixed_sync_grads_raises_on_every_rank(world_size):
    # A rank gathering without sync_grads would never join the backward collective: refused up front instead.
    for message in run_distributed(body_mixed_sync_grads, world_size, deadline=DEADLINE):
        assert message is not None
        assert "different" in message


# ------------------------------------------------------- CPU states beside a CUDA autograd thread (issue 34 item 5)
def body_host_states_with_cuda(rank, world_size, nccl_ranks, touched):
    """The group reads as NCCL-served on ``nccl_ranks``; CUDA reads as used (``pin_memory``, a query) if ``touched``."""
    from torchmetrics_varlen import SoftF1Loss
    from torchmetrics_varlen._engine.group import REGISTRY

    real = torch.cuda.is_initialized
    torch.cuda.is_initialized = lambda: touched  # a process that merely touched CUDA is no reason to refuse
    state = REGISTRY.state(None)
    backend = state.backend
    if rank in nccl_ranks:  # where DDP's CUDA buckets share the group: a several-backend group, as a GPU job has
        state.backend, state.policies = "cpu:gloo,cuda:nccl", {}
    errors = []
    try:
        for hook in (False, True):  # the loss metric (a per-step sync), then the hook
            probs = torch.rand(3 + rank, dtype=torch.float64, requires_grad=True)
            try:
                if hook:
                    torch.cat(gather_all_tensors(probs, sync_grads=True)).sum().backward()
                else:
                    SoftF1Loss()(probs, torch.ones(3 + rank)).backward()
            except ValueError as err:
                errors.append(str(err))
    finally:
        torch.cuda.is_initialized = real
        state.backend, state.policies = backend, {}
    # The group is still usable, and without such a group the same sync carries gradients as before.
    probs = torch.rand(3 + rank, dtype=torch.float64, requires_grad=True)
    torch.cat(gather_all_tensors(probs, sync_grads=True)).sum().backward()
    return errors, probs.grad.tolist()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("everywhere", [True, False])
def test_differentiable_sync_of_cpu_states_beside_nccl_is_refused_on_every_rank(world_size, everywhere):
    # Its backward all-reduce would wait for the CPU thread's copies while DDP issues its own from the CUDA thread:
    # an order that differs between ranks (a gloo abort on one GPU, seen on an H200). Decided from every rank's
    # record, so a rank that alone would race makes every rank raise, before any data moves.
    nccl_ranks = list(range(world_size)) if everywhere else [world_size - 1]
    for rank, (errors, grad) in enumerate(run_distributed(body_host_states_with_cuda, world_size, nccl_ranks, False)):
        assert len(errors) == 2, (rank, errors)
        for message in errors:
            assert f"ranks {nccl_ranks} hold them on the CPU" in message, message
            assert "metric.to(device)" in message and "sync_grads=False" in message, message
        assert grad == [float(world_size)] * (3 + rank)  # d/dx of the sum over every rank's gathered pieces


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_cpu_job_that_touched_cuda_is_not_refused(world_size):
    # Issue 43 item 9: `torch.cuda.is_initialized()` was the test, so `pin_memory` or a device query on one rank
    # refused every rank of a CPU-only DDP job. Only an NCCL-served group or a CUDA gradient device can race.
    for rank, (errors, grad) in enumerate(run_distributed(body_host_states_with_cuda, world_size, [], True)):
        assert errors == [], (rank, errors)
        assert grad == [float(world_size)] * (3 + rank)
