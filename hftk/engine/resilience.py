"""Preemption and non-finite losses, decided by all ranks together at each optimizer step.

One tiny all-reduce per optimizer step carries two flags: "a preemption signal (SIGTERM or
SIGUSR1) reached some rank" and "some rank saw a non-finite gradient". Every rank takes the
same decision at the same step; a rank reacting alone would wait forever in the collectives
of a save the others never start.

- Preemption: the step in flight finishes, every rank saves an emergency checkpoint (atomic,
  see :mod:`hftk.checkpoint.atomic`) and the process exits with :data:`EXIT_PREEMPTED`. An evaluation
  that was due after that step is skipped: the grace period (torchrun's ``--shutdown_timeout``,
  30 s; a scheduler's kill wait) belongs to the save. A signal that arrives during an
  evaluation stops it at the next eval batch: every rank agrees on the flag once per batch
  (:func:`check_evaluation`) and raises :class:`EvaluationInterrupted` at the same batch, then
  the engine saves and exits the same way. A repeat within :data:`REPEAT_GRACE_S` is the same
  preemption told twice (``scancel`` signals every process of the job step, then torchrun forwards its
  own SIGTERM to the workers): it is absorbed. A repeat after that gets the default action (the
  scheduler insists).
- Non-finite gradient (a NaN/Inf loss on any rank): the update is dropped (no parameter or
  optimizer-state change; the step counter and learning-rate schedule still advance). With
  ``resilience.nan_policy=stop`` the run then saves that state and exits with
  :data:`EXIT_NONFINITE`. DeepSpeed skips non-finite updates itself (its overflow check);
  hftk reads ``engine.was_step_applied()`` there.
- fp16 with torch's loss scaler (``GradScaler``): an overflow is the scaler's business, not a
  NaN. It skips that step and halves the scale by design; see :func:`counts_as_nonfinite`.

Exit codes are the process's own; torchrun lists them per rank in its failure report and
exits 1. Under ``--max_restarts`` the agent restarts the group, which resumes from the
emergency checkpoint (see :func:`hftk.checkpoint.atomic.resolve_resume`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
from transformers import TrainerCallback

EXIT_PREEMPTED = 75  # os.EX_TEMPFAIL: the run saved itself and wants to be resumed
EXIT_NONFINITE = 65  # os.EX_DATAERR: nan_policy=stop met a NaN/Inf loss
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# torchrun's --shutdown_timeout default: the launcher SIGKILLs this long after forwarding a signal, so a
# repeat inside it is a copy of the first (scancel + torchrun), never a second, more urgent request.
REPEAT_GRACE_S = 30.0

logger = logging.getLogger(__name__)
T = TypeVar("T")


def check_restartable(env: dict[str, str]) -> None:
    """Refuse ``--max_restarts`` where torch elastic cannot bring the group back.

    With the static rendezvous (torchrun's and accelerate's default) and with c10d sharing its
    store (torch's default), every round's workers use the same store without a per-round
    prefix: restarted ranks read the dead round's gloo / NCCL addresses and hang or fail
    (measured here; pytorch/pytorch#135712). Only c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    gives each round a fresh store, which the workers see as TORCHELASTIC_USE_AGENT_STORE=False.
    """
    from hftk.core.errors import HftkError

    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise HftkError(
            "launch", "--max_restarts with a store shared across rounds: restarted ranks would read the dead "
            "round's addresses from it and hang.",
            "launch with the c10d rendezvous and a fresh store per round: `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "accelerate launch --rdzv_backend c10d --max_restarts K ...` or `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "torchrun --standalone --max-restarts K ...`.")


class PreemptionSignal:
    """Remembers that SIGTERM / SIGUSR1 arrived instead of dying; the training loop decides when to act."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}
        self._leaving = False

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        if self.installed:
            return
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    @contextlib.contextmanager
    def watching(self) -> Iterator[PreemptionSignal]:
        """Installed for the body (training and the evaluations after it), uninstalled after."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            if not self._leaving:
                signal.signal(sig, previous)
        self._previous.clear()

    def leave(self) -> None:
        """The run saved itself and leaves with its stop code: from here on preemption signals are ignored, so the
        SIGTERM a launcher sends the ranks still running once one has exited (torchrun does) cannot turn this
        rank's exit 75 into a death by signal while it tears down."""
        self._leaving = True
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received, self._received_at = signum, time.monotonic()
        elif time.monotonic() - self._received_at > REPEAT_GRACE_S:
            self.uninstall()
            os.kill(os.getpid(), signum)


def agree(flags: list[bool], device: Any) -> list[bool]:
    """Element-wise OR of ``flags`` over every rank (one small all-reduce; identity without a group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return list(flags)
    tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


class EvaluationInterrupted(Exception):
    """A preemption signal reached some rank during an evaluation; every rank raises it at the same batch.

    Not a ``RuntimeError``: the Trainer's ``_evaluate`` inspects those for out-of-memory errors.
    """


def check_evaluation(preemption: PreemptionSignal, device: Any) -> None:
    """Once per eval batch on every rank: raise :class:`EvaluationInterrupted` everywhere when any rank
    has seen a preemption signal (one small all-reduce, so no rank is left waiting in a collective)."""
    if agree([preemption.received is not None], device)[0]:
        raise EvaluationInterrupted(signal_name(preemption))


def signal_name(preemption: PreemptionSignal) -> str:
    """How a stop message names the signal: this rank's, or another rank's that the agreement carried."""
    return signal.Signals(preemption.received).name if preemption.received else "a signal on another rank"


def nonfinite_gradients(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """Whether any local gradient (a DTensor's local shard) holds a NaN or Inf.

    The max-abs norm never overflows a finite gradient, unlike the 2-norm in half precision; but
    on CPU it costs ~15x the 2-norm (10 ms per step for a 3.7M-parameter model: 2-3 % of the step).
    So the 2-norm, finite for every finite gradient that does not overflow it, answers first, and
    the max-abs norm is asked only when the 2-norm is not finite.
    """
    by_device: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for param in parameters:
        grad = param.grad
        if grad is not None:
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            by_device[grad.device].append(grad)
    return any(not _norms_finite(grads, 2.0) and not _norms_finite(grads, float("inf"))
               for grads in by_device.values())


def _norms_finite(grads: list[torch.Tensor], order: float) -> bool:
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads, order))).all())


# Below this loss scale an overflow is no longer fp16's range: GradScaler starts at 2**16 and halves
# on every overflow, so a scale under 1 means 17+ net halvings, i.e. gradients that overflow even with
# the loss scaled *down* -- a NaN/Inf loss the scaler would otherwise skip forever in silence.
MIN_LOSS_SCALE = 1.0


def active_scaler(accelerator: Any) -> Any:
    """The enabled AMP ``GradScaler`` of an Accelerate run (fp16), or None."""
    scaler = getattr(accelerator, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def counts_as_nonfinite(grads_nonfinite: bool, scaler: Any) -> bool:
    """Whether a non-finite gradient is a non-finite *step* for ``nan_policy``.

    Without a loss scaler it always is. With one, an overflow is expected: the scaler finds it,
    skips ``optimizer.step`` and lowers its scale, so hftk neither drops the gradients (the
    scaler's ``step`` needs them to record its inf check) nor stops the run. Only once the scale has
    collapsed below :data:`MIN_LOSS_SCALE` does an overflow count.
    """
    if scaler is None:
        return grads_nonfinite
    return grads_nonfinite and scaler.get_scale() < MIN_LOSS_SCALE


def decide_step(preemption: PreemptionSignal, local_nonfinite: bool, nan_policy: str, device: Any
                ) -> tuple[bool, tuple[int, str] | None]:
    """Every engine's rule before an optimizer step, agreed by all ranks in one all-reduce: whether any
    rank's gradients are non-finite (the update is dropped), and the stop it calls for, if any
    (``nan_policy=stop`` -> exit 65, a preemption signal on any rank -> exit 75; the first wins)."""
    preempted, nonfinite = agree([preemption.received is not None, local_nonfinite], device)
    if nonfinite and nan_policy == "stop":
        return nonfinite, (EXIT_NONFINITE, "a NaN/Inf loss (resilience.nan_policy=stop)")
    return nonfinite, (EXIT_PREEMPTED, f"preempted ({signal_name(preemption)})") if preempted else None


def stop_line(step: int, reason: str, saved: Any, code: int) -> str:
    """What every engine prints (rank 0) when it stops a run early after saving."""
    return (f"hftk: stopped at step {step}: {reason}; saved {saved}; continue with --resume_from_checkpoint latest "
            f"(exit {code})")


class StepGuard(TrainerCallback):
    """The Trainer side: agree on the flags before each optimizer step, act at the step's end."""

    def __init__(self, trainer: Any, nan_policy: str) -> None:
        self.trainer = trainer
        self.nan_policy = nan_policy
        self.signal = PreemptionSignal()
        self.exit_code: int | None = None
        self.reason = ""
        self.nonfinite_steps: list[int] = []
        self._nonfinite_now = False
        self._owns_signal = False  # installed by on_train_begin, not by an engine's ``signal.watching()``

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._owns_signal = not self.signal.installed
        self.signal.install()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._owns_signal:
            self.signal.uninstall()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        scaler = active_scaler(self.trainer.accelerator)
        nonfinite, stop = decide_step(self.signal, self._local_nonfinite(scaler), self.nan_policy, args.device)
        self._nonfinite_now = nonfinite
        if nonfinite and scaler is None:  # a scaler skips the step itself (and needs the gradients to see why)
            for param in self.trainer.model.parameters():
                param.grad = None  # torch optimizers skip parameters without a gradient
        if stop is not None and self.exit_code is None:
            self.exit_code, self.reason = stop

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._nonfinite_now:
            self.nonfinite_steps.append(state.global_step)
            if state.is_world_process_zero:
                logger.warning("step %d: non-finite gradient on some rank; the update was skipped", state.global_step)
            self.trainer.log({"nonfinite_steps_skipped": float(len(self.nonfinite_steps))})
        if self.exit_code is not None:
            control.should_save = True
            control.should_training_stop = True
            control.should_evaluate = False  # the grace period is for the save

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.exit_code is not None:
            control.should_evaluate = False  # an epoch-end evaluation would run before the save, too

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After each eval batch: the Trainer's evaluation loop has no stop flag, so every rank raises."""
        try:
            check_evaluation(self.signal, args.device)
        except EvaluationInterrupted as stop:
            if self.exit_code is None:
                self.exit_code, self.reason = EXIT_PREEMPTED, f"preempted ({stop}) during evaluation"
            raise

    def _local_nonfinite(self, scaler: Any) -> bool:
        trainer = self.trainer
        if getattr(trainer, "is_deepspeed_enabled", False):
            engine = trainer.model_wrapped  # DeepSpeed has already stepped (and skipped an overflow)
            return not engine.was_step_applied() and not engine.fp16_enabled()
        return counts_as_nonfinite(nonfinite_gradients(trainer.model.parameters()), scaler)


def step_guard(trainer: Any) -> StepGuard:
    return next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StepGuard))


def guarded(trainer: Any, work: Callable[[], T]) -> T:
    """``trainer.train`` or an evaluation after it; exits with the guard's code when it stopped the run.

    A stop at a step end was saved by the Trainer itself (``control.should_save``). An evaluation
    interrupted by preemption left the Trainer through :class:`EvaluationInterrupted`, on every
    rank at the same batch; its emergency checkpoint is saved here by the two calls the Trainer
    makes for ``control.should_save`` (``_maybe_log_save_evaluate``), at the step already taken.
    """
    try:
        result = work()
    except EvaluationInterrupted:
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
        raise_stop(trainer)  # exits: the guard set its code before raising
        raise
    raise_stop(trainer)
    return result


def raise_stop(trainer: Any) -> None:
    """Exit with the guard's code when it stopped the run early (after its checkpoint was saved)."""
    guard = step_guard(trainer)
    if guard.exit_code is None:
        return
    from hftk.checkpoint.atomic import list_checkpoints

    if trainer.args.should_save:
        saved = list_checkpoints(trainer.args.output_dir)
        where = saved[-1] if saved else "no checkpoint"
        print(stop_line(trainer.state.global_step, guard.reason, where, guard.exit_code), file=sys.stderr, flush=True)
    guard.signal.leave()
    trainer.accelerator.end_training()
    raise SystemExit(guard.exit_code)
