"""Per-rank memory of every strategy, from the model's config alone, and the pick for ``auto``.

The model is built on the meta device (shapes, no storage, no weight download), so a plan for
a 70B Hub model costs a config download. Per rank, at the optimizer step (what
:mod:`hftk.bench.memory_worker` counts; the table below is fp32, AdamW):

=============  ==========  ==================================  =================================
strategy       parameters  gradients                           optimizer state
=============  ==========  ==================================  =================================
ddp            w P         w T                                 2 w T (two moments)
zero1, zero2   d P         4 T/N (fp32 copy of the partition)  12 T/N (fp32 master + moments)
fsdp, ep       w P/N       w T/N                               2 w T/N
zero3          d P/N       d T/N + bucket + 4 sub-group        8 T/N (+ 4 T/N master under bf16)
zero3_offload  d P/N       d T/N + bucket + 4 T/N              12 T/N, in host memory on a GPU
=============  ==========  ==================================  =================================

P parameters, T trainable (LoRA: the adapters only), N ranks, w bytes of the loaded dtype, d the
dtype DeepSpeed trains in (2 under bf16/fp16, else w). The peak adds ``transient`` (what a rank
holds on top at its worst moment: DDP's gradient buckets, FSDP's gathered blocks, ZeRO-1's whole
gradients until backward ends, ZeRO-2's partition before it becomes fp32, ZeRO-3's gathered
parameters), activations (what the model's own forward saves for backward, traced on the meta
device for the attention implementation the run uses: :mod:`hftk.models.activations`) and the runtime's
own footprint (torch and the process group; the CUDA context on a GPU), measured on this project's
machines. ``auto`` takes the least sharding that fits the per-rank budget with :data:`HEADROOM` to spare.

Expert parallel (``ep``, mixtures of experts only: a dense model's plan has no such row) holds what fsdp holds --
each rank ``E / ep`` experts of every MoE layer, FSDP2-sharded over the ``N / ep`` ranks holding the same ones, and
``1/N`` of the dense parts -- but gathers for a block only its dense part and its own experts (``1/ep`` of them),
not every expert as fsdp does; its activations add the routed token rows each MoE layer sends, receives and keeps
for backward. ``auto`` tries it before fsdp.

A quantized base (QLoRA; ddp and fsdp only) replaces ``w P`` by what bitsandbytes stores: the
weights it quantizes (every linear layer but the LM head) at 0.5 byte (4-bit) or 1 byte (8-bit)
per parameter, plus their constants -- 4-bit: an fp32 absmax per 64 weights, or with double
quantization an 8-bit one plus an fp32 absmax per 256 of those; 8-bit: an fp32 scale per output
row -- and the rest in fp32 (``prepare_model_for_kbit_training`` upcasts it); the constants stay
whole on every rank under FSDP. Adapters train in fp32. bitsandbytes' 8-bit optimizers
(``optim`` containing ``8bit``) keep 2 bytes per element plus an fp32 absmax per 256 for tensors
of 4096 elements or more that are not embeddings, and 8 bytes per element otherwise.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
from typing import Any

import torch

from hftk.config import strategy_table
from hftk.core.errors import HftkError
from hftk.models.activations import profile, trace_key
from hftk.models.loss import choose as choose_loss
from hftk.models.loss import chunk_tokens
from hftk.plan.types import (DTYPE_BYTES, GIB, HEADROOM, MAX_LIVE_PARAMETERS, MIB, RUNTIME_BYTES, SUB_GROUP_SIZE,
                             ModelShape, PlanInputs, StrategyPlan)

# the analytic rows of a dense model, least sharding first: ``auto`` takes the first that fits; a mixture of
# experts' plan adds the experts_only rows (plan_strategies)
PLAN_STRATEGIES = tuple(n for n in strategy_table.AUTO_ORDER if not strategy_table.STRATEGIES[n].experts_only)
DEEPSPEED_RUNTIME_BYTES = {"cpu": 50 * MIB, "gpu": 0}
QUANT_BLOCK = 64  # bitsandbytes' 4-bit block size (one absmax per block)
DOUBLE_QUANT_BLOCK = 256  # absmaxes per second-level block under double quantization
OPTIM_8BIT_MIN = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep 32-bit state
OPTIM_8BIT_BLOCK = 256  # elements per absmax of an 8-bit optimizer state


# ---- the model's shape, without weights ----

def model_shape(model_config: Any, lora_r: int = 0, lora_target_modules: str | None = None) -> ModelShape:
    """Count parameters of the model built on the meta device (LoRA adapters added the same way)."""
    from hftk.models.layout import block_modules, spec_of
    from hftk.models.moe import active_shares
    from hftk.models.spec import meta_model

    model = meta_model(model_config)
    hidden = _config_int(model_config, "hidden_size", "n_embd")
    blocks = block_modules(model)  # none when they cannot be derived: FSDP then gathers the whole model as one unit
    if lora_r:  # the adapters the run would add (hftk.models.lora: same targets), so T counts only them
        from peft import get_peft_model

        from hftk.config.options import ModelConfig
        from hftk.models.lora import lora_config, uses_conv1d

        lora = ModelConfig(lora_r=lora_r, lora_target_modules=lora_target_modules)
        model = get_peft_model(model, lora_config(lora, model_config, conv1d=uses_conv1d(model)))
    params = list(model.parameters())
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    shares = active_shares(model)  # expert weights: the share of tokens each serves
    largest = max(blocks, key=lambda b: sum(p.numel() for p in b.parameters()), default=None)
    moe = spec_of(model).moe
    quantizable, rows = _quantizable(model)
    optim_8bit = _optim_8bit(model)
    return ModelShape(
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        trainable_tensors=sum(1 for p in params if p.requires_grad),
        hidden=hidden,
        layers=len(blocks) or spec_of(model).layers,
        heads=_config_int(model_config, "num_attention_heads", "n_head"),
        vocab=_config_int(model_config, "vocab_size"),
        largest_block=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        outside_blocks=sum(p.numel() for p in params if id(p) not in in_blocks),
        persistent=sum(p.numel() for p in params if p.numel() <= 10 * hidden),
        saved=profile(model, blocks, _sliding_window(spec_of(model))),
        quantizable=quantizable, quantizable_rows=rows, optim_8bit=sum(optim_8bit),
        optim_8bit_tensors=len(optim_8bit), kv_width=kv_width(model_config),
        experts=sum(p.numel() for p in params if id(p) in shares),
        active=int(sum(p.numel() * shares.get(id(p), 1.0) for p in params)) if shares else 0,
        largest_block_experts=sum(p.numel() for p in largest.parameters() if id(p) in shares) if largest else 0,
        moe_layers=len(moe.layers) if moe else 0, top_k=moe.top_k if moe else 0,
        num_experts=moe.num_experts if moe else 0,
    )


def plan_strategies(shape: ModelShape) -> tuple[str, ...]:
    """The plan's rows for this model: :data:`PLAN_STRATEGIES`, and for a mixture of experts the rows only it has
    (expert parallel), in ``auto``'s order."""
    return strategy_table.AUTO_ORDER if shape.experts else PLAN_STRATEGIES


