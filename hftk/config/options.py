"""The typed run configuration: the single source of truth for every hftk option.

Sections (YAML top-level keys): ``model``, ``data``, ``training``, ``strategy``,
``tracking``, ``samples``, ``hub``, ``resilience``. Every option has help text (``hftk train --help``).
``training`` is the HF ``TrainingArguments``: every one of its fields passes through.

``TrainingArguments.__post_init__`` starts the process group (it resolves the device), so
``RunConfig.training`` keeps its keyword arguments as a plain dict until validation has
passed; :func:`hftk.engine.trainer.build_training_arguments` constructs it later.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from hftk.config.strategy_table import STRATEGIES as STRATEGY_TABLE
from hftk.core.errors import HftkError

STRATEGIES = (*STRATEGY_TABLE, "auto")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "topk")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PACKINGS = ("auto", "concat", "bfd", "none")
DATA_FORMATS = ("auto", "text", "prompt_completion", "messages", "alpaca", "sharegpt")
DEFAULT_MODEL = "builtin:gpt2-small"
DEFAULT_DATASET = "builtin:kjv"


def _opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with help text (HfArgumentParser reads ``metadata['help']``)."""
    meta = {"help": help}
    if "choices" in kw:
        meta["choices"] = kw.pop("choices")
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class ModelConfig:
    """Which model to fine-tune and how to load it."""

    model_name_or_path: str = _opt(
        DEFAULT_MODEL, "Hub id, local folder, or 'builtin:NAME' (gpt2-tiny, gpt2-tiny4, gpt2-small, gpt2-90m, "
        "llama-tiny, neox-tiny), a small model created locally and loaded through from_pretrained.")
    model_revision: str = _opt("main", "Hub revision (branch, tag or commit) of the model.")
    tokenizer_name_or_path: str | None = _opt(None, "Tokenizer source when it differs from the model.")
    trust_remote_code: bool = _opt(False, "Run code shipped with a Hub model. Off unless you trust the repository.")
    use_hub_kernels: bool = _opt(
        False, "Let transformers swap the model's layers for kernels-community kernels fetched from the Hub when the "
        "model changes mode (code from the Hub, as trust_remote_code; offline it needs the kernel cached). Off: the "
        "model's own layers, on every device.")
    model_dtype: str = _opt("float32", "dtype the weights are loaded in; mixed precision is training.bf16 / "
                            "training.fp16.", choices=["float32", "bfloat16", "float16"])
    attn_implementation: str | None = _opt(None, "Attention kernel: eager, sdpa, flash_attention_2 (None: transformers' choice).")
    loss_implementation: str = _opt(
        "auto", "How the causal-LM loss is computed: chunked (the head and the loss over a few hundred target tokens at "
        "a time, each chunk checkpointed: no rank holds every token's logits; the Trainer engine: ddp, fsdp, ZeRO), "
        "plain (the model's own loss over all its logits), auto (chunked where it runs, else plain; the start line "
        "says which). DPO and GRPO: TRL's own chunked log-probs.", choices=["auto", "chunked", "plain"])
    model_dropout: float | None = _opt(
        None, "Override every dropout probability of the model config (0 for exact parity tests).")
    lora_r: int = _opt(0, "LoRA rank; 0 trains the full model.")
    lora_alpha: int = _opt(16, "LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = _opt(0.0, "Dropout on the LoRA branch.")
    lora_target_modules: str | None = _opt(
        None, "Comma-separated module names to adapt; default chosen per architecture.")
    use_dora: bool = _opt(False, "DoRA (PEFT use_dora): LoRA plus a trained magnitude per output channel; needs lora_r.")
    use_rslora: bool = _opt(False, "rsLoRA (PEFT use_rslora): scale adapters by alpha / sqrt(r) instead of alpha / r; "
                            "needs lora_r.")
    # QLoRA: the frozen base quantized at load by bitsandbytes (transformers' BitsAndBytesConfig).
    load_in_4bit: bool = _opt(False, "Load the base weights in 4 bits through bitsandbytes (QLoRA); needs lora_r.")
    load_in_8bit: bool = _opt(False, "Load the base weights in 8 bits through bitsandbytes (LLM.int8); needs lora_r.")
    bnb_4bit_quant_type: str = _opt("nf4", "4-bit data type: nf4 (NormalFloat, QLoRA's) or fp4.", choices=["nf4", "fp4"])
    bnb_4bit_use_double_quant: bool = _opt(
        True, "Quantize the 4-bit blocks' fp32 scales again (8-bit, blocks of 256): ~0.37 bit/param saved.")
    bnb_4bit_compute_dtype: str | None = _opt(None, "dtype 4-bit layers dequantize to for their matmul (None: "
                                              "model_dtype).", choices=["float32", "bfloat16", "float16"])
    # Mixture of experts (hftk.models.moe): read only for models with experts.
    router_aux_loss_coef: float | None = _opt(
        None, "Weight of the router's load-balancing loss, optimized while training (mean over each step's "
        "micro-batches); 0 turns it off. None: the model config's router_aux_loss_coef.")
    experts_implementation: str | None = _opt(
        None, "How expert matmuls run (transformers' experts_implementation): eager (a loop over the experts hit), "
        "batched_mm, grouped_mm. None: grouped_mm (the CPU; CUDA from compute capability 8.0), else eager.",
        choices=["eager", "batched_mm", "grouped_mm"])


@dataclass
class DataConfig:
    """Where the training text comes from and how it becomes fixed-size blocks."""

    dataset: str = _opt(DEFAULT_DATASET, "Hub dataset name, a local file (.txt .jsonl .json .csv .parquet) or folder, "
                        "or 'builtin:kjv' (the shipped public-domain corpus).")
    dataset_config_name: str | None = _opt(None, "Hub dataset configuration name.")
    dataset_revision: str | None = _opt(None, "Hub revision of the dataset.")
    train_split: str = _opt("train", "Split to train on.")
    eval_split: str | None = _opt(None, "Split to evaluate on; when unset, eval_fraction of the train split is held out.")
    eval_fraction: float = _opt(0.05, "Fraction of training rows held out for evaluation when eval_split is unset (0 disables).")
    data_format: str = _opt(
        "auto", "'text' (loss on every token), 'prompt_completion' (loss on the completion only), 'messages' (chat "
        "conversations, loss on the assistant turns), 'alpaca' (instruction / input / output), 'sharegpt' "
        "(conversations of from / value), or 'auto' (detected from the columns, in that order: messages, sharegpt, "
        "alpaca, prompt_completion, text).", choices=list(DATA_FORMATS))
    text_field: str = _opt("text", "Column holding the text for data_format=text.")
    prompt_field: str = _opt("prompt", "Column holding the prompt for data_format=prompt_completion.")
    completion_field: str = _opt("completion", "Column holding the completion for data_format=prompt_completion.")
    block_size: int = _opt(128, "Tokens per training sequence; must not exceed the model's context length.")
    packing: str = _opt(
        "auto", "How examples become training rows. 'concat': concatenated and cut into full blocks (an example "
        "attends to the one before it: continued pre-training of plain text). 'bfd': whole examples placed into blocks "
        "of block_size by best-fit decreasing (TRL's pack_dataset), position ids restarting at 0 per example and no "
        "attention mask, so no example attends to another (rows padded to the batch's longest; one padding-free row "
        "under flash attention) (Trainer strategies; sdpa / eager / flash attention; pipeline and tp: rows of "
        "block_size, sdpa / eager). 'none': one example per row, each batch padded to its longest example (rounded up "
        "to pad_to_multiple_of; pipeline, tp and sp pad to block_size). 'auto': concat for plain text, else bfd where "
        "the strategy keeps packed examples apart, else none.", choices=list(PACKINGS))
    pad_to_multiple_of: int | None = _opt(None, "packing none: pad each batch to a multiple of this many tokens (e.g. "
                                          "8 or 64 for GPU kernels; block_size pads every batch to block_size).")
    max_train_samples: int | None = _opt(None, "Keep only this many raw training rows (quick runs).")
    max_eval_samples: int | None = _opt(
        None, "Keep only the first this many evaluation blocks (after the split and packing, as run_clm's "
        "max_eval_samples), bounding what every evaluation costs; the count is printed at start.")
    preprocessing_num_workers: int | None = _opt(None, "Processes for tokenisation (datasets.map num_proc).")
    # Conversations, instruction formats and several datasets.
    datasets: list[str] | None = _opt(
        None, "Several datasets (instead of data.dataset). In YAML a list of paths / Hub names or of mappings with "
        "path, and optionally split, eval_split, format, config_name, revision, weight and any *_field option; with "
        "weights they are mixed by datasets.interleave_datasets (seeded, probabilities from the weights), without them "
        "concatenated. `--dataset a.jsonl,b.jsonl` is the command-line short form.")
    messages_field: str = _opt("messages", "Column of [{role, content}, ...] lists for data_format=messages.")
    conversations_field: str = _opt("conversations", "Column of [{from, value}, ...] lists for data_format=sharegpt.")
    instruction_field: str = _opt("instruction", "Column of the instruction for data_format=alpaca.")
    input_field: str = _opt("input", "Optional column of the instruction's input for data_format=alpaca.")
    output_field: str = _opt("output", "Column of the answer for data_format=alpaca.")
    chat_template: str | None = _opt(
        None, "Chat template for conversations: a shipped name (chatml) or a Jinja file; overrides the tokenizer's "
        "own. Needed when the tokenizer has none. It is saved with the tokenizer in every checkpoint and in final/.")
    add_chat_tokens: bool = _opt(
        True, "When the chosen chat template writes <|...|> markers that are not single tokens of the tokenizer (chatml "
        "on GPT-2 or most base models): add them as special tokens, make the template's end-of-turn marker the EOS "
        "(tokenizer, config, generation config) and grow the embeddings to match (new rows trained, with LoRA too). "
        "--no_add_chat_tokens keeps them as plain text and the tokenizer's EOS.")
    train_on_prompt: bool = _opt(
        False, "Conversations: put the loss on system / user turns too, not only on the assistant turns.")
    on_bad_row: str = _opt("error", "A row that does not fit its format (unknown role, empty assistant turn, no final "
                           "assistant turn, tool turns the template cannot render): 'error' names the first one and "
                           "stops, 'drop' skips them and prints how many.", choices=["error", "drop"])
    truncation: str = _opt(
        "drop", "Conversations and prompt/completion pairs longer than block_size (under packing bfd or none): 'drop' "
        "them (counted in a summary line) or 'truncate' them to the block (conversations: only the assistant turns "
        "that end inside it keep their labels; pairs: the completion is cut, and a pair whose prompt fills the block "
        "is dropped, never trained with no completion token). DPO's preference pairs likewise against "
        "training.max_length.", choices=["drop", "truncate"])
    tokenized_path: str | None = _opt(
        None, "Folder of blocks written by `hftk preprocess` (tokenised, templated, masked, packed once): training "
        "reads it on every rank with no tokenisation; one made with another tokenizer, template, block size, format or "
        "datasets is refused (--method dpo: TRL's tokenised preference pairs, refused for another method or "
        "max_length). For `hftk preprocess` the folder to write.")


@dataclass
class StrategyConfig:
    """How the work is spread over processes; applied from outside the model code."""

    strategy: str = _opt(
        "ddp", "Parallelism: ddp, fsdp (FSDP2), zero1, zero2, zero3, zero3_offload (DeepSpeed), pipeline, tp (tensor "
        "parallel x FSDP2 on one mesh), cp (ring-attention context parallel on that mesh), sp (DeepSpeed Ulysses "
        "sequence parallel), ep (expert parallel x FSDP2, mixtures of experts), or auto (pick from the per-rank "
        "memory plan).", choices=list(STRATEGIES))
    device_memory_gb: float | None = _opt(
        None, "Memory per rank the auto strategy and the plan may use (default: the device's, or RAM / ranks on CPU).")
    fsdp_cpu_offload: bool = _opt(False, "FSDP2: keep sharded parameters and optimizer state in CPU memory.")
    fsdp_reshard_after_forward: bool = _opt(True, "FSDP2: free gathered parameters after forward (ZeRO-3 style).")
    fsdp_state_dict: str = _opt("sharded", "FSDP2 checkpoint format: sharded (torch.distributed.checkpoint) or full.",
                                choices=["sharded", "full"])
    fsdp_hybrid: bool = _opt(False, "FSDP2: shard inside a node, replicate across nodes (HSDP).")
    pp_size: int = _opt(1, "Pipeline stages (strategy=pipeline).")
    pp_microbatches: int = _opt(4, "Micro-batches each pipeline step splits a batch into.")
    pp_schedule: str = _opt("1f1b", "Pipeline schedule.", choices=list(PP_SCHEDULES))
    pp_virtual_stages: int = _opt(2, "Stages per rank for interleaved_1f1b.")
    tp_size: int = _opt(1, "Tensor-parallel degree (strategy tp or cp).")
    dp_shard_size: int = _opt(1, "FSDP2 sharding degree composed with tensor / context parallel (-1: the rest of the world).")
    dp_replicate_size: int = _opt(1, "Strategy tp / cp: data-parallel replicas (HSDP across them); dp_replicate x "
                                  "dp_shard x cp x tp = world size.")
    sp_size: int = _opt(1, "Sequence-parallel degree (strategy sp, DeepSpeed Ulysses); the rest of the world is data parallel.")
    cp_size: int = _opt(1, "Context-parallel degree (strategy cp): every sequence split over cp ranks, torch ring attention.")
    ep_size: int = _opt(-1, "Expert-parallel degree (strategy ep): each rank of a group of ep_size holds 1/ep_size of "
                        "every MoE layer's experts and tokens travel to them by all-to-all; it must divide the world "
                        "size and the number of experts (-1: the world size).")
    grad_compression: str = _opt("none", "Gradient compression hook for DDP.", choices=list(COMPRESSIONS))
    powersgd_rank: int = _opt(4, "PowerSGD: rank of the low-rank approximation.")
    powersgd_warmup_steps: int = _opt(10, "PowerSGD: uncompressed steps before compression starts.")
    topk_ratio: float = _opt(0.01, "Top-k: fraction of gradient entries sent each step.")
    topk_warmup_steps: int = _opt(
        10, "Top-k: uncompressed steps before sparsification starts (the early, large gradient changes are "
        "otherwise delayed by error feedback and training falls behind).")
    hierarchical_allreduce: bool = _opt(False, "Reduce inside a node, all-reduce among node leaders, broadcast back.")


@dataclass
class TrackingConfig:
    """Where metrics go besides the Trainer's report_to integrations."""

    metrics_file: str = _opt("metrics.jsonl", "JSON-lines metrics file, relative to training.output_dir.")
    wandb_project: str = _opt("hftk", "wandb project (wandb runs offline when no API key is configured).")
    imbalance_warn_threshold: float = _opt(
        0.2, "Warn when the fastest rank idles, waiting for the slowest, for more than this fraction of each step "
        "(slowest minus fastest compute time, forward start to last gradient, over the wall step time).")
    check_sync_steps: int = _opt(
        0, "Every N optimizer steps, hash each rank's replicated parameters and log whether all replicas agree (ddp, "
        "ZeRO, each pipeline stage's replicas; refused under tp / cp / sp, whose shards have no replicas; 0: off).")
    comm_profile_steps: int = _opt(
        50, "Time the collectives of step 3 and then of every N-th optimizer step to log the communication share of "
        "the step (gloo on CPU; not on CUDA, whose NCCL collectives report done when queued; 0: off).")


@dataclass
class SamplesConfig:
    """Generation samples at every evaluation and at the end of training (``samples.jsonl``, tensorboard, wandb)."""

    eval_prompts: str | None = _opt(
        None, "JSONL file of prompts to generate from at every evaluation and at the end: one {\"prompt\": str} or "
        "{\"messages\": [{role, content}, ...]} row per line (messages rendered with the run's chat template).")
    num_eval_samples: int = _opt(
        0, "Generate from the prompt part of the first N held-out rows (prompt/completion pairs: the prompt; "
        "conversations: the turns before the last assistant turn) instead of --eval_prompts (0: off).")
    sample_max_new_tokens: int = _opt(64, "Most new tokens per sample (a sample that reaches it stops with 'length').")
    do_sample: bool = _opt(False, "Samples: sample (GenerationConfig do_sample) instead of greedy decoding, seeded "
                           "from training.seed and the step.")
    temperature: float = _opt(1.0, "Sampling temperature (GenerationConfig temperature): the samples' (needs "
                              "do_sample) and, under --method grpo, the rollouts' (GRPOConfig temperature).")
    top_p: float = _opt(1.0, "Nucleus sampling mass in (0, 1] (GenerationConfig top_p): the samples' (needs do_sample) "
                        "and, under --method grpo, the rollouts' (GRPOConfig top_p).")


@dataclass
class HubConfig:
    """Pushing the result to the Hugging Face Hub (push_to_hub / hub_model_id / hub_strategy live in training)."""

    hub_upload_retries: int = _opt(5, "Attempts per upload before it is reported as failed (training goes on).")
    hub_retry_backoff_s: float = _opt(2.0, "Wait before the second upload attempt; it doubles for each further attempt.")
    hub_push_merged: bool = _opt(False, "With LoRA: push the merged full model instead of the adapter.")


@dataclass
class ResilienceConfig:
    """What happens when things go wrong mid-run."""

    nan_policy: str = _opt(
        "stop", "On a NaN/Inf loss: 'skip' the step, or 'stop' with a checkpoint.", choices=["skip", "stop"])


# TRL 1.16's DPOConfig / GRPOConfig loss types (trl/trainer/{dpo,grpo}_config.py); tests/unit/config/test_options.py
# and test_preference.py read them back from TRL's help text.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
METHODS = ("sft", "dpo", "grpo")
# Each method's TRL default, where an option left unset means something per method (DPOConfig / GRPOConfig's own).
METHOD_DEFAULTS = {"dpo": {"beta": 0.1, "loss_type": "sigmoid"}, "grpo": {"beta": 0.0, "loss_type": "dapo"}}


@dataclass
class PreferenceConfig:
    """Preference tuning (TRL's DPOTrainer) and the objective itself; the YAML keeps these under ``training:``
    (``training.method``)."""

    method: str = _opt("sft", "Training objective: sft (supervised fine-tuning on text / conversations), dpo "
                       "(Direct Preference Optimization on prompt / chosen / rejected pairs, TRL's DPOTrainer) or grpo "
                       "(online reinforcement learning on prompts scored by --reward_funcs, TRL's GRPOTrainer).",
                       choices=list(METHODS))
    beta: float | None = _opt(None, "DPO: how far the policy may move from the reference (higher: closer); for "
                              "loss_type ipo the regulariser tau (default 0.1). GRPO: the KL penalty towards the "
                              "starting model (default 0.0, TRL's: no reference model is held).")
    loss_type: str | None = _opt(
        None, "DPO: the pairwise loss, one of TRL's: " + ", ".join(DPO_LOSS_TYPES) + " (default sigmoid). GRPO: how "
        "token losses are aggregated, one of TRL's: " + ", ".join(GRPO_LOSS_TYPES) + " (default dapo).",
        choices=[*DPO_LOSS_TYPES, *GRPO_LOSS_TYPES])
    max_length: int | None = _opt(None, "DPO: most tokens of prompt + completion; longer pairs are dropped or "
                                  "truncated (keep_start, TRL's) as data.truncation says, with a summary line. "
                                  "Default: data.block_size.")
    precompute_ref_log_probs: bool = _opt(False, "DPO: compute the reference model's log-probs over the data once "
                                          "before training, so no reference model is held while training.")
    ref_model_name_or_path: str | None = _opt(
        None, "DPO: the reference model (Hub id or folder); default the starting model. With LoRA the reference "
        "is the base with the adapter disabled (no second copy), so it must be unset.")


@dataclass
class RLConfig:
    """Online RL with rewards the user writes (``--method grpo``, TRL's GRPOTrainer and GRPOConfig's names); the
    YAML keeps these under ``training:``. Unset: TRL's default. The rollouts sample with ``--temperature`` and
    ``--top_p`` (the samples section's options, GRPOConfig's names); ``--beta`` and ``--loss_type`` are shared with
    DPO; prompts are at most ``data.block_size`` tokens."""

    reward_funcs: list[str] | None = _opt(
        None, "GRPO: the reward functions, FILE.py:NAME, package.module:NAME or the name of one TRL ships "
        "(accuracy_reward, reasoning_accuracy_reward, think_format_reward); several comma-separated or as a list. Each "
        "is a TRL reward function: called with completions=, prompts=, completion_ids= and every other dataset column "
        "by keyword (so it takes **kwargs), returning one float per completion (None: not scored).")
    reward_weights: list[float] | None = _opt(
        None, "GRPO: one weight per reward function, in --reward_funcs order (default 1 each).")
    num_generations: int | None = _opt(
        None, "GRPO: completions sampled per prompt, the group each reward is compared within (default 8); it must "
        "divide the global batch (per_device_train_batch_size x gradient_accumulation_steps x ranks).")
    max_completion_length: int | None = _opt(
        None, "GRPO: most tokens per completion (default 512); with data.block_size (the longest prompt) it must fit "
        "the model's context.")
    epsilon: float | None = _opt(None, "GRPO: the clipping range of the probability ratio, 1 - epsilon .. 1 + "
                                 "epsilon_high (default 0.2).")
    epsilon_high: float | None = _opt(None, "GRPO: the upper clipping range (default: epsilon; DAPO uses 0.28).")
    num_iterations: int | None = _opt(None, "GRPO: optimisation passes over each batch of completions before new "
                                      "ones are sampled (default 1).")
    scale_rewards: str | None = _opt(None, "GRPO: divide each advantage by the standard deviation of its group's "
                                     "rewards (group, the default), of the whole batch's (batch) or not (none).",
                                     choices=["group", "batch", "none"])
    mask_truncated_completions: bool = _opt(False, "GRPO: leave completions cut off at max_completion_length (no EOS) "
                                            "out of the loss.")
    importance_sampling_level: str | None = _opt(
        None, "GRPO: probability ratios per token (token, the default) or one per sequence (sequence: GSPO).",
        choices=["token", "sequence"])
    use_vllm: bool = _opt(False, "GRPO: generate the rollouts with vLLM (colocated, TRL's) instead of transformers' "
                          "generate; needs vLLM installed and a GPU.")


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "strategy": StrategyConfig,
                             "tracking": TrackingConfig, "samples": SamplesConfig, "hub": HubConfig,
                             "resilience": ResilienceConfig, "preference": PreferenceConfig, "rl": RLConfig}
