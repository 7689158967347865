"""`gather_all_tensors` as `dist_sync_fn` of stock metrics: equal to one process on the concatenated data."""

import warnings

import pytest
import torch
from conftest import run_distributed
from torchmetrics import Metric as StockMetric
from torchmetrics.aggregation import CatMetric, MeanMetric, SumMetric
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, MulticlassAUROC
from torchmetrics.utilities import dim_zero_cat

from torchmetrics_varlen import gather_all_tensors


class PairCollector(StockMetric):
    """A custom metric with a 2-D int64 `cat` list state."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("pairs", default=[], dist_reduce_fx="cat")

    def update(self, pairs):
        self.pairs.append(pairs)

    def compute(self):
        if isinstance(self.pairs, list) and not self.pairs:
            return torch.empty(0, 2, dtype=torch.int64)
        return dim_zero_cat(self.pairs)


def _binary(n, gen):
    return torch.rand(n, generator=gen), torch.randint(0, 2, (n,), generator=gen)


def _multiclass(n, gen):
    return torch.softmax(torch.randn(n, 3, generator=gen), -1), torch.randint(0, 3, (n,), generator=gen)


def _values(n, gen):
    return (torch.randn(n, generator=gen).double(),)


def _pairs(n, gen):
    return (torch.randint(-(10**12), 10**12, (n, 2), generator=gen),)


METRICS = {
    "BinaryAUROC": (lambda **kw: BinaryAUROC(thresholds=None, **kw), _binary),
    "MulticlassAUROC": (lambda **kw: MulticlassAUROC(num_classes=3, thresholds=None, **kw), _multiclass),
    "BinaryAveragePrecision": (lambda **kw: BinaryAveragePrecision(thresholds=None, **kw), _binary),
    "CatMetric": (lambda **kw: CatMetric(**kw), _values),
    "MeanMetric": (lambda **kw: MeanMetric(**kw), _values),
    "SumMetric": (lambda **kw: SumMetric(**kw), _values),
    "PairCollector": (lambda **kw: PairCollector(**kw), _pairs),
}

SIZES = {
    "uneven": lambda world: [7, 3, 5, 4][:world],
    "one_empty": lambda world: [6, 0, 5, 2][:world] if world > 1 else [6],
    "first_empty": lambda world: [0, 5, 4, 3][:world] if world > 1 else [5],
    "all_empty": lambda world: [0] * world,
}


def _split(sizes, rank):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def body_stock_metric(rank, world_size, name, scenario, batch=4):
    factory, make_data = METRICS[name]
    sizes = SIZES[scenario](world_size)
    gen = torch.Generator().manual_seed(1234)
    data = make_data(sum(sizes), gen)
    mine = [x[_split(sizes, rank)] for x in data]
    metric = factory(dist_sync_fn=gather_all_tensors)
    for start in range(0, sizes[rank], batch):
        metric.update(*[x[start : start + batch] for x in mine])
    reference = factory(sync_on_compute=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if sum(sizes):
            reference.update(*data)
            expected = reference.compute()
            got = metric.compute()
            return {"got": got, "expected": expected}
        # No data anywhere: the reference metric sees no update at all.
        try:
            expected = reference.compute()
        except Exception as err:  # the single-process behaviour on no data is the reference
            expected = type(err).__name__
        try:
            got = metric.compute()
        except Exception as err:  #
            got = type(err).__name__
        return {"got": got, "expected": expected}


def _assert_same(got, expected):
    if isinstance(expected, str) or isinstance(got, str):
        assert got == expected
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-6, atol=1e-7)
    else:
        assert type(got) is type(expected)
        assert len(got) == len(expected)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scenario", ["uneven", "one_empty", "first_empty"])
@pytest.mark.parametrize("name", sorted(METRICS))
def test_stock_metric_with_hook_equals_single_process(world_size, scenario, name):
    for result in run_distributed(body_stock_metric, world_size, name, scenario):
        _assert_same(result["got"], result["expected"])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["MeanMetric", "SumMetric", "CatMetric", "PairCollector"])
def test_all_ranks_empty_does_not_abort(world_size, name):
    # Tensor-state metrics must equal the single-process value on no data. For `cat` lists the hook returns empty
    # tensors; stock `_sync_dist` then stacks them, so only the element count can be compared
    # (torchmetrics_varlen.Metric restores the exact single-process result, see test_metric.py).
    for result in run_distributed(body_stock_metric, world_size, name, "all_empty"):
        if name in ("MeanMetric", "SumMetric"):
            _assert_same(result["got"], result["expected"])
        else:
            got = result["got"]
            assert isinstance(got, torch.Tensor) and got.numel() == 0


def body_hook_autograd(rank, world_size):
    """`dist_sync_on_step=True`: the local input's gradient is the one-process gradient of the global value."""

    class GlobalMeanSquare(StockMetric):
        full_state_update = False

        def __init__(self):
            super().__init__(dist_sync_on_step=True, dist_sync_fn=gather_all_tensors)
            self.add_state("values", default=[], dist_reduce_fx="cat")

        def update(self, x):
            self.values.append(x)

        def compute(self):
            return (dim_zero_cat(self.values) ** 2).mean()

    sizes = [5, 2, 0, 3][:world_size]
    if world_size == 1:
        sizes = [4]
    everything = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    local = everything[_split(sizes, rank)].clone().requires_grad_(True)
    metric = GlobalMeanSquare()
    value = metric(local)
    if local.numel():
        value.backward()
    reference_input = everything.clone().requires_grad_(True)
    (reference_input**2).mean().backward()
    return {
        "value": value.detach(),
        "expected_value": (everything**2).mean(),
        "grad": local.grad if local.numel() else torch.zeros(0, dtype=torch.float64),
        "expected_grad": reference_input.grad[_split(sizes, rank)],
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_hook_keeps_rank_local_autograd_graph(world_size):
    for result in run_distributed(body_hook_autograd, world_size):
        torch.testing.assert_close(result["value"], result["expected_value"])
        torch.testing.assert_close(result["grad"], result["expected_grad"])


# ------------------------------------------------------------------ where the hook cannot help: an empty rank's lists
def _retrieval_data(world_size, empty):
    """A retrieval batch split over the ranks, rank ``empty`` holding nothing; and the whole batch."""
    gen = torch.Generator().manual_seed(11)
    n = 10 * world_size
    indexes = torch.randint(0, 5, (n,), generator=gen)
    whole = (torch.rand(n, generator=gen), torch.randint(0, 2, (n,), generator=gen), indexes)  # update's order
    holders = [rank for rank in range(world_size) if rank != empty]
    return whole, {rank: [part.chunk(len(holders))[holders.index(rank)] for part in whole] for rank in holders}


def body_retrieval_hook_empty_rank(rank, world_size, empty):
    from torchmetrics.retrieval import RetrievalMAP

    from torchmetrics_varlen import SyncTimeoutError

    _, parts = _retrieval_data(world_size, empty)
    metric = RetrievalMAP(dist_sync_fn=gather_all_tensors)
    if rank in parts:
        metric.update(*parts[rank])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compute() before update() on the empty rank
        try:
            metric.compute()
        except SyncTimeoutError as err:
            return ("SyncTimeoutError", str(err))
        except Exception as err:  # the empty rank fails on its own, inside stock code
            return (type(err).__name__, str(err))
    return ("returned", "")


@pytest.mark.parametrize("world_size", [2, 3])
def test_hook_names_the_empty_list_case_on_the_waiting_ranks(world_size):
    """Stock calls the hook once per item of a `dist_reduce_fx=None` list: never on an empty rank. Its peers say so."""
    empty = 1
    env = {"TORCHMETRICS_VARLEN_SYNC_TIMEOUT": "2"}
    results = run_distributed(body_retrieval_hook_empty_rank, world_size, empty, fresh=True, env=env, deadline=60)
    kind, message = results[empty]
    assert kind == "ValueError" and "No samples to concatenate" in message, results[empty]
    for rank, (kind, message) in enumerate(results):
        if rank == empty:
            continue
        assert kind == "SyncTimeoutError", (rank, kind, message)
        assert "gather_all_tensors" in message and "dist_reduce_fx=None" in message, message
        assert "torchmetrics_varlen.rebase(" in message and "empty" in message, message


def body_retrieval_rebased_empty_rank(rank, world_size, empty):
    from torchmetrics.retrieval import RetrievalMAP

    from torchmetrics_varlen import rebase

    _, parts = _retrieval_data(world_size, empty)
    metric = rebase(RetrievalMAP)()
    if rank in parts:
        metric.update(*parts[rank])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return metric.compute()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_rebased_retrieval_map_is_exact_with_an_empty_rank(world_size):
    from torchmetrics.retrieval import RetrievalMAP

    empty = 1 if world_size > 1 else -1
    whole, _ = _retrieval_data(world_size, empty)
    expected = RetrievalMAP()(*whole)
    for value in run_distributed(body_retrieval_rebased_empty_rank, world_size, empty):
        torch.testing.assert_close(value, expected, rtol=0, atol=0)


class _TypedItems(StockMetric):
    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("items", default=[], dist_reduce_fx="cat")

    def update(self, x):
        self.items.append(x)

    def compute(self):
        return dim_zero_cat(self.items)


ZERO_LENGTH_DTYPES = ["bfloat16", "float16", "int8", "uint8", "int32", "int64", "bool"]


def body_zero_length_items(rank, world_size):
    # Rank 0 holds zero-length typed items, the others none (stock sends its float32 placeholder for them).
    out = {}
    for name in ZERO_LENGTH_DTYPES:
        for shape in [(0,), (0, 3)]:
            items = [torch.zeros(shape, dtype=getattr(torch, name))] * 2
            metric = _TypedItems(dist_sync_fn=gather_all_tensors)
            reference = _TypedItems(distributed_available_fn=lambda: False)  # one process holding every item
            for item in items:
                reference.update(item)
                if rank == 0:
                    metric.update(item)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got, expected = metric.compute(), reference.compute()
            out[(name, shape)] = ((got.dtype, got.shape[1:], got.numel()), (expected.dtype, expected.shape[1:], 0))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_hook_keeps_the_dtype_of_zero_length_items(world_size):
    for result in run_distributed(body_zero_length_items, world_size):
        for case, (got, expected) in result.items():
            assert got == expected, case


# ----------------------------------------------------------------- dtypes a backend cannot move, conjugate views
ROUTED_DTYPES = ["int16", "uint16", "uint32", "int8", "bool", "bfloat16"]


def body_routed_dtypes_and_conjugates(rank, world_size):
    """Large uneven states of every dtype take the per-rank route (128 KiB or more on gloo); conjugate views too."""
    out = {}
    for name in ROUTED_DTYPES:
        dtype = getattr(torch, name)
        mine = (torch.arange(70_000 + rank) % 120).to(dtype) if rank < 2 else torch.zeros(0, dtype=dtype)
        out[name] = [piece.clone() for piece in gather_all_tensors(mine)]
    gen = torch.Generator().manual_seed(rank)
    for size in (20_000, 8):  # the per-rank route, and a small one that rides in the records
        conj = torch.randn(size + rank, dtype=torch.complex64, generator=gen).conj()
        out[f"conj{size}"] = [piece.resolve_conj().clone() for piece in gather_all_tensors(conj)]
    neg = torch.randn(40_000 + rank, dtype=torch.complex128, generator=gen).conj().imag  # a negative-bit view
    out["neg"] = [piece.resolve_neg().clone() for piece in gather_all_tensors(neg)]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_states_of_any_dtype_and_conjugate_views_take_the_per_rank_route(world_size):
    # Before: int16, uint16 and uint32 states broadcast in their own dtype, which gloo (and NCCL) refuse, and every
    # rank raised SyncPeerError as if a peer had crashed; a conjugate view raised on its own rank alone.
    results = run_distributed(body_routed_dtypes_and_conjugates, world_size, deadline=90)
    for name in ROUTED_DTYPES:
        dtype = getattr(torch, name)
        expected = [
            (torch.arange(70_000 + r) % 120).to(dtype) if r < 2 else torch.zeros(0, dtype=dtype)
            for r in range(world_size)
        ]
        for result in results:
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(result[name], expected)), name
    for key in ("conj20000", "conj8", "neg"):
        for rank, result in enumerate(results):
            for source, piece in enumerate(result[key]):
                assert torch.equal(piece, results[source][key][source]), (key, rank, source)
    gen = [torch.Generator().manual_seed(r) for r in range(world_size)]
    for source in range(world_size):  # each rank's own piece is its values, conjugated
        expected = torch.randn(20_000 + source, dtype=torch.complex64, generator=gen[source]).conj().resolve_conj()
        assert torch.equal(results[0]["conj20000"][source], expected)
