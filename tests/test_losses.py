"""SoftF1Loss under DDP: exact single-process gradients with sync_grads, 1/world_size without."""

import pytest
import torch
from _helpers import split
from conftest import run_distributed

from torchmetrics_varlen.losses import SoftF1Loss

SIZES = {1: [6], 2: [7, 0], 3: [5, 0, 3]}


def _soft_f1(probs, target):
    tp = (probs * target).sum()
    fp = (probs * (1 - target)).sum()
    fn = ((1 - probs) * target).sum()
    return 1 - 2 * tp / (2 * tp + fp + fn + 1e-8)


def body_ddp_gradients(rank, world_size, sync_grads):
    sizes = SIZES[world_size]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(sizes), 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (sum(sizes),), generator=gen).double()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1).double()
    reference = torch.nn.Linear(4, 1).double()
    reference.load_state_dict(net.state_dict())
    model = torch.nn.parallel.DistributedDataParallel(net) if world_size > 1 else net
    loss_fn = SoftF1Loss(sync_grads=sync_grads).double()
    mine = split(sizes, rank)
    loss = loss_fn(torch.sigmoid(model(x[mine]).squeeze(-1)), y[mine])
    loss.backward()
    expected_loss = _soft_f1(torch.sigmoid(reference(x).squeeze(-1)), y)
    expected_loss.backward()
    return {
        "loss": loss.detach(),
        "expected_loss": expected_loss.detach(),
        "grads": [p.grad for p in net.parameters()],
        "expected": [p.grad for p in reference.parameters()],
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("sync_grads", [True, False])
def test_soft_f1_loss_gradients_under_ddp(world_size, sync_grads):
    for result in run_distributed(body_ddp_gradients, world_size, sync_grads):
        torch.testing.assert_close(result["loss"], result["expected_loss"], rtol=1e-12, atol=1e-12)
        scale = 1.0 if sync_grads else 1.0 / world_size
        for got, expected in zip(result["grads"], result["expected"]):
            torch.testing.assert_close(got, expected * scale, rtol=1e-10, atol=1e-12)


def test_soft_f1_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        SoftF1Loss()(torch.rand(3), torch.ones(4))
