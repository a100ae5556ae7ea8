"""The model-family table: every decoder family hftk trains and what each part of hftk needs to know
of it (torchtitan's ``ModelSpec`` idea). ``layout`` reads the part names, ``lora`` the default
targets, ``strategies.tp_plans`` where the tensor-parallel plan comes from, ``support`` the display
names and which families sequence parallel drives. Adding a family is one row here, plus its tiny
test model (``tests/helpers.make_family``) so the support matrix runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

_ATTENTION_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class FamilySpec:
    """One family, keyed by its config's ``model_type``."""

    name: str  # as the README's tables spell it
    backbone: str  # the causal LM's attribute holding the decoder
    blocks: str  # the backbone's ModuleList of decoder blocks
    token_embedding: str
    position_embedding: str | None  # learned positions (GPT-2); rotary families have none
    final_norm: str
    embedding_dropout: str | None  # dropout on the embeddings before the first block
    lora_targets: tuple[str, ...]  # the attention and MLP projections (GPT-2's c_proj names both outputs)
    # "transformers": the config's base_model_tp_plan (attention checked to run on local heads,
    # tests/integration/test_tensor_parallel.py); "hftk": hftk's own plan after Conv1D -> nn.Linear (GPT-2)
    tp_plan: str
    ulysses: bool  # attention takes position ids through its kwargs, as sequence parallel's Ulysses needs


FAMILIES: dict[str, FamilySpec] = {
    "gpt2": FamilySpec("GPT-2", "transformer", "h", "wte", "wpe", "ln_f", "drop", ("c_attn", "c_proj", "c_fc"),
                       tp_plan="hftk", ulysses=False),
    "gpt_neox": FamilySpec("GPT-NeoX", "gpt_neox", "layers", "embed_in", None, "final_layer_norm", "emb_dropout",
                           ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
                           tp_plan="transformers", ulysses=False),
    "llama": FamilySpec("Llama", "model", "layers", "embed_tokens", None, "norm", None, _ATTENTION_MLP,
                        tp_plan="transformers", ulysses=True),
    "mistral": FamilySpec("Mistral", "model", "layers", "embed_tokens", None, "norm", None, _ATTENTION_MLP,
                          tp_plan="transformers", ulysses=True),
    "qwen2": FamilySpec("Qwen2", "model", "layers", "embed_tokens", None, "norm", None, _ATTENTION_MLP,
                        tp_plan="transformers", ulysses=True),
}


def supported_families() -> str:
    return ", ".join(sorted(FAMILIES))