def kv_width(model_config: Any) -> int:
    """Elements one token's key (or value) holds per layer: the key/value heads (grouped-query attention: fewer than
    the query heads) times the head size."""
    hidden = _config_int(model_config, "hidden_size", "n_embd")
    heads = _config_int(model_config, "num_attention_heads", "n_head")
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    return kv_heads * (getattr(model_config, "head_dim", None) or hidden // heads)


def _sliding_window(spec: Any) -> int | None:
    """The window of the model's sliding layers (the activation trace's second regime), or None."""
    return spec.sliding_window if "sliding_attention" in spec.layer_types else None


def _quantizable(model: Any) -> tuple[int, int]:
    """(weights, output rows) of the layers transformers hands to bitsandbytes: linear layers (GPT-2's
    Conv1D too, which stores (in, out)) except the output embeddings (its ``get_keys_to_not_convert``);
    PEFT's own adapter layers are not part of the base."""
    head = model.get_output_embeddings()
    weights = rows = 0
    for name, module in model.named_modules():
        conv1d = type(module).__name__ == "Conv1D"
        if module is head or "lora_" in name or not (conv1d or isinstance(module, torch.nn.Linear)):
            continue
        weights += module.weight.numel()
        rows += module.weight.shape[1 if conv1d else 0]
    return weights, rows


def _optim_8bit(model: Any) -> list[int]:
    """Elements of each trainable tensor a bitsandbytes 8-bit optimizer keeps in 8 bits (the Trainer keeps
    embeddings in 32 bits; bitsandbytes keeps tensors under ``min_8bit_size`` there too)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [p.numel() for p in model.parameters()
            if p.requires_grad and id(p) not in embeddings and p.numel() >= OPTIM_8BIT_MIN]


def _config_int(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise HftkError("model.model_name_or_path", f"its config has none of {', '.join(names)}.",
                    "plan a decoder-only causal LM (GPT-2, GPT-NeoX, Llama, Mistral, Qwen2, ...).")


# ---- bytes per strategy ----

def activation_bytes(shape: ModelShape, inputs: PlanInputs, chunked_loss: bool = False) -> int:
    """One micro-batch's activations at their peak, early in backward: what its forward kept (traced,
    see :mod:`hftk.models.activations`; under activation checkpointing what lies outside the blocks plus
    every block's inputs), then the larger of two moments: the loss's fp32 gradients of the logits
    (two, plus their 16-bit cast under mixed precision) or a block's backward (recomputed whole under
    checkpointing; with eager attention plus the gradient of its probabilities). Within 10% of the
    peak RSS of real CPU runs at 1024 tokens (``tests/integration/test_activations.py``).

    ``chunked_loss`` (:mod:`hftk.models.loss`): the head and the loss keep nothing, and the logits' moment is one
    chunk's, whatever the tokens: its fp32 logits, their log-softmax and both gradients (plus the 16-bit logits
    and their cast gradient under mixed precision)."""
    b, s = inputs.micro_batch * (2 if inputs.pairs else 1), inputs.seq_len
    half = inputs.mixed_precision != "no" or inputs.dtype != "float32"
    trace = shape.saved[trace_key(half, inputs.attention)]
    kept = trace.checkpointed.at(s) if inputs.gradient_checkpointing else trace.total.at(s)
    block_backward = trace.largest_block.gamma * s**2  # eager: one layer's probabilities' gradient
    if inputs.gradient_checkpointing:
        block_backward += trace.largest_block.at(s)
    if chunked_loss:
        chunk = min(b * s, chunk_tokens(shape.vocab))
        logits_moment = chunk * shape.vocab * (20 if half else 16)
        return int(b * (kept - trace.head_and_loss.at(s)) + max(logits_moment, b * block_backward))
    logits_grads = s * shape.vocab * (10 if half else 8)
    return int(b * (kept + max(logits_grads, block_backward)))


def estimate(strategy: str, shape: ModelShape, inputs: PlanInputs) -> StrategyPlan:
    """Per-rank bytes of ``strategy`` (one of :data:`PLAN_STRATEGIES`) at its optimizer step: the policy's,
    DPO's / GRPO's reference model beside it, and GRPO's generation."""
    return dataclasses.replace(policy_estimate(strategy, shape, inputs), reference=reference_bytes(strategy, shape, inputs),
                               generation=generation_bytes(strategy, shape, inputs))


