"""The backend policy, forced on made-up backends and work objects: the logic NCCL would run, exercised without NCCL."""

import pytest
import torch

from torchmetrics_varlen import _policy, _transport
from torchmetrics_varlen._policy import PeerFailedError, buffer_device, wait_for, wait_mode


@pytest.mark.parametrize(
    ("backend", "like", "expected"),
    [
        ("nccl", torch.device("cpu"), torch.device("cuda", 3)),  # CPU states (compute_on_cpu) go to the GPU
        ("nccl", torch.device("cuda", 1), torch.device("cuda", 1)),  # CUDA states stay on their device
        ("gloo", torch.device("cuda", 0), torch.device("cpu")),  # CUDA states over gloo move through the host
        ("gloo", torch.device("cpu"), torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", torch.device("cpu"), torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 2), torch.device("cuda", 2)),
        ("mpi", torch.device("cpu"), torch.device("cpu")),  # any other backend: the states' own device
    ],
)
def test_buffer_device(backend, like, expected):
    assert buffer_device(backend, like, current_cuda=lambda: 3) == expected


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


def test_forced_policy_is_scoped_to_the_block():
    with _policy.forced(backend="nccl", reduce="always") as policy:
        assert _policy.policy_for(None, torch.device("cpu")) is policy
    assert getattr(_policy._FORCED, "policy", None) is None


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
    limits = _transport.limits_for(None, 600.0, wait)
    assert limits.from_group and limits.ours == limits.bound == 590.0
    assert _transport.limits_for(None, 4.0, wait).ours == 3.5  # a short group keeps at least half a second


@pytest.mark.parametrize("wait", ["block", "poll"])
def test_a_sync_timeout_longer_than_the_group_timeout_is_capped(wait):
    assert _transport.limits_for(900.0, 600.0, wait).ours == 590.0
    shorter = _transport.limits_for(3.0, 600.0, wait)
    assert shorter.ours == 3.0 and not shorter.from_group and shorter.bound == 590.0  # busy peers: up to the bound


def test_no_timer_of_ours_is_bounded_by_the_group_where_we_poll():
    # sync_timeout=0: gloo's own timed wait ends it; polling (NCCL, also with TORCH_NCCL_BLOCKING_WAIT=1, where no
    # watchdog ends the process) would never end without the group's timeout as the bound.
    assert _transport.limits_for(0.0, 600.0, "block").ours is None
    assert _transport.limits_for(0.0, 600.0, "poll").ours == 600.0
