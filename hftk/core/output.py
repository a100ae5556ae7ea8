"""What a run prints: hftk's progress bar, metrics and one-line messages, and nothing else.

The libraries under hftk each print their own notices: DeepSpeed's accelerator guess (every rank, every
import), its "op built successfully" note and torch's deprecation warnings for the collectives ZeRO calls, transformers'
deprecation warning for the ``is_gradient_checkpointing`` alias TRL's trainers read (every rank), its
weight-loading and shard-writing bars and three advisory warnings about choices hftk made on purpose,
``datasets``' map bars, the ``[INFO] Running in WANDB offline mode`` line every rank prints at import,
wandb's run history tables. :func:`quiet_libraries` turns each off at its
source with the library's own switch, once, before a run imports them; :func:`printed_lines_dropped`
filters DeepSpeed's note, which has no switch, around the one call that prints it. Warnings that say something is wrong with a run stay, and ``--log_level info`` /
``debug`` (the Trainer sets transformers' verbosity from it) brings the two dropped ones back.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator

# DeepSpeed's note on every rank each time its comm backend starts (``deepspeed.comm.torch.build_shm_op``: a print)
DEEPSPEED_OP_BUILT = re.compile(r"DeepSpeed \S+ built successfully\n?\Z")

# transformers' advisory warnings about what hftk does on purpose: (logger, the message it drops)
DROPPED_WARNINGS = (
    # hftk's tokenizer defines a pad token; the Trainer copies it into the model config (the only change)
    ("transformers.trainer_utils", re.compile(r"The tokenizer has new PAD/BOS/EOS tokens .* Updated tokens: "
                                              r"\{'pad_token_id': \d+\}\.\Z", re.S)),
    # a config without `loss_type` gets the causal LM loss, which is the loss hftk trains with
    ("transformers.modeling_utils", re.compile(r"`loss_type=None` was set in the config but it is unrecognized")),
    # chat markers added as tokens: hftk grows the embeddings with mean resizing on purpose and says so in one line
    ("transformers.modeling_utils", re.compile(r"The new (embeddings|lm_head weights) will be initialized from a "
                                               r"multivariate normal distribution")),
)


class _Dropped(logging.Filter):
    """Drops one advisory message unless the user asked transformers for info or debug output."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger("transformers").getEffectiveLevel() < logging.WARNING:
            return True  # --log_level info / debug: everything, as transformers wrote it
        return not self.pattern.match(record.getMessage())


def quiet_libraries(on_cpu: bool) -> None:
    """Switch the libraries' own output off where it is not the user's business (see the module doc).

    ``setdefault`` everywhere: a user's own ``DS_ACCELERATOR`` or ``WANDB_QUIET`` wins. Hub download
    bars stay (a large download is progress the user waits on), as does the Trainer's progress bar
    (its own ``tqdm``, governed by ``disable_tqdm``)."""
    import datasets
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    if on_cpu:  # DeepSpeed's guess otherwise warns on every rank that it found no GPU (announce_cpu says it once)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("WANDB_QUIET", "true")  # wandb's own switch: no history tables, its paths stay
    hub_bars_off = hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
    if not hub_bars_off:
        hub_utils.enable_progress_bars()  # transformers' switch turns the Hub's off too
    datasets.disable_progress_bars()  # tokenize / pack / map bars
    # ZeRO calls torch's deprecated tensor collectives (all_gather_into_tensor, reduce_scatter_tensor) on every
    # rank, ZeRO-3 at every step: DeepSpeed's business, nothing a user can change
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated\. Please use",
                            category=FutureWarning, module=r"torch\.distributed\.c10d_logger")
    # TRL's trainers read transformers' deprecated alias around every generation and reference forward (DPO, GRPO),
    # on every rank: TRL's business, nothing a user can change
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module=r"transformers\.modeling_utils")
    for name, pattern in DROPPED_WARNINGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Dropped) and f.pattern is pattern for f in logger.filters):
            logger.addFilter(_Dropped(pattern))
    _import_integrations_quietly()


def announce_cpu(main_process: bool) -> None:
    """DeepSpeed's "Setting accelerator to CPU ... we were unable to detect it" (every rank) as one line from
    rank 0 when torch sees no GPU; printed once the input is valid, so an input error is the first line."""
    import torch

    if main_process and not torch.cuda.is_available():
        print("hftk: torch sees no GPU: running on CPU", flush=True)


def _import_integrations_quietly() -> None:
    """Import transformers' tracker integrations with ``WANDB_MODE`` hidden: the module prints
    ``[INFO] Running in WANDB offline mode`` at import when it is ``offline``, on every rank, with
    no switch; wandb itself then says it once, on rank 0, with where the run's files are."""
    if "transformers.integrations.integration_utils" in sys.modules:
        return
    mode = os.environ.pop("WANDB_MODE", None)
    try:
        import transformers.integrations.integration_utils  # noqa: F401
    finally:
        if mode is not None:
            os.environ["WANDB_MODE"] = mode


@contextlib.contextmanager
def printed_lines_dropped(pattern: re.Pattern[str]) -> Iterator[None]:
    """Run a library call whose Python ``print`` has no switch (:data:`DEEPSPEED_OP_BUILT`); every other
    line it prints is written back when it returns."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        kept = "".join(line for line in buffer.getvalue().splitlines(keepends=True) if not pattern.match(line))
        if kept:
            sys.stdout.write(kept)
            sys.stdout.flush()


def done_line(seconds: float, step: int, eval_loss: float | None, final: str, resumed_step: int | None,
              resumes: bool, newest_checkpoint: int | None, preference_accuracy: float | None = None,
              rewards: dict[str, float] | None = None) -> str:
    """The line every run ends on (rank 0): how long, how good, where the model is, what a rerun does.
    ``preference_accuracy`` (a DPO run's eval ``rewards/accuracies``): its eval loss is DPO's pairwise loss, of
    which a perplexity would mean nothing, so the held-out preference accuracy is said instead. ``rewards`` (a GRPO
    run's): the mean reward of its last logged step (``train_reward`` at ``train_reward_step``) and the held-out
    prompts' (``eval_reward``)."""
    import math

    if rewards is not None:
        held_out = f", eval reward {rewards['eval_reward']:.4f}" if rewards.get("eval_reward") is not None else ""
        quality = (f"final mean reward {rewards['train_reward']:.4f} (step {rewards['train_reward_step']})"
                   if "train_reward" in rewards else "no reward logged (logging_steps past the last step)") + held_out
    elif eval_loss is None:
        quality = "no held-out data"
    elif preference_accuracy is not None:
        quality = f"eval DPO loss {eval_loss:.4f}, preference accuracy {preference_accuracy:.3f}"
    else:
        quality = f"eval loss {eval_loss:.4f}, perplexity {math.exp(min(eval_loss, 700)):.2f}"
    if resumed_step == step:
        return (f"hftk: the run was already complete at step {step}: nothing left to train ({quality}); "
                f"the model is in {final} ({seconds:.0f} s)")
    if not resumes:
        rerun = "add --resume_from_checkpoint latest to this command to resume it after a stop"
    elif newest_checkpoint is None:
        rerun = "no checkpoint was saved: rerunning this command starts over"
    else:
        rerun = f"rerunning this command resumes from checkpoint-{newest_checkpoint}"
    return f"hftk: done: step {step} in {seconds:.0f} s, {quality}; the model is in {final} ({rerun})"
