"""GRPO test plumbing shared by the 2-rank runs (tests/workers/grpo_*.py) and the one-process TRL references
(tests/integration/test_grpo.py): the reward functions the runs name by path, the test hook that pins completions,
a model whose completions end at EOS at uneven lengths, and TRL's own GRPOTrainer as the reference.

Why completions are pinned for the parity runs: TRL samples each rank's completions as one batch from that rank's
torch generator (seeded ``seed + rank``), so 2 ranks and one process draw different completions from the same
weights, and every later step differs. :func:`seeded_per_row` (installed on TRL's ``_generate_single_turn``, below
hftk's lock-step wrapper, identically in both runs) generates each completion alone -- still through the model as
the strategy holds it, sharded and in lock-step -- from a generator seeded by (step, the row's place in the global
batch), which one process reproduces row for row.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

SEED = 1234
WORDS = "blue cat dog moon lamp rock".split()  # one token each (built-in tokenizer): every prompt as long


# ---- reward functions (named by path: tests/grpo_rollouts.py:NAME) ----

def e_share(completions, **kwargs):
    """Dense and learnable from random weights: the share of a completion's characters that are 'e'."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def says_word(completions, word, **kwargs):
    """1 when the completion holds the prompt's word (the ``word`` column), else 0: a column read by keyword."""
    return [float(w in c) for c, w in zip(completions, word)]


def short_on_rank_1(completions, **kwargs):
    """Wrong on one rank only (as a reward that fails on some rows would be): one reward too few on rank 1."""
    return [0.0] * (len(completions) - (os.environ.get("RANK") == "1"))


def text_reward(completions, **kwargs):
    return ["high"] * len(completions)


def nan_reward(completions, **kwargs):
    return [float("nan")] * len(completions)


def raising_reward(completions, **kwargs):
    raise KeyError("answer")


# ---- data and model ----

def prompt_rows(path: Path, rows: int) -> Path:
    """``rows`` prompts of equal token length, each with a ``word`` column."""
    with path.open("w") as f:
        for i in range(rows):
            word = WORDS[i % len(WORDS)]
            f.write(json.dumps({"prompt": f"Say {word}:", "word": word}) + "\n")
    return path


def eos_prone_model(folder: Path, eos_logit: float = 4.5) -> Path:
    """The built-in tiny GPT-2 with EOS's logit raised by ``eos_logit`` (the final norm's bias moved along the tied
    EOS embedding): sampled completions end at EOS after a few tokens, at different lengths on each rank, so the
    ranks' ``generate`` calls end at different forwards and only lock-step keeps their collectives paired."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftk.data.builtin import materialize_model

    source = materialize_model("builtin:gpt2-tiny")
    # no dropout (as hftk's --model_dropout 0): TRL's one-process reference runs the same forwards
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, resid_pdrop=0.0, embd_pdrop=0.0,
                                                 attn_pdrop=0.0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    eos = model.transformer.wte.weight[tokenizer.eos_token_id].detach()
    with torch.no_grad():
        model.transformer.ln_f.bias.add_(eos_logit * eos / eos.dot(eos))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ---- the test hook ----

def seeded_per_row(original: Any) -> Any:
    """TRL's ``_generate_single_turn`` made world-size independent (module doc); each rank also appends what it
    generated at each step (lengths, EOS) to ``HFTK_TEST_GENERATIONS/rank-R.jsonl`` when that is set."""

    @functools.wraps(original)
    def generate(self: Any, prompt_ids: list, images: Any, multimodal_fields: Any, num_generations: int,
                 has_tool_images: bool = False) -> tuple[list, None]:
        rank, rows, step = self.accelerator.process_index, len(prompt_ids), self.state.global_step
        completions = []
        for index, ids in enumerate(prompt_ids):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED + 100_003 * step + rank * rows + index)
                one, _ = original(self, [ids], images, multimodal_fields, num_generations, has_tool_images)
            completions.append(one[0])
        folder = os.environ.get("HFTK_TEST_GENERATIONS")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            with open(Path(folder) / f"rank-{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "lengths": [len(c) for c in completions],
                                    "eos": [bool(c) and c[-1] in self.eos_token_ids for c in completions]}) + "\n")
        return completions, None

    return generate


def install() -> None:
    """The hook on TRL's class (hftk's trainer reaches it through ``super()``)."""
    from trl import GRPOTrainer

    if not getattr(GRPOTrainer._generate_single_turn, "__wrapped__", None):
        GRPOTrainer._generate_single_turn = seeded_per_row(GRPOTrainer._generate_single_turn)


def uninstall() -> None:
    from trl import GRPOTrainer

    GRPOTrainer._generate_single_turn = getattr(GRPOTrainer._generate_single_turn, "__wrapped__",
                                                GRPOTrainer._generate_single_turn)


# ---- the reference: TRL's own GRPOTrainer, one process ----

def trl_reference(model_dir: Path, data: Path, out: Path, reward: Any, *, steps: int, batch: int, generations: int,
                  completion: int, beta: float, learning_rate: float, lora: bool = False) -> tuple[list[dict], dict,
                                                                                                   list[dict]]:
    """TRL's GRPOTrainer in this process on the global batch, fp32 (bf16 and gradient checkpointing off: GRPOConfig
    turns both on by default), completions pinned by :func:`seeded_per_row`: (its per-step logs, its final weights
    (the adapter's under ``lora``: PEFT's LoRA of hftk's default config and seed), its completions per logging step
    as TRL keeps them for ``log_completions``)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)  # lora_A's draw, as hftk seeds it
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True))
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=batch, num_generations=generations,
                      max_completion_length=completion, max_steps=steps, learning_rate=learning_rate,
                      lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, seed=7, report_to=[],
                      save_strategy="no", use_cpu=True, bf16=False, gradient_checkpointing=False, beta=beta,
                      max_grad_norm=1.0, adam_epsilon=1e-4, disable_tqdm=True)
    rows: list[dict] = []

    class KeepCompletions(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "reward" in logs:
                rows.extend({"step": state.global_step, "prompt": p, "completion": c}
                            for p, c in zip(trainer._logs["prompt"], trainer._logs["completion"]))

    install()
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=AutoTokenizer.from_pretrained(
            model_dir), train_dataset=datasets.load_dataset("json", data_files=str(data))["train"],
            callbacks=[KeepCompletions()])
        trainer.train()
    finally:
        uninstall()
    trainer.save_model(str(out / "final"))
    logs = [row for row in trainer.state.log_history if "reward" in row]
    from safetensors.torch import load_file

    weights = load_file(str(out / "final" / ("adapter_model.safetensors" if lora else "model.safetensors")))
    return logs, weights, rows
