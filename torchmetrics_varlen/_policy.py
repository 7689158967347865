"""The one place that knows backends: where exchange buffers live, how to wait, which data path runs.

Everything else in the package is backend-agnostic. The decisions, and why:

* **Buffer device.** Decided from facts equal on every rank, never from the states a rank happens to hold (a rank
  whose list states are all empty must not pick another backend than its peers):

  - *which backend serves the sync* matters only on a group created with several backends
    (``backend="cpu:gloo,cuda:nccl"``; ``init_process_group()`` without a backend reports "undefined" and is served by
    its device map, see :func:`backend_of`). It is the entry for the metric's device type (torchmetrics'
    ``Metric.device``, passed down by every caller); where no metric is known (the ``gather_all_tensors`` hook) it
    is the accelerator's entry when CUDA is available, else the CPU's, whatever the tensor's device;
  - *which device of that kind* is this rank's own choice (peers only have to agree on the kind): NCCL moves CUDA
    memory only, so its buffers live on the group's bound device (``init_process_group(device_id=...)``, which
    ``new_group`` inherits), else the metric's CUDA device, else this rank's first CUDA state, else the current
    device; gloo's on the CPU (gloo stages CUDA tensors through the host anyway); any other backend's on the metric's
    device (the first state's where no metric is known).

  States on other devices are copied to the buffer device when packed and back to their own device when unpacked
  (an entry with no tensor, to the metric's device): one code path whatever the devices, since ``Tensor.to`` is a
  no-op on the same device.
* **Differentiable outputs.** Autograd runs a node on the thread of the device its output gradients live on (the CPU
  thread for CPU tensors, one thread per CUDA device). DDP's gradient hooks run on the CUDA device's thread, so the
  backward all-reduce of a differentiable sync must be issued from that thread too, or two threads issue collectives
  on one communicator in an order that can differ between ranks. So the outputs of the differentiable step live on
  the buffer device when it is an accelerator, else on the metric's device (``grad_device``), and are copied to each
  state's own device after the node: its backward runs on the accelerator's thread even for CPU states.
* **Waiting.** Every collective is started asynchronously and waited for in one of two ways, both with the same
  outcome (done, expired with the collective left pending, or failed), both run by the gloo tests (a third, inside
  backward only, follows):

  - ``"block"`` (gloo): ``work.wait(timeout)`` in slices, at once (no spinning first: gloo's own thread in this
    process runs the collective, and a spinning caller would take CPU from it). gloo's work is c10d's base
    ``Work``, whose timed ``wait``
    is a condition-variable wait that raises "Operation timed out!" and changes nothing (``c10d::Work::wait``), so a
    rank wakes the moment the collective completes. A slice is never zero: c10d reads a zero timeout as "none".
  - ``"poll"`` (NCCL and every other backend): check ``work.is_completed()`` a few hundred times without sleeping
    (a small collective is done by then), then between sleeps of growing length, and
    call ``work.wait()`` *without* a timeout once it completed. A timed ``wait`` is not safe there: on NCCL it blocks
    and, on expiry, marks the work timed out and aborts the communicator (``ProcessGroupNCCL::WorkNCCL::wait``),
    which would tear down the job's group for a rank that is merely late.
  - ``"stream"`` (NCCL, inside a backward pass only: ``grad_wait``): a plain ``work.wait()``, which on NCCL makes the
    current stream wait for the collective and returns at once (``ProcessGroupNCCL::WorkNCCL::wait`` without a
    timeout), so the autograd thread is not blocked in CPU polling and DDP's overlap is kept. There is no timeout of
    ours there: a rank that never runs its backward is NCCL's watchdog's to report, at the group's timeout.

  Nothing here aborts a communicator because a rank is late: no timed wait ever runs on NCCL, and our timer only
  stops waiting. Once the backend itself failed a work (its own group timeout, a crashed peer), the untimed ``wait()``
  runs the backend's error handling, which on NCCL may abort the communicator and end the process (the watchdog
  does so at the group's timeout anyway); that is why our timeout is capped below the group's (see ``_waits``).
  A sleep asks the OS for tens of microseconds and gets 100-200 on a busy machine, which is why gloo blocks instead of
  sleeping.
* **Data path.** The padded equal-size gather (``all_gather_into_tensor``) on every backend, ``all_reduce`` for the
  dense states the plan routes there, and one ``broadcast`` per rank straight into the result for the states whose
  largest rank holds at least ``broadcast_min`` bytes (see ``_routes.route_data``). ``broadcast_min`` is the cost
  model's one constant: the bytes whose transfer costs what one more collective does. Measured on gloo (2-8 CPU
  processes, docs page "How the sync works"): 128 KiB. On NCCL it is 4 MiB, a choice from NCCL's documented latency
  and bandwidth, **not measured** (one GPU cannot: NCCL refuses two ranks on it). On NCCL each round of the route
  (every rank's chunk of one state) is one list ``all_gather`` of unequal sizes, which ``ProcessGroupNCCL`` runs as
  one group of broadcasts (``grouped_broadcasts``); gloo's list ``all_gather`` takes equal sizes only, so there it is
  one ``broadcast`` per rank and chunk. The grouped path runs on gloo in the tests with equal sections only.
* **The gather to one rank** (``compute_on_rank``, ``point_to_point``): ``gather`` and ``all_to_all_single`` off NCCL;
  on NCCL, which runs both point to point (a connection, and its buffers for the communicator's life, to every peer
  an operation names, zero-byte ones included), the padded ``all_gather`` and list ``all_gather`` calls (see
  ``_to_rank``).
* **NCCL by any name.** torch calls its NCCL implementations "nccl", "nccl2", "nccl-lazy" and "nccl-legacy"
  (:data:`NCCL_BACKENDS`); every decision above treats them alike (:func:`is_nccl`).

The waiting itself (the two ways, their constants, the timeouts) is :mod:`torchmetrics_varlen._waits`'s: this module
only decides which way a sync waits (:func:`wait_mode`). Tests force a policy on gloo with :func:`forced`, and call
:func:`decide` and :func:`buffer_device` directly with made-up facts and backends.
"""

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from torchmetrics_varlen import _caches

