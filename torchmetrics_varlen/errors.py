"""Errors raised by the sync protocol.

All four subclass :class:`SyncError`, a :class:`torch.distributed.DistError` (a :class:`RuntimeError`). Each is
raised on every rank that takes part in the failing sync and is still alive, never on one rank alone.
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

    When a sync receives much, the ranks agree after the metadata exchange that each could allocate it (see "How the
    sync works"), so a rank out of memory makes every rank raise this error, naming the failing ranks (on those the
    allocator's error is the ``__cause__``), instead of leaving its peers waiting. The process group stays usable.

    Example:
        >>> from torchmetrics_varlen import SyncMemoryError
        >>> issubclass(SyncMemoryError, RuntimeError)
        True
    """


class SyncMismatchError(SyncError):
    """The ranks disagree about what they are syncing.

    Raised on every rank alike when the ranks hold data that cannot be combined (dtype, number of dimensions, trailing
    dims of ``cat`` data, a stacked state's shape), sync different metrics or state layouts, or are in different
    phases (a per-step sync and an epoch ``compute()``), mostly before any data moves. The message names the metric
    and state, with one line per rank saying what that rank held.

    Example:
        >>> from torchmetrics_varlen import SyncMismatchError
        >>> issubclass(SyncMismatchError, RuntimeError)
        True
    """


class SyncTimeoutError(SyncError):
    """Some ranks did not arrive at a sync within the sync timeout, or ended their process without it.

    Raised on the ranks that did arrive, after ``sync_timeout`` (by default the group's own timeout) or the backend's
    own timeout, and when a peer's process ended with no exception its exit note could see (fewer syncs, or a crash
    under a launcher that catches it; the message says both), naming the ranks where the store can tell and the usual
    causes. A peer known to be busy (``compute_on_rank``'s destination, running steps inside ``join``) is waited for
    up to the group's timeout. After this error the process group still has a pending collective: end the job.

    Example:
        >>> from torchmetrics_varlen import SyncTimeoutError
        >>> issubclass(SyncTimeoutError, RuntimeError)
        True
    """


class SyncPeerError(SyncError):
    """Another rank crashed, or closed its connection without leaving an exit note, while this rank was in a sync.

    Raised on the ranks still alive, with the backend's own error as the ``__cause__``, instead of reporting the dead
    rank as merely late; where the rank's exit note saw the exception that ended it (as under ``torchrun``), the
    message names the rank and the exception's type. The local states are left as they were before the sync. The
    process group cannot be used afterwards: end the job (an elastic launcher may restart it).

    Example:
        >>> from torchmetrics_varlen import SyncPeerError
        >>> issubclass(SyncPeerError, RuntimeError)
        True
    """
