"""Large and skewed ``cat`` states: bytes, time and peak extra memory per rank of one sync, three sides in one run.

One float32 ``cat`` state (``CatMetric``) of a given size on every rank, synced by

* **stock**: ``torchmetrics.aggregation.CatMetric``'s ``sync()`` (a shape gather, then a gather padded to the largest);
* **padded**: one raw ``all_gather_into_tensor`` (``all_gather_single`` where torch has it) of ``W x`` the largest
  rank's samples, the floor of any padded gather: for the time into a preallocated buffer, for the memory into a
  fresh one (a padded route must hold it);
* **ours**: ``rebase(CatMetric)``'s ``sync()``, whatever route the engine picks from the exchanged records;
* **ours, to one rank**: :func:`~torchmetrics_varlen.compute_on_rank` to rank 0 of a ``CatMetric`` whose
  ``compute()`` returns the sum of its samples (so that the result's broadcast is a few bytes): only rank 0 receives
  the states.

Per rank and side: the bytes received (:class:`tests._meters.ByteMeter`: the output buffers
of every collective, and the part that came from peers), the median time of interleaved syncs, and the peak extra
resident memory of one ``sync()`` alone (``VmHWM`` reset before it, as :mod:`~benchmarks._memory`
does; the synced state, which is the result, is part of it). The ratios compare sides measured in the same processes
in the same run: bytes over the true total (every rank's samples once), time over the padded gather's, peak memory
over the synced result's bytes.
"""

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._memory import _peak_bytes, _reset_peak, _rss_bytes, _trim
from benchmarks._timing import interleaved_medians
from tests._meters import ByteMeter

Row = dict[str, Any]
SIDES = ("stock", "padded", "varlen", "one_rank")
ONE_RANK_DST = 0  # the destination of the one-rank side (the big rank is the last by default)
ITEM_BYTES = 4  # float32
BYTES_TARGET = 1.25  # issue 22: bytes received per rank over the true total, one rank holding 8x the others
MEMORY_TARGET = 1.2  # issue 22: peak extra memory of a sync over the synced result (plus the engine's cap)


def skew_sizes(world_size: int, base: int, factor: int, big_rank: int | None = None) -> list[int]:
    """Samples per rank: ``base`` on every rank but one, which holds ``factor x base`` (the last rank by default).

    Example:
        >>> skew_sizes(4, 10, 8)
        [10, 10, 10, 80]
    """
    big = world_size - 1 if big_rank is None else big_rank
    return [base * factor if rank == big else base for rank in range(world_size)]


