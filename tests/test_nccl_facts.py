"""NCCL's implementations by every name torch gives them, and the hint for ranks that share one GPU, decided on gloo
from made-up facts."""

import pytest
import torch
import torch.distributed as dist
from _helpers import MadeUpGroup, group_state

from torchmetrics_varlen._engine import comm as _transport
from torchmetrics_varlen._engine import group as _policy
from torchmetrics_varlen._engine import wait as _waits
from torchmetrics_varlen._engine.group import Facts, decide

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
NAMES = ["nccl", "nccl2", "nccl-lazy", "nccl-legacy"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mixed", [False, True], ids=["alone", "cpu:gloo,cuda:..."])
def test_every_nccl_name_gets_the_nccl_policy(name, mixed):
    # torch >= 2.14 makes "nccl" the torchcomms-based ProcessGroupNCCL2 and names it "nccl2" too; "nccl-lazy" and
    # "nccl-legacy" are NCCL as well. No timed waits (one would abort the communicator), device buffers, the backward
    # wait on the stream, grouped broadcast rounds, NCCL's threshold, no point-to-point, NCCL's 10 minute fallback.
    backend = f"cpu:gloo,cuda:{name}" if mixed else name
    facts = Facts(backend, CPU if not mixed else CUDA1, current_cuda=1)
    got = decide(facts)
    reference = decide(Facts(backend.replace(name, "nccl"), facts.device, current_cuda=1))
    assert got.device == CUDA1
    assert (got.wait, got.grad_wait, got.grouped_broadcasts, got.point_to_point) == ("poll", "stream", True, False)
    assert got.broadcast_min == _policy.BROADCAST_MIN_BYTES["nccl"] == reference.broadcast_min
    assert _policy.wait_mode(backend, "cuda") == "poll"
    assert _policy.fallback_timeout(backend, "cuda") == 600.0
    if mixed:  # its CPU entry stays gloo's
        assert _policy.wait_mode(backend, "cpu") == "block"
        assert _policy.fallback_timeout(backend, "cpu") == 1800.0


def _state(backend, pg=None):
    """A group's state as the registry makes it (rank 1 of 2), for a made-up group and backend."""
    return group_state(pg, backend, rank=1)


@pytest.mark.parametrize("name", NAMES)
def test_the_group_policy_reads_the_bound_and_current_device_on_every_nccl_name(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _state(name, MadeUpGroup(bound=None)).policy(CPU, None).device == CUDA1


def test_a_timeout_on_nccl2_says_the_watchdog_ends_the_process():
    limits = _waits.limits_for(None, 600.0, "poll")
    message = _waits._timeout_message("sync of X", 590.0, "`sync_timeout`", None, _state("nccl2"), limits)
    assert "the watchdog may end this process" in message


@pytest.mark.parametrize(
    ("backend", "device", "bound", "local_rank", "gpus", "hinted"),
    [
        ("nccl", CUDA0, None, "3", 8, True),  # no device_id, no set_device: cuda:0 where LOCAL_RANK 3 means cuda:3
        ("nccl", CUDA0, None, "0", 8, False),  # local rank 0 belongs on cuda:0
        ("nccl", CUDA0, None, "3", 1, False),  # one visible GPU per process (CUDA_VISIBLE_DEVICES): cuda:0 is right
        ("nccl", CUDA0, None, "8", 8, False),  # LOCAL_RANK 8 of 8 GPUs maps to cuda:0
        ("nccl", CUDA0, CUDA0, "3", 8, False),  # a bound group: the user chose
        ("nccl", CUDA1, None, "3", 8, False),  # set_device was called (or the metric is on its own GPU)
        ("nccl", CUDA0, None, None, 8, False),  # no launcher's LOCAL_RANK: nothing to tell from
        ("nccl", CUDA0, None, "x", 8, False),
        ("nccl2", CUDA0, None, "2", 4, True),
        ("cpu:gloo,cuda:nccl", CUDA0, None, "1", 2, True),
        ("gloo", CPU, None, "3", 8, False),
    ],
)
def test_the_shared_gpu_hint_from_facts(backend, device, bound, local_rank, gpus, hinted):
    hint = _policy.shared_gpu_hint(backend, device, bound, local_rank, gpus)
    assert bool(hint) is hinted, hint
    if hinted:
        assert f"torch.cuda.set_device({int(local_rank) % gpus})" in hint and "device_id=" in hint


class _RefusedError(RuntimeError):
    pass


def _refuse(output, local, group=None, async_op=False):
    raise _RefusedError("NCCL error: invalid usage\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both on")


def _collective(monkeypatch, fn):
    """``fn`` as every all-gather ``comm.gather_equal`` may start (no process group, no GPU here)."""
    monkeypatch.setattr(dist, "all_gather_single", fn, raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", fn)


def test_the_hint_rides_on_nccls_own_error(monkeypatch):
    # What the user sees when NCCL refuses two ranks on one GPU at the first collective: NCCL's error, with the fix.
    _collective(monkeypatch, _refuse)
    monkeypatch.setattr(_transport, "bound_device", lambda group: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    output = torch.empty(0, dtype=torch.int64, device="meta")  # any tensor: only its device is read
    monkeypatch.setattr(_transport, "_shared_gpu_hint", _with_device(_transport._shared_gpu_hint, CUDA0))
    with pytest.raises(_RefusedError, match=r"(?s)Duplicate GPU.*torch\.cuda\.set_device\(1\)") as raised:
        _transport.gather_equal(output, output, None, "nccl")
    assert isinstance(raised.value.__cause__, _RefusedError)
    monkeypatch.setenv("LOCAL_RANK", "0")  # no fact points to it, NCCL's message does: the generic fix
    with pytest.raises(_RefusedError, match=r"set_device\(local_rank\)"):
        _transport.gather_equal(output, output, None, "nccl")


def test_other_errors_pass_unchanged(monkeypatch):
    def fail(output, local, group=None, async_op=False):
        raise _RefusedError("something else")

    _collective(monkeypatch, fail)
    with pytest.raises(_RefusedError, match=r"^something else$"):
        _transport.gather_equal(torch.empty(0), torch.empty(0), None, "gloo")
    # Nor on a CUDA device whose group no fact points to: NCCL's refusal alone carries the fix.
    monkeypatch.setattr(_transport, "_shared_gpu_hint", _with_device(_transport._shared_gpu_hint, CUDA0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(_RefusedError, match=r"^something else$"):
        _transport.gather_equal(torch.empty(0), torch.empty(0), None, "gloo")


def _with_device(fn, device):
    """``fn`` told that the buffers are on ``device`` (no GPU here to put a tensor on)."""
    return lambda group, backend, _device, error: fn(group, backend, device, error)


def test_nccls_refusal_from_a_work_names_the_fix_too():
    # Where NCCL's refusal comes from the work instead (a communicator created without blocking), SyncPeerError.
    state = _state("nccl")
    message = _waits._peer_message("sync of X", state, "NCCL error: invalid usage\nDuplicate GPU detected : rank 1")
    assert "torch.cuda.set_device(local_rank)" in message and "device_id=" in message
    assert "set_device" not in _waits._peer_message("sync of X", state, "Connection closed by peer")
