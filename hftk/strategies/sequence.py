"""Sequence parallel (``sp``): DeepSpeed Ulysses, each rank holding the whole model and 1/sp of every sequence.

The mesh is ``(dp, sp)`` with ``sp`` innermost. The ranks of one sequence-parallel group read the
same samples and each keeps its slice of every sequence (input ids, position ids, and the labels
shifted on the WHOLE sequence first); the ``dp`` ranks split the global batch, so no sample is fed
twice. Inside attention, DeepSpeed's ``UlyssesSPAttentionHF`` trades the sequence split for a head
split with two all-to-alls, so every rank attends over the full sequence for its heads.

Three traps of the stock integration are closed here:

- every batch carries ``position_ids`` (the adapter needs them to rebuild the causal order);
- the loss is the token-loss sum over all ranks divided by the global token count, and the
  gradients are summed over every rank (each holds the gradient of its own tokens only);
- accelerate registers the adapter with ``disable_in_eval=True``: in eval mode it keeps the
  sequence sharded but stops gathering attention, a wrong loss without an error; and
  ``from_pretrained`` returns an eval-mode model. hftk registers it with ``disable_in_eval=False``
  (evaluation is sequence parallel too) and the loop puts the model in train mode for every step.

Padded blocks (conversations, one per block) are exact too: hftk pads on the right, so causal attention
without a mask never lets a real token see a pad, and pads carry no label (a rank whose slice is all
padding adds nothing to the loss sum or the token count).

Only SDPA attention is supported: DeepSpeed refuses eager (it needs a 4-D mask), and flash
attention was not tested here.
"""

from __future__ import annotations

from typing import Any

import torch

from hftk.comm.collectives import BUCKET_BYTES, all_reduce_flat
from hftk.config.options import RunConfig
from hftk.config.support import check_lora
from hftk.core.errors import HftkError
from hftk.models.spec import check_strategy, model_spec
from hftk.strategies.mesh import LOOP_DEFAULTS as MESH_LOOP_DEFAULTS
from hftk.strategies.mesh import mesh_step
from hftk.strategies.parallel_dims import parallel_dims

ATTENTION = "sdpa"


def validate(cfg: RunConfig, world_size: int) -> None:
    """Degrees, attention kernel, sequence and head divisibility, supported options; before any process group."""
    from hftk.models.loading import load_model_config
    from hftk.strategies.mesh import check_training_options

    s = cfg.strategy
    parallel_dims(s, world_size)
    for name in ("tp_size", "dp_shard_size", "dp_replicate_size"):
        if getattr(s, name) != 1:
            raise HftkError(f"strategy.{name}", "does not compose with strategy sp in hftk.",
                            "use strategy sp (sp x data parallel) or strategy tp (tp x dp_shard x dp_replicate).")
    check_lora("sp", cfg.model.lora_r)  # under auto, LoRA must rule sp out
    if cfg.model.attn_implementation not in (None, ATTENTION):
        raise HftkError("model.attn_implementation", f"'{cfg.model.attn_implementation}' is not supported with "
                        "strategy sp (Ulysses needs an attention without a 4-D mask).", f"use {ATTENTION}.")
    if cfg.data.block_size % s.sp_size:
        raise HftkError("data.block_size", f"{cfg.data.block_size} tokens do not split evenly over sp_size {s.sp_size}.",
                        f"choose a block_size divisible by {s.sp_size}.")
    check_training_options(cfg, "sp")
    config = load_model_config(cfg.model)
    check_strategy(model_spec(config, cfg.model.trust_remote_code), "sp", cfg.data.block_size)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % s.sp_size or (kv % s.sp_size and s.sp_size % kv):
        raise HftkError("strategy.sp_size", f"the model's {heads} attention heads ({kv} key/value heads) do not split "
                        f"over sp_size {s.sp_size}.",
                        f"choose an sp_size that divides {heads} (and {kv}, or a multiple of it).")