def generation_bytes(strategy: str, shape: ModelShape, inputs: PlanInputs) -> int:
    """GRPO's rollouts on one rank (0 for other methods): transformers' KV cache over every layer for its rows at
    their longest (key and value, in the loaded dtype: TRL generates outside autocast), the last position's fp32
    logits per row, and the weights the strategy gathers for generation: the whole model under ZeRO-3 (TRL's
    ``ds3_gather_for_generation``), FSDP2's root and two blocks (the one in use, the prefetched one)."""
    if not inputs.rollout_rows:
        return 0
    w = DTYPE_BYTES[inputs.dtype]
    cache = 2 * shape.layers * shape.kv_width * inputs.rollout_tokens * inputs.rollout_rows * w
    logits = 4 * shape.vocab * inputs.rollout_rows
    d = 2 if inputs.mixed_precision != "no" else w
    gathered = {"zero3": d * shape.params, "zero3_offload": d * shape.params,
                "fsdp": w * (shape.outside_blocks + 2 * shape.largest_block)}.get(strategy, 0)
    return cache + logits + gathered


def reference_bytes(strategy: str, shape: ModelShape, inputs: PlanInputs) -> int:
    """DPO's reference as hftk / TRL hold it (engine/preference.py): a whole copy in the loaded dtype under ddp;
    sharded like the policy under fsdp (FSDP2, loaded dtype); under ZeRO-1/2 a whole copy that TRL's DeepSpeed
    inference engine casts to the run's 16-bit type, under ZeRO-3 partitioned likewise; of the named reference's
    size where one is named. No reference: 0."""
    if not inputs.reference:
        return 0
    p = shape.params if inputs.reference_params is None else inputs.reference_params
    n, w = inputs.world_size, DTYPE_BYTES[inputs.dtype]
    d = 2 if inputs.mixed_precision != "no" else w
    return {"ddp": w * p, "fsdp": _ceil(w * p, n), "zero1": d * p, "zero2": d * p}.get(strategy, d * _ceil(p, n))


