"""The run record (``hftk_run.json``) and the model card generated from it.

A leaf beside :mod:`hftk.publish.hub`: the engines write both into every checkpoint and ``final/``, and a
merged LoRA export writes its own, so neither the exporter nor LoRA needs the Hub module.
"""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Any

from hftk import __version__
from hftk.data.dataset import describe as describe_datasets

RUN_FILE = "hftk_run.json"  # config, world size, step and final metrics: the model card's source
CARD_FILE = "README.md"


def is_hub_id(name: str) -> bool:
    """A string that names a Hub repository (not a local path, not a built-in)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name)) and not Path(name).exists()


HYPERPARAMETERS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "per_device_train_batch_size",
                   "gradient_accumulation_steps", "num_train_epochs", "max_steps", "optim", "weight_decay",
                   "max_grad_norm", "bf16", "fp16", "seed")


def run_record(cfg: Any, args: Any, world_size: int, data_format: str, step: int,
               metrics: dict[str, float] | None = None, data_parallel_size: int | None = None) -> dict[str, Any]:
    """What the model card is generated from (the Trainer's effective values, not just what was typed).

    ``world_size`` counts processes; ``data_parallel_size`` (default: all of them) the replicas that
    read different samples, which is what the global batch multiplies (pipeline stages and tp / cp /
    sp ranks of one replica read the same ones).
    """
    replicas = world_size if data_parallel_size is None else data_parallel_size
    hyper = {k: getattr(getattr(args, k), "value", getattr(args, k)) for k in HYPERPARAMETERS}
    hyper["global_batch_size"] = args.per_device_train_batch_size * args.gradient_accumulation_steps * replicas
    hyper["block_size"] = cfg.data.block_size
    if cfg.model.lora_r:
        hyper.update(lora_r=cfg.model.lora_r, lora_alpha=cfg.model.lora_alpha, lora_dropout=cfg.model.lora_dropout)
    if cfg.preference.method == "dpo":
        hyper.update(method="dpo", beta=cfg.preference.beta, loss_type=cfg.preference.loss_type)
    if cfg.preference.method == "grpo":
        r = cfg.rl
        hyper.update(method="grpo", beta=cfg.preference.beta, loss_type=cfg.preference.loss_type,
                     reward_funcs=",".join(r.reward_funcs or []), num_generations=r.num_generations or 8,
                     max_completion_length=r.max_completion_length or 512, temperature=cfg.samples.temperature)
    return {"hftk_version": __version__, "config": cfg.to_dict(), "world_size": world_size,
            "data_parallel_size": replicas, "data_format": data_format,
            "datasets": describe_datasets(cfg.data), "hyperparameters": hyper, "global_step": step,
            "metrics": dict(metrics or {})}


def _write_new(path: Path, text: str) -> None:
    """Write ``path`` as a new file: a hard-linked snapshot must never write through into a checkpoint."""
    path.unlink(missing_ok=True)
    path.write_text(text)


def save_run_record(folder: Path, record: dict[str, Any]) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    _write_new(Path(folder) / RUN_FILE, json.dumps(record, indent=1, sort_keys=True, default=str))


def merged_note(model: dict[str, Any]) -> str:
    """How a merged LoRA model's weights came about: a QLoRA adapter merges into its base dequantized."""
    bits = 4 if model.get("load_in_4bit") else 8 if model.get("load_in_8bit") else 0
    if not bits:
        return " (LoRA adapter merged into the base weights)."
    kind = f"{model.get('bnb_4bit_quant_type', 'nf4')}, " if bits == 4 else ""
    return (f" (QLoRA adapter merged into the base dequantized from its {bits}-bit ({kind}bitsandbytes) training "
            "copy: full-precision weights, equal to the quantized base the adapter was trained on plus the adapter, "
            "not to the original base's weights plus the adapter).")


def write_run_files(folder: Path, record: dict[str, Any], repo_id: str | None) -> None:
    """``hftk_run.json`` plus the ``README.md`` model card into ``folder``."""
    save_run_record(folder, record)
    _write_new(Path(folder) / CARD_FILE, model_card(record, repo_id))


def _versions() -> dict[str, str]:
    import torch
    import transformers

    versions = {"hftk": __version__, "transformers": transformers.__version__, "torch": torch.__version__}
    for name in ("accelerate", "deepspeed", "peft", "datasets"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            continue
    versions["python"] = platform.python_version()
    return versions


def model_card(record: dict[str, Any], repo_id: str | None) -> str:
    """A Hub model card: metadata header, then base model, data, strategy, hyperparameters, results."""
    import yaml

    cfg = record["config"]
    model, data, strategy = cfg["model"], cfg["data"], cfg["strategy"]
    base, dataset = model["model_name_or_path"], data["dataset"]
    adapter = bool(model.get("lora_r")) and not record.get("merged")  # a LoRA run pushes its adapter unless merged
    meta: dict[str, Any] = {"library_name": "peft" if adapter else "transformers",
                            "tags": ["hftk", "fine-tuned", strategy["strategy"]], "pipeline_tag": "text-generation"}
    if is_hub_id(base):
        meta["base_model"] = base
    sources = record.get("datasets") or [{"path": dataset, "split": data["train_split"], "format": data["data_format"]}]
    if any(is_hub_id(d["path"]) for d in sources):
        meta["datasets"] = [d["path"] for d in sources if is_hub_id(d["path"])]
    world, hyper = record["world_size"], record["hyperparameters"]
    method = hyper.get("method")
    if method in ("dpo", "grpo"):
        meta["tags"].insert(2, method)
    name = repo_id.split("/")[-1] if repo_id else "fine-tuned model"
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=True).strip(), "---", "",
        f"# {name}", "",
        f"Fine-tuned from `{base}` with hftk {record['hftk_version']}"
        + (" (LoRA adapter)." if adapter else merged_note(model) if model.get("lora_r") else "."), "",
        "## Base model", "", f"- `{base}` (revision `{model['model_revision']}`, dtype {model['model_dtype']})", "",
        "## Training data", "",
        *[f"- dataset: `{d['path']}`" + (f" (config `{data['dataset_config_name']}`)" if data.get("dataset_config_name")
                                            and len(sources) == 1 else "")
          + f", split `{d['split']}`, format {d['format']}" + (f", weight {d['weight']}" if d.get("weight") else "")
          for d in sources],
        f"- format: {record['data_format']}, packing: {data['packing']}, "
        f"block size: {data['block_size']} tokens"
        + (f", first {data['max_train_samples']} rows" if data.get("max_train_samples") else ""), "",
        "## Training procedure", "",
        f"- strategy: **{strategy['strategy']}** over {world} process(es)"
        + (f", {record['data_parallel_size']} data-parallel replica(s)"
           if record.get("data_parallel_size", world) != world else ""),
        *([f"- method: **DPO** (Direct Preference Optimization, TRL's DPOTrainer), beta {hyper['beta']}, "
           f"loss {hyper['loss_type']}"] if method == "dpo" else []),
        *([f"- method: **GRPO** (Group Relative Policy Optimization, TRL's GRPOTrainer), rewards "
           f"`{hyper['reward_funcs']}`, {hyper['num_generations']} completions per prompt, beta {hyper['beta']}, "
           f"loss {hyper['loss_type']}"] if method == "grpo" else []),
        f"- optimizer steps: {record['global_step']}", "",
        "| hyperparameter | value |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in hyper.items()], "",
        "## Results", "",
    ]
    metrics = record.get("metrics") or {}
    if metrics:
        lines += ["| metric | value |", "|---|---|", *[f"| {k} | {_fmt(v)} |" for k, v in sorted(metrics.items())]]
    else:
        lines.append("No metrics were recorded.")
    lines += ["", "## Framework versions", "", *[f"- {k} {v}" for k, v in _versions().items()], ""]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def find_run_record(folder: Path) -> dict[str, Any] | None:
    """``hftk_run.json`` in ``folder`` or its parent (a checkpoint's run folder)."""
    for candidate in (folder / RUN_FILE, folder.parent / RUN_FILE):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    return None
