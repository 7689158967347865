"""`gather_all_tensors` called directly: a seeded differential fuzz, mismatch errors, and the collective budget.

The fuzz derives everything from a seed that every rank shares, so each rank can rebuild every peer's tensor and
check the gathered list exactly (shape, dtype and bits) without any extra communication.
"""

import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from _helpers import count_collectives
from conftest import run_distributed

import torchmetrics_varlen
from torchmetrics_varlen import SyncMismatchError, gather_all_tensors

WORLD_SIZES = [1, 2, 3, 4]
FUZZ_SEED = 20240611
DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
]  # fmt: skip
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# How a non-empty rank's tensor is laid out in memory.
LAYOUTS = ["contiguous", "transposed", "strided", "offset", "expanded", "conj"]


@dataclass
class RankSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    random_bits: bool  # arbitrary bit patterns (NaN, inf, subnormals for floats) instead of ordinary values
    seed: int

    def __str__(self) -> str:
        extra = "" if self.layout == "contiguous" else f" {self.layout}"
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}{extra}"


def make_case(seed, case, world_size):
    """Everything about one case, from (seed, case, world_size) only: the same on every rank."""
    rng = random.Random(f"{seed}/{case}/{world_size}")  # str seeds are hashed with sha512: stable across processes
    dtype = rng.choice(DTYPES)
    ndim = rng.randint(0, 3)
    mode = rng.choices(["mixed", "none_empty", "all_empty"], weights=[6, 3, 1])[0]
    scalar_mix = ndim <= 1 and rng.random() < 0.4  # non-empty peers are a mix of 0-d and 1-d tensors
    specs = []
    for _ in range(world_size):
        empty = mode == "all_empty" or (mode == "mixed" and rng.random() < 0.4)
        rank_seed = rng.getrandbits(62)
        if empty:
            specs.append(_empty_spec(rng, dtype, ndim, seed=rank_seed))
            continue
        rank_ndim = rng.choice([0, 1]) if scalar_mix else ndim
        shape = tuple(rng.randint(1, 5) for _ in range(rank_ndim))
        layouts = ["contiguous"] * 6 + ["offset", "expanded"]
        if rank_ndim >= 1:
            layouts.append("strided")
        if rank_ndim >= 2:
            layouts.append("transposed")
        if dtype.is_complex:
            layouts.append("conj")
        specs.append(RankSpec(shape, dtype, rng.choice(layouts), rng.random() < 0.5, rank_seed))
    if all(_numel(spec.shape) == 0 for spec in specs):
        # Nobody holds data: the ranks keep one dtype (see test_all_empty_ranks_with_different_dtypes).
        for spec in specs:
            spec.dtype = dtype
    return specs


def _empty_spec(rng, dtype, ndim, seed):
    """An empty rank: the same ndim with a zero somewhere, or what torchmetrics sends (`torch.tensor([])`), or any."""
    kind = rng.choice(["same_ndim", "torchmetrics", "other"])
    if kind == "same_ndim" and ndim >= 1:
        shape = [rng.randint(0, 4) for _ in range(ndim)]
        shape[rng.randrange(ndim)] = 0
        return RankSpec(tuple(shape), dtype, "contiguous", False, seed)
    if kind == "torchmetrics" or ndim == 0:
        return RankSpec((0,), torch.float32, "contiguous", False, seed)
    other_ndim = rng.randint(1, 4)
    shape = [rng.randint(0, 3) for _ in range(other_ndim)]
    shape[rng.randrange(other_ndim)] = 0
    return RankSpec(tuple(shape), rng.choice(DTYPES), "contiguous", False, seed)


