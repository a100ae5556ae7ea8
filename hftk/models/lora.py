"""LoRA through PEFT, applied from outside the model code, and its adapters saved whole.

The one place hftk knows about LoRA: which modules to adapt (``model.lora_target_modules``, else the
family's default, checked against the model's real module names before any process group starts);
``get_peft_model`` before any strategy wraps or shards the model, seeded (FSDP2 and pipeline stages
keep each rank's own values, so every rank must draw the same ``lora_A``), the adapters partitioned
like the base under ZeRO-3; every adapter tensor read whole out of whatever holds it (reading
``state_dict()`` instead is the field's incomplete-adapter failure, peft#453: ZeRO-3 partitions are
empty tensors outside a gather); PEFT's own folder format, proven complete by shape; and the merge
(``merge_and_unload``) for ``hftk export --merge`` and the merged Hub push.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hftk.config import support
from hftk.config.options import ModelConfig, RunConfig
from hftk.core.errors import HftkError
from hftk.models.loading import partition_like_base
from hftk.models.spec import model_spec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # PEFT's name for the one adapter get_peft_model creates
# Beside a QLoRA adapter: the BitsAndBytesConfig of the base it was trained on (PEFT records none), so that
# `hftk export --merge` merges into that base dequantized -- the weights the adapter was trained against.
QUANTIZATION_FILE = "hftk_quantization.json"
# Layer types PEFT's LoRA can wrap (transformers' Conv1D is GPT-2's linear layer).
ADAPTABLE = ("Linear", "Conv1D", "Embedding", "Conv1d", "Conv2d", "Conv3d")


# ---- before any process group ----

def target_modules(cfg: ModelConfig, model_config: Any) -> list[str]:
    """The module names to adapt: the user's list, else every linear projection of the decoder blocks (the
    model's spec: PEFT's ``all-linear`` by name)."""
    if cfg.lora_target_modules:
        return [name.strip() for name in cfg.lora_target_modules.split(",") if name.strip()]
    spec = model_spec(model_config, cfg.trust_remote_code)
    if not spec.lora_targets:
        why = spec.structure_problem or "its decoder blocks hold no linear projection"
        raise HftkError("model.lora_target_modules", f"hftk finds no default LoRA targets in {spec.name} "
                        f"('{spec.family}'): {why}.", "pass --lora_target_modules with its attention / MLP layer names.")
    return list(spec.lora_targets)


def target_parameters(cfg: ModelConfig, model_config: Any) -> list[str]:
    """PEFT ``target_parameters`` of the default targets: a mixture of experts' fused expert weights (3-D
    parameters no ``nn.Linear`` wraps), beside the blocks' linear projections. None with a user's own list."""
    if cfg.lora_target_modules:
        return []
    moe = model_spec(model_config, cfg.trust_remote_code).moe
    return list(moe.lora_target_parameters) if moe is not None else []


def uses_conv1d(model: Any) -> bool:
    """Whether the targets are transformers' ``Conv1D`` (GPT-2 style, weights stored (in, out): PEFT's
    ``fan_in_fan_out``); a quantized base has bitsandbytes Linear layers (out, in) there instead."""
    return any(type(m).__name__ == "Conv1D" for m in model.modules())


def lora_config(cfg: ModelConfig, model_config: Any, new_tokens: dict[str, list[int]] | None = None,
                conv1d: bool = False) -> Any:
    """PEFT's ``LoraConfig`` of this run (no bias, causal LM, base revision recorded, DoRA / rsLoRA).

    ``new_tokens``: the rows the run added (chat markers, ``data.add_chat_tokens``) by embedding module
    (:func:`trainable_tokens`); PEFT's ``trainable_token_indices`` trains them beside the adapters.
    ``conv1d``: the model's projections are ``Conv1D`` (:func:`uses_conv1d`)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=target_modules(cfg, model_config), bias="none", task_type="CAUSAL_LM",
                      target_parameters=target_parameters(cfg, model_config) or None,
                      fan_in_fan_out=conv1d, use_dora=cfg.use_dora, use_rslora=cfg.use_rslora,
                      revision=None if cfg.model_revision == "main" else cfg.model_revision,
                      trainable_token_indices=new_tokens or None)


