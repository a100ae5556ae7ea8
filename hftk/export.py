"""Any strategy's checkpoint -> a standard HF folder (safetensors, config, tokenizer).

A small registry: each :class:`CheckpointKind` says how to recognise a checkpoint folder and
how to read it into one full state dict; the rest (rebuild the model from the checkpoint's
config, tie weights, ``save_pretrained``, copy the tokenizer, prove every tensor is there) is
shared. Strategies add their kind to :data:`KINDS`, most specific first (a ZeRO checkpoint
also holds a gathered ``model.safetensors``, but its fp32 master shards are the better source).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hftk import lora, mesh_checkpoint
from hftk.checkpoint import list_checkpoints
from hftk.errors import HftkError
from hftk.strategies import deepspeed as zero
from hftk.strategies import fsdp
from hftk.strategies import pipeline

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"

Shapes = list[tuple[list[str], tuple[int, ...]]]  # per parameter: all its names (tied weights), full shape


@dataclass(frozen=True)
class CheckpointKind:
    name: str
    detect: Callable[[Path], bool]
    state_dict: Callable[[Path], dict[str, torch.Tensor]]


def has_safetensors(path: Path) -> bool:
    return (path / SAFE_WEIGHTS).is_file() or (path / SAFE_INDEX).is_file()


def safetensors_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Weights saved whole by ``save_pretrained`` (DDP, or any strategy's gathered save), sharded or not."""
    from safetensors.torch import load_file

    return {k: v for f in _safetensors_files(path) for k, v in load_file(str(f)).items()}


def _safetensors_files(path: Path) -> list[Path]:
    import json

    if (path / SAFE_INDEX).is_file():
        index = json.loads((path / SAFE_INDEX).read_text())
        return [path / name for name in sorted(set(index["weight_map"].values()))]
    return [path / SAFE_WEIGHTS]


KINDS: list[CheckpointKind] = [
    CheckpointKind("mesh-dcp (tp / cp / sp)", mesh_checkpoint.is_mesh_checkpoint, mesh_checkpoint.export_state_dict),
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
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and any(out.iterdir()):
        raise HftkError("OUT", f"'{out}' exists and is not empty.", "choose a new output folder.")
    if lora.is_adapter_folder(checkpoint):
        return _write_atomically(out, lambda tmp: lora.export_adapter(checkpoint, tmp, merge, base_model))
    if merge:
        raise HftkError("--merge", f"'{checkpoint}' holds no LoRA adapter ({lora.ADAPTER_CONFIG}) to merge.",
                        "drop --merge: a full fine-tuning checkpoint exports as the whole model already.")
    kind = detect(checkpoint)
    for needed in ("config.json",):
        if not (checkpoint / needed).is_file():
            raise HftkError("CHECKPOINT", f"'{checkpoint}' has no {needed}: the model cannot be rebuilt.",
                            "pass a checkpoint written by the Trainer (it saves the config beside the weights).")
    model = _model_from(checkpoint, kind.state_dict(checkpoint))
    tokenizer = _tokenizer_from(checkpoint)

    def write(tmp: Path) -> str:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        check_complete(tmp, shapes_of(model))
        return kind.name

    return _write_atomically(out, write)


def _write_atomically(out: Path, write: Callable[[Path], str]) -> str:
    """``write`` fills a temporary sibling of ``out``, renamed to ``out`` once complete; returns what it returns."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        kind = write(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return kind


def _model_from(checkpoint: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The checkpoint's architecture holding ``state``; built on the meta device (no random init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still_missing = [name for name, p in model.named_parameters() if p.is_meta]
    if unexpected or still_missing:
        raise HftkError("CHECKPOINT", f"'{checkpoint}' does not match its config.json: missing "
                        f"{still_missing[:5]}, unexpected {unexpected[:5]}.",
                        "pass the checkpoint folder the Trainer wrote, unmodified.")
    return model


def _tokenizer_from(checkpoint: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(checkpoint)
    except (OSError, ValueError) as exc:
        raise HftkError("CHECKPOINT", f"'{checkpoint}' has no loadable tokenizer ({str(exc).splitlines()[0]}).",
                        "copy the run's tokenizer files into the checkpoint folder.") from None


def shapes_of(model: torch.nn.Module) -> Shapes:
    """Per parameter: every name it goes by (tied weights have several) and its full shape.

    ZeRO-3 partitioned parameters report their full shape in ``ds_shape``. The names include
    the one ``save_pretrained`` writes when transformers renames a weight back to its original
    checkpoint name (GPT-NeoX's ``lm_head.weight`` is saved as ``embed_out.weight``).
    """
    from transformers.modeling_utils import revert_weight_conversion

    groups: dict[int, tuple[list[str], tuple[int, ...]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shape = tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
        names = groups.setdefault(id(param), ([], shape))[0]
        names.append(name)
        names.extend(k for k in revert_weight_conversion(model, {name: torch.empty(shape, device="meta")}) if k != name)
    return list(groups.values())


def check_complete(folder: Path, expected: Shapes) -> None:
    """Every parameter is saved under one of its names with its full shape (reads headers only).

    Empty or partial final weights after sharded training are the field's most reported
    failure; this turns them into an error at save time instead of at someone's load time.
    """
    from safetensors import safe_open

    folder = Path(folder)
    saved: dict[str, tuple[int, ...]] = {}
    for f in _safetensors_files(folder):
        if not f.is_file():
            raise HftkError("output", f"{folder} has no {f.name}.", "rerun the save; check free disk space.")
        with safe_open(str(f), framework="pt") as handle:
            saved.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})
    for names, shape in expected:
        if not any(saved.get(n) == shape for n in names):
            got = {n: saved[n] for n in names if n in saved}
            raise HftkError("output", f"{folder} lacks {names[0]} {list(shape)} (saved: {got or 'nothing'}).",
                            "the weights were not gathered before saving; report this with the strategy used.")


def main(argv: list[str]) -> int:
    """``hftk export CHECKPOINT OUT [--merge [--base_model B]]``."""
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
    args = parser.parse_args(argv)
    if args.base_model and not args.merge:
        raise HftkError("--base_model", "only matters with --merge.", "add --merge, or drop --base_model.")
    kind = export(args.checkpoint, args.out, merge=args.merge, base_model=args.base_model)
    print(f"exported {args.checkpoint} ({kind}) -> {args.out}")
    return 0
