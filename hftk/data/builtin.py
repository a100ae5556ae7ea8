"""Built-in small models and the shipped corpus, for runs and tests without a network.

A built-in model is materialised once into a cache folder (config, tokenizer trained with
the ``tokenizers`` library on the shipped corpus, seeded random weights as safetensors) and
then loaded through the same ``from_pretrained`` path as any Hub model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from hftk.core.errors import HftkError

CORPUS = Path(__file__).parent / "corpus" / "kjv_selections.txt"
BUILTIN_DATASETS = {"kjv": CORPUS}
VOCAB_SIZE = 2048
EOS = "<|endoftext|>"
PREFIX = "builtin:"


def _gpt2(n_layer: int, n_embd: int, n_head: int, n_positions: int) -> Callable[[], Any]:
    def make() -> Any:
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=VOCAB_SIZE, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
        )

    return make


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )


def _neox() -> Any:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )


def _qwen3_moe() -> Any:
    """A mixture of experts (Qwen3-MoE's layout: 8 experts, top-2, every layer sparse): ``hftk bench moe``'s model."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )


MODELS: dict[str, Callable[[], Any]] = {
    "gpt2-tiny": _gpt2(n_layer=2, n_embd=64, n_head=4, n_positions=256),
    "gpt2-tiny4": _gpt2(n_layer=4, n_embd=64, n_head=4, n_positions=256),  # enough blocks for 2 ranks x 2 virtual stages
    "gpt2-small": _gpt2(n_layer=4, n_embd=256, n_head=4, n_positions=256),
    "gpt2-90m": _gpt2(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
    "llama-tiny": _llama,
    "neox-tiny": _neox,
    "qwen3-moe-small": _qwen3_moe,
}


def is_builtin(name: str) -> bool:
    return name.startswith(PREFIX)


def cache_root() -> Path:
    return Path(os.environ.get("HFTK_CACHE", Path.home() / ".cache" / "hftk"))


def builtin_model_config(name: str) -> Any:
    """The transformers config of a built-in model (no weights, no files)."""
    return MODELS[name.removeprefix(PREFIX)]()


WEIGHTS = "model.safetensors"
# In the cache key: a folder of an older layout is never taken for a current one. 2: folders are
# checked complete (hftk 1 could cache one without weights, written by a rank transformers skipped).
CACHE_FORMAT = 2


def materialize_model(name: str) -> Path:
    """Folder holding the built-in model ``builtin:NAME``; created atomically on first use.

    Several ranks may call this at once: each writes into its own temporary folder and the
    first rename wins, so nobody ever reads a half-written model. Call it before any process
    group exists (``hftk.run.prepare.prepare`` does): once one is up, transformers' ``save_pretrained``
    writes on rank 0 only, and the other ranks' folders would be empty.
    """
    key = name.removeprefix(PREFIX)
    config = MODELS[key]()
    digest = hashlib.sha256(
        (json.dumps(config.to_dict(), sort_keys=True, default=str) + CORPUS.read_text()[:4096]
         + str(CACHE_FORMAT)).encode()
    ).hexdigest()[:10]
    target = cache_root() / "models" / f"{key}-{digest}"
    if target.exists():
        return _complete(target, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        import torch
        from transformers import AutoModelForCausalLM

        tokenizer_for_corpus().save_pretrained(tmp)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp, safe_serialization=True)
        _complete(tmp, name)  # never publish a folder transformers skipped writing
        try:
            tmp.rename(target)
        except OSError:  # another rank won the race; its folder is complete
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(folder: Path, name: str) -> Path:
    """``folder`` if it holds config and weights; otherwise a one-line error naming the fix."""
    missing = [f for f in ("config.json", WEIGHTS) if not (folder / f).is_file()]
    if missing:
        raise HftkError("model.model_name_or_path",
                        f"the folder of {name} lacks {', '.join(missing)} ({folder}): it was written after a process "
                        "group started, where transformers saves on rank 0 only.",
                        f"delete {folder} and materialise built-ins before init_process_group "
                        "(hftk.run.prepare.prepare does).")
    return folder


def tokenizer_for_corpus() -> Any:
    """A byte-level BPE tokenizer trained on the shipped corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    # No pad token on purpose: like most GPT-style Hub models, hftk must set one itself.
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, model_max_length=1024)