def trainable_tokens(model: Any, new_rows: list[int]) -> dict[str, list[int]]:
    """PEFT's ``trainable_token_indices`` for rows added to ``model``'s vocabulary: the input embedding's, and
    an untied LM head's too (its new rows give the new tokens' logits: ``<|im_end|>``'s is when to stop;
    a tied head follows the embedding in PEFT)."""
    if not new_rows:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    layers = {names[id(embed)]: list(new_rows)}
    if head is not None and head.weight is not embed.weight:
        layers[names[id(head)]] = list(new_rows)
    return layers


def validate(cfg: RunConfig, model_config: Any) -> None:
    """LoRA options that cannot work, named before any process starts."""
    from hftk.models.loading import quantized_field

    m = cfg.model
    check_optimizer(str(cfg.args.optim))
    if m.load_in_4bit and m.load_in_8bit:
        raise HftkError("model.load_in_8bit", "and load_in_4bit are both set; a base has one quantization.",
                        "keep one of --load_in_4bit / --load_in_8bit.")
    if not m.lora_r:
        needs_lora = [("model.lora_target_modules", m.lora_target_modules), ("model.use_dora", m.use_dora),
                      ("model.use_rslora", m.use_rslora), (quantized_field(m), quantized_field(m))]
        for field, value in needs_lora:
            if value:
                what = ("quantizes the frozen base, and a quantized base cannot be fully fine-tuned"
                        if field == quantized_field(m) else "is set")
                raise HftkError(field, f"{what}, but lora_r is 0, so no adapter would be trained.",
                                f"set --lora_r (e.g. 8) to train LoRA on it, or drop --{field.split('.')[1]}.")
        if cfg.hub.hub_push_merged:
            raise HftkError("hub.hub_push_merged", "merges a LoRA adapter, but lora_r is 0 (full fine-tuning).",
                            "drop --hub_push_merged, or train LoRA with --lora_r.")
        return
    if m.lora_alpha <= 0:
        raise HftkError("model.lora_alpha", f"must be > 0, got {m.lora_alpha}.", "use e.g. 16 (scale = alpha / r).")
    if not 0 <= m.lora_dropout < 1:
        raise HftkError("model.lora_dropout", f"must be in [0, 1), got {m.lora_dropout}.", "use e.g. 0.05 or 0.")
    if cfg.preference.method != "sft" and target_parameters(m, model_config):
        raise HftkError("model.lora_target_modules", f"the default LoRA targets include the experts' fused weights "
                        f"(PEFT target_parameters), and TRL's {cfg.preference.method} copies the adapter into a frozen "
                        "reference adapter, which PEFT cannot do beside parameter adapters.",
                        "pass --lora_target_modules with the linear layers only (e.g. q_proj,k_proj,v_proj,o_proj), "
                        "or train the full model (lora_r 0).")
    if m.lora_dropout and target_parameters(m, model_config):
        raise HftkError("model.lora_dropout", f"is {m.lora_dropout}, but the default targets include the experts' "
                        "fused weights, whose PEFT adapters take no dropout.", "pass --lora_dropout 0, or "
                        "--lora_target_modules to adapt the linear layers only.")
    support.check_lora(cfg.strategy.strategy, m.lora_r)  # tp / cp / sp shard the layers LoRA wraps
    support.check_quantized(cfg.strategy.strategy, quantized_field(m))
    check_quantization(cfg)
    check_targets(m, model_config)


def refuse_added_tokens(cfg: RunConfig, why: str, fix: str) -> None:
    """A strategy that cannot train LoRA's trainable tokens (chat markers the run adds) names it before launch."""
    from hftk.models.loading import markers_to_add

    missing = markers_to_add(cfg.model, cfg.data.chat_template, cfg.data.add_chat_tokens) if cfg.model.lora_r else []
    if missing:
        raise HftkError("data.add_chat_tokens", f"adds {', '.join(missing)} to the vocabulary, and LoRA under "
                        f"{cfg.strategy.strategy} {why}.", f"pass --no_add_chat_tokens (the markers stay text), or {fix}.")


