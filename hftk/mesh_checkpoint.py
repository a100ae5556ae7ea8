"""Checkpoints of the mesh loop (tensor / sequence parallel): DCP state, exact resume, HF export.

A ``checkpoint-N`` folder holds ``dcp/`` (model and AdamW state through
``torch.distributed.checkpoint``: every rank writes its own shards, no rank ever holds the
whole model), the LR scheduler, each rank's RNG state (python, numpy, torch CPU and CUDA:
:func:`hftk.checkpoint.save_rng`), the model config and tokenizer, and
``hftk_mesh.json`` (the layout and step it was written at). It is staged and published
atomically by :mod:`hftk.checkpoint`, so ``latest`` never picks a half-written one. DCP records
full shapes and offsets, so a checkpoint resumes on another mesh too.

``hftk export`` reads such a folder without any process group (:func:`export_state_dict`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hftk.checkpoint import atomic_save, load_rng, save_rng, staged_folder

DCP_DIR = "dcp"
LAYOUT_FILE = "hftk_mesh.json"
SCHEDULER_FILE = "scheduler.pt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(output_dir: Path, step: int, layout: Any, optimizer: Any, scheduler: Any, cfg: Any, tokenizer: Any) -> Path:
    """Collective: ``output_dir/checkpoint-<step>``, published atomically (:func:`hftk.checkpoint.atomic_save`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def write(folder: Path) -> None:
        model_state, optim_state = get_state_dict(layout.model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder / DCP_DIR))
        save_rng(folder)
        if _rank() == 0:
            torch.save(scheduler.state_dict(), folder / SCHEDULER_FILE)
            layout.model.config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            (folder / LAYOUT_FILE).write_text(json.dumps({**layout.describe, "step": step}, indent=1, sort_keys=True))

    global_batch = (cfg.args.per_device_train_batch_size * cfg.args.gradient_accumulation_steps * layout.data_size)
    return atomic_save(output_dir, step, write, cfg.training.get("save_total_limit"), global_batch)


def load(folder: Path, layout: Any, optimizer: Any, scheduler: Any) -> int:
    """Restore model, optimizer, scheduler and RNG from ``folder``; returns the step it was saved at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(folder)
    model_state, optim_state = get_state_dict(layout.model, optimizer)  # templates (optimizer state initialised)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder / DCP_DIR))
    set_state_dict(layout.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, weights_only=True))
    load_rng(folder)
    return int(json.loads((folder / LAYOUT_FILE).read_text())["step"])


def save_hf_folder(out: Path, layout: Any, tokenizer: Any, write_extra: Callable[[Path], None]) -> None:
    """Collective: gather every shard to rank 0, which writes a standard HF folder; it appears whole or not at all.

    ``write_extra(folder)`` adds files beside the weights on rank 0 (the run record and model card).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hftk.hf_folder import check_complete, model_from, shapes_of
    from hftk.strategies.tp_plans import to_hf_state_dict

    full = get_model_state_dict(layout.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with staged_folder(Path(out), publisher=_rank() == 0) as folder:
        if _rank() == 0:
            model = model_from(layout.model.config, to_hf_state_dict(full), Path(out))
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            check_complete(folder, shapes_of(model))
            write_extra(folder)


def is_mesh_checkpoint(folder: Path) -> bool:
    return (Path(folder) / LAYOUT_FILE).is_file() and (Path(folder) / DCP_DIR / ".metadata").is_file()


def export_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Full model tensors of a mesh checkpoint, read on one process, in the family's own names and shapes."""
    from hftk.hf_folder import read_dcp_model
    from hftk.strategies.tp_plans import to_hf_state_dict

    return to_hf_state_dict(read_dcp_model(Path(folder) / DCP_DIR))
