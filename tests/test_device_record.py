"""Small states on an accelerator ride in the record (``_device_record``): one collective, exact against stock.

CI has no GPU, so the device path is forced onto gloo and CPU states (``ON_THE_CPU_TOO``): the record is built, sent
and cut exactly as on NCCL, only on the CPU. A rank on that path and a rank that carries its data the usual way sync
together, and a rank whose states cannot ride makes every rank take the data step.
"""

import pytest
import torch
from _helpers import count_collectives
from conftest import run_distributed
from torchmetrics.classification import BinaryAccuracy, MulticlassStatScores
from torchmetrics.regression import MeanSquaredError

from torchmetrics_varlen import _device_record, _protocol, rebase

CASES = [
    (BinaryAccuracy, {}, lambda n, g: (torch.rand(n, generator=g), torch.randint(0, 2, (n,), generator=g))),
    (
        MulticlassStatScores,
        {"num_classes": 3, "average": None},
        lambda n, g: (torch.randint(0, 3, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)),
    ),
    (MeanSquaredError, {}, lambda n, g: (torch.rand(n, generator=g), torch.rand(n, generator=g))),
]


def body_small_states(rank, world_size, on_device_ranks, no_room_rank):
    """Each case's compute() on every rank, twice: its collectives, and which syncs took the device path."""
    _device_record.ON_THE_CPU_TOO = rank in on_device_ranks
    room = _protocol.INLINE_MAX_BYTES
    if rank == no_room_rank:  # this rank's records carry no data: the data step for every rank
        _protocol.INLINE_MAX_BYTES = 0
    attached = []
    original = _device_record.attach

    def attach(record, entries):
        out = original(record, entries)
        attached.append(isinstance(out, _device_record.DeviceRecord))
        return out

    _device_record.attach = attach
    try:
        collectives = []
        for cls, kwargs, data in CASES:
            ours, stock = rebase(cls)(**kwargs), cls(**kwargs, sync_on_compute=False)
            for step in range(2):
                inputs = [data(4 + 3 * r + step, torch.Generator().manual_seed(10 * r + step)) for r in range(3)]
                ours.update(*inputs[rank])
                for other in range(world_size):
                    stock.update(*inputs[other])
                with count_collectives() as counts:
                    got = ours.compute()
                ours._computed = None
                collectives.append(sum(counts.values()))
                expected = stock.compute()
                assert got.dtype == expected.dtype and got.shape == expected.shape, (cls, got, expected)
                assert torch.allclose(got, expected, rtol=0, atol=1e-6), (cls, step, got, expected)
        return collectives, attached
    finally:
        _device_record.attach = original
        _device_record.ON_THE_CPU_TOO = False
        _protocol.INLINE_MAX_BYTES = room


@pytest.mark.parametrize("world_size", [2, 3])
def test_small_states_ride_the_record_in_one_collective(world_size):
    for collectives, attached in run_distributed(body_small_states, world_size, list(range(world_size)), None):
        assert attached and all(attached), attached  # every sync took the device path
        assert collectives == [1] * len(collectives), collectives


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_device_record_and_a_host_record_sync_together(world_size):
    for rank, (collectives, attached) in enumerate(run_distributed(body_small_states, world_size, [0], None)):
        assert bool(attached) == (rank == 0), (rank, attached)
        assert collectives == [1] * len(collectives), collectives


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_whose_data_cannot_ride_sends_every_rank_through_the_data_step(world_size):
    for rank, (collectives, attached) in enumerate(
        run_distributed(body_small_states, world_size, list(range(world_size)), world_size - 1)
    ):
        assert all(attached) == (rank != world_size - 1), (rank, attached)
        assert collectives == [2] * len(collectives), collectives  # exact all the same (the body checks)


def test_entries_that_cannot_ride():
    cpu = torch.device("cpu")
    _device_record.ON_THE_CPU_TOO = True
    try:
        assert _device_record.eligible([torch.ones(3), torch.zeros((), dtype=torch.int64)], cpu)
        assert not _device_record.eligible([], cpu)
        assert not _device_record.eligible([torch.ones(0)], cpu)  # empty
        assert not _device_record.eligible([torch.ones(2, dtype=torch.complex128)], cpu)  # 16-byte elements
        assert not _device_record.eligible([[torch.ones(2)]], cpu)  # a list state
        assert not _device_record.eligible([torch.ones(2)], torch.device("meta"))  # another device
    finally:
        _device_record.ON_THE_CPU_TOO = False
    assert not _device_record.eligible([torch.ones(3)], cpu)  # on the CPU, describe carries the data itself