def check_optimizer(optim: str) -> None:
    """bitsandbytes' paged optimizers page their state between GPU and CPU memory; on CPU they would
    silently run the plain optimizer (bitsandbytes only warns), so they are refused there by name."""
    if "paged" in optim and not torch.cuda.is_available():
        raise HftkError("training.optim", f"{optim} pages optimizer state between GPU and CPU memory, and this "
                        "machine has no GPU.", f"use {optim.replace('paged_', '')} here, or run on a GPU.")


def check_quantization(cfg: RunConfig) -> None:
    """What a bitsandbytes base needs from the rest of the run: the library, and options it honours."""
    from hftk.models.loading import quantized_field

    field = quantized_field(cfg.model)
    if field is None:
        return
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise HftkError(field, "needs the bitsandbytes package, which is not installed.",
                        "pip install -e . (it is one of hftk's dependencies) or pip install bitsandbytes.")
    if cfg.model.load_in_8bit and cfg.strategy.strategy == "fsdp":
        raise HftkError("model.load_in_8bit", "with strategy fsdp: FSDP2 cannot shard bitsandbytes' int8 weights "
                        "(integer storage, scales kept beside the tensor).", "use --load_in_4bit with fsdp, or ddp.")


def check_targets(cfg: ModelConfig, model_config: Any) -> None:
    """Every target names at least one adaptable layer of the model (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=cfg.trust_remote_code)
    targets = target_modules(cfg, model_config)
    kinds = {name: type(module).__name__ for name, module in model.named_modules() if name}
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in kinds)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, kind in kinds.items() if kind in ADAPTABLE})
        raise HftkError("model.lora_target_modules", f"{', '.join(missing)} match(es) no module of "
                        f"{model_config.model_type}.", f"choose among its layers: {', '.join(leaves)}.")
    wrong = sorted({f"{n.rsplit('.', 1)[-1]} ({kind})" for n, kind in kinds.items()
                    if n.rsplit(".", 1)[-1] in targets and kind not in ADAPTABLE})
    if wrong:
        raise HftkError("model.lora_target_modules", f"LoRA cannot wrap {', '.join(wrong)}.",
                        f"target linear layers only ({', '.join(ADAPTABLE)}).")


# ---- applying ----

def is_peft(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def apply(model: Any, cfg: RunConfig, args: Any, new_tokens: list[int] | None = None) -> Any:
    """``get_peft_model`` before the strategy sees the model; a no-op without ``lora_r``.

    ``new_tokens``: the rows ``models.loading.fit_to_tokenizer`` added, trained with the adapter.

    ``args`` is the run's ``TrainingArguments`` (seed, main process). Gradient checkpointing needs
    nothing here: transformers' ``gradient_checkpointing_enable`` makes the embeddings' output
    require grad, so even reentrant checkpointing backpropagates into the adapters of frozen blocks.
    """
    if not cfg.model.lora_r:
        return model
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_quantized", False):  # QLoRA: frozen base, norms / embeddings in fp32, input grads
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    with torch.random.fork_rng(devices=[]):  # every rank (and a one-process run) draws the same lora_A
        torch.manual_seed(args.seed)
        config = lora_config(cfg.model, model.config, trainable_tokens(model, new_tokens or []), uses_conv1d(model))
        model = get_peft_model(model, config)
    partition_like_base(model)  # the adapters PEFT added
    counts = parameter_counts(model)
    if args.process_index == 0:
        from hftk.telemetry.metrics import append_jsonl

        peft_config = model.peft_config[ADAPTER_NAME]
        targets = ", ".join([*sorted(peft_config.target_modules), *sorted(peft_config.target_parameters or [])])
        chosen = "" if cfg.model.lora_target_modules else (
            " (default: every linear projection of the decoder blocks" +
            (" and the experts' fused weights, which QLoRA leaves in 16 bits" if peft_config.target_parameters and
             getattr(model.get_base_model(), "is_quantized", False) else
             " and the experts' fused weights" if peft_config.target_parameters else "") + ")")
        print(f"hftk: LoRA r={cfg.model.lora_r} alpha={cfg.model.lora_alpha} on {targets}{chosen}: "
              f"{counts['lora_trainable_params']:,} trainable of {counts['lora_total_params']:,} parameters "
              f"({100 * counts['lora_trainable_fraction']:.3f}%)", flush=True)
        append_jsonl(cfg.output_dir / cfg.tracking.metrics_file, {"step": 0, **counts})
    return model


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter (a ZeRO-3 partition reports its full count in ``ds_numel``)."""
    return int(getattr(param, "ds_numel", param.numel()))


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


