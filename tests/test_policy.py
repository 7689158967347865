"""The backend policy, forced on made-up backends and work objects: the logic NCCL would run, exercised without NCCL."""

import pytest
import torch
from _helpers import MadeUpGroup, forced_policy, group_state
from conftest import run_distributed

from torchmetrics_varlen._engine import group as _policy
from torchmetrics_varlen._engine import wait as _waits
from torchmetrics_varlen._engine.group import Facts, buffer_device, decide, wait_mode
from torchmetrics_varlen._engine.wait import PeerFailedError, wait_for

CPU, CUDA0, CUDA1, CUDA2 = (torch.device("cpu"), *(torch.device("cuda", i) for i in range(3)))
TWO = "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (Facts("nccl", CPU, current_cuda=3), torch.device("cuda", 3)),  # CPU states (compute_on_cpu) go to the GPU
        (Facts("nccl", CUDA1, current_cuda=0), CUDA1),  # CUDA states stay on the metric's device
        # init_process_group(device_id=...) without set_device: the current device is 0 on every local rank, the
        # bound device is right (issue 20, item 3); it wins over the metric's device too
        (Facts("nccl", CPU, bound=CUDA2, current_cuda=0), CUDA2),
        (Facts("nccl", CUDA1, bound=CUDA2, current_cuda=0), CUDA2),
        (Facts("nccl", None, local=CUDA1, current_cuda=0), CUDA1),  # the hook: the tensor's CUDA device
        (Facts("nccl", None, local=CPU, current_cuda=2), CUDA2),
        (Facts("gloo", CUDA0), CPU),  # CUDA states over gloo move through the host
        (Facts("gloo", CPU), CPU),
        (Facts(TWO, CPU, local=CUDA0), CPU),  # the metric's device type picks the backend, not the local tensor
        (Facts(TWO, CUDA2, current_cuda=0), CUDA2),  # an empty rank (no local tensor) picks what its peers pick
        (Facts(TWO, CUDA2, local=CPU, current_cuda=0), CUDA2),  # compute_on_cpu list states on a CUDA metric
        (Facts(TWO, None, local=CPU, cuda_available=True, current_cuda=1), CUDA1),  # the hook: the accelerator's
        (Facts(TWO, None, local=CUDA0, cuda_available=False), CPU),
        (Facts("cuda:nccl", CPU, current_cuda=1), CUDA1),  # init_process_group() on a GPU machine: NCCL only
        (Facts("mpi", CPU), CPU),  # any other backend: the metric's device
        (Facts("xccl", torch.device("xpu", 1)), torch.device("xpu", 1)),
        (Facts("xccl", None, local=torch.device("xpu", 1)), torch.device("xpu", 1)),
    ],
)
def test_buffer_device(facts, expected):
    assert buffer_device(facts) == expected


@pytest.mark.parametrize("backend", ["nccl", "gloo", TWO, "cuda:nccl", "cpu:gloo", "mpi"])
@pytest.mark.parametrize("metric", [CPU, CUDA1, None])
@pytest.mark.parametrize("cuda_available", [True, False])
def test_local_data_never_picks_the_backend(backend, metric, cuda_available):
    # An empty rank (no local tensor), a rank with CPU states and one with CUDA states decide alike: the same backend
    # (the same kind of buffer device, the same way of waiting), so they meet in one communicator.
    decided = {
        local: decide(Facts(backend, metric, local, current_cuda=0, cuda_available=cuda_available))
        for local in (None, CPU, CUDA0)
    }
    if metric is None and ":" not in backend:
        decided.pop(None)  # the hook on a one-backend group always has its tensor (it picks a device of the kind)
    serving = {(_policy.serving_backend(backend, p.device.type), p.wait, p.grad_wait) for p in decided.values()}
    assert len(serving) == 1, decided


@pytest.mark.parametrize(
    ("facts", "grad_device", "grad_wait"),
    [
        # Under DDP on NCCL the backward all-reduce must run on the CUDA device's autograd thread, where DDP's hooks
        # run: the differentiable outputs live on the buffer device, also for CPU states (issue 20, item 4).
        (Facts("nccl", CPU, current_cuda=1), CUDA1, "stream"),
        (Facts("nccl", CUDA0, current_cuda=0), CUDA0, "stream"),
        (Facts(TWO, CUDA2, local=CPU, current_cuda=0), CUDA2, "stream"),
        (Facts("gloo", CUDA1), CUDA1, "block"),  # buffers on the CPU, outputs where the metric is
        (Facts("gloo", CPU), CPU, "block"),
        (Facts(TWO, CPU), CPU, "block"),
        (Facts("mpi", CPU), CPU, "poll"),
    ],
)
def test_differentiable_outputs_and_backward_wait(facts, grad_device, grad_wait):
    policy = decide(facts)
    assert (policy.grad_device, policy.grad_wait) == (grad_device, grad_wait)


