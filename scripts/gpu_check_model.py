"""The ~1B-parameter Llama-shaped model of scripts/gpu_check.sh's throughput run, as a local HF folder.

Random weights from a ``LlamaConfig`` (Llama-3.2-1B-like: hidden 2048, 16 layers, 32 heads, 8 K/V
heads, MLP 8192, vocabulary 32000; 1.1B parameters), saved in bf16 with hftk's built-in tokenizer
(:func:`hftk.data.builtin.tokenizer_for_corpus`, 2048 tokens: ids stay inside the model's vocabulary; the
embedding and LM head still cost their full 32000 rows, as in a real run). ``--tiny`` writes the
same architecture at test size through the same code.

usage: python scripts/gpu_check_model.py OUT_FOLDER [--tiny]
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
}


def make_model_folder(folder: Path, shape: str) -> Any:
    """Write config, bf16 safetensors weights and tokenizer into ``folder``; return the config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hftk.data.builtin import EOS, tokenizer_for_corpus

    tokenizer = tokenizer_for_corpus()
    tokenizer.model_max_length = 4096
    eos = tokenizer.convert_tokens_to_ids(EOS)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rope_theta=500000.0, bos_token_id=eos,
                         eos_token_id=eos, tie_word_embeddings=False, dtype="bfloat16")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # initialising 1.1B weights on a GPU takes seconds
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tiny", action="store_true", help="the same architecture at test size")
    opts = parser.parse_args()
    config = make_model_folder(opts.folder, "tiny" if opts.tiny else "1b")
    print(f"{opts.folder}: Llama, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
          f"vocabulary {config.vocab_size}")


if __name__ == "__main__":
    main()