def parameter_counts(model: Any) -> dict[str, float]:
    params = list(model.parameters())
    trainable = sum(full_numel(p) for p in params if p.requires_grad)
    total = sum(full_numel(p) for p in params)
    return {"lora_trainable_params": trainable, "lora_total_params": total,
            "lora_trainable_fraction": trainable / total}


# ---- gathering and saving ----

def is_trained_adapter(name: str) -> bool:
    """A weight of the adapter hftk trains (``default``: LoRA, and trainable tokens where chat markers were
    added); not another adapter beside it, such as the frozen reference copy (``ref``) TRL's DPOTrainer adds."""
    return ("lora_" in name or "trainable_tokens_" in name) and (f".{ADAPTER_NAME}." in name
                                                                  or name.endswith(f".{ADAPTER_NAME}"))


def adapter_parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """What PEFT saves of this adapter, by parameter name: the trained adapter's weights (no bias), and with
    trainable tokens (chat markers added) the embeddings they were added to, whole: PEFT saves a resized
    vocabulary's embedding layers (``save_embedding_layers="auto"``), so the adapter reloads with the very
    rows it was trained beside (an untied LM head's new rows are drawn at random, never trained)."""
    embeddings: set[int] = set()
    if getattr(model.peft_config[ADAPTER_NAME], "trainable_token_indices", None):
        base = model.get_base_model()
        for layer in filter(None, (base.get_input_embeddings(), base.get_output_embeddings())):
            embeddings |= {id(p) for p in layer.parameters()}
    return [(n, p) for n, p in model.named_parameters() if is_trained_adapter(n) or id(p) in embeddings]


def adapter_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Full shape of every adapter tensor by parameter name (:func:`adapter_parameters`)."""
    return {n: full_shape(p) for n, p in adapter_parameters(model)}


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Every adapter weight whole, as a CPU tensor, under the model's parameter names.

    A collective under FSDP2 (``full_tensor``) and ZeRO-3 (``GatheredParameters``): every rank
    calls it, in the same parameter order; every rank gets the result.
    """
    named = adapter_parameters(model)
    if any(hasattr(p, "ds_id") for _, p in named):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().to("cpu", copy=True) for n, p in named}
    detached = [(n, p.detach()) for n, p in named]
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).to("cpu", copy=True) for n, t in detached}


def gather_pieces(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Union of every rank's whole tensors (pipeline: each rank holds its stages' adapters)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(local)
    from hftk.comm.collectives import gather_objects

    return {k: v for piece in gather_objects({k: v.to("cpu") for k, v in local.items()}) for k, v in piece.items()}


