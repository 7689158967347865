"""The transfer cap: how many bytes one collective of a sync may move, and how large its padded buffer may grow.

Each rank sends its cap in its record (``_protocol.H_CAP``) and the plan takes the smallest, so every rank chunks
alike whatever each was configured with. The cap comes from, first found:

1. the metric's ``sync_cap`` keyword (``Metric(sync_cap=...)``, ``MetricCollection(sync_cap=...)``; a collection
   syncing several metrics takes the smallest of theirs);
2. the ``TORCHMETRICS_VARLEN_SYNC_CAP`` environment variable;
3. :data:`DEFAULT_CAP` (256 MiB).

What it bounds (see ``_routes.route_data``): the padded gather's buffer (``world_size x`` the largest rank's bytes);
entries that would push it past the cap move by per-rank broadcasts straight into their results instead, and each
broadcast moves at most the cap. So beyond the synced result itself a sync allocates about the cap at most.
"""

import os
import re

SYNC_CAP_ENV = "TORCHMETRICS_VARLEN_SYNC_CAP"
DEFAULT_CAP = 256 * 2**20
MIN_CAP = 1024  # bytes: below this, chunking costs more collectives than any memory it saves
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_cap(value: object, source: str) -> int:
    """``value`` (bytes, or a string such as ``"64MiB"``) as a number of bytes; ``source`` names it in errors.

    Example:
        >>> parse_cap("64MiB", "sync_cap"), parse_cap(4096, "sync_cap")
        (67108864, 4096)
    """
    nbytes: float | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            nbytes = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if nbytes is None or nbytes < MIN_CAP:
        raise ValueError(
            f"Expected `{source}` to be a number of bytes of at least {MIN_CAP} (an int, or a string such as"
            f" '64MiB', '1GiB') but got {value!r}."
        )
    return int(nbytes)


INVALID_CAP = 0  # sent for an environment value that does not parse: every rank raises, naming the rank


def resolve_cap(sync_cap: object = None) -> int:
    """The cap this rank sends: ``sync_cap`` if given, else the environment's, else :data:`DEFAULT_CAP`.

    An environment value that does not parse gives :data:`INVALID_CAP`: it travels in the record, and every rank raises
    together (``_mismatch.check_headers``), where raising here would leave the other ranks waiting.
    """
    if sync_cap is not None:
        return parse_cap(sync_cap, "sync_cap")
    env = os.environ.get(SYNC_CAP_ENV)
    if not env:
        return DEFAULT_CAP
    try:
        return parse_cap(env, SYNC_CAP_ENV)
    except ValueError:
        return INVALID_CAP
