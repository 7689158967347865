"""Metrics saved on W ranks and resumed on W' ranks, and the single-process truth they must equal.

One small data set (``DATASET`` samples, each a function of its dataset index, so a sample seen twice carries the
same values). Phase 1 runs on the saving world, phase 2 on the resuming one; each rank takes the next samples of its
phase in rank order (``SIZES``), some ranks none, and updates in batches of two. Phase 2 starts with two samples of
phase 1 again (a resumed epoch that serves them a second time). The reference is one process that updates stock
torchmetrics classes with every rank's batches of phase 1 in rank order, then those of phase 2: the order in which the
synced ``cat`` rows come out (the first resumed rank holds all of phase 1), so ``cat`` results are compared exactly.
"""

import math
import warnings

import torch
from torchmetrics.aggregation import CatMetric, MaxMetric, MeanMetric, SumMetric
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryAUROC,
    BinaryAveragePrecision,
    BinaryPrecision,
    BinaryRecall,
)
from torchmetrics.retrieval import RetrievalMAP

import torchmetrics_varlen as tv

DATASET = 12
# Samples per rank: phase 1 on the saving world (3 in all: fewer than the 4 ranks of the largest resume), phase 2 on
# the resuming one. Empty ranks in both.
SIZES = {
    "save": {1: [3], 2: [1, 2], 3: [2, 0, 1]},
    "resume": {1: [3], 2: [2, 1], 3: [1, 0, 2], 4: [2, 0, 1, 1]},
}
NAMES = ("sum", "max", "cat2d", "auroc", "retrieval", "indexed", "words", "scalars", "collection")
SCALAR_REDUCE = {"tokens": "sum", "peak": "max"}


def sample(index):
    """Sample ``index`` of the data set: the same values whenever it is seen."""
    gen = torch.Generator().manual_seed(1000 + index)
    target = index % 2  # both classes early
    return {
        "index": index,
        "x": float(torch.randint(0, 10, (), generator=gen)),  # integer-valued: float sums are exact
        "row": torch.randint(-5, 5, (3,), generator=gen).double(),
        "score": round(float(torch.rand((), generator=gen)), 6),
        "target": target,
        "query": index % 3,
        "word": f"w{index}-{int(torch.randint(0, 100, (), generator=gen))}",
    }


def phase_indices(phase, world_size):
    """The dataset indices of a phase, in rank order (phase 2 starts with two samples of phase 1 again)."""
    sizes = SIZES[phase][world_size]
    if phase == "save":
        return list(range(sum(sizes)))
    return [0, 1, *range(3, 3 + sum(sizes) - 2)][: sum(sizes)]


def rank_batches(phase, world_size, rank):
    """The batches (lists of samples, two at most) rank ``rank`` updates with in a phase."""
    sizes = SIZES[phase][world_size]
    indices = phase_indices(phase, world_size)
    start = sum(sizes[:rank])
    mine = [sample(i) for i in indices[start : start + sizes[rank]]]
    return [mine[i : i + 2] for i in range(0, len(mine), 2)]


