"""``torchmetrics_varlen.mesh_group``: metrics on a 2x2 ``DeviceMesh`` of gloo CPU ranks, each sample counted once.

Mesh ``("dp", "tp")`` over ranks ``[[0, 1], [2, 3]]``: the two tensor-parallel ranks of a data-parallel slice hold the
same (replicated) batch, and the slices hold uneven shares (13 and 4 samples, one slice's second rank none of its own).
Synced over ``"dp"`` the metrics equal one process on the 17 samples; synced over the whole world, the positive
control, they count every sample twice. Synced over ``("dp", "tp")`` (as for data x context parallelism, where every
rank holds different tokens) they equal one process on everything the four ranks hold.
"""

import pytest
import torch
from _helpers import split
from conftest import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import BinaryAUROC
from torchmetrics.functional.classification import binary_auroc

import torchmetrics_varlen as tv

DP_SIZES = [13, 4]  # samples per data-parallel slice, replicated on its tensor-parallel ranks
RANK_SIZES = [6, 0, 9, 2]  # distinct tokens per rank, as with context parallelism


def _data(n, seed):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 2, (n,), generator=gen)
    return torch.sigmoid(target.float() - 0.5 + torch.randn(n, generator=gen)), target


def body_mesh(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    scores, target = _data(sum(DP_SIZES), 1)
    mine = split(DP_SIZES, dp_rank)  # the same on both tensor-parallel ranks of the slice
    dp_group = tv.mesh_group(mesh, "dp")
    by_dp = tv.rebase(BinaryAUROC)(thresholds=None, process_group=dp_group)
    count_dp = tv.rebase(SumMetric)(process_group=dp_group)
    whole_world = tv.rebase(SumMetric)()  # the positive control: replicated samples counted twice
    for metric in (by_dp, whole_world):
        metric.update(*((scores[mine], target[mine]) if metric is by_dp else (target[mine].float(),)))
    count_dp.update(torch.ones(DP_SIZES[dp_rank]))
    # Every rank distinct (context parallel): sync over both dimensions, one group made for them.
    tokens, _ = _data(sum(RANK_SIZES), 2)
    flat_group = tv.mesh_group(mesh, ("dp", "tp"))
    by_both = tv.rebase(SumMetric)(process_group=flat_group)
    by_both.update(tokens[split(RANK_SIZES, rank)])
    return {
        "auroc": by_dp.compute().item(),
        "count": count_dp.compute().item(),
        "world_positives": whole_world.compute().item(),
        "tokens": by_both.compute().item(),
        "same_group_again": tv.mesh_group(mesh, ("dp", "tp")) is flat_group,
        "group_sizes": [torch.distributed.get_world_size(dp_group), torch.distributed.get_world_size(flat_group)],
    }


def test_mesh_group_counts_replicated_samples_once():
    results = run_distributed(body_mesh, 4)
    scores, target = _data(sum(DP_SIZES), 1)
    tokens, _ = _data(sum(RANK_SIZES), 2)
    for rank, result in enumerate(results):
        assert result["auroc"] == pytest.approx(binary_auroc(scores, target).item(), abs=1e-6), rank
        assert result["count"] == sum(DP_SIZES), rank
        assert result["world_positives"] == pytest.approx(2 * target.sum().item()), rank  # counted twice
        assert result["tokens"] == pytest.approx(tokens.sum().item(), rel=1e-6), rank
        assert result["same_group_again"] and result["group_sizes"] == [2, 4], rank


def test_mesh_group_rejects_unknown_dimensions():
    class FakeMesh:
        mesh_dim_names = ("dp", "tp")

        def get_group(self, dim):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match=r"among the mesh's dimensions \('dp', 'tp'\) but got 'cp'"):
        tv.mesh_group(FakeMesh(), "cp")
    with pytest.raises(ValueError, match="distinct names"):
        tv.mesh_group(FakeMesh(), ("dp", "dp"))
