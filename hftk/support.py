"""What hftk supports: every strategy x model family x {full fine-tuning, LoRA}, in one table.

The strategies' validators take their LoRA refusals from here (:func:`check_lora`), the README's
support table is rendered from it (``python -m hftk.support`` prints it; tests/test_support.py keeps
the README equal), and tests/test_matrix.py runs every cell on 2 ranks and asserts each one trains
and saves a loadable ``final/`` or is refused before launch exactly as :func:`expected` says.
"""

from __future__ import annotations

from dataclasses import dataclass

from hftk.errors import HftkError
from hftk.layout import FAMILIES
from hftk.strategies import MODULES

STRATEGIES = tuple(MODULES)
FAMILY_NAMES = {"gpt2": "GPT-2", "gpt_neox": "GPT-NeoX", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
assert set(FAMILY_NAMES) == set(FAMILIES), "every family the layout knows needs a column here"


@dataclass(frozen=True)
class Refusal:
    """A cell hftk refuses before launch: the field its one-line error names, and why."""

    field: str
    problem: str
    fix: str = ""


# LoRA under layouts that shard the very layers LoRA wraps (DTensor rows / columns, Ulysses heads).
LORA_REFUSED = {
    strategy: Refusal("model.lora_r", f"LoRA is not supported with strategy {strategy}: its layout shards the "
                      "layers LoRA wraps.", "train the full model, or use ddp / fsdp / zero1-3 / pipeline.")
    for strategy in ("tp", "cp", "sp")
}
# Families whose default config a strategy cannot train (the validator reads the model config itself;
# this is what a model built from the family's default config meets).
FAMILY_REFUSED = {
    ("cp", "mistral"): Refusal("model.model_name_or_path", "Mistral's sliding-window attention needs a mask "
                               "stricter than causal, which ring attention cannot apply."),
}


def expected(strategy: str, family: str, lora: bool) -> Refusal | None:
    """``None`` when the cell trains and saves ``final/``; else the refusal it meets before launch."""
    if (strategy, family) in FAMILY_REFUSED:
        return FAMILY_REFUSED[(strategy, family)]
    if lora and strategy in LORA_REFUSED:
        return LORA_REFUSED[strategy]
    return None


def check_lora(strategy: str, lora_r: int) -> None:
    """Raise the table's refusal for LoRA under ``strategy`` (called by that strategy's ``validate``)."""
    refusal = LORA_REFUSED.get(strategy)
    if lora_r > 0 and refusal is not None:
        raise HftkError(refusal.field, refusal.problem, refusal.fix)


def _cell(strategy: str, family: str) -> str:
    full, lora = expected(strategy, family, False), expected(strategy, family, True)
    if full is not None:
        return f"refused: `{full.field}`"
    return "full, LoRA" if lora is None else f"full (LoRA refused: `{lora.field}`)"


def render_markdown() -> str:
    """The README's support table (between its ``support-table`` markers)."""
    families = list(FAMILY_NAMES)
    lines = ["| strategy | " + " | ".join(FAMILY_NAMES[f] for f in families) + " |",
             "|---" * (len(families) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(_cell(s, f) for f in families) + " |" for s in STRATEGIES]
    reasons = {r.problem: None for r in [*LORA_REFUSED.values(), *FAMILY_REFUSED.values()]}
    lines += ["", "Refusals are one line before launch (exit 2): " + " ".join(reasons)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
