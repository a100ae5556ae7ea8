"""Tensor and context parallel (``tp``, ``cp``), composed with FSDP2 data parallel on one device mesh.

The mesh is ``(dp_replicate, dp_shard, cp, tp)`` and its size must equal the world size; ``tp``
is the innermost dimension, so a tensor-parallel group is made of neighbouring ranks (one node,
where its per-layer all-reduces are cheapest), and ``cp`` the next. Strategy ``tp`` keeps
``cp`` at 1; strategy ``cp`` needs ``cp_size`` 2 or more and may add ``tp_size``. In fixed
order, from outside the model code:

1. tensor parallel over ``tp`` (:mod:`hftk.strategies.tp_plans`): attention by heads, MLP by
   width, input embedding and LM head by vocabulary, the loss computed on vocabulary-sharded
   logits (``loss_parallel``);
2. context parallel over ``cp`` (:mod:`hftk.strategies.context`): every sequence split over the
   ``cp`` ranks, attention computed by torch's ring attention;
3. FSDP2 over the data-parallel dimensions and ``cp`` (whose ranks hold the same model):
   ``fully_shard`` on every decoder block, then the root, on ``dp_shard x cp`` (or HSDP on
   ``(dp_replicate, dp_shard x cp)``), which turns the tensor-parallel shards into 2-D (or 3-D)
   DTensors.

The ranks of one tensor- or context-parallel group read the same samples; the data-parallel
ranks split each global batch. The HF Trainer cannot drive this layout (see
:mod:`hftk.strategies.mesh`), so these strategies run on hftk's custom loop. ``tp_size 1`` on one
process is the plain model: the single-process reference the tests compare with.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hftk.config.options import RunConfig
from hftk.config.support import check_lora
from hftk.core.errors import HftkError
from hftk.strategies.mesh import LOOP_DEFAULTS as MESH_LOOP_DEFAULTS
from hftk.strategies.mesh import mesh_step
from hftk.strategies.parallel_dims import MESH_LOOP_DIMS, parallel_dims


def validate(cfg: RunConfig, world_size: int) -> None:
    """Mesh sizes, model plan and divisibility, and the options this layout supports, before any process group."""
    from hftk.models.loading import load_model_config
    from hftk.strategies import context, tp_plans
    from hftk.strategies.mesh import check_training_options, device_type

    s = cfg.strategy
    if s.sp_size > 1:
        raise HftkError("strategy.sp_size", f"Ulysses sequence parallel does not compose with strategy {s.strategy} "
                        "in hftk.", "use strategy cp (ring attention) to split sequences on this mesh, "
                        "or strategy sp (sp x data parallel).")
    if s.strategy == "cp" and s.cp_size < 2:
        raise HftkError("strategy.cp_size", f"strategy cp needs cp_size 2 or more, got {s.cp_size}.",
                        "pass --cp_size 2 (or more), or use strategy tp.")
    if s.fsdp_cpu_offload:
        raise HftkError("strategy.fsdp_cpu_offload", f"is not supported with strategy {s.strategy}.",
                        "drop it, or use strategy fsdp / zero3_offload for offloading.")
    check_lora(s.strategy, cfg.model.lora_r)  # under auto, LoRA must rule tp / cp out
    dims = parallel_dims(s, world_size)
    cp, tp = dims.cp, dims.tp
    check_training_options(cfg, s.strategy)
    model_config = load_model_config(cfg.model)
    if tp > 1:
        tp_plans.block_plan(model_config)
        tp_plans.check_divisible(model_config, tp)
    if cp > 1:
        context.validate(cfg, model_config, cp, device_type(cfg))


def shard_data_parallel(model: Any, mesh: Any, reshard_after_forward: bool) -> None:
    """FSDP2 over the data-parallel mesh dimensions and ``cp``: each decoder block, then the root."""
    from hftk.models.layout import layout as decoder_layout
    from hftk.strategies.fsdp import apply_fsdp

    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # the ranks that hold the same tensor-parallel shard
    dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard_cp"]
    apply_fsdp(model, list(decoder_layout(model).blocks), dp_mesh, reshard_after_forward)


def layout(model: Any, cfg: RunConfig, device_type: str) -> Any:
    """Build the mesh, shard ``model`` on it, and say how the loop feeds and combines it."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    from hftk.strategies import context
    from hftk.strategies.mesh import MeshLayout
    from hftk.comm.collectives import all_reduce_flat
    from hftk.models.spec import model_spec
    from hftk.strategies.tp_plans import apply_tensor_parallel, block_plan, partial_grad_params

    dims = parallel_dims(cfg.strategy, dist.get_world_size())
    replicate, shard, cp, tp = dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp
    mesh = dims.mesh(device_type, MESH_LOOP_DIMS)
    partial: list[str] = []
    experts_whole = tp > 1 and model_spec(model.config).moe is not None
    if tp > 1:
        partial = partial_grad_params(model, block_plan(model.config))
        apply_tensor_parallel(model, mesh["tp"])
    if experts_whole and dist.get_rank() == 0:
        print("hftk: tp: the model's tensor-parallel plan splits attention (and dense MLPs), not its experts: each "
              "tensor-parallel rank holds and runs every expert of its layers (FSDP2 shards them over the "
              "data-parallel ranks)", flush=True)
    if cp > 1:
        context.use_ring_attention(model)
    data_size = dims.data_parallel
    if data_size * cp > 1:
        shard_data_parallel(model, mesh, cfg.strategy.fsdp_reshard_after_forward)
    cp_rank = mesh["cp"].get_local_rank()
    params = dict(model.named_parameters())
    partial_params = [params[name] for name in partial if params[name].requires_grad]

    def sum_partial_grads() -> None:
        """Per-head norms (replicated, applied to this rank's heads): their gradients summed over the tp group."""
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in partial_params
                 if p.grad is not None]
        if grads:
            all_reduce_flat(grads, mesh["tp"].get_group())

    @contextlib.contextmanager
    def loss_context() -> Any:
        with (loss_parallel() if tp > 1 else contextlib.nullcontext()), \
                (context.ring_attention_context(mesh["cp"]) if cp > 1 else contextlib.nullcontext()):
            yield

    return MeshLayout(
        model=model,
        data_rank=mesh["dp_replicate"].get_local_rank() * shard + mesh["dp_shard"].get_local_rank(),
        data_size=data_size,
        data_groups=[mesh.get_group("dp_replicate"), mesh.get_group("dp_shard"), mesh.get_group("cp")],
        grad_scale=float(data_size * cp),  # FSDP2 averages gradients over the data-parallel and cp ranks
        describe={"strategy": cfg.strategy.strategy, "dp_replicate_size": replicate, "dp_shard_size": shard,
                  "cp_size": cp, "tp_size": tp, "family": model.config.model_type, "vocab_parallel_loss": tp > 1,
                  "experts_replicated_over_tp": experts_whole},
        shard_batch=(lambda batch: context.shard_sequences(batch, cp, cp_rank)) if cp > 1 else (lambda batch: batch),
        loss_context=loss_context,
        reduce_grads=sum_partial_grads,
    )


