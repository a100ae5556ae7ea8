"""The strategy table: one :class:`StrategySpec` per strategy says which module implements it, which
engine drives it, how it launches and what it allows. Every check reads it (the CLI choices,
``hftk configs``, validation, the support table, the plan and ``auto``, the engines), so a strategy
is added or changed here and in its module (:mod:`hftk.strategies`), nowhere else.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from hftk.core.errors import HftkError

ALL_PACKING = ("concat", "bfd", "none")


@dataclass(frozen=True)
class StrategySpec:
    """One strategy: where it lives, how it launches, and what it allows (the refusals' reasons live
    in :mod:`hftk.config.support`, which reads these flags)."""

    module: str  # the module under hftk.config.strategy_table that implements it
    engine: str  # "trainer" (the HF Trainer: ddp, fsdp, ZeRO) or "loop" (hftk's custom loop: pipeline, tp, cp, sp)
    launch: str  # accelerate's distributed_type in its generated launch config
    usage: str  # one line for `hftk configs` and the launch config's header
    lora: bool = True  # LoRA adapters train under it
    quantized_base: bool = False  # a bitsandbytes 4/8-bit base (QLoRA) trains under it
    grad_compression: bool = False  # hftk's DDP communication hooks apply (its gradients go through a DDP reducer)
    packing: tuple[str, ...] = ALL_PACKING  # data.packing modes it keeps exact
    fixed_shape_batches: bool = False  # batches are rows of block_size (bfd needs sdpa / eager)
    auto_rank: int | None = None  # plan row order under `auto` (least sharding first); None: no analytic row
    options: tuple[str, ...] = ()  # strategy.* degrees only it reads
    zero_stage: int | None = None  # DeepSpeed ZeRO stage
    offload: bool = False  # parameters and optimizer state in CPU memory
    reshards_on_resume: bool = False  # resumes at another world size: whole, DCP-resharded or ZeRO -> universal
    experts_only: bool = False  # trains only mixtures of experts (a dense model is refused; its plan row is MoE-only)


_DS = "hftk.strategies.deepspeed"
_MESH = ("tp_size", "dp_replicate_size", "dp_shard_size")
STRATEGIES: dict[str, StrategySpec] = {
    "ddp": StrategySpec("hftk.strategies.ddp", "trainer", "MULTI_GPU",
                        "DDP: every rank holds the whole model; gradients are all-reduced.",
                        quantized_base=True, grad_compression=True, auto_rank=0, reshards_on_resume=True),
    "fsdp": StrategySpec("hftk.strategies.fsdp", "trainer", "FSDP",
                         "FSDP2: hftk shards every decoder block with fully_shard (its own options: --fsdp_*).",
                         quantized_base=True, auto_rank=4, reshards_on_resume=True),
    "zero1": StrategySpec(_DS, "trainer", "DEEPSPEED", "DeepSpeed ZeRO-1: optimizer state sharded.",
                          auto_rank=1, zero_stage=1, reshards_on_resume=True),
    "zero2": StrategySpec(_DS, "trainer", "DEEPSPEED", "DeepSpeed ZeRO-2: optimizer state and gradients sharded.",
                          auto_rank=2, zero_stage=2, reshards_on_resume=True),
    "zero3": StrategySpec(_DS, "trainer", "DEEPSPEED",
                          "DeepSpeed ZeRO-3: parameters, gradients and optimizer state sharded.",
                          auto_rank=5, zero_stage=3),
    "zero3_offload": StrategySpec(_DS, "trainer", "DEEPSPEED",
                                  "DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to CPU memory.",
                                  auto_rank=6, zero_stage=3, offload=True),
    "tp": StrategySpec("hftk.strategies.tensor", "loop", "MULTI_GPU",
                       "Tensor parallel x FSDP2: add --strategy tp --tp_size T [--dp_shard_size -1] (this launch "
                       "cannot say it).", lora=False, fixed_shape_batches=True, options=_MESH,
                       reshards_on_resume=True),
    "cp": StrategySpec("hftk.strategies.tensor", "loop", "MULTI_GPU",
                       "Ring-attention context parallel (x TP x FSDP2): add --strategy cp --cp_size C [--tp_size T] "
                       "(this launch cannot say it).", lora=False, packing=("concat",),
                       options=("cp_size", *_MESH), reshards_on_resume=True),
    "sp": StrategySpec("hftk.strategies.sequence", "loop", "MULTI_GPU",
                       "Ulysses sequence parallel: add --strategy sp --sp_size S (this launch cannot say it itself).",
                       lora=False, packing=("concat", "none"), options=("sp_size",), reshards_on_resume=True),
    # before fsdp in auto's order: the same sharded state, but each rank gathers only its own experts
    "ep": StrategySpec("hftk.strategies.expert", "loop", "MULTI_GPU",
                       "Expert parallel x FSDP2 (mixtures of experts): add --strategy ep [--ep_size N] (this launch "
                       "cannot say it).", fixed_shape_batches=True, auto_rank=3, options=("ep_size",),
                       reshards_on_resume=True, experts_only=True),
    "pipeline": StrategySpec("hftk.strategies.pipeline", "loop", "MULTI_GPU",
                             "Pipeline stages: add --strategy pipeline --pp_size N (this launch cannot say it itself).",
                             fixed_shape_batches=True, options=("pp_size",)),
}
# Least sharding first: ``auto`` takes the first plan row that fits (a dense model's plan leaves experts_only rows out).
AUTO_ORDER = tuple(sorted((n for n, s in STRATEGIES.items() if s.auto_rank is not None),
                          key=lambda n: STRATEGIES[n].auto_rank))
DEEPSPEED = tuple(n for n, s in STRATEGIES.items() if s.zero_stage is not None)


def get(name: str) -> ModuleType:
    """The module implementing strategy ``name``."""
    return importlib.import_module(spec(name).module)


def spec(name: str) -> StrategySpec:
    """The table's row of strategy ``name``."""
    if name not in STRATEGIES:
        raise HftkError("strategy.strategy", f"'{name}' is not implemented yet.",
                        f"use one of: {', '.join(STRATEGIES)}.")
    return STRATEGIES[name]
