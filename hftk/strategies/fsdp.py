"""FSDP2 (``torch.distributed.fsdp.fully_shard``), applied by hftk, trained by the HF Trainer.

Why hftk shards the model itself instead of asking accelerate: accelerate turns FSDP on only for
GPU-like distributed types, so on CPU ``distributed_type: FSDP`` and the Trainer's ``fsdp=...``
silently train plain DDP; and a plain Accelerator given an FSDP2 model wraps it in DDP and
crashes on its DTensor parameters. One path serves CPU (gloo) and GPU (NCCL) alike:

1. :func:`prepare_model` calls ``fully_shard`` on every decoder block (the model's spec names their
   classes: :func:`hftk.models.layout.block_modules`), then on the root, which owns the embeddings, the
   final norm and the LM head, so tied input/output embeddings stay one sharded parameter. A model
   whose blocks cannot be derived is one unit (the root), and the run says so. It marks the model as
   already prepared so accelerate does not wrap it in DDP.
2. :class:`FSDPTrainer` is the HF Trainer with FSDP2's checkpoint I/O: sharded
   (``torch.distributed.checkpoint``) or full model and optimizer state inside the Trainer's own
   ``checkpoint-N`` folders (scheduler, RNG and trainer state stay the Trainer's), and a
   consolidated ``from_pretrained`` folder whenever a model is saved outside a checkpoint.
3. :func:`verify` refuses to train unless every parameter is a DTensor sharded over the ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from transformers import Trainer

from hftk.config.options import RunConfig
from hftk.core.errors import HftkError
from hftk.models import lora
from hftk.models.layout import block_modules, spec_of

# A 4-bit base stores its packed bytes as compute-dtype elements (modeling.quantization_config), so every
# parameter FSDP2 shards is floating point (torch's fully_shard cannot shard bitsandbytes' uint8 default).
SHARDS_PARAMETERS = True
SHARDED_MODEL_DIR = "fsdp_model"  # DCP checkpoint of the model (fsdp_state_dict=sharded)
SHARDED_OPTIMIZER_DIR = "fsdp_optimizer"  # DCP checkpoint of the optimizer (fsdp_state_dict=sharded)
FULL_OPTIMIZER_FILE = "fsdp_optimizer_full.pt"  # whole optimizer state by parameter name (fsdp_state_dict=full)
FULL_MODEL_FILE = "model.safetensors"  # written by save_pretrained (fsdp_state_dict=full, and every final save)
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's name: same place as under every other strategy


# ---- before any process group ----

def validate(cfg: RunConfig, world_size: int) -> None:
    """Combinations FSDP2 cannot honour, or that another mechanism would silently override."""
    s, t = cfg.strategy, cfg.training
    if world_size < 2:
        raise HftkError("strategy.strategy", f"fsdp shards the model over ranks, but the launch has {world_size}: "
                        "nothing would be sharded.",
                        "launch 2+ processes (torchrun --nproc_per_node 2, or accelerate launch with "
                        "accelerate_configs/fsdp.yaml), or use --strategy ddp for one process.")
    if t.get("fp16"):
        raise HftkError("training.fp16", "fsdp trains in fp32 or bf16 (FSDP2 mixed precision); fp16 would need a "
                        "sharded loss scaler hftk does not set up.", "use --bf16 instead of --fp16.")
    if t.get("fsdp") or t.get("fsdp_config"):
        field = "training.fsdp" if t.get("fsdp") else "training.fsdp_config"
        raise HftkError(field, "hftk applies FSDP2 itself; the Trainer's own FSDP would shard the model a second "
                        "time on GPU and silently fall back to DDP on CPU.",
                        "drop it; set FSDP options under strategy (fsdp_cpu_offload, fsdp_reshard_after_forward, ...).")
    if t.get("deepspeed"):
        raise HftkError("training.deepspeed", "FSDP and DeepSpeed cannot both shard the model.",
                        "drop --deepspeed, or use --strategy zero1|zero2|zero3|zero3_offload.")
    if s.fsdp_hybrid:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if world_size % local:
            raise HftkError("strategy.fsdp_hybrid", f"needs the same number of processes on every node "
                            f"(world {world_size}, {local} on this node).", "launch equal process counts per node.")


def training_arguments(cfg: RunConfig, model_config: Any) -> dict[str, Any]:
    """With CPU offload on GPUs the process group also needs gloo: offloaded shards are CPU
    tensors, and the gradient-norm all-reduce and full-state gathers run on them (accelerate
    makes the same choice for its own FSDP offload)."""
    if cfg.strategy.fsdp_cpu_offload and torch.cuda.is_available() and not cfg.training.get("use_cpu"):
        return {"ddp_backend": "cuda:nccl,cpu:gloo"}
    return {}


# ---- sharding ----

def device_mesh(cfg: RunConfig) -> Any:
    """1-D mesh over all ranks; with ``fsdp_hybrid`` 2-D (replicate across nodes, shard inside one).

    The device type is the one accelerate resolved for this process (cpu under ``use_cpu``,
    else the accelerator), so the same code runs on gloo and NCCL.
    """
    from accelerate import PartialState
    from torch.distributed.device_mesh import init_device_mesh

    device_type = PartialState().device.type
    world = dist.get_world_size()
    if cfg.strategy.fsdp_hybrid:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return init_device_mesh(device_type, (world // local, local), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))


def apply_fsdp(model: Any, blocks: list[Any], mesh: Any, reshard_after_forward: bool, bf16: bool = False,
               cpu_offload: bool = False, ignored: set[Any] | None = None) -> None:
    """FSDP2 the way every hftk layout uses it: ``fully_shard`` each decoder block (one gather unit
    each), then the root (embeddings, final norm, head); strategy fsdp and tp / cp / ep's data-parallel
    dimensions. ``bf16``: bf16 compute with fp32 gradient reduction (tp / cp / sp autocast instead).
    ``ignored``: parameters another layout owns whole (expert parallel's experts, one rank each)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                      if bf16 else MixedPrecisionPolicy()),
        # Pinned host memory needs an accelerator; on a CPU-only run the shards live in RAM anyway.
        "offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy(),
        "ignored_params": ignored,
    }
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)


