"""What hftk supports per strategy: full fine-tuning or LoRA, a quantized (QLoRA) base, packing modes, preference
tuning (DPO, full, LoRA and QLoRA) and online RL (GRPO, full and LoRA), each refusal with its reason.

What each strategy allows is a flag in the strategy table (:data:`hftk.config.strategy_table.STRATEGIES`); this
module says why each refusal is one and raises it. The strategies' validators take their LoRA refusals
from here (:func:`check_lora`), the packing modes each strategy honours (:func:`check_packing`). What a model's
own structure allows is :mod:`hftk.models.spec`'s; the README's support table joins both
(:mod:`hftk.models.support_table`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hftk.config.strategy_table import STRATEGIES as TABLE
from hftk.core.errors import HftkError

STRATEGIES = tuple(TABLE)


@dataclass(frozen=True)
class Refusal:
    """A cell hftk refuses before launch: the field its one-line error names, and why."""

    field: str
    problem: str
    fix: str = ""


# LoRA under layouts that shard the very layers LoRA wraps (DTensor rows / columns, Ulysses heads).
_NO_LORA = tuple(n for n, spec in TABLE.items() if not spec.lora)
LORA_REFUSED = {
    strategy: Refusal("model.lora_r", f"LoRA is not supported with strategy {strategy}: its layout shards the "
                      "layers LoRA wraps.", f"use one of {', '.join(s for s in STRATEGIES if s not in _NO_LORA)} "
                      "(or auto) for LoRA, or set lora_r 0 to train the full model.")
    for strategy in _NO_LORA
}
# A bitsandbytes-quantized base (QLoRA: load_in_4bit / load_in_8bit) under the strategies shown to train
# it with single-process parity (tests/integration/test_qlora.py); the others are refused before launch, naming why.
QUANT_FIELD = "model.load_in_4bit"
QUANT_STRATEGIES = tuple(n for n, spec in TABLE.items() if spec.quantized_base)
_QUANT_FIX = (f"use --strategy {' or '.join(QUANT_STRATEGIES)} with load_in_4bit / load_in_8bit, or train LoRA on an "
              "unquantized base.")


def _quant_refusal(where: str, why: str) -> Refusal:
    return Refusal(QUANT_FIELD, f"a bitsandbytes-quantized base is not supported under {where}: {why}.", _QUANT_FIX)


_ZERO12 = _quant_refusal("DeepSpeed ZeRO-1/2", "its engine with bitsandbytes' packed weights is not verified by "
                         "hftk's tests")
_ZERO3 = _quant_refusal("ZeRO-3", "transformers loads a quantized base without ZeRO-3's partitioned init (every "
                        "rank holds it whole), and hftk's ZeRO-3 path requires the partitioned load")
QUANT_REFUSED = {
    "zero1": _ZERO12, "zero2": _ZERO12, "zero3": _ZERO3, "zero3_offload": _ZERO3,
    "pipeline": _quant_refusal("pipeline", "stages holding bitsandbytes layers are not verified by hftk's tests"),
    "ep": _quant_refusal("expert parallel", "bitsandbytes quantizes no fused expert weights (nn.Linear only), and "
                         "its 4-bit layers under ep's FSDP2 layout are not verified by hftk's tests"),
    **LORA_REFUSED,  # a quantized base trains adapters only, and LoRA is refused first there
}
assert set(QUANT_REFUSED) | set(QUANT_STRATEGIES) == set(STRATEGIES), "every strategy decides on a quantized base"


def check_quantized(strategy: str, field: str | None) -> None:
    """Raise the table's refusal of a quantized base under ``strategy``; ``field`` names the option that
    quantizes (``model.load_in_4bit`` / ``model.load_in_8bit``), None when the base is not quantized."""
    if field is not None and (refusal := QUANT_REFUSED.get(strategy)) is not None:
        raise HftkError(field if refusal.field == QUANT_FIELD else refusal.field, refusal.problem, refusal.fix)


# Packing modes (data.packing) each engine honours. bfd needs position ids that restart per example
# and no attention mask (transformers then masks across examples): the Trainer strategies pass the
# batch to the model as it is, the pipeline's stages build each stage's mask from the batch's position
# ids with transformers' create_causal_mask (as the model's own forward does), and tp hands the batch
# to the model itself. Under pipeline, tp and sp 'none' pads to block_size (fixed shapes across stages
# and ranks); cp's ring takes no padding mask.
PACKING_SUPPORT = {n: spec.packing for n, spec in TABLE.items()}
# Why a strategy refuses bfd (measured / read in the libraries they run on).
BFD_REFUSED = {
    "cp": "ring attention takes no padding mask and does not keep packed examples apart",
    "sp": "DeepSpeed's Ulysses attention (UlyssesSPAttentionHF) drops the mask transformers builds from the "
          "position ids and runs sdpa causally over the whole gathered row, so packed examples would attend "
          "to each other (only its flash-attention path reads packed position ids, and hftk's sp runs sdpa)",
}
assert set(BFD_REFUSED) == {s for s, m in PACKING_SUPPORT.items() if "bfd" not in m}, "every bfd refusal says why"
# Attention implementations that build the packed (block-diagonal) mask from position ids when no
# attention mask is passed: transformers' sdpa and eager masks (masking_utils.find_packed_sequence_indices,
# tested on CPU for GPT-2, GPT-NeoX, Llama, Mistral, Qwen2) and the flash kernels' varlen path, which
# reads packing only from a batch of one row (modeling_flash_attention_utils._is_packed_sequence). The
# Trainer's collator flattens bfd batches into that one row under flash attention; pipeline stages and
# tp take fixed (rows x block_size) batches, so they keep bfd to sdpa and eager.
BFD_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
FIXED_SHAPE_BFD_ATTENTION = {n: ("sdpa", "eager") for n, spec in TABLE.items()
                             if spec.fixed_shape_batches and "bfd" in spec.packing}


def packing_refusal(strategy: str, packing: str, attn_implementation: str | None) -> Refusal | None:
    """Why ``packing`` cannot run under ``strategy`` (or with that attention), or None."""
    if packing not in PACKING_SUPPORT[strategy]:
        return Refusal("data.packing", f"packing {packing} is not supported with strategy {strategy}: "
                       f"{BFD_REFUSED[strategy]}.", f"use --packing {' or '.join(PACKING_SUPPORT[strategy])}, or a "
                       f"strategy of {', '.join(s for s, m in PACKING_SUPPORT.items() if packing in m)}.")
    allowed = FIXED_SHAPE_BFD_ATTENTION.get(strategy, BFD_ATTENTION)
    if packing == "bfd" and attn_implementation is not None and attn_implementation not in allowed:
        where = f" with strategy {strategy} (its batches are rows of block_size)" if strategy in \
            FIXED_SHAPE_BFD_ATTENTION else ""
        return Refusal("model.attn_implementation", f"'{attn_implementation}' does not keep packed examples "
                       f"apart (packing bfd){where}.", f"use one of {', '.join(allowed)}, or --packing none.")
    return None


def check_packing(strategy: str, packing: str, attn_implementation: str | None) -> None:
    """Raise the table's refusal of ``packing`` (called once the datasets' formats resolved it)."""
    if (refusal := packing_refusal(strategy, packing, attn_implementation)) is not None:
        raise HftkError(refusal.field, refusal.problem, refusal.fix)


def resolve_packing(strategy: str, data_format: str, packing: str, attn_implementation: str | None = None) -> str:
    """``auto`` -> concat for plain text, else bfd where ``strategy`` (with that attention) keeps packed
    examples apart, else none."""
    if packing != "auto":
        return packing
    if data_format == "text":
        return "concat"
    return "bfd" if packing_refusal(strategy, "bfd", attn_implementation) is None else "none"


def check_lora(strategy: str, lora_r: int) -> None:
    """Raise the table's refusal for LoRA under ``strategy`` (called by that strategy's ``validate``)."""
    if lora_r > 0 and (refusal := LORA_REFUSED.get(strategy)) is not None:
        raise HftkError(refusal.field, refusal.problem, refusal.fix)


# Preference tuning (training.method dpo) through TRL's DPOTrainer (engine/preference.py): ddp, fsdp and every ZeRO
# stage train it with one-process TRL parity (tests/integration/test_dpo.py). hftk's own loop (pipeline, tp, cp, sp)
# has no pairwise step with the reference forward; it refuses before launch.
DPO_STRATEGIES: tuple[str, ...] = ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload")
DPO_REFUSED = {
    strategy: Refusal("training.method", f"dpo is not supported with strategy {strategy}: hftk's own loop has no "
                      "pairwise step (chosen and rejected with the reference forward).",
                      f"use --strategy {' or '.join(DPO_STRATEGIES)} for DPO, or --method sft.")
    for strategy in STRATEGIES if strategy not in DPO_STRATEGIES
}
assert all(TABLE[s].engine == "loop" for s in DPO_REFUSED), "every Trainer strategy trains DPO"


# DPO with LoRA: TRL 1.16 (DPOTrainer.__init__) gives a PeftModel without a ref_model a frozen "ref" copy of its
# adapter, added and copied after hftk has sharded the policy: a plain tensor copied from an FSDP2 DTensor, or from
# a ZeRO-3 partition (0 elements), fails. Where the adapter's parameters are whole (ddp, ZeRO-1/2) it trains.
_DPO_LORA_SHARDED = ("fsdp", "zero3", "zero3_offload")
DPO_LORA_REFUSED = {
    strategy: Refusal("model.lora_r", f"DPO with LoRA is not supported with strategy {strategy}: TRL copies the "
                      "adapter into its frozen reference adapter after the policy is sharded, which it cannot do "
                      "on sharded parameters.",
                      f"use --strategy {' or '.join(s for s in DPO_STRATEGIES if s not in _DPO_LORA_SHARDED)} for "
                      "DPO with LoRA, or full fine-tuning (lora_r 0) under it.")
    for strategy in _DPO_LORA_SHARDED
}


# Precomputed reference log-probs: TRL 1.16 fingerprints the model's parameters with .numpy() first, which
# FSDP2's sharded (DTensor) parameters refuse (tests/integration/test_dpo.py runs it under ddp and ZeRO-3).
DPO_PRECOMPUTE_REFUSED = {
    "fsdp": Refusal("training.precompute_ref_log_probs", "is not supported with strategy fsdp: TRL 1.16 fingerprints "
                    "the model's parameters with .numpy(), which FSDP2's sharded (DTensor) parameters refuse.",
                    "drop --precompute_ref_log_probs (the reference is then sharded like the policy) or use ddp / "
                    "zero1 / zero2 / zero3."),
}


# Online RL (training.method grpo) through TRL's GRPOTrainer (engine/rl.py): every Trainer strategy, full and LoRA,
# equals one-process TRL (tests/integration/test_grpo.py). hftk's own loop (pipeline, tp, cp, sp) has no rollout step;
# a quantized base is not verified with GRPO (TRL casts its adapters to bf16 after hftk has prepared the model).
GRPO_STRATEGIES: tuple[str, ...] = DPO_STRATEGIES
GRPO_REFUSED = {
    strategy: Refusal("training.method", f"grpo is not supported with strategy {strategy}: hftk's own loop has no "
                      "rollout step (generation, rewards and the policy-gradient loss).",
                      f"use --strategy {' or '.join(GRPO_STRATEGIES)} for GRPO, or --method sft.")
    for strategy in STRATEGIES if strategy not in GRPO_STRATEGIES
}
assert all(TABLE[s].engine == "loop" for s in GRPO_REFUSED), "every Trainer strategy trains GRPO"
GRPO_QUANT_REFUSED = Refusal(QUANT_FIELD, "a bitsandbytes-quantized base is not supported with --method grpo: TRL "
                             "casts the adapters of a quantized model to bf16 after hftk prepared it, which hftk's "
                             "tests have not verified.", "train GRPO with LoRA on an unquantized base (drop "
                             "--load_in_4bit / --load_in_8bit).")


def dpo_refusal(strategy: str, lora: bool) -> Refusal | None:
    """Why DPO does not run under ``strategy`` (with LoRA when ``lora``), or None."""
    return DPO_REFUSED.get(strategy) or (DPO_LORA_REFUSED.get(strategy) if lora else None)


def check_method(strategy: str, method: str, lora_r: int = 0, precompute_ref_log_probs: bool = False,
                 quantized_field: str | None = None) -> None:
    """Raise the table's refusal of ``method`` under ``strategy`` (sft trains everywhere); ``quantized_field``: the
    option that quantizes the base, None when it is not quantized."""
    if method == "grpo":
        refusal = GRPO_REFUSED.get(strategy) or (GRPO_QUANT_REFUSED if quantized_field else None)
        if refusal is not None:
            raise HftkError(quantized_field if refusal is GRPO_QUANT_REFUSED else refusal.field, refusal.problem,
                            refusal.fix)
        return
    if method != "dpo":
        return
    refusal = dpo_refusal(strategy, lora_r > 0) or (DPO_PRECOMPUTE_REFUSED.get(strategy) if precompute_ref_log_probs
                                                      else None)
    if refusal is not None:
        raise HftkError(refusal.field, refusal.problem, refusal.fix)
