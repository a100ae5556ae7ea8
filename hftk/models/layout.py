"""Handles on a live model's parts, by the names its :class:`~hftk.models.spec.ModelSpec` derived.

Strategies need the same few answers (the blocks to wrap or shard, the list of blocks to split into
stages, the parts before and after them, the LM head); this module turns the spec's names into the
live modules of a model, whatever wraps it (PEFT, DDP, a DeepSpeed engine, torch.compile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from hftk.core.errors import HftkError
from hftk.models.spec import FIELD, ModelSpec, model_spec


@dataclass
class DecoderLayout:
    """One causal LM's parts (all still owned by the model)."""

    spec: ModelSpec
    model: nn.Module  # the causal LM itself (unwrapped)
    backbone: nn.Module
    blocks: nn.ModuleList
    before: dict[str, nn.Module]  # backbone children with weights the forward runs before the blocks
    after: dict[str, nn.Module]  # ... after them (the final norm)
    head: nn.Module | None

    @property
    def tied(self) -> bool:
        embedding = self.model.get_input_embeddings()
        return self.head is not None and self.head.weight is embedding.weight


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


def spec_of(model: nn.Module) -> ModelSpec:
    return model_spec(causal_lm(model).config)


def layout(model: nn.Module) -> DecoderLayout:
    """The :class:`DecoderLayout` of a causal LM, wrapped or not; a model whose structure could not be derived
    raises the spec's one line."""
    model = causal_lm(model)
    spec = model_spec(model.config)
    if not spec.has_structure:
        raise HftkError(FIELD, f"hftk cannot derive the decoder structure of {spec.name} ('{spec.family}'): "
                        f"{spec.structure_problem}.", "train it with ddp, fsdp or a ZeRO stage.")
    backbone = model.get_submodule(spec.backbone) if spec.backbone else model
    return DecoderLayout(spec=spec, model=model, backbone=backbone, blocks=getattr(backbone, spec.blocks),
                         before={n: getattr(backbone, n) for n in spec.before_blocks},
                         after={n: getattr(backbone, n) for n in spec.after_blocks},
                         head=model.get_submodule(spec.head) if spec.head else None)


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks (FSDP's units), found by the classes the spec read off the blocks; none when the
    structure could not be derived."""
    classes = set(spec_of(model).block_classes)
    return [m for m in causal_lm(model).modules() if type(m).__name__ in classes]