REDUCE_ENV = "TORCHMETRICS_VARLEN_REDUCE"
REDUCE_MODES = ("auto", "never", "always")
# The broadcast route's threshold (module docstring, "Data path"): measured on gloo; NCCL's is not measured.
BROADCAST_MIN_BYTES = {"gloo": 128 * 2**10, "nccl": 4 * 2**20}
# The names torch gives NCCL's implementations: "nccl" (since torch 2.14 the torchcomms-based ProcessGroupNCCL2 unless
# TORCH_DIST_USE_NCCL2=0), "nccl2" (that one by name), "nccl-lazy" (nccl2 with a 2-rank communicator per
# point-to-point pair) and "nccl-legacy" (the older ProcessGroupNCCL by name). torch treats them all as NCCL
# (``distributed_c10d._get_default_timeout``), and so does every decision here.
NCCL_BACKENDS = frozenset({"nccl", "nccl2", "nccl-lazy", "nccl-legacy"})


@dataclass(frozen=True)
class TransportPolicy:
    """The backend-dependent choices of one sync.

    Args:
        backend: the group's backend name, lower case.
        device: where the exchange buffers live.
        reduce: "auto" (the plan's cost model), "never" or "always" (every eligible state all-reduced).
        wait: how the collectives are waited for: "block" or "poll" (see ``_waits.wait_for``).
        grad_device: where the outputs of a differentiable sync live (None: ``device``); see the module docstring.
        grad_wait: how the backward all-reduce is waited for: "stream" on NCCL, else as ``wait``.
        broadcast_min: the bytes of its largest rank from which a state moves by per-rank broadcasts.
        grouped_broadcasts: issue each round of the broadcast route (every rank's chunk of one state) as one list
            ``all_gather``, which NCCL runs as one group of broadcasts; else one ``broadcast`` per rank and chunk
            (gloo's list ``all_gather`` takes equal sizes only).
        point_to_point: a one-rank sync (``compute_on_rank``) may use collectives that NCCL runs point to point
            (``gather``, ``all_to_all_single``); False on NCCL, where each peer they name gets a connection and its
            buffers for the communicator's life (see ``_to_rank``).
    """

    backend: str
    device: torch.device
    reduce: str = "auto"
    wait: str = "poll"
    grad_device: torch.device | None = None
    grad_wait: str | None = None
    broadcast_min: int = BROADCAST_MIN_BYTES["gloo"]
    grouped_broadcasts: bool = False
    point_to_point: bool = True


