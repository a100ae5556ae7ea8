"""Preference tuning: TRL's DPOTrainer driven as the Trainer path drives the HF Trainer (same arguments,
strategy, callbacks, checkpoints); TRL tokenises the pairs, holds the reference and computes the loss, and
hftk holds the tokenised pairs to ``max_length`` as ``data.truncation`` says. The steps every TRL trainer of hftk
takes (its config over TRL's defaults, the policy, the reference as the strategy holds it, the trainer with the
strategy's I/O, hftk's callbacks) are the functions here that GRPO (:mod:`hftk.engine.rl`) calls too."""

from __future__ import annotations

import dataclasses
from typing import Any

from hftk.config import strategy_table
from hftk.config.options import field_default
from hftk.core import startup
from hftk.core.errors import HftkError
from hftk.data.dataset import split_and_mix
from hftk.data.preference import PAIR_IDS, fit_pairs
from hftk.engine import trainer as trainer_engine
from hftk.engine.run_types import PreparedRun
from hftk.launch.guard import check_world
from hftk.models import lora
from hftk.models.loading import fit_to_tokenizer, load_model, load_tokenizer


def dpo_options(cfg: Any) -> dict[str, Any]:
    """DPOConfig's fields from hftk's preference options (TRL's names)."""
    p = cfg.preference
    return dict(beta=p.beta, loss_type=[p.loss_type], max_length=p.max_length or cfg.data.block_size,
                precompute_ref_log_probs=p.precompute_ref_log_probs)


def trl_default_overrides(cfg: Any, config_class: Any = None, trl_keeps: tuple[str, ...] = ()) -> dict[str, Any]:
    """The run's value (``cfg.args``: set, else hftk's default, else TrainingArguments') of each field TRL's
    config (DPOConfig, or ``config_class``) defaults differently (TRL 1.16: bf16 None -> on unless fp16,
    gradient_checkpointing on, learning_rate 1e-6, logging_steps 10). Without this an option left unset means
    something else under ``--method dpo`` / ``grpo`` than under sft: bf16 autocast on CPU was the ~1e-4 parity gap
    to a fp32 reference. ``trl_keeps``: fields whose TRL default the trainer needs unless the user set them (GRPO's
    ``remove_unused_columns`` False: the reward functions read every column)."""
    from transformers import TrainingArguments
    from trl import DPOConfig

    plain = {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}
    return {f.name: getattr(cfg.args, f.name) for f in dataclasses.fields(config_class or DPOConfig)
            if f.name in plain and field_default(f) != field_default(plain[f.name])
            and (f.name not in trl_keeps or f.name in cfg.given)}