class Words(tv.Metric):
    """A metric with an object state: the words seen, in order (a list of Python strings, dist_reduce_fx='cat')."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("words", default=[], dist_reduce_fx="cat")

    def update(self, words):
        self.words.extend(words)

    def compute(self):
        return list(self.words)


def build():
    """The metrics under test, fresh (this package's or rebased stock classes)."""
    collection = tv.MetricCollection(
        {
            "acc": BinaryAccuracy(),
            "prec": BinaryPrecision(),  # precision and recall share their states: a compute group
            "rec": BinaryRecall(),
            "ap": BinaryAveragePrecision(thresholds=None),
        }
    )
    return {
        "sum": tv.rebase(SumMetric)(),
        "max": tv.rebase(MaxMetric)(),
        "cat2d": tv.rebase(CatMetric)(),
        "auroc": tv.rebase(BinaryAUROC)(thresholds=None),
        "retrieval": tv.rebase(RetrievalMAP)(),
        "indexed": tv.IndexedMetric(CatMetric()),
        "words": Words(),
        "scalars": tv.ScalarLog(reduce=SCALAR_REDUCE),
        "collection": collection,
    }


def _tensors(batch):
    return {
        "x": torch.tensor([s["x"] for s in batch], dtype=torch.float64),
        "row": torch.stack([s["row"] for s in batch]),
        "score": torch.tensor([s["score"] for s in batch]),
        "target": torch.tensor([s["target"] for s in batch]),
        "query": torch.tensor([s["query"] for s in batch]),
        "index": torch.tensor([s["index"] for s in batch]),
    }


def feed(metrics, batches):
    """Update every metric with each batch (one update call per batch and metric)."""
    for batch in batches:
        t = _tensors(batch)
        metrics["sum"].update(t["x"])
        metrics["max"].update(t["x"])
        metrics["cat2d"].update(t["row"])
        metrics["auroc"].update(t["score"], t["target"])
        metrics["retrieval"].update(t["score"], t["target"], indexes=t["query"])
        metrics["indexed"].update(t["x"], sample_index=t["index"])
        metrics["words"].update([s["word"] for s in batch])
        loss = t["x"].mean()
        metrics["scalars"].update({"loss": loss, "tokens": len(batch), "peak": t["score"].max()}, weight=len(batch))
        metrics["collection"].update(t["score"], t["target"])


def as_plain(value):
    """A metric result as plain Python (tensors to lists), comparable with ``==`` after the workers return it."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {key: as_plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_plain(item) for item in value]
    return value


def compute_all(metrics):
    """Every metric's value, plain, on this rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "compute before update" on ranks that have seen nothing
        return {name: as_plain(metric.compute()) for name, metric in metrics.items()}


def update_counts(metrics):
    """Each metric's update count on this rank (the collection's: its members')."""
    counts = {}
    for name, metric in metrics.items():
        if isinstance(metric, tv.MetricCollection):
            for key, member in metric.items(keep_base=True, copy_state=False):
                counts[f"{name}.{key}"] = member._update_count
        else:
            counts[name] = metric._update_count
    return counts


# ------------------------------------------------------------------------------------------------ the truth
def _all_batches(phases):
    """Every batch of the given (phase, world size) pairs, in rank order within each phase."""
    return [batch for phase, world in phases for rank in range(world) for batch in rank_batches(phase, world, rank)]


def reference(phases):
    """One process, stock torchmetrics (and plain Python), on every batch of ``phases`` in order."""
    batches = _all_batches(phases)
    stock = {
        "sum": SumMetric(),
        "max": MaxMetric(),
        "cat2d": CatMetric(),
        "auroc": BinaryAUROC(thresholds=None),
        "retrieval": RetrievalMAP(),
        "acc": BinaryAccuracy(),
        "prec": BinaryPrecision(),
        "rec": BinaryRecall(),
        "ap": BinaryAveragePrecision(thresholds=None),
    }
    words, first_copy = [], {}
    scalars = {
        "loss": MeanMetric().set_dtype(torch.float64),
        "tokens": SumMetric().set_dtype(torch.float64),
        "peak": MaxMetric().set_dtype(torch.float64),
    }
    for batch in batches:
        t = _tensors(batch)
        stock["sum"].update(t["x"])
        stock["max"].update(t["x"])
        stock["cat2d"].update(t["row"])
        stock["auroc"].update(t["score"], t["target"])
        stock["retrieval"].update(t["score"], t["target"], indexes=t["query"])
        for name in ("acc", "prec", "rec", "ap"):
            stock[name].update(t["score"], t["target"])
        words += [s["word"] for s in batch]
        for s in batch:
            first_copy.setdefault(s["index"], s["x"])
        scalars["loss"].update(t["x"].mean(), torch.tensor(float(len(batch)), dtype=torch.float64))
        scalars["tokens"].update(torch.tensor(float(len(batch)), dtype=torch.float64))
        scalars["peak"].update(t["score"].max().double())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = {name: as_plain(metric.compute()) for name, metric in stock.items()}
        indexed = CatMetric()
        indexed.update(torch.tensor([first_copy[i] for i in sorted(first_copy)], dtype=torch.float64))
        out = {name: values[name] for name in ("sum", "max", "cat2d", "auroc", "retrieval")}
        out["indexed"] = as_plain(indexed.compute())
        out["words"] = words
        out["scalars"] = {key: metric.compute().item() for key, metric in scalars.items()} if batches else {}
        out["collection"] = {name: values[name] for name in ("acc", "prec", "rec", "ap")}
    return out


def expected_updates(phases):
    """The update calls of every phase, each metric once per batch (the collection's members too)."""
    calls = len(_all_batches(phases))
    counts = {name: calls for name in NAMES if name != "collection"}
    counts.update({f"collection.{key}": calls for key in ("acc", "prec", "rec", "ap")})
    return counts


def assert_same(got, expected, where):
    """Exact equality, NaN equal to NaN (AUROC of one class), with a readable message."""

    def same(a, b):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    for name in expected:
        assert same(got[name], expected[name]), f"{where}: {name}: {got[name]!r} != {expected[name]!r}"


def assert_resumed(results, saved_on, loaded_on):
    """Each rank's value right after the load and after more updates equals one process on the same batches; the
    update counts add up to one process's, the first rank holding the saved ones and the others their own."""
    before = reference([("save", saved_on)])
    after = reference([("save", saved_on), ("resume", loaded_on)])
    for rank, (resumed, final, _) in enumerate(results):
        assert_same(resumed, before, f"saved on {saved_on}, rank {rank} of {loaded_on} right after the load")
        assert_same(final, after, f"saved on {saved_on}, rank {rank} of {loaded_on} after more updates")
    counts = [counts for _, _, counts in results]
    totals = {name: sum(c[name] for c in counts) for name in counts[0]}
    assert totals == expected_updates([("save", saved_on), ("resume", loaded_on)])
    for rank in range(1, loaded_on):
        own = len(rank_batches("resume", loaded_on, rank))
        assert all(count == own for count in counts[rank].values()), (rank, counts[rank])