def prepare_model(model: Any, cfg: RunConfig) -> Any:
    """``fully_shard`` each decoder block, then the root; returns the same (now sharded) model."""
    tied = _tied_aliases(model)
    blocks = block_modules(model)
    if not blocks and int(os.environ.get("RANK", "0")) == 0:
        spec = spec_of(model)
        print(f"hftk: fsdp: {spec.name}'s decoder blocks cannot be derived ({spec.structure_problem}): the whole "
              "model is one FSDP unit, gathered whole for each forward and backward", flush=True)
    apply_fsdp(model, blocks, device_mesh(cfg),
               cfg.strategy.fsdp_reshard_after_forward, bool(cfg.training.get("bf16")), cfg.strategy.fsdp_cpu_offload)
    if _tied_aliases(model) != tied:  # e.g. a family whose tied head lives inside a block
        raise HftkError("model.model_name_or_path", f"sharding split the tied weights {sorted(tied)} into separate "
                        "parameters, which would train apart.", "report this model family; train it with ddp meanwhile.")
    # accelerate's own guard against wrapping a model twice: without it, Accelerator.prepare
    # (called by the Trainer) would put the sharded model inside DDP and fail on DTensors.
    model._is_accelerate_prepared = True
    return model


def shard_degree(param: DTensor) -> int:
    """How many ranks ``param`` is split over: its mesh's ``shard`` dimension (all of a 1-D mesh)."""
    mesh = param.device_mesh
    return mesh["shard"].size() if "shard" in (mesh.mesh_dim_names or ()) and mesh.ndim > 1 else mesh.size()