def trl_arguments(prepared: PreparedRun, config_class: Any, options: dict[str, Any],
                  trl_keeps: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """(TRL's config for this run, the strategy module): the strategy's own arguments and the run's options over
    TRL's defaults, then the method's ``options``; building it starts the process group, whose size is checked."""
    cfg = prepared.cfg
    strategy = strategy_table.get(cfg.strategy.strategy)
    extra = {**trl_default_overrides(cfg, config_class, trl_keeps),
             **strategy.training_arguments(cfg, prepared.model_config), **options}
    args = trainer_engine.build_training_arguments(prepared, extra, arguments_class=config_class)
    check_world(args.world_size)
    startup.mark("process_group")
    return args, strategy


def policy_model(cfg: Any, strategy: Any, tokenizer: Any, args: Any) -> tuple[Any, list[int]]:
    """(the model to train, the token ids added for chat markers): loaded, fitted to the tokenizer, LoRA applied,
    then prepared (sharded) by the strategy, in the engine's order."""
    base = load_model(cfg.model, shardable=getattr(strategy, "SHARDS_PARAMETERS", False))
    new_tokens = fit_to_tokenizer(base, tokenizer, args.seed)
    return strategy.prepare_model(lora.apply(base, cfg, args, new_tokens), cfg), new_tokens


def starting_copy(model: Any, strategy: Any, tokenizer: Any, seed: int) -> Any:
    """A second, frozen copy of a starting model (``model``: its options) in the policy's vocabulary, before any
    strategy prepares it: the reference."""
    ref = load_model(model, shardable=getattr(strategy, "SHARDS_PARAMETERS", False))
    fit_to_tokenizer(ref, tokenizer, seed)  # the policy's vocabulary
    return ref


def trl_trainer(cfg: Any, strategy: Any, trainer_class: type, **kwargs: Any) -> Any:
    """``trainer_class`` (a TRL trainer) built with the strategy's own model / optimizer I/O ahead of it where the
    strategy has one (FSDP2 shards)."""
    make = strategy.trainer_factory(cfg, trainer_class) if hasattr(strategy, "trainer_factory") else trainer_class
    return make(**kwargs)


def add_run_callbacks(prepared: PreparedRun, trainer: Any, strategy: Any, method: str, held: str) -> None:
    """hftk's callbacks and samples on a TRL trainer; rank 0 says how the reference is held."""
    if trainer.args.process_index == 0:
        print(f"hftk: {method} reference: {held}", flush=True)
    for callback in trainer_engine.run_callbacks(prepared, trainer, strategy):
        trainer.add_callback(callback)
    trainer_engine.add_samples(prepared, trainer)  # the policy's samples (the reference is never sampled)
    startup.mark("trainer")


def reference_model(cfg: Any, strategy: Any, tokenizer: Any, seed: int, grown: bool) -> Any:
    """The reference hftk loads, or None where TRL makes it: under LoRA the base with the adapter disabled (no
    copy); otherwise TRL loads the starting model again and prepares it with the policy's accelerate / DeepSpeed
    setup (under ZeRO-3 partitioned, ``trl.models.utils.prepare_deepspeed``). A strategy that shards parameters
    itself (fsdp: hftk's FSDP2, which TRL does not see) gets the reference loaded and sharded like the policy,
    since TRL would hold a whole copy on every rank. ``ref_model_name_or_path`` is loaded here in every case, and
    so is the starting model when chat markers were added (``grown``): TRL's reload from the path would lack their
    rows, so it is grown here with the run's seed, to the policy's very starting rows."""
    shards = getattr(strategy, "SHARDS_PARAMETERS", False)
    name = cfg.preference.ref_model_name_or_path
    if cfg.model.lora_r or not (name or shards or grown) or (cfg.preference.precompute_ref_log_probs and not name):
        return None
    ref = starting_copy(dataclasses.replace(cfg.model, model_name_or_path=name or cfg.model.model_name_or_path),
                        strategy, tokenizer, seed)
    return strategy.prepare_model(ref, cfg) if shards else ref


def reference_held(trainer: Any, strategy_name: str) -> str:
    """How the reference is held, checked where the strategy shards the policy (fsdp: every parameter a DTensor
    over the ranks; ZeRO-3: a stage-3 DeepSpeed engine over partitioned parameters): a whole copy per rank there
    stops the run before training instead of silently costing a model's memory on every rank."""
    ref, spec = trainer.ref_model, strategy_table.STRATEGIES[strategy_name]
    if ref is None:
        if not lora.is_peft(trainer.model):
            return "precomputed log-probs"
        # TRL gives a PeftModel without a reference a frozen copy of its adapter, "ref" (equal to the base while
        # the adapter is fresh: lora_B starts at 0); without it, the base with the adapter disabled.
        peft = trainer.accelerator.unwrap_model(trainer.model).peft_config
        return ("the policy with a frozen copy of its starting adapter (no second model)" if "ref" in peft else
                "the policy with its adapter disabled (no second model)")
    ranks = trainer.args.world_size
    if getattr(strategy_table.get(strategy_name), "SHARDS_PARAMETERS", False):
        from torch.distributed.tensor import DTensor

        whole = [n for n, p in ref.named_parameters() if not isinstance(p, DTensor)]
        if whole:
            raise HftkError("strategy.strategy", f"{strategy_name}: the reference model holds {whole[0]} whole on "
                            "every rank.", "report this with the model family; train with ddp meanwhile.")
        return f"sharded over {ranks} ranks (FSDP2)"
    if spec.zero_stage == 3:
        module = getattr(ref, "module", ref)
        if getattr(ref, "zero_optimization_stage", lambda: None)() != 3 or \
                not all(hasattr(p, "ds_id") for p in module.parameters()):
            raise HftkError("strategy.strategy", f"{strategy_name}: the reference model is not a partitioned ZeRO-3 "
                            "engine.", "report this with the DeepSpeed and TRL versions.")
        return f"partitioned over {ranks} ranks (ZeRO-3)"
    return "a whole copy on each rank"


class _PairsHeldToMaxLength:
    """Ahead of TRL's DPOTrainer in the MRO: TRL tokenises each split (unless ``hftk preprocess`` did already:
    TRL would tokenise its text again), then :func:`hftk.data.preference.fit_pairs` applies
    ``data.truncation`` with its summary line."""

    data_truncation = "drop"

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        rows = len(dataset)
        if not set(PAIR_IDS) <= set(dataset.column_names):
            dataset = super()._prepare_dataset(dataset, processing_class, args, dataset_name)  # type: ignore[misc]
        return fit_pairs(dataset, rows, args.max_length, self.data_truncation, dataset_name, args.process_index == 0)


def dpo_trainer_class(cfg: Any) -> type:
    """TRL's DPOTrainer with the run's pair-length policy (:class:`_PairsHeldToMaxLength`)."""
    from trl import DPOTrainer

    return type("HftkDPOTrainer", (_PairsHeldToMaxLength, DPOTrainer), {"data_truncation": cfg.data.truncation})


def build_dpo_trainer(prepared: PreparedRun) -> tuple[Any, Any, Any]:
    """A ready DPOTrainer: (trainer, strategy module, data with ``train`` / ``eval``)."""
    from trl import DPOConfig

    cfg = prepared.cfg
    args, strategy = trl_arguments(prepared, DPOConfig, dpo_options(cfg))
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template, cfg.data.add_chat_tokens,
                               announce=args.process_index == 0)
    if prepared.tokenized is not None:  # hftk preprocess ran TRL's tokenisation once; every rank read it in prepare
        train, held_out = prepared.tokenized.train, prepared.tokenized.eval
    else:
        train, held_out = split_and_mix(prepared.sources, args.seed)
    startup.mark("data")
    model, new_tokens = policy_model(cfg, strategy, tokenizer, args)
    ref_model = reference_model(cfg, strategy, tokenizer, args.seed, bool(new_tokens))
    startup.mark("model")
    trainer = trl_trainer(cfg, strategy, dpo_trainer_class(cfg), model=model, ref_model=ref_model, args=args,
                          train_dataset=train, eval_dataset=held_out, processing_class=tokenizer)
    add_run_callbacks(prepared, trainer, strategy, "DPO", reference_held(trainer, cfg.strategy.strategy))
    return trainer, strategy, _Data(train=trainer.train_dataset, eval=trainer.eval_dataset)


@dataclasses.dataclass
class _Data:
    """What ``engine.trainer.train`` reads of the data: whether there is a held-out split."""

    train: Any
    eval: Any


def train(prepared: PreparedRun) -> dict[str, float]:
    """The Trainer path's run (callbacks, atomic checkpoints, final/, run record, Hub) around a DPOTrainer."""
    return trainer_engine.train(prepared, build=build_dpo_trainer)
