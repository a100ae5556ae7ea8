"""fp16 and the NaN guard (hftk.engine.resilience), in one process: an overflow the AMP loss scaler skips is not a
non-finite step (a real ``torch.amp.GradScaler`` on CPU, the guard's decision function and the
Trainer callback itself), a collapsed scale is; SIGUSR1 is a preemption signal."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from hftk.engine.resilience import (EXIT_NONFINITE, MIN_LOSS_SCALE, StepGuard, active_scaler, counts_as_nonfinite,
                                    nonfinite_gradients)


def _overflowed(param: torch.nn.Parameter) -> None:
    """A backward whose gradient overflowed fp16 range: the scaled loss made it Inf."""
    param.grad = torch.full_like(param, float("inf"))


def _scaled_backward(scaler: torch.amp.GradScaler, param: torch.nn.Parameter) -> None:
    """A real scaled backward that overflows: 1e38 * the loss scale is past fp32's range too."""
    scaler.scale((param * 1e38).sum()).backward()


def test_an_overflow_under_the_loss_scaler_is_the_scalers_business():
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    _scaled_backward(scaler, param)
    scaler.unscale_(optimizer)  # as the Trainer's clipping does before on_pre_optimizer_step
    assert nonfinite_gradients([param])
    assert not counts_as_nonfinite(True, scaler)
    scaler.step(optimizer)  # skipped by the scaler: the weights stay
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(4)) and scaler.get_scale() == 2.0**15


def test_an_overflow_counts_once_the_scale_collapsed_or_without_a_scaler():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    _scaled_backward(scaler, torch.nn.Parameter(torch.ones(4)))
    scaler.update(new_scale=MIN_LOSS_SCALE / 2)  # 17+ halvings: even a down-scaled loss overflows
    assert counts_as_nonfinite(True, scaler)
    assert not counts_as_nonfinite(False, scaler)
    assert counts_as_nonfinite(True, None)
    assert active_scaler(SimpleNamespace(scaler=torch.amp.GradScaler("cpu", enabled=False))) is None
    assert active_scaler(SimpleNamespace(scaler=None)) is None


def _guard(scaler, nan_policy="stop"):
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        _overflowed(p)
    trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(scaler=scaler), is_deepspeed_enabled=False)
    guard = StepGuard(trainer, nan_policy)
    guard.on_pre_optimizer_step(SimpleNamespace(device=torch.device("cpu")), None, None)
    return guard, model


def test_step_guard_lets_the_scaler_skip_an_fp16_overflow():
    guard, model = _guard(torch.amp.GradScaler("cpu", init_scale=2.0**16))
    assert guard.exit_code is None and not guard._nonfinite_now
    assert all(p.grad is not None for p in model.parameters())  # the scaler's step needs them


def test_step_guard_stops_on_a_nonfinite_step_without_a_scaler():
    guard, model = _guard(None)
    assert guard.exit_code == EXIT_NONFINITE
    assert all(p.grad is None for p in model.parameters())  # the update is dropped


@pytest.mark.slow  # as in the multi-process file it came from
def test_sigusr1_is_a_preemption_signal_too():
    """SLURM's --signal=USR1@N warns this way: the handler records it instead of the process dying."""
    from hftk.engine.resilience import PreemptionSignal

    preemption = PreemptionSignal()
    preemption.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.received == signal.SIGUSR1
    finally:
        preemption.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_repeated_signal_inside_the_grace_period_is_the_same_preemption(monkeypatch):
    """scancel signals every process of the job step and torchrun forwards its own SIGTERM: a worker gets
    two at once and must save as for one; a repeat after the grace period is a scheduler insisting."""
    from hftk.engine import resilience

    clock = [100.0]
    killed: list[int] = []
    monkeypatch.setattr(resilience.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(resilience.os, "kill", lambda pid, signum: killed.append(signum))
    preemption = resilience.PreemptionSignal()
    preemption.install()
    try:
        preemption._handle(signal.SIGTERM, None)
        clock[0] += resilience.REPEAT_GRACE_S - 1
        preemption._handle(signal.SIGTERM, None)
        assert preemption.received == signal.SIGTERM and not killed and preemption.installed
        clock[0] += 2
        preemption._handle(signal.SIGTERM, None)
        assert killed == [signal.SIGTERM] and not preemption.installed  # the default action, re-raised
    finally:
        preemption.uninstall()


def test_a_rank_leaving_with_its_stop_code_ignores_the_launchers_sigterm():
    """Once a rank has saved and leaves with 75, torchrun's SIGTERM to the ranks still running (sent when one
    exits) must not kill it by signal while it tears down: ignored, and still ignored after the watch ends."""
    import os
    import signal

    from hftk.engine.resilience import PREEMPTION_SIGNALS, PreemptionSignal

    before = {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS}
    try:
        watch = PreemptionSignal()
        with watch.watching():
            watch.leave()
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in PREEMPTION_SIGNALS)
        os.kill(os.getpid(), signal.SIGTERM)  # would end this test process were it not ignored
    finally:  # every one restored: an ignored signal is inherited by every process this worker starts later
        for sig, handler in before.items():
            signal.signal(sig, handler)
