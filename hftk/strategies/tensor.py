"""Tensor parallel (``tp``), composed with FSDP2 data parallel on one device mesh.

The mesh is ``(dp_replicate, dp_shard, tp)`` and its size must equal the world size; ``tp`` is
the innermost dimension, so a tensor-parallel group is made of neighbouring ranks (one node,
where its per-layer all-reduces are cheapest). In fixed order, from outside the model code:

1. tensor parallel over ``tp`` (:mod:`hftk.strategies.tp_plans`): attention by heads, MLP by
   width, input embedding and LM head by vocabulary, the loss computed on vocabulary-sharded
   logits (``loss_parallel``);
2. FSDP2 over the data-parallel dimensions: ``fully_shard`` on every decoder block, then the
   root, on ``dp_shard`` (or HSDP on ``(dp_replicate, dp_shard)``), which turns the tensor-parallel
   shards into 2-D (or 3-D) DTensors.

The ranks of one tensor-parallel group read the same samples; the data-parallel ranks split
each global batch. The HF Trainer cannot drive this layout (see :mod:`hftk.engine.mesh_loop`),
so the strategy runs on hftk's mesh loop. ``tp_size 1`` on one process is the plain model:
the single-process reference the tests compare with.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hftk.config import RunConfig
from hftk.errors import HftkError

ENGINE = "mesh_loop"
DIMS = ("dp_replicate", "dp_shard", "tp")


def mesh_shape(cfg: RunConfig, world_size: int) -> tuple[int, int, int]:
    """``(dp_replicate, dp_shard, tp)``; ``dp_shard_size -1`` takes whatever the other two leave."""
    s = cfg.strategy
    for name in ("tp_size", "dp_replicate_size"):
        if getattr(s, name) < 1:
            raise HftkError(f"strategy.{name}", f"must be 1 or more, got {getattr(s, name)}.",
                            f"set strategy.{name} to 1 or more.")
    if s.dp_shard_size == 0 or s.dp_shard_size < -1:
        raise HftkError("strategy.dp_shard_size", f"must be -1 or 1 or more, got {s.dp_shard_size}.",
                        "use -1 (the rest of the world) or a positive degree.")
    shard = s.dp_shard_size
    if shard == -1:
        rest = s.tp_size * s.dp_replicate_size
        if world_size % rest:
            raise HftkError("strategy.tp_size", f"tp_size {s.tp_size} x dp_replicate_size {s.dp_replicate_size} does "
                            f"not divide the world size {world_size}.", "choose sizes whose product divides the world size.")
        shard = world_size // rest
    shape = (s.dp_replicate_size, shard, s.tp_size)
    if shape[0] * shape[1] * shape[2] != world_size:
        raise HftkError("strategy.tp_size", f"dp_replicate_size {shape[0]} x dp_shard_size {shape[1]} x tp_size "
                        f"{shape[2]} = {shape[0] * shape[1] * shape[2]} ranks, but the world size is {world_size}.",
                        f"make the three multiply to {world_size} (dp_shard_size -1 fills in the rest).")
    return shape


def validate(cfg: RunConfig, world_size: int) -> None:
    """Mesh sizes, model plan and divisibility, and the options this layout supports, before any process group."""
    from hftk.engine.mesh_loop import check_training_options
    from hftk.modeling import load_model_config
    from hftk.strategies import tp_plans

    s = cfg.strategy
    if s.sp_size > 1:
        raise HftkError("strategy.sp_size", "tensor parallel and sequence parallel do not compose in hftk yet.",
                        "use strategy tp (tp x dp_shard x dp_replicate) or strategy sp (sp x data parallel).")
    if s.fsdp_cpu_offload:
        raise HftkError("strategy.fsdp_cpu_offload", "is not supported with strategy tp.",
                        "drop it, or use strategy fsdp / zero3_offload for offloading.")
    if cfg.model.lora_r > 0:
        raise HftkError("model.lora_r", "LoRA is not supported with strategy tp.",
                        "train the full model, or use ddp / fsdp.")
    replicate, shard, tp = mesh_shape(cfg, world_size)
    check_training_options(cfg, "tp")
    if tp > 1:
        model_config = load_model_config(cfg.model)
        tp_plans.block_plan(model_config)
        tp_plans.check_divisible(model_config, tp)


def shard_data_parallel(model: Any, mesh: Any, reshard_after_forward: bool) -> None:
    """FSDP2 over the data-parallel mesh dimensions: each decoder block, then the root."""
    from torch.distributed.fsdp import fully_shard

    from hftk.layout import layout as decoder_layout

    dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    for block in decoder_layout(model).blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def layout(model: Any, cfg: RunConfig, device_type: str) -> Any:
    """Build the mesh, shard ``model`` on it, and say how the loop feeds and combines it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from hftk.engine.mesh_loop import MeshLayout
    from hftk.strategies.tp_plans import apply_tensor_parallel

    replicate, shard, tp = mesh_shape(cfg, dist.get_world_size())
    mesh = init_device_mesh(device_type, (replicate, shard, tp), mesh_dim_names=DIMS)
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    data_size = replicate * shard
    if data_size > 1:
        shard_data_parallel(model, mesh, cfg.strategy.fsdp_reshard_after_forward)
    return MeshLayout(
        model=model,
        data_rank=mesh["dp_replicate"].get_local_rank() * shard + mesh["dp_shard"].get_local_rank(),
        data_size=data_size,
        data_groups=[mesh.get_group("dp_replicate"), mesh.get_group("dp_shard")],
        grad_scale=float(data_size),  # FSDP2 averages gradients over the data-parallel ranks
        describe={"strategy": "tp", "dp_replicate_size": replicate, "dp_shard_size": shard, "tp_size": tp,
                  "family": model.config.model_type, "vocab_parallel_loss": tp > 1},
        loss_context=loss_parallel if tp > 1 else contextlib.nullcontext,
    )