def _values(numel, dtype, random_bits, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    if random_bits or not (dtype.is_floating_point or dtype.is_complex):
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        return raw.view(dtype)
    scale = 1000.0 if dtype.itemsize >= 4 else 10.0
    real = torch.randn(numel * (2 if dtype.is_complex else 1), generator=gen, dtype=torch.float64) * scale
    return torch.view_as_complex(real.view(-1, 2)).to(dtype) if dtype.is_complex else real.to(dtype)


def build(spec):
    """The tensor a rank holds, laid out as its spec says (views of a larger base for the non-contiguous layouts)."""
    gen = torch.Generator().manual_seed(spec.seed)
    shape = spec.shape
    if spec.layout == "transposed":
        base_shape = (*shape[:-2], shape[-1], shape[-2])
    elif spec.layout == "strided":
        base_shape = (2 * shape[0] + 1, *shape[1:])
    elif spec.layout == "offset":
        base_shape = (3 + _numel(shape),)
    elif spec.layout == "expanded":
        base_shape = tuple(1 if i % 2 == 0 else s for i, s in enumerate(shape))
    else:
        base_shape = shape
    base = _values(_numel(base_shape), spec.dtype, spec.random_bits, gen).reshape(base_shape)
    if spec.layout == "transposed":
        return base.transpose(-1, -2)
    if spec.layout == "strided":
        return base[1::2]
    if spec.layout == "offset":
        return base[3:].view(shape)
    if spec.layout == "expanded":
        return base.expand(shape)
    if spec.layout == "conj":
        return base.conj()
    return base


def _numel(shape):
    numel = 1
    for size in shape:
        numel *= size
    return numel


def expected_gather(tensors):
    """The documented result: true tensors; empty ranks take dtype and trailing shape of the first rank with data."""
    nonempty = [t for t in tensors if t.numel() > 0]
    out = []
    for tensor in tensors:
        if tensor.numel() > 0:
            out.append(tensor)
        elif nonempty:
            out.append(torch.empty((0, *nonempty[0].shape[1:]), dtype=nonempty[0].dtype))
        else:  # nobody holds data: every rank keeps its own shape and dtype
            out.append(torch.empty(tensor.shape, dtype=tensor.dtype))
    return out


def _bits(tensor):
    tensor = tensor.resolve_conj().contiguous()
    return tensor.view(_BITS[tensor.dtype.itemsize])


def compare(got, expected):
    """Problems found comparing one gathered tensor with the expected one (empty when they are exactly equal)."""
    if not isinstance(got, torch.Tensor):
        return [f"got {type(got).__name__}"]
    problems = []
    if got.dtype != expected.dtype:
        problems.append(f"dtype {got.dtype} != {expected.dtype}")
    if got.shape != expected.shape:
        problems.append(f"shape {tuple(got.shape)} != {tuple(expected.shape)}")
    if got.device != expected.device:
        problems.append(f"device {got.device} != {expected.device}")
    if problems or expected.numel() == 0:
        return problems
    exact = torch.equal(_bits(got), _bits(expected))  # to the bit: NaN payloads and -0.0 included
    has_nan = (expected.is_floating_point() or expected.is_complex()) and bool(expected.isnan().any())
    if not exact or (not has_nan and not torch.equal(got, expected)):
        problems.append("values differ")
    return problems


def body_fuzz(rank, world_size, cases, seed):
    failures = []
    stats = Counter()
    for case in range(cases):
        specs = make_case(seed, case, world_size)
        tensors = [build(spec) for spec in specs]  # every rank rebuilds every peer's tensor from the shared seed
        mine = tensors[rank]
        describe = f"seed={seed} case={case} world={world_size}: [" + "; ".join(map(str, specs)) + "]"
        _count(stats, specs, tensors)
        try:
            got = gather_all_tensors(mine)
        except Exception as err:
            failures.append(f"{describe} -> rank {rank} raised {type(err).__name__}: {err}")
            continue
        problems = []
        if len(got) != world_size:
            problems.append(f"{len(got)} tensors for {world_size} ranks")
        else:
            for peer, (g, e) in enumerate(zip(got, expected_gather(tensors))):
                problems += [f"rank {peer}: {p}" for p in compare(g, e)]
            if mine.numel() > 0 and got[rank] is not mine:
                problems.append("own element is not the caller's tensor")
        if problems:
            failures.append(f"{describe} -> on rank {rank}: {', '.join(problems)}")
    return {"cases": cases, "failures": failures[:20], "n_failures": len(failures), "stats": dict(stats)}


def _count(stats, specs, tensors):
    empty = [t.numel() == 0 for t in tensors]
    stats[str(specs[0].dtype)] += 1
    stats["all_empty" if all(empty) else "some_empty" if any(empty) else "none_empty"] += 1
    nonempty_ndims = {t.ndim for t in tensors if t.numel() > 0}
    if nonempty_ndims == {0, 1}:
        stats["scalar_mix"] += 1
    for spec, t in zip(specs, tensors):
        if (t.numel() > 0 and not t.is_contiguous()) or spec.layout == "conj":
            stats[f"layout_{spec.layout}"] += 1
        if t.numel() == 0 and any(x.numel() > 0 and x.dtype != t.dtype for x in tensors):
            stats["empty_other_dtype"] += 1
        if t.numel() == 0 and t.ndim > 0 and t.shape[0] > 0:
            stats["empty_nonleading_zero"] += 1


def _check_fuzz(results, world_size, cases):
    for rank, result in enumerate(results):
        assert result["cases"] == cases
        assert result["n_failures"] == 0, f"rank {rank}: {result['n_failures']} failing cases:\n" + "\n".join(
            result["failures"]
        )
    stats = results[0]["stats"]
    if cases >= 300:  # the generator does reach every corner
        assert all(stats.get(str(dtype), 0) > 0 for dtype in DTYPES), stats
        expected = ["all_empty", "none_empty", "layout_transposed", "layout_strided", "layout_conj"]
        if world_size > 1:
            expected += ["some_empty", "scalar_mix", "empty_other_dtype", "empty_nonleading_zero"]
        assert all(stats.get(key, 0) > 0 for key in expected), stats


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_matches_reference_on_random_cases(request, world_size):
    cases = request.config.getoption("--fuzz-cases")
    results = run_distributed(body_fuzz, world_size, cases, FUZZ_SEED)
    _check_fuzz(results, world_size, cases)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_matches_reference_on_many_random_cases(world_size):
    results = run_distributed(body_fuzz, world_size, 5000, FUZZ_SEED + 1, deadline=600.0)
    _check_fuzz(results, world_size, 5000)


# --- mismatches: raised on every rank together, and the group stays usable ------------------------------------------


def _mismatch_dtype(rank):
    return torch.ones(rank + 1, 2, dtype=torch.float32 if rank % 2 == 0 else torch.int64)


def _mismatch_ndim(rank):
    return torch.ones(2, 3) if rank == 0 else torch.ones(1, 2, rank + 1)


def _mismatch_sparse(rank, world_size):
    if rank == world_size - 1:
        return torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,))
    return torch.arange(rank + 2, dtype=torch.float32)


