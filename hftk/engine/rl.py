"""Online RL: TRL's GRPOTrainer driven as the Trainer path drives the HF Trainer (the steps DPO takes too:
:mod:`hftk.engine.preference`). TRL samples the completions, calls the reward functions, computes the advantages
and the loss; hftk adds what a multi-rank run needs around it:

- Rollouts in lock-step (:class:`_LockStepRollouts`): every rank runs ``generate`` with ``synced_gpus`` (a rank whose
  completions ended keeps running forwards until all have), as hftk's samples do (:mod:`hftk.engine.samples`).
  Under hftk's FSDP2 each forward gathers its blocks' shards (a collective the ranks must call alike); TRL's
  ``summon_full_params`` path is FSDP1's and does nothing there, and transformers turns ``synced_gpus`` on only for
  its own FSDP marker; the root unit (embeddings, final norm, head) is gathered around the whole generation, since
  PEFT's ``generate`` skips the root's own hook. Under ZeRO-3 TRL gathers the weights (``ds3_gather_for_generation``).
  One small all-reduce per forward tells every rank of a preemption signal, and all stop at the same token, save
  and exit 75.
- Rewards checked on every rank (:mod:`hftk.engine.rewards`): a bad output stops every rank at the same step with
  one line naming the function and the completion.
- The reference (``--beta`` > 0) held as DPO's is (sharded under fsdp / zero3): TRL 1.16's GRPOTrainer takes no
  reference model, loads a whole copy on every rank itself, and under LoRA copies the adapter into a frozen "ref"
  adapter after hftk has sharded it (which fails on sharded parameters); so it is built with beta 0 and given
  hftk's reference and beta after.
- ``completions.jsonl`` (prompts, completions, each function's reward, advantage) at every logging step, with a
  tensorboard text and a wandb table (TRL's ``log_completions`` prints rich tables instead; it stays off).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import StoppingCriteriaList, TrainerCallback

from hftk.comm.collectives import gather_objects
from hftk.core import startup
from hftk.core.errors import HftkError
from hftk.data.dataset import split_and_mix
from hftk.engine import trainer as trainer_engine
from hftk.engine.preference import (add_run_callbacks, policy_model, reference_held, starting_copy, trl_arguments,
                                    trl_trainer)
from hftk.engine.resilience import EXIT_PREEMPTED, EvaluationInterrupted, agree, step_guard
from hftk.engine.rewards import FIELD, RewardProblems, checked, load_reward_funcs
from hftk.engine.run_types import PreparedRun
from hftk.engine.samples import StopOnAgreement, TokenAgreement, root_gathered
from hftk.models import lora
from hftk.models.loading import load_tokenizer
from hftk.telemetry.samples import report_completions

# GRPOConfig's fields hftk sets only when the run does (unset: TRL's default).
OPTIONAL = ("num_generations", "max_completion_length", "epsilon", "epsilon_high", "num_iterations", "scale_rewards",
            "importance_sampling_level")


def grpo_options(cfg: Any) -> dict[str, Any]:
    """GRPOConfig's fields from hftk's options (TRL's names); ``beta`` is the run's (the trainer is built with 0)."""
    r, p, s = cfg.rl, cfg.preference, cfg.samples
    options = dict(beta=p.beta, loss_type=p.loss_type, temperature=s.temperature, top_p=s.top_p,
                   mask_truncated_completions=r.mask_truncated_completions, use_vllm=r.use_vllm,
                   reward_weights=r.reward_weights, log_completions=False)
    return {**options, **{name: getattr(r, name) for name in OPTIONAL if getattr(r, name) is not None}}


class _LockStepRollouts:
    """Ahead of TRL's GRPOTrainer in the MRO: generation in lock-step (module doc) and rewards checked on every
    rank."""

    reward_problems: RewardProblems

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        with lock_step(self):
            return super()._generate_single_turn(*args, **kwargs)  # type: ignore[misc]

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
        rewards = super()._calculate_rewards(*args, **kwargs)  # type: ignore[misc]
        problem = self.reward_problems.take()
        if agree([problem is not None], self.args.device)[0]:  # type: ignore[attr-defined]
            first = next(found for found in gather_objects(problem) if found is not None)
            raise HftkError(FIELD, *first)  # on every rank at once: one line (rank 0's report), exit 2
        return rewards


@contextmanager
def lock_step(trainer: Any) -> Iterator[None]:
    """Around TRL's generation: ``generate`` called with ``synced_gpus`` and a stop at the token where the ranks
    agree on a preemption (TRL 1.16 passes ``generate`` neither: the call is wrapped for its duration), the FSDP2
    root gathered; a preemption then raises :class:`EvaluationInterrupted` on every rank, which ``guarded`` turns
    into a checkpoint of the last step and exit 75."""
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    guard = step_guard(trainer)
    agreement = TokenAgreement(guard.signal, trainer.args.device)
    synced = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    model.generate = functools.partial(model.generate, synced_gpus=synced,
                                       stopping_criteria=StoppingCriteriaList([StopOnAgreement(agreement)]))
    try:
        with root_gathered(model), agreement.watching(model):
            yield
    finally:
        agreement.exchange(done=True)  # a signal after the last forward
        del model.generate  # the class's own again
    try:
        agreement.raise_if_stopped()
    except EvaluationInterrupted as stop:
        if guard.exit_code is None:
            guard.exit_code, guard.reason = EXIT_PREEMPTED, f"preempted ({stop}) during generation"
        raise


def grpo_trainer_class() -> type:
    """TRL's GRPOTrainer with hftk's lock-step rollouts and checked rewards."""
    from trl import GRPOTrainer

    return type("HftkGRPOTrainer", (_LockStepRollouts, GRPOTrainer), {})


def attach_reference(trainer: Any, cfg: Any, strategy: Any, tokenizer: Any, beta: float) -> str:
    """Give the trainer (built with beta 0) the run's ``beta`` and the reference as the strategy holds it: none
    under LoRA (the policy with its adapter disabled: TRL's own rule for a PeftModel without a "ref" adapter), else
    the starting model sharded like the policy (fsdp), partitioned by TRL's ``prepare_deepspeed`` (ZeRO), or a
    whole copy (ddp), with TRL's fused log-prob head as TRL gives its own reference. Returns how it is held."""
    trainer.beta = trainer.args.beta = beta
    if beta == 0:
        return "none (beta 0: no KL term)"
    if not lora.is_peft(trainer.model):
        from trl.models.utils import prepare_deepspeed
        from trl.trainer.utils import add_fused_lm_head

        ref = starting_copy(cfg.model, strategy, tokenizer, trainer.args.seed)
        add_fused_lm_head(ref, temperature=trainer.temperature, cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32)
        if getattr(strategy, "SHARDS_PARAMETERS", False):
            ref = strategy.prepare_model(ref, cfg)
        elif trainer.is_deepspeed_enabled:
            ref = prepare_deepspeed(ref, trainer.accelerator)
        else:
            ref = trainer.accelerator.prepare_model(ref, evaluation_mode=True)
        trainer.ref_model = ref
    return reference_held(trainer, cfg.strategy.strategy)


def build_grpo_trainer(prepared: PreparedRun) -> tuple[Any, Any, Any]:
    """A ready GRPOTrainer: (trainer, strategy module, data with ``train`` / ``eval``)."""
    from trl import GRPOConfig

    cfg = prepared.cfg
    options = grpo_options(cfg)
    args, strategy = trl_arguments(prepared, GRPOConfig, {**options, "beta": 0.0},
                                   trl_keeps=("remove_unused_columns",))
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template, cfg.data.add_chat_tokens,
                               announce=args.process_index == 0)
    train, held_out = split_and_mix(prepared.sources, args.seed)
    startup.mark("data")
    model, _ = policy_model(cfg, strategy, tokenizer, args)
    startup.mark("model")
    problems = RewardProblems()
    funcs = [checked(func, spec, problems) for spec, func in zip(cfg.rl.reward_funcs, load_reward_funcs(
        cfg.rl.reward_funcs))]
    trainer = trl_trainer(cfg, strategy, grpo_trainer_class(), model=model, reward_funcs=funcs, args=args,
                          train_dataset=train, eval_dataset=held_out, processing_class=tokenizer)
    trainer.reward_problems = problems
    held = attach_reference(trainer, cfg, strategy, tokenizer, options["beta"])
    add_run_callbacks(prepared, trainer, strategy, "GRPO", held)
    trainer.add_callback(CompletionsCallback(trainer))
    return trainer, strategy, _Data(train=trainer.train_dataset, eval=trainer.eval_dataset)


@dataclasses.dataclass
class _Data:
    """What ``engine.trainer.train`` reads of the data: whether there is a held-out split."""

    train: Any
    eval: Any


class CompletionsCallback(TrainerCallback):
    """At each logging step (rank 0): the latest rollouts TRL keeps for its ``log_completions`` (every rank's,
    gathered) to ``completions.jsonl``, a tensorboard text and a wandb table."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        logs = logs or {}
        split = "train" if "reward" in logs else "eval" if "eval_reward" in logs else None
        if split is None or not state.is_world_process_zero:
            return
        kept = self.trainer._logs  # TRL's own record of the last generation batch, gathered over the ranks
        rewards = {name: list(values) for name, values in kept["rewards"].items()}
        rows = [{"step": state.global_step, "split": split, "prompt": prompt, "completion": completion,
                 "rewards": {name: _number(values[i]) for name, values in rewards.items()},
                 "advantage": _number(advantage)}
                for i, (prompt, completion, advantage) in enumerate(zip(kept["prompt"], kept["completion"],
                                                                       kept["advantages"]))]
        report_completions(rows, Path(args.output_dir), self.trainer.callback_handler.callbacks, args,
                           state.global_step)


def _number(value: float) -> float | None:
    """A reward or advantage as JSON holds it: float32's digits (TRL keeps them in float32 tensors), an unscored
    completion's NaN as null."""
    return None if value != value else float(f"{value:.7g}")


def final_reward(trainer: Any) -> dict[str, float]:
    """The mean reward of the last logged training step (the run record and the closing line say it)."""
    logged = [row for row in trainer.state.log_history if "reward" in row and row["reward"] is not None]
    return {"train_reward": logged[-1]["reward"], "train_reward_step": logged[-1]["step"]} if logged else {}


def train(prepared: PreparedRun) -> dict[str, float]:
    """The Trainer path's run (callbacks, atomic checkpoints, final/, run record, Hub) around a GRPOTrainer."""
    return trainer_engine.train(prepared, build=build_grpo_trainer, summary=final_reward)