def register_ulysses(model: Any, group: Any) -> None:
    """Route the model's SDPA attention through DeepSpeed's Ulysses adapter on ``group``.

    One adapter per micro-batch size (its shapes are fixed at construction), so evaluation
    batches of another size work too. The adapter replaces SDPA in transformers' attention
    registry for this process; the model's config must already select SDPA.
    """
    import deepspeed.comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)
    deepspeed.comm.init_distributed(dist_backend=torch.distributed.get_backend())
    core = sdpa_attention_forward  # not the registry's entry: an earlier run in this process replaced it
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    adapters: dict[int, UlyssesSPAttentionHF] = {}

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        batch = query.shape[0]
        if batch not in adapters:
            adapters[batch] = UlyssesSPAttentionHF(
                attn=core, batch_size=batch, attn_head_count=heads,
                attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // heads,
                kv_head_count=getattr(config, "num_key_value_heads", None) or heads,
                num_hidden_layers=config.num_hidden_layers, process_group=group, seq_length_is_variable=True,
                disable_in_eval=False,
            )
        # The mask HF built is for the local slice; causal SDPA over the gathered sequence replaces it.
        out, weights = adapters[batch](module, query, key, value, None, *args, **kwargs)
        # DeepSpeed hands back (batch, local sequence, heads x head_dim); transformers' SDPA gives (batch, sequence,
        # heads, head_dim), which models that merge heads from the output's own shape (GPT-2) need
        return out.view(*out.shape[:2], query.shape[1], -1), weights

    ALL_ATTENTION_FUNCTIONS[ATTENTION] = attention


def sequence_slice(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's contiguous slice of every sequence (the attention mask is dropped: causal SDPA replaces it)."""
    length = batch["input_ids"].shape[1] // size
    cut = slice(rank * length, (rank + 1) * length)
    return {k: v[:, cut] for k, v in batch.items() if k != "attention_mask"}


def layout(model: Any, cfg: RunConfig, device_type: str) -> Any:
    """Build the ``(dp, sp)`` mesh, register Ulysses, and say how the loop feeds and combines the ranks."""
    import torch.distributed as dist

    from hftk.strategies.mesh import MeshLayout

    sp = cfg.strategy.sp_size
    mesh = parallel_dims(cfg.strategy, dist.get_world_size()).mesh(device_type, ("dp_replicate", "sp"))
    sp_rank = mesh["sp"].get_local_rank()
    if sp > 1:
        register_ulysses(model, mesh["sp"].get_group())
    model.train()
    world = dist.group.WORLD
    return MeshLayout(
        model=model,
        data_rank=mesh["dp_replicate"].get_local_rank(),
        data_size=mesh["dp_replicate"].size(),
        data_groups=[world],  # every rank reads different tokens
        grad_scale=1.0,  # gradients are summed over all ranks, not averaged
        describe={"strategy": "sp", "sp_size": sp, "dp_size": mesh["dp_replicate"].size(), "family": model.config.model_type,
                  "attention": ATTENTION},
        shard_batch=lambda batch: sequence_slice(batch, sp_rank, sp),
        reduce_grads=lambda: (all_reduce_flat([p.grad for p in model.parameters() if p.grad is not None], world)
                              if dist.get_world_size() > 1 else None),
    )


def estimate_memory(shape: Any, inputs: Any, sp: int) -> Any:
    """Per-rank bytes of ``sp`` (an :class:`hftk.plan.estimate.StrategyPlan`): the whole model, 1/sp of the activations.

    Parameters, gradients and AdamW state are replicated (as under DDP); the flat all-reduce bucket
    is the transient. Each rank keeps ``s / sp`` tokens of every activation and attends over the
    whole sequence for ``a / sp`` heads, so per layer ``b s h (34 + 5 a s / h) / sp``, the score
    term only under eager attention (SDPA and flash kernels keep no scores).
    """
    from hftk.models.activations import SCORE_KEEPING
    from hftk.plan.types import DTYPE_BYTES, RUNTIME_BYTES, StrategyPlan

    w = DTYPE_BYTES[inputs.dtype]
    b, s, h = inputs.micro_batch, inputs.seq_len, shape.hidden
    scale = 2.0 if inputs.dtype == "float32" else 1.0  # the formula counts 16-bit activations
    scores = 5 * shape.heads * s / h if inputs.attention in SCORE_KEEPING else 0
    per_layer = b * s * h * (34 + scores) * scale / sp
    layers = (per_layer + b * s * h * 4 * (shape.layers - 1) / sp) if inputs.gradient_checkpointing \
        else per_layer * shape.layers
    activations = int(layers + 3 * b * s * shape.vocab * 4 / sp)
    bucket = 2 * min(shape.params * w, BUCKET_BYTES)  # the bucket and its flattened copy
    counters = 4 * shape.trainable_tensors  # torch AdamW's per-parameter step counters
    return StrategyPlan(f"sp{sp}", shape.params * w, shape.params * w, 2 * shape.params * w + counters, bucket,
                        activations, RUNTIME_BYTES[inputs.device], 0)


LOOP_DEFAULTS = MESH_LOOP_DEFAULTS  # the custom loop's defaults for options not given (engine/loop.training_overrides)


def build_step(model: Any, cfg: RunConfig, args: Any) -> Any:
    """The custom loop's step: ``model`` sharded by :func:`layout`."""
    return mesh_step(model, cfg, args, layout)
