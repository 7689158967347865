"""The scale benchmark, ``python -m benchmarks bench --scale``: what a sync costs per rank as ranks grow.

Three parts, each side by side in one run (see the "Scale" docs page for the cost model behind the figures):

1. **Bytes per rank** of one sync on real gloo CPU processes (2, 4, 8 ranks), counted by wrapping the
   ``torch.distributed`` collectives (:mod:`~benchmarks.scale_procs`), then extended to 1024 ranks
   from the plan alone (:mod:`~benchmarks.scale_plan`), both models checked against the measurement.
2. **Planning time**: ``make_plan`` + ``unpack`` over synthetic metadata tables of 8 to 1024 ranks, no processes.
3. **Small-metric latency**: ``BinaryAccuracy`` compute() and sync, ours vs stock vs one raw all-gather of its states'
   bytes (the floor).
"""

import json
from collections.abc import Sequence
from typing import Any

from benchmarks.scale_plan import extended_rows, planner_rows
from benchmarks.scale_procs import case_names, measure_processes

Row = dict[str, Any]
EXTENDED_WORLDS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
PLANNER_WORLDS = [8, 16, 32, 64, 128, 256, 512, 1024]
PLAN_TARGET_MS = 5.0  # issue 14's target for plan + unpack at 1024 ranks


def human(nbytes: float) -> str:
    """Bytes as a short readable string (binary units).

    Example:
        >>> human(8_000_000), human(6560), human(128)
        ('7.63 MiB', '6.41 KiB', '128 B')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def _cell(values: Sequence[int]) -> str:
    """One rank's figure when every rank has the same, else the largest marked with ``*``."""
    text = human(max(values))
    return text if len(set(values)) == 1 else f"{text}*"


def check_models(measured: list[Row], extended: list[Row]) -> list[Row]:
    """The byte models (plan for ours, stock's per-state protocol) against the measured bytes, where both exist."""
    model = {(row["case"], row["world_size"], row["side"]): row for row in extended}
    checks = []
    for row in measured:
        expected = model.get((row["case"], row["world_size"], row["side"]))
        if expected is None:
            continue
        checks.append(
            {
                "case": row["case"],
                "world_size": row["world_size"],
                "side": row["side"],
                "measured": row["received"],
                "model": expected["received"],
                "matches": all(value == expected["received"] for value in row["received"])
                and all(value == expected["collectives"] for value in row["collectives"]),
            }
        )
    return checks


def format_bytes_table(measured: list[Row]) -> str:
    """Measured bytes per rank, stock vs ours, per case and world size."""
    lines = [
        "Bytes per rank of one compute() (measured on gloo processes; * marks ranks that differ: the largest shown)",
        "",
        f"| {'case':<34} | {'W':>3} | {'stock coll.':>11} | {'stock received':>14} | {'stock buffers':>13} |"
        f" {'ours coll.':>10} | {'ours received':>13} | {'ours buffers':>12} | {'stock/ours':>10} |",
        f"|{'-' * 36}|{'-' * 5}|{'-' * 13}|{'-' * 16}|{'-' * 15}|{'-' * 12}|{'-' * 15}|{'-' * 14}|{'-' * 12}|",
    ]
    keyed = {(row["case"], row["world_size"], row["side"]): row for row in measured}
    for case, world in sorted({(row["case"], row["world_size"]) for row in measured}, key=_case_order(measured)):
        stock, ours = keyed[(case, world, "stock")], keyed[(case, world, "varlen")]
        ratio = max(stock["received"]) / max(max(ours["received"]), 1)
        lines.append(
            f"| {case:<34} | {world:>3} | {max(stock['collectives']):>11} | {_cell(stock['received']):>14} |"
            f" {_cell(stock['buffers']):>13} | {max(ours['collectives']):>10} | {_cell(ours['received']):>13} |"
            f" {_cell(ours['buffers']):>12} | {ratio:>9.2f}x |"
        )
    return "\n".join(lines)


def _case_order(rows: list[Row]) -> Any:
    order = list(dict.fromkeys(row["case"] for row in rows))
    return lambda key: (order.index(key[0]), key[1])


