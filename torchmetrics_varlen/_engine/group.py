"""State per process group, the policy of a sync, and the settings read from the environment.

Everything a sync keeps between syncs lives in one :class:`GroupState` per (process group, generation), held by the
one registry (:data:`REGISTRY`): the group's rank and size, its backend and the policies decided for it, its agreed
record length, its plan cache and the repeated syncs it learnt (the fast path), the limits of its
waits, its send buffers and its side group (a gloo group of the same ranks, for the Join worker). A group destroyed
takes its state along (weakly keyed); a world initialised again is a new generation, whose store keys differ.

**The policy** (:func:`decide`, pure: tests give it made-up facts) is decided from facts equal on every rank, never
from the states a rank happens to hold (a rank whose list states are all empty must not pick another backend):

* *which backend serves the sync* matters on a group made with several (``"cpu:gloo,cuda:nccl"``; a group made
  without a backend reports "undefined" and is served by its device map): the entry for the metric's device type,
  else (the ``gather_all_tensors`` hook, no metric) the accelerator's where CUDA is available;
* *the buffer device*: NCCL moves CUDA memory only, so its buffers live on the group's bound device, else the
  metric's CUDA device, else this rank's first CUDA state, else the current device; gloo's on the CPU (gloo stages
  CUDA tensors through the host anyway); any other backend's on the metric's device;
* *differentiable outputs* live on the accelerator when the buffers do (autograd runs a node's backward on the thread
  of its outputs' device, where DDP's hooks issue their all-reduces), else on the metric's device;
* *how to wait*: "block" on gloo (a timed ``work.wait``, a condition-variable wait that changes nothing on expiry),
  "poll" elsewhere (``is_completed`` checks, then an untimed ``wait``: a timed ``wait`` on NCCL aborts the
  communicator when it expires), "stream" for the backward all-reduce on NCCL (the stream waits, not the thread);
* *the broadcast route's threshold*: 128 KiB on gloo (measured), 4 MiB on NCCL (from NCCL's documented latency and
  bandwidth, not measured); on NCCL a round of the route is one list ``all_gather`` (one group of broadcasts) and a
  one-rank sync uses no point-to-point collective (NCCL connects every peer such a call names);
* *device records*: small states on an accelerator ride in the record on the device (never read on the host).

NCCL by any name ("nccl", "nccl2", "nccl-lazy", "nccl-legacy") is treated alike.
"""

import contextlib
import datetime
import os
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from torchmetrics_varlen._engine.plan import Plan
from torchmetrics_varlen._engine.record import MAX_WORDS, record_words

ProcessGroup = Any  # torch.distributed.ProcessGroup; kept loose because its import path moved between torch releases

