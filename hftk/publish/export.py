"""Any strategy's checkpoint -> a standard HF folder (safetensors, config, tokenizer).

A small registry: each :class:`CheckpointKind` says how to recognise a checkpoint folder and
how to read it into one full state dict; the rest (rebuild the model from the checkpoint's
config, tie weights, ``save_pretrained``, copy the tokenizer, prove every tensor is there) is
shared. Strategies add their kind to :data:`KINDS`, most specific first (a ZeRO checkpoint
also holds a gathered ``model.safetensors``, but its fp32 master shards are the better source).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hftk.checkpoint.atomic import list_checkpoints
from hftk.checkpoint.hf_folder import (check_complete, has_safetensors, model_from, safetensors_state_dict, shapes_of,
                                       write_atomically)
from hftk.core.errors import HftkError
from hftk.models import lora
from hftk.strategies import deepspeed as zero
from hftk.strategies import fsdp, mesh_checkpoint, pipeline


@dataclass(frozen=True)
class CheckpointKind:
    name: str
    detect: Callable[[Path], bool]
    state_dict: Callable[[Path], dict[str, torch.Tensor]]


KINDS: list[CheckpointKind] = [
    CheckpointKind("mesh-dcp (tp / cp / sp / ep)", mesh_checkpoint.is_mesh_checkpoint, mesh_checkpoint.export_state_dict),
    CheckpointKind("pipeline", pipeline.is_pipeline_checkpoint, pipeline.pipeline_state_dict),
    CheckpointKind("deepspeed-zero", zero.is_zero_checkpoint, zero.zero_state_dict),
    CheckpointKind("fsdp-sharded", fsdp.is_fsdp_checkpoint, fsdp.fsdp_state_dict),
    CheckpointKind("safetensors", has_safetensors, safetensors_state_dict),
]


def detect(checkpoint: Path) -> CheckpointKind:
    """The first registered kind that recognises ``checkpoint``."""
    if not checkpoint.is_dir():
        raise HftkError("CHECKPOINT", f"'{checkpoint}' is not a folder.", "pass a checkpoint-N folder of a run.")
    found = list_checkpoints(checkpoint)
    if found and not (checkpoint / "config.json").exists():
        raise HftkError("CHECKPOINT", f"'{checkpoint}' is a run folder, not one checkpoint.",
                        f"pass one of its checkpoints, e.g. {found[-1]}.")
    for kind in KINDS:
        if kind.detect(checkpoint):
            return kind
    raise HftkError("CHECKPOINT", f"'{checkpoint}' holds no weights hftk can read.",
                    f"pass a checkpoint of one of: {', '.join(k.name for k in KINDS)}.")


def export(checkpoint: Path, out: Path, merge: bool = False, base_model: str | None = None) -> str:
    """Write ``out`` as a standard HF folder from ``checkpoint``; returns the kind it was read as.

    A LoRA checkpoint or final folder (any strategy writes the whole adapter into each) exports as
    the adapter folder, or with ``merge`` as the base model with the adapter merged into it.
    Written into a temporary sibling and renamed, so ``out`` is either complete or absent.
    """
    from transformers import AutoConfig, AutoTokenizer

    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and any(out.iterdir()):
        raise HftkError("OUT", f"'{out}' exists and is not empty.", "choose a new output folder.")
    if lora.is_adapter_folder(checkpoint):
        return write_atomically(out, lambda tmp: lora.export_adapter(checkpoint, tmp, merge, base_model))
    if merge:
        raise HftkError("--merge", f"'{checkpoint}' holds no LoRA adapter ({lora.ADAPTER_CONFIG}) to merge.",
                        "drop --merge: a full fine-tuning checkpoint exports as the whole model already.")
    kind = detect(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise HftkError("CHECKPOINT", f"'{checkpoint}' has no config.json: the model cannot be rebuilt.",
                        "pass a checkpoint written by the Trainer (it saves the config beside the weights).")
    model = model_from(AutoConfig.from_pretrained(checkpoint), kind.state_dict(checkpoint), checkpoint)
    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    except (OSError, ValueError) as exc:
        raise HftkError("CHECKPOINT", f"'{checkpoint}' has no loadable tokenizer ({str(exc).splitlines()[0]}).",
                        "copy the run's tokenizer files into the checkpoint folder.") from None

    def write(tmp: Path) -> str:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        check_complete(tmp, shapes_of(model))
        return kind.name

    return write_atomically(out, write)


def build_parser() -> argparse.ArgumentParser:
    """``hftk export``'s options (also rendered on the documentation's command reference)."""
    parser = argparse.ArgumentParser(
        prog="hftk export",
        description="Turn a checkpoint of any strategy (" + ", ".join(k.name for k in KINDS)
        + ") into a standard Hugging Face folder: model.safetensors, config, tokenizer. A LoRA checkpoint (or "
        "final folder) exports as its adapter, or with --merge as the base model with the adapter merged in.",
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-N folder written during training")
    parser.add_argument("out", type=Path, help="new folder to write (must not exist or be empty)")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA: merge the adapter into the base model (merge_and_unload) and write the full model")
    parser.add_argument("--base_model", default=None,
                        help="LoRA with --merge: the base model's Hub id or folder (default: adapter_config.json's)")
    return parser


def main(argv: list[str]) -> int:
    """``hftk export CHECKPOINT OUT [--merge [--base_model B]]``."""
    args = build_parser().parse_args(argv)
    if args.base_model and not args.merge:
        raise HftkError("--base_model", "only matters with --merge.", "add --merge, or drop --base_model.")
    kind = export(args.checkpoint, args.out, merge=args.merge, base_model=args.base_model)
    print(f"exported {args.checkpoint} ({kind}) -> {args.out}")
    return 0