# YAML sections whose options live in another section's dataclass: ``training.method`` as users know it.
YAML_ALIASES: dict[str, str] = {"preference": "training", "rl": "training"}

# hftk's defaults for TrainingArguments fields, where the HF default does not suit fine-tuning here.
TRAINING_DEFAULTS: dict[str, Any] = dict(
    output_dir="outputs/run", per_device_train_batch_size=8, per_device_eval_batch_size=8,
    learning_rate=5e-4, warmup_steps=10, lr_scheduler_type="cosine", num_train_epochs=2.0,
    logging_steps=5, eval_strategy="steps", eval_steps=50, save_strategy="steps", save_steps=50, save_total_limit=3,
    report_to=["tensorboard"], ddp_find_unused_parameters=False, ddp_timeout=600, dataloader_num_workers=0,
    max_grad_norm=1.0, seed=42,
)


@dataclass
class RunConfig:
    """Everything one run needs, validated before any process group exists."""

    model: ModelConfig
    data: DataConfig
    strategy: StrategyConfig
    tracking: TrackingConfig
    samples: SamplesConfig
    hub: HubConfig
    resilience: ResilienceConfig
    preference: PreferenceConfig
    rl: RLConfig
    training: dict[str, Any]
    # Training options the user set (command line or YAML), even to TrainingArguments' own default,
    # which ``training`` leaves out: an engine whose choice differs from that default reads it here.
    given: frozenset[str] = frozenset()

    @property
    def output_dir(self) -> Path:
        return Path(self.training["output_dir"])

    @functools.cached_property
    def args(self) -> SimpleNamespace:
        """The training options resolved once, as attributes named like ``TrainingArguments``'
        (``cfg.args.logging_steps``): what the run set, else hftk's ``TRAINING_DEFAULTS``, else
        TrainingArguments' own default. Read options here rather than ``cfg.training.get(key, default)``:
        a call-site default can only disagree with these."""
        return SimpleNamespace(**{**training_defaults(), **self.training})

    def to_dict(self) -> dict[str, Any]:
        """The YAML form of this config (what ``--config`` accepts)."""
        sections = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS if name not in YAML_ALIASES}
        training = {**dataclasses.asdict(self.preference), **dataclasses.asdict(self.rl), **self.training}
        return {**sections, "training": training}


