"""What a memory plan is made of: its inputs, a model's shape, one strategy's per-rank bytes, and
the constants every strategy's estimate shares.

A leaf module: :mod:`hftk.plan.estimate` (the data-parallel formulas, ``auto``, ``hftk plan``) and the
strategies that estimate their own rows (``tp`` / ``cp`` / ``sp``) both import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hftk.models.activations import SavedActivations

HEADROOM = 0.2  # auto keeps this fraction of the budget free for what an estimate misses
GIB = 1024**3
MIB = 1024**2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Measured per-rank footprint before any model exists: torch + transformers (+ deepspeed) and the
# process group on CPU (RSS); the CUDA context and allocator on a GPU.
RUNTIME_BYTES = {"cpu": 500 * MIB, "gpu": 600 * MIB}

# ZeRO-3 knobs the DeepSpeed config sets and the plan counts, not derived from the hidden size (see the
# field notes: with DeepSpeed's defaults ZeRO-3 peaked above DDP on small models). Counts are elements.
MAX_LIVE_PARAMETERS = 1_000_000
MAX_REUSE_DISTANCE = 1_000_000
SUB_GROUP_SIZE = 5_000_000  # the optimizer steps over the partition in groups this big


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs from a model, read from its meta-device instance."""

    params: int  # distinct parameters (tied weights once)
    trainable: int
    trainable_tensors: int
    hidden: int
    layers: int
    heads: int
    vocab: int
    largest_block: int  # parameters of the biggest decoder block: FSDP's / ZeRO-3's gather unit
    outside_blocks: int  # embeddings, final norm, LM head: FSDP's root unit
    persistent: int  # parameters ZeRO-3 keeps whole on every rank (numel <= 10 h)
    saved: dict[str, SavedActivations]  # what backward keeps, per activations.trace_key (meta-device traces)
    quantizable: int = 0  # weights bitsandbytes quantizes (linear layers but the LM head)
    quantizable_rows: int = 0  # their output rows (8-bit: one fp32 scale each)
    optim_8bit: int = 0  # trainable elements an 8-bit optimizer keeps in 8 bits
    optim_8bit_tensors: int = 0
    kv_width: int = 0  # key (and value) elements one token caches per layer: key/value heads x head size
    experts: int = 0  # a mixture of experts' expert weights (all held, whatever a token uses)
    active: int = 0  # the parameters one token uses (its top-k experts of each MoE layer); 0: all of them
    largest_block_experts: int = 0  # the expert weights inside the biggest block (expert parallel splits them)
    moe_layers: int = 0  # blocks with experts
    top_k: int = 0  # experts each token is routed to
    num_experts: int = 0  # experts per MoE layer


@dataclass(frozen=True)
class PlanInputs:
    world_size: int
    device_memory_bytes: int
    seq_len: int = 128
    micro_batch: int = 8
    dtype: str = "float32"  # the dtype the weights are loaded in
    mixed_precision: str = "no"  # "bf16" / "fp16" (training.bf16 / training.fp16)
    gradient_checkpointing: bool = False
    attention: str = "sdpa"  # model.attn_implementation (transformers' default for these families: sdpa)
    device: str = "gpu"  # "cpu": host memory is the device (offload moves nothing off it)
    quant_bits: int = 0  # 4 / 8: the base loaded through bitsandbytes (QLoRA); 0: not quantized
    double_quant: bool = True  # 4-bit: bnb_4bit_use_double_quant
    optim_bits: int = 32  # 8: a bitsandbytes 8-bit optimizer (training.optim adamw_bnb_8bit, ...)
    pairs: bool = False  # DPO: a micro-batch is pairs, chosen and rejected through one forward (2 x micro_batch rows)
    reference: bool = False  # DPO: a frozen reference model beside the policy (none under LoRA or precomputed log-probs)
    reference_params: int | None = None  # DPO: a separately named reference's parameters (None: the policy's)
    rollout_rows: int = 0  # GRPO: the completions a rank generates at once (per-device batch x steps per generation)
    rollout_tokens: int = 0  # GRPO: the longest prompt + max_completion_length (the KV cache's length)
    ep_size: int = 0  # expert parallel: ranks each MoE layer's experts are split over (0: the world size)
    loss: str = "auto"  # model.loss_implementation (DPO / GRPO: "plain", TRL's log-probs); auto: chunked on the Trainer


@dataclass
class StrategyPlan:
    """Per-rank bytes of one strategy."""

    strategy: str
    params: int
    grads: int
    optimizer: int
    transient: int
    activations: int
    runtime: int
    offloaded: int  # model state held in host memory instead of the device
    fits: bool = False
    reference: int = 0  # DPO's / GRPO's frozen reference model, as this strategy holds it (no gradients, no optimizer)
    generation: int = 0  # GRPO's rollouts on top of the model state: the KV cache, the last logits, gathered weights
    refused: str | None = None  # why this model cannot run under the strategy (then the bytes are 0, not estimated)

    @classmethod
    def refusal(cls, strategy: str, why: str) -> "StrategyPlan":
        """The row of a strategy this model cannot run: its reason instead of an estimate."""
        return cls(strategy, 0, 0, 0, 0, 0, 0, 0, refused=why)

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device_total(self) -> int:
        """Predicted peak on one device (on CPU: the process's peak RSS): the larger of training's moment
        (activations) and GRPO's generation, which do not overlap."""
        return (self.model_state - self.offloaded + self.reference + self.transient + max(self.activations, self.generation)
                + self.runtime)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "model_state": self.model_state, "device_total": self.device_total}
