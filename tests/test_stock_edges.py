"""Stock's result where it is easy to differ silently: empty `cat` lists, NaN/inf/-0.0, data that cannot be combined.

References: stock torchmetrics itself (the same metric on the same ranks, synced by stock's ``_sync_dist``), stock's
reduction of the stacked per-rank states, or one process on the concatenated data.
"""

import pytest
import torch
from _helpers import count_collectives, forced_policy, quiet_compute
from conftest import run_distributed
from torchmetrics import Metric as StockMetric
from torchmetrics.utilities.data import dim_zero_cat

from torchmetrics_varlen import Metric, SyncMismatchError, gather_all_tensors, rebase

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ROUTES = ("never", "always", "auto")  # gathered, all-reduced where the plan may, the cost model (inline when small)


# ------------------------------------------------------------------------------------------- empty `cat` lists
class StockListMetric(StockMetric):
    """torchmetrics' own test metric for empty lists: a `cat` list state, compute() returns it as it is."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("x", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.x.append(x)

    def compute(self):
        return self.x


ListMetric = rebase(StockListMetric)


def body_empty_lists(rank, world_size, dtype):
    got, expected = ListMetric(), StockListMetric()
    if dtype is not None:
        got, expected = got.set_dtype(dtype), expected.set_dtype(dtype)
    ours, stock = quiet_compute(got), quiet_compute(expected)  # stock syncs with torch.distributed's own gather
    return {"ours": (type(ours).__name__, getattr(ours, "dtype", None), tuple(getattr(ours, "shape", ()))),
            "stock": (type(stock).__name__, stock.dtype, tuple(stock.shape))}  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", [None, torch.float64, torch.float16])
def test_cat_list_empty_on_every_rank_gives_stocks_empty_tensor(world_size, dtype):
    # torchmetrics' test_sync_with_empty_lists: stock's compute() sees tensor([]) of the metric's dtype, not [].
    for result in run_distributed(body_empty_lists, world_size, dtype):
        assert result["ours"] == result["stock"], result
        assert result["stock"][0] == "Tensor"


ZERO_LENGTH_DTYPES = (torch.bfloat16, torch.float16, torch.int32, torch.uint8, torch.bool, torch.int64)


def _zero_length_items(rank, dtype, trailing):
    if rank == 1:
        return []  # a rank without items: only the others know the dtype and trailing dims
    return [torch.empty(0, *trailing, dtype=dtype) for _ in range(rank + 1)]


def body_zero_length_items(rank, world_size, trailing):
    out = {}
    for dtype in ZERO_LENGTH_DTYPES:
        metric = ListMetric()
        for item in _zero_length_items(rank, dtype, trailing):
            metric.update(item)
        value = quiet_compute(metric)
        out[str(dtype)] = (value.dtype, tuple(value.shape))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("trailing", [(), (3,)], ids=["vectors", "rows"])
def test_zero_length_items_keep_their_dtype_and_trailing_dims(world_size, trailing):
    for result in run_distributed(body_zero_length_items, world_size, trailing):
        for dtype in ZERO_LENGTH_DTYPES:
            # One process on every rank's items: dim_zero_cat keeps the dtype and the trailing dims.
            items = [item for rank in range(world_size) for item in _zero_length_items(rank, dtype, trailing)]
            expected = dim_zero_cat(items)
            assert result[str(dtype)] == (expected.dtype, tuple(expected.shape)), (dtype, result[str(dtype)])


# -------------------------------------------------------------------------------------- NaN, inf, -0.0, extremes
NAN, INF = float("nan"), float("inf")


def _float_values(rank, world_size):
    """Per rank, 80 values: NaN at a position of its own, +-inf, signed zeros (ties between ranks), small integers.

    Small integers sum exactly in any order, so every difference from stock comes from the special values.
    """
    values = torch.arange(80, dtype=torch.float64) % 7 - 3
    values[rank] = NAN  # a different position on each rank
    values[10] = -0.0  # -0.0 on every rank: torch.sum gives +0.0, torch.max -0.0
    values[11] = -0.0 if rank % 2 == 0 else 0.0  # a tie of signed zeros: torch.max keeps the first rank's
    values[12] = 0.0 if rank % 2 == 0 else -0.0
    values[13] = INF if rank == 0 else 1.0
    values[14] = -INF if rank == world_size - 1 else 2.0
    values[15] = INF if rank == 0 else -INF if rank == 1 else 0.0  # inf - inf: NaN
    values[16 + rank] = -INF
    values[20 + rank] = INF
    return values


def _int_values(rank, dtype):
    info = torch.iinfo(dtype) if dtype != torch.bool else None
    if info is None:
        return torch.tensor([rank % 2 == 0, rank % 2 == 1, True, False] * 20)
    low, high = info.min, info.max
    pattern = [low, high, low + rank, high - rank, 0, -1 if low < 0 else 1, rank, high if rank == 0 else low]
    return torch.tensor(pattern * 10, dtype=dtype)


class SpecialFloats(Metric):
    """sum, mean, max and min states of every float dtype (float max/min: gathered; sums: may be all-reduced)."""

    def __init__(self, reductions, **kwargs):
        super().__init__(**kwargs)
        for dtype in FLOATS:
            for fx in reductions:
                self.add_state(f"{fx}_{str(dtype)[6:]}", default=torch.zeros(80, dtype=dtype), dist_reduce_fx=fx)

    def update(self, values):
        for name in self._defaults:
            setattr(self, name, values.to(self._defaults[name].dtype, copy=True))  # one object per state

    def compute(self):
        return {name: getattr(self, name) for name in self._defaults}


INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class ExtremeInts(Metric):
    """sum, max and min states of every integer dtype (and bool), holding the dtype's extremes."""

    def __init__(self, reductions, **kwargs):
        super().__init__(**kwargs)
        for dtype in INTS:
            for fx in reductions:
                self.add_state(f"{fx}_{str(dtype)[6:]}", default=torch.zeros(80, dtype=dtype), dist_reduce_fx=fx)

    def update(self, rank):
        for name in self._defaults:
            setattr(self, name, _int_values(rank, self._defaults[name].dtype))

    def compute(self):
        return {name: getattr(self, name) for name in self._defaults}