def policy_estimate(strategy: str, shape: ModelShape, inputs: PlanInputs) -> StrategyPlan:
    """Per-rank bytes of the trained model under ``strategy`` at its optimizer step.

    ``params`` / ``grads`` / ``optimizer`` are what a rank holds while its optimizer steps (what
    :mod:`hftk.bench.memory_worker` counts); ``transient`` is what it holds on top at its worst
    moment (buckets, gathered blocks, DeepSpeed's gradients before they become fp32 partitions).
    """
    n, p, t = inputs.world_size, shape.params, shape.trainable
    w = DTYPE_BYTES[inputs.dtype]
    half = inputs.mixed_precision != "no"
    chunked = choose_loss(inputs.loss, strategy_table.spec(strategy).engine) == "chunked"
    activations = activation_bytes(shape, inputs, chunked)
    runtime = RUNTIME_BYTES[inputs.device]
    if inputs.quant_bits:  # QLoRA: the stored base as bitsandbytes keeps it; adapters in fp32
        stored, constants = quantized_base_bytes(shape, inputs)
        w = 4
    else:
        stored, constants = w * p, 0
    if strategy == "ddp":
        bucket = t * w  # the reducer's buckets hold a second copy of every gradient
        return StrategyPlan(strategy, stored + constants, t * w, optimizer_bytes(shape, inputs, w, 1), bucket,
                            activations, runtime, 0)
    if strategy == "fsdp":
        # sharded parameters stay in the loaded dtype (MixedPrecisionPolicy casts only gathered copies)
        per_param = stored / p  # bytes per parameter as stored (quantized: under w)
        gathered = int((2 if half else per_param) * 2 * shape.largest_block)  # the block in use + the prefetched one
        transient = gathered + w * shape.largest_block + w * shape.outside_blocks  # its unsharded grads, the root
        return StrategyPlan(strategy, _ceil(stored, n) + constants, w * _ceil(t, n), optimizer_bytes(shape, inputs, w, n),
                            transient, activations, runtime, 0)
    if strategy == "ep":
        return expert_parallel_estimate(shape, inputs, stored, activations, runtime)
    # DeepSpeed: the model in d bytes (it casts to bf16/fp16); the optimizer steps fp32 partitions
    # (a master copy, except fp32 ZeRO-3 whose partition is the master); its gradient is an fp32
    # copy of the partition (ZeRO-3: of one sub-group of it at a time).
    d = 2 if half else w
    part = _ceil(t, n)
    bucket = shape.hidden**2 * d  # reduce_bucket_size: h^2 elements
    runtime += DEEPSPEED_RUNTIME_BYTES[inputs.device]
    if strategy in ("zero1", "zero2"):
        # ZeRO-1 keeps whole gradients until backward ends; ZeRO-2 its reduced partition (+ one bucket)
        # until the step flattens it into the fp32 copy counted in grads.
        extra = d * t - 4 * part if strategy == "zero1" else d * part + bucket
        return StrategyPlan(strategy, d * p, 4 * part, 12 * part, max(extra, 0), activations, runtime, 0)
    offload = strategy == "zero3_offload"
    step_grad = 4 * (part if offload else min(part, SUB_GROUP_SIZE))
    master = 4 * part if (offload or d != 4) else 0
    gathered = d * int(0.9 * shape.hidden**2) + d * min(MAX_LIVE_PARAMETERS, shape.largest_block)  # prefetch + live
    params, grads, optimizer = d * _ceil(p, n), d * part + bucket + step_grad, master + 8 * part
    offloaded = params + step_grad + optimizer if offload and inputs.device == "gpu" else 0
    return StrategyPlan(strategy, params, grads, optimizer, gathered + d * shape.persistent, activations, runtime,
                        offloaded)


def expert_parallel_estimate(shape: ModelShape, inputs: PlanInputs, stored: int, activations: int,
                             runtime: int) -> StrategyPlan:
    """Strategy ep: fsdp's sharded state (experts ``1/ep`` per rank, then FSDP2 over the ``N / ep`` holding the same;
    the dense parts ``1/N``); a block's gather is its dense part and this rank's experts, plus the layer's routed rows
    in flight (``k`` per token, sent and received). What backward keeps is the model's own (the experts' inputs and
    outputs, ``k`` rows per token on whichever rank runs them), traced without expert parallel."""
    n, t, w = inputs.world_size, shape.trainable, DTYPE_BYTES[inputs.dtype]
    ep = inputs.ep_size or n
    if n % ep or shape.num_experts % ep:
        return StrategyPlan.refusal("ep", f"ep_size {ep} must divide the world size {n} and the {shape.num_experts} "
                                    "experts of each MoE layer")
    half = inputs.mixed_precision != "no"
    block = shape.largest_block - shape.largest_block_experts + _ceil(shape.largest_block_experts, ep)
    routed = 2 * inputs.micro_batch * inputs.seq_len * shape.top_k * shape.hidden * (2 if half else w)
    transient = int((2 if half else w) * 2 * block) + w * block + w * shape.outside_blocks + routed
    return StrategyPlan("ep", _ceil(stored, n), w * _ceil(t, n), optimizer_bytes(shape, inputs, w, n), transient,
                        activations, runtime, 0)


def quantized_base_bytes(shape: ModelShape, inputs: PlanInputs) -> tuple[int, int]:
    """(bytes of the parameters as stored, bytes of the quantization constants beside them) of a
    bitsandbytes base: the quantized weights packed, everything else fp32 (adapters included)."""
    q, rest = shape.quantizable, 4 * (shape.params - shape.quantizable)
    if inputs.quant_bits == 8:
        return q + rest, 4 * shape.quantizable_rows  # int8 weights, an fp32 scale per output row
    blocks = _ceil(q, QUANT_BLOCK)
    constants = blocks + 4 * _ceil(blocks, DOUBLE_QUANT_BLOCK) if inputs.double_quant else 4 * blocks
    return _ceil(q, 2) + rest, constants


def optimizer_bytes(shape: ModelShape, inputs: PlanInputs, w: int, ranks: int) -> int:
    """AdamW's state over ``ranks`` shards: two moments of ``w`` bytes and a step counter per tensor, or
    bitsandbytes' 8-bit state (2 bytes and an fp32 absmax per 256 elements each, for large tensors)."""
    t = shape.trainable
    if inputs.optim_bits != 8:
        return 2 * w * _ceil(t, ranks) + 4 * shape.trainable_tensors
    small, large = t - shape.optim_8bit, shape.optim_8bit
    qmaps = 2 * 256 * 4 if large else 0  # the two 256-entry quantization maps, shared by every tensor
    return _ceil(8 * small + 2 * large + 8 * _ceil(large, OPTIM_8BIT_BLOCK), ranks) + qmaps