def verify(trainer: Any) -> None:
    """Every parameter is a DTensor split over the launched ranks (over one node's ranks with
    ``fsdp_hybrid``), and the Trainer did not wrap the model in DDP.

    This is the guard against the field's silent fallback: a DDP-wrapped or unsharded model
    stops the run at train begin instead of training replicas under the name fsdp.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    fix = "launch with torchrun or `accelerate launch --config_file accelerate_configs/fsdp.yaml`; keep --fsdp unset."
    model, wrapped = trainer.model, trainer.model_wrapped
    if isinstance(wrapped, DistributedDataParallel) or not isinstance(model, FSDPModule):
        raise HftkError("strategy.strategy", f"fsdp was asked for but the Trainer runs the model as "
                        f"{type(wrapped).__name__}, not an FSDP2 module.", fix)
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            raise HftkError("strategy.strategy", f"fsdp: parameter {name} is not sharded (a plain tensor).", fix)
        hybrid = "replicate" in (param.device_mesh.mesh_dim_names or ())
        expected = int(os.environ.get("LOCAL_WORLD_SIZE" if hybrid else "WORLD_SIZE", "1"))
        if shard_degree(param) != expected or not any(isinstance(p, Shard) for p in param.placements):
            raise HftkError("strategy.strategy", f"fsdp: parameter {name} is placed {param.placements} over "
                            f"{shard_degree(param)} rank(s), expected a Shard over {expected}.", fix)


# ---- state dicts ----

def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def _tied_aliases(model: Any) -> dict[str, str]:
    """Second and later names of a shared parameter -> its first name (e.g. lm_head.weight -> wte)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def full_model_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The whole model as CPU tensors on rank 0 ({} elsewhere); a collective: call on every rank.

    Tied names point at one tensor again, so ``save_pretrained`` stores the weight once.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))
    if state:
        for alias, source in _tied_aliases(model).items():
            state[alias] = state[source]
    return state


def save_full_model(trainer: Any, out_dir: Path, original_format: bool = True) -> None:
    """A complete ``from_pretrained`` folder: safetensors (tied weights once), config, tokenizer.

    Every rank joins the gather; rank 0 writes; all ranks leave once the folder is complete.
    ``original_format=False`` keeps the model's own parameter names (no transformers rename back
    to a family's original checkpoint names), so a resume loads the file as it is.
    """
    from hftk.checkpoint.atomic import held_until_settled

    state = full_model_state_dict(trainer.model)
    if trainer.args.should_save:  # held in a checkpoint save: the others wait in the barrier below
        held_until_settled(_write_full_folder)(trainer, out_dir, state, original_format)
    dist.barrier()


def _write_full_folder(trainer: Any, out_dir: Path, state: dict[str, torch.Tensor], original_format: bool) -> None:
    from hftk.checkpoint.hf_folder import check_complete, shapes_of

    out_dir.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(out_dir, state_dict=state, is_main_process=True,
                                  save_original_format=original_format)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(out_dir)
    check_complete(out_dir, shapes_of(trainer.model, original_format))


