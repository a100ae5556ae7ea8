"""Tensor-parallel plans: which module of a model is split which way, applied from outside.

The plan is the model's own (:class:`hftk.models.spec.ModelSpec`'s ``tp_plan``: transformers'
``base_model_tp_plan``, hand-written only for GPT-2), applied with torch's DTensor styles
(:func:`to_parallel_styles`): q/k/v and up/gate projections column-wise, output projections row-wise,
their gathered / split variants where a module between them needs the whole width (OLMo 2's q/k norms
over the full projection, Phi-3's fused projections), and per-head norms replicated with their
gradients summed over the group (Qwen3's and Gemma 3's q/k norms: each rank's gradient covers its own
heads only; :func:`partial_grad_params`). hftk adds the vocabulary-parallel input embedding and LM head.

GPT-2's ``Conv1D`` layers (weight stored ``[in, out]``) defeat torch's colwise/rowwise styles, which
shard ``nn.Linear``. hftk therefore converts GPT-2's four ``Conv1D`` per block into ``nn.Linear``
from outside the model code, splitting the fused ``c_attn`` into three projections so q, k and v
are each sharded by heads; the export turns them back into the original names and shapes
(:func:`to_hf_state_dict`).

The attention modules of the families transformers 5 ships reshape with ``-1`` heads, so they run on
the local heads by themselves; GPT-2 splits its fused projection at a width read from the module
(``split_size``), which :func:`apply_tensor_parallel` sets to the local width.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

import torch
import torch.nn as nn

from hftk.core.errors import HftkError
from hftk.models.spec import check_strategy, meta_model, model_spec

# Styles whose modules keep their weights whole on every rank with a partial gradient (summed over the group).
PARTIAL_GRAD = "replicated_with_grad_allreduce"
SPLIT_OUTPUT = ("colwise", "colwise_gather_output")  # weight (and bias) split by output rows
SPLIT_INPUT = ("rowwise", "rowwise_split_input", "embedding_rowwise")  # weight split by input columns


def block_plan(model_config: Any) -> dict[str, str]:
    """Style per module pattern (relative to the model root): the model's own plan; its refusal otherwise."""
    check_strategy(model_spec(model_config), "tp")
    if getattr(model_config, "add_cross_attention", False):
        raise HftkError("model.model_name_or_path", "a decoder with cross-attention has no tensor-parallel plan in "
                        "hftk.", "use a decoder-only model, or strategy fsdp.")
    return dict(model_spec(model_config).tp_plan)


def _styled(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module, str]]:
    """(name, module, style) of every module a plan pattern matches."""
    found = []
    for name, module in model.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch(name, pattern)), None)
        if style is not None:
            found.append((name, module, style))
    return found


def check_divisible(model_config: Any, tp: int) -> None:
    """Heads and key/value heads, and every width the plan splits, must split evenly over ``tp`` ranks."""
    c = model_config.get_text_config()
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    sizes = {"attention heads": heads}
    kv = getattr(c, "num_key_value_heads", None)
    if kv:
        sizes["key/value heads"] = kv
    model = meta_model(model_config)
    if model_config.model_type == "gpt2":
        gpt2_to_linear(model)
    for name, module, style in _styled(model, block_plan(model_config)):
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and style in SPLIT_OUTPUT:
            sizes.setdefault(f"{leaf} output width", module.out_features)
        elif isinstance(module, nn.Linear) and style in SPLIT_INPUT:
            sizes.setdefault(f"{leaf} input width", module.in_features)
    for what, value in sizes.items():
        if value % tp:
            raise HftkError("strategy.tp_size", f"the model's {what} ({value}) do not split evenly over {tp} ranks.",
                            f"choose a tp_size that divides {value}.")


class FusedQKV(nn.Module):
    """GPT-2's fused ``c_attn`` as three ``nn.Linear``: each is sharded by heads on its own.

    Its output is the same ``[q | k | v]`` concatenation the attention module splits, so the
    model code runs unchanged; under tensor parallel each third holds the local heads.
    """

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        super().__init__()
        self.q, self.k, self.v = q, k, v

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)], dim=-1)


