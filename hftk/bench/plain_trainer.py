"""The plain ``transformers.Trainer`` script ``hftk bench startup`` compares hftk's start-up with.

``python plain_trainer.py MODEL_DIR TEXT_FILE OUT_JSON --block_size N --micro_batch N --max_steps N``,
under the same launcher as hftk (torchrun; DDP over gloo on CPU). What a user writes without hftk:
run_clm's data recipe (the ``text`` loader, tokenise, concatenate, cut into blocks), ``from_pretrained``
from a local folder, ``TrainingArguments`` and ``Trainer``. It is run by path and imports nothing from
hftk, so it pays only the libraries' start-up. It closes the same phases as :mod:`hftk.core.startup` (no
``prepare``: it validates nothing) and rank 0 writes them to OUT_JSON at its first optimizer step.
"""

import argparse
import json
import os
import sys
import time

import psutil
from transformers import (AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments,
                          default_data_collator)

ENDS: dict[str, float] = {"imports": time.time()}


class FirstStep(TrainerCallback):
    """Closes ``first_step`` and writes the phases (rank 0)."""

    def __init__(self, out: str) -> None:
        self.out, self.done = out, False

    def on_step_end(self, args, state, control, **kwargs):
        if self.done:
            return
        self.done = True
        ENDS["first_step"] = time.time()
        if state.is_world_process_zero:
            previous = start = psutil.Process().create_time()
            seconds = {}
            for phase, end in ENDS.items():
                seconds[phase], previous = round(end - previous, 3), end
            with open(self.out, "w") as f:
                json.dump({**seconds, "total": round(previous - start, 3)}, f)


def blocks(text_file: str, tokenizer, block_size: int):
    import datasets

    raw = datasets.load_dataset("text", data_files={"train": text_file})["train"]
    raw = raw.filter(lambda row: bool(row["text"].strip()))
    ids = raw.map(lambda b: {"input_ids": [x + [tokenizer.eos_token_id] for x in tokenizer(b["text"])["input_ids"]]},
                  batched=True, remove_columns=["text"])

    def group(batch):  # run_clm's group_texts
        flat = sum(batch["input_ids"], [])
        cut = [flat[i:i + block_size] for i in range(0, len(flat) // block_size * block_size, block_size)]
        return {"input_ids": cut, "labels": [list(x) for x in cut], "attention_mask": [[1] * len(x) for x in cut]}

    return ids.map(group, batched=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("text")
    p.add_argument("out")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--max_steps", type=int, default=2)
    a = p.parse_args(argv)
    args = TrainingArguments(output_dir=os.path.join(os.path.dirname(a.out), "plain-run"), use_cpu=True,
                             max_steps=a.max_steps, per_device_train_batch_size=a.micro_batch, logging_steps=1,
                             save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
                             lr_scheduler_type="constant", optim="adamw_torch_fused")
    _ = args.world_size  # starts the process group, as hftk's TrainingArguments do
    ENDS["process_group"] = time.time()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    with args.main_process_first(desc="tokenize"):
        train = blocks(a.text, tokenizer, a.block_size)
    ENDS["data"] = time.time()
    model = AutoModelForCausalLM.from_pretrained(a.model, use_kernels=False)  # hftk's layers (its default): hub kernels are fetched
    ENDS["model"] = time.time()
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator,
                      callbacks=[FirstStep(a.out)])
    ENDS["trainer"] = time.time()
    trainer.train()
    trainer.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
