"""DeepSpeed ZeRO-1, -2, -3 and ZeRO-3 with CPU offload, through the HF Trainer.

The Trainer takes the config dict built by :func:`deepspeed_config` as
``TrainingArguments(deepspeed=...)``. Building ``TrainingArguments`` registers the config
globally (``HfDeepSpeedConfig``), so the engine's order - arguments first, model second - makes
``from_pretrained`` construct a ZeRO-3 model already partitioned (``zero.Init``) instead of whole
on every rank; :func:`prepare_model` refuses a ZeRO-3 model that was loaded whole.

``deepspeed`` itself is imported only inside functions: importing it prints a banner and costs
seconds, and ``hftk export`` reads ZeRO checkpoints through this module without training.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import pickle
import re
import shutil
import socket
import sys
import sysconfig
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import TrainerCallback

from hftk.checkpoint.atomic import COMPLETE_MARKER, resolve_resume, saved_world
from hftk.config.options import RunConfig
from hftk.config.strategy_table import STRATEGIES
from hftk.core.agent_store import node_first
from hftk.core.errors import HftkError
from hftk.core.output import DEEPSPEED_OP_BUILT, printed_lines_dropped
from hftk.models.layout import spec_of
from hftk.plan.types import MAX_LIVE_PARAMETERS, MAX_REUSE_DISTANCE, SUB_GROUP_SIZE

# ZeRO keeps one optimizer partition per rank and DeepSpeed's own loader refuses another world size.
# zero1/2 resume through DeepSpeed's universal checkpoint (:func:`to_universal`). zero3 and zero3_offload
# are not in the table's reshards_on_resume, so their way on is the weights alone: DeepSpeed 0.19.8's
# ZeRO-3 universal load (stage3.py ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) continued a
# 2-rank checkpoint on 1 rank with the first loss equal and later ones up to 3.5e-3 apart, although the
# converted weights and Adam moments matched, hftk's fp32 master alias made no difference, and the same
# 1-rank run from scratch equals the 2-rank one bit for bit; offload (CPU Adam) takes the same ZeRO-3 load.
OTHER_WORLD_SIZE_FIX = (", or start a new run from its weights (`hftk export CHECKPOINT OUT`, then "
                        "--model_name_or_path OUT; the optimizer state starts afresh)")
UNIVERSAL_SUFFIX = ".universal"  # checkpoint-N.universal beside checkpoint-N: no Trainer or hftk name matches it
UNIVERSAL_MARKER = "hftk_universal.json"  # which sealed checkpoint it was converted from, written last

# DeepSpeed keeps its fp32 master weights in these folders: global_step<N>/, named in `latest`.
GLOBAL_STEP_RE = re.compile(r"^global_step\d+$")


def deepspeed_config(cfg: RunConfig) -> dict[str, Any]:
    """The DeepSpeed config dict of ``cfg.strategy.strategy`` (one with a ``zero_stage`` in the strategy table).

    A pure function of the typed config, with DeepSpeed's / the Trainer's ``"auto"`` wherever a
    value depends on the model or on ``TrainingArguments`` (the Trainer fills them in): that is
    what lets ``hftk configs`` write it to ``accelerate_configs/deepspeed/<strategy>.json`` for any model.
    Keep the name and signature stable; ``hftk configs`` calls it.

    - Buckets follow the hidden size h ("auto"): ``reduce_bucket_size`` h^2,
      ``stage3_prefetch_bucket_size`` 0.9 h^2, ``stage3_param_persistence_threshold`` 10 h.
      DeepSpeed's own defaults (5e8-element buckets) allocate more than a small model weighs.
    - ``overlap_comm`` off: overlapping keeps extra gradient buckets alive (memory over speed).
    - ``gradient_clipping`` is explicit: DeepSpeed clips at 1.0 when told nothing, which would
      make a ``max_grad_norm`` other than 1.0 differ silently from DDP.
    - bf16 / fp16 follow ``training.bf16`` / ``training.fp16`` ("auto"); fp16 gets dynamic loss
      scaling (GPU only; validation refuses fp16 without CUDA).
    - No ``optimizer`` section: the Trainer builds its torch AdamW (DeepSpeed's "AdamW" would
      JIT-build fused_adam). ``zero3_offload`` is the exception: offloaded optimizer state needs
      DeepSpeed's CPU Adam, so it names AdamW and DeepSpeed picks ``DeepSpeedCPUAdam``.
    """
    name = cfg.strategy.strategy
    stage = STRATEGIES[name].zero_stage
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
    }
    if stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": MAX_LIVE_PARAMETERS,
            "stage3_max_reuse_distance": MAX_REUSE_DISTANCE,
            "sub_group_size": SUB_GROUP_SIZE,
            # the Trainer's save_model gathers full weights only with this on (else: empty files)
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    config: dict[str, Any] = {
        "zero_optimization": zero,
        "gradient_clipping": float(cfg.args.max_grad_norm),
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1},
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    if STRATEGIES[name].offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        config["optimizer"] = {"type": "AdamW",
                               "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    return config


def validate(cfg: RunConfig, world_size: int) -> None:
    """Options DeepSpeed would silently ignore, and configs that would fight ours."""
    s, t, name = cfg.strategy, cfg.training, cfg.strategy.strategy
    if s.fsdp_cpu_offload:
        raise HftkError("strategy.fsdp_cpu_offload", f"is an FSDP option; {name} (DeepSpeed) would ignore it.",
                        "use --strategy zero3_offload for DeepSpeed CPU offload, or --strategy fsdp --fsdp_cpu_offload.")
    if s.fsdp_hybrid:
        raise HftkError("strategy.fsdp_hybrid", f"is an FSDP option; {name} (DeepSpeed) would ignore it.",
                        "drop --fsdp_hybrid, or use --strategy fsdp.")
    if s.grad_compression != "none" or s.hierarchical_allreduce:
        field = "strategy.grad_compression" if s.grad_compression != "none" else "strategy.hierarchical_allreduce"
        raise HftkError(field, f"hooks into DDP's all-reduce; {name} reduces gradients inside DeepSpeed.",
                        "use it with --strategy ddp, or drop it.")
    if t.get("deepspeed"):
        raise HftkError("training.deepspeed", f"hftk builds the DeepSpeed config of {name} itself.",
                        "drop --deepspeed; pick the stage with --strategy zero1|zero2|zero3|zero3_offload.")
    if t.get("fsdp"):
        raise HftkError("training.fsdp", f"FSDP and DeepSpeed ({name}) cannot both shard the model.",
                        "drop --fsdp, or use --strategy fsdp.")
    if t.get("use_cpu") and torch.cuda.is_available():
        raise HftkError("training.use_cpu", f"makes accelerate skip DeepSpeed, so {name} would silently train as DDP.",
                        "drop --use_cpu to train on the GPUs.")
    if not isinstance(t.get("accelerator_config") or {}, dict):
        raise HftkError("training.accelerator_config", f"{name} adds to it, so it must be given inline.",
                        "write accelerator_config as a mapping in the run YAML.")
    optim = str(cfg.args.optim)
    if STRATEGIES[name].offload and not optim.startswith("adamw"):
        raise HftkError("training.optim", f"{name} steps the optimizer on the CPU with DeepSpeed's CPU AdamW, "
                        f"not {optim}.", "drop --optim, or use --strategy zero3 to keep your optimizer.")
    missing = missing_cpu_adam_tools() if STRATEGIES[name].offload else []
    if missing:
        raise HftkError("strategy.strategy", f"{name} steps the optimizer with DeepSpeed's CPU Adam, built on first use; "
                        f"this machine lacks {'; '.join(missing)}.", "install them (or use --strategy zero3).")
    check_chat_tokens_with_lora(cfg)
    if "LOCAL_RANK" not in os.environ:
        raise HftkError("launch", f"{name} runs under a launcher, even for one process (DeepSpeed reads its rank "
                        "from the environment).", "use `torchrun --nproc_per_node N scripts/finetune.py ...` or "
                        f"`accelerate launch --config_file accelerate_configs/{name}.yaml scripts/finetune.py ...`.")


def check_chat_tokens_with_lora(cfg: RunConfig) -> None:
    """LoRA trains the chat markers a run adds through PEFT's trainable tokens, whose ZeRO-3 set-up
    (``TrainableTokensLayer._collect_token_weights``) gathers the rows on a CUDA device only."""
    from hftk.models.lora import refuse_added_tokens

    if STRATEGIES[cfg.strategy.strategy].zero_stage == 3 and not torch.cuda.is_available():
        refuse_added_tokens(cfg, "trains them with PEFT's trainable tokens, which ZeRO-3 sets up on a GPU only",
                            "train with ddp or fsdp here")


def missing_cpu_adam_tools() -> list[str]:
    """What DeepSpeed's JIT build of ``cpu_adam`` (the offloaded optimizer step) lacks here; [] when built.

    Checked before launch because the build otherwise fails minutes into the first run, on every
    rank, in a compiler log. Prebuilding in setup.sh (``DS_BUILD_CPU_ADAM=1``) would need the same
    tools and cost minutes for users who never offload, so hftk names what to install instead.
    """
    from torch.utils.cpp_extension import CUDA_HOME, _get_build_directory

    package = importlib.util.find_spec("deepspeed")  # the spec only: importing deepspeed prints a banner
    prebuilt = [Path(p) / "ops" / "adam" for p in (package.submodule_search_locations or [])] if package else []
    jit = Path(_get_build_directory("cpu_adam", verbose=False))
    if any(any(folder.glob("cpu_adam*.so")) for folder in [*prebuilt, jit]):
        return []
    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler}; e.g. apt-get install g++)")
    if shutil.which("ninja") is None:
        missing.append("ninja (pip install ninja)")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        missing.append(f"the Python headers (Python.h; e.g. apt-get install python{sysconfig.get_python_version()}-dev)")
    if torch.cuda.is_available() and not (CUDA_HOME and Path(CUDA_HOME, "bin", "nvcc").exists()):
        missing.append(f"the CUDA {torch.version.cuda} toolkit (nvcc; set CUDA_HOME)")
    return missing


def training_arguments(cfg: RunConfig, model_config: Any) -> dict[str, Any]:
    """``deepspeed=<dict>``: the Trainer fills the "auto" values and registers it before the model loads.

    A resume at another world size first converts its checkpoint (:func:`to_universal`: each node's
    local rank 0 while the others wait, before any process group) and loads it with ``load_universal``.

    On DeepSpeed's CPU accelerator, accelerate 1.15 would either drop DeepSpeed (``use_cpu``,
    which the Trainer needs on CPU, e.g. for bf16) or find no backend and report world size 1
    while DeepSpeed's group has N ranks. So this starts accelerate's shared state itself, with
    DeepSpeed's backend (gloo, or ccl when oneCCL is installed), and tells the Trainer to use it;
    ``use_cpu`` then only keeps the Trainer's CPU-side checks happy.
    """
    kwargs: dict[str, Any] = {"deepspeed": deepspeed_config(cfg)}
    source = resumed_at_another_world(resolve_resume(cfg.output_dir, cfg.training.get("resume_from_checkpoint")))
    if source is not None:  # converted before the process group starts (validate let the world change through)
        with node_first("zero-universal"):
            to_universal(source)
        kwargs["deepspeed"]["checkpoint"] = {"load_universal": True}
    if _deepspeed_device() == "cpu":
        _start_cpu_state(int(cfg.args.ddp_timeout))
        kwargs["accelerator_config"] = {**(cfg.training.get("accelerator_config") or {}), "use_configured_state": True}
    return kwargs


def _deepspeed_device() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _start_cpu_state(timeout_s: int) -> None:
    """accelerate's state as a GPU launch gets it: DeepSpeed comm up, backend named, world size right."""
    from datetime import timedelta

    from accelerate import PartialState
    from deepspeed.accelerator import get_accelerator

    before = os.environ.get("ACCELERATE_USE_DEEPSPEED")  # set by `accelerate launch --use_deepspeed`
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # read once by PartialState, as TrainingArguments does
    try:
        with printed_lines_dropped(DEEPSPEED_OP_BUILT):  # DeepSpeed's comm starts here: its note on every rank
            PartialState(backend=get_accelerator().communication_backend_name(), timeout=timedelta(seconds=timeout_s))
    finally:
        if before is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = before