def _training_fields() -> dict[str, dataclasses.Field]:
    from transformers import TrainingArguments

    return {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}


def build_parser() -> argparse.ArgumentParser:
    """One parser over every section; help text comes from the dataclass metadata."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser([*SECTIONS.values(), TrainingArguments], prog="hftk train", exit_on_error=False,
                              description="Fine-tune a causal LM. Options may also come from --config run.yaml "
                              f"(sections: {', '.join([*SECTIONS, 'training'])}); command-line options override "
                              "the file.")
    parser.add_argument("--config", default=None, help="YAML file with the run configuration.")
    # HfArgumentParser reads ``report_to: None | str | list[str]`` as one string: several reporters
    # (``--report_to wandb tensorboard``, or ``wandb,tensorboard``) need a list.
    report_to = next(a for a in parser._actions if "--report_to" in a.option_strings)
    report_to.nargs, report_to.type = "+", None
    report_to.help = "where metrics go: one or more of the Trainer's reporters (tensorboard, wandb, ...), or none"
    parser.set_defaults(**TRAINING_DEFAULTS)
    return parser


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HftkError("--config", f"cannot read {path}: {exc.strerror}.", "pass an existing YAML file.") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise HftkError("--config", f"{path} is not valid YAML{at}.", "fix the YAML syntax.") from None
    if not isinstance(data, dict):
        raise HftkError("--config", f"{path} must be a mapping of sections.", "use sections like 'model:', 'training:'.")
    return data


def _flatten_yaml(data: dict[str, Any]) -> dict[str, Any]:
    """Check every key belongs to its section and return one flat option dict."""
    known = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items() if name not in YAML_ALIASES}
    known["training"] = set(_training_fields()).union(
        *({f.name for f in dataclasses.fields(SECTIONS[name])} for name in YAML_ALIASES))
    flat: dict[str, Any] = {}
    for section, values in data.items():
        if section not in known:
            raise HftkError(f"config.{section}", "is not a section.", f"use one of: {', '.join(sorted(known))}.")
        if not isinstance(values, dict):
            raise HftkError(f"config.{section}", "must be a mapping of options.", "indent its options under it.")
        for key, value in values.items():
            if key not in known[section]:
                owner = next((s for s, keys in known.items() if key in keys), None)
                fix = f"move it under '{owner}:'." if owner else f"see `hftk train --help` for {section} options."
                raise HftkError(f"{section}.{key}", "is not an option of this section.", fix)
            flat[key] = value
    return flat


def load_config(argv: list[str] | None = None) -> RunConfig:
    """Parse ``--config`` YAML plus command-line overrides into a :class:`RunConfig`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    config_path = _config_path(argv)
    from_yaml = _flatten_yaml(_read_yaml(config_path)) if config_path else {}
    parser.set_defaults(**from_yaml)
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise HftkError(exc.argument_name or "option", f"{exc.message}.", "see `hftk train --help`.") from None
    if unknown:
        bad = next((u for u in unknown if u.startswith("-")), unknown[0])
        raise HftkError(bad, "is not a known option.", "see `hftk train --help` for the options.")
    # argparse fills a namespace attribute with its default only when absent: pre-set to a marker,
    # the attributes left holding it are the options the command line did not give.
    unset = object()
    probe, _ = parser.parse_known_args(argv, namespace=argparse.Namespace(**{k: unset for k in vars(namespace)}))
    given = {k for k, v in vars(probe).items() if v is not unset} | set(from_yaml)
    values = vars(namespace)
    values.pop("config", None)
    sections = {name: cls(**{f.name: values.pop(f.name) for f in dataclasses.fields(cls)})
                for name, cls in SECTIONS.items()}
    resolve_method_defaults(sections["preference"], sections["rl"])
    training_fields = _training_fields()
    training = {k: v for k, v in values.items()
                if k in training_fields and v not in (None, field_default(training_fields[k]))}
    for key in TRAINING_DEFAULTS:
        training[key] = values[key]
    if isinstance(training.get("report_to"), list):  # "none" and "all" are the Trainer's words, not reporters
        names = [name for item in training["report_to"] for name in str(item).split(",") if name]
        training["report_to"] = names[0] if names in (["none"], ["all"]) else names
    # The declared annotations: HfArgumentParser narrows the fields' ``type`` in place (``int | None`` -> int).
    for name, section in sections.items():
        for f in dataclasses.fields(section):
            _check_value(f"{name}.{f.name}", getattr(section, f.name), type(section).__annotations__[f.name],
                         f.metadata.get("choices"))
    from transformers import TrainingArguments

    declared = {k: v for cls in reversed(TrainingArguments.__mro__) for k, v in getattr(cls, "__annotations__", {}).items()}
    for key, value in training.items():
        if declared.get(key) in (int, float, bool):
            _check_value(f"training.{key}", value, declared[key].__name__, None)
    return RunConfig(**sections, training=training, given=frozenset(given & set(training_fields)))


