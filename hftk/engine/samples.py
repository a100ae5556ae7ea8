"""Generation samples during training (``samples`` options): at every evaluation and at the end of training,
every prompt through transformers' ``generate`` on the model as the strategy holds it.

The prompts are dealt out over the ranks and each is generated alone (no padding, so a sample equals a
one-process ``generate`` on the same weights); rank 0 gathers the rows. The ranks call ``generate`` in lock-step
with ``synced_gpus=True``: a rank whose sample stops early keeps running forwards until every rank has stopped
(transformers' own mechanism). Where the parameters are sharded (ZeRO-3's partitions, FSDP2's DTensors) each
forward gathers them layer by layer, so without it the ranks' gathers would pair up wrongly and hang, and no rank
gathers more than a training forward does (plus, under FSDP2, the root's own group for the whole sampling).
Replicated models (ddp, zero1/2, LoRA under them) are kept in lock-step too, for :class:`TokenAgreement`: one
small all-reduce per forward tells every rank of a preemption signal, and all stop at the same token.
Rank 0 writes and reports the rows (:mod:`hftk.telemetry.samples`); the time is logged as ``sample_time_s``.
The custom loop (:mod:`hftk.engine.loop`) cannot generate sharded: it calls :func:`sample` on rank 0 alone with
the weights its step consolidates there (``consolidated_model``, in host memory), on the run's device where the
copy fits beside training (:func:`sampling_device`), else on the CPU, said in one line; the other ranks
:meth:`TokenAgreement.follow` its forwards.
It runs between optimizer steps (``on_evaluate``, ``on_train_end``), outside the step window
:class:`hftk.telemetry.metrics.MetricsCallback` times, so it never counts in tokens/s or MFU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TrainerCallback

from hftk.config.options import RunConfig
from hftk.data.dataset import heldout_prompts
from hftk.engine.resilience import (EXIT_PREEMPTED, EvaluationInterrupted, PreemptionSignal, agree, signal_name,
                                    step_guard)
from hftk.publish.generate import generate, generation_config, read_prompts
from hftk.telemetry.samples import report_samples

Prompt = str | list[dict[str, str]]


def requested(cfg: RunConfig) -> bool:
    return bool(cfg.samples.eval_prompts or cfg.samples.num_eval_samples)


def prompts(cfg: RunConfig, sources: list[Any], seed: int) -> list[Prompt]:
    """The run's sample prompts: ``eval_prompts``' rows, or the prompt part of ``num_eval_samples`` held-out rows."""
    if cfg.samples.eval_prompts:
        return read_prompts(Path(cfg.samples.eval_prompts), "samples.eval_prompts")
    return heldout_prompts(sources, cfg.samples.num_eval_samples, seed) if cfg.samples.num_eval_samples else []


def is_sharded(model: Any) -> bool:
    """Whether ranks hold pieces of the parameters (ZeRO-3 partitions, DTensor shards) in a multi-rank group."""
    from torch.distributed.tensor import DTensor

    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return False
    return any(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in model.parameters())


@contextmanager
def root_gathered(model: Any) -> Iterator[None]:
    """The FSDP2 root unit of ``model`` (embeddings, final norm, head) gathered for the body (a collective of the
    root's group; the blocks gather themselves at each forward); nothing for any other model. PEFT's ``generate``
    calls the inner model's forward, skipping the root's hook that gathers its parameters, so the root is gathered
    around the whole generation instead. FSDP2 names its root at the first forward through it (its states'
    ``_lazy_init``, which ``unshard`` does not run): a generation before any training forward (GRPO's first rollout)
    would make a block the root, so that is done first, as the root's own pre-forward does."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model._get_fsdp_state()._lazy_init()  # no-op once a forward ran through the root
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def sampling_device(model: torch.nn.Module, device: torch.device) -> torch.device:
    """Where rank 0 samples the custom loop's consolidated copy: ``device``, unless that is a GPU whose memory
    left (free, plus what torch's allocator holds unused) cannot take the whole copy with a tenth to spare beside
    the training state; then the CPU (slow, not out of memory mid-run), said in one line."""
    if device.type != "cuda":
        return device
    copy = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    free, _ = torch.cuda.mem_get_info(device)
    left = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if copy * 1.1 <= left:
        return device
    print(f"hftk: samples: the consolidated model ({copy / 2**30:.2f} GiB) does not fit beside training on {device} "
          f"({left / 2**30:.2f} GiB left): rank 0 samples it on the CPU", flush=True)
    return torch.device("cpu")


def stop_reason(tokens: list[int], config: Any) -> str:
    """``eos`` when the last new token is one of the config's EOS ids, else ``length``."""
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return "eos" if tokens and tokens[-1] in eos_ids else "length"


class TokenAgreement:
    """Every rank learns of a preemption signal at the same generated token, as an evaluation does at the same
    batch (:func:`hftk.engine.resilience.check_evaluation`). A forward pre-hook on the input embeddings (each
    forward passes them once) makes one small all-reduce per forward. The ranks' forwards are in lock-step
    (``synced_gpus``, which also runs the forwards of a rank whose sample has stopped), or the ranks that do not
    sample :meth:`follow` the one that does. Not a stopping criterion alone: transformers skips those on a rank
    whose sample has stopped, so a collective there would hang."""

    def __init__(self, signal: PreemptionSignal, device: Any) -> None:
        self.signal = signal
        self.device = device  # the process group's device (the sampling rank may generate on the CPU)
        self.stopped = False

    def exchange(self, done: bool = False) -> bool:
        """One round: whether any rank has seen a signal (kept in ``stopped``); returns whether the sampling
        rank said it is ``done``."""
        stop, done = agree([self.signal.received is not None, done], self.device)
        self.stopped = self.stopped or stop
        return done

    @contextmanager
    def watching(self, model: Any) -> Iterator[None]:
        handle = model.get_input_embeddings().register_forward_pre_hook(self._before_forward)
        try:
            yield
        finally:
            handle.remove()

    def _before_forward(self, module: Any, args: Any) -> None:  # None: a pre-hook's return would replace the input
        self.exchange()

    def follow(self) -> None:
        """On a rank that does not sample: one round per forward of the sampling rank, until it is done; then
        :class:`EvaluationInterrupted` when a signal was seen."""
        while not self.exchange():
            pass
        self.raise_if_stopped()

    def raise_if_stopped(self) -> None:
        if self.stopped:
            raise EvaluationInterrupted(signal_name(self.signal))


class StopOnAgreement(StoppingCriteria):
    """Ends a ``generate`` at the token where the ranks agreed on a preemption."""

    def __init__(self, agreement: TokenAgreement) -> None:
        self.agreement = agreement

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.agreement.stopped, device=input_ids.device)


def sample(model: Any, tokenizer: Any, prompts: list[Prompt], cfg: RunConfig, step: int, device: Any,
           shared: bool = True, agreement: TokenAgreement | None = None) -> list[dict]:
    """One row per prompt (step, prompt, completion, tokens, stop) from ``model`` as it is now (in eval mode).
    ``shared`` (every rank calls this with the model it trains): the prompts are dealt out over the ranks (rank r
    takes prompts r, r + world, ...) and the rows gathered to every rank; the ranks make the same number of
    ``generate`` calls in lock-step (a rank short of prompts repeats its first one and drops the result). Else this
    one process generates them all (the custom loop's consolidated model on rank 0). Sampling is seeded per prompt
    from ``training.seed`` and the step, on a forked RNG: the rows do not depend on the world size, and training's
    RNG stream is untouched. ``agreement``: a preemption on any rank ends the current ``generate`` at the next
    token on every rank, and every rank raises :class:`EvaluationInterrupted`."""
    from hftk.comm.collectives import gather_objects

    s = cfg.samples
    config = generation_config(model, tokenizer, s.sample_max_new_tokens, s.do_sample, s.temperature, s.top_p)
    dist = torch.distributed
    world, rank = (dist.get_world_size(), dist.get_rank()) if shared and dist.is_initialized() else (1, 0)
    synced = world > 1
    mine = list(range(rank, len(prompts), world))
    calls = -(-len(prompts) // world)
    stop = StoppingCriteriaList([StopOnAgreement(agreement)]) if agreement is not None else None
    was_training = model.training
    model.eval()
    rows: list[tuple[int, dict]] = []
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with root_gathered(model) if shared else nullcontext(), \
                agreement.watching(model) if agreement is not None else nullcontext():
            for call in range(calls):
                index = mine[call] if call < len(mine) else (mine or [0])[0]
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(int(cfg.args.seed) + step * len(prompts) + index)
                    tokens = generate(model, tokenizer, prompts[index], config, synced_gpus=synced, device=device,
                                      stopping_criteria=stop).tolist()
                if agreement is not None and agreement.stopped:  # the same call on every rank: they agreed
                    break
                if call < len(mine):
                    rows.append((index, {"step": step, "prompt": prompts[index], "tokens": tokens,
                                         "stop": stop_reason(tokens, config),
                                         "completion": tokenizer.decode(tokens, skip_special_tokens=True)}))
    finally:
        if agreement is not None:
            agreement.exchange(done=True)  # a signal after the last forward; and the followers' end
        model.train(was_training)
    if agreement is not None:
        agreement.raise_if_stopped()
    gathered = gather_objects(rows) if shared else [rows]
    return [row for _, row in sorted((r for ranks in gathered for r in ranks), key=lambda r: r[0])]


class SamplesCallback(TrainerCallback):
    """Samples at each evaluation and at the end of training, once per step (the engine's final evaluation after
    ``train`` ends at a step already sampled). Placed ahead of the reporters so that at train end it runs before
    tensorboard closes its writer."""

    def __init__(self, trainer: Any, cfg: RunConfig, prompts: list[Prompt]) -> None:
        self.trainer = trainer
        self.cfg = cfg
        self.prompts = prompts
        self.sampled: set[int] = set()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sample(args, state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sample(args, state)

    def _sample(self, args: Any, state: Any) -> None:
        step = state.global_step
        if step in self.sampled:
            return
        self.sampled.add(step)
        trainer = self.trainer
        guard = step_guard(trainer)
        start = time.perf_counter()
        try:
            rows = sample(trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class, self.prompts,
                          self.cfg, step, args.device, agreement=TokenAgreement(guard.signal, args.device))
        except EvaluationInterrupted as stop:  # leaves the Trainer; ``guarded`` saves and exits as for an evaluation
            if guard.exit_code is None:
                guard.exit_code, guard.reason = EXIT_PREEMPTED, f"preempted ({stop}) during sampling"
            raise
        seconds = time.perf_counter() - start
        if state.is_world_process_zero:
            report_samples(rows, Path(args.output_dir), trainer.callback_handler.callbacks, args, step)
        trainer.log({"sample_time_s": seconds})
