"""torchmetrics-varlen: exact, hang-free, differentiable distributed TorchMetrics on uneven data."""

from torchmetrics_varlen.errors import SyncMismatchError, SyncTimeoutError
from torchmetrics_varlen.gather import gather_all_tensors

__version__ = "0.1.0"

__all__ = [
    "SyncMismatchError",
    "SyncTimeoutError",
    "__version__",
    "gather_all_tensors",
]