def _ceil(count: int, ranks: int) -> int:
    return -(-count // ranks)


def plan(shape: ModelShape, inputs: PlanInputs, strategies: tuple[str, ...] | None = None) -> list[StrategyPlan]:
    """Every strategy's plan, ``fits`` set against the budget with headroom."""
    budget = inputs.device_memory_bytes * (1 - HEADROOM)
    plans = [estimate(s, shape, inputs) for s in (plan_strategies(shape) if strategies is None else strategies)]
    for p in plans:
        p.fits = p.device_total <= budget
    return plans


def pick(plans: list[StrategyPlan]) -> StrategyPlan | None:
    """The least sharding that fits (plans are ordered least sharding first)."""
    return next((p for p in plans if p.fits), None)


# ---- inside a run: --strategy auto ----

def device_memory_bytes(cfg: Any) -> tuple[int, str]:
    """The per-rank budget: the option, else the GPU's free memory, else RAM / processes on this node."""
    if cfg.strategy.device_memory_gb is not None:
        return int(cfg.strategy.device_memory_gb * GIB), "strategy.device_memory_gb"
    if torch.cuda.is_available() and not cfg.training.get("use_cpu"):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        free, total = torch.cuda.mem_get_info(local_rank)  # what other processes hold is not ours to plan
        return free, f"the GPU's free memory ({total / GIB:.1f} GiB total)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local, f"RAM / {local} process(es)"


def inputs_from_config(cfg: Any, world_size: int, budget: int) -> PlanInputs:
    t = cfg.training
    on_gpu = torch.cuda.is_available() and not t.get("use_cpu")
    fields: dict[str, Any] = dict(
        world_size=world_size, device_memory_bytes=budget, seq_len=cfg.data.block_size,
        micro_batch=cfg.args.per_device_train_batch_size, dtype=cfg.model.model_dtype,
        mixed_precision="bf16" if t.get("bf16") else "fp16" if t.get("fp16") else "no",
        gradient_checkpointing=bool(t.get("gradient_checkpointing")), device="gpu" if on_gpu else "cpu",
        attention=cfg.model.attn_implementation or "sdpa", ep_size=max(cfg.strategy.ep_size, 0),
        loss=cfg.model.loss_implementation if cfg.preference.method == "sft" else "plain",
        **quantization_inputs(cfg.model.load_in_4bit, cfg.model.load_in_8bit, cfg.model.bnb_4bit_use_double_quant,
                              str(cfg.args.optim)),
    )
    return PlanInputs(**{**fields, **preference_inputs(cfg), **rl_inputs(cfg)})


def rl_inputs(cfg: Any) -> dict[str, Any]:
    """GRPO's PlanInputs fields: sequences of the longest prompt (data.block_size: longer ones are dropped) plus
    max_completion_length, whether a reference model is held (beta > 0, not under LoRA: the policy with its adapter
    off is the reference then), and the rollouts each rank generates at once."""
    if cfg.preference.method != "grpo":
        return {}
    tokens = cfg.data.block_size + (cfg.rl.max_completion_length or 512)  # GRPOConfig's default
    return {"seq_len": tokens, "rollout_tokens": tokens, "reference": cfg.preference.beta > 0 and not cfg.model.lora_r,
            "rollout_rows": cfg.args.per_device_train_batch_size * cfg.args.gradient_accumulation_steps}


def preference_inputs(cfg: Any) -> dict[str, Any]:
    """DPO's PlanInputs fields: pairs per micro-batch, sequences of max_length, whether a reference model is held
    (not under LoRA, whose reference is the base with the adapter off, nor with precomputed log-probs), and the
    size of a separately named one."""
    p = cfg.preference
    if p.method != "dpo":
        return {}
    named = p.ref_model_name_or_path
    held = reference_held(p.method, cfg.model.lora_r, p.precompute_ref_log_probs, named)
    size = {"reference_params": reference_params(cfg.model, named)} if held and named else {}
    return {"pairs": True, "reference": held, "seq_len": p.max_length or cfg.data.block_size, **size}


def reference_held(method: str, lora_r: int | None, precompute_ref_log_probs: bool, named: str | None) -> bool:
    """Whether DPO holds a reference model beside the policy: not under LoRA (the base with the adapter off is
    the reference), nor with precomputed log-probs unless one is named (TRL keeps a named one)."""
    return method == "dpo" and not lora_r and (not precompute_ref_log_probs or named is not None)


def reference_params(model: Any, name: str) -> int:
    """The parameters of the reference model ``name`` (its config, read as ``model``'s options read the policy's,
    built on the meta device): a named reference need not be the policy's size."""
    from hftk.models.loading import load_model_config

    return model_shape(load_model_config(dataclasses.replace(model, model_name_or_path=name))).params


def quantization_inputs(load_in_4bit: bool, load_in_8bit: bool, double_quant: bool, optim: str) -> dict[str, Any]:
    """The PlanInputs fields of a quantized base and a bitsandbytes 8-bit optimizer."""
    return {"quant_bits": 4 if load_in_4bit else 8 if load_in_8bit else 0, "double_quant": double_quant,
            "optim_bits": 8 if "8bit" in optim else 32}


def runnable(cfg: Any, world_size: int, strategies: tuple[str, ...] = PLAN_STRATEGIES
             ) -> tuple[tuple[str, ...], dict[str, str]]:
    """The plan's ``strategies`` this config can run at this world size, and why the others cannot."""
    from hftk.config import support
    from hftk.models.loading import quantized_field

    ok, why = [], {}
    for name in strategies:
        trial = copy.deepcopy(cfg)
        trial.strategy.strategy = name
        try:
            support.check_quantized(name, quantized_field(cfg.model))
            strategy_table.get(name).validate(trial, world_size)
        except HftkError as exc:
            why[name] = exc.one_line()
            continue
        ok.append(name)
    return tuple(ok), why


def resolve_auto(cfg: Any, model_config: Any, world_size: int) -> str:
    """Replace ``auto`` by the least sharding that fits; print the choice on rank 0."""
    budget, source = device_memory_bytes(cfg)
    inputs = inputs_from_config(cfg, world_size, budget)
    shape = model_shape(model_config, cfg.model.lora_r, cfg.model.lora_target_modules)
    candidates, why_not = runnable(cfg, world_size, plan_strategies(shape))
    plans = plan(shape, inputs, candidates)
    chosen = pick(plans)
    if chosen is None:
        smallest = min(plans, key=lambda p: p.device_total, default=None)
        need = f"; the smallest, {smallest.strategy}, needs {_gib(smallest.device_total)}" if smallest else ""
        raise HftkError("strategy.strategy", f"auto: no strategy fits {_gib(budget)} per rank ({source}) with "
                        f"{HEADROOM:.0%} headroom at world size {world_size}{need}.",
                        "launch more ranks, enable --gradient_checkpointing, lower --per_device_train_batch_size "
                        "or --block_size, train LoRA (--lora_r 8), or raise --device_memory_gb.")
    if int(os.environ.get("RANK", "0")) == 0:
        others = ", ".join(f"{p.strategy} {_gib(p.device_total)}" for p in plans)
        skipped = f"; not runnable: {', '.join(why_not)}" if why_not else ""
        print(f"hftk: strategy auto -> {chosen.strategy} (budget {_gib(budget)} per rank from {source}, "
              f"{HEADROOM:.0%} headroom; predicted peaks: {others}{skipped})", flush=True)
    return chosen.strategy


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _size(n: int) -> str:
    if n < MIB:
        return f"{n / 1024:,.0f} KiB"
    return f"{n / MIB:,.0f} MiB" if n < 100 * GIB else f"{n / GIB:,.0f} GiB"


# ---- hftk plan ----

def _seq_len(text: str) -> int | str:
    return "max" if text == "max" else _positive(int)(text)


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hftk plan", exit_on_error=False,
                                description="Per-rank memory of every strategy from the model's config alone "
                                "(meta device: no weights are downloaded), and what --strategy auto would pick.")
    p.add_argument("--model", help="Hub id, local folder, or builtin:NAME (required)")
    p.add_argument("--model_revision", default="main", help="Hub revision of the model")
    p.add_argument("--trust_remote_code", action="store_true", help="run code shipped with a Hub model's config")
    p.add_argument("--world_size", type=_positive(int), help="ranks (processes) in the run (required)")
    p.add_argument("--device_memory", type=_positive(float), help="memory per rank, GiB (required)")
    p.add_argument("--seq_len", type=_seq_len, default=128, help="tokens per sequence (data.block_size); max: print "
                   "each strategy's longest sequence that fits instead")
    p.add_argument("--micro_batch", type=_positive(int), default=8, help="sequences per rank per step")
    p.add_argument("--lora_r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--lora_target_modules", default=None,
                   help="comma-separated LoRA targets (default: the architecture's attention and MLP projections)")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float32", help="dtype the weights are loaded in")
    p.add_argument("--load_in_4bit", action="store_true", help="QLoRA: the base in 4 bits (bitsandbytes; needs "
                   "--lora_r; planned for ddp and fsdp, the strategies that train it)")
    p.add_argument("--load_in_8bit", action="store_true", help="the base in 8 bits (bitsandbytes; needs --lora_r)")
    p.add_argument("--no_double_quant", action="store_true", help="4-bit without double quantization of the scales")
    p.add_argument("--optim", default="adamw_torch", help="training.optim; one containing 8bit (adamw_bnb_8bit) "
                   "counts bitsandbytes' 8-bit state")
    p.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default="no", help="training.bf16/fp16")
    p.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--attn_implementation", default="sdpa", help="model.attn_implementation of the run: eager keeps "
                   "every layer's (b, heads, s, s) probabilities; sdpa / flash_attention_2 keep none")
    p.add_argument("--loss_implementation", choices=["auto", "chunked", "plain"], default="auto",
                   help="model.loss_implementation of the run: chunked holds one chunk's logits, plain every token's "
                   "(auto: chunked on the Trainer's strategies; DPO / GRPO: plain)")
    p.add_argument("--tp_size", type=_positive(int), default=1, help="also show tensor parallel of this degree "
                   "(FSDP2 over the other ranks; strategy tp)")
    p.add_argument("--sp_size", type=_positive(int), default=1, help="also show Ulysses sequence parallel of this "
                   "degree (strategy sp)")
    p.add_argument("--cp_size", type=_positive(int), default=1, help="also show ring-attention context parallel of "
                   "this degree (strategy cp, with --tp_size when given; FSDP2 over the other ranks)")
    p.add_argument("--ep_size", type=_positive(int), default=None, help="a mixture of experts' expert-parallel "
                   "degree for its ep row (strategy ep; default: the world size)")
    p.add_argument("--device", choices=["gpu", "cpu"], default=None,
                   help="what a rank's memory is (default: gpu when one is present, else cpu)")
    p.add_argument("--method", choices=["sft", "dpo", "grpo"], default="sft", help="training.method: dpo runs "
                   "chosen and rejected through one forward (2 x --micro_batch sequences) beside a frozen reference "
                   "model; grpo generates --micro_batch x --gradient_accumulation_steps completions per rank (their KV "
                   "cache) and trains on --seq_len (the longest prompt) + --max_completion_length tokens")
    p.add_argument("--max_completion_length", type=_positive(int), default=512, help="GRPO: most new tokens per "
                   "completion (GRPOConfig's default 512)")
    p.add_argument("--gradient_accumulation_steps", type=_positive(int), default=1, help="GRPO: micro-batches per "
                   "optimizer step; a rank generates the completions of all of them at once")
    p.add_argument("--beta", type=float, default=0.0, help="GRPO: the KL weight; above 0 a reference model is held "
                   "(not under --lora_r: the base with the adapter off is the reference)")
    p.add_argument("--precompute_ref_log_probs", action="store_true", help="DPO: the reference's log-probs computed "
                   "before training, so no reference model is held (with --lora_r none is either)")
    p.add_argument("--ref_model_name_or_path", default=None, help="DPO: a separate reference model (a folder or Hub "
                   "id; its config is read): the plan counts its parameters, not the policy's")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def plan_command(argv: list[str]) -> int:
    """``hftk plan``: print the per-rank memory table and the pick."""
    from hftk.config.options import ModelConfig
    from hftk.config.support import QUANT_STRATEGIES
    from hftk.models.loading import context_length, load_model_config

    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise HftkError(exc.argument_name or "hftk plan", f"{exc.message}.", "see `hftk plan --help`.") from None
    if unknown:
        raise HftkError(unknown[0], "is not an option of hftk plan.", "see `hftk plan --help`.")
    for name in ("model", "world_size", "device_memory"):
        if getattr(args, name) is None:
            raise HftkError(f"--{name}", "is required.", "e.g. hftk plan --model gpt2 --world_size 8 --device_memory 80")
    if args.lora_r < 0:
        raise HftkError("--lora_r", f"must be >= 0, got {args.lora_r}.", "use 0 (full fine-tuning) or e.g. 8.")
    quant = quantization_inputs(args.load_in_4bit, args.load_in_8bit, not args.no_double_quant, args.optim)
    if quant["quant_bits"] and not args.lora_r:
        raise HftkError("--load_in_4bit" if args.load_in_4bit else "--load_in_8bit", "quantizes the frozen base, "
                        "which trains only with LoRA.", "add --lora_r (e.g. 8).")
    device = args.device or ("gpu" if torch.cuda.is_available() else "cpu")
    model_cfg = ModelConfig(model_name_or_path=args.model, model_revision=args.model_revision,
                            trust_remote_code=args.trust_remote_code)
    model_config = load_model_config(model_cfg)
    named = args.ref_model_name_or_path
    grpo = args.method == "grpo"
    held = reference_held(args.method, args.lora_r, args.precompute_ref_log_probs, named) or \
        (grpo and args.beta > 0 and not args.lora_r)
    longest = args.seq_len == "max"
    if longest and grpo:
        raise HftkError("--seq_len", "max plans supervised and DPO runs (GRPO's length is the prompt's plus "
                        "--max_completion_length).", "give --seq_len the longest prompt's tokens.")
    limit = context_length(model_config)
    tokens = (limit or 128) if longest else args.seq_len + (args.max_completion_length if grpo else 0)
    if limit is not None and tokens > limit:
        raise HftkError("--seq_len", f"{tokens} tokens" + (" (with --max_completion_length)" if grpo else "") +
                        f" exceed the model's context length {limit}.", f"use at most {limit} tokens.")
    inputs = PlanInputs(world_size=args.world_size, device_memory_bytes=int(args.device_memory * GIB),
                        seq_len=tokens, micro_batch=args.micro_batch, dtype=args.dtype,
                        rollout_rows=args.micro_batch * args.gradient_accumulation_steps if grpo else 0,
                        rollout_tokens=tokens if grpo else 0,
                        mixed_precision=args.mixed_precision, gradient_checkpointing=args.gradient_checkpointing,
                        attention=args.attn_implementation, device=device, ep_size=args.ep_size or 0,
                        pairs=args.method == "dpo", reference=held, **quant,
                        loss=args.loss_implementation if args.method == "sft" else "plain",
                        reference_params=reference_params(model_cfg, named) if held and named else None)
    shape = model_shape(model_config, args.lora_r, args.lora_target_modules)
    if longest:
        print(format_longest(shape, inputs, QUANT_STRATEGIES if inputs.quant_bits else plan_strategies(shape),
                             limit or MAX_SEARCHED_TOKENS))
        return 0
    plans = plan(shape, inputs, QUANT_STRATEGIES if inputs.quant_bits else None)
    chosen = pick(plans)
    if not inputs.quant_bits:  # tp / cp / sp train no LoRA, so no quantized base
        plans += strategy_table.get("tp").plan_rows(  # tp / cp / sp rows: their own module
            model_config, shape, inputs, args.tp_size, args.sp_size, args.cp_size)
    if args.json:
        print(json.dumps({"shape": dataclasses.asdict(shape), "inputs": dataclasses.asdict(inputs),
                          "plans": [p.to_dict() for p in plans], "pick": chosen.strategy if chosen else None}))
        return 0
    print(format_table(shape, inputs, plans, chosen))
    return 0