def _state(pg, backend, rank=0):
    """A group's state as the registry makes it, for a made-up group and backend (no process group needed)."""
    return group_state(pg, backend, rank)


def test_the_group_policy_reads_the_bound_device_of_the_group(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # no set_device: 0 on every local rank
    assert _state(MadeUpGroup(CUDA2), "nccl").policy(CPU, None).device == CUDA2
    assert _state(MadeUpGroup(CUDA1), "nccl").policy(CUDA0, CUDA0).device == CUDA1
    assert _state(MadeUpGroup(None), "nccl").policy(CPU, None).device == CUDA0
    assert _state(MadeUpGroup(CUDA2), "gloo").policy(CPU, None).device == CPU  # gloo has no use for it


def test_a_group_without_a_backend_is_served_by_its_device_map():
    import torch.distributed as dist

    if dist.is_initialized():  # the distributed tests run in worker processes; this one needs a process of its own
        pytest.skip("a process group is already initialised in the test process")
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)  # no backend: "undefined", lazily made
    try:
        assert str(dist.get_backend()) == "undefined"
        expected = "cuda:nccl" if torch.cuda.is_available() else "cpu:gloo"
        assert _policy.backend_of(dist.group.WORLD) == expected
        assert _policy.bound_device(dist.group.WORLD) is None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("backend", "device_type", "expected"),
    [
        ("gloo", "cpu", "block"),  # c10d's base Work: a timed wait is a condition-variable wait, nothing else
        ("nccl", "cuda", "poll"),  # a timed wait would abort the communicator on expiry
        ("cpu:gloo,cuda:nccl", "cpu", "block"),
        ("cpu:gloo,cuda:nccl", "cuda", "poll"),
        ("mpi", "cpu", "poll"),  # unknown timed-wait semantics: poll
    ],
)
def test_wait_mode(backend, device_type, expected):
    assert wait_mode(backend, device_type) == expected


class FakeWork:
    """A work object that completes after ``polls`` polls, or never, or with an error; records how it was waited."""

    def __init__(self, polls=None, error=None):
        self.polls, self.error, self.wait_calls, self.checks = polls, error, [], 0

    def is_completed(self):
        self.checks += 1
        return self.polls is not None and self.checks > self.polls

    def wait(self, *args, **kwargs):
        self.wait_calls.append((args, kwargs))
        if self.error is not None:
            raise self.error
        return True


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert seconds >= 0
        self.now += seconds


def test_wait_polls_and_never_passes_a_timeout_to_wait():
    clock, work = FakeClock(), FakeWork(polls=3)
    assert wait_for(work, timeout=5.0, clock=clock, sleep=clock.sleep)
    assert work.wait_calls == [((), {})]  # a timed wait would abort an NCCL communicator
    assert clock.now == 0.0  # a quick collective completes within the first checks, before any sleep


def test_wait_gives_up_after_the_timeout_and_leaves_the_work_alone():
    clock, work, slow = FakeClock(), FakeWork(polls=None), []
    assert not wait_for(work, 2.0, lambda: slow.append(clock.now), 1.0, clock=clock, sleep=clock.sleep)
    assert work.wait_calls == []  # nothing waits on, or aborts, the pending collective
    assert len(slow) == 1 and 1.0 <= slow[0] < 2.0  # the "where I wait" note is written once, before the timeout
    assert 2.0 <= clock.now < 2.0 + 0.01  # the poll interval never overshoots the deadline by more than its cap


def test_wait_without_timeout_polls_until_done():
    clock, work = FakeClock(), FakeWork(polls=50)
    assert wait_for(work, None, clock=clock, sleep=clock.sleep)
    assert work.wait_calls == [((), {})]


