"""GPU check scenarios of logged scalars: ``ScalarLog`` and ``sync_scalars`` with device tensors on the job's group.

On NCCL the record exchange runs on the GPU (the policy's device) and the values arrive as device tensors; each
rank's keys differ. The reference is every rank's updates gathered over the control group and reduced in one process.
"""

import torch

import torchmetrics_varlen as tv
from benchmarks._gpu_common import Ctx, Scenario
from tests._meters import CollectiveCounter


def _updates(rank: int, window: int) -> list[tuple[dict[str, float], int]]:
    """This rank's updates of a window: a shared loss, a per-rank counter, rank 0's own term."""
    out = []
    for step in range(2 + rank):
        values = {"loss": 0.5 * step + rank + window, f"rank{rank}/count": float(step)}
        if rank == 0:
            values["aux"] = 0.1 * step
        out.append((values, 4 + rank))
    return out


def _scalar_log(ctx: Ctx) -> str:
    log = tv.ScalarLog(reduce={f"rank{r}/count": "sum" for r in range(ctx.world_size)}).to(ctx.device)
    counts = []
    for window in range(2):
        for values, weight in _updates(ctx.rank, window):
            log.update({k: torch.tensor(v, device=ctx.device) for k, v in values.items()}, weight=weight)
        with CollectiveCounter() as counter:
            got = log.compute()
        counts.append(counter.count)
        log.reset()
        everything = [u for rank_updates in ctx.gather_objects(_updates(ctx.rank, window)) for u in rank_updates]
        sums: dict[str, list[float]] = {}  # key -> [Σ w·v, Σ w, Σ v]
        for values, weight in everything:
            for key, value in values.items():
                total = sums.setdefault(key, [0.0, 0.0, 0.0])
                total[0], total[1], total[2] = total[0] + weight * value, total[1] + weight, total[2] + value
        expected = {key: (s[2] if key.endswith("/count") else s[0] / s[1]) for key, s in sums.items()}
        for key, value in expected.items():
            if abs(got[key] - value) > 1e-9 * max(1.0, abs(value)):
                raise AssertionError(f"window {window}: {key} = {got[key]}, expected {value}")
        if set(got) != set(expected):
            raise AssertionError(f"window {window}: keys {sorted(got)}, expected {sorted(expected)}")
    if counts[1] != 1:
        raise AssertionError(f"collectives per compute {counts}: expected 1 once the keys are known")
    one = tv.sync_scalars({"x": torch.tensor(float(ctx.rank), device=ctx.device)}, weight=ctx.rank + 1)["x"]
    expected_one = sum(r * (r + 1) for r in range(ctx.world_size)) / sum(r + 1 for r in range(ctx.world_size))
    if abs(one - expected_one) > 1e-12:
        raise AssertionError(f"sync_scalars gave {one}, expected {expected_one}")
    return f"ScalarLog on {ctx.device}, keys differing by rank: exact, collectives per compute {counts}"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "scalar-log-device",
        "ScalarLog and sync_scalars with device tensors, keys differing by rank: exact, one collective once known",
        _scalar_log,
    ),
)