def peft_model_from(config: Any, adapter: Any, state: dict[str, torch.Tensor]) -> Any:
    """A one-process copy of a run's LoRA model: the base built from ``config`` with PEFT's ``adapter`` on it,
    holding ``state`` (gathered shards or stages, under the PeftModel's names; a tied head may be left out)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = get_peft_model(AutoModelForCausalLM.from_config(config), adapter)
    _, unexpected = model.load_state_dict(state, strict=False)
    model.get_base_model().tie_weights()  # a head left out is the embedding's tensor again
    loaded = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in state}
    missing = [name for name, p in model.named_parameters(remove_duplicate=False) if id(p) not in loaded]
    if unexpected or missing:
        raise HftkError("model.lora_r", f"the gathered weights do not match the model with its adapter: missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}.", "report this with the strategy used: the "
                        "shards or stages should hold every weight.")
    return model


def saved_name(name: str) -> str:
    """PEFT's file key for a model parameter name: ``...lora_A.default.weight`` -> ``...lora_A.weight``,
    ``...lora_magnitude_vector.default.weight`` -> ``...lora_magnitude_vector`` (get_peft_model_state_dict's keys)."""
    marker = f".{ADAPTER_NAME}."
    if marker in name:
        head, tail = name.rsplit(marker, 1)
        if head.endswith(".lora_magnitude_vector"):  # DoRA: PEFT saves the magnitude without ``.weight``
            return head
        return f"{head}.{tail}"
    return name.removesuffix(f".{ADAPTER_NAME}")


def write_adapter(folder: Path, config: Any, tensors: dict[str, torch.Tensor],
                  shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's format; with ``shapes``
    (parameter name -> full shape) the file is proven to hold every adapter tensor whole."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({saved_name(k): v.contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    config = copy.deepcopy(config)
    config.inference_mode = True
    config.save_pretrained(str(folder))
    if shapes is not None:
        check_adapter(folder, {saved_name(k): v for k, v in shapes.items()})


def check_adapter(folder: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Every expected adapter tensor is in the file with its full shape (headers only)."""
    from safetensors import safe_open

    if not (Path(folder) / ADAPTER_CONFIG).is_file():
        raise HftkError("output", f"{folder} has no {ADAPTER_CONFIG}.", "rerun the save; check free disk space.")
    with safe_open(str(Path(folder) / ADAPTER_WEIGHTS), framework="pt") as handle:
        saved = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
    bad = {k: (list(shape), saved.get(k)) for k, shape in expected.items() if saved.get(k) != shape}
    if bad or not expected:
        raise HftkError("output", f"{folder}: the adapter lacks or truncates {len(bad)} of {len(expected)} LoRA "
                        f"tensors, e.g. {next(iter(bad.items()), None)}.",
                        "the adapters were not gathered before saving; report this with the strategy used.")


def save_adapter(model: Any, folder: Path, is_main: bool) -> None:
    """Collective: gather the adapter from any sharding; the main process writes and checks it."""
    tensors = adapter_tensors(model)
    if is_main:
        write_adapter(folder, model.peft_config[ADAPTER_NAME], tensors, adapter_shapes(model))
        write_quantization_record(model, folder)


def write_quantization_record(model: Any, folder: Path) -> None:
    """A QLoRA adapter's base quantization beside it, so that a merge quantizes the base as in training."""
    quantization = getattr(model.config, "quantization_config", None)
    if quantization is not None:
        (Path(folder) / QUANTIZATION_FILE).write_text(json.dumps(quantization.to_dict(), indent=2, default=str))


class QuantizationRecordCallback(TrainerCallback):
    """The Trainer's own ``checkpoint-N`` of a PEFT model holds the adapter but not the base's
    quantization; this adds it while the checkpoint is still staged (before it is sealed)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if args.should_save and folder.is_dir() and not (folder / QUANTIZATION_FILE).exists():
            write_quantization_record(self.model, folder)


def save_final(trainer: Any, folder: Path) -> None:
    """The final folder of a Trainer LoRA run under any strategy: adapter + tokenizer."""
    import torch.distributed as dist

    save_adapter(trainer.model, folder, trainer.args.should_save)
    if trainer.args.should_save and trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(str(folder))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def load_adapter(model: Any, folder: Path) -> None:
    """Adapter weights from ``folder`` into a (possibly FSDP2-sharded) PeftModel; a collective under FSDP2."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    saved = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    names = adapter_shapes(model)
    state = {name: saved[saved_name(name)] for name in names if saved_name(name) in saved}
    missing = sorted(set(names) - set(state))
    if missing:
        raise HftkError("training.resume_from_checkpoint", f"{folder} lacks adapter tensors {missing[:3]}.",
                        "resume from a complete checkpoint of the same LoRA configuration.")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


# ---- export and merge ----

def is_adapter_folder(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file() and (Path(path) / ADAPTER_WEIGHTS).is_file()


def base_model_of(folder: Path) -> str:
    """The base model an adapter was trained on (PEFT records it in adapter_config.json)."""
    base = json.loads((Path(folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise HftkError("CHECKPOINT", f"{folder}/{ADAPTER_CONFIG} names no base model.",
                        "pass --base_model with the Hub id or folder the adapter was trained on.")
    return base


def quantization_of(folder: Path) -> dict[str, Any] | None:
    """The BitsAndBytesConfig (as a dict) of the base a QLoRA adapter was trained on, or None."""
    path = Path(folder) / QUANTIZATION_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def merged_model(folder: Path, base: str | None = None) -> Any:
    """The base model with the adapter of ``folder`` folded into its weights (``merge_and_unload``).

    A QLoRA adapter merges into its base quantized as in training, then dequantized (transformers'
    ``dequantize``): full-precision weights equal to what the adapter was trained against. A run that
    added chat markers saved its tokenizer and its grown embeddings beside the adapter: the base is grown
    to that tokenizer first (PEFT then loads the saved rows over the grown ones) and stops on its EOS.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from hftk.models.loading import fit_to_tokenizer, local_device

    base = base or base_model_of(folder)
    revision = json.loads((Path(folder) / ADAPTER_CONFIG).read_text()).get("revision")
    quantization = quantization_of(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if quantization is None:
        model = AutoModelForCausalLM.from_pretrained(base, revision=revision, dtype="auto", use_kernels=False)
        fit_to_tokenizer(model, tokenizer, seed=0)  # any rows: the adapter's saved embeddings replace them
        return PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    model = AutoModelForCausalLM.from_pretrained(base, revision=revision, device_map={"": local_device()},
                                                 quantization_config=BitsAndBytesConfig.from_dict(quantization),
                                                 use_kernels=False)
    model = model.dequantize()
    fit_to_tokenizer(model, tokenizer, seed=0)
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    return in_base_layout(merged)


def in_base_layout(model: Any) -> Any:
    """``model`` rebuilt as its own architecture: dequantizing turned GPT-2's Conv1D layers, which store
    weights (in, out), into ``nn.Linear`` (out, in); their weights are transposed back so the folder
    loads with ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(model.config)
    conv1d = {f"{name}.weight" for name, module in fresh.named_modules() if type(module).__name__ == "Conv1D"}
    state = {k: (v.t().contiguous() if k in conv1d else v).to("cpu") for k, v in model.state_dict().items()}
    fresh.load_state_dict(state, strict=True, assign=True)
    fresh.tie_weights()
    return fresh


def export_adapter(checkpoint: Path, out: Path, merge: bool, base: str | None = None,
                   repo_id: str | None = None) -> str:
    """Write ``out`` from a LoRA checkpoint: the adapter folder, or (``merge``) the merged full model
    with the run's record and a model card saying how it was merged (when the run's record is found).

    Tokenizer files come along in both cases (and a QLoRA adapter's quantization record); returns the
    kind of folder written: ``lora-adapter``, ``lora-merged`` or ``qlora-merged`` (dequantized base).
    """
    from transformers import AutoTokenizer

    from hftk.checkpoint.hf_folder import check_complete, shapes_of

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    if merge:
        model = merged_model(checkpoint, base)
        model.save_pretrained(str(out))
        check_complete(out, shapes_of(model))
        kind = "qlora-merged" if quantization_of(checkpoint) else "lora-merged"
        from hftk.checkpoint.run_record import find_run_record, write_run_files

        record = find_run_record(Path(checkpoint))
        if record is not None:
            write_run_files(out, {**record, "merged": True}, repo_id)
    else:
        out.mkdir(parents=True, exist_ok=True)
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, QUANTIZATION_FILE):
            if (Path(checkpoint) / name).is_file() or name != QUANTIZATION_FILE:
                shutil.copy2(Path(checkpoint) / name, out / name)
        kind = "lora-adapter"
    tokenizer.save_pretrained(str(out))
    return kind
