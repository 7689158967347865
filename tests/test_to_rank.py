"""compute_on_rank's broadcast route: one collective per piece, and no point-to-point collective on NCCL.

Every value is compared with stock torchmetrics run in one process on the concatenated data; the collectives counted
are compared with the pieces computed here from the known per-rank sizes.
"""

import pytest
import torch
import torch.distributed as dist
from _helpers import assert_same, forced_policy, group_state
from _meters import ByteMeter
from conftest import run_distributed
from torchmetrics.classification import BinaryAUROC

import torchmetrics_varlen as tv
from torchmetrics_varlen._engine import group as _policy
from torchmetrics_varlen._engine import pack as _to_rank
from torchmetrics_varlen.onerank import compute_on_rank


def _data(sizes, seed=3):
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    return torch.rand(total, generator=gen), torch.randint(0, 2, (total,), generator=gen)


def _mine(rank, sizes, seed=3):
    preds, target = _data(sizes, seed)
    start = sum(sizes[:rank])
    return preds[start : start + sizes[rank]], target[start : start + sizes[rank]]


class _GroupOfBroadcasts:
    """The work of what ProcessGroupNCCL makes of a list all_gather of unequal sizes: one broadcast per rank."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self):
        return all(work.is_completed() for work in self.works)


def _all_gather_as_broadcasts(tensor_list, tensor, group=None, async_op=False):
    rank = dist.get_rank(group)
    works = []
    for src, part in enumerate(tensor_list):
        buffer = tensor if src == rank else part
        if buffer.numel():  # every rank knows every size: they skip alike
            root = src if group is None else dist.get_global_rank(group, src)
            works.append(dist.broadcast(buffer, src=root, group=group, async_op=True))
    return _GroupOfBroadcasts(works)


def body_one_rank(rank, world_size, sizes, dst, cap, nccl_shaped):
    preds, target = _mine(rank, sizes)
    auroc = tv.rebase(BinaryAUROC)(thresholds=None, sync_cap=cap)
    auroc.update(preds, target)
    original = dist.all_gather
    if nccl_shaped:  # gloo's list all_gather takes equal sizes only: NCCL's runs unequal ones as broadcasts
        dist.all_gather = _all_gather_as_broadcasts
    try:
        with forced_policy(point_to_point=not nccl_shaped, broadcast_min=1024), ByteMeter() as meter:
            got = compute_on_rank(auroc, dst=dst)
    finally:
        dist.all_gather = original
    return {"got": got, "calls": [name for name, _ in meter.calls]}


def _pieces(sizes, dst, cap):
    """The collectives the route should issue: per state (float32 preds, int64 target), the spans before and after
    the destination's own section, each cut at the cap."""
    spans = [sum(sizes[:dst]), sum(sizes[dst + 1 :])]
    return sum(-(-span * itemsize // cap) for span in spans for itemsize in (4, 8))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("nccl_shaped", [False, True], ids=["all_to_all", "nccl-grouped"])
@pytest.mark.parametrize(
    ("dst", "cap", "empty"), [(0, None, None), (1, None, None), (0, 65_536, None), (1, 65_536, 0), (0, None, 1)]
)
def test_one_collective_per_piece_and_exact_results(world_size, nccl_shaped, dst, cap, empty):
    sizes = [30_000, 5_000, 12_000][:world_size]
    if empty is not None:
        sizes[empty] = 0
    results = run_distributed(body_one_rank, world_size, sizes, dst, cap, nccl_shaped)
    reference = BinaryAUROC(thresholds=None)
    reference.update(*_data(sizes))
    expected = reference.compute()
    pieces = _pieces(sizes, dst, cap or 256 * 2**20)
    for result in results:
        assert_same(result["got"], expected)
        calls = result["calls"]
        if nccl_shaped:  # no gather and no all-to-all: NCCL runs both point to point
            assert "gather" not in calls and "all_to_all_single" not in calls, calls
            assert calls.count("all_gather") == pieces, calls
        else:
            assert calls.count("all_to_all_single") == pieces, calls
            assert "all_gather" not in calls, calls


def test_pieces_are_contiguous_spans_cut_at_the_cap():
    # Three ranks, one float32 state of 5, 0 and 7 elements (20, 0 and 28 bytes), destination 1 (holding nothing),
    # a cap of 16 bytes: the span before it is rank 0's 20 bytes, the one after it rank 2's 28: 2 + 2 pieces.
    from types import SimpleNamespace

    entry = SimpleNamespace(dtype=torch.float32, numels=torch.tensor([5, 0, 7]))
    plan = SimpleNamespace(broadcast=[0], entries=[entry], cap=16)
    result = torch.arange(12, dtype=torch.float32)
    on_dst = _to_rank.pieces(plan, {0: result}, {}, rank=1, dst=1)
    assert [piece.counts for piece in on_dst] == [[16, 0, 0], [4, 0, 0], [0, 0, 16], [0, 0, 12]]
    assert [piece.received.numel() for piece in on_dst] == [16, 4, 16, 12]
    assert on_dst[2].received.data_ptr() == result.view(torch.uint8)[20:].data_ptr()  # straight into the result
    source = torch.arange(7, dtype=torch.float32) + 5
    on_two = _to_rank.pieces(plan, {}, {0: source}, rank=2, dst=1)
    assert [piece.sent is None for piece in on_two] == [True, True, False, False]
    assert torch.equal(torch.cat([on_two[2].sent, on_two[3].sent]), source.view(torch.uint8))
    assert _to_rank.scratch_bytes(on_two, rank=2, dst=1) == 16  # at most the cap, whatever the total
    assert _to_rank.scratch_bytes(on_dst, rank=1, dst=1) == 0


@pytest.mark.parametrize(
    ("backend", "device_type", "expected"),
    [("nccl", "cuda", False), ("nccl2", "cuda", False), ("cpu:gloo,cuda:nccl", "cpu", True), ("gloo", "cpu", True)],
)
def test_point_to_point_is_off_on_nccl_only(monkeypatch, backend, device_type, expected):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    state = group_state(None, backend)  # what a group of that backend keeps
    assert state.policy(device, None).point_to_point is expected
    assert _policy.decide(_policy.Facts(backend, device, current_cuda=0)).point_to_point is expected
