"""GPU check scenario of list states holding Python objects (issue 35), each a function every rank runs.

On NCCL the objects' pickles travel as ``uint8`` items in the CUDA buffers and the tensors inside them as views of
their CUDA bytes, coming back as CUDA tensors on the receiving rank's device: none of it can run in CI. In ``--cpu``
mode the same code runs with CPU tensors on gloo, so CI covers it.
"""

from typing import Any

import torch
from torchmetrics.utilities.data import _squeeze_if_scalar

import torchmetrics_varlen as tv
from benchmarks._gpu_common import Ctx, Scenario
from torchmetrics_varlen.onerank import compute_on_rank

__all__ = ["SCENARIOS"]


class _Detections(tv.Metric):
    """Per image: a dict of a name, an RLE-like mask and tensors, as a detection metric keeps them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("images", default=[], dist_reduce_fx=None)

    def update(self, image: dict[str, Any]) -> None:
        images: list[Any] = self.images  # type: ignore[assignment]
        images.append(image)

    def compute(self) -> list[Any]:
        images: list[Any] = self.images  # type: ignore[assignment]
        return list(images)


def _image(index: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(index)
    return {
        "name": f"image-{index}",
        "mask": ({"size": [8, 8], "counts": bytes(range(index % 7, index % 7 + 5))},),
        "boxes": torch.rand(index % 4, 4, generator=gen).to(device),
        "labels": torch.randint(0, 5, (index % 4,), generator=gen).to(torch.int8).to(device),
        "scores": torch.rand(index % 4, generator=gen).to(torch.bfloat16).to(device),
    }


def _check(got: list[Any], expected: list[Any], device: torch.device) -> None:
    expected = _squeeze_if_scalar(expected)  # what compute() returns goes through it, as with stock
    if [item["name"] for item in got] != [item["name"] for item in expected]:
        raise AssertionError("expected every rank's images in rank order")
    for a, b in zip(got, expected, strict=True):
        if a["mask"] != b["mask"]:
            raise AssertionError(f"mask of {a['name']} differs")
        for key in ("boxes", "labels", "scores"):
            x, y = a[key], b[key]
            if x.device != device or x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y.to(x.device)):
                found = f"{x.dtype} {tuple(x.shape)} on {x.device}"
                raise AssertionError(f"{a['name']}.{key}: {found}, expected {y.dtype} {tuple(y.shape)} on {device}")


def _object_states(ctx: Ctx) -> str:
    sizes = [6 if rank == 0 else 0 if rank == ctx.world_size - 1 > 1 else 2 for rank in range(ctx.world_size)]
    images = [_image(index, ctx.device) for index in range(sum(sizes))]
    start = sum(sizes[: ctx.rank])
    metric = _Detections(sync_cap="1KiB").to(ctx.device)  # 1 KiB chunks: the broadcast route's chunking too
    for image in images[start : start + sizes[ctx.rank]]:
        metric.update(image)
    _check(metric.compute(), images, ctx.device)
    metric._computed = None
    dst = ctx.world_size - 1
    got = compute_on_rank(metric, dst=dst)
    _check(got, images, ctx.device)
    return f"object list states, images per rank {sizes}, tensors inside on {ctx.device}: every rank, and rank {dst}"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("object-states", "list states of dicts holding device tensors: rank order, tensors stay", _object_states),
)
