"""What the demo's sections share: the methods they run, how rows are judged and printed.

The collectives a row issues are counted with ``tests._meters.CollectiveCounter``.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

Rows = dict[str, Any]  # method name -> list of per-rank results, or the text of what went wrong ("HANG: ...")

TODAY, STOCK, OURS, NOTE = "today", "stock", "ours", "note"  # roles: only OURS rows decide the exit status


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to do what a section shows, run on every rank as ``fn(rank, world_size)``.

    ``breaks``: what it does to the process group. ``""``: nothing, it runs in the demo's shared pool. ``"aborts"``
    or ``"pending"`` (leaves a collective pending): a pool of its own. ``"hangs"``: a pool of its own and the
    demo's watchdog, which kills the ranks after ``watchdog`` seconds without the job finishing. None of these
    run under torchrun, where they would take the user's job down.
    """

    name: str
    role: str
    fn: Callable[[int, int], Any]
    breaks: str = ""
    watchdog: float = 8.0


@dataclasses.dataclass
class Section:
    """A section's printed text and whether every ``OURS`` row matched the truth (or raised the promised error)."""

    text: str
    ok: bool


def failure_text(err: BaseException) -> str:
    """One line for a method that failed: a hang the watchdog stopped, an aborted rank, or the last error line."""
    text = str(err)
    if "did not finish within the deadline" in text and "Traceback" not in text:
        return "HANG"
    if any(sign in text for sign in ("died", "Received data size", "collective mismatch", "Connection")):
        return "ERROR: a rank aborted (gloo)"
    last = [line for line in text.splitlines() if line.strip()][-1]
    return f"ERROR: {last.strip()[:60]}"


def close(got: float, truth: float, tol: float = 1e-6) -> bool:
    """Equal to the truth within ``tol`` (relative to its size)."""
    return abs(got - truth) <= tol * max(1.0, abs(truth))


def verdict(ok: bool, exact: bool = False) -> str:
    """The "matches truth" column."""
    return ("yes, exactly" if exact else "yes") if ok else "NO"


def line(*cells: str, widths: tuple[int, ...]) -> str:
    """One table row: the first cell left-aligned, the last left-aligned, the others right-aligned."""
    parts = []
    for i, (cell, width) in enumerate(zip(cells, widths)):
        left = i == 0 or i == len(widths) - 1
        last = i == len(widths) - 1  # the verdict: never cut
        parts.append(cell if last else f"{cell[:width]:<{width}}" if left else f"{cell[:width]:>{width}}")
    return "  ".join(parts).rstrip()
