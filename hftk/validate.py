"""Every check that can fail on user input, run before any process group exists.

Checks are ordered from cheapest (pure config) to those that read the model config or the
raw dataset, so most mistakes are reported in well under a second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hftk import support
from hftk.comm.register import validate as check_compression
from hftk.config import RunConfig
from hftk.engine.guard import check_accelerate_launch, parent_argv
from hftk.errors import HftkError
from hftk.lora import validate as check_lora
from hftk.resilience import check_restartable


def launch_world_size() -> int:
    """World size the launcher asked for (torchrun / accelerate set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_config(cfg: RunConfig) -> None:
    """Pure checks on option values and their combinations."""
    t, d, m = cfg.training, cfg.data, cfg.model
    positive = {
        "training.per_device_train_batch_size": cfg.args.per_device_train_batch_size,
        "training.per_device_eval_batch_size": cfg.args.per_device_eval_batch_size,
        "training.gradient_accumulation_steps": cfg.args.gradient_accumulation_steps,
        "data.block_size": d.block_size,
    }
    for name, value in positive.items():
        if not isinstance(value, int) or value <= 0:
            raise HftkError(name, f"must be a positive integer, got {value!r}.", f"set {name} to 1 or more.")
    if not cfg.args.learning_rate > 0:
        raise HftkError("training.learning_rate", f"must be > 0, got {cfg.args.learning_rate}.", "set e.g. 5e-4.")
    if cfg.args.max_steps <= 0 and cfg.args.num_train_epochs <= 0:
        raise HftkError("training.num_train_epochs", "must be > 0 when max_steps is not set.",
                        "set training.num_train_epochs or training.max_steps.")
    if not 0 <= d.eval_fraction < 1:
        raise HftkError("data.eval_fraction", f"must be in [0, 1), got {d.eval_fraction}.", "use e.g. 0.05.")
    if d.max_train_samples is not None and d.max_train_samples <= 0:
        raise HftkError("data.max_train_samples", "must be positive.", "remove it or set a positive count.")
    eval_cap = d.max_eval_samples
    if eval_cap is not None and (isinstance(eval_cap, bool) or not isinstance(eval_cap, int) or eval_cap <= 0):
        raise HftkError("data.max_eval_samples", f"must be a positive integer, got {d.max_eval_samples!r}.",
                        "remove it or set a positive count of evaluation blocks.")
    if cfg.tracking.comm_profile_steps < 0:
        raise HftkError("tracking.comm_profile_steps", f"must be >= 0, got {cfg.tracking.comm_profile_steps}.",
                        "use 0 (no profiling) or N to profile every N-th step.")
    if not cfg.tracking.imbalance_warn_threshold > 0:
        raise HftkError("tracking.imbalance_warn_threshold", f"must be > 0, got {cfg.tracking.imbalance_warn_threshold}.",
                        "use e.g. 0.2 (warn when the slowest rank computes 20 % longer than the fastest).")
    if m.lora_r < 0:
        raise HftkError("model.lora_r", "must be >= 0.", "use 0 (full fine-tuning) or a rank like 8.")
    if t.get("bf16") and t.get("fp16"):
        raise HftkError("training.fp16", "bf16 and fp16 are both on.", "choose one mixed-precision mode.")
    if t.get("fp16") and m.model_dtype == "float16" and not m.lora_r and not cfg.strategy.strategy.startswith("zero"):
        # The AMP loss scaler keeps fp32 master gradients only; fp16 trainable weights make it raise
        # "Attempting to unscale FP16 gradients" at the first step (LoRA adapters stay fp32 in PEFT,
        # DeepSpeed keeps its own fp32 master copy: both train).
        raise HftkError("model.model_dtype", "float16 weights with --fp16: the loss scaler cannot unscale fp16 "
                        "gradients (it needs fp32 trainable weights).",
                        "load fp32 weights (model_dtype float32) with --fp16, or use --bf16.")
    if t.get("fp16") and not torch.cuda.is_available():
        raise HftkError("training.fp16", "fp16 needs a CUDA GPU (this machine has none).",
                        "use training.bf16 on CPU, or no mixed precision.")
    if t.get("tf32"):
        from transformers.utils import is_torch_tf32_available

        if not is_torch_tf32_available():  # TrainingArguments would raise a ValueError after launch
            raise HftkError("training.tf32", "TF32 needs an NVIDIA Ampere or newer GPU (none here).",
                            "drop --tf32 (bf16 is the fast mode on CPU).")
    if t.get("hub_token"):
        raise HftkError("training.hub_token", "tokens are never taken as options (they would be saved with the run).",
                        "export HF_TOKEN or run `hf auth login`.")
    if t.get("push_to_hub") and not t.get("hub_model_id"):
        raise HftkError("training.hub_model_id", "push_to_hub needs a repository id.", "pass --hub_model_id user/name.")
    if t.get("push_to_hub"):
        from hftk.hub import check_can_push

        check_can_push("training.push_to_hub")
        if t.get("hub_revision"):
            raise HftkError("training.hub_revision", "hftk pushes to the repository's main branch only.",
                            "drop --hub_revision, or push to a separate repository id.")
    if cfg.hub.hub_upload_retries < 1:
        raise HftkError("hub.hub_upload_retries", "must be at least 1.", "set it to 1 or more (default 5).")
    check_compression(cfg.strategy, launch_world_size(), dict(os.environ))
    check_restartable(dict(os.environ))
    check_accelerate_launch(dict(os.environ), parent_argv())
    _check_parallel_degrees(cfg)
    _check_output_dir(cfg)


def _check_parallel_degrees(cfg: RunConfig) -> None:
    """A tensor/sequence/context-parallel degree only means something to the strategies that apply it."""
    s = cfg.strategy
    owners = {"tp_size": ("tp", "cp"), "dp_replicate_size": ("tp", "cp"), "cp_size": ("cp",), "sp_size": ("sp",),
              "pp_size": ("pipeline",)}
    for name, strategies in owners.items():
        if getattr(s, name) != 1 and s.strategy not in strategies:
            raise HftkError(f"strategy.{name}", f"is {getattr(s, name)} but strategy {s.strategy} does not use it.",
                            f"pass --strategy {' or '.join(strategies)}, or leave {name} at 1.")


def _check_output_dir(cfg: RunConfig) -> None:
    """Never silently train over someone's earlier checkpoints."""
    from hftk.checkpoint import continues_this_job

    resume = cfg.training.get("resume_from_checkpoint")
    if resume and resume != "latest" and not Path(resume).is_dir():
        raise HftkError("training.resume_from_checkpoint", f"'{resume}' is not a checkpoint folder.",
                        "pass an existing checkpoint-N folder or 'latest'.")
    restarted = continues_this_job(cfg.output_dir)  # an elastic round resumes its own checkpoints
    earlier = any(Path(cfg.output_dir).glob("checkpoint-*"))  # complete or not: either is someone's work
    if not resume and not restarted and earlier and not cfg.training.get("overwrite_output_dir"):
        raise HftkError("training.output_dir", f"{cfg.output_dir} already holds checkpoints of another run.",
                        "pass --resume_from_checkpoint latest to continue it, or choose a new output_dir.")


def check_model(cfg: RunConfig, model_config: Any) -> None:
    """Checks that need the model's config (read without weights)."""
    from hftk.modeling import context_length

    limit = context_length(model_config)
    if limit is not None and cfg.data.block_size > limit:
        raise HftkError("data.block_size", f"{cfg.data.block_size} exceeds the model's context length {limit}.",
                        f"set data.block_size to {limit} or less.")
    check_lora(cfg, model_config)


def check_data(cfg: RunConfig, data_format: str) -> None:
    """Checks that need the datasets' formats (known once they are read); resolves ``data.packing auto``."""
    if cfg.strategy.strategy == "cp" and "messages" in data_format.split("+"):
        raise HftkError("data.data_format", "context parallel needs full blocks (ring attention takes no padding "
                        "mask) and conversations are padded, one per block.",
                        "train conversations with ddp, fsdp, zero1-3, pipeline, tp or sp.")
    resolve_packing(cfg, data_format)


def resolve_packing(cfg: RunConfig, data_format: str) -> None:
    """``data.packing`` from ``auto`` to the mode the formats and strategy call for, then the support
    table's refusals (strategy, attention implementation)."""
    d = cfg.data
    d.packing = support.resolve_packing(cfg.strategy.strategy, data_format, d.packing)
    if d.packing == "concat" and "messages" in data_format.split("+"):
        raise HftkError("data.packing", "concat would join conversations so that each attends to the one before it.",
                        "use --packing bfd (whole conversations kept apart) or none (one per row).")
    support.check_packing(cfg.strategy.strategy, d.packing, cfg.model.attn_implementation)
    if d.pad_to_multiple_of is not None and d.pad_to_multiple_of < 1:
        raise HftkError("data.pad_to_multiple_of", f"must be a positive number of tokens, got {d.pad_to_multiple_of}.",
                        "pass e.g. 8, or leave it unset.")