MAX_SEARCHED_TOKENS = 2**20  # --seq_len max of a model whose config names no context length


def longest_fitting(strategy: str, shape: ModelShape, inputs: PlanInputs, limit: int) -> int:
    """The longest sequence (at most ``limit``) whose plan fits the budget with headroom; 0 when none does. Every
    term grows with the length, so a bisection finds it."""
    budget = inputs.device_memory_bytes * (1 - HEADROOM)

    def fits(tokens: int) -> bool:
        row = estimate(strategy, shape, dataclasses.replace(inputs, seq_len=tokens))
        return row.refused is None and row.device_total <= budget

    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def format_longest(shape: ModelShape, inputs: PlanInputs, strategies: tuple[str, ...], limit: int) -> str:
    """``hftk plan --seq_len max``: per strategy, the longest sequence that fits (the loss as the run computes it)."""
    budget = inputs.device_memory_bytes * (1 - HEADROOM)
    lines = [f"{shape.params / 1e6:.1f}M parameters, world size {inputs.world_size}, micro-batch {inputs.micro_batch}, "
             f"{inputs.dtype}{'' if inputs.mixed_precision == 'no' else ' + ' + inputs.mixed_precision}, loss "
             f"{inputs.loss}: the longest sequence that fits {budget / GIB:.2f} GiB per rank ({HEADROOM:.0%} headroom "
             f"kept; the model's context: {limit:,} tokens)", ""]
    for strategy in strategies:
        tokens = longest_fitting(strategy, shape, inputs, limit)
        loss = choose_loss(inputs.loss, strategy_table.spec(strategy).engine)
        capped = " (the model's context length)" if tokens == limit else ""
        lines.append(f"{strategy:<14} {f'{tokens:,} tokens' if tokens else 'none fits'} ({loss} loss){capped}")
    return "\n".join(lines)