@dataclass(frozen=True)
class Facts:
    """What a sync's policy is decided from: all equal on every rank, except which device of a kind is this rank's.

    Args:
        backend: the group's backend name, lower case (``"cpu:gloo,cuda:nccl"`` for several).
        device: the metric's device (torchmetrics' ``Metric.device``); None where no metric is known (the hook).
        local: the device of this rank's first local tensor, or None: only picks a device within the kind the
            equal facts chose (a CUDA index, or another backend's device where no metric is known).
        bound: the group's bound device (``init_process_group(device_id=...)``), or None.
        current_cuda: the current CUDA device index, or -1 where no CUDA device is needed.
        cuda_available: ``torch.cuda.is_available()``: picks the backend of a several-backend group for the hook.
        reduce: the raw ``TORCHMETRICS_VARLEN_REDUCE`` value.
    """

    backend: str
    device: torch.device | None
    local: torch.device | None = None
    bound: torch.device | None = None
    current_cuda: int = -1
    cuda_available: bool = False
    reduce: str = ""


class _Forced(threading.local):
    """The policy :func:`forced` set, per thread; unset: the class's None (read at every sync: no AttributeError)."""

    policy: "TransportPolicy | None" = None


_FORCED = _Forced()
_CPU = torch.device("cpu")


def backend_of(group: Any) -> str:
    """The backend name of ``group`` (the default group when None), lower case.

    A group made by ``init_process_group()`` without a backend reports "undefined": its device-to-backend map
    (``"cuda:nccl"`` where torch sees an accelerator, ``"cpu:gloo"`` elsewhere) is what serves it.
    """
    pg = group if group is not None else dist.group.WORLD
    try:
        return _BACKENDS[pg]
    except (KeyError, TypeError):  # not seen yet, or a group that cannot be weakly referenced
        pass
    backend = str(dist.get_backend(group)).lower()
    if backend == "undefined":
        backend = str(dist.get_backend_config(group)).lower().replace(" ", "")
    with contextlib.suppress(TypeError):
        _BACKENDS[pg] = backend
    return backend


# A group's backend never changes; every sync asks (``dist.get_backend`` costs more than the rest of the policy).
# Weakly keyed: a destroyed group takes its entry along, and a group made later is looked up afresh.
_BACKENDS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_caches.register(
    "_policy._BACKENDS: a group's backend never changes, and asking torch costs more than the policy", _BACKENDS.clear
)


def bound_device(group: Any) -> torch.device | None:
    """The device ``group`` (the default group when None) is bound to by ``init_process_group(device_id=...)``."""
    pg = group if group is not None else dist.group.WORLD
    bound = getattr(pg, "bound_device_id", None)  # new_group and split_group inherit the default group's
    return bound if isinstance(bound, torch.device) else None


def _backends(backend: str) -> dict[str, str]:
    return dict(part.split(":", 1) for part in backend.split(","))  # "cpu:gloo,cuda:nccl"


def serving_backend(backend: str, device_type: str) -> str:
    """The backend that serves tensors of ``device_type``: ``backend`` itself, or its entry for that device type."""
    if ":" not in backend:
        return backend
    mapping = _backends(backend)
    return mapping.get(device_type) or next(iter(mapping.values()))


def serving_type(facts: Facts) -> str:
    """The device type whose backend serves the sync: decided from facts equal on every rank (module docstring)."""
    return _serving_type(facts.backend, facts.device, facts.local, facts.cuda_available)


def _serving_type(backend: str, device: torch.device | None, local: torch.device | None, cuda: bool) -> str:
    if device is not None:
        return device.type
    if ":" in backend:  # the hook on a several-backend group: the accelerator's entry where there is one
        return "cuda" if cuda and "cuda" in _backends(backend) else "cpu"
    return local.type if local is not None else "cpu"


def is_nccl(backend: str, device_type: str = "cuda") -> bool:
    """Whether ``backend`` (its entry for ``device_type``) is one of NCCL's implementations (:data:`NCCL_BACKENDS`).

    Example:
        >>> is_nccl("nccl"), is_nccl("nccl2"), is_nccl("cpu:gloo,cuda:nccl2"), is_nccl("cpu:gloo,cuda:nccl2", "cpu")
        (True, True, True, False)
    """
    return serving_backend(backend, device_type) in NCCL_BACKENDS