def _mismatch_scalar_vs_2d(rank):
    return torch.tensor(1.5) if rank == 0 else torch.ones(rank, 2)


def _mismatch_too_many_dims(rank):
    return torch.ones((1,) * 7) if rank == 0 else torch.ones(rank, 1, 1, 1, 1, 1)


def _mismatch_unsupported_dtype(rank):
    return torch.ones(rank + 1, dtype=torch.complex32 if rank == 0 else torch.complex64)


MISMATCHES = {
    "dtype": _mismatch_dtype,
    "ndim": _mismatch_ndim,
    "sparse": _mismatch_sparse,
    "scalar_vs_2d": _mismatch_scalar_vs_2d,
    "too_many_dims": _mismatch_too_many_dims,
    "unsupported_dtype": _mismatch_unsupported_dtype,
}


def body_mismatch(rank, world_size, name):
    make = MISMATCHES[name]
    mine = make(rank, world_size) if name == "sparse" else make(rank)
    with pytest.raises(SyncMismatchError) as info:
        gather_all_tensors(mine)
    # No rank is left inside a collective: the next gather pairs up and is exact.
    after = gather_all_tensors(torch.arange(rank + 1, dtype=torch.int64) * 10)
    assert [t.tolist() for t in after] == [[10 * i for i in range(r + 1)] for r in range(world_size)]
    return str(info.value)


