"""Logged scalars: the local accumulators, the key layout the ranks agree on, and the record that carries both.

A :class:`~torchmetrics_varlen.ScalarLog` sync brings its own record to :func:`._engine.exchange` (the group's agreed
record length, its timeouts, the errors naming missing ranks): a protocol header with no entries (so a rank syncing a
metric at the same step raises `SyncMismatchError` alike, through ``mismatch.check_headers``) followed by:

* ``S_FP``, ``S_K``, ``S_NEW``, ``S_ERR``, ``S_SPARSE``: the fingerprint and length of the key layout this rank
  holds, how many keys it names for the first time, a local problem, and how its layout keys travel;
* the layout keys it updated since its ``reset()``, each with its reduction's words (``mean``: Σ w·v and Σ w;
  ``sum``, ``max``, ``min``: one), either dense (a presence bitmap and every layout key's words, the identity where
  it has no update; ``S_SPARSE`` -1) or sparse (its keys' layout positions as ``int32``, then their words;
  ``S_SPARSE`` their number), whichever is shorter;
* the keys it names for the first time: one word each (reduction code and name length), the names' UTF-8 bytes,
  then their words.

Every rank decodes the same table, extends the layout alike (new names in rank order) and reduces every key over
the ranks in the same order, in float64: identical results on every rank. A record within the group's agreed length
is the whole sync: one collective. A longer one (new keys, more keys than the records have room for) makes every rank
exchange again at the longest length; the group's next record is sized for the same keys (names travel once).
"""

import array
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from torchmetrics_varlen._engine import record as _protocol
from torchmetrics_varlen._engine.mismatch import check_headers
from torchmetrics_varlen._engine.record import MAX_WORDS
from torchmetrics_varlen.errors import SyncMismatchError

REDUCTIONS = ("mean", "sum", "max", "min")
MEAN, SUM, MAX, MIN = 1, 2, 3, 4  # reduction codes as they travel (0: none)
WIDTH = np.array([0, 2, 1, 1, 1], dtype=np.int64)  # float64 words per key, by code
FIRST = np.array([0.0, 0.0, 0.0, -math.inf, math.inf])  # the identity of each code's first word
WIDTH.flags.writeable = FIRST.flags.writeable = False  # read-only tables
CONTEXT = _protocol.context_hash("torchmetrics_varlen.ScalarLog|compute")
S_FP, S_K, S_NEW, S_ERR, S_SPARSE = range(_protocol.HEADER_LEN, _protocol.HEADER_LEN + 5)
PAYLOAD = S_SPARSE + 1
ERR_TOO_LONG = 1
Array = npt.NDArray[Any]


class Accumulator:
    """One rank's per-key float64 accumulators since the last reset: keys in the order they were first updated.

    Updates of numbers accumulate here, on the host, updates with tensors on their device (:attr:`devices`); a key
    updated in several places sums each place's part in update order, then the parts (:meth:`Reading.folded`).
    """

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.codes = np.zeros(0, dtype=np.int64)
        self.first = np.zeros(0)  # Σ w·v (mean), Σ v (sum), the max or the min
        self.weight = np.zeros(0)  # Σ w (mean only)
        self.devices: dict[torch.device, Sums] = {}

    def register(self, keys: Sequence[str], codes: Sequence[int]) -> Array:
        """The positions of ``keys``, new ones appended (at their reduction's identity)."""
        fresh = [(key, code) for key, code in zip(keys, codes) if key not in self.index]
        if fresh:  # one concatenation per update, however many keys are new
            for key, _ in fresh:
                self.index[key] = len(self.index)
            new_codes = np.asarray([code for _, code in fresh], dtype=np.int64)
            self.codes = np.concatenate([self.codes, new_codes])
            self.first = np.concatenate([self.first, FIRST[new_codes]])
            self.weight = np.concatenate([self.weight, np.zeros(len(fresh))])
        return np.fromiter((self.index[key] for key in keys), dtype=np.int64, count=len(keys))

    def add(self, keys: Sequence[str], codes: Sequence[int], values: Array, weights: Array) -> None:
        """Add one update: ``values`` and ``weights`` (float64, NaN already handled) of distinct ``keys``."""
        at = self.register(keys, codes)
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

    def add_tensor(
        self, keys: Sequence[str], codes: Sequence[int], values: Tensor, weights: Tensor, nan_strategy: Any
    ) -> None:
        """Add one update held in float64 tensors on one device, there (``"error"`` with NaN: nothing, it raises)."""
        if values.device not in self.devices:
            self.devices[values.device] = Sums(values.device)
        self.devices[values.device].add(tuple(keys), codes, values, weights, nan_strategy)
        self.register(keys, codes)

    def merge(self, keys: Sequence[str], first: Array, weight: Array) -> None:
        """Combine another part of these keys' words (a device's sums) into this one, by each key's reduction."""
        at = np.fromiter((self.index[key] for key in keys), dtype=np.int64, count=len(keys))
        kinds, old = self.codes[at], self.first[at]
        with np.errstate(invalid="ignore"):  # the branch not taken may be inf - inf
            summed = old + first
        low = np.where(kinds == MIN, np.minimum(old, first), summed)
        self.first[at] = np.where(kinds == MAX, np.maximum(old, first), low)
        self.weight[at] += weight

    def read(self) -> "Reading":
        """A copy of every accumulator: the device parts copied to pinned host memory without blocking (events)."""
        host = Accumulator()
        host.index, host.codes = dict(self.index), self.codes
        host.first, host.weight = self.first.copy(), self.weight.copy()
        reading = Reading(host, [], [])
        for sums in self.devices.values():
            data = torch.cat([sums.first, sums.weight, sums.nan.to(torch.float64)])  # a copy: updates may go on
            if sums.device.type != "cpu":
                data = torch.empty(data.shape, dtype=data.dtype, pin_memory=True).copy_(data, non_blocking=True)
                reading.events.append(torch.cuda.current_stream(sums.device).record_event())
            reading.parts.append((list(sums.index), data))
        return reading