def save_sharded_model(trainer: Any, out_dir: Path) -> None:
    """Each rank writes its own shards (DCP); rank 0 adds config and tokenizer for ``hftk export``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(trainer.model)}, checkpoint_id=out_dir / SHARDED_MODEL_DIR)
    if trainer.args.should_save:
        trainer.model.config.save_pretrained(out_dir)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(out_dir)


def load_model_state(model: Any, checkpoint: Path) -> None:
    """Model weights from an FSDP checkpoint of either format (collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if (checkpoint / SHARDED_MODEL_DIR).is_dir():
        import torch.distributed.checkpoint as dcp

        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=checkpoint / SHARDED_MODEL_DIR)
        set_model_state_dict(model, state["model"])
    elif (checkpoint / FULL_MODEL_FILE).is_file():
        from safetensors.torch import load_file

        full = load_file(str(checkpoint / FULL_MODEL_FILE))
        for alias, source in _tied_aliases(model).items():
            full.setdefault(alias, full[source])
        set_model_state_dict(model, full, options=_options(full_state_dict=True))
    elif lora.is_peft(model) and lora.is_adapter_folder(checkpoint):
        lora.load_adapter(model, checkpoint)  # fsdp_state_dict=full with LoRA: the frozen base is as loaded
    else:
        raise HftkError("training.resume_from_checkpoint", f"{checkpoint} holds no FSDP model state "
                        f"({SHARDED_MODEL_DIR}/ or {FULL_MODEL_FILE}).",
                        "resume from a checkpoint written by an fsdp run, or start a new output_dir.")


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def save_optimizer(model: Any, optimizer: Any, out_dir: Path, sharded: bool, is_main: bool) -> None:
    """Optimizer state keyed by parameter name: per-rank DCP shards, or one file from rank 0."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if sharded:
        import torch.distributed.checkpoint as dcp

        dcp.save({"optimizer": get_optimizer_state_dict(model, _inner(optimizer))},
                 checkpoint_id=out_dir / SHARDED_OPTIMIZER_DIR)
        return
    state = get_optimizer_state_dict(model, _inner(optimizer), options=_options(full_state_dict=True, cpu_offload=True))
    if is_main:
        torch.save(state, out_dir / FULL_OPTIMIZER_FILE)


def load_optimizer(model: Any, optimizer: Any, checkpoint: Path) -> None:
    """Optimizer state from either format into the live sharded optimizer (collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    inner = _inner(optimizer)
    if (checkpoint / SHARDED_OPTIMIZER_DIR).is_dir():
        import torch.distributed.checkpoint as dcp

        state = {"optimizer": get_optimizer_state_dict(model, inner)}
        dcp.load(state, checkpoint_id=checkpoint / SHARDED_OPTIMIZER_DIR)
        set_optimizer_state_dict(model, inner, state["optimizer"])
    elif (checkpoint / FULL_OPTIMIZER_FILE).is_file():
        full = torch.load(checkpoint / FULL_OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        set_optimizer_state_dict(model, inner, full, options=_options(full_state_dict=True))
    else:
        raise HftkError("training.resume_from_checkpoint", f"{checkpoint} holds no FSDP optimizer state.",
                        "resume from a checkpoint written by an fsdp run (not with save_only_model).")


# ---- checkpoints: detection and consolidation for `hftk export` ----

def is_fsdp_checkpoint(path: Path) -> bool:
    """A checkpoint holding FSDP's sharded model state (full-format ones are plain safetensors)."""
    return (path / SHARDED_MODEL_DIR / ".metadata").is_file()


def fsdp_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The whole model from every rank's DCP shards, read in this one process (no process group)."""
    from hftk.checkpoint.hf_folder import read_dcp_model

    return read_dcp_model(path / SHARDED_MODEL_DIR)


class FSDPTrainer(Trainer):
    """The HF Trainer whose model and optimizer I/O understands FSDP2's DTensor shards.

    Only the state I/O is replaced; the training loop, scheduler, RNG and trainer-state files
    are the Trainer's. ``state_dict_type`` is ``strategy.fsdp_state_dict``.
    """

    def __init__(self, *args: Any, state_dict_type: str, **kwargs: Any) -> None:
        self.state_dict_type = state_dict_type
        self._saving_checkpoint = False
        super().__init__(*args, **kwargs)

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """Nothing to move: ``fully_shard`` placed every shard (on the mesh's device, or CPU when offloading)."""

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Sharded weights inside a sharded checkpoint; a consolidated HF folder everywhere else."""
        out = Path(output_dir or self.args.output_dir)
        if lora.is_peft(self.model):  # the adapter gathered from the shards (plus DCP shards to resume from)
            lora.save_adapter(self.model, out, self.args.should_save)
            if self._saving_checkpoint and self.state_dict_type == "sharded":
                save_sharded_model(self, out)
            elif self.args.should_save and self.processing_class is not None:
                self.processing_class.save_pretrained(out)
        elif not self._saving_checkpoint:
            save_full_model(self, out)
        elif self.state_dict_type == "sharded":
            save_sharded_model(self, out)
        else:
            save_full_model(self, out, original_format=False)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        out = Path(output_dir)
        save_optimizer(self.model, self.optimizer, out, self.state_dict_type == "sharded", self.args.should_save)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), out / SCHEDULER_FILE)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        load_model_state(model if model is not None else self.model, Path(resume_from_checkpoint))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_optimizer(self.model, self.optimizer, Path(checkpoint))
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=True))

    def _load_best_model(self) -> None:
        load_model_state(self.model, Path(self.state.best_model_checkpoint))


def trainer_factory(cfg: RunConfig, base: type = Trainer) -> Any:
    """The Trainer class the engine builds for this strategy, bound to the checkpoint format; ``base``: another
    Trainer subclass (TRL's DPOTrainer) that gets the same FSDP2 state I/O ahead of it in the MRO."""
    import functools

    cls = FSDPTrainer if base is Trainer else type(f"FSDP{base.__name__}", (FSDPTrainer, base), {})
    return functools.partial(cls, state_dict_type=cfg.strategy.fsdp_state_dict)


def save_final(trainer: Any, out_dir: Path) -> None:
    save_full_model(trainer, out_dir)