# ----------------------------------------------------------------------------------------------------- settings
SYNC_CAP_ENV = "TORCHMETRICS_VARLEN_SYNC_CAP"
TIMEOUT_ENV = "TORCHMETRICS_VARLEN_SYNC_TIMEOUT"
REDUCE_ENV = "TORCHMETRICS_VARLEN_REDUCE"
REDUCE_MODES = ("auto", "never", "always")
DEFAULT_CAP = 256 * 2**20
MIN_CAP = 1024  # bytes: below this, chunking costs more collectives than any memory it saves
INVALID_CAP = 0  # sent for an environment value that does not parse: every rank raises, naming the rank
_UNITS = MappingProxyType({"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_cap(value: object, source: str) -> int:
    """``value`` (bytes, or a string such as ``"64MiB"``) as a number of bytes; ``source`` names it in errors.

    Example:
        >>> parse_cap("64MiB", "sync_cap"), parse_cap(4096, "sync_cap")
        (67108864, 4096)
    """
    nbytes: float | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            nbytes = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if nbytes is None or nbytes < MIN_CAP:
        raise ValueError(
            f"Expected `{source}` to be a number of bytes of at least {MIN_CAP} (an int, or a string such as"
            f" '64MiB', '1GiB') but got {value!r}."
        )
    return int(nbytes)


def sent_cap(cap: int | None) -> int:
    """The transfer cap this rank's record carries: ``cap`` if given, else the environment's, else the default.

    An environment value that does not parse gives :data:`INVALID_CAP`: it travels in the record, and every rank
    raises together (raising here would leave the other ranks waiting).
    """
    if cap is not None:
        return cap
    env = os.environ.get(SYNC_CAP_ENV)
    if not env:
        return DEFAULT_CAP
    try:
        return parse_cap(env, SYNC_CAP_ENV)
    except ValueError:
        return INVALID_CAP


def default_timeout() -> float | None:
    """``TORCHMETRICS_VARLEN_SYNC_TIMEOUT`` in seconds if set (0: no timeout of ours), else None: the group's own."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(f"Expected `{TIMEOUT_ENV}` to be a number of seconds but got {raw!r}") from err
    return max(value, 0.0)


def resolve_timeout(sync_timeout: object) -> float | None:
    """A ``sync_timeout`` argument, else the environment's, else None (the group's own); 0 or less: no timer of ours."""
    if sync_timeout is None:
        return default_timeout()
    if isinstance(sync_timeout, bool) or not isinstance(sync_timeout, (int, float)):
        raise ValueError(f"Expected `sync_timeout` to be a number of seconds or None but got {sync_timeout!r}")
    return float(sync_timeout) if sync_timeout > 0 else 0.0


def reduce_mode(raw: str | None = None) -> str:
    """``TORCHMETRICS_VARLEN_REDUCE`` (or ``raw``): "auto" (default), "never" (gather everything) or "always"."""
    raw = os.environ.get(REDUCE_ENV, "auto") if raw is None else raw
    raw = raw.strip().lower() or "auto"
    if raw not in REDUCE_MODES:
        raise ValueError(f"Expected `{REDUCE_ENV}` to be one of {REDUCE_MODES} but got {raw!r}")
    return raw


# ------------------------------------------------------------------------------------------------------- policy
BROADCAST_MIN_BYTES = MappingProxyType({"gloo": 128 * 2**10, "nccl": 4 * 2**20})
NCCL_BACKENDS = frozenset({"nccl", "nccl2", "nccl-lazy", "nccl-legacy"})
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Policy:
    """The backend-dependent choices of one sync (see the module docstring).

    Args:
        backend: the group's backend name, lower case.
        device: where the exchange buffers live.
        reduce: "auto" (the plan's cost model), "never" or "always" (every eligible state all-reduced).
        wait: how the collectives are waited for: "block" or "poll".
        grad_device: where the outputs of a differentiable sync live.
        grad_wait: how the backward all-reduce is waited for: "stream" on NCCL, else as ``wait``.
        broadcast_min: the bytes of its largest rank from which a state moves by per-rank broadcasts.
        grouped_broadcasts: a round of the broadcast route is one list ``all_gather`` (NCCL).
        point_to_point: a one-rank sync may use ``gather`` and ``all_to_all_single`` (not on NCCL).
        device_records: small states on ``device`` ride in the record there (an accelerator).
    """

    backend: str
    device: torch.device
    reduce: str = "auto"
    wait: str = "block"
    grad_device: torch.device | None = None
    grad_wait: str | None = None
    broadcast_min: int = BROADCAST_MIN_BYTES["gloo"]
    grouped_broadcasts: bool = False
    point_to_point: bool = True
    device_records: bool = False


@dataclass(frozen=True)
class Facts:
    """What a policy is decided from: all equal on every rank, except which device of a kind is this rank's.

    Args:
        backend: the group's backend name, lower case (``"cpu:gloo,cuda:nccl"`` for several).
        device: the metric's device (``Metric.device``); None where no metric is known (the hook).
        local: the device of this rank's first local tensor: only picks a device within the kind already chosen.
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


def _backends(backend: str) -> dict[str, str]:
    return dict(part.split(":", 1) for part in backend.split(","))  # "cpu:gloo,cuda:nccl"


def serving_backend(backend: str, device_type: str) -> str:
    """The backend that serves tensors of ``device_type``: ``backend`` itself, or its entry for that device type."""
    if ":" not in backend:
        return backend
    mapping = _backends(backend)
    return mapping.get(device_type) or next(iter(mapping.values()))


def serving_type(facts: Facts) -> str:
    """The device type whose backend serves the sync: decided from facts equal on every rank."""
    if facts.device is not None:
        return facts.device.type
    if ":" in facts.backend:  # the hook on a several-backend group: the accelerator's entry where there is one
        return "cuda" if facts.cuda_available and "cuda" in _backends(facts.backend) else "cpu"
    return facts.local.type if facts.local is not None else "cpu"


def is_nccl(backend: str, device_type: str = "cuda") -> bool:
    """Whether ``backend`` (its entry for ``device_type``) is one of NCCL's implementations.

    Example:
        >>> is_nccl("nccl"), is_nccl("nccl2"), is_nccl("cpu:gloo,cuda:nccl2"), is_nccl("cpu:gloo,cuda:nccl2", "cpu")
        (True, True, True, False)
    """
    return serving_backend(backend, device_type) in NCCL_BACKENDS


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


def decide(facts: Facts) -> Policy:
    """The policy of a sync with these facts: a pure function, so tests give it made-up backends and devices."""
    device = buffer_device(facts)
    grad_device = device if device.type != "cpu" else (facts.device or facts.local or _CPU)
    serving = serving_backend(facts.backend, device.type)
    nccl = serving in NCCL_BACKENDS
    wait = wait_mode(facts.backend, device.type)
    broadcast_min = BROADCAST_MIN_BYTES["nccl" if nccl else serving if serving in BROADCAST_MIN_BYTES else "gloo"]
    return Policy(
        facts.backend,
        device,
        reduce_mode(facts.reduce),
        wait,
        grad_device,
        "stream" if nccl else wait,
        broadcast_min,
        grouped_broadcasts=nccl,
        point_to_point=not nccl,
        device_records=device.type != "cpu",
    )


def crosses_autograd_threads(devices: list[torch.device], cuda_autograd: bool) -> bool:
    """Whether a differentiable sync of tensors on ``devices`` would race DDP's gradient all-reduces.

    Where a CUDA autograd thread can issue DDP's buckets (``cuda_autograd``: the group is served by NCCL, or a
    gradient lives on a CUDA device), a sync of CPU tensors puts its backward all-reduce behind work on the CPU's
    autograd thread, so which of the two reaches the process group first is a matter of timing and can differ between
    ranks. Such a sync is refused, on every rank alike (each rank's answer travels in its record as
    ``FLAG_HOST_GRAD``). A process that merely touched CUDA (``pin_memory``, a device query) is not such a process.

    Example:
        >>> crosses_autograd_threads([torch.device("cpu")], cuda_autograd=True)
        True
        >>> crosses_autograd_threads([torch.device("cpu")], cuda_autograd=False)
        False
    """
    return cuda_autograd and any(device.type == "cpu" for device in devices)


def shared_gpu_hint(
    backend: str, device: torch.device, bound: torch.device | None, local_rank: str | None, device_count: int
) -> str:
    """The fix for buffers that land on one GPU for every local rank, or "" where the facts do not point to it.

    A CPU-state metric on an NCCL group with neither ``init_process_group(device_id=...)`` nor
    ``torch.cuda.set_device`` puts its buffers on ``cuda:0`` on every local rank, and NCCL refuses two ranks on one
    GPU ("Duplicate GPU detected") at the first collective.

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


SHARED_GPU_FIX = (
    " Two ranks of this node share one GPU, which NCCL refuses: give each rank its own with"
    " `torch.cuda.set_device(local_rank)` before the first sync, or"
    " `init_process_group(..., device_id=torch.device('cuda', local_rank))`."
)


# -------------------------------------------------------------------------------------------------- group state
INITIAL_WORDS = record_words(30)  # room for 30 entries at first: one exchange for most collections
MIN_WORDS = record_words(8)  # the agreed length never shrinks below room for 8 entries
RECORD_WINDOW = 64  # syncs after which the agreed length shrinks to the longest record of the window
PLANS_KEPT = 64  # plans kept per group: a job syncs a handful of layouts again and again
SEND_BUFFER_KEPT_BYTES = 64 * 2**20  # a CPU send buffer up to this size is reused between syncs


@dataclass
class GroupState:
    """What a process group keeps between syncs; the same on all its ranks where it follows from exchanged tables.

    Records are as long as a sync needs, but a collective needs one size on every rank: the group's agreed record
    length (``words``), which every rank derives from the tables all ranks saw. Records are sent at that length;
    when a header (always within it) says that some rank needs more, every rank exchanges again at the longest
    length, which the group keeps; every ``RECORD_WINDOW`` syncs the length shrinks to the longest record of the
    window, but not below ``MIN_WORDS``.
    """

    ref: "weakref.ref[Any]"  # the process group, weakly: the registry's key must not be kept alive by its value
    rank: int
    size: int
    backend: str
    generation: str
    tag: str  # a name of the group equal on all its ranks
    nccl: bool = False  # NCCL serves some device type of the group: the current CUDA device is a fact of its policies
    syncs: int = 0  # syncs so far: numbers where a rank waits, in its store note
    words: int = INITIAL_WORDS
    longest: int = 0
    left: int = RECORD_WINDOW
    policies: dict[tuple[Any, ...], Policy] = field(default_factory=dict)
    group_seconds: dict[str, float] = field(default_factory=dict)
    limits: dict[tuple[Any, ...], Any] = field(default_factory=dict)  # the waits' limits (:mod:`.wait`)
    plans: "OrderedDict[tuple[Any, ...], Plan]" = field(default_factory=OrderedDict)
    learnt: "OrderedDict[Any, Any]" = field(
        default_factory=OrderedDict
    )  # the fast path's entries (:mod:`~torchmetrics_varlen._engine`)
    send_buffers: dict[torch.device, Tensor] = field(default_factory=dict)
    side: ProcessGroup | None = None  # the gloo group of the same ranks (the Join worker, compute_async), once made
    broken: BaseException | None = None  # a pending sync here failed, leaving a collective pending (:mod:`.deferred`)
    held: bool = False  # a join drives this (side) group: compute_async computes at once (:mod:`.deferred`)

    @property
    def pg(self) -> ProcessGroup:
        """The process group (alive while a sync runs on it: its caller holds it, or torch does)."""
        return self.ref()

    def count_sync(self) -> int:
        """Count a new sync of the group; the length to send its record at."""
        self.syncs += 1
        return self.words

    def learn_longest(self, needed: int) -> None:
        """Every rank saw that the longest record of this sync has ``needed`` words."""
        self.words = max(self.words, needed)
        self.longest = max(self.longest, needed)
        self.left -= 1
        if self.left == 0:
            self.words, self.longest, self.left = max(self.longest, MIN_WORDS), 0, RECORD_WINDOW

    def settle(self, before: tuple[int, int, int], words: int) -> None:
        """After a sync whose record carried names that travel once: size the next record of the same keys.

        ``before`` is ``(words, longest, left)`` before the sync; ``words`` the next record's length. Within the same
        window the room the names took is undone (the group goes back to what it agreed, or ``words`` if longer);
        when this sync closed the window, the window's choice stands, grown to ``words``. Every input comes from
        exchanged tables, so every rank decides alike.
        """
        if words > MAX_WORDS:
            return
        if self.left < before[2]:
            self.words, self.longest = max(before[0], words), max(before[1], words)
        else:
            self.words, self.longest = max(self.words, words), max(self.longest, words)

    def policy(self, device: torch.device | None, local: torch.device | None) -> Policy:
        """The policy of a sync for a metric on ``device`` (None: the hook), this rank's first tensor on ``local``.

        Kept per facts: every sync asks, and a policy depends on the facts only (the current CUDA device is a fact
        on NCCL only, where it picks the buffers' device).
        """
        key = (device, local, os.environ.get(REDUCE_ENV, ""), torch.cuda.current_device() if self.nccl else -1)
        found = self.policies.get(key)
        if found is None:
            cuda_available = ":" in self.backend and device is None and torch.cuda.is_available()
            facts = Facts(self.backend, device, local, None, -1, cuda_available, key[2])
            if is_nccl(self.backend, serving_type(facts)):
                facts = replace(facts, bound=bound_device(self.pg), current_cuda=torch.cuda.current_device())
            found = self.policies[key] = decide(facts)
        return found

    def send_buffer(self, nbytes: int, device: torch.device) -> Tensor:
        """A send buffer of ``nbytes``; on the CPU reused between syncs (fresh pages cost time).

        Safe because nothing refers to a send buffer once its collective completed (received data lives in buffers
        of its own); CUDA's caching allocator already reuses memory, so only CPU buffers are kept.
        """
        cached = self.send_buffers.get(device)
        if cached is not None and cached.numel() >= nbytes:
            return cached[:nbytes]
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if device.type == "cpu" and nbytes <= SEND_BUFFER_KEPT_BYTES:
            self.send_buffers[device] = buffer
        return buffer

    def keep_plan(self, key: tuple[Any, ...], plan: Plan) -> None:
        """Keep a plan for its table (the oldest goes past ``PLANS_KEPT``)."""
        self.plans[key] = plan
        if len(self.plans) > PLANS_KEPT:
            self.plans.popitem(last=False)


def backend_of(pg: ProcessGroup) -> str:
    """The backend name of ``pg``, lower case; a group made without a backend reports its device-to-backend map."""
    backend = str(dist.get_backend(pg)).lower()
    if backend == "undefined":
        backend = str(dist.get_backend_config(pg)).lower().replace(" ", "")
    return backend


def bound_device(pg: ProcessGroup) -> torch.device | None:
    """The device ``pg`` is bound to by ``init_process_group(device_id=...)`` (``new_group`` inherits it)."""
    bound = getattr(pg, "bound_device_id", None)
    return bound if isinstance(bound, torch.device) else None


def group_timeout(pg: ProcessGroup, device_type: str) -> float:
    """The timeout ``pg`` was created with, in seconds, for its backend that serves ``device_type``.

    ``init_process_group``/``new_group`` store it in the backend's options (``Backend.options._timeout``, private:
    covered by a test); where it cannot be read, torch's default for that backend.
    """
    try:
        value = pg._get_backend(torch.device(device_type)).options._timeout
        return float(value.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return fallback_timeout(backend_of(pg), device_type)


def fallback_timeout(backend: str, device_type: str) -> float:
    """The default timeout torch gives a group of ``backend`` (its entry for ``device_type``), in seconds.

    Example:
        >>> fallback_timeout("nccl", "cuda"), fallback_timeout("gloo", "cpu")
        (600.0, 1800.0)
        >>> fallback_timeout("cpu:gloo,cuda:nccl", "cuda"), fallback_timeout("cpu:gloo,cuda:nccl", "cpu")
        (600.0, 1800.0)
    """
    if is_nccl(backend, device_type):
        nccl: datetime.timedelta | None = getattr(dist.constants, "default_pg_nccl_timeout", None)
        return float((nccl or datetime.timedelta(minutes=10)).total_seconds())
    default: datetime.timedelta = dist.default_pg_timeout
    return float(default.total_seconds())


def _tag(pg: ProcessGroup) -> str:
    """A name of ``pg`` equal on all its ranks (groups are named in creation order)."""
    name = getattr(pg, "group_name", None)
    return str(name) if name else ",".join(map(str, dist.get_process_group_ranks(pg)))


class Registry:
    """The groups' states, weakly keyed by the process group object, and the world's generation.

    The one process-global table of the engine (its lock serves the Join worker's thread, which syncs on its side
    group while the main thread syncs on others). :meth:`reset` empties it (tests: as in a fresh process).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()
        self._world: weakref.ref[Any] | None = None
        self._worlds = 0  # worlds this process has seen: a re-initialised world is a new generation
        self._last: tuple[weakref.ref[Any], GroupState] | None = None
        self.flattened: dict[tuple[int, tuple[str, ...]], tuple[weakref.ref[Any], ProcessGroup]] = {}

    def state(self, group: ProcessGroup | None) -> GroupState | None:
        """The state of ``group`` (the world when None); None when nothing is to sync (no group, or one rank)."""
        world = dist.group.WORLD if _DISTRIBUTED else None  # None: not initialised
        if world is None:
            return None
        pg = group if group is not None else world
        last = self._last
        if last is not None and last[0]() is pg:  # the group asked last: every sync asks
            return last[1] if last[1].size > 1 else None
        with self._lock:
            found = self._states.get(pg)
            if found is None:
                found = self._states[pg] = self._make(pg, world)
            with contextlib.suppress(TypeError):  # held until the group goes: its state must not outlive it
                self._last = (weakref.ref(pg, self._forget_last), found)
        return found if found.size > 1 else None

    def _forget_last(self, gone: "weakref.ref[Any]") -> None:
        if self._last is not None and self._last[0] is gone:
            self._last = None

    def _make(self, pg: ProcessGroup, world: ProcessGroup) -> GroupState:
        if self._world is None or self._world() is not world:
            self._world, self._worlds = weakref.ref(world), self._worlds + 1
        generation = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{self._worlds}"
        backend = backend_of(pg)
        rank, size = dist.get_rank(pg), dist.get_world_size(pg)
        return GroupState(weakref.ref(pg), rank, size, backend, generation, _tag(pg), is_nccl(backend, "cuda"))

    def reset(self) -> None:
        """Forget every group's state (on every rank alike: the next sync of each group starts afresh)."""
        with self._lock:
            self._states = weakref.WeakKeyDictionary()
            self._last = None
            self.flattened.clear()


_DISTRIBUTED = dist.is_available()  # built with torch.distributed: fixed for the process
# Why a process-global: a group's state must outlive the metrics that sync on it (its agreed record length is the
# same on all its ranks only if every sync of the group updates it).
REGISTRY = Registry()


@dataclass(slots=True)
class Link:
    """Where and how a sync runs: the group's state, the policy, the timeout, and what error messages call it.

    Not to be changed once made (``dataclasses.replace`` makes another): not frozen only because a frozen class's
    constructor costs several times more, and every sync makes one.
    """

    state: GroupState
    policy: Policy
    timeout: float | None
    what: str

    @property
    def group(self) -> ProcessGroup:
        """The process group."""
        return self.state.pg

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.state.rank

    @property
    def size(self) -> int:
        """The group's world size."""
        return self.state.size


def needs_sync(group: ProcessGroup | None) -> bool:
    """Whether a sync over ``group`` (the world when None) has anything to do: a process group of two ranks or more."""
    return REGISTRY.state(group) is not None


def link(
    group: ProcessGroup | None,
    device: torch.device | None,
    timeout: float | None,
    what: str,
    local: torch.device | None = None,
) -> Link | None:
    """The link of a sync over ``group`` for a metric on ``device``; None when nothing is to sync."""
    state = REGISTRY.state(group)
    if state is None:
        return None
    return Link(state, state.policy(device, local), timeout, what)
