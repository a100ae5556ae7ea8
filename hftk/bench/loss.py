"""``hftk bench memory --loss_vocab V``: what the loss holds, plain against chunked (:mod:`hftk.models.loss`),
side by side in one run, at a vocabulary users train (151,936: Qwen's) and long sequences.

A Qwen2-shaped model of ``V`` tokens (hidden 256, 2 layers: the vocabulary is nearly all of it, as in the issue's
measure) trains one rank for a few steps per (tokens, loss) cell through :mod:`hftk.bench.memory_worker`; a
2,048-token-vocabulary twin at the same length is the baseline. The loss's bytes are a run's peak minus its counted
model state, minus the same for the twin (whose logits are negligible): the backbone's activations, the runtime and
the data cancel out. A cell the plan puts above the memory this machine has free is not run, and says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

from hftk.bench.launch import threads_per_rank, torchrun_module
from hftk.plan.estimate import GIB, MIB

BASELINE_VOCAB = 2048  # the built-in tokenizer's size: every token id of the corpus fits
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}
SHARE_TARGET = 0.15  # chunked's loss bytes at most this share of plain's at the longest length (issue 52)
STEP_TARGET = 1.1  # chunked's step time at most this multiple of plain's


def make_model(folder: Path, vocab: int, tokens: int) -> Path:
    """A Qwen2-shaped model of ``vocab`` tokens and the built-in tokenizer, saved as a user's folder would be."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hftk.data.builtin import materialize_model

    if not (folder / "config.json").exists():
        config = AutoConfig.for_model("qwen2", vocab_size=vocab, max_position_embeddings=max(tokens, 4096),
                                      tie_word_embeddings=False, **SHAPE)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(materialize_model("builtin:gpt2-tiny")).save_pretrained(folder)
    return folder


def free_bytes() -> int:
    """MemAvailable: what this machine can still give a run."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_loss_rows(out_dir: Path, argv: list[str], vocab: int, lengths: tuple[int, ...], steps: int,
                  timeout: float, predict: Callable[..., dict[str, Any]], step_time: Callable[[Path], float]
                  ) -> dict[str, Any]:
    """Every (length, loss) cell and its baseline on one rank; ratios chunked / plain per length. ``predict`` and
    ``step_time``: :mod:`hftk.bench.memory`'s (the plan of a run, a run's median step time)."""
    cells: dict[str, Any] = {}
    for tokens in lengths:
        models = {"baseline": make_model(out_dir / f"model-{BASELINE_VOCAB}", BASELINE_VOCAB, max(lengths)),
                  "plain": make_model(out_dir / f"model-{vocab}", vocab, max(lengths))}
        models["chunked"] = models["plain"]
        runs = {}
        for name, model in models.items():
            args = [*argv, "--model_name_or_path", str(model), "--block_size", str(tokens),
                    "--per_device_train_batch_size", "1", "--max_steps", str(steps), "--strategy", "ddp",
                    "--loss_implementation", "plain" if name == "plain" else "chunked"]
            planned = predict(args, 1, ("ddp",))["ddp"].device_total
            if planned > free_bytes():
                runs[name] = {"skipped": f"the plan puts it at {planned / GIB:.1f} GiB, more than the "
                                         f"{free_bytes() / GIB:.1f} GiB free here"}
                continue
            work = out_dir / f"loss-{tokens}-{name}"
            launch = torchrun_module(1, "hftk.bench.memory_worker",
                                     [*args, "--output_dir", str(work / "run"), "--memory_out", str(work / "memory.json")],
                                     work, timeout, threads_per_rank(1))
            record = json.loads((work / "memory.json").read_text())["ranks"][0]
            runs[name] = {"peak_mib": record["peak"] / MIB, "model_state_mib": record["total"] / MIB,
                          "plan_peak_mib": planned / MIB, "step_time_s": step_time(work / "run" / "metrics.jsonl"),
                          "wall_s": launch.wall_s}
        base = runs["baseline"]
        for name in ("plain", "chunked"):
            run = runs[name]
            if "peak_mib" in run and "peak_mib" in base:
                run["loss_mib"] = (run["peak_mib"] - run["model_state_mib"]) - (base["peak_mib"] - base["model_state_mib"])
        if all("loss_mib" in runs[n] for n in ("plain", "chunked")):
            runs["chunked"]["loss_vs_plain"] = runs["chunked"]["loss_mib"] / runs["plain"]["loss_mib"]
            runs["chunked"]["peak_vs_plain"] = runs["chunked"]["peak_mib"] / runs["plain"]["peak_mib"]
            runs["chunked"]["step_time_vs_plain"] = runs["chunked"]["step_time_s"] / runs["plain"]["step_time_s"]
        cells[str(tokens)] = runs
    longest = cells[str(max(lengths))]["chunked"]
    targets = {}
    if "loss_vs_plain" in longest:
        targets = {"loss_share": longest["loss_vs_plain"] <= SHARE_TARGET,
                   "step_time": longest["step_time_vs_plain"] <= STEP_TARGET}
    return {"vocab": vocab, "shape": SHAPE, "cells": cells, "targets": targets, "cpus": os.cpu_count()}


def markdown_rows(result: dict[str, Any]) -> list[str]:
    """The loss table: one row per (tokens, loss)."""
    lines = [f"Loss at a {result['vocab']:,}-token vocabulary (Qwen2-shaped, hidden 256, 2 layers, one rank, "
             f"batch 1); loss MiB = peak - model state, less the same for a {BASELINE_VOCAB:,}-token twin:", "",
             "| tokens | loss | peak MiB | plan peak MiB | loss MiB | loss x plain | peak x plain | step s | step x plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for tokens, runs in result["cells"].items():
        for name in ("baseline", "plain", "chunked"):
            r = runs[name]
            if "skipped" in r:
                lines.append(f"| {tokens} | {name} | not run: {r['skipped']} | | | | | | |")
                continue
            ratio = (lambda key: f"{r[key]:.3f}" if key in r else "-")
            lines.append(f"| {tokens} | {name} | {r['peak_mib']:.0f} | {r['plan_peak_mib']:.0f} | "
                         f"{r.get('loss_mib', 0):.0f} | {ratio('loss_vs_plain')} | {ratio('peak_vs_plain')} | "
                         f"{r['step_time_s']:.2f} | {ratio('step_time_vs_plain')} |")
    return [*lines, ""]
