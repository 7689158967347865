"""The large-state benchmark cases (skewed ranks, memory of the sync) in small configurations, on 2 and 3 ranks.

No timing is asserted. The byte checks recompute from the per-rank sizes alone what each side must receive, so they
fail if the byte meter, the padded side or the engine's routing moves other bytes than the sizes imply.
"""

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed

from benchmarks import skew
from tests._meters import ByteMeter
from torchmetrics_varlen._engine.group import INITIAL_WORDS

SIZE_CASES = {
    2: [skew.skew_sizes(2, 500, 8), [700, 700]],
    3: [skew.skew_sizes(3, 300, 8), skew.skew_sizes(3, 300, 8, big_rank=1), [1, 400, 2]],
}


def body_meter(rank, world_size):
    """A broadcast from rank 0 and a list all-gather: what the meter counts as received, and as from the peers."""
    out = {}
    tensor = torch.zeros(10)
    with ByteMeter() as meter:
        dist.broadcast(tensor, src=0)
    out["broadcast"] = (meter.received, meter.from_peers, meter.calls)
    with ByteMeter() as meter:
        dist.all_gather([torch.empty(3) for _ in range(world_size)], torch.zeros(3))
    out["all_gather"] = (meter.received, meter.from_peers)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_meter_counts_own_slots_out_of_from_peers(world_size):
    results = run_distributed(body_meter, world_size)
    for rank, out in enumerate(results):
        assert out["broadcast"] == (40, 0 if rank == 0 else 40, [("broadcast", 40)])
        assert out["all_gather"] == (12 * world_size, 12 * (world_size - 1))


@pytest.mark.parametrize(("world_size", "case"), [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
def test_sides_move_what_the_sizes_imply(world_size, case, tmp_path):
    sizes = SIZE_CASES[world_size][case]
    per_rank = run_distributed(skew.body_sides, world_size, sizes, 2)
    longest, total = max(sizes), sum(sizes)
    padded, exact = world_size * longest * 4, total * 4
    for rank, out in enumerate(per_rank):
        # The raw padded gather: one collective of W x the largest, of which the peers' slots came from the peers.
        assert out["padded"]["received"] == padded and out["padded"]["collectives"] == 1
        assert out["padded"]["from_peers"] == padded - longest * 4
        assert out["padded"]["synced"] == world_size * longest
        # Stock: a barrier, a gather of the 1-d shapes (int64), a gather padded to the largest.
        assert out["stock"]["calls"] == [("barrier", 0), ("all_gather", world_size * 8), ("all_gather", padded)]
        # Ours: the metadata exchange (records of one agreed length), then the data: the padded gather of today's
        # route, or exactly the true sizes for a route that sends each rank's bytes as they are.
        (first, metadata), *data = out["varlen"]["calls"]
        assert first.startswith("all_gather") and metadata % (8 * world_size) == 0
        assert metadata <= world_size * 8 * INITIAL_WORDS
        data_bytes = sum(nbytes for _, nbytes in data)
        assert data_bytes in (padded, exact), (data, padded, exact)
        assert out["varlen"]["received"] == metadata + data_bytes
        # Every side but the raw gather returns every rank's samples once.
        assert out["stock"]["synced"] == out["varlen"]["synced"] == total
        # To one rank: the metadata exchange, the data to rank 0 alone (padded rows or the peers' true bytes), then
        # the scalar result's broadcast (its size, then its bytes) to every rank.
        (first, metadata), *data, (size_call, size_bytes), (result_call, _) = out["one_rank"]["calls"]
        assert first.startswith("all_gather") and (size_call, size_bytes, result_call) == ("broadcast", 8, "broadcast")
        assert {name for name, _ in data} <= {"gather", "all_to_all_single"}
        data_bytes = sum(nbytes for _, nbytes in data)
        if rank == skew.ONE_RANK_DST:
            assert data_bytes in (padded, exact - sizes[rank] * 4), (data, padded, exact)
            assert out["one_rank"]["synced"] == total
        else:
            assert data_bytes == 0
        for side in skew.SIDES:
            assert out[side]["ms"] > 0 and isinstance(out[side]["peak"], int)
    assert len({out["varlen"]["received"] for out in per_rank}) == 1  # the same plan on every rank

    row = skew.summarize(sizes, per_rank)
    assert row["true_bytes"] == exact and row["padded"]["bytes_ratio"] == padded / exact
    assert row["padded"]["time_ratio"] == 1.0
    assert row["varlen"]["bytes_ratio"] == max(row["varlen"]["received"]) / exact
    assert row["varlen"]["received"] == [out["varlen"]["received"] for out in per_rank]
    table = skew.format_skew_table(row, 2)
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][1:] == [
        "stock",
        "padded gather",
        "ours",
        "ours, to rank 0",
    ]
    assert len({len(line) for line in table.splitlines() if line.startswith("|")}) == 1  # the columns line up
    memory = skew.format_memory_table([row], 2)
    cap_cell = memory.splitlines()[-3].split("|")[3].strip()
    assert (cap_cell == "-") == (skew.engine_cap() is None)
    skew.plot_skew(row, str(tmp_path / "skew.png"))
    skew.plot_memory([row, row], str(tmp_path / "memory.png"))
    assert (tmp_path / "skew.png").read_bytes()[:4] == (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_sizes_and_siblings():
    assert skew.skew_sizes(8, 10, 8) == [10] * 7 + [80]  # the case: one rank holding 8x the others
    assert skew.skew_sizes(3, 5, 2, big_rank=0) == [10, 5, 5]
    assert skew.even_sizes(4, 10) == [3, 3, 2, 2] and sum(skew.even_sizes(4, 4_000_001)) == 4_000_001
    assert skew.sibling("docs/benchmarks_table.rst", "skew") == "docs/benchmarks_table_skew.rst"
    assert all(sum(sizes) == sum(skew.memory_configs(True)[0][1]) for _, sizes in skew.memory_configs(True))
    assert [w for w, sizes in skew.memory_configs(False)] == [len(sizes) for _, sizes in skew.memory_configs(False)]


def test_measure_rejects_a_size_list_of_another_length():
    with pytest.raises(ValueError, match="one size per rank"):
        skew.measure(3, [1, 2], 1)