def test_failed_work_is_a_peer_failure_with_the_backend_error():
    clock = FakeClock()
    backend_error = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(PeerFailedError, match="Connection closed by peer") as info:
        wait_for(FakeWork(polls=0, error=backend_error), 5.0, clock=clock, sleep=clock.sleep)
    assert info.value.__cause__ is backend_error


def test_stream_wait_neither_polls_nor_times_out():
    # Inside backward on NCCL: one untimed wait(), which orders the current stream after the collective and returns;
    # polling would block autograd's device thread (and DDP's overlap) on the CPU.
    clock, work = FakeClock(), FakeWork(polls=None)  # never completes as far as is_completed() tells
    assert wait_for(work, timeout=5.0, clock=clock, sleep=clock.sleep, mode="stream")
    assert work.wait_calls == [((), {})] and work.checks == 0 and clock.now == 0.0
    backend_error = RuntimeError("NCCL communicator was aborted")
    with pytest.raises(PeerFailedError, match="aborted"):
        wait_for(FakeWork(polls=None, error=backend_error), 5.0, mode="stream")


class FakeBlockingWork:
    """A gloo-like work: a timed ``wait`` sleeps on the clock and raises "Operation timed out!" unless done by then."""

    def __init__(self, clock, done_at=None, error=None):
        self.clock, self.done_at, self.error, self.timeouts = clock, done_at, error, []

    def is_completed(self):
        return self.done_at is not None and self.clock.now >= self.done_at

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        if timeout is not None:
            assert timeout.total_seconds() >= 1e-3  # c10d reads a zero timeout as "wait forever"
            if self.done_at is None or self.done_at > self.clock.now + timeout.total_seconds():
                self.clock.sleep(timeout.total_seconds())
                raise RuntimeError("Operation timed out!")
        assert self.done_at is not None, "an untimed wait on a work that never completes would hang"
        self.clock.now = max(self.clock.now, self.done_at)
        if self.error is not None:
            raise self.error
        return True


def test_blocking_wait_returns_when_done_and_notes_a_slow_wait_once():
    clock, slow = FakeClock(), []
    work = FakeBlockingWork(clock, done_at=3.5)
    assert wait_for(work, 10.0, lambda: slow.append(clock.now), 1.0, clock=clock, mode="block")
    assert slow == [1.0] and clock.now == 3.5
    assert [t.total_seconds() for t in work.timeouts] == [1.0, 9.0]  # up to the note, then up to the deadline


def test_blocking_wait_expires_and_leaves_the_work_pending():
    clock = FakeClock()
    work = FakeBlockingWork(clock, done_at=None)
    assert not wait_for(work, 2.0, None, clock=clock, mode="block")
    assert clock.now == 2.0 and not work.is_completed()


def test_blocking_wait_without_timeout_waits_once_untimed():
    clock = FakeClock()
    work = FakeBlockingWork(clock, done_at=7.0)
    assert wait_for(work, None, clock=clock, mode="block")
    assert work.timeouts == [None]


def test_blocking_wait_reports_a_failed_work_as_a_peer_failure():
    clock = FakeClock()
    backend_error = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    work = FakeBlockingWork(clock, done_at=0.5, error=backend_error)
    with pytest.raises(PeerFailedError, match="Connection closed by peer") as info:
        wait_for(work, 5.0, clock=clock, mode="block")
    assert info.value.__cause__ is backend_error


class CompletesAsItTimesOut(FakeBlockingWork):
    def wait(self, timeout=None):
        if self.done_at is None:  # the slice expires, and the collective completes while the error unwinds
            self.done_at = self.clock.now
            raise RuntimeError("Operation timed out!")
        return super().wait(timeout)


def test_blocking_wait_tells_an_expired_slice_from_a_failure():
    clock = FakeClock()
    assert wait_for(CompletesAsItTimesOut(clock), 5.0, clock=clock, mode="block")


def test_the_group_policy_is_decided_once_per_facts(monkeypatch):
    # Every sync asks for its policy: GroupState.policy decides once per set of facts, and asks `decide` at call time
    # (so a test's forced policy reaches it once the cache is cleared).
    state, asked = _state(MadeUpGroup(None), "gloo"), []
    monkeypatch.setattr(_policy, "decide", lambda facts: asked.append(facts) or decide(facts))
    first = state.policy(CPU, None)
    assert state.policy(CPU, None) is first and state.policy(CPU, CPU) == first and len(asked) == 2
    assert first == decide(Facts("gloo", CPU))
    monkeypatch.setenv(_policy.REDUCE_ENV, "never")  # a fact of its own: decided again
    assert state.policy(CPU, None).reduce == "never" and len(asked) == 3