def _make(kind, reductions):
    return SpecialFloats(reductions) if kind == "floats" else ExtremeInts(reductions)


def _fill(metric, kind, rank, world_size):
    metric.update(_float_values(rank, world_size) if kind == "floats" else rank)


def body_special_values(rank, world_size, kind, reductions):
    out = {}
    for route in ROUTES:
        metric = _make(kind, reductions)
        _fill(metric, kind, rank, world_size)
        with forced_policy(reduce=route), count_collectives() as counts:
            out[route] = quiet_compute(metric)
        out[route + "_all_reduce"] = counts.get("all_reduce", 0)
    return out


def _assert_bitwise_equal(got, expected, where):
    """Equal dtype and shape, NaN at the same places, equal values and equal signs elsewhere (-0.0 vs +0.0)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, (where, got, expected)
    if not got.is_floating_point():
        assert torch.equal(got, expected), (where, got, expected)
        return
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan), (where, torch.isnan(got).nonzero(), nan.nonzero())
    assert torch.equal(got[~nan], expected[~nan]), (where, got, expected)
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(expected[~nan])), (where, got, expected)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("kind", "reductions"),
    [("floats", ("sum", "mean")), ("floats", ("max", "min")), ("ints", ("sum",)), ("ints", ("max", "min"))],
    ids=["float-sums", "float-max-min", "int-sums", "int-max-min"],
)
def test_special_values_equal_stock_bit_for_bit_on_every_route(world_size, kind, reductions):
    for result in run_distributed(body_special_values, world_size, kind, reductions):
        # Stock's reduction of the stacked per-rank states, on one process.
        per_rank = []
        for rank in range(world_size):
            metric = _make(kind, reductions)
            _fill(metric, kind, rank, world_size)
            per_rank.append(metric)
        reference = _make(kind, reductions)
        for route in ROUTES:
            for name, fx in reference._reductions.items():
                expected = fx(torch.stack([getattr(m, name) for m in per_rank]))
                _assert_bitwise_equal(result[route][name], expected, (route, name))
        # The routes differ: sums and integer max/min are all-reduced when forced, float max/min never are.
        assert result["never_all_reduce"] == 0
        assert result["always_all_reduce"] == (0 if reductions == ("max", "min") and kind == "floats" else 1)


def body_nan_in_large_max_state(rank, world_size):
    # The case: a 10,000-float max state with a NaN at a different position on each rank.
    metric = SpecialFloats(("max",))
    values = torch.arange(10_000, dtype=torch.float64)
    values[rank * 1000] = NAN
    metric.update(values)
    return {name: torch.isnan(value).nonzero().flatten().tolist() for name, value in quiet_compute(metric).items()}


@pytest.mark.parametrize("world_size", [3])
def test_nan_of_every_rank_survives_a_large_max_state(world_size):
    # Large enough that the cost model would all-reduce it: one process keeps every rank's NaN.
    for result in run_distributed(body_nan_in_large_max_state, world_size):
        for name, positions in result.items():
            assert positions == [rank * 1000 for rank in range(world_size)], (name, positions)


class OneTensorTwoReductions(Metric):
    """Two states holding the very same tensor object, one summed and one averaged."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.zeros(3), dist_reduce_fx="sum")
        self.add_state("average", default=torch.zeros(3), dist_reduce_fx="mean")

    def update(self, values):
        self.total = self.average = values

    def compute(self):
        return {"total": self.total, "average": self.average}


