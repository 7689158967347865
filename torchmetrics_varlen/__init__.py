"""torchmetrics-varlen: exact, hang-free, differentiable distributed TorchMetrics on uneven data."""

from torchmetrics_varlen.checkpoint import (
    MergedState,
    MergedStateError,
    ShardedState,
    load_merged_state_dict,
    merged_state_dict,
    sharded_load_planner,
)
from torchmetrics_varlen.collection import MetricCollection
from torchmetrics_varlen.errors import SyncError, SyncMemoryError, SyncMismatchError, SyncPeerError, SyncTimeoutError
from torchmetrics_varlen.gather import gather_all_tensors
from torchmetrics_varlen.indexed import IndexedMetric
from torchmetrics_varlen.join import join
from torchmetrics_varlen.losses import SoftF1Loss
from torchmetrics_varlen.mesh import mesh_group
from torchmetrics_varlen.metric import Metric, rebase
from torchmetrics_varlen.onerank import compute_on_rank
from torchmetrics_varlen.sampler import UnpaddedDistributedSampler
from torchmetrics_varlen.scalars import ScalarLog, sync_scalars

__version__ = "0.1.0"

__all__ = [
    "IndexedMetric",
    "MergedState",
    "MergedStateError",
    "Metric",
    "MetricCollection",
    "ScalarLog",
    "ShardedState",
    "SoftF1Loss",
    "SyncError",
    "SyncMemoryError",
    "SyncMismatchError",
    "SyncPeerError",
    "SyncTimeoutError",
    "UnpaddedDistributedSampler",
    "__version__",
    "compute_on_rank",
    "gather_all_tensors",
    "join",
    "load_merged_state_dict",
    "merged_state_dict",
    "mesh_group",
    "rebase",
    "sharded_load_planner",
    "sync_scalars",
]