def estimate_memory(shape: Any, inputs: Any, tp: int, replicated: int, cp: int = 1) -> Any:
    """Per-rank bytes of ``tp`` / ``cp`` (an :class:`hftk.plan.estimate.StrategyPlan`): TP over ``tp``, FSDP2 over the rest.

    ``replicated`` parameters (:func:`hftk.strategies.tp_plans.replicated_params`) stay whole under
    TP; everything else is split ``tp`` ways, then FSDP2 splits what a rank holds over
    ``world_size / tp`` (the ``cp`` ranks included). Activations follow Korthikanti et al. for TP
    without sequence-parallel norms, per layer ``b s h (10 + 24 / t + 5 a s / (h t))``, the score
    term only under eager attention (SDPA and flash kernels keep no scores); under ``cp`` ``s`` is
    the 1/cp of each sequence a rank holds and the score term becomes a neighbour's K/V block
    ``2 / t`` (the ring's kernels keep no scores either); the logits are vocabulary-sharded.
    """
    from hftk.models.activations import SCORE_KEEPING
    from hftk.plan.types import DTYPE_BYTES, RUNTIME_BYTES, StrategyPlan

    data = max(inputs.world_size // tp, 1)
    w = DTYPE_BYTES[inputs.dtype]
    per_rank = -(-((shape.params - replicated) // tp + replicated) // data)
    transient = 0
    if data > 1:  # FSDP2: the gathered block (current + prefetched), its unsharded gradient, the root
        block = shape.largest_block // tp
        transient = 2 * block * w + block * 4 + shape.outside_blocks // tp * w
    b, s, h = inputs.micro_batch, max(inputs.seq_len // cp, 1), shape.hidden
    scale = 2.0 if inputs.dtype == "float32" else 1.0  # the formula counts 16-bit activations
    # ring attention runs flash-style kernels (no s x s scores kept) and holds a neighbour's K/V block
    scores = 2 / tp if cp > 1 else 5 * shape.heads * s / (h * tp) if inputs.attention in SCORE_KEEPING else 0
    per_layer = b * s * h * (10 + 24 / tp + scores) * scale
    layers = (per_layer + b * s * h * 4 * (shape.layers - 1)) if inputs.gradient_checkpointing else per_layer * shape.layers
    activations = int(layers + 3 * b * s * shape.vocab * 4 / tp)
    counters = 4 * shape.trainable_tensors  # torch AdamW's per-parameter step counters (every rank has all)
    parts = ([f"cp{cp}"] if cp > 1 else []) + ([f"tp{tp}"] if tp > 1 or cp == 1 else [])
    parts += [f"fsdp{data // cp}"] if data // cp > 1 else []
    return StrategyPlan(" x ".join(parts), per_rank * w, per_rank * w, 2 * per_rank * w + counters, transient, activations,
                        RUNTIME_BYTES[inputs.device], 0)


def plan_rows(model_config: Any, shape: Any, inputs: Any, tp_size: int, sp_size: int, cp_size: int = 1) -> list[Any]:
    """``hftk plan`` rows for tensor / context / sequence parallel at the asked degrees (shown; ``auto`` never
    picks them); a layout this model cannot run is a row saying why (its spec's refusal).

    Which layout suits a model is a question of interconnect and sequence length, not only of
    memory, so these rows inform and the pick stays among the data-parallel strategies.
    """
    from hftk.models.spec import model_spec, strategy_refusal
    from hftk.plan.types import HEADROOM, StrategyPlan
    from hftk.strategies import sequence, tp_plans

    for name, degree in (("--tp_size", tp_size), ("--sp_size", sp_size), ("--cp_size", cp_size),
                         ("--cp_size x --tp_size", cp_size * tp_size)):
        if inputs.world_size % degree:
            raise HftkError(name, f"{degree} does not divide the world size {inputs.world_size}.",
                            f"choose a {name} that divides --world_size.")
    spec = model_spec(model_config)
    asked = [("tp", tp_size > 1, f"tp{tp_size}"), ("cp", cp_size > 1, f"cp{cp_size}"), ("sp", sp_size > 1, f"sp{sp_size}")]
    refused = {s: strategy_refusal(spec, s, inputs.seq_len) for s, wanted, _ in asked if wanted}
    if tp_size > 1 and refused.get("cp") is None and refused.get("tp") is not None:
        refused["cp"] = refused["tp"]  # cp x tp shards the layers tp does
    rows = [StrategyPlan.refusal(label, refused[s].problem) for s, wanted, label in asked if wanted and refused[s]]
    replicated = tp_plans.replicated_params(model_config) if tp_size > 1 and refused.get("tp") is None else 0
    rows += [estimate_memory(shape, inputs, tp_size, replicated)] if tp_size > 1 and not refused["tp"] else []
    rows += [estimate_memory(shape, inputs, tp_size, replicated, cp_size)] if cp_size > 1 and not refused["cp"] else []
    rows += [sequence.estimate_memory(shape, inputs, sp_size)] if sp_size > 1 and not refused["sp"] else []
    for row in rows:
        row.fits = row.refused is None and row.device_total <= inputs.device_memory_bytes * (1 - HEADROOM)
    return rows


LOOP_DEFAULTS = MESH_LOOP_DEFAULTS  # the custom loop's defaults for options not given (engine/loop.training_overrides)


def build_step(model: Any, cfg: RunConfig, args: Any) -> Any:
    """The custom loop's step: ``model`` sharded by :func:`layout`."""
    return mesh_step(model, cfg, args, layout)