def _linear(weight_in_out: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` computing ``x @ weight_in_out + bias`` (what ``Conv1D`` computes)."""
    n_in, n_out = weight_in_out.shape
    layer = nn.Linear(n_in, n_out, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight_in_out.detach().t().contiguous())
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone())
    return layer


def gpt2_to_linear(model: nn.Module) -> nn.Module:
    """Replace every block's ``Conv1D`` with ``nn.Linear`` (``c_attn`` with :class:`FusedQKV`), in place."""
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        w, b = attn.c_attn.weight, attn.c_attn.bias
        width = attn.split_size
        attn.c_attn = FusedQKV(*(_linear(w[:, i * width:(i + 1) * width], b[i * width:(i + 1) * width])
                                 for i in range(3)))
        attn.c_proj = _linear(attn.c_proj.weight, attn.c_proj.bias)
        mlp.c_fc = _linear(mlp.c_fc.weight, mlp.c_fc.bias)
        mlp.c_proj = _linear(mlp.c_proj.weight, mlp.c_proj.bias)
    return model


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict -> the family's own names and shapes (undoes :func:`gpt2_to_linear`; else as is)."""
    if not any(key.endswith(".attn.c_attn.q.weight") for key in state):
        return state
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".attn.c_attn." in key:
            stem, _, leaf = key.rpartition(".")  # ...c_attn.q, weight
            base, _, part = stem.rpartition(".")
            if part != "q":
                continue
            parts = [state[f"{base}.{p}.{leaf}"] for p in ("q", "k", "v")]
            out[f"{base}.{leaf}"] = torch.cat(parts, dim=0).t().contiguous() if leaf == "weight" else torch.cat(parts)
        elif key.endswith(".weight") and any(f".{name}." in key for name in ("c_proj", "c_fc")):
            out[key] = value.t().contiguous()
        else:
            out[key] = value
    return out


def to_parallel_styles(plan: dict[str, str]) -> dict[str, Any]:
    """transformers' style names -> torch ``ParallelStyle`` objects (:data:`PARTIAL_GRAD` modules get none: their
    weights stay plain, whole on every rank)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    make = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    return {key: make[style]() for key, style in plan.items() if style != PARTIAL_GRAD}


def partial_grad_params(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """Names of the parameters of :data:`PARTIAL_GRAD` modules: replicated weights applied to this rank's heads
    only, whose gradients must be summed over the tensor-parallel group (transformers'
    ``ReplicatedWithGradAllReduce``)."""
    partial = {pattern: style for pattern, style in plan.items() if style == PARTIAL_GRAD}
    return [f"{name}.{leaf}" for name, module, _ in _styled(model, partial)
            for leaf, _ in module.named_parameters(recurse=False)]


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Shard ``model`` over ``tp_mesh``: blocks by heads / MLP width, embedding and LM head by vocabulary.

    The LM head keeps its logits sharded on the vocabulary (a ``DTensor``); the loss is computed
    under ``loss_parallel`` so no rank ever holds the full ``[batch, seq, vocab]`` logits.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    config = model.config
    plan = block_plan(config)
    tp = tp_mesh.size()
    if config.model_type == "gpt2":
        gpt2_to_linear(model)
        for block in model.transformer.h:
            block.attn.split_size //= tp
            block.attn.num_heads //= tp
            block.attn.embed_dim //= tp
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    names = {module: name for name, module in model.named_modules()}
    # the plan's patterns resolved to the modules that exist (a dense layer's MLP entries match no MoE layer)
    plan = {name: style for name, _, style in _styled(model, plan)}
    plan.setdefault(names[embedding], "embedding_rowwise")
    styles = to_parallel_styles(plan)
    if head is not None:
        styles[names[head]] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, styles)
    if tied:
        # Both shard the [vocab, hidden] weight on dim 0: one parameter serves both again.
        head.weight = embedding.weight
    # The vocabulary-parallel lookup hands back a replicated (full [vocab, hidden]) gradient;
    # keeping only this rank's rows is a local slice and saves (tp - 1) / tp of that memory.
    embedding.weight.register_post_accumulate_grad_hook(_reshard_grad)
    return model


def _reshard_grad(param: Any) -> None:
    if param.grad is not None and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)


def replicated_params(model_config: Any) -> int:
    """Parameters every tensor-parallel rank keeps whole (from the config; built on the meta device).

    Everything outside the plan's split modules (norms, GPT-2's position table, per-head q/k norms) and the
    biases of row-parallel layers; column-parallel layers, the input embedding and the LM head are split.
    """
    model = meta_model(model_config)
    if model_config.model_type == "gpt2":
        gpt2_to_linear(model)
    split = {id(model.get_input_embeddings().weight)}
    if model.get_output_embeddings() is not None:
        split.add(id(model.get_output_embeddings().weight))
    for _, module, style in _styled(model, block_plan(model_config)):
        if style in SPLIT_OUTPUT:
            split.update(id(p) for p in module.parameters(recurse=False))
        elif style in SPLIT_INPUT:
            split.add(id(module.weight))
    return sum(p.numel() for p in model.parameters() if id(p) not in split)