def prepare_model(model: Any, cfg: RunConfig) -> Any:
    """Nothing to apply (the Trainer wraps the engine); ZeRO-3 must have been partitioned at load. A mixture of
    experts kept as one module per expert makes its sparse block a ZeRO-3 leaf (DeepSpeed's
    ``set_z3_leaf_modules``, LLaMA-Factory's fix): gathered whole, so ranks that route to different experts never
    wait on each other's gathers (DeepSpeed#4808). Fused experts are one parameter, gathered whole anyway."""
    zero3 = STRATEGIES[cfg.strategy.strategy].zero_stage == 3
    if zero3 and not all(hasattr(p, "ds_id") for p in model.parameters()):
        raise HftkError(
            "strategy.strategy", f"{cfg.strategy.strategy}: the model was loaded whole, not partitioned by zero.Init, "
            "so every rank would first hold all of it.",
            "build TrainingArguments(deepspeed=...) before from_pretrained (hftk's engine does).",
        )
    moe = spec_of(model).moe
    if zero3 and moe is not None and not moe.fused:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [type(m) for m in model.modules() if type(m).__name__ == moe.sparse_block_class][:1])
    return model


def verify(trainer: Any) -> None:
    """The Trainer must run a DeepSpeed engine of the asked stage, partitioned over the launched world."""
    from deepspeed import DeepSpeedEngine

    asked = trainer.args.deepspeed["zero_optimization"]
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    engine = trainer.model_wrapped
    fix = "launch with torchrun or `accelerate launch --config_file accelerate_configs/<strategy>.yaml`."
    if not isinstance(engine, DeepSpeedEngine):
        raise HftkError("strategy.strategy", f"ZeRO-{asked['stage']} was asked for but the Trainer wrapped the "
                        f"model as {type(engine).__name__}.", fix)
    stage, ranks = engine.zero_optimization_stage(), engine.dp_world_size
    if stage != asked["stage"] or ranks != launched:
        raise HftkError("strategy.strategy", f"ZeRO-{asked['stage']} over {launched} rank(s) was asked for, the "
                        f"engine runs ZeRO-{stage} over {ranks}.", fix)
    if "offload_optimizer" in asked and not (engine.zero_offload_optimizer() and engine.zero_offload_param()):
        raise HftkError("strategy.strategy", "CPU offload was asked for, the engine keeps state on the device.", fix)
    if stage == 3:
        _check_partitioned(trainer.model, ranks)