def point_to_point(group: Any, device_type: str) -> bool:
    """Whether a one-rank sync over ``group`` may use point-to-point collectives (:class:`TransportPolicy`).

    A policy forced for tests decides; else every backend but NCCL's (the backend is the same on every rank).
    """
    forced = _FORCED.policy
    if forced is not None:
        return forced.point_to_point
    return not is_nccl(backend_of(group), device_type)


def wait_mode(backend: str, device_type: str) -> str:
    """How to wait for a collective of ``backend`` on buffers of ``device_type``: "block" on gloo, else "poll"."""
    return "block" if serving_backend(backend, device_type) == "gloo" else "poll"


def buffer_device(facts: Facts) -> torch.device:
    """Where the buffers of a sync live (see the module docstring for the order of preference)."""
    backend = serving_backend(facts.backend, serving_type(facts))
    if backend in NCCL_BACKENDS:
        for candidate in (facts.bound, facts.device, facts.local):
            if candidate is not None and candidate.type == "cuda":
                index = candidate.index if candidate.index is not None else facts.current_cuda
                return torch.device("cuda", max(index, 0))
        return torch.device("cuda", max(facts.current_cuda, 0))
    if backend == "gloo":
        return _CPU
    return facts.device or facts.local or _CPU


def decide(facts: Facts) -> TransportPolicy:
    """The policy of a sync with these facts: a pure function, so tests give it made-up backends and devices."""
    device = buffer_device(facts)
    grad_device = device if device.type != "cpu" else (facts.device or facts.local or _CPU)
    serving = serving_backend(facts.backend, device.type)
    nccl = serving in NCCL_BACKENDS
    wait = wait_mode(facts.backend, device.type)
    broadcast_min = BROADCAST_MIN_BYTES["nccl" if nccl else serving if serving in BROADCAST_MIN_BYTES else "gloo"]
    return TransportPolicy(
        facts.backend,
        device,
        reduce_mode(facts.reduce),
        wait,
        grad_device,
        "stream" if nccl else wait,
        broadcast_min,
        grouped_broadcasts=nccl,
        point_to_point=not nccl,
    )


def shared_gpu_hint(
    backend: str, device: torch.device, bound: torch.device | None, local_rank: str | None, device_count: int
) -> str:
    """The fix for buffers that land on one GPU for every local rank, or "" where the facts do not point to it.

    A CPU-state metric (or a CUDA metric moved with ``.to("cuda")``) on an NCCL group with neither
    ``init_process_group(device_id=...)`` nor ``torch.cuda.set_device`` puts its buffers on the current device,
    ``cuda:0`` on every local rank, and NCCL refuses two ranks on one GPU ("Duplicate GPU detected") at the first
    collective, on every rank of the node. The facts: an NCCL group with no bound device, buffers on ``cuda:0``, and a
    ``LOCAL_RANK`` that maps to another of the visible GPUs. torch's own ``nccl2`` backend binds the group to
    ``LOCAL_RANK``'s GPU itself, so its groups never match.

    Example:
        >>> shared_gpu_hint("nccl", torch.device("cuda", 0), None, "3", 8)[:45]
        'This rank (LOCAL_RANK 3) put its buffers on c'
        >>> shared_gpu_hint("nccl", torch.device("cuda", 0), None, "0", 8), shared_gpu_hint("gloo", _CPU, None, "3", 8)
        ('', '')
    """
    if not is_nccl(backend, device.type) or bound is not None or device != torch.device("cuda", 0):
        return ""
    try:
        expected = int(local_rank or "0") % max(device_count, 1)
    except ValueError:
        return ""
    if expected == 0:
        return ""
    return (
        f"This rank (LOCAL_RANK {local_rank}) put its buffers on cuda:0, the current device, because the process"
        " group is bound to no device and `torch.cuda.set_device` was not called: every rank of this node is on"
        f" cuda:0, which NCCL refuses. Call `torch.cuda.set_device({expected})` (`torch.cuda.set_device(local_rank)`)"
        " before the first sync, or create the group with `init_process_group(..., device_id=torch.device('cuda',"
        " local_rank))`."
    )