@dataclass
class Reading:
    """What :meth:`Accumulator.read` copied: the host's part, each device's (keys, then their words and NaN flags)."""

    host: Accumulator
    parts: list[tuple[list[str], Tensor]]
    events: list[Any]  # the device copies' completion, waited for before :meth:`folded` reads them

    def folded(self) -> tuple[Accumulator, list[str]]:
        """The accumulators with every device's part combined in, and the keys whose tensor updates carried NaN."""
        for event in self.events:
            event.synchronize()  # returns at once where the worker polled it already
        nan: list[str] = []
        for keys, data in self.parts:
            words, count = data.numpy(), len(keys)
            self.host.merge(keys, words[:count], words[count : 2 * count])
            nan += [key for key, flag in zip(keys, words[2 * count :].tolist()) if flag]
        self.parts = []
        return self.host, nan


class Sums:
    """One device's per-key float64 words of the tensor updates (as in :class:`Accumulator`), and where NaN came.

    An update is a handful of device operations whatever its number of keys (positions, codes and identities go to
    the device once per set of keys); nothing is read on the host, except for ``"error"``, which must raise at once.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index: dict[str, int] = {}
        self.first = torch.zeros(0, dtype=torch.float64, device=device)
        self.weight = torch.zeros(0, dtype=torch.float64, device=device)
        self.nan = torch.zeros(0, dtype=torch.bool, device=device)
        self._plans: dict[tuple[str, ...], tuple[Tensor, Tensor, Tensor]] = {}

    def _plan(self, keys: tuple[str, ...], codes: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        found = self._plans.get(keys)
        if found is None:
            fresh = [key for key in keys if key not in self.index]
            for key in fresh:
                self.index[key] = len(self.index)
            kinds = np.asarray(codes, dtype=np.int64)
            new = np.asarray([code for key, code in zip(keys, codes) if key in fresh], dtype=np.int64)
            at = np.fromiter((self.index[key] for key in keys), dtype=np.int64, count=len(keys))
            identities = [FIRST[kinds].view(np.int64), FIRST[new].view(np.int64)]
            words = torch.from_numpy(np.concatenate([at, kinds, *identities]))
            if self.device.type != "cpu":
                words = words.pin_memory().to(self.device, non_blocking=True)
            n = len(keys)
            found = self._plans[keys] = (words[:n], words[n : 2 * n], words[2 * n : 3 * n].view(torch.float64))
            if fresh:
                self.first = torch.cat([self.first, words[3 * n :].view(torch.float64)])
                self.weight = torch.cat([self.weight, torch.zeros(len(fresh), dtype=torch.float64, device=self.device)])
                self.nan = torch.cat([self.nan, torch.zeros(len(fresh), dtype=torch.bool, device=self.device)])
        return found

    def add(self, keys: tuple[str, ...], codes: Sequence[int], v: Tensor, w: Tensor, nan_strategy: Any) -> None:
        """Add one update, NaN handled as torchmetrics' aggregators do (``"error"``: raised before anything changes)."""
        if nan_strategy == "error":  # the one read on the host
            v_nan, w_nan = torch.stack([v.isnan(), w.isnan()]).tolist()
            named = [key for key, code, a, b in zip(keys, codes, v_nan, w_nan) if a or (b and code == MEAN)]
            if named:
                raise RuntimeError(f"Encountered `nan` values in ScalarLog keys {named}")
        at, kinds, identity = self._plan(keys, codes)
        mean = kinds == MEAN
        nans = v.isnan() | (mean & w.isnan())
        if isinstance(nan_strategy, float):
            v, w = torch.where(nans, nan_strategy, v), torch.where(nans, 1.0, w)
        elif nan_strategy != "disable":  # dropped: the key still counts as updated, with its reduction's identity
            v, w = torch.where(nans, identity, v), torch.where(nans, 0.0, w)
        old = self.first[at]
        summed = old + torch.where(mean, w * v, v)
        low = torch.where(kinds == MIN, torch.minimum(old, v), summed)
        self.first[at] = torch.where(kinds == MAX, torch.maximum(old, v), low)  # NaN propagates, as in torch.max
        self.weight[at] = self.weight[at] + torch.where(mean, w, 0.0)
        self.nan[at] = self.nan[at] | nans


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