def _check_partitioned(model: Any, ranks: int) -> None:
    """Each rank's ZeRO-3 partition of every parameter holds about 1/ranks of it."""
    for name, param in model.named_parameters():
        expected = -(-param.ds_numel // ranks)
        if param.ds_tensor.numel() != expected and param.ds_tensor.numel() != param.ds_numel:
            raise HftkError("strategy.strategy", f"ZeRO-3 partition of {name} has {param.ds_tensor.numel()} of "
                            f"{param.ds_numel} elements at {ranks} ranks.", "report this with the DeepSpeed version.")


def callbacks(trainer: Any) -> list[Any]:
    """Trainer callbacks this strategy needs: sharing ZeRO-3's fp32 master with the parameters, and
    saves that settle a failed write collectively."""
    return [DeepSpeedCallback(trainer)]


class DeepSpeedCallback(TrainerCallback):
    """At train begin (engine built, checkpoint loaded, no step yet), see :func:`share_fp32_master`;
    and every rank's checkpoint file written through :func:`hftk.checkpoint.atomic.held_until_settled`, since
    DeepSpeed's ``save_checkpoint`` ends in a barrier that a rank leaving at its failed write would skip."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from hftk.checkpoint.atomic import held_until_settled

        writer = self.trainer.model_wrapped.checkpoint_engine
        writer.save = held_until_settled(writer.save)
        freed = share_fp32_master(self.trainer.model_wrapped.optimizer)
        if freed and state.is_world_process_zero:
            print(f"hftk: ZeRO-3 steps the fp32 parameter partition itself, no fp32 master copy "
                  f"({freed / 2**20:.1f} MiB less per rank)", flush=True)


def share_fp32_master(zero: Any) -> int:
    """Let ZeRO-3's optimizer step the fp32 parameter partition itself instead of an fp32 copy.

    With fp32 weights the "master" partition duplicates the parameter partition. DeepSpeed
    0.19.8 means to alias them (stage3.py ``_create_fp32_partitions``: same dtype and device ->
    no copy, and ``_reassign_or_swap_out_partitioned_parameters`` is written for aliases), but
    its check compares a ``torch.device`` with the string ``get_accelerator().current_device_name()``
    returns, which is never equal, so every rank keeps a redundant copy (1/N of the model in
    fp32). This applies DeepSpeed's own alias. Mixed precision (bf16 / fp16 partitions with an
    fp32 master), offload and NVMe swapping keep their copies. Returns the bytes freed.
    """
    if not hasattr(zero, "fp32_partitioned_groups_flat") or zero.offload_optimizer or zero.swap_optimizer:
        return 0
    freed = 0
    for low, master in zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat):
        if low is None or low.dtype != master.dtype or low.device != master.device:
            continue
        if low.data_ptr() == master.data_ptr():
            continue
        if not torch.equal(low, master):
            raise HftkError("strategy.strategy", "ZeRO-3's fp32 master and parameter partitions differ at train begin.",
                            "report this with the DeepSpeed version; hftk expects DeepSpeed 0.19.")
        freed += master.numel() * master.element_size()
        master.data = low.data
    return freed


def _save_whole_module(trainer: Any, out_dir: str) -> None:
    """ZeRO-1/2 hold the whole module on every rank: its own state dict is saved. The Trainer's ``save_model``
    takes accelerate's ``get_state_dict``, which clones every tensor for DeepSpeed and so unties a tied LM
    head from its embedding: ``save_pretrained`` then finds no shared storage and writes the head twice."""
    if trainer.args.should_save:
        trainer._save(out_dir, state_dict=trainer.accelerator.unwrap_model(trainer.model).state_dict())


class _WholeModuleCheckpoints:
    """ZeRO-1/2's ``checkpoint-N`` model files as ``final/``'s (:func:`_save_whole_module`): the tied head once."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not _internal_call:  # a user's call (and its Hub push): the Trainer's own
            return super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        _save_whole_module(self, output_dir or self.args.output_dir)  # type: ignore[attr-defined]