def resolve_method_defaults(preference: PreferenceConfig, rl: RLConfig) -> None:
    """The options whose unset value means a method's TRL default (``beta``, ``loss_type``), resolved once; and
    ``--reward_funcs a.py:f,b.py:g`` (one argument) as the list YAML writes."""
    defaults = METHOD_DEFAULTS.get(preference.method, METHOD_DEFAULTS["dpo"])  # sft reads neither
    for name, value in defaults.items():
        if getattr(preference, name) is None:
            setattr(preference, name, value)
    if isinstance(rl.reward_funcs, str):
        rl.reward_funcs = [rl.reward_funcs]
    if rl.reward_funcs is not None:
        rl.reward_funcs = [part.strip() for item in rl.reward_funcs for part in str(item).split(",") if part.strip()]


def training_defaults() -> dict[str, Any]:
    """Every TrainingArguments option's value in a run that does not set it (None where the field has no default)."""
    own = {name: field_default(f) for name, f in _training_fields().items()}
    return {**{k: None if v is dataclasses.MISSING else v for k, v in own.items()}, **TRAINING_DEFAULTS}


SCALARS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _check_value(name: str, value: Any, annotation: str, choices: list[str] | None) -> None:
    """Type and choice of one option. argparse checks the command line; a YAML value reaches here
    unconverted (``block_size: big``, ``strategy: zero9``), so the schema is checked once for both."""
    kinds = annotation.split(" | ")
    if value is None and "None" in kinds:
        return
    accepted = SCALARS.get(kinds[0])
    if accepted is None:
        return  # lists, dicts, unions of other types: their readers check them
    if isinstance(value, bool) and bool not in accepted or not isinstance(value, accepted):
        raise HftkError(name, f"must be {'an' if kinds[0] == 'int' else 'a'} {kinds[0]}, got {value!r}.",
                        f"write a {kinds[0]} value for {name}.")
    if choices and value not in choices:
        raise HftkError(name, f"'{value}' is not one of {', '.join(choices)}.", f"use one of: {', '.join(choices)}.")


def field_default(f: dataclasses.Field) -> Any:
    """The field's default (``dataclasses.MISSING`` when it has none)."""
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise HftkError("--config", "needs a file path.", "write --config run.yaml.")
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def is_main_process() -> bool:
    """Rank 0 according to the launcher's environment (valid before the process group exists)."""
    return int(os.environ.get("RANK", "0")) == 0