def body_shared_object(rank, world_size):
    metric = OneTensorTwoReductions()
    metric.update(torch.arange(3.0) * (rank + 1))
    return quiet_compute(metric)


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_object_in_two_states_is_reduced_by_each_states_reduction(world_size):
    stacked = torch.stack([torch.arange(3.0) * (rank + 1) for rank in range(world_size)])
    for result in run_distributed(body_shared_object, world_size):
        assert torch.equal(result["total"], stacked.sum(0)) and torch.equal(result["average"], stacked.mean(0))


# ----------------------------------------------------------------------------- data the ranks cannot combine
class Rows(Metric):
    """A `cat` list of rows and a `sum` tensor, for conflicts between ranks."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("rows", default=[], dist_reduce_fx="cat")
        self.add_state("total", default=torch.zeros(3), dist_reduce_fx="sum")

    def update(self, rows, total=None):
        self.rows.extend(rows)
        if total is not None:
            self.total = total

    def compute(self):
        return dim_zero_cat(self.rows)


CONFLICTS = {
    # rank 0 and the last rank: [n, 3]; rank 1: [n, 4] (torch's "Sizes of tensors must match" before)
    "trailing dims": lambda rank: ([torch.ones(2 + rank, 4 if rank == 1 else 3)],),
    "dtype": lambda rank: ([torch.ones(2, 3, dtype=torch.int64 if rank == 1 else torch.float32)],),
    "ndim": lambda rank: ([torch.ones(2, 3, 1) if rank == 1 else torch.ones(2, 3)],),
    # rank 0's own items do not concatenate: the plan leaves it to the join, which raises on every rank alike
    "items of one rank": lambda rank: ([torch.ones(2, 3), torch.ones(1, 5)] if rank == 0 else [torch.ones(1, 3)],),
    # a `sum` state of a different shape on one rank (stock's stack would fail)
    "sum shape": lambda rank: ([torch.ones(1, 3)], torch.zeros(4 if rank == 1 else 3)),
}


def body_conflict(rank, world_size, case):
    metric = Rows()
    metric.update(*CONFLICTS[case](rank))
    try:
        quiet_compute(metric)
    except Exception as err:  # every rank must raise, the same error
        return type(err).__name__, str(err)
    return None, None


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(CONFLICTS))
def test_incompatible_data_raise_sync_mismatch_naming_the_state(world_size, case):
    results = run_distributed(body_conflict, world_size, case)
    for kind, message in results:
        assert kind == "SyncMismatchError", (kind, message)
        state = "total" if case == "sum shape" else "rows"
        assert f"Rows.{state}" in message and "entry 0" not in message, message
        for rank in range(world_size):
            assert f"rank {rank}" in message, message
        assert ("int64" if case == "dtype" else "float32") in message, message
    assert len({message for _, message in results}) == 1  # every rank says the same
    if case == "trailing dims":  # each rank's shape: what its items join to
        assert "(*, 4)" in results[0][1] and "(*, 3)" in results[0][1], results[0][1]


def body_hook_conflict(rank, world_size):
    try:
        gather_all_tensors(torch.ones(2, dtype=torch.int64 if rank == 1 else torch.float32))
    except SyncMismatchError as err:
        return str(err)
    return None


@pytest.mark.parametrize("world_size", [2, 3])
def test_hook_conflict_names_the_gathered_tensor(world_size):
    for message in run_distributed(body_hook_conflict, world_size):
        assert message is not None and "gather_all_tensors" in message and "entry 0" not in message, message
        assert "int64" in message and "float32" in message, message