def _rollouts(inputs: PlanInputs) -> str:
    if not inputs.rollout_rows:
        return ""
    held = "held" if inputs.reference else "not held"
    return f", GRPO rollouts of {inputs.rollout_rows} x {inputs.rollout_tokens} tokens per rank, reference model {held}"


def format_table(shape: ModelShape, inputs: PlanInputs, plans: list[StrategyPlan], chosen: StrategyPlan | None) -> str:
    experts = (f", {shape.experts / 1e6:.1f}M in experts, {shape.active / 1e6:.1f}M active per token"
               if shape.experts else "")
    head = (f"{shape.params / 1e6:.1f}M parameters ({shape.trainable / 1e6:.2f}M trainable{experts}), world size "
            f"{inputs.world_size}, {inputs.device_memory_bytes / GIB:.1f} GiB per rank ({inputs.device}), "
            f"micro-batch {inputs.micro_batch} x {inputs.seq_len} tokens, {inputs.dtype}"
            f"{'' if inputs.mixed_precision == 'no' else ' + ' + inputs.mixed_precision}"
            f"{f', {inputs.quant_bits}-bit base' if inputs.quant_bits else ''}"
            f"{', 8-bit optimizer' if inputs.optim_bits == 8 else ''}"
            f"{(', DPO pairs, reference model ' + ('held' if inputs.reference else 'not held')) if inputs.pairs else ''}"
            f"{_rollouts(inputs)}")
    cols = ["strategy", "params", "grads", "optimizer", "model state", "offloaded", "reference", "transient",
            "activations", "generation", "runtime", "peak", "fits"]
    estimated = [p for p in plans if p.refused is None]
    rows = [[p.strategy, *(_size(v) for v in (p.params, p.grads, p.optimizer, p.model_state, p.offloaded, p.reference,
                                              p.transient, p.activations, p.generation, p.runtime, p.device_total)),
             "yes" if p.fits else "no"] for p in estimated]
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols))]
    lines = [head, "", "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines += [f"{p.strategy.ljust(widths[0])}  refused: {p.refused}" for p in plans if p.refused is not None]
    budget = inputs.device_memory_bytes * (1 - HEADROOM)
    lines += ["", f"pick: {chosen.strategy}" if chosen else
              f"pick: none fits {budget / GIB:.2f} GiB ({HEADROOM:.0%} headroom kept)"]
    return "\n".join(lines)

