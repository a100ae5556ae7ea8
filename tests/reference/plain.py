"""Reference training runs that owe nothing to hftk: ``python tests/reference/plain.py {trainer,loop} ...``.

The suite's parity tests used to compare hftk's distributed engines with hftk's own engine on one
process, so a mistake shared by both (data, loss, optimizer, schedule) could not show. This script
imports nothing from hftk (``tests/unit/test_references.py`` reads its imports; every run lists the hftk
modules loaded, which ``tests/helpers.plain_reference`` requires to be none) and rebuilds everything
from the same local model folder and text file:

- data: run_clm's recipe -- the ``text`` loader, the first ``max_train_samples`` rows,
  ``train_test_split(eval_fraction, seed)`` for the held-out rows, empty lines dropped, each line
  tokenised with the tokenizer's own special tokens plus an eos, concatenated per 1000 rows
  (``datasets.map``'s batch) and cut into ``block_size`` blocks (the remainder dropped);
- ``trainer``: a plain ``transformers.Trainer`` on one process (its own RandomSampler seeded by
  ``seed``, its own AdamW, schedule, clipping and loss);
- ``loop``: a plain PyTorch loop: batches in the order the Trainer's seedable sampler draws them
  (``torch.randperm`` seeded with ``seed + epoch``), ``model(**batch).loss``, ``torch.optim.AdamW``
  (no decay on 1-D parameters), ``transformers.get_scheduler``, ``clip_grad_norm_``.

Writes ``OUT/losses.json`` (per-step loss, grad norm, learning rate, the Trainer's epoch; final held-out loss with
``--eval``; whether any hftk module was loaded) and the final weights to ``OUT/final``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

DROPOUT_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("trainer", "loop"))
    p.add_argument("--model", required=True, help="a local model folder (config, weights, tokenizer)")
    p.add_argument("--text", required=True, help="a local text file, one example per line")
    p.add_argument("--out", required=True)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--max_train_samples", type=int, default=1500)
    p.add_argument("--eval_fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--lr_scheduler_type", default="constant")
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--adam_epsilon", type=float, default=1e-8)
    p.add_argument("--optim", choices=("adamw_torch", "adamw_torch_fused"), default="adamw_torch_fused",
                   help="torch's AdamW, foreach or fused (the Trainer's default on torch >= 2.8)")
    p.add_argument("--loss_divisor", choices=("targets", "labels"), default="targets",
                   help="loop (training and held-out loss): divide the summed loss by the predicted tokens (the "
                        "mean, block - 1 per row) or by every label, as the Trainer counts num_items_in_batch for a "
                        "model without a ForCausalLM loss_type (GPT-2)")
    p.add_argument("--eval", action="store_true", help="also the held-out loss of the final weights")
    p.add_argument("--micro_batches", type=int, default=1, help="loop: each batch in this many contiguous "
                   "micro-batches, one backward each (the cross-entropy over the whole batch's tokens; a mixture of "
                   "experts' balancing loss weighted by its config's coefficient over this number)")
    p.add_argument("--experts_implementation", default=None, help="a mixture of experts' transformers "
                   "experts_implementation (eager, batched_mm, grouped_mm)")
    p.add_argument("--lora_r", type=int, default=0, help="train a LoRA adapter of this rank on PEFT's own "
                   "'all-linear' targets and a mixture of experts' 3-D expert weights (alpha 16, no dropout), lora_A "
                   "drawn right after torch.manual_seed(seed), the convention hftk documents for every rank and a "
                   "one-process run")
    return p.parse_args(argv)


def blocks(args: argparse.Namespace, tokenizer: Any) -> tuple[Any, Any]:
    """(train, held-out) datasets of ``input_ids`` / ``labels`` / ``attention_mask`` blocks."""
    import datasets

    raw = datasets.load_dataset("text", data_files={"train": args.text})["train"]
    raw = raw.select(range(min(args.max_train_samples, len(raw))))
    split = raw.train_test_split(test_size=args.eval_fraction, seed=args.seed, shuffle=True)

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer(batch["text"])["input_ids"]
        return {"input_ids": [x + [tokenizer.eos_token_id] for x in ids]}

    def group_texts(batch: dict[str, list]) -> dict[str, list]:  # run_clm's
        ids = sum(batch["input_ids"], [])
        total = len(ids) // args.block_size * args.block_size
        cut = [ids[i:i + args.block_size] for i in range(0, total, args.block_size)]
        return {"input_ids": cut, "labels": [list(x) for x in cut], "attention_mask": [[1] * len(x) for x in cut]}

    def build(ds: Any) -> Any:
        ds = ds.filter(lambda row: bool(row["text"].strip()))
        ds = ds.map(tokenize, batched=True, remove_columns=["text"])
        return ds.map(group_texts, batched=True).with_format("torch")

    return build(split["train"]), build(split["test"])


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(args.model)
    for field in DROPOUT_FIELDS:  # deterministic: both sides train without dropout
        if hasattr(config, field):
            setattr(config, field, 0.0)
    extra = {"experts_implementation": args.experts_implementation} if args.experts_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, config=config, dtype=torch.float32, **extra)
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())  # GPT-2 stores (in, out)
        # a mixture of experts' fused expert weights: 3-D parameters (expert dimension first), by their last names
        experts = sorted({".".join(n.split(".")[-3:]) for n, p in model.named_parameters() if p.ndim == 3})
        # beside them, every nn.Linear but the head by name (what all-linear selects): PEFT maps the keyword
        # all-linear on a transformers-5 mixture of experts through its v4 names, adding the router (a v4 Linear
        # named gate, a plain module in v5) as a target parameter
        head = model.get_output_embeddings()
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and m is not head})
        torch.manual_seed(args.seed)
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                 target_modules=linear if experts else "all-linear",
                                                 fan_in_fan_out=conv1d, target_parameters=experts or None,
                                                 task_type="CAUSAL_LM"))
    return model, AutoTokenizer.from_pretrained(args.model)


def run_trainer(args: argparse.Namespace, model: Any, train: Any, held_out: Any) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments, default_data_collator

    targs = TrainingArguments(
        output_dir=str(Path(args.out) / "trainer"), use_cpu=True, seed=args.seed, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate, lr_scheduler_type=args.lr_scheduler_type, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, optim=args.optim,
        adam_epsilon=args.adam_epsilon, logging_steps=1,
        save_strategy="no",
        eval_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=train, eval_dataset=held_out,
                      data_collator=default_data_collator)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out: dict[str, Any] = {"losses": {h["step"]: h["loss"] for h in logs},
                           "grad_norms": {h["step"]: h["grad_norm"] for h in logs},
                           "learning_rates": {h["step"]: h["learning_rate"] for h in logs},
                           "epochs": {h["step"]: h["epoch"] for h in logs}}
    if args.eval:
        out["eval_loss"] = trainer.evaluate()["eval_loss"]
    return out


def run_loop(args: argparse.Namespace, model: Any, train: Any, held_out: Any) -> dict[str, Any]:
    from transformers import get_scheduler, set_seed

    set_seed(args.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, eps=args.adam_epsilon,
                                  fused=args.optim == "adamw_torch_fused" or None)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.max_steps)
    per_epoch = len(train) // args.batch_size
    out: dict[str, Any] = {"losses": {}, "grad_norms": {}, "learning_rates": {}}
    moe = {}
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT: the model inside
    if hasattr(causal, "router_aux_loss_coef"):  # a mixture of experts: its balancing loss, mean over micro-batches
        moe = {"output_router_logits": True}
        causal.router_aux_loss_coef = causal.config.router_aux_loss_coef / args.micro_batches
    for step in range(1, args.max_steps + 1):
        epoch, i = divmod(step - 1, per_epoch)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + epoch))
        rows = train[order[i * args.batch_size:(i + 1) * args.batch_size]]
        batch = {k: rows[k] for k in ("input_ids", "labels", "attention_mask")}
        # the Trainer's num_items_in_batch: every label for a model without loss_type, else the predicted tokens
        labels = batch["labels"] if args.loss_divisor == "labels" else batch["labels"][:, 1:]
        count = labels.ne(-100).sum()
        loss = torch.zeros(())
        for chunk in range(args.micro_batches):  # contiguous micro-batches, each one backward
            part = {k: v.chunk(args.micro_batches)[chunk] for k, v in batch.items()}
            part_loss = model(**part, num_items_in_batch=count, **moe).loss
            part_loss.backward()
            loss = loss + part_loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        out["learning_rates"][step] = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"][step], out["grad_norms"][step] = loss.item(), norm.item()
    if args.eval:
        out["eval_loss"] = held_out_loss(model, held_out, args.batch_size, args.loss_divisor)
    return out


@torch.no_grad()
def held_out_loss(model: Any, held_out: Any, batch_size: int, divisor: str) -> float:
    """Summed next-token loss of the held-out blocks over the predicted tokens (or every label: ``divisor``)."""
    model.eval()
    total = count = 0.0
    for start in range(0, len(held_out), batch_size):
        rows = held_out[start:start + batch_size]
        logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
        targets = rows["labels"][:, 1:]
        total += float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(),
                                                         reduction="sum", ignore_index=-100))
        count += float((targets if divisor == "targets" else rows["labels"]).ne(-100).sum())
    return total / count


def main(argv: list[str]) -> int:
    args = parse(argv)
    model, tokenizer = load(args)
    train, held_out = blocks(args, tokenizer)
    result = (run_trainer if args.mode == "trainer" else run_loop)(args, model, train, held_out)
    model.save_pretrained(Path(args.out) / "final")
    result["train_blocks"], result["held_out_blocks"] = len(train), len(held_out)
    result["hftk_loaded"] = sorted(m for m in sys.modules if m == "hftk" or m.startswith("hftk."))
    (Path(args.out) / "losses.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
