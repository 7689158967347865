"""Logged scalars: the local accumulators, the key layout the ranks agree on, and the record that carries both.

A :class:`~torchmetrics_varlen.ScalarLog` sync is one metadata exchange of the engine's transport
(``_transport.exchange_records``: the group's agreed record length, its timeouts and the errors naming missing
ranks). Its record is a protocol header with no entries (so a rank syncing a metric at the same step raises
`SyncMismatchError` alike, through ``_mismatch.check_headers``) followed by:

* ``S_FP``, ``S_K``, ``S_NEW``, ``S_ERR``: the fingerprint and length of the key layout this rank holds, how many
  keys it names for the first time, a local problem;
* a presence bitmap over the layout (which layout keys this rank updated since its ``reset()``);
* the layout's values: per key its reduction's words (``mean``: Σ w·v and Σ w; ``sum``, ``max``, ``min``: one),
  the identity where this rank has no update;
* the keys it names for the first time: one word each (reduction code and name length), the names' UTF-8 bytes,
  then their values.

Every rank decodes the same table, extends the layout alike (new names in rank order) and reduces every key over
the ranks in the same order, in float64: the results are identical on every rank. A record within the group's
agreed length is the whole sync: one collective. One that is longer (new keys, more keys than the group's records
have room for) makes every rank exchange again at the longest length, which the group keeps (see
:mod:`torchmetrics_varlen._transport`).
"""

import array
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from torchmetrics_varlen import _protocol, _transport
from torchmetrics_varlen._mismatch import check_headers
from torchmetrics_varlen.errors import SyncMismatchError

REDUCTIONS = ("mean", "sum", "max", "min")
MEAN, SUM, MAX, MIN = 1, 2, 3, 4  # reduction codes as they travel (0: none)
WIDTH = np.array([0, 2, 1, 1, 1], dtype=np.int64)  # float64 words per key, by code
FIRST = np.array([0.0, 0.0, 0.0, -math.inf, math.inf])  # the identity of each code's first word
CONTEXT = _protocol.context_hash("torchmetrics_varlen.ScalarLog|compute")
S_FP, S_K, S_NEW, S_ERR = range(_protocol.HEADER_LEN, _protocol.HEADER_LEN + 4)
PAYLOAD = S_ERR + 1
ERR_TOO_LONG = 1
Array = npt.NDArray[Any]


class Accumulator:
    """One rank's per-key float64 accumulators since the last reset: keys in the order they were first updated."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.codes = np.zeros(0, dtype=np.int64)
        self.first = np.zeros(0)  # Σ w·v (mean), Σ v (sum), the max or the min
        self.weight = np.zeros(0)  # Σ w (mean only)

    def add(self, keys: Sequence[str], codes: Sequence[int], values: Array, weights: Array) -> None:
        """Add one update: ``values`` and ``weights`` (float64, NaN already handled) of distinct ``keys``."""
        fresh = [(key, code) for key, code in zip(keys, codes) if key not in self.index]
        if fresh:  # one concatenation per update, however many keys are new
            for key, _ in fresh:
                self.index[key] = len(self.index)
            new_codes = np.asarray([code for _, code in fresh], dtype=np.int64)
            self.codes = np.concatenate([self.codes, new_codes])
            self.first = np.concatenate([self.first, FIRST[new_codes]])
            self.weight = np.concatenate([self.weight, np.zeros(len(fresh))])
        at = np.fromiter((self.index[key] for key in keys), dtype=np.int64, count=len(keys))
        kinds = self.codes[at]
        for reduction in (MEAN, SUM, MAX, MIN):
            mask = kinds == reduction
            rows, old, v = at[mask], self.first[at[mask]], values[mask]
            if reduction == MEAN:
                self.first[rows] = old + weights[mask] * v
            elif reduction == SUM:
                self.first[rows] = old + v
            else:  # NaN propagates, as torch.max and torch.min do
                self.first[rows] = np.maximum(old, v) if reduction == MAX else np.minimum(old, v)
        self.weight[at[kinds == MEAN]] += weights[kinds == MEAN]


@dataclass
class Layout:
    """The key layout every rank of a group agreed on: names, reduction codes, and where each key's words start."""

    names: list[str] = field(default_factory=list)
    position: dict[str, int] = field(default_factory=dict)
    codes: Array = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    offsets: Array = field(default_factory=lambda: np.zeros(1, dtype=np.int64))  # len(names) + 1
    fingerprint: int = 0

    def extend(self, names: Sequence[str], codes: Sequence[int]) -> None:
        """Append new keys (the same on every rank: decided from the exchanged table)."""
        digest = hashlib.blake2b(self.fingerprint.to_bytes(8, "little", signed=True), digest_size=8)
        for name, code in zip(names, codes):
            self.position[name] = len(self.names)
            self.names.append(name)
            digest.update(name.encode() + b"\0" + bytes([code]))
        self.codes = np.concatenate([self.codes, np.asarray(codes, dtype=np.int64)])
        self.offsets = np.concatenate([[0], np.cumsum(WIDTH[self.codes])]).astype(np.int64)
        self.fingerprint = int.from_bytes(digest.digest(), "little", signed=True) if names else self.fingerprint

    def identity(self) -> Array:
        """Every key's words as a rank without updates sends them."""
        words = np.zeros(int(self.offsets[-1]))
        words[self.offsets[:-1]] = FIRST[self.codes]
        return words


