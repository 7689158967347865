"""Figures of the documentation, drawn with matplotlib.

    python docs/figures.py            # redraws docs/_static/protocol.png (and a bench placeholder if none exists)

``conf.py`` calls :func:`ensure_figures` at every build, which draws only what is missing, so a fresh checkout builds
even before ``python -m nox -s bench`` has written ``docs/_static/bench.png``.
"""

import sys
from pathlib import Path
from typing import Any

STATIC = Path(__file__).resolve().parent / "_static"
PROTOCOL_PNG = STATIC / "protocol.png"
BENCH_PNG = STATIC / "bench.png"
# Written by the same benchmark run beside bench.png: the skew case and the memory of sync() alone.
BENCH_SIBLING_PNGS = (STATIC / "bench_skew.png", STATIC / "bench_sync_memory.png")

# One colour per rank's data; padding is hatched grey; collectives are dark bands across every rank.
RANK_COLOURS = ("#4c78a8", "#f58518", "#54a24b")
PAD_COLOUR = "#e6e6e6"
BAND_COLOUR = "#2f3b4c"
PLAN_COLOUR = "#fff4d6"
TEXT_COLOUR = "#1d1d1d"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_protocol(path: Path = PROTOCOL_PNG) -> Path:
    """Draw the seven steps of one sync for three ranks holding 7, 3 and 0 samples of a ``cat`` state."""
    plt = _pyplot()
    from matplotlib.patches import FancyBboxPatch, Rectangle

    lengths = (7, 3, 0)  # samples per rank
    longest = max(lengths)
    world = len(lengths)
    fig, ax = plt.subplots(figsize=(12, 9.6))
    ax.set(xlim=(0, 120), ylim=(0, 96))
    ax.axis("off")

    col_x = (28, 59, 90)  # left edge of each rank's column
    col_w = 28
    unit = col_w / longest  # width of one sample in a buffer bar

    def box(x: float, y: float, w: float, h: float, text: str, face: str, size: float = 8.5, **kw: object) -> None:
        ax.add_patch(
            FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.25,rounding_size=0.8", fc=face, ec="#555555", lw=0.8)
        )
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=TEXT_COLOUR, **kw)

    def band(y: float, text: str) -> None:
        ax.add_patch(Rectangle((col_x[0] - 1.5, y), col_x[-1] + col_w + 3 - col_x[0], 4.2, fc=BAND_COLOUR, ec="none"))
        ax.text(
            (col_x[0] + col_x[-1] + col_w) / 2,
            y + 2.1,
            text,
            ha="center",
            va="center",
            fontsize=9.5,
            color="white",
            weight="bold",
        )

    def step(y: float, number: str, title: str, note: str = "") -> None:
        ax.text(1, y, f"{number}  {title}", ha="left", va="center", fontsize=10.5, weight="bold", color=TEXT_COLOUR)
        if note:
            ax.text(1, y - 2.6, note, ha="left", va="center", fontsize=7.8, color="#444444", style="italic")

    def bar(x: float, y: float, filled: int, colour: str, h: float = 2.6, total: int = longest) -> None:
        if filled:
            ax.add_patch(Rectangle((x, y), filled * unit, h, fc=colour, ec="white", lw=0.6))
        if total - filled:
            ax.add_patch(
                Rectangle(
                    (x + filled * unit, y),
                    (total - filled) * unit,
                    h,
                    fc=PAD_COLOUR,
                    ec="#999999",
                    lw=0.6,
                    hatch="////",
                )
            )

    # Ranks.
    titles = ("rank 0: 7 samples", "rank 1: 3 samples", "rank 2: no data")
    for r in range(world):
        box(col_x[r], 90, col_w, 4, titles[r], RANK_COLOURS[r], size=9.5, weight="bold")

    # 1. describe.
    step(85.5, "1", "describe", "no decision from local data")
    for r in range(world):
        text = f"record: numel={lengths[r]}, dtype, shape\nfixed size, equal on every rank"
        box(col_x[r], 83, col_w, 4.6, text, "white", size=7.8)

    # 2. metadata exchange.
    band(76.5, "collective 1: all_gather of fixed-size int64 records (about 11 KiB per rank)")
    step(78.6, "2", "metadata")

    # 3. plan.
    step(70.5, "3", "plan", "the same table on every rank")
    box(
        col_x[0],
        62.5,
        col_x[-1] + col_w - col_x[0],
        11,
        "one table, one decision, on every rank alike:\n"
        "ranks disagree (metric, phase, dtype, ndim)?  SyncMismatchError on every rank, before any data moves\n"
        "byte layout of each rank's buffer; transfer size = the largest payload\n"
        "empty rank 2 takes the peers' dtype and trailing shape\n"
        "every rank cached, or no bytes anywhere?  stop here, on every rank",
        PLAN_COLOUR,
        size=8.4,
    )

    # 4. pack.
    step(57.5, "4", "pack", "one uint8 buffer, padded to the largest")
    for r in range(world):
        bar(col_x[r], 56, lengths[r], RANK_COLOURS[r])
        used = f"{lengths[r]} of {longest} used" + ("" if lengths[r] else ": padding only")
        ax.text(col_x[r] + col_w / 2, 53.6, used, ha="center", va="center", fontsize=7.5, color="#444444")

    # 5. data exchange.
    band(46.5, "collective 2: all_gather of the uint8 buffers (NCCL: native uneven all_gather, no padding)")
    step(48.6, "5", "data")

    # 6. unpack and trim.
    step(40.5, "6", "unpack, trim", "views cut to each rank's true shape")
    for r in range(world):
        for source in range(world):
            y = 41.5 - source * 3.2
            if lengths[source]:
                bar(col_x[r], y, lengths[source], RANK_COLOURS[source], h=2.4, total=lengths[source])
            else:
                ax.add_patch(Rectangle((col_x[r], y), 1.2, 2.4, fc="white", ec="#777777", lw=0.8, ls="--"))
                ax.text(col_x[r] + 2.2, y + 1.2, "empty, peers' dtype", va="center", fontsize=7, color="#444444")
            if source == r:
                ax.add_patch(Rectangle((col_x[r] - 0.6, y - 0.4), col_w + 1.2, 3.2, fc="none", ec="black", lw=1.6))
        ax.text(
            col_x[r] + col_w / 2,
            32.2,
            "own slot = the caller's tensor\n(keeps its autograd graph)",
            ha="center",
            va="center",
            fontsize=7.3,
            color="#444444",
        )

    # 7. reduce.
    step(25.5, "7", "reduce")
    box(
        col_x[0],
        21,
        col_x[-1] + col_w - col_x[0],
        6.5,
        "as torchmetrics: sum / mean / max / min / custom over the stacked ranks;\n"
        "cat: 7 + 3 + 0 = 10 samples, one view per rank, joined by dim_zero_cat in compute()",
        "white",
        size=8.5,
    )

    # Legend.
    legend_y = 13
    items = [
        (RANK_COLOURS[0], "white", "", "data of rank 0"),
        (RANK_COLOURS[1], "white", "", "data of rank 1"),
        (PAD_COLOUR, "#999999", "////", "padding (never returned)"),
        ("none", "black", "", "this rank's own slot"),
    ]
    for i, (face, edge, hatch, label) in enumerate(items):
        x = col_x[0] + 24 * i - (0 if i < 3 else -4)
        ax.add_patch(Rectangle((x, legend_y), 3, 2, fc=face, ec=edge, hatch=hatch, lw=1.2))
        ax.text(x + 4, legend_y + 1, label, va="center", fontsize=8)
    ax.text(
        60,
        7,
        "Every rank issues the same collectives in the same order, whatever it holds: two per sync, no barrier.",
        ha="center",
        va="center",
        fontsize=9.5,
        style="italic",
        color=TEXT_COLOUR,
    )
    ax.text(
        60,
        3.5,
        "sync_grads=True adds one all_reduce in backward;  compute_on_rank replaces collective 2 by a "
        "gather to one rank and a broadcast of the result.",
        ha="center",
        va="center",
        fontsize=8,
        color="#444444",
    )

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def draw_bench_placeholder(path: Path = BENCH_PNG) -> Path:
    """A stand-in for the benchmark plot until ``python -m nox -s bench`` draws the real one."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.axis("off")
    ax.text(
        0.5,
        0.5,
        "No benchmark run yet.\nRun  python -m nox -s bench  to draw this plot.",
        ha="center",
        va="center",
        fontsize=14,
        transform=ax.transAxes,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def ensure_figures() -> list[Path]:
    """Draw the figures that do not exist yet; return what was drawn."""
    drawn = []
    if not PROTOCOL_PNG.exists():
        drawn.append(draw_protocol())
    for path in (BENCH_PNG, *BENCH_SIBLING_PNGS):
        if not path.exists():
            drawn.append(draw_bench_placeholder(path))
    return drawn


if __name__ == "__main__":
    draw_protocol()
    if "--bench-placeholder" in sys.argv[1:] or not BENCH_PNG.exists():
        draw_bench_placeholder()
    print(f"wrote {PROTOCOL_PNG}")
