"""The on-disk state of tp / cp / sp / ep runs: DCP shards, the gathered HF folder, the offline reader.

Inside a ``checkpoint-N`` folder (written by :mod:`hftk.checkpoint.checkpointer` with the scheduler, trainer
state and every rank's RNG) this module writes ``dcp/`` (model and AdamW state through
``torch.distributed.checkpoint``: every rank writes its own shards, no rank ever holds the whole
model) and ``hftk_mesh.json`` (the layout it was written on). DCP records full shapes and
offsets, so a checkpoint resumes on another mesh too.

``hftk export`` reads such a folder without any process group (:func:`export_state_dict`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hftk.checkpoint.hf_folder import check_complete, model_from, read_dcp_model, shapes_of
from hftk.strategies.tp_plans import to_hf_state_dict

DCP_DIR = "dcp"
LAYOUT_FILE = "hftk_mesh.json"


def write_state(folder: Path, layout: Any, optimizer: Any) -> None:
    """Collective: every rank's model and optimizer shards into ``folder/dcp``; rank 0 the layout file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(layout.model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder / DCP_DIR))
    if dist.get_rank() == 0:  # tp / cp / sp / ep run on a device mesh: a process group is always up
        (folder / LAYOUT_FILE).write_text(json.dumps(layout.describe, indent=1, sort_keys=True))


def read_state(folder: Path, layout: Any, optimizer: Any) -> None:
    """Restore model and optimizer shards from ``folder/dcp`` (resharded onto this run's mesh)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(layout.model, optimizer)  # templates (optimizer state initialised)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(Path(folder) / DCP_DIR))
    set_state_dict(layout.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _full_state(layout: Any) -> dict[str, torch.Tensor]:
    """Collective: every shard gathered; rank 0 gets the full CPU tensors (the others an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(layout.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


PLAIN_SDPA = "hftk_plain_sdpa"  # transformers' own SDPA attention and mask, under a name no strategy replaces


def gathered_model(layout: Any, adapter: Any = None) -> torch.nn.Module | None:
    """Collective: rank 0 gets a runnable one-process HF model of the layout's current weights; the others None.

    It attends as a one-process model does: cp's ring attention (causal, no mask: wrong for a one-token query
    over a KV cache) and sp's Ulysses (which takes over "sdpa" in this process and would wait for the other
    ranks) are replaced by transformers' plain SDPA, registered under :data:`PLAIN_SDPA`. ``adapter``: the run's
    PEFT config: the copy is the base with that adapter (the live model is a PeftModel)."""
    import copy

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    full = _full_state(layout)
    if dist.get_rank() != 0:
        return None
    if adapter is not None:
        from hftk.models.lora import peft_model_from

        return peft_model_from(layout.model.config, adapter, full)
    config = copy.deepcopy(layout.model.config)
    if config._attn_implementation not in ("eager", "flash_attention_2", "flash_attention_3"):
        AttentionInterface.register(PLAIN_SDPA, sdpa_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(PLAIN_SDPA, sdpa_mask)
        config._attn_implementation = PLAIN_SDPA
    return model_from(config, to_hf_state_dict(full), Path("<live model>"), runnable=True)


def save_hf_folder(folder: Path, layout: Any, tokenizer: Any) -> None:
    """Collective: gather every shard to rank 0, which writes a standard HF folder into ``folder`` (the engine's
    final save, :func:`hftk.checkpoint.atomic.staged_folder`) and proves it complete."""
    full = _full_state(layout)
    if dist.get_rank() == 0:
        model = model_from(layout.model.config, to_hf_state_dict(full), Path(folder))
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        check_complete(folder, shapes_of(model))


def is_mesh_checkpoint(folder: Path) -> bool:
    return (Path(folder) / LAYOUT_FILE).is_file() and (Path(folder) / DCP_DIR / ".metadata").is_file()


def export_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Full model tensors of a mesh checkpoint, read on one process, in the family's own names and shapes."""
    return to_hf_state_dict(read_dcp_model(Path(folder) / DCP_DIR))
