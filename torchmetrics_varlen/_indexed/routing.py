"""One-rank routing: with ``compute_on_rank`` set, ``compute()`` gathers to that rank, computes there, broadcasts."""

import functools
from collections.abc import Callable
from typing import Any

from torchmetrics import Metric as StockMetric

from torchmetrics_varlen.onerank import one_rank_compute


def route_compute(
    metric: StockMetric, every_rank: Callable[..., Any], compute: Callable[..., Any]
) -> Callable[..., Any]:
    """Wrap ``compute``: the every-rank path (``every_rank``), or the one-rank path when ``compute_on_rank`` is set."""

    @functools.wraps(compute)
    def wrapped_compute(*args: Any, **kwargs: Any) -> Any:
        dst = getattr(metric, "compute_on_rank", None)
        if dst is None:
            return every_rank(*args, **kwargs)
        return one_rank_compute(metric, dst, functools.partial(every_rank, *args, **kwargs))

    return wrapped_compute
