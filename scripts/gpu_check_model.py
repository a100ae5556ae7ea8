"""The models of scripts/gpu_check.sh's runs, as local HF folders.

The throughput run's ~1B-parameter Llama (Llama-3.2-1B-like: hidden 2048, 16 layers, 32 heads, 8 K/V heads,
MLP 8192, vocabulary 32000; 1.1B parameters); with ``--family`` a ~0.2B model of another family from its own
config class (Qwen3, Gemma 3, Qwen3-MoE: hidden 1024, 8 layers, 16 heads of 64, 8 K/V heads, MLP 3072, their
default quirks kept: Gemma 3's sliding / full layers and scaled embedding, Qwen3's q/k norms, Qwen3-MoE's 8 experts
of MLP 768, top-2). Random weights, saved
in bf16 with hftk's built-in tokenizer (:func:`hftk.data.builtin.tokenizer_for_corpus`, 2048 tokens: ids stay
inside the model's vocabulary; the embedding and LM head still cost their full 32000 rows, as in a real run).
``--tiny`` writes the same architecture at test size through the same code.

usage: python scripts/gpu_check_model.py OUT_FOLDER [--tiny] [--family MODEL_TYPE]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096),
    "family": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=64, vocab_size=32000),
    "family-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=4096),
}


def make_model_folder(folder: Path, shape: str, family: str = "llama") -> Any:
    """Write config, bf16 safetensors weights and tokenizer into ``folder``; return the config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hftk.data.builtin import EOS, tokenizer_for_corpus

    tokenizer = tokenizer_for_corpus()
    tokenizer.model_max_length = 4096
    eos = tokenizer.convert_tokens_to_ids(EOS)
    extra = {"rope_theta": 500000.0, "tie_word_embeddings": False} if family == "llama" else {}
    if family == "qwen3_moe":  # 8 experts of a quarter of the dense MLP's width, top-2
        extra = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": SHAPES[shape]["intermediate_size"] // 4}
    config = AutoConfig.for_model(family, **SHAPES[shape], max_position_embeddings=4096, bos_token_id=eos,
                                  eos_token_id=eos, pad_token_id=eos, dtype="bfloat16", **extra)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # initialising 1.1B weights on a GPU takes seconds
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tiny", action="store_true", help="the same architecture at test size")
    parser.add_argument("--family", default="llama", help="a config model_type (llama: the 1B throughput model)")
    opts = parser.parse_args()
    shape = ("tiny" if opts.tiny else "1b") if opts.family == "llama" else ("family-tiny" if opts.tiny else "family")
    config = make_model_folder(opts.folder, shape, opts.family)
    print(f"{opts.folder}: {opts.family}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
          f"vocabulary {config.vocab_size}")


if __name__ == "__main__":
    main()