def _shape_dtype(tensor):
    return f"shape={tuple(tensor.shape)}, dtype={str(tensor.dtype).replace('torch.', '')}"


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning", "ignore:ComplexHalf support:UserWarning")
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_mismatch_raises_on_every_rank(world_size, name):
    messages = run_distributed(body_mismatch, world_size, name)
    assert len(set(messages)) == 1  # every rank decided from the same table, so every rank says the same
    message = messages[0]
    make = MISMATCHES[name]
    for rank in range(world_size):
        tensor = make(rank, world_size) if name == "sparse" else make(rank)
        assert f"rank {rank}: gather_all_tensors" in message
        if tensor.layout != torch.strided or tensor.ndim > 6 or tensor.dtype == torch.complex32:
            assert f"rank {rank} holds" in message  # the rank with the unsyncable tensor is named as the culprit
        else:
            assert f"rank {rank}: gather_all_tensors, {_shape_dtype(tensor)}" in message, message
    if name == "dtype":
        assert "['float32', 'int64']" in message
    if name == "ndim":
        assert "number of dimensions" in message and "[2, 3]" in message
    if name == "sparse":
        assert "sparse" in message


def body_all_empty_mixed_dtypes(rank, world_size):
    mine = torch.empty(0, dtype=torch.float32 if rank == 0 else torch.int64)
    try:
        got = gather_all_tensors(mine)
    except SyncMismatchError as err:
        return f"SyncMismatchError: {err}"
    return [(tuple(t.shape), t.dtype) for t in got]


def test_all_empty_ranks_with_different_dtypes():
    # No rank holds data: every piece takes one dtype, so that stock's stack of them keeps it. A 1-D float32 piece is
    # what stock sends for an empty list state (its placeholder), so rank 1's int64 items win: what one process keeps.
    results = run_distributed(body_all_empty_mixed_dtypes, 2)
    expected = [((0,), torch.int64), ((0,), torch.int64)]
    assert results == [expected, expected]


# --- collective budget ----------------------------------------------------------------------------------------------


def body_collectives(rank, world_size):
    scenarios = {
        "uneven": torch.randn(rank + 1, 3),
        "one_empty": torch.empty(0) if rank == 1 else torch.arange(rank + 2),
        "scalar": torch.tensor(float(rank)),
        "big": torch.ones(1000 * (rank + 1), dtype=torch.float64),
        "all_empty": torch.empty(0, 4),
        "mismatch": torch.ones(2, dtype=torch.float32 if rank == 0 else torch.int64),
    }
    out = {}
    for scenario, tensor in scenarios.items():
        raised = None
        with count_collectives() as counts:
            try:
                gather_all_tensors(tensor)
            except SyncMismatchError:
                raised = "SyncMismatchError"
        out[scenario] = (dict(counts), raised)
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_collective_budget(world_size):
    for rank, result in enumerate(run_distributed(body_collectives, world_size)):
        for scenario, (counts, raised) in result.items():
            total = sum(counts.values())
            where = f"rank {rank}, {scenario}: {counts}"
            assert counts.get("barrier", 0) == 0 and counts.get("monitored_barrier", 0) == 0, where
            if world_size == 1:
                assert total == 0, where
                assert raised is None
            elif scenario == "all_empty":
                assert total == 1, where  # the metadata exchange alone: nobody has bytes to send
            elif scenario == "mismatch":
                assert total == 1, where  # raised right after the metadata exchange, before any data moves
                assert raised == "SyncMismatchError"
            elif scenario == "scalar":
                assert total == 1, where  # equal small tensors ride in the records: the metadata exchange is all
            else:
                assert total == 2, where
            if world_size > 1 and scenario != "mismatch":
                assert raised is None, where


