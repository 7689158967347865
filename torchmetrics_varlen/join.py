"""Join support: ranks that ran out of data shadow a metric's per-step syncs until every rank is done.

Inside ``with Join([ddp_model, metric]):`` a rank that ran out of batches leaves its loop early; ``Join`` then calls
this module's hook once per iteration that the other ranks still run, and the hook takes part in the metric's
per-step sync as a rank with an empty batch (every state at its default). The other ranks' per-step values and
the epoch ``compute()`` are then exact.

Why a side process group and a thread: when the metric is a DDP loss, a running rank issues, per iteration, DDP's
forward collectives, then the metric's step sync, then DDP's backward all-reduces. DDP's own join hook shadows its
forward and backward collectives in one call, so a joined rank cannot put the metric's sync between them on the same
process group. The metric's per-step syncs inside ``Join`` therefore travel on a process group of their own (made
once per metric, when the first ``Join`` is built), and the joined rank shadows them from a worker thread, while its
main thread runs DDP's hook.

The shadow does not count iterations: any number of per-step syncs per iteration works (several forwards, several
metrics, each listed in the ``Join``), as long as the running ranks make them in the same order; the documented
usage is one metric forward per iteration. Assumptions: no rank calls ``compute()`` inside the ``Join`` block; a DDP
model comes before the metric in the ``Join`` list (DDP's forward collectives must follow the count of running
ranks; the other order raises ``ValueError``); every rank of the world builds the ``Join`` (the join group comes
from ``new_group``, which every rank of the world must call, even for a metric on a subgroup).
"""

import sys
import threading
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from torchmetrics_varlen import _protocol, _transport

if TYPE_CHECKING:
    from torchmetrics_varlen.metric import Metric

__all__ = ["MetricJoinHook"]


_TERMINATE = _protocol.context_hash("torchmetrics_varlen.join.terminate")


class MetricJoinHook(JoinHook):
    """Shadows ``metric``'s per-step syncs on a rank that ran out of data, until every rank has joined.

    A worker thread takes part in every per-step sync the running ranks make on the metric's join group, as a rank
    with an empty batch: it does not count iterations, so it works whatever the other joinables (DDP) do between
    the syncs and however many syncs an iteration makes. When every rank has joined, the ranks that joined last send
    one "terminate" record on the join group; the workers, waiting in their next shadow, see it and stop.

    Args:
        metric: the metric whose per-step syncs are shadowed.
    """

    def __init__(self, metric: "Metric") -> None:
        self.metric = metric
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def main_hook(self) -> None:
        """Start the shadowing worker on the first call; it runs until the terminate record."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="torchmetrics-varlen-join", daemon=True)
            self._thread.start()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Stop the workers (the last joiners send the terminate record), leave join mode, re-raise shadow errors."""
        try:
            if self._thread is None:  # joined last: never shadowed, so this rank tells the workers to stop
                _exchange_terminate(self.metric)
            else:
                self._thread.join()
                self._thread = None
        finally:
            self.metric._join_active = False
        if self._errors:
            raise self._errors[0]

    def _work(self) -> None:
        try:
            while _shadow_once(self.metric):
                pass
        except BaseException as err:  # reported on the main thread by post_hook
            self._errors.append(err)