def _packed(first: Array, weight: Array, codes: Array) -> Array:
    """Keys' words back to back: their first word, then Σ w for ``"mean"`` keys."""
    widths = WIDTH[codes]
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64) if len(codes) else codes
    out = np.zeros(int(widths.sum()))
    out[starts] = first
    out[starts[codes == MEAN] + 1] = weight[codes == MEAN]
    return out


def _known_words(acc: Accumulator, layout: Layout, named: "set[str]") -> list[Array]:
    """The layout keys this rank updated, dense or sparse: each rank picks the shorter (a few of many keys: sparse)."""
    known = [(layout.position[key], acc.index[key]) for key in acc.index if key in named]
    pos, at = (np.asarray(column, dtype=np.int64) for column in zip(*known)) if known else (np.zeros(0, np.int64),) * 2
    sparse = _packed(acc.first[at], acc.weight[at], acc.codes[at])
    if -(-len(pos) // 2) + len(sparse) < -(-len(layout.names) // 64) + int(layout.offsets[-1]):
        return [np.asarray([len(pos)]), _words(pos.astype(np.int32).tobytes()), sparse.view(np.int64)]
    values, present = layout.identity(), np.zeros(len(layout.names), dtype=bool)
    present[pos] = True
    values[layout.offsets[pos]] = acc.first[at]
    mean = acc.codes[at] == MEAN
    values[layout.offsets[pos[mean]] + 1] = acc.weight[at[mean]]
    return [np.asarray([-1]), _words(np.packbits(present, bitorder="little").tobytes()), values.view(np.int64)]


def make_record(acc: Accumulator, layout: Layout, named: "set[str]", label: str, cap: int) -> "array.array[int]":
    """This rank's record: what it updated since reset, laid out as the agreed ``layout``, plus keys it names anew."""
    fresh = [key for key in acc.index if key not in named]  # first named by this rank: name and values ride together
    encoded = [key.encode() for key in fresh]
    at = np.asarray([acc.index[key] for key in fresh], dtype=np.int64)
    heads = acc.codes[at] | (np.asarray([len(name) for name in encoded], dtype=np.int64) << 8)
    fresh_values = _packed(acc.first[at], acc.weight[at], acc.codes[at])
    sparse, *known = _known_words(acc, layout, named)
    body = [*known, heads, _words(b"".join(encoded)), fresh_values.view(np.int64)]
    total = PAYLOAD + sum(len(part) for part in body)
    error = 0
    if total > MAX_WORDS:  # every rank raises, naming this one, from the first exchange
        body, total, error = [], PAYLOAD, ERR_TOO_LONG
    header = _protocol.header(CONTEXT, label, 0, 0, total, cap)
    record = array.array("q", [*header, layout.fingerprint, len(layout.names), len(fresh), error, int(sparse[0])])
    for part in body:
        record.frombytes(np.ascontiguousarray(part, dtype=np.int64).tobytes())
    return record


def check_table(table: Array, what: str) -> None:
    """Raise on every rank alike when the ranks' records cannot be combined."""
    check_headers(torch.from_numpy(table[:, : _protocol.HEADER_LEN].copy()), what)
    too_long = np.flatnonzero(table[:, S_ERR] == ERR_TOO_LONG).tolist()
    if too_long:
        raise SyncMismatchError(
            f"{what}: expected each rank's logged scalars to fit one record of {MAX_WORDS} words but ranks"
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


def reduce_table(table: Array, layout: Layout, what: str) -> tuple[tuple[list[str], list[int], dict[str, float]], int]:
    """Check, then reduce every key some rank updated (layout unchanged): (new keys, codes, results), next length."""
    check_table(table, what)
    world, k = table.shape[0], len(layout.names)
    words = np.tile(layout.identity(), (world, 1))
    present = np.zeros((world, k), dtype=bool)
    starts = [_read_known(row, layout, words[rank], present[rank]) for rank, row in enumerate(table)]
    if not table[:, S_NEW].any():  # the common case: no rank names a key anew, the layout stays as it is
        return ([], [], _reduce(words, present, layout)), _next_words(present, layout)
    named = [_new_keys(row, start) for row, start in zip(table, starts)]
    new_names, new_codes = _agree_new_keys(named, layout, what)
    grown = Layout(list(layout.names), dict(layout.position), layout.codes, layout.offsets, layout.fingerprint)
    grown.extend(new_names, new_codes)
    words = np.concatenate([words, np.tile(grown.identity()[int(layout.offsets[-1]) :], (world, 1))], axis=1)
    present = np.concatenate([present, np.zeros((world, len(new_names)), dtype=bool)], axis=1)
    for rank, entries in enumerate(named):
        for name, _, values in entries:
            pos = grown.position[name]
            present[rank, pos] = True
            words[rank, grown.offsets[pos] : grown.offsets[pos + 1]] = values
    return (new_names, new_codes, _reduce(words, present, grown)), _next_words(present, grown)


def _next_words(present: Array, layout: Layout) -> int:
    """The longest record a window of the same keys per rank sends next (each rank dense or sparse, as it picks)."""
    dense = -(-len(layout.names) // 64) + int(layout.offsets[-1])
    counts = present.sum(axis=1)
    sparse = -(-counts // 2) + present.astype(np.int64) @ WIDTH[layout.codes]
    return PAYLOAD + int(np.minimum(sparse, dense).max(initial=0))


def _read_known(row: Array, layout: Layout, words: Array, present: Array) -> int:
    """A rank's layout keys into ``words`` and ``present`` (its rows); where its new keys start in ``row``."""
    start, count = PAYLOAD, int(row[S_SPARSE])
    if count < 0:  # dense: the bitmap, then every layout key's words
        bitmap_words, length = -(-len(layout.names) // 64), int(layout.offsets[-1])
        bits = np.unpackbits(row[start : start + bitmap_words].view(np.uint8), bitorder="little")
        present[:] = bits[: len(layout.names)].astype(bool)
        words[:] = row[start + bitmap_words : start + bitmap_words + length].view(np.float64)
        return start + bitmap_words + length
    pos = row[start : start + -(-count // 2)].view(np.int32)[:count].astype(np.int64)
    codes = layout.codes[pos]
    widths = WIDTH[codes]
    values = row[start + -(-count // 2) : start + -(-count // 2) + int(widths.sum())].view(np.float64)
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64) if count else pos
    present[pos] = True
    words[layout.offsets[pos]] = values[starts]
    words[layout.offsets[pos[codes == MEAN]] + 1] = values[starts[codes == MEAN] + 1]
    return start + -(-count // 2) + int(widths.sum())


def _new_keys(row: Array, start: int) -> list[tuple[str, int, Array]]:
    """The keys a rank names for the first time, from ``start`` in its row: (name, code, its words)."""
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
    return entries


def _agree_new_keys(
    named: list[list[tuple[str, int, Array]]], layout: Layout, what: str
) -> tuple[list[str], list[int]]:
    """The keys new to the layout in rank order; `SyncMismatchError` where ranks give a key different reductions."""
    codes: dict[str, int] = {}  # the new keys, in rank order
    claims: dict[str, dict[int, int]] = {}
    for rank, entries in enumerate(named):
        for name, code, _ in entries:
            claims.setdefault(name, {})[rank] = code
            if name not in layout.position:
                codes.setdefault(name, code)
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
    return list(codes), list(codes.values())


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
    out[codes == MAX] = first[:, codes == MAX].max(axis=0)  # NaN propagates, as torch.max does
    out[codes == MIN] = first[:, codes == MIN].min(axis=0)
    keep = np.flatnonzero(present.any(axis=0))
    return dict(zip([layout.names[i] for i in keep.tolist()], out[keep].tolist()))


def local_results(acc: Accumulator) -> dict[str, float]:
    """This rank's own results: what a group of one gives."""
    layout = Layout()
    layout.extend(list(acc.index), acc.codes.tolist())
    words = _packed(acc.first, acc.weight, acc.codes)[None, :]  # every key's words, in the layout's order
    return _reduce(words, np.ones((1, len(layout.names)), dtype=bool), layout)