def test_exported_from_package():
    assert torchmetrics_varlen.gather_all_tensors is gather_all_tensors
    assert issubclass(SyncMismatchError, RuntimeError)


def test_fuzz_checker_is_exact_and_deterministic():
    # The reference side of the differential test, checked in-process: it must catch what it claims to catch.
    x = torch.tensor([1.0, float("nan"), -0.0])
    assert compare(x, x.clone()) == []
    assert compare(torch.tensor([0.0]), torch.tensor([-0.0])) == ["values differ"]
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 3])) == ["values differ"]
    assert compare(torch.tensor([1, 2]), torch.tensor([1.0, 2.0])) == ["dtype torch.int64 != torch.float32"]
    assert compare(torch.ones(1, 2), torch.ones(2)) == ["shape (1, 2) != (2,)"]
    conj = torch.tensor([1 + 2j], dtype=torch.complex64).conj()
    assert compare(conj.resolve_conj(), conj) == []
    assert compare(torch.tensor([1 + 2j], dtype=torch.complex64), conj) == ["values differ"]
    peers = [torch.empty(3, 0), torch.tensor(2.0), torch.ones(4), torch.empty(0, dtype=torch.int64)]
    got = expected_gather(peers)
    assert [tuple(t.shape) for t in got] == [(0,), (), (4,), (0,)]  # a 0-d first rank with data: empty ranks get (0,)
    assert all(t.dtype == torch.float32 for t in got)
    assert got[1] is peers[1]
    nobody = [torch.empty(0, 3), torch.empty(2, 0)]
    assert [tuple(t.shape) for t in expected_gather(nobody)] == [(0, 3), (2, 0)]
    for case in range(50):
        specs = make_case(FUZZ_SEED, case, 3)
        assert specs == make_case(FUZZ_SEED, case, 3)  # every rank derives the same case
        for spec in specs:
            assert compare(build(spec), build(spec)) == []


def test_plan_cache_reuses_equal_tables_only():
    # In-process: the group's plan cache (GroupState.plans, keyed by every rank's headers and slots) gives a repeated
    # table its plan again, also when the data riding in the records differs; another table, or the same table synced
    # another way, gets its own; a table that raises is never cached. (The distributed tests above run every sync
    # through the cache.)
    from _helpers import describe, group_state

    from torchmetrics_varlen import _engine
    from torchmetrics_varlen._engine.group import Facts, Link, decide

    cpu = torch.device("cpu")
    state = group_state(None, "gloo")  # a group's state, as the registry makes it
    link = Link(state, decide(Facts("gloo", cpu)), None, "t")
    request = _engine.Request([torch.ones(1)], 7, "t")  # the plan reads the request's ops, cat, dst and grad only

    def table(*sizes, inline=False, fill=1.0):
        rows = [describe([torch.full((size,), fill)], 7, "t", inline=inline) for size in sizes]
        return torch.tensor(rows).numpy()

    first = _engine._plan(table(3, 5), request, link)
    assert _engine._plan(table(3, 5), request, link) is first and len(state.plans) == 1
    other = _engine._plan(table(4, 4), request, link)
    assert other is not first and other.entries[0].dense and not first.entries[0].dense
    assert first.nbytes.tolist() == [16, 32]  # 3 and 5 float32 elements, aligned to 16 bytes
    inline = _engine._plan(table(2, 2, inline=True), request, link)
    assert inline.inline and _engine._plan(table(2, 2, inline=True, fill=5.0), request, link) is inline
    joined = _engine._plan(table(3, 5), _engine.Request([torch.ones(1)], 7, "t", cat=[True]), link)
    assert joined is not first and len(state.plans) == 4
    bad = torch.tensor([describe([torch.ones(2)], 7, "t"), describe([torch.ones(2)], 8, "t")]).numpy()
    for _ in range(2):
        with pytest.raises(SyncMismatchError, match="syncing different things"):
            _engine._plan(bad, request, link)
    assert len(state.plans) == 4
