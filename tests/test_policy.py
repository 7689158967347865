"""The backend policy, forced on made-up backends and work objects: the logic NCCL would run, exercised without NCCL."""

import pytest
import torch

from torchmetrics_varlen import _policy
from torchmetrics_varlen._policy import PeerFailedError, buffer_device, wait_for


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