def trainer_factory(cfg: RunConfig, base: type | None = None) -> Any:
    """The Trainer class the engine builds: under ZeRO-1/2 ``base`` (the Trainer, or TRL's DPOTrainer) with
    :class:`_WholeModuleCheckpoints` ahead of it in the MRO; under ZeRO-3 ``base`` itself."""
    from transformers import Trainer

    base = base or Trainer
    if STRATEGIES[cfg.strategy.strategy].zero_stage == 3:
        return base
    return type(f"WholeModule{base.__name__}", (_WholeModuleCheckpoints, base), {})


def save_final(trainer: Any, out_dir: Path) -> None:
    """ZeRO-1/2 save the module each rank holds (:func:`_save_whole_module`); the Trainer gathers ZeRO-3
    partitions (16-bit gather flag on); then prove the folder complete. No collective after the check: the
    caller's save settles every rank (:func:`hftk.checkpoint.atomic.staged_folder`), also when it fails."""
    if trainer.model_wrapped.zero_optimization_stage() < 3:
        _save_whole_module(trainer, str(out_dir))
    else:
        trainer.save_model(str(out_dir))
    if trainer.args.should_save:
        from hftk.checkpoint.hf_folder import check_complete, shapes_of

        check_complete(out_dir, shapes_of(trainer.model))


