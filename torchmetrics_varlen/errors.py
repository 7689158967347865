"""Errors raised by the sync protocol.

All four errors subclass :class:`SyncError`, itself a :class:`torch.distributed.DistError` (a :class:`RuntimeError`),
so ``except DistError`` and ``except RuntimeError`` catch them as they catch the errors of ``torch.distributed``.
Each is raised on every rank that takes part in the failing sync and is still alive, never on one rank alone.
"""

from torch.distributed import DistError

__all__ = ["SyncError", "SyncMemoryError", "SyncMismatchError", "SyncPeerError", "SyncTimeoutError"]


class SyncError(DistError):
    """The base of the errors of a sync: catch it to handle any of them.

    Example:
        >>> import torch.distributed as dist
        >>> from torchmetrics_varlen import SyncError, SyncTimeoutError
        >>> issubclass(SyncTimeoutError, SyncError), issubclass(SyncError, dist.DistError)
        (True, True)
    """


class SyncMemoryError(SyncError):
    """A rank could not allocate what a sync receives into; raised on every rank alike, before any data moved.

    After the metadata exchange every rank knows how much the sync receives (the padded gather's rows, the results of
    the states that move by broadcast); each allocates it, and when that is large (see "How the sync works") the ranks
    exchange one word saying whether they could. So a rank that runs out of memory makes every rank raise this error
    (naming the failing ranks; on the failing rank the allocator's error is the ``__cause__``) instead of leaving its
    peers waiting for a collective it never enters. The process group stays usable.

    Example:
        >>> from torchmetrics_varlen import SyncMemoryError
        >>> issubclass(SyncMemoryError, RuntimeError)
        True
    """


class SyncMismatchError(SyncError):
    """The ranks disagree about what they are syncing.

    Raised on every rank alike when the ranks hold data that cannot be combined (different dtype or number of
    dimensions, ``cat`` data whose dims after the first differ, a stacked state whose shape differs), sync different
    metrics or state layouts, or are in different phases (one in a per-step sync, another in an epoch
    ``compute()``). Decided from the exchanged metadata, right after its exchange and before any data moves; only
    what the metadata cannot show (a ``cat`` list whose items differ on one rank, the shapes of a state with a
    stacking reduction) is found after the data step, from data every rank holds alike. The message names the
    metric and state and has one line per rank saying what that rank held.

    Example:
        >>> from torchmetrics_varlen import SyncMismatchError
        >>> issubclass(SyncMismatchError, RuntimeError)
        True
    """


class SyncTimeoutError(SyncError):
    """Some ranks did not arrive at a sync within the sync timeout, or ended their process without it.

    Raised on the ranks that did arrive, after ``sync_timeout`` (by default the process group's own timeout), also when
    the backend's own timeout failed the collective first, and when a peer's process ended with no exception that its
    exit note could see: it ran fewer syncs, or it crashed under a launcher that catches the exception itself
    (``torch.multiprocessing.spawn``, ``multiprocessing``); the note cannot tell which, so the message says both, the
    crash first. The message names the missing or ended ranks where the store can tell, whose timeout expired, and the
    usual causes: ranks that run different numbers of steps, or ``compute()`` / ``self.log`` called on rank 0 only. A
    peer that is alive and busy (computing in ``compute_on_rank``, running steps inside ``join``) is waited for up to
    the group's timeout instead. After this error the process group still has a pending collective and cannot be
    trusted: end the job, or let the late ranks arrive.

    Example:
        >>> from torchmetrics_varlen import SyncTimeoutError
        >>> issubclass(SyncTimeoutError, RuntimeError)
        True
    """


class SyncPeerError(SyncError):
    """Another rank crashed, or closed its connection without leaving an exit note, while this rank was in a sync.

    Raised on the ranks that are still alive, with the backend's own error as the cause (``__cause__``), instead of
    reporting the dead rank as merely late. Where the rank's exit note saw the exception that ended it (one that reached
    the top of its main thread, as in a script under ``torchrun``), the message names the rank and the exception's type.
    The metric's local states are left as they were before the sync. The process group cannot be used afterwards: end
    the job (an elastic launcher may restart it).

    Example:
        >>> from torchmetrics_varlen import SyncPeerError
        >>> issubclass(SyncPeerError, RuntimeError)
        True
    """
