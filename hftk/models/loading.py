"""Load the model and tokenizer: Hub id (with revision), local folder, or built-in.

Parallelism is never applied here; strategies wrap or shard the plain model from outside.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hftk.config.options import ModelConfig
from hftk.core.errors import HftkError
from hftk.data import builtin

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(cfg: ModelConfig) -> str:
    """A local folder or Hub id that ``from_pretrained`` accepts (built-ins materialised)."""
    name = cfg.model_name_or_path
    if builtin.is_builtin(name):
        return str(builtin.materialize_model(name))
    return name


def load_model_config(cfg: ModelConfig) -> Any:
    """The model's transformers config only (no weights): for validation and the memory plan."""
    from transformers import AutoConfig

    name = cfg.model_name_or_path
    if builtin.is_builtin(name):
        if name.removeprefix(builtin.PREFIX) not in builtin.MODELS:
            raise HftkError("model.model_name_or_path", f"unknown built-in model '{name}'.",
                            f"use one of: {', '.join(builtin.PREFIX + m for m in builtin.MODELS)}.")
        config = builtin.builtin_model_config(name)
    else:
        looks_local = name.startswith((".", "/", "~")) or Path(name).exists()
        if looks_local and not (Path(name).expanduser() / "config.json").exists():
            raise HftkError("model.model_name_or_path", f"'{name}' is not a model folder (no config.json there).",
                            "pass a folder written by save_pretrained, or a Hub id like 'gpt2'.")
        try:
            config = AutoConfig.from_pretrained(name, revision=cfg.model_revision,
                                                trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise HftkError("model.model_name_or_path", f"cannot load the config of '{name}': "
                            f"{str(exc).splitlines()[0]}", "check the Hub id and revision, your network and "
                            "HF_TOKEN, or pass a local folder.") from None
    _apply_dropout(config, cfg.model_dropout)
    return config


def _apply_dropout(config: Any, dropout: float | None) -> None:
    if dropout is None:
        return
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout",
                "attention_probs_dropout_prob", "hidden_dropout_prob", "dropout"):
        if hasattr(config, key):
            setattr(config, key, dropout)


def load_tokenizer(cfg: ModelConfig, chat_template: str | None = None, add_chat_tokens: bool = True,
                   announce: bool = False) -> Any:
    """Tokenizer with a pad token (GPT-style models ship without one; eos serves) and the chat template
    ``data.chat_template`` chose (it then travels with every ``save_pretrained`` of the tokenizer).

    With a chosen template and ``add_chat_tokens`` (``data.add_chat_tokens``), its ``<|...|>`` markers that
    are not tokens yet become special tokens and its end-of-turn marker the EOS (``data.chat.add_chat_tokens``);
    every rank does the same, so every rank gets the same ids. ``announce``: print what was added (rank 0)."""
    from transformers import AutoTokenizer

    from hftk.data.chat import add_chat_tokens as add_markers
    from hftk.data.chat import apply_template_choice

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_name_or_path or resolve_model_path(cfg),
                                              revision=cfg.model_revision, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    apply_template_choice(tokenizer, chat_template)
    if chat_template and add_chat_tokens:
        said = add_markers(tokenizer, tokenizer.chat_template)
        if said and announce:
            print(f"hftk: chat template {chat_template}: {said}", flush=True)
    return tokenizer


def markers_to_add(cfg: ModelConfig, chat_template: str | None, add_chat_tokens: bool) -> list[str]:
    """The chat markers a run will add to the tokenizer (:func:`load_tokenizer`), for checks before launch."""
    from hftk.data.chat import missing_markers

    if not (chat_template and add_chat_tokens):
        return []
    tokenizer = load_tokenizer(cfg, chat_template, add_chat_tokens=False)
    return missing_markers(tokenizer, tokenizer.chat_template)


def fit_to_tokenizer(model: Any, tokenizer: Any, seed: int) -> list[int]:
    """Grow ``model``'s embeddings (and an untied LM head) to ``len(tokenizer)`` when the tokenizer gained
    tokens (chat markers), and make the tokenizer's EOS one its config and generation config stop on.

    Called on the plain model, before LoRA and before any strategy wraps or shards it (under ZeRO-3 the
    model is partitioned already: ``resize_token_embeddings`` gathers it). The new rows are drawn from the
    old rows' mean and covariance (``mean_resizing``, what transformers recommends for causal LMs) under
    ``seed`` in a forked RNG: every rank draws the same rows and the run's own RNG stream is untouched.
    Returns the new rows' ids (LoRA trains them: ``lora.apply``)."""
    weight = model.get_input_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 keeps the full shape in ds_shape
    if len(tokenizer) > rows:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        partition_like_base(model)  # ZeRO-3: the resized embedding is a whole new parameter
    eos = tokenizer.eos_token_id
    configs = [model.config.get_text_config(), getattr(model, "generation_config", None)]
    for config in filter(None, configs):  # the tokenizer's EOS is the one its turns end with: stop there
        if eos not in _ids(config.eos_token_id):
            config.eos_token_id = eos
    return list(range(rows, len(tokenizer)))