def format_extended_table(extended: list[Row], worlds: Sequence[int]) -> str:
    """Bytes per rank up to 1024 ranks, from the plan (ours) and stock's per-state protocol (stock)."""
    shown = [world for world in worlds if world in (2, 8, 64, 256, 1024)]
    lines = [
        "Bytes received per rank of one sync, from the plan (ours) and stock's per-state protocol, up to 1024 ranks",
        "",
        f"| {'case':<34} | {'side':<6} | " + " | ".join(f"{f'W={w}':>10}" for w in shown) + " |",
        f"|{'-' * 36}|{'-' * 8}|" + "|".join("-" * 12 for _ in shown) + "|",
    ]
    keyed = {(row["case"], row["world_size"], row["side"]): row for row in extended}
    for case in dict.fromkeys(row["case"] for row in extended):
        for side in ("stock", "varlen"):
            cells = " | ".join(f"{human(keyed[(case, w, side)]['received']):>10}" for w in shown)
            lines.append(f"| {case:<34} | {'ours' if side == 'varlen' else side:<6} | {cells} |")
    return "\n".join(lines)


def format_planner_table(rows: list[Row]) -> str:
    """Planner-only timings and the bytes per rank the synthetic plan implies."""
    lines = [
        "Planner only: make_plan + unpack over a synthetic table (8 uneven `cat` lists + 16 small dense states),"
        " median, one thread",
        "",
        f"| {'W':>5} | {'plan ms':>8} | {'unpack ms':>9} | {'total ms':>8} | {'metadata':>10} | {'gather':>10} |"
        f" {'all-reduce':>10} | {'coll.':>5} |",
        f"|{'-' * 7}|{'-' * 10}|{'-' * 11}|{'-' * 10}|{'-' * 12}|{'-' * 12}|{'-' * 12}|{'-' * 7}|",
    ]
    for row in rows:
        lines.append(
            f"| {row['world_size']:>5} | {row['plan_ms']:>8.2f} | {row['unpack_ms']:>9.2f} |"
            f" {row['plan_unpack_ms']:>8.2f} | {human(row['metadata']):>10} | {human(row['gather']):>10} |"
            f" {human(row['reduce']):>10} | {row['collectives']:>5} |"
        )
    return "\n".join(lines)


def format_latency_table(rows: list[Row], repeats: int) -> str:
    """Small-metric latency: stock vs ours vs the floor, and the ratios."""
    lines = [
        f"Small metric (BinaryAccuracy), median of {repeats}, interleaved; floor: one raw all_gather_into_tensor of"
        " the states' 32 bytes; bare: the least a sync does through public calls (header, one gather, one sum)",
        "",
        f"| {'W':>3} | {'stock compute':>13} | {'ours compute':>12} | {'speed-up':>8} | {'stock sync':>10} |"
        f" {'ours sync':>9} | {'speed-up':>8} | {'1 gather':>8} | {'sync/1 gather':>15} | {'bare/1 gather':>13} |",
        f"|{'-' * 5}|{'-' * 15}|{'-' * 14}|{'-' * 10}|{'-' * 12}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 17}|"
        f"{'-' * 15}|",
    ]
    for row in rows:
        lines.append(
            f"| {row['world_size']:>3} | {row['stock compute']:>10.3f} ms | {row['varlen compute']:>9.3f} ms |"
            f" {row['compute_speedup']:>7.2f}x | {row['stock sync']:>7.3f} ms | {row['varlen sync']:>6.3f} ms |"
            f" {row['sync_speedup']:>7.2f}x | {row['floor']:>5.3f} ms | {row['sync_to_floor']:>14.2f}x |"
            f" {row['bare_to_floor']:>12.2f}x |"
        )
    return "\n".join(lines)


