"""Where the parts of a decoder-only HF model live, read from the model's own structure.

Strategies need the same few answers (the decoder-layer class to wrap or shard, the list of
blocks to split into stages, the embeddings / final norm / LM head): this module is the one
place that knows each family's attribute names, so model code stays untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from hftk.config.family_table import FAMILIES, supported_families
from hftk.core.errors import HftkError


@dataclass
class DecoderLayout:
    """Handles on one causal-LM's parts (all still owned by the model)."""

    family: str
    backbone: nn.Module
    blocks: nn.ModuleList
    token_embedding: nn.Embedding
    position_embedding: nn.Embedding | None
    final_norm: nn.Module
    lm_head: nn.Module
    tied: bool  # input embedding and LM head share one weight
    embedding_dropout: nn.Module | None = None
    rotary: nn.Module | None = None  # the backbone's rotary-embedding module (Llama / NeoX families)

    @property
    def block_class(self) -> type[nn.Module]:
        return type(self.blocks[0])


def causal_lm(model: nn.Module) -> nn.Module:
    """The family's own causal-LM module inside whatever wraps it (PEFT, DDP, accelerate, compile).

    Wrappers forward attribute lookups to what they wrap, so on a PEFT model ``model.model`` is
    the LlamaForCausalLM itself, not its backbone: the layout must be read on the unwrapped model.
    """
    while True:
        if hasattr(model, "get_base_model") and model.get_base_model() is not model:  # PEFT
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):  # DDP / DeepSpeed engine
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def layout(model: nn.Module) -> DecoderLayout:
    """The :class:`DecoderLayout` of a GPT-2 / GPT-NeoX / Llama / Mistral / Qwen2 causal LM, wrapped or not."""
    model = causal_lm(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise HftkError("model.model_name_or_path", f"architecture '{model_type}' has no known decoder layout.",
                        f"use a model of a supported family ({supported_families()}).")
    spec = FAMILIES[model_type]
    backbone = getattr(model, spec.backbone)
    lm_head = model.get_output_embeddings()
    token_embedding = getattr(backbone, spec.token_embedding)
    return DecoderLayout(
        family=model_type,
        backbone=backbone,
        blocks=getattr(backbone, spec.blocks),
        token_embedding=token_embedding,
        position_embedding=getattr(backbone, spec.position_embedding) if spec.position_embedding else None,
        final_norm=getattr(backbone, spec.final_norm),
        lm_head=lm_head,
        tied=lm_head is not None and lm_head.weight is token_embedding.weight,
        embedding_dropout=getattr(backbone, spec.embedding_dropout) if spec.embedding_dropout else None,
        rotary=getattr(backbone, "rotary_emb", None),
    )


def decoder_block_class(model: nn.Module) -> type[nn.Module]:
    """The class of one decoder block: the FSDP wrap unit and the pipeline split unit.

    Known families use :func:`layout`; any other HF model falls back to its own
    ``_no_split_modules`` declaration, which names exactly that class.
    """
    model = causal_lm(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in FAMILIES:
        return layout(model).block_class
    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in names:
            return type(module)
    raise HftkError("model.model_name_or_path", f"cannot find the decoder-layer class of '{model_type}'.",
                    f"use a model of a supported family ({supported_families()}).")