def shared_gpu_hint_for(group: Any, device: torch.device, error: str) -> str:
    """:func:`shared_gpu_hint` with this process's facts (the group's bound device, ``LOCAL_RANK``, the GPU count).

    ``error`` is the backend's message: NCCL's own "Duplicate GPU detected" gets a hint even where ``LOCAL_RANK``
    cannot tell which GPU was meant.
    """
    if device.type != "cuda":
        return ""
    hint = shared_gpu_hint(
        backend_of(group), device, bound_device(group), os.environ.get("LOCAL_RANK"), torch.cuda.device_count()
    )
    if not hint and "Duplicate GPU" in error:
        hint = f"This rank put its buffers on {device}.{SHARED_GPU_FIX}"
    return hint


# What NCCL's "Duplicate GPU detected" needs, wherever it surfaces (at the collective's start, or from its work).
SHARED_GPU_FIX = (
    " Two ranks of this node share one GPU, which NCCL refuses: give each rank its own with"
    " `torch.cuda.set_device(local_rank)` before the first sync, or"
    " `init_process_group(..., device_id=torch.device('cuda', local_rank))`."
)


def crosses_autograd_threads(devices: list[torch.device], cuda_in_use: bool) -> bool:
    """Whether a differentiable sync of tensors on ``devices`` would race DDP's gradient all-reduces.

    In a process that uses CUDA, DDP's hooks issue their all-reduces from the CUDA device's autograd thread. A sync
    of CPU tensors (states updated with ``.cpu()`` copies) puts its backward all-reduce behind work on the CPU's
    autograd thread, whatever device its own outputs live on, so which of the two reaches the process group first
    is a matter of timing, and can differ between ranks: a hang or mixed-up gradients. Such a sync is refused, on
    every rank alike (each rank's answer travels in its record as ``FLAG_HOST_GRAD``).

    Example:
        >>> crosses_autograd_threads([torch.device("cpu")], cuda_in_use=True)
        True
        >>> crosses_autograd_threads([torch.device("cpu")], cuda_in_use=False)
        False
    """
    return cuda_in_use and any(device.type == "cpu" for device in devices)


def reduce_mode(raw: str | None = None) -> str:
    """``TORCHMETRICS_VARLEN_REDUCE`` (or ``raw``): "auto" (default), "never" (gather everything) or "always"."""
    raw = os.environ.get(REDUCE_ENV, "auto") if raw is None else raw
    raw = raw.strip().lower() or "auto"
    if raw not in REDUCE_MODES:
        raise ValueError(f"Expected `{REDUCE_ENV}` to be one of {REDUCE_MODES} but got {raw!r}")
    return raw


def policy_for(group: Any, device: torch.device | None, local: torch.device | None = None) -> TransportPolicy:
    """The policy of a sync over ``group`` for a metric on ``device`` (None: no metric, the hook).

    ``local`` is this rank's first local tensor's device: it never picks the backend, only a device of the kind the
    equal facts picked (see :class:`Facts`).
    """
    forced = _FORCED.policy
    if forced is not None:
        return forced
    backend = backend_of(group)
    cuda_available = ":" in backend and device is None and torch.cuda.is_available()
    reduce = os.environ.get(REDUCE_ENV, "")
    bound, current = None, -1
    if serving_backend(backend, _serving_type(backend, device, local, cuda_available)) in NCCL_BACKENDS:
        bound, current = bound_device(group), torch.cuda.current_device()
    return _decide(backend, device, local, bound, current, cuda_available, reduce)


@functools.lru_cache(maxsize=64)
def _decide(*facts: Any) -> TransportPolicy:
    # Every sync asks for its policy: the answer depends on the facts only, so it is built once per combination
    # (keyed by the plain values: cheaper to hash than a Facts).
    return decide(Facts(*facts))


@contextlib.contextmanager
def forced(**fields: Any) -> Generator[TransportPolicy, None, None]:
    """Use a policy with ``fields`` replaced (in this thread) for the syncs inside the block: tests."""
    base = TransportPolicy("gloo", torch.device("cpu"), "auto", "block", None, None)
    policy = replace(base, **fields)
    previous = _FORCED.policy
    _FORCED.policy = policy
    try:
        yield policy
    finally:
        _FORCED.policy = previous


_caches.register("_policy._decide: a policy depends on its facts only, and every sync asks", _decide.cache_clear)