def body_forced_policy(rank, world_size):
    from torchmetrics_varlen._engine.group import REGISTRY

    state = REGISTRY.state(None)
    before = state.policy(CPU, None)
    with forced_policy(grouped_broadcasts=True, reduce="always") as policy:
        inside = state.policy(CPU, None)
    after = state.policy(CPU, None)
    return before, policy, inside, after


def test_the_forced_policy_fixture_is_scoped_to_the_block():
    # The package has no forced-policy switch any more (tests/_helpers.forced_policy replaces `decide`): inside the
    # block every sync of the group runs under the forced fields, after it under the decided policy again.
    for before, policy, inside, after in run_distributed(body_forced_policy, 2):
        assert (before.grouped_broadcasts, before.reduce) == (False, "auto")
        assert inside is policy and (inside.grouped_broadcasts, inside.reduce) == (True, "always")
        assert inside.backend == before.backend and inside.device == before.device  # the other fields: decided
        assert after == before


def test_reduce_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv(_policy.REDUCE_ENV, "never")
    assert _policy.reduce_mode() == "never"
    monkeypatch.setenv(_policy.REDUCE_ENV, "sometimes")
    with pytest.raises(ValueError, match="Expected `TORCHMETRICS_VARLEN_REDUCE` to be one of"):
        _policy.reduce_mode()


# ---------------------------------------------------------------------- our timeout against the group's (issue 20)
@pytest.mark.parametrize("wait", ["block", "poll"])
def test_the_default_timeout_is_the_group_timeout_less_a_margin(wait):
    # NCCL's default group timeout is 10 minutes: our error must come before its watchdog ends the process.
    limits = _waits.limits_for(None, 600.0, wait)
    assert limits.from_group and limits.ours == 590.0 and limits.group_s == 600.0
    assert _waits.limits_for(None, 4.0, wait).ours == 3.5  # a short group keeps at least half a second


@pytest.mark.parametrize("wait", ["block", "poll"])
def test_a_sync_timeout_longer_than_the_group_timeout_is_capped(wait):
    assert _waits.limits_for(900.0, 600.0, wait).ours == 590.0
    shorter = _waits.limits_for(3.0, 600.0, wait)
    # (The old `bound` field, how long busy peers could extend a wait, went with the busy notes.)
    assert shorter.ours == 3.0 and not shorter.from_group and shorter.group_s == 600.0


def test_no_timer_of_ours_is_bounded_by_the_group_where_we_poll():
    # sync_timeout=0: gloo's own timed wait ends it; polling (NCCL, also with TORCH_NCCL_BLOCKING_WAIT=1, where no
    # watchdog ends the process) would never end without the group's timeout as the bound.
    assert _waits.limits_for(0.0, 600.0, "block").ours is None
    assert _waits.limits_for(0.0, 600.0, "poll").ours == 600.0


@pytest.mark.parametrize(
    ("backend", "device", "grouped"),
    [
        ("nccl", CUDA1, True),
        ("cpu:gloo,cuda:nccl", CUDA1, True),
        ("gloo", CPU, False),
        ("cpu:gloo,cuda:nccl", CPU, False),
    ],
)
def test_broadcast_rounds_are_grouped_on_nccl_only(backend, device, grouped):
    # NCCL runs a list all_gather of unequal sizes as one group of broadcasts; gloo's takes equal sizes only.
    assert decide(Facts(backend, device, current_cuda=0)).grouped_broadcasts is grouped


def test_a_timeout_on_nccl_says_the_watchdog_ends_the_process(monkeypatch):
    # Issue 34 item 10: on NCCL the watchdog tears the process down at the group's timeout, just after our error.
    limits = _waits.limits_for(None, 600.0, "poll")
    for backend, said in (("nccl", True), ("cpu:gloo,cuda:nccl", True), ("gloo", False)):
        state = _state(None, backend, rank=1)
        message = _waits._timeout_message("sync of X", 590.0, "`sync_timeout`", None, state, limits)
        named = "the watchdog may end this process when the group's timeout (600 s) expires" in message
        assert named is said, message
        assert message.startswith("sync of X: rank 1 waited 590 s (`sync_timeout`)"), message