def estimate_memory(shape: Any, inputs: Any, tp: int, replicated: int) -> Any:
    """Per-rank bytes of ``tp`` (an :class:`hftk.plan.StrategyPlan`): TP over ``tp``, FSDP2 over the rest.

    ``replicated`` parameters (:func:`hftk.strategies.tp_plans.replicated_params`) stay whole under
    TP; everything else is split ``tp`` ways, then FSDP2 splits what a rank holds over
    ``world_size / tp``. Activations
    follow Korthikanti et al. for TP without sequence-parallel norms, per layer
    ``b s h (10 + 24 / t + 5 a s / (h t))``; the logits are vocabulary-sharded.
    """
    from hftk.plan import DTYPE_BYTES, RUNTIME_BYTES, StrategyPlan

    data = max(inputs.world_size // tp, 1)
    w = DTYPE_BYTES[inputs.dtype]
    per_rank = -(-((shape.params - replicated) // tp + replicated) // data)
    transient = 0
    if data > 1:  # FSDP2: the gathered block (current + prefetched), its unsharded gradient, the root
        block = shape.largest_block // tp
        transient = 2 * block * w + block * 4 + shape.outside_blocks // tp * w
    b, s, h = inputs.micro_batch, inputs.seq_len, shape.hidden
    scale = 2.0 if inputs.dtype == "float32" else 1.0  # the formula counts 16-bit activations
    per_layer = b * s * h * (10 + 24 / tp + 5 * shape.heads * s / (h * tp)) * scale
    layers = (per_layer + b * s * h * 4 * (shape.layers - 1)) if inputs.gradient_checkpointing else per_layer * shape.layers
    activations = int(layers + 3 * b * s * shape.vocab * 4 / tp)
    counters = 4 * shape.trainable_tensors  # torch AdamW's per-parameter step counters (every rank has all)
    return StrategyPlan(f"tp{tp}" + (f" x fsdp{data}" if data > 1 else ""), per_rank * w, per_rank * w,
                        2 * per_rank * w + counters, transient, activations, RUNTIME_BYTES[inputs.device], 0)


def plan_rows(model_config: Any, shape: Any, inputs: Any, tp_size: int, sp_size: int) -> list[Any]:
    """``hftk plan`` rows for tensor / sequence parallel at the asked degrees (shown; ``auto`` never picks them).

    Which layout suits a model is a question of interconnect and sequence length, not only of
    memory, so these rows inform and the pick stays among the data-parallel strategies.
    """
    from hftk.plan import HEADROOM
    from hftk.strategies import sequence, tp_plans

    for name, degree in (("--tp_size", tp_size), ("--sp_size", sp_size)):
        if inputs.world_size % degree:
            raise HftkError(name, f"{degree} does not divide the world size {inputs.world_size}.",
                            f"choose a {name} that divides --world_size.")
    rows = [estimate_memory(shape, inputs, tp_size, tp_plans.replicated_params(model_config))] if tp_size > 1 else []
    rows += [sequence.estimate_memory(shape, inputs, sp_size)] if sp_size > 1 else []
    for row in rows:
        row.fits = row.device_total <= inputs.device_memory_bytes * (1 - HEADROOM)
    return rows
