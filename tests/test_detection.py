"""`rebase(MeanAveragePrecision)` on uneven and empty ranks: every key equal to one process on all images.

Needs torchvision and pycocotools (``nox -s detection``); skipped where they are not installed.
"""

import pytest
import torch
from _helpers import split
from conftest import run_distributed

pytest.importorskip("torchvision")
pytest.importorskip("pycocotools")

SIZES = {"uneven_empty": [3, 0, 2], "first_empty": [0, 2, 3], "even": [2, 2, 2]}


def _image(index, iou_type):
    """One image's predictions and targets, the same in every process (seeded by the image's index)."""
    gen = torch.Generator().manual_seed(index)
    n_pred, n_true = 2 + index % 3, 1 + index % 2
    preds, target = {}, {}
    for out, n in ((preds, n_pred), (target, n_true)):
        corner = torch.randint(0, 10, (n, 2), generator=gen).float()
        size = torch.randint(3, 8, (n, 2), generator=gen).float()
        out["labels"] = torch.randint(0, 3, (n,), generator=gen)
        if "bbox" in iou_type:
            out["boxes"] = torch.cat([corner, corner + size], dim=1)
        if "segm" in iou_type:
            masks = torch.zeros(n, 20, 20, dtype=torch.bool)
            for k in range(n):
                x, y = corner[k].long().tolist()
                w, h = size[k].long().tolist()
                masks[k, y : y + h, x : x + w] = True
            out["masks"] = masks
    preds["scores"] = torch.rand(n_pred, generator=gen)
    return preds, target


def body_map(rank, world_size, iou_type, scenario, dst):
    from torchmetrics.detection import MeanAveragePrecision

    from torchmetrics_varlen import compute_on_rank, rebase

    sizes = SIZES[scenario][:world_size]
    images = [_image(i, iou_type) for i in range(sum(sizes))]
    metric = rebase(MeanAveragePrecision)(iou_type=iou_type)
    for preds, target in images[split(sizes, rank)]:
        metric.update([preds], [target])
    got = metric.compute() if dst is None else compute_on_rank(metric, dst)
    reference = MeanAveragePrecision(iou_type=iou_type, distributed_available_fn=lambda: False)
    for preds, target in images:
        reference.update([preds], [target])
    return {"got": got, "expected": reference.compute()}


IOU_TYPES = {"bbox": "bbox", "segm": "segm", "both": ("bbox", "segm")}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("scenario", sorted(SIZES))
@pytest.mark.parametrize("iou", sorted(IOU_TYPES))
def test_rebased_mean_average_precision_equals_one_process(world_size, scenario, iou):
    for result in run_distributed(body_map, world_size, IOU_TYPES[iou], scenario, None, deadline=180):
        _assert_all_keys_equal(result["got"], result["expected"])


@pytest.mark.parametrize("iou", sorted(IOU_TYPES))
def test_mean_average_precision_on_the_empty_rank_alone(iou):
    # compute_on_rank with the empty rank as the destination: it alone receives every image
    for result in run_distributed(body_map, 3, IOU_TYPES[iou], "uneven_empty", 1, deadline=180):
        _assert_all_keys_equal(result["got"], result["expected"])


def _assert_all_keys_equal(got, expected):
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), (key, got[key], expected[key])