def _join_being_built(hook: MetricJoinHook) -> Join | None:
    """The ``Join`` whose constructor is running and holds ``hook`` (found on the call stack), or None.

    None if it cannot be found (a future torch changed ``Join.__init__``; a test watches for that).
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        hooks = getattr(candidate, "_join_hooks", None)
        if isinstance(candidate, Join) and isinstance(hooks, list) and hook in hooks:
            return candidate
        frame = frame.f_back
    return None


def _check_order_and_run_hook_first(join: Join, hook: MetricJoinHook, is_first_joinable: bool) -> None:
    """Refuse a metric listed before a DDP model, and move ``hook`` to the front of the hooks of ``join``.

    The first joinable of a ``Join`` counts the running ranks with an all-reduce at the start of its per-iteration
    work, and torch requires that count to come before every other joinable's collectives. DDP's forward pass issues
    collectives (bucket rebuilds, the backward-sync flag) before the metric's per-step sync, so a metric listed before
    a DDP model would make a joined rank pair those collectives with the wrong ones: the job hangs. Raised on every rank
    alike, since every rank builds the same ``Join``.

    ``Join`` runs its joinables' hooks in list order. With ``Join([ddp_model, metric])``, DDP's hook would block in
    its backward all-reduces before this metric's hook could start the shadowing thread that lets the running ranks
    reach their backward pass. This hook only starts a thread, so running it first changes nothing else.
    """
    others = [joinable for joinable in getattr(join, "_joinables", []) if joinable is not hook.metric]
    if is_first_joinable and any(isinstance(other, DistributedDataParallel) for other in others):
        raise ValueError(
            "Expected the DDP model before the metric in `Join` (`Join([ddp_model, metric])`) but the metric came"
            " first. The first joinable counts the running ranks at the start of each iteration, and DDP's forward"
            " pass runs before the metric's per-step sync."
        )
    hooks: list[JoinHook] = join._join_hooks
    hooks.remove(hook)
    hooks.insert(0, hook)


def _shadow_once(metric: "Metric") -> bool:
    """One per-step sync as a rank with an empty batch; False when the terminate record arrived instead."""
    from torchmetrics_varlen._state_sync import sync_layout
    from torchmetrics_varlen.gather import exchange_entries

    empty: dict[str, Any] = {name: [] if isinstance(value, list) else value for name, value in metric._defaults.items()}
    _, entries, context, join = sync_layout([metric], "step", [empty])
    plan, _ = exchange_entries(
        entries,
        metric._join_group,
        context=context,
        label=f"{type(metric).__name__}.step",
        join=join,
        stop=lambda table: any(row[_protocol.H_CONTEXT] == _TERMINATE for row in table),
    )
    return plan is not None


def _exchange_terminate(metric: "Metric") -> None:
    from torchmetrics_varlen.gather import exchange_entries

    exchange_entries([], metric._join_group, context=_TERMINATE, label="Join.terminate", stop=lambda table: True)


class JoinableMetric(Joinable):
    """The :class:`~torch.distributed.algorithms.join.Joinable` side of :class:`~torchmetrics_varlen.Metric`."""

    _join_active: bool
    process_group: Any
    sync_grads: bool

    @property
    def device(self) -> torch.device:
        """The metric's device (torchmetrics.Metric provides it)."""
        raise NotImplementedError

    def _init_join(self) -> None:
        # Joinable.__init__ is not reached through torchmetrics' constructor chain; this is what it would set.
        from torch.distributed.algorithms.join import _JoinConfig

        self._join_hook: MetricJoinHook | None = None
        self._join_group = None
        self._join_active = False
        self._join_config = _JoinConfig.construct_disabled_join_config()  # type: ignore[no-untyped-call]

    def _join_state_for_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        # A process group and a thread cannot be copied: a copy starts outside any Join, with a group made anew.
        state = dict(state)
        state.update(_join_group_ref=None, _join_hook=None, _join_active=False)
        return state

    @property
    def _join_group(self) -> Any:
        """The side process group of this metric's per-step syncs inside ``Join``; None before the first ``Join``."""
        ref = self.__dict__.get("_join_group_ref")
        return ref() if ref is not None else None

    @_join_group.setter
    def _join_group(self, group: Any) -> None:
        # Held weakly: torch.distributed holds its groups until destroy_process_group(). Metrics sit in reference
        # cycles (torchmetrics wraps update/compute), so one may live on until the garbage collector runs at
        # interpreter exit; a gloo group destroyed that late can abort the process ("terminate called without an
        # active exception"). After destroy_process_group() the group is gone, and a later Join makes a new one.
        self.__dict__["_join_group_ref"] = weakref.ref(group) if group is not None else None

    @property
    def _join_config(self) -> Any:
        return self.__dict__["_join_config_value"]

    @_join_config.setter
    def _join_config(self, config: Any) -> None:
        # Join sets every joinable's config right after it built their hooks: the moment to check the order of the
        # joinables and to put this metric's hook first, so that a joined rank starts shadowing before another
        # joinable's hook (DDP's) blocks.
        self.__dict__["_join_config_value"] = config
        if not (config.enable and self._join_hook is not None):
            return
        join = _join_being_built(self._join_hook)
        if join is None:
            return
        try:
            _check_order_and_run_hook_first(join, self._join_hook, config.is_first_joinable)
        except ValueError:
            self._join_active = False  # this Join never runs: per-step syncs go back to the metric's own group
            raise

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on a rank that ran out of data (called on every rank when ``Join`` is built)."""
        if self.sync_grads:
            raise RuntimeError(
                "Expected `sync_grads=False` for a metric inside `Join` but got True: a rank that ran out of data"
                " cannot shadow the backward pass of a differentiable gather. Use the default rank-local gradient"
                " (DDP then gives 1/world_size of the single-process gradient; scale the loss by the world size)."
            )
        if self._join_group is None:
            # A collective on the whole world: every rank builds its Join at the same point, so all get here.
            ranks = None if self.process_group is None else dist.get_process_group_ranks(self.process_group)
            self._join_group = dist.new_group(ranks=ranks)
        self._join_active = True
        self._join_hook = MetricJoinHook(self)  # type: ignore[arg-type]
        return self._join_hook

    @property
    def join_device(self) -> torch.device:
        """Device of the tensors ``Join`` all-reduces to count the ranks that have not joined."""
        if not dist.is_initialized():
            return self.device  # no Join without a process group; TorchScript reads every property while scripting
        return _transport.transport_device(self.process_group, self.device)

    @property
    def join_process_group(self) -> Any:
        """Process group ``Join`` counts the ranks on: the metric's own (the world by default)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _step_sync_group(self, group: Any) -> Any:
        """Inside Join the per-step syncs move to the join group, and tell Join that this rank still runs."""
        if not self._join_active:
            return group
        Join.notify_join_context(self)
        return self._join_group