def plot(measured: list[Row], extended: list[Row], planner: list[Row], path: str) -> None:
    """Bytes per rank against W (left) and plan + unpack time against W (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    widths = [1.5, 1.5, 5.0, 1.5]  # the FID-like lines, wide and pale: the confusion matrix's lie on top of them
    cases = dict.fromkeys(row["case"] for row in measured)
    for colour, width, case in zip(colours, widths, cases):
        for side, style in (("stock", "--"), ("varlen", "-")):
            line = [row for row in extended if row["case"] == case and row["side"] == side]
            if line:
                xs, ys = [r["world_size"] for r in line], [r["received"] for r in line]
                left.plot(xs, ys, style, color=colour, linewidth=width, alpha=0.5 if width > 2 else 1.0)
            points = [row for row in measured if row["case"] == case and row["side"] == side]
            name = "stock" if side == "stock" else "ours"
            xs, ys = [r["world_size"] for r in points], [max(r["received"]) for r in points]
            fill = "none" if side == "stock" else colour
            marker = "o" if side == "stock" else "s"
            left.plot(xs, ys, marker, color=colour, mfc=fill, label=f"{case}, {name}")
    left.set(xscale="log", yscale="log", xlabel="ranks (W)", ylabel="bytes received per rank, one sync")
    left.set_title("markers: measured; lines: plan (ours, solid) / stock protocol (dashed)", fontsize=8)
    left.legend(fontsize=6)
    worlds = [row["world_size"] for row in planner]
    right.plot(worlds, [row["plan_unpack_ms"] for row in planner], "s-", label="make_plan + unpack")
    right.plot(worlds, [row["plan_ms"] for row in planner], ".:", label="make_plan")
    right.plot(worlds, [row["unpack_ms"] for row in planner], ".:", label="unpack")
    right.axhline(PLAN_TARGET_MS, color="grey", linewidth=0.8, label=f"target {PLAN_TARGET_MS:g} ms at W=1024")
    right.set(xscale="log", xlabel="ranks (W), synthetic table", ylabel="ms (median)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(
    json_path: str | None = None,
    plot_path: str | None = None,
    table_path: str | None = None,
    quick: bool = False,
    world_sizes: Sequence[int] | None = None,
    repeats: int | None = None,
) -> int:
    """Entry point of ``python -m benchmarks bench --scale``; returns the exit status.

    ``quick`` uses small states, 2 and 4 ranks, few repeats and planner sizes up to 64 ranks (smoke tests).
    ``world_sizes`` replaces the measured world sizes (2, 4, 8); the latency runs on those of at most 4 ranks.
    """
    worlds = list(world_sizes or ([2, 4] if quick else [2, 4, 8]))
    repeats = repeats or (10 if quick else 200)
    measured, latency = measure_processes(worlds, quick, repeats)
    for row in latency:
        row["compute_speedup"] = row["stock compute"] / row["varlen compute"]
        row["sync_speedup"] = row["stock sync"] / row["varlen sync"]
        row["sync_to_floor"] = row["varlen sync"] / row["floor"]
        row["bare_to_floor"] = row["bare"] / row["floor"]
    extended = extended_rows(sorted(set(EXTENDED_WORLDS) | set(worlds)), quick)
    planner = planner_rows([8, 64] if quick else PLANNER_WORLDS, 3 if quick else 15)
    checks = check_models(measured, extended)
    parts = [
        format_bytes_table(measured),
        format_extended_table(extended, EXTENDED_WORLDS),
        f"Byte models vs measurement: {sum(c['matches'] for c in checks)} of {len(checks)} (case, W, side) match"
        " exactly"
        + "".join(f"; differs: {c['case']} W={c['world_size']} {c['side']}" for c in checks if not c["matches"]),
        format_planner_table(planner),
        format_latency_table(latency, repeats),
    ]
    table = "\n\n".join(parts)
    print(table)
    result = {
        "cases": case_names(quick),
        "world_sizes": worlds,
        "bytes": measured,
        "extended": extended,
        "model_checks": checks,
        "planner": planner,
        "latency": latency,
        "repeats": repeats,
    }
    if json_path:
        with open(json_path, "w") as out:
            json.dump(result, out, indent=1)
    if table_path:
        with open(table_path, "w") as out:  # a literal block, included by docs/scale.rst
            out.write("::\n\n" + "\n".join(f"    {line}".rstrip() for line in table.splitlines()) + "\n")
    if plot_path:
        plot(measured, extended, planner, plot_path)
    return 0
