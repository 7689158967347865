"""A distributed sampler for evaluation that gives every sample to exactly one rank, without padding."""

from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["UnpaddedDistributedSampler"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class UnpaddedDistributedSampler(Sampler[int]):
    """Split a dataset across ranks so that every sample is seen exactly once, with no padding duplicates.

    ``torch.utils.data.DistributedSampler`` pads the index list by repeating samples, which a distributed metric then
    counts twice. Here rank ``r`` gets ``indices[r::num_replicas]``, the same strided assignment minus the padding: a
    drop-in replacement whose shards differ by at most one (a rank may get none). Use it for evaluation: ranks get
    different numbers of batches, so per-step syncs need ``Join``, and DDP training without ``Join`` would hang in a
    gradient all-reduce (see the "Exact evaluation" docs page).

    Args:
        dataset: the dataset to sample from; only its length is used.
        num_replicas: number of ranks taking part. Defaults to the world size of the default process group.
        rank: rank of this process, in ``[0, num_replicas)``. Defaults to the rank in the default process group.
        shuffle: shuffle the indices, with the same permutation on every rank (seeded by ``seed + epoch``).
        seed: random seed of the shuffle; must be the same on every rank.

    Raises:
        ValueError: ``num_replicas`` or ``rank`` is not given and no process group is initialized, or an argument has
            the wrong type or is out of range.
        TypeError: ``dataset`` has no length.

    Example:
        Without a process group, pass ``num_replicas`` and ``rank`` explicitly. Ten samples over three ranks:

        >>> from torchmetrics_varlen.sampler import UnpaddedDistributedSampler
        >>> dataset = list(range(10))
        >>> shards = [list(UnpaddedDistributedSampler(dataset, num_replicas=3, rank=r)) for r in range(3)]
        >>> shards
        [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
        >>> [len(UnpaddedDistributedSampler(dataset, num_replicas=3, rank=r)) for r in range(3)]
        [4, 3, 3]

        With ``shuffle=True`` call ``set_epoch`` before each epoch; every rank draws the same permutation:

        >>> shards = [UnpaddedDistributedSampler(dataset, 3, r, shuffle=True, seed=42) for r in range(3)]
        >>> for shard in shards:
        ...     shard.set_epoch(1)
        >>> sorted(i for shard in shards for i in shard) == dataset
        True
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(
                f"Expected `dataset` to have a length (`__len__`) but got {type(dataset).__name__}; iterable-style"
                " datasets must be split across ranks by the dataset itself"
            )
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                missing = " and ".join(
                    f"`{name}`" for name, value in (("num_replicas", num_replicas), ("rank", rank)) if value is None
                )
                raise ValueError(
                    f"{missing} not given and no default process group is initialized: call"
                    " `torch.distributed.init_process_group` first, or pass `num_replicas` and `rank` explicitly"
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if not _is_int(num_replicas) or num_replicas < 1:
            raise ValueError(f"Expected `num_replicas` to be a positive integer but got {num_replicas!r}")
        if not _is_int(rank) or not 0 <= rank < num_replicas:
            raise ValueError(f"Expected `rank` to be in [0, num_replicas) = [0, {num_replicas}) but got {rank!r}")
        if not isinstance(shuffle, bool):
            raise ValueError(f"Expected `shuffle` to be a bool but got {shuffle!r}")
        if not _is_int(seed):
            raise ValueError(f"Expected `seed` to be an int but got {seed!r}")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices: ``indices[rank::num_replicas]`` of the (possibly shuffled) index list."""
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices: list[int] = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        return iter(indices[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        """Exact number of indices this rank yields (0 when the dataset has fewer samples than ``rank + 1``)."""
        return len(range(self.rank, len(self.dataset), self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch used to seed the shuffle (``seed + epoch``); call it on every rank before each epoch.

        Args:
            epoch: the epoch number, the same on every rank.
        """
        if not _is_int(epoch):
            raise ValueError(f"Expected `epoch` to be an int but got {epoch!r}")
        self.epoch = epoch
