"""Dedup: order the samples of every rank by dataset index and keep each index once, refusing likely mistakes.

The samples arrive concatenated in rank order, and on each rank in call order. A stable sort by dataset index keeps
that order among the copies of one index, so the first copy is the one from the lowest rank's earliest call.

Copies are normal: a padding ``DistributedSampler`` repeats a few samples so that every rank gets as many. They are
the same samples, so dropping them loses nothing. But with per-rank indices (the position in the rank's shard or
batch, passed by mistake) every rank's samples collide with the other ranks', and ``duplicates="first"`` would keep
one rank's data and drop the rest without a word. A padding sampler repeats fewer than ``world_size`` samples in
all (it pads the data set to the next multiple of the world size), and never on one rank twice; so copies that carry
different values are refused when they are more than that, or when one rank holds two different samples under one
index. Every rank decides on the same gathered data, so every rank raises alike.
"""

import torch
from torch import Tensor

RULES = ("first", "error")


def _rows_equal(first: Tensor, second: Tensor) -> Tensor:
    """Per row (dim 0): equal values, NaN equal to NaN."""
    same = first == second
    if first.is_floating_point() or first.is_complex():
        same |= first.isnan() & second.isnan()
    return same.flatten(1).all(1) if same.ndim > 1 else same


def sample_ranks(updates: Tensor | None, samples: int) -> Tensor | None:
    """The rank of every sample, from the ``(rank, samples)`` row each update stored; None if they do not add up."""
    if updates is None or updates.numel() == 0:
        return None
    ranks, sizes = updates[:, 0], updates[:, 1]
    if int(sizes.sum()) != samples:
        return None  # states set by hand (or loaded from elsewhere): no rank information to rely on
    return torch.repeat_interleave(ranks, sizes)


class Dedup:
    """The dataset indices of all gathered samples, sorted, with each index's copies located.

    Args:
        index: the dataset index of every sample, in gather order (rank, then call).
    """

    def __init__(self, index: Tensor) -> None:
        self.keys, self.order = torch.sort(index, stable=True)
        samples = self.keys.numel()
        self.first = torch.ones(samples, dtype=torch.bool, device=self.keys.device)
        self.first[1:] = self.keys[1:] != self.keys[:-1]
        positions = torch.arange(samples, device=self.keys.device)
        group_start = torch.where(self.first, positions, torch.zeros_like(positions)).cummax(0).values
        self.copies = positions[~self.first]  # sorted positions of the copies that are dropped
        self.kept = group_start[self.copies]  # sorted position of the copy kept for each of them

    def take(self) -> Tensor:
        """Gather positions of the samples to keep, in dataset index order."""
        return self.order[self.first]

    def _differs(self, data: Tensor) -> Tensor:
        device = data.device
        return ~_rows_equal(data[self.order[self.copies].to(device)], data[self.order[self.kept].to(device)])

    def check_all_agree(self, inputs: dict[str, Tensor]) -> None:
        """``duplicates="error"``: every copy carries the values of the copy that is kept."""
        if self.copies.numel() == 0:
            return
        for name, data in inputs.items():
            differs = self._differs(data)
            if bool(differs.any()):
                bad = int(torch.nonzero(differs)[0, 0])
                where, kept = int(self.copies[bad]), int(self.kept[bad])
                device = data.device
                raise ValueError(
                    f"Expected every copy of a sample to carry the same values (duplicates='error') but sample index"
                    f" {int(self.keys[where])} has `{name}` = {data[self.order[kept].to(device)].tolist()!r} in its"
                    f" first copy and {data[self.order[where].to(device)].tolist()!r} in another (from another rank or"
                    " call). Pass duplicates='first' to keep the first copy."
                )

    def check_padding_like(self, inputs: dict[str, Tensor], ranks: Tensor | None, world_size: int) -> None:
        """``duplicates="first"``: refuse copies with other values beyond what a padding sampler produces."""
        if self.copies.numel() == 0:
            return
        differs = torch.zeros(self.copies.numel(), dtype=torch.bool, device=self.keys.device)
        for data in inputs.values():
            differs |= self._differs(data).to(differs.device)
        conflicts = int(differs.sum())
        if conflicts == 0:
            return  # identical copies: dropping them loses nothing
        within: dict[int, int] = {}
        if ranks is not None:
            sorted_ranks = ranks.to(self.order.device)[self.order]
            # A copy's predecessor in sorted order is an earlier copy of the same index (rank order, then call order).
            same_rank = (sorted_ranks[self.copies] == sorted_ranks[self.copies - 1]) & differs
            for rank, count in zip(*torch.unique(sorted_ranks[self.copies][same_rank], return_counts=True)):
                within[int(rank)] = int(count)
        if not within and conflicts < world_size:
            return  # as much as padding can produce: the copies are taken for the same samples
        where = ""
        if within:
            where = " (" + ", ".join(f"{count} on rank {rank}" for rank, count in sorted(within.items()))
            where += " repeat an index that the same rank already used)"
        raise ValueError(
            "Expected `sample_index` to hold dataset indices (each sample's index in the whole data set, the same on"
            f" every rank) but {conflicts} of {self.keys.numel()} samples repeat an index with different values"
            f"{where}. A padding sampler repeats fewer than world_size = {world_size} samples in all and never one"
            " within a rank, so these look like per-rank indices, and duplicates='first' would silently drop them."
            " Pass the index of each sample in the whole data set (the indices the sampler yields, not positions"
            " within a rank's shard or batch); duplicates='error' shows the first conflicting sample."
        )
