"""The metrics of one ``Join`` on a rank: which group carries their per-step syncs, and the shadow of a joined rank.

Split out of :mod:`torchmetrics_varlen.join`, which builds a session per ``Join`` (see its docstring for the design).
"""

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.join import Join

from torchmetrics_varlen import _exit_grace, _join_shadow


class _Session:
    """The metrics of one ``Join`` on this rank: where their per-step syncs go, and the shadow of a joined rank.

    The per-step syncs travel on the metrics' own process group until some rank has joined, then on the side group.
    Every rank switches at the same sync because it decides from Join's own count of the running ranks, an
    all-reduce whose result is equal on every rank: started at the start of each iteration by the first joinable
    (on DDP's forward, where ``ddp`` is given; at each per-step sync, for metrics alone), and read before the sync.
    A rank that joined is blocked in the matching all-reduce of ``Join``, so the count drops below the group size at
    the first iteration it misses, before any sync it could not take part in. With ``counted`` False (a model that
    is not DDP counts the ranks itself, out of reach) the syncs use the side group from the first one.

    Args:
        metrics: the metrics, in the same order on every rank.
        notifier: the joinable whose ``_join_config`` makes it the first one (it notifies ``Join``).
        ddp: the DDP model whose forward starts the count, or None.
        counted: whether the count can be read (False: side group from the first sync).
        owned: made by :func:`join`, which raises the shadow's errors on exit (else the post hook reports them).
        followed: another joinable's hook runs after this session's post hook (a plain ``Join``): errors are then
            warned, since a raise would skip that hook.
    """

    def __init__(
        self, metrics: Sequence[Any], notifier: Any, ddp: Any, counted: bool, owned: bool, followed: bool = False
    ) -> None:
        for metric in metrics:
            if metric.sync_grads:
                raise RuntimeError(
                    "Expected `sync_grads=False` for a metric inside `Join` but got True: a rank that ran out of"
                    " data cannot shadow the backward pass of a differentiable gather. Use the default rank-local"
                    " gradient (DDP then gives 1/world_size of the single-process gradient; scale the loss by the"
                    " world size)."
                )
        self.metrics = [metric for i, metric in enumerate(metrics) if not any(metric is m for m in metrics[:i])]
        self.notifier = notifier
        self.ddp = ddp
        self.counted = counted
        self.owned = owned
        self.followed = followed  # a hook of another joinable runs after this session's post hook
        group = self.metrics[0].join_process_group
        self.world_size = dist.get_world_size(group)
        # A collective on the group's ranks the first time (each of them builds its Join at the same point); cached
        # after.
        self.side = _join_shadow.side_group(self.metrics[0].process_group, self.metrics[0].join_device)
        self.joined = not counted
        self._pending: Any = None
        timeout = self.metrics[0].sync_timeout
        what = ", ".join(f"`{type(metric).__name__}`" for metric in self.metrics)
        self.shadow = _join_shadow.Shadow(self.metrics, self.side, timeout, what)
        self.contexts = self.shadow.contexts
        self.errors: list[BaseException] = []
        self.owner: Join | None = None  # the plain Join that made it
        self._handle = ddp.register_forward_pre_hook(self._on_forward) if ddp is not None else None
        for metric in self.metrics:
            metric._join_session = self

    @property
    def enabled(self) -> bool:
        """Whether ``Join`` is enabled (``Join(enable=False)`` shadows nothing)."""
        return bool(self.notifier._join_config.enable)

    def _on_forward(self, module: Any, args: Any) -> None:
        # Runs instead of DDP's own notify (DDP is not the first joinable here), at the same point of its forward,
        # and hands DDP the work as its own notify would (it reads the count when `divide_by_initial_world_size`
        # is False).
        work = Join.notify_join_context(self.notifier)
        if work is not None:
            module.reducer._set_forward_pass_work_handle(work, module._divide_by_initial_world_size)
            self._pending = work

    def step_group(self) -> Any:
        """The side group when some rank has joined, else None (the metric's own group); counts first if needed."""
        if self.ddp is None and self.counted:
            work = Join.notify_join_context(self.notifier)
            if work is not None:
                self._pending = work
        work, self._pending = self._pending, None
        if work is not None and not self.joined:
            try:
                work.wait()
            finally:
                _exit_grace.waited()  # see _exit_grace
            running = work.get_future().value()[0]
            self.joined = int(running.item()) < self.world_size
        return self.side if self.joined else None

    def all_errors(self) -> list[BaseException]:
        """The shadow's errors, then the post hook's."""
        return [*self.shadow.errors, *self.errors]

    def detach(self) -> None:
        """End the session: the metrics' per-step syncs go back to their own group, outside any Join."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for metric in self.metrics:
            if metric._join_session is self:
                metric._join_session = None
            metric._join_config = metric._join_config._replace(enable=False)