def even_sizes(world_size: int, total: int) -> list[int]:
    """``total`` samples split over the ranks, uneven by one sample at most (the first ranks hold one more).

    Example:
        >>> even_sizes(3, 10)
        [4, 3, 3]
    """
    return [total // world_size + (rank < total % world_size) for rank in range(world_size)]


def engine_cap() -> int:
    """The transfer cap in bytes this process syncs with (``TORCHMETRICS_VARLEN_SYNC_CAP``, else the default)."""
    from torchmetrics_varlen._engine.group import sent_cap

    return sent_cap(None)


def _synced_numel(metric: Any) -> int:
    value = metric.value
    return sum(item.numel() for item in value) if isinstance(value, list) else int(value.numel())


def _sum_of_samples() -> Any:
    """A ``CatMetric`` whose ``compute()`` is the sum of its samples: a one-rank compute broadcasts a scalar."""
    from torchmetrics.aggregation import CatMetric

    class SumOfSamples(CatMetric):
        def compute(self) -> torch.Tensor:
            return super().compute().sum()

    return SumOfSamples()


def _gather(output: torch.Tensor, local: torch.Tensor) -> None:
    # Looked up at each call, as the engine does: the byte meter wraps the module's functions.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, local)


def _peak_growth(fn: Callable[[], Any]) -> int:
    """Peak resident-memory growth of one call of ``fn`` on this rank, every rank starting together."""
    gc.collect()
    _trim()
    dist.barrier()
    reset = _reset_peak()
    before = _rss_bytes()
    before_peak = _peak_bytes(reset)
    fn()
    peak = _peak_bytes(reset)
    return peak - before if reset else max(0, peak - before_peak)


def body_sides(rank: int, world_size: int, sizes: Sequence[int], repeats: int) -> dict[str, Any]:
    """One rank: the three sides on ``sizes[rank]`` float32 samples; bytes, peak extra memory, then median times.

    Returns per side ``received``, ``from_peers``, ``collectives``, ``calls`` (name and bytes of each collective),
    ``peak`` (bytes), ``ms`` and ``synced`` (elements of the synced state, or of the padded receive buffer).
    """
    from torchmetrics.aggregation import CatMetric

    from torchmetrics_varlen import rebase

    local = torch.randn(sizes[rank], generator=torch.Generator().manual_seed(rank))
    longest = max(sizes)
    send = torch.zeros(longest)
    send[: local.numel()] = local
    receive = torch.empty(world_size * longest)
    metrics = {"stock": CatMetric(), "varlen": rebase(CatMetric)(), "one_rank": _sum_of_samples()}
    synced: dict[str, int] = {"padded": receive.numel()}

    def sync_of(side: str) -> Callable[[], None]:
        metric = metrics[side]
        metric.update(local)

        def sync_once() -> None:
            metric.sync()
            synced[side] = _synced_numel(metric)
            metric.unsync()

        return sync_once

    def to_one_rank() -> None:
        from torchmetrics_varlen.onerank import compute_on_rank

        metrics["one_rank"]._computed = None  # no cached value: every call syncs
        compute_on_rank(metrics["one_rank"], dst=ONE_RANK_DST)

    metrics["one_rank"].update(local)
    synced["one_rank"] = sum(sizes) if rank == ONE_RANK_DST else 0  # what the destination computes on
    fns: dict[str, Callable[[], Any]] = {
        "stock": sync_of("stock"),
        "padded": lambda: _gather(receive, send),
        "varlen": sync_of("varlen"),
        "one_rank": to_one_rank,
    }

    def fresh_padded() -> None:  # the memory of a padded route: it must allocate W x the largest
        _gather(torch.empty(world_size * longest), send)

    out: dict[str, Any] = {side: {} for side in SIDES}
    for side, fn in fns.items():  # warm-up: a group's first large sync exchanges its metadata twice
        dist.barrier()
        fn()
        dist.barrier()
        with ByteMeter() as meter:
            fn()
        out[side].update(
            received=meter.received, from_peers=meter.from_peers, collectives=meter.collectives, calls=meter.calls
        )
    del receive  # the memory pass runs without the preallocated buffer, so that it does not sit in the baseline
    for side in SIDES:
        out[side]["peak"] = _peak_growth(fresh_padded if side == "padded" else fns[side])
    receive = torch.empty(world_size * longest)  # the padded side's timing closure reads this name again
    for side, ms in interleaved_medians(fns, repeats).items():
        out[side]["ms"] = ms
        out[side]["synced"] = synced[side]
    return out


def measure(world_size: int, sizes: Sequence[int], repeats: int) -> Row:
    """Run :func:`body_sides` on ``world_size`` fresh gloo ranks and :func:`summarize` what they report."""
    from tests._workers import WorkerPool

    if len(sizes) != world_size:
        raise ValueError(f"Expected one size per rank ({world_size}) but got {len(sizes)}: {list(sizes)}")
    deadline = 120.0 + repeats * sum(sizes) * world_size / 2e5
    with WorkerPool(world_size, pg_timeout=300.0) as pool:
        per_rank = pool.run(body_sides, list(sizes), repeats, deadline=deadline)
    return summarize(sizes, per_rank)


def summarize(sizes: Sequence[int], per_rank: Sequence[dict[str, Any]]) -> Row:
    """Per side, per-rank lists (index = rank) of what :func:`body_sides` returned, and the ratios.

    The ratios: ``bytes_ratio`` (the most any rank received over the true total, ``sum(sizes) x 4`` bytes),
    ``time_ratio`` (the slowest rank's median over the padded gather's slowest), ``memory_ratio`` (the largest peak
    extra memory of any rank over the synced result's bytes, the true total).
    """
    total = sum(sizes) * ITEM_BYTES
    row: Row = {"world_size": len(sizes), "sizes": list(sizes), "true_bytes": total, "cap": engine_cap()}
    padded_ms = max(ranks["padded"]["ms"] for ranks in per_rank)
    for side in SIDES:
        side_row = {key: [ranks[side][key] for ranks in per_rank] for key in per_rank[0][side]}
        side_row["bytes_ratio"] = max(side_row["received"]) / total
        side_row["time_ratio"] = max(side_row["ms"]) / padded_ms
        side_row["memory_ratio"] = max(side_row["peak"]) / total
        row[side] = side_row
    return row


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _name(side: str) -> str:
    return {"stock": "stock", "padded": "padded gather", "varlen": "ours", "one_rank": "ours, to rank 0"}[side]


def format_skew_table(row: Row, repeats: int) -> str:
    """The skew case: per side, bytes, time and peak memory per rank, and their ratios."""
    sizes, world = row["sizes"], row["world_size"]
    big = max(range(world), key=sizes.__getitem__)
    others = [rank for rank in range(world) if rank != big]
    lines = [
        f"Skewed cat state: {world} gloo ranks, rank {big} holds {sizes[big]:,} float32 samples, the others"
        f" {max(sizes[r] for r in others):,} (true total {_mib(row['true_bytes'])} MiB); one sync(), per rank;"
        f" time: slowest rank's median of {repeats} interleaved",
        "",
        f"| {'side':<15} | {'coll.':>5} | {'received MiB':>12} | {'from peers MiB':>14} | {'/ true total':>12} |"
        f" {'ms':>8} | {'/ padded':>8} | {'peak MiB, big':>13} | {'peak MiB, others':>16} | {'peak / result':>13} |",
        f"|{'-' * 17}|{'-' * 7}|{'-' * 14}|{'-' * 16}|{'-' * 14}|{'-' * 10}|{'-' * 10}|{'-' * 15}|{'-' * 18}|"
        f"{'-' * 15}|",
    ]
    for side in SIDES:
        data = row[side]
        received = data["received"]
        cell = _mib(max(received)) + ("*" if len(set(received)) > 1 else "")
        lines.append(
            f"| {_name(side):<15} | {max(data['collectives']):>5} | {cell:>12} |"
            f" {_mib(max(data['from_peers'])):>14} | {data['bytes_ratio']:>11.2f}x | {max(data['ms']):>8.2f} |"
            f" {data['time_ratio']:>7.2f}x | {_mib(data['peak'][big]):>13} |"
            f" {_mib(max(data['peak'][r] for r in others)):>16} | {data['memory_ratio']:>12.2f}x |"
        )
    lines += [
        "",
        f"Targets (ours): received / true total <= {BYTES_TARGET}x, time / padded gather <= 1x."
        " * marks ranks that differ: the largest shown; padded gather's memory: into a fresh buffer.",
        f"Ours, to rank {ONE_RANK_DST}: compute_on_rank of the same samples (a scalar result); only rank"
        f" {ONE_RANK_DST} receives the states, and its time includes the result's broadcast.",
    ]
    return "\n".join(lines)


def format_memory_table(rows: Sequence[Row], repeats: int) -> str:
    """The memory case: peak extra memory per rank of ``sync()`` beside its time, as ratios to the synced result."""
    lines = [
        f"Memory of sync() alone: one float32 cat state, near-even ranks; peak resident-memory growth during one sync()"
        f" (VmHWM reset), the largest of any rank; time: slowest rank's median of {repeats} interleaved",
        "",
        f"| {'W':>2} | {'result MiB':>10} | {'cap MiB':>7} | {'ours ms':>8} | {'ours / padded':>13} |"
        f" {'ours peak MiB':>13} | {'ours / result':>13} | {'target':>6} | {'stock / result':>14} |"
        f" {'padded / result':>15} |",
        f"|{'-' * 4}|{'-' * 12}|{'-' * 9}|{'-' * 10}|{'-' * 15}|{'-' * 15}|{'-' * 15}|{'-' * 8}|{'-' * 16}|{'-' * 17}|",
    ]
    for row in rows:
        ours, cap = row["varlen"], row["cap"]
        met = "met" if max(ours["peak"]) <= MEMORY_TARGET * row["true_bytes"] + cap else "no"
        cap_cell = _mib(cap)
        lines.append(
            f"| {row['world_size']:>2} | {_mib(row['true_bytes']):>10} | {cap_cell:>7} | {max(ours['ms']):>8.2f} |"
            f" {ours['time_ratio']:>12.2f}x | {_mib(max(ours['peak'])):>13} | {ours['memory_ratio']:>12.2f}x |"
            f" {met:>6} | {row['stock']['memory_ratio']:>13.2f}x | {row['padded']['memory_ratio']:>14.2f}x |"
        )
    lines += ["", f"Target (ours): peak <= {MEMORY_TARGET}x the result + the engine's cap."]
    return "\n".join(lines)


def plot_skew(row: Row, path: str) -> None:
    """Three panels of ratios, per side: bytes over the true total, time over the padded gather, memory over result."""
    plt = _pyplot()
    sizes = row["sizes"]
    big = max(range(row["world_size"]), key=sizes.__getitem__)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    xs = range(len(SIDES))
    names = [_name(side) for side in SIDES]
    total = row["true_bytes"]
    panels = (
        ("received", total, "bytes received / true total", BYTES_TARGET),
        ("peak", total, "peak extra memory / result", MEMORY_TARGET),
    )
    for ax, (key, scale, label, target) in zip((axes[0], axes[2]), panels):
        big_vals = [row[side][key][big] / scale for side in SIDES]
        other_vals = [max(v for r, v in enumerate(row[side][key]) if r != big) / scale for side in SIDES]
        ax.bar([x - 0.2 for x in xs], big_vals, 0.4, label=f"rank {big} ({sizes[big]:,} samples)")
        ax.bar([x + 0.2 for x in xs], other_vals, 0.4, label="other ranks (largest)")
        ax.axhline(target, color="grey", linewidth=0.8, linestyle="--", label=f"target {target:g}x")
        ax.set(ylabel=label, xticks=list(xs), ylim=(0, 1.45 * max(big_vals + other_vals + [target])))
        ax.set_xticklabels(names, fontsize=7)
        ax.legend(fontsize=7, loc="upper left")
    axes[1].bar(xs, [row[side]["time_ratio"] for side in SIDES], 0.5, color="tab:green")
    axes[1].axhline(1.0, color="grey", linewidth=0.8, linestyle="--", label="target 1x")
    times = [row[side]["time_ratio"] for side in SIDES]
    axes[1].set(ylabel="sync time / padded gather (slowest rank)", xticks=list(xs))
    axes[1].set_xticklabels(names, fontsize=7)
    axes[1].set_ylim(0, 1.45 * max(times))
    axes[1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{row['world_size']} ranks, one holding {sizes[big] // max(min(sizes), 1)}x the others", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def plot_memory(rows: Sequence[Row], path: str) -> None:
    """Peak extra memory of one sync over the result (left) and time over the padded gather (right), per size."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = [f"W={row['world_size']}\n{_mib(row['true_bytes'])} MiB" for row in rows]
    xs = range(len(rows))
    # The padded gather's markers large and pale: ours often lies exactly on them.
    for side, style, size in (("stock", "o--", 6), ("padded", "^:", 12), ("varlen", "s-", 6)):
        for ax, key in ((left, "memory_ratio"), (right, "time_ratio")):
            values = [row[side][key] for row in rows]
            ax.plot(xs, values, style, markersize=size, alpha=0.5 if side == "padded" else 1.0, label=_name(side))
    targets = [MEMORY_TARGET + row["cap"] / row["true_bytes"] for row in rows]
    left.plot(xs, targets, "_", color="grey", markersize=18, label="target (1.2x + cap)")
    left.set(ylabel="peak extra memory of sync() / result", xticks=list(xs), xticklabels=labels)
    right.set(ylabel="sync time / padded gather (slowest rank)", xticks=list(xs), xticklabels=labels)
    for ax in (left, right):
        ax.set_ylim(0, 1.3 * max(line.get_ydata().max() for line in ax.get_lines()))  # type: ignore[union-attr]
    left.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sibling(path: str, suffix: str) -> str:
    """``path`` with ``_suffix`` added to its stem: where a case writes its own table or plot beside the main one.

    Example:
        >>> sibling("docs/_static/bench.png", "skew")
        'docs/_static/bench_skew.png'
    """
    from pathlib import Path

    where = Path(path)
    return str(where.with_name(f"{where.stem}_{suffix}{where.suffix}"))


def memory_configs(quick: bool) -> list[tuple[int, list[int]]]:
    """World sizes and per-rank sizes of the memory case: 4M and 16M samples on 2 ranks, 16M on 4 (quick: 400k on 2)."""
    totals = [(2, 400_000)] if quick else [(2, 4_000_000), (2, 16_000_000), (4, 16_000_000)]
    return [(world, even_sizes(world, total)) for world, total in totals]


def run(
    quick: bool,
    world_size: int = 8,
    base: int | None = None,
    factor: int = 8,
    table_path: str | None = None,
    plot_path: str | None = None,
) -> dict[str, Any]:
    """The skew case and the memory case, printed; tables and plots written beside ``table_path``/``plot_path``.

    The skew case runs on ``world_size`` ranks (quick: at most 4), ``base`` samples per rank (default 250k, quick
    20k) and ``factor x base`` on the last rank. Tables go to ``<table>_skew.rst`` and ``<table>_sync_memory.rst``,
    plots to ``<plot>_skew.png`` and ``<plot>_sync_memory.png``. Returns ``{"skew": row, "sync_memory": [rows]}``.
    """
    world = min(world_size, 4) if quick else world_size
    base = base or (20_000 if quick else 250_000)
    skew_repeats, memory_repeats = (3, 3) if quick else (10, 5)
    skew = measure(world, skew_sizes(world, base, factor), skew_repeats)
    memory = [measure(w, sizes, memory_repeats) for w, sizes in memory_configs(quick)]
    tables = {"skew": format_skew_table(skew, skew_repeats), "sync_memory": format_memory_table(memory, memory_repeats)}
    print("\n\n".join(tables.values()))
    if table_path:
        for suffix, table in tables.items():
            with open(sibling(table_path, suffix), "w") as out:  # literal blocks, included by the docs pages
                out.write("::\n\n" + "\n".join(f"    {line}".rstrip() for line in table.splitlines()) + "\n")
    if plot_path:
        plot_skew(skew, sibling(plot_path, "skew"))
        plot_memory(memory, sibling(plot_path, "sync_memory"))
    return {"skew": skew, "sync_memory": memory}