def _words(data: bytes) -> Array:
    return np.frombuffer(data.ljust(-(-len(data) // 8) * 8, b"\0"), dtype=np.int64)


def make_record(acc: Accumulator, layout: Layout, named: "set[str]", label: str, cap: int) -> "array.array[int]":
    """This rank's record: what it updated since reset, laid out as the agreed ``layout``, plus keys it names anew."""
    local = list(acc.index)
    fresh = [key for key in local if key not in named]  # first named by this rank: name and values ride together
    known = [(layout.position[key], acc.index[key]) for key in local if key in named]
    values = layout.identity()
    present = np.zeros(len(layout.names), dtype=bool)
    if known:
        pos, at = (np.asarray(column, dtype=np.int64) for column in zip(*known))
        present[pos] = True
        values[layout.offsets[pos]] = acc.first[at]
        mean = acc.codes[at] == MEAN
        values[layout.offsets[pos[mean]] + 1] = acc.weight[at[mean]]
    encoded = [key.encode() for key in fresh]
    at = np.asarray([acc.index[key] for key in fresh], dtype=np.int64)
    heads = acc.codes[at] | (np.asarray([len(name) for name in encoded], dtype=np.int64) << 8)
    widths = WIDTH[acc.codes[at]]
    fresh_values = np.zeros(int(widths.sum()))
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64) if len(fresh) else at
    fresh_values[starts] = acc.first[at]
    fresh_values[starts[acc.codes[at] == MEAN] + 1] = acc.weight[at[acc.codes[at] == MEAN]]
    bitmap = _words(np.packbits(present, bitorder="little").tobytes())
    body = [bitmap, values.view(np.int64), heads, _words(b"".join(encoded)), fresh_values.view(np.int64)]
    header = _protocol.describe([], CONTEXT, label, cap=cap)
    total = PAYLOAD + sum(len(part) for part in body)
    error = 0
    if total > _transport.MAX_WORDS:  # every rank raises, naming this one, from the first exchange
        body, total, error = [], PAYLOAD, ERR_TOO_LONG
    header[_protocol.H_WORDS] = total
    record = array.array("q", [*header, layout.fingerprint, len(layout.names), len(fresh), error])
    for part in body:
        record.frombytes(np.ascontiguousarray(part, dtype=np.int64).tobytes())
    return record


def check_table(table: Array, what: str) -> None:
    """Raise on every rank alike when the ranks' records cannot be combined."""
    check_headers(torch.from_numpy(table[:, : _protocol.HEADER_LEN].copy()), what)
    too_long = np.flatnonzero(table[:, S_ERR] == ERR_TOO_LONG).tolist()
    if too_long:
        raise SyncMismatchError(
            f"{what}: expected each rank's logged scalars to fit one record of {_transport.MAX_WORDS} words but ranks"
            f" {too_long} hold more keys than that. Log fewer keys per window (or split them over two ScalarLogs)."
        )
    agreed = table[:, [S_FP, S_K]]
    if not (agreed == agreed[:1]).all():
        per_rank = ", ".join(f"rank {r}: {int(k)} keys" for r, k in enumerate(table[:, S_K].tolist()))
        raise SyncMismatchError(
            f"{what}: expected every rank to hold the same agreed key layout but got different ones ({per_rank}):"
            " the ranks did not run the same syncs of this ScalarLog (one was created or computed on some ranks"
            " only). Create it on every rank and call `compute()` on every rank."
        )


def reduce_table(table: Array, layout: Layout, what: str) -> tuple[list[str], list[int], dict[str, float]]:
    """Every key updated on some rank, reduced over the ranks: (new names, their codes, results); layout unchanged."""
    world, k = table.shape[0], len(layout.names)
    named = _named_anew(table, k, int(layout.offsets[-1]))
    new_names, new_codes = _agree_new_keys(named, layout, what)
    grown = Layout(list(layout.names), dict(layout.position), layout.codes, layout.offsets, layout.fingerprint)
    grown.extend(new_names, new_codes)
    words = np.tile(grown.identity(), (world, 1))
    present = np.zeros((world, len(grown.names)), dtype=bool)
    bitmap_words = -(-k // 64)
    bits = table[:, PAYLOAD : PAYLOAD + bitmap_words].copy().view(np.uint8)
    present[:, :k] = np.unpackbits(bits, axis=1, bitorder="little")[:, :k].astype(bool)
    start = PAYLOAD + bitmap_words
    words[:, : layout.offsets[-1]] = table[:, start : start + int(layout.offsets[-1])].view(np.float64)
    for rank, entries in enumerate(named):
        for name, _, values in entries:
            pos = grown.position[name]
            present[rank, pos] = True
            words[rank, grown.offsets[pos] : grown.offsets[pos + 1]] = values
    return new_names, new_codes, _reduce(words, present, grown)


def _named_anew(table: Array, k: int, layout_words: int) -> list[list[tuple[str, int, Array]]]:
    """Per rank, the keys it names for the first time: (name, code, its words)."""
    named = []
    start = PAYLOAD + -(-k // 64) + layout_words
    for row in table:
        count = int(row[S_NEW])
        heads = row[start : start + count]
        lengths = (heads >> 8).tolist()
        name_words = -(-sum(lengths) // 8)
        blob = row[start + count : start + count + name_words].tobytes()
        values = row[start + count + name_words :].view(np.float64)
        entries, at, cursor = [], 0, 0
        for head, length in zip(heads.tolist(), lengths):
            code = head & 0xFF
            width = int(WIDTH[code]) if 0 < code < len(WIDTH) else 0
            entries.append((blob[at : at + length].decode(), code, values[cursor : cursor + width].copy()))
            at, cursor = at + length, cursor + width
        named.append(entries)
    return named


def _agree_new_keys(
    named: list[list[tuple[str, int, Array]]], layout: Layout, what: str
) -> tuple[list[str], list[int]]:
    """The keys new to the layout in rank order; `SyncMismatchError` where ranks give a key different reductions."""
    new_names: list[str] = []
    codes: dict[str, int] = {}
    claims: dict[str, dict[int, int]] = {}
    for rank, entries in enumerate(named):
        for name, code, _ in entries:
            claims.setdefault(name, {})[rank] = code
            if name not in layout.position and name not in codes:
                codes[name] = code
                new_names.append(name)
    conflicts = []
    for name, per_rank in claims.items():
        agreed = int(layout.codes[layout.position[name]]) if name in layout.position else None
        if len(set(per_rank.values()) | ({agreed} if agreed is not None else set())) > 1:
            ranks = ", ".join(f"rank {rank}: {_reduction(code)!r}" for rank, code in per_rank.items())
            earlier = f", agreed earlier: {_reduction(agreed)!r}" if agreed is not None else ""
            conflicts.append(f"`{name}` ({ranks}{earlier})")
    if conflicts:
        raise SyncMismatchError(
            f"{what}: expected every rank to reduce a key the same way but the ranks name different reductions for "
            + "; ".join(conflicts[:10])
            + ". Pass the same `reduce=` on every rank."
        )
    return new_names, [codes[name] for name in new_names]


def _reduction(code: int) -> str:
    return REDUCTIONS[code - 1] if 0 < code <= len(REDUCTIONS) else f"code {code}"


def _reduce(words: Array, present: Array, layout: Layout) -> dict[str, float]:
    """Each present key's reduction over the ranks' rows, in the same order on every rank."""
    first = words[:, layout.offsets[:-1]]
    codes = layout.codes
    out = np.empty(len(layout.names))
    sums = first.sum(axis=0)
    out[codes == SUM] = sums[codes == SUM]
    means = codes == MEAN
    with np.errstate(divide="ignore", invalid="ignore"):  # no weight: 0 / 0 is NaN, as MeanMetric gives
        out[means] = sums[means] / words[:, layout.offsets[:-1][means] + 1].sum(axis=0)
    if (codes == MAX).any():
        out[codes == MAX] = first[:, codes == MAX].max(axis=0)  # NaN propagates, as torch.max does
    if (codes == MIN).any():
        out[codes == MIN] = first[:, codes == MIN].min(axis=0)
    keep = np.flatnonzero(present.any(axis=0))
    return {layout.names[i]: float(out[i]) for i in keep.tolist()}


def reserve(group: Any, layout: Layout) -> None:
    """Make the group's agreed record length room for the next record of known keys (every rank alike).

    Decided from the exchanged table (the grown layout), so equal on every rank: the next ``compute()`` of the same
    keys is one collective, until ``RECORD_WINDOW`` syncs of the group without this one shrink the length again.
    """
    state = _transport.group_state(group)
    needed = PAYLOAD + -(-len(layout.names) // 64) + int(layout.offsets[-1])
    if needed <= _transport.MAX_WORDS:
        state.words = max(state.words, needed)
        state.longest = max(state.longest, needed)


def local_results(acc: Accumulator) -> dict[str, float]:
    """This rank's own results: what a group of one gives."""
    layout = Layout()
    layout.extend(list(acc.index), acc.codes.tolist())
    words = layout.identity()[None, :]
    words[0, layout.offsets[:-1]] = acc.first
    words[0, layout.offsets[:-1][acc.codes == MEAN] + 1] = acc.weight[acc.codes == MEAN]
    return _reduce(words, np.ones((1, len(layout.names)), dtype=bool), layout)


def to_tensors(results: Mapping[str, float]) -> dict[str, Tensor]:
    """Results as float64 0-d tensors."""
    return {key: torch.tensor(value, dtype=torch.float64) for key, value in results.items()}