def partition_like_base(model: Any) -> None:
    """Under ZeRO-3 ``zero.Init`` partitioned the base at load; parameters created since (PEFT's adapters,
    resized embeddings) are partitioned the same way now (DeepSpeed's own conversion), so no rank holds a
    whole weight."""
    zero = [p for p in model.parameters() if hasattr(p, "ds_id")]
    fresh = [p for p in model.parameters() if not hasattr(p, "ds_id")]
    if zero and fresh:
        zero[0].convert_to_zero_parameters(param_list=fresh)


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def quantized_field(cfg: ModelConfig) -> str | None:
    """The option that quantizes the base (``model.load_in_4bit`` / ``model.load_in_8bit``), or None."""
    if cfg.load_in_4bit:
        return "model.load_in_4bit"
    return "model.load_in_8bit" if cfg.load_in_8bit else None


def compute_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype 4-bit layers dequantize to for their matmul (default: the model's dtype)."""
    return DTYPES[cfg.bnb_4bit_compute_dtype or cfg.model_dtype]


def quantization_config(cfg: ModelConfig, shardable: bool = False) -> Any:
    """transformers' ``BitsAndBytesConfig`` of this run, or None without quantization.

    ``shardable`` (FSDP2): the packed 4-bit bytes are stored as compute-dtype elements, so every
    parameter FSDP shards has one floating dtype (what TRL / Axolotl / accelerate set for FSDP QLoRA).
    """
    from transformers import BitsAndBytesConfig

    if cfg.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    if not cfg.load_in_4bit:
        return None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant,
                              bnb_4bit_compute_dtype=compute_dtype(cfg),
                              bnb_4bit_quant_storage=compute_dtype(cfg) if shardable else torch.uint8)


def local_device() -> str:
    """Where this rank's quantized weights go (bitsandbytes quantizes while loading onto a device)."""
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def load_model(cfg: ModelConfig, shardable: bool = False) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` with hftk's dtype / dropout / attention / quantization choices.

    Gradient checkpointing is switched on by the engine (``training.gradient_checkpointing``);
    ``shardable``: see :func:`quantization_config`.
    """
    from transformers import AutoModelForCausalLM

    config = load_model_config(cfg)
    kwargs: dict[str, Any] = {"dtype": DTYPES[cfg.model_dtype], "trust_remote_code": cfg.trust_remote_code,
                              "use_kernels": cfg.use_hub_kernels}  # transformers' default: on whenever `kernels` is installed
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    quantization = quantization_config(cfg, shardable)
    if quantization is not None:
        kwargs.update(quantization_config=quantization, device_map={"": local_device()})
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg), config=config, revision=cfg.model_revision,
                                                 **kwargs)
    if quantization is not None:
        evaluate_4bit_as_trained(model)
    else:
        keep_declared_frozen(model, config)
    return model


def keep_declared_frozen(model: Any, config: Any) -> list[str]:
    """Freeze again what the model class builds frozen; returns the names.

    transformers 5's ``from_pretrained`` hands back every loaded parameter trainable, also those a class declares
    ``requires_grad=False`` (Ernie 4.5 MoE's router score-correction bias, which its own rule updates, never a
    gradient): the optimizer would move them and DDP waits for a gradient that never comes. A meta-device build of
    the same config (no memory, no init) says which they are.
    """
    with torch.device("meta"):  # the class itself: from_config would also run ZeRO-3's partitioned init
        skeleton = type(model)(config)
    frozen = {name for name, p in skeleton.named_parameters() if not p.requires_grad}
    names = [name for name, p in model.named_parameters() if name in frozen and p.requires_grad]
    for name in names:
        model.get_parameter(name).requires_grad_(False)
    return names


def evaluate_4bit_as_trained(model: Any) -> None:
    """Keep every bitsandbytes ``Linear4bit`` of ``model`` on the kernel it trains with, in eval mode too.

    On a CPU with AVX512-BF16, bitsandbytes >= 0.50 repacks a 4-bit weight in place the first time the layer
    runs in eval mode (``support_avx512bf16_for_cpu``) for a faster inference kernel. That layout assumes
    ``in_features`` is a multiple of the quantization block (a Llama ``down_proj`` of 160 crashed the first
    evaluation), and FSDP's sharded storage does not survive the rewrite (a QLoRA fsdp run's eval loss was
    0.07 off one process's). Evaluation then dequantizes and multiplies exactly as training does, on every
    shape and strategy, at the price of that kernel's speed."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def context_length(config: Any) -> int | None:
    """The longest sequence the model accepts, from whichever field its family uses."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