# ---- checkpoints: detection and consolidation for `hftk export` ----

def is_zero_checkpoint(path: Path) -> bool:
    """A Trainer checkpoint written by a DeepSpeed engine: ``global_step<N>/`` beside ``latest``."""
    return (path / "latest").is_file() and any(GLOBAL_STEP_RE.match(p.name) for p in path.iterdir() if p.is_dir())


def zero_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights merged from every rank's ZeRO shards (any stage, any world size).

    DeepSpeed's reader, loaded with ``weights_only`` forced on: its pickles are opened with an
    allow-list of DeepSpeed's own small classes instead of arbitrary code execution.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with _weights_only_loads():
            return get_fp32_state_dict_from_zero_checkpoint(str(path))
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        raise HftkError("CHECKPOINT", f"{path} pickles {found.group(1) if found else 'an object'}, which is not on "
                        "hftk's allow-list for DeepSpeed checkpoints (weights-only loading).",
                        "export with the DeepSpeed version that wrote it, or convert it with DeepSpeed's "
                        "zero_to_fp32.py if you trust its source.") from None


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """``torch.load`` weights-only even where DeepSpeed passes ``weights_only=False``; allow-list what it pickles."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


# ---- resuming at another world size: DeepSpeed's universal checkpoint ----

def resumed_at_another_world(resume: str | None) -> Path | None:
    """``resume`` when it is a ZeRO checkpoint saved by another number of ranks than this launch has, else None.

    ``validate.check_world_change`` has already refused such a resume unless the strategy's table row
    reshards and the global batch is kept, so what reaches here continues exactly."""
    if resume is None or not is_zero_checkpoint(Path(resume)):
        return None
    saved = saved_world(Path(resume))[0]
    return Path(resume) if saved not in (None, int(os.environ.get("WORLD_SIZE", "1"))) else None


def resume_folder(resume: str | None) -> str | None:
    """What the Trainer resumes from: for a checkpoint saved at another world size, the universal folder
    :func:`training_arguments` converted it into (its DeepSpeed config then says ``load_universal``)."""
    source = resumed_at_another_world(resume)
    return str(universal_folder(source)) if source is not None else resume


def universal_folder(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + UNIVERSAL_SUFFIX)


def to_universal(checkpoint: Path) -> Path:
    """``checkpoint-N.universal`` beside ``checkpoint-N``, which stays as it was: the Trainer's own files
    linked, ZeRO's per-rank shards converted by DeepSpeed's ``ds_to_universal`` into one fp32 folder per
    parameter (weights, Adam moments, step), and ``latest_universal`` naming it -- the layout
    ``engine.load_checkpoint`` reads under ``"checkpoint": {"load_universal": true}``, at any world size.

    Converted once: a folder whose marker names this checkpoint's seal is reused. Written in a staging
    sibling and renamed, so a killed conversion never leaves a half folder that looks done."""
    final = universal_folder(checkpoint)
    source = {"source": str(checkpoint.resolve()),
              "seal": hashlib.sha256((checkpoint / COMPLETE_MARKER).read_bytes()).hexdigest()}
    if (final / UNIVERSAL_MARKER).is_file() and json.loads((final / UNIVERSAL_MARKER).read_text()) == source:
        return final
    staged = checkpoint.with_name(f".{final.name}.partial-{socket.gethostname()}")
    shutil.rmtree(staged, ignore_errors=True)  # this host's leftover of a killed conversion
    try:
        staged.mkdir()
    except OSError as exc:
        raise HftkError("training.resume_from_checkpoint", f"{checkpoint} was saved by another number of ranks "
                        f"and its universal form cannot be written beside it: {exc.strerror}.",
                        "copy the checkpoint into a folder you can write to and resume from there.") from None
    tag = (checkpoint / "latest").read_text().strip()
    try:
        for entry in checkpoint.iterdir():  # trainer_state.json, rng states, weights, tokenizer: read as they are
            if entry.name not in ("latest", COMPLETE_MARKER) and not GLOBAL_STEP_RE.match(entry.name):
                (staged / entry.name).symlink_to(entry.resolve())
        _ds_to_universal(checkpoint / tag, staged / f"{tag}_universal")
        (staged / UNIVERSAL_MARKER).write_text(json.dumps(source))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if final.exists():  # converted from an earlier checkpoint of the same name
        shutil.rmtree(final)
    try:
        staged.rename(final)
    except OSError:  # another node's rank finished the same conversion first (a shared filesystem)
        shutil.rmtree(staged, ignore_errors=True)
    print(f"hftk: converted {checkpoint} to DeepSpeed's universal checkpoint {final} (to resume it at another "
          "world size; the original is unchanged)", file=sys.stderr, flush=True)
    return final


def _ds_to_universal(zero_folder: Path, out: Path) -> None:
    """DeepSpeed's converter, called as its script's ``main`` would be (one process, so no worker pool; its
    banner and progress bars kept off the screen; a failure is one line). ``inject_missing_state``: a model
    that is not Megatron's declares no universal-checkpoint info, which DeepSpeed then fills with its version."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(zero_folder), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    try:  # the user's pickles opened weights-only, as `hftk export` does
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                _weights_only_loads():
            ds_to_universal.main(args)
    except Exception as exc:
        raise HftkError("training.resume_from_checkpoint", f"DeepSpeed could not convert {zero_folder} to a "
                        f"universal checkpoint: {type(exc).__name__}: {exc}.",
                        "resume with the number of ranks that saved it.") from None
