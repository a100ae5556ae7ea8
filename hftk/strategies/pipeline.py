"""Pipeline parallelism for GPT-style Hub models with ``torch.distributed.pipelining``.

The HF model is cut along its own structure (:mod:`hftk.models.spec`: transformers'
``base_model_pp_plan`` or the module tree): embeddings -> decoder blocks -> final norm -> LM head,
into contiguous stages balanced by parameter count. Each stage (:class:`DecoderStage`) runs the
model's own forward over its blocks only, so the model code is never edited and nothing the model
does around its blocks is lost. Schedules: GPipe, 1F1B and interleaved 1F1B
(``pp_virtual_stages`` stages per rank, stage ``s`` on pipeline rank ``s % pp_size``).

Layout of the processes: a ``(dp, pp)`` device mesh; ranks ``d*pp .. d*pp+pp-1`` form
replica ``d``. Gradients are summed over the data-parallel group of each stage, and a
tied input/output embedding (first and last stage) is summed over a two-rank group, so
the update equals the single-process one. Every loss is divided by the token count of the
whole optimizer step (all micro-batches, accumulation steps and replicas), as the Trainer
does with ``num_items_in_batch``; gradients are therefore summed, never averaged.

The Trainer cannot drive a pipeline: the strategy table names the loop that does
(:mod:`hftk.engine.loop`). Checkpoints hold one safetensors file per stage under the
full model's parameter names (``stage-NN.safetensors``), one optimizer state per pipeline
rank, and ``pipeline.json``; :func:`pipeline_state_dict` merges them for the export.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from hftk.comm.collectives import all_reduce_flat, gather_objects
from hftk.config.options import RunConfig, StrategyConfig
from hftk.core.errors import HftkError
from hftk.models import moe
from hftk.models.lora import peft_model_from
from hftk.models.layout import DecoderLayout, layout
from hftk.models.spec import check_strategy, model_spec
from hftk.strategies.parallel_dims import ParallelDims, parallel_dims

MANIFEST = "pipeline.json"
STAGE_FILE = "stage-{:02d}.safetensors"
OPTIMIZER_FILE = "optimizer-pp{:02d}.pt"


# ---------------------------------------------------------------------------------------------
# Validation (before any process group exists)
# ---------------------------------------------------------------------------------------------

def stages_per_rank(s: StrategyConfig) -> int:
    return s.pp_virtual_stages if s.pp_schedule == "interleaved_1f1b" else 1


def validate(cfg: RunConfig, world_size: int) -> None:
    """Every pipeline-specific mistake, named, before any process starts training."""
    from hftk.models.loading import load_model_config

    s = cfg.strategy
    parallel_dims(s, world_size)
    _refuse_combinations(cfg)
    batch = cfg.args.per_device_train_batch_size
    m = s.pp_microbatches
    if m < 1 or batch % m:
        raise HftkError("strategy.pp_microbatches", f"{m} micro-batches do not divide the per-replica batch of {batch}.",
                        "choose pp_microbatches dividing training.per_device_train_batch_size.")
    if s.pp_schedule == "1f1b" and m < s.pp_size:
        raise HftkError("strategy.pp_microbatches", f"1F1B needs at least as many micro-batches as stages ({m} < {s.pp_size}).",
                        f"set pp_microbatches >= {s.pp_size}, or use --pp_schedule gpipe.")
    if s.pp_schedule == "interleaved_1f1b":
        if s.pp_virtual_stages < 2:
            raise HftkError("strategy.pp_virtual_stages", f"interleaved 1F1B needs >= 2 stages per rank, got {s.pp_virtual_stages}.",
                            "set --pp_virtual_stages 2 or more, or use --pp_schedule 1f1b.")
        rounds = max(1, m // s.pp_size)
        if m % rounds:
            raise HftkError("strategy.pp_microbatches", f"interleaved 1F1B runs {m} micro-batches in rounds of "
                            f"{s.pp_size}; {m} is not a multiple of {rounds} rounds.",
                            f"use a multiple of pp_size ({s.pp_size}) or fewer micro-batches than pp_size.")
    model_config = load_model_config(cfg.model)
    check_strategy(model_spec(model_config, cfg.model.trust_remote_code), "pipeline")
    layers = model_spec(model_config, cfg.model.trust_remote_code).layers
    stages = s.pp_size * stages_per_rank(s)
    if stages > layers:
        name = "strategy.pp_virtual_stages" if stages_per_rank(s) > 1 else "strategy.pp_size"
        raise HftkError(name, f"{stages} pipeline stages but the model has only {layers} decoder layers "
                        "(each stage needs at least one).",
                        f"use at most {layers} stages in all (pp_size x pp_virtual_stages).")
    _check_resume_layout(cfg, world_size)


def _refuse_combinations(cfg: RunConfig) -> None:
    s, t = cfg.strategy, cfg.training
    other = {"strategy.tp_size": s.tp_size, "strategy.sp_size": s.sp_size, "strategy.cp_size": s.cp_size,
             "strategy.dp_shard_size": s.dp_shard_size}
    for name, value in other.items():
        if value != 1:
            raise HftkError(name, f"is {value}, but pipeline runs replicate each stage (no tensor, sequence, context "
                            "or FSDP sharding inside a stage).", f"set {name.split('.')[1]} to 1 with --strategy pipeline.")
    if t.get("deepspeed"):
        raise HftkError("training.deepspeed", "DeepSpeed ZeRO cannot be combined with hftk's pipeline engine.",
                        "drop --deepspeed, or use --strategy zero1/zero2/zero3 without pipeline.")
    if t.get("fsdp"):
        raise HftkError("training.fsdp", "FSDP cannot be combined with hftk's pipeline engine.",
                        "drop --fsdp, or use --strategy fsdp without pipeline.")
    if s.grad_compression != "none" or s.hierarchical_allreduce:
        name = "strategy.grad_compression" if s.grad_compression != "none" else "strategy.hierarchical_allreduce"
        raise HftkError(name, "gradient compression hooks are DDP hooks; the pipeline engine all-reduces its own "
                        "per-stage gradients.", "leave it off with --strategy pipeline.")
    if t.get("fp16"):
        raise HftkError("training.fp16", "the pipeline engine has no fp16 loss scaler.", "use --bf16 instead.")
    if t.get("load_best_model_at_end") or t.get("save_strategy") == "best":
        name = "training.load_best_model_at_end" if t.get("load_best_model_at_end") else "training.save_strategy"
        raise HftkError(name, "the pipeline engine keeps the newest checkpoints, not the best one.",
                        "use save_strategy steps or epoch without load_best_model_at_end.")


def _check_resume_layout(cfg: RunConfig, world_size: int) -> None:
    """A pipeline checkpoint can only continue with the same stages, replicas and schedule."""
    from hftk.checkpoint.atomic import resolve_resume

    resume = resolve_resume(cfg.output_dir, cfg.training.get("resume_from_checkpoint"))
    if not resume or not (Path(resume) / MANIFEST).is_file():
        return
    saved = json.loads((Path(resume) / MANIFEST).read_text())
    wanted = {"pp_size": cfg.strategy.pp_size, "dp_size": world_size // cfg.strategy.pp_size,
              "num_stages": cfg.strategy.pp_size * stages_per_rank(cfg.strategy)}
    diff = {k: (saved.get(k), v) for k, v in wanted.items() if saved.get(k) != v}
    if diff:
        said = ", ".join(f"{k} {a} (checkpoint) vs {b} (this run)" for k, (a, b) in diff.items())
        raise HftkError("training.resume_from_checkpoint", f"{resume} was written by another pipeline layout: {said}.",
                        "resume with the same pp_size, schedule/virtual stages and number of processes, or export it "
                        "with `hftk export` and start a new run from the exported folder.")


# ---------------------------------------------------------------------------------------------
# Stage split
# ---------------------------------------------------------------------------------------------

def _numel(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def split_blocks(block_sizes: list[int], head: int, tail: int, n_stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, minimising the largest stage's parameter count.

    ``head`` (embeddings) counts on the first stage and ``tail`` (final norm + LM head, a tied
    head included: its matmul runs there) on the last. Every stage gets at least one block.
    Exact dynamic programme over split points, ties broken towards earlier cuts.
    """
    n = len(block_sizes)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {n_stages} stages")
    prefix = [0]
    for size in block_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (head if stage == 0 else 0) + (tail if stage == n_stages - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(n_stages, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def plan_stages(parts: DecoderLayout, n_stages: int) -> list[range]:
    """Which decoder blocks each of ``n_stages`` stages runs, balanced by parameter count."""
    head = sum(_numel(m) for m in parts.before.values())
    tail = sum(_numel(m) for m in parts.after.values()) + _numel(parts.head)
    return split_blocks([_numel(b) for b in parts.blocks], head, tail, n_stages)


# ---------------------------------------------------------------------------------------------
# Stage modules: the model's own forward, run over this stage's blocks only
# ---------------------------------------------------------------------------------------------

def _copy_plain_attributes(source: nn.Module, target: nn.Module) -> None:
    """A stand-in answers what a forward may read off the block it replaces (``attention_type``, ``layer_idx``)."""
    for key, value in vars(source).items():
        if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool)):
            setattr(target, key, value)


class _Feed(nn.Module):
    """Stands in for a block before this stage's first: hands on what the stage received (the previous stage's
    hidden states) instead of what the forward computed on its zero placeholder."""

    def __init__(self, box: dict[str, torch.Tensor], block: nn.Module) -> None:
        super().__init__()
        self.box = box
        _copy_plain_attributes(block, self)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.box["input"]


class _Pass(nn.Module):
    """Stands in for a block after this stage's last: passes the hidden states on; the first one records them
    (``box``: this stage's output)."""

    def __init__(self, block: nn.Module, box: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.box = box
        _copy_plain_attributes(block, self)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.box is not None:
            self.box["output"] = hidden
        return hidden


class _ShapeOnly(nn.Module):
    """Stands in, on a rank that does not hold it, for a module the model's forward still calls around this
    rank's blocks (GPT-2 adds its position table before them, a backbone runs its final norm after them):
    zeros of the module's output shape, computed on a weightless meta copy; the stage never uses the values."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        import copy

        memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                                for p in module.parameters()}
        memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
        self.meta = (copy.deepcopy(module, memo),)  # a tuple: not a submodule, never moved or saved

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils._pytree import tree_map

        device = next((t.device for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)), None)
        to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        out = self.meta[0](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                        if isinstance(t, torch.Tensor) else t, out)


class DecoderStage(nn.Module):
    """One stage: the causal LM's own forward, over this stage's blocks only.

    The model code is not rebuilt: during this stage's forward the backbone's block list is a view in which
    the blocks before the stage hand on the received hidden states (:class:`_Feed`) and those after it pass
    them through (:class:`_Pass`), so everything the model does around its blocks (embedding scales and
    multipliers, per-layer-type masks and rotary tables, logit scaling and soft-capping) runs as the model
    runs it. The first stage feeds ``input_ids``; a later one feeds zeros as ``inputs_embeds`` (the forward's
    code before the blocks runs on them, their values never reach a block). The last stage returns the
    causal LM's logits, the others the hidden states after their last block.

    Holds references to the model's own submodules (no copies); ``names`` maps each of its state-dict keys to
    the full model's name, so per-stage checkpoints merge into one model.
    """

    def __init__(self, parts: DecoderLayout, blocks: range, first: bool, last: bool,
                 qualnames: dict[int, str]) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.block_indices = list(blocks)
        self.blocks = nn.ModuleList(parts.blocks[i] for i in self.block_indices)
        self.before = nn.ModuleDict(parts.before) if first else None
        self.after = nn.ModuleDict(parts.after) if last else None
        self.head = parts.head if last else None
        owned = [(f"blocks.{j}", block) for j, block in enumerate(self.blocks)]
        owned += [(f"before.{n}", m) for n, m in (parts.before.items() if first else ())]
        owned += [(f"after.{n}", m) for n, m in (parts.after.items() if last else ())]
        owned += [("head", parts.head)] if last and parts.head is not None else []
        self.names = {f"{local}.{key}": f"{qualnames[id(module)]}.{key}"
                      for local, module in owned for key in module.state_dict()}
        self._box: dict[str, torch.Tensor] = {}
        end = blocks.stop
        view = [_Feed(self._box, b) if i < blocks.start else b if i < end
                else _Pass(b, self._box if i == end else None) for i, b in enumerate(parts.blocks)]
        # tuples: the model, its backbone and the view are reached through, not owned (no double registration)
        self._model, self._backbone, self._view = (parts.model,), (parts.backbone,), (nn.ModuleList(view),)
        self._blocks_name = parts.spec.blocks
        # Mixture of experts with a balancing loss: the running sums of every MoE layer's router travel with the
        # hidden states, and the last stage adds the loss they make (hftk.models.moe.add_balance_sums)
        moe = parts.spec.moe
        self._moe = moe if moe is not None and moe.aux_coef is not None else None
        self._routers = [parts.blocks[i].get_submodule(moe.router) for i in self.block_indices
                         if i in moe.layers] if self._moe else []

    def forward(self, inputs: torch.Tensor, *carried: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> Any:
        """``position_ids`` (packing bfd: restarting per example, no ``attention_mask``) reach every stage with
        the batch; the model's mask makers then build the packed block-diagonal mask from them. ``carried``: the
        balancing loss's running sums from the stages before (mixture of experts)."""
        model, backbone = self._model[0], self._backbone[0]
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
        if self._moe:  # the stage adds the balancing loss itself: the model would see this stage's routers only
            kwargs["output_router_logits"] = False
        if self.first:
            kwargs["input_ids"] = inputs
        else:
            self._box["input"] = inputs
            kwargs["inputs_embeds"] = torch.zeros_like(inputs)
        logits: list[torch.Tensor] = []
        index = self._moe.router_logits_index if self._moe else 0
        hooks = [r.register_forward_hook(lambda _m, _a, out: logits.append(out[index])) for r in self._routers]
        own = backbone._modules[self._blocks_name]
        backbone._modules[self._blocks_name] = self._view[0]
        try:
            if self.last:
                out = model(**kwargs).logits
            else:
                backbone(**kwargs)
                out = self._box["output"]
        finally:
            backbone._modules[self._blocks_name] = own
            self._box.clear()
            for hook in hooks:
                hook.remove()
        if not self._moe:
            return out
        sums = carried[0] if carried else torch.zeros(2 * self._moe.num_experts + 1, device=inputs.device)
        for layer_logits in logits:
            sums = moe.add_balance_sums(sums, layer_logits, self._moe.top_k, attention_mask)
        if not self.last:
            return out, sums
        return out, moe.balance_loss(sums)  # the loss function weighs it beside the cross-entropy (TokenLoss)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's tensors under the full model's names."""
        return {self.names[k]: v for k, v in self.state_dict().items() if k in self.names}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = [full for full in self.names.values() if full not in state]
        if missing:
            raise HftkError("training.resume_from_checkpoint", f"the stage file lacks {missing[:3]}.",
                            "resume from a complete checkpoint written by the same model.")
        self.load_state_dict({local: state[full] for local, full in self.names.items()}, strict=False)


def build_stages(model: nn.Module, n_stages: int) -> list[DecoderStage]:
    """All ``n_stages`` stage modules of ``model`` (each process then keeps only its own: :func:`keep_only`)."""
    parts = layout(model)
    qualnames: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        qualnames.setdefault(id(module), name)
    plan = plan_stages(parts, n_stages)
    return [DecoderStage(parts, blocks, i == 0, i == n_stages - 1, qualnames) for i, blocks in enumerate(plan)]


def keep_only(model: nn.Module, stages: list[DecoderStage]) -> None:
    """Free what this rank's ``stages`` do not hold: other stages' blocks become pass-through stand-ins, the
    embeddings, final norm and head the forward still calls become :class:`_ShapeOnly` stand-ins (a tied head
    keeps the weight it shares with an embedding held here)."""
    parts = layout(model)
    held = {id(m) for stage in stages for m in stage.modules()}
    for i, block in enumerate(parts.blocks):
        if id(block) not in held:
            parts.blocks[i] = _Pass(block)
    for name, module in [*parts.before.items(), *parts.after.items()]:
        if id(module) not in held:
            setattr(parts.backbone, name, _ShapeOnly(module))
    if parts.head is not None and id(parts.head) not in held:
        parent, _, leaf = parts.spec.head.rpartition(".")
        setattr(parts.model.get_submodule(parent) if parent else parts.model, leaf, _ShapeOnly(parts.head))


# ---------------------------------------------------------------------------------------------
# Process layout
# ---------------------------------------------------------------------------------------------

@dataclass
class Topology:
    """Where this rank sits in the ``(dp, pp)`` mesh and the groups it talks over."""

    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    pp_group: Any
    dp_group: Any
    tie_group: Any  # first + last pipeline rank of this replica; None on the other ranks
    device: torch.device

    @property
    def holds_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def holds_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def topology(pp_size: int, device: torch.device) -> Topology:
    """Build the mesh and groups (every rank must call this, in the same order)."""
    dims = ParallelDims(dp_replicate=dist.get_world_size() // pp_size, pp=pp_size)
    dp_size = dims.dp_replicate
    if device.type == "cpu":
        device = torch.device("cpu")  # accelerate says "cpu:0", which torch.load and safetensors refuse
    mesh = dims.mesh(device.type, ("dp_replicate", "pp"))
    tie_group = None
    for replica in range(dp_size):  # new_group is collective: every rank creates every pair
        pair = [replica * pp_size, replica * pp_size + pp_size - 1]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            tie_group = group
    return Topology(pp_rank=mesh.get_local_rank("pp"), pp_size=pp_size, dp_rank=mesh.get_local_rank("dp_replicate"),
                    dp_size=dp_size, pp_group=mesh.get_group("pp"), dp_group=mesh.get_group("dp_replicate"),
                    tie_group=tie_group, device=device)


# ---------------------------------------------------------------------------------------------
# Runtime: stages + schedule + gradient synchronisation
# ---------------------------------------------------------------------------------------------

class TokenLoss:
    """The model's own causal-LM loss, divided by the token count of the whole optimizer step; with a mixture of
    experts' balancing loss beside the logits (the last stage's output ``(logits, balancing loss)``), plus that
    loss weighted by the model's ``router_aux_loss_coef`` (:mod:`hftk.models.moe`) while training.

    ``divisor`` is set before every schedule step (training: tokens of all micro-batches,
    accumulation steps and replicas; evaluation: 1, i.e. a sum, and no balancing term).
    """

    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.divisor: torch.Tensor | float = 1.0
        self.training = True
        self.balances: list[torch.Tensor] = []  # this step's balancing losses (the schedule's first step also
        # runs the loss on the placeholder tensors it infers shapes with: only the last micro-batches' are real)

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor
                 ) -> torch.Tensor:
        logits, balance = output if isinstance(output, tuple) else (output, None)
        loss = self.model.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size,
                                        num_items_in_batch=self.divisor)
        if balance is None or not self.training:
            return loss
        self.balances.append(balance.detach())
        return loss + self.model.router_aux_loss_coef * balance


@dataclass
class PipelineRuntime:
    topo: Topology
    stages: list[DecoderStage]  # this rank's stages, in stage order
    stage_indices: list[int]
    num_stages: int
    schedule: Any
    loss: TokenLoss
    microbatches: int
    tied_names: tuple[str, str] | None  # (input embedding, LM head) full names when tied
    # (first-stage, last-stage) names of every parameter both hold: the tied embedding, and under LoRA with
    # added chat tokens the new rows PEFT's trainable tokens share between a tied embedding and head
    shared: list[tuple[str, str]] = field(default_factory=list)
    autocast_dtype: torch.dtype | None = None
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    pipe_stages: list[Any] = field(default_factory=list)  # the PipelineStage objects the schedule drives

    @property
    def holds_first(self) -> bool:
        return self.stage_indices[0] == 0

    @property
    def holds_last(self) -> bool:
        return self.stage_indices[-1] == self.num_stages - 1


def schedule_class(name: str) -> type:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[name]


def build_runtime(model: nn.Module, s: StrategyConfig, topo: Topology, bf16: bool = False) -> PipelineRuntime:
    """Cut ``model``, keep this rank's stages, wrap them in ``PipelineStage`` and a schedule."""
    from torch.distributed.pipelining import PipelineStage

    per_rank = stages_per_rank(s)
    n_stages = s.pp_size * per_rank
    all_stages = build_stages(model, n_stages)
    indices = [topo.pp_rank + v * s.pp_size for v in range(per_rank)]
    mine = [all_stages[i] for i in indices]
    parts = layout(model)
    tied = None
    if parts.tied:
        tied = (all_stages[0].names[f"before.{parts.spec.embedding}.weight"], all_stages[-1].names["head.weight"])
    shared = shared_parameters(all_stages[0], all_stages[-1])  # before the other ranks' parts are dropped here
    keep_only(model, mine)
    parts.model.to(topo.device)  # the stages' modules and what every stage runs (rotary tables); stand-ins stay meta
    pipe_stages = [PipelineStage(stage, i, n_stages, topo.device, group=topo.pp_group) for stage, i in zip(mine, indices)]
    loss = TokenLoss(parts.model, model.config.vocab_size)
    cls = schedule_class(s.pp_schedule)
    target = pipe_stages if per_rank > 1 else pipe_stages[0]
    schedule = cls(target, n_microbatches=s.pp_microbatches, loss_fn=loss, scale_grads=False)
    params = [(stage.names[local], p) for stage in mine for local, p in stage.named_parameters()]
    return PipelineRuntime(topo=topo, stages=mine, stage_indices=indices, num_stages=n_stages, schedule=schedule,
                           loss=loss, microbatches=s.pp_microbatches, tied_names=tied,
                           shared=shared,
                           autocast_dtype=torch.bfloat16 if bf16 else None, params=params, pipe_stages=pipe_stages)


def _schedule_inputs(rt: PipelineRuntime, batch: dict[str, torch.Tensor]) -> tuple[tuple, dict]:
    device = rt.topo.device
    args = (batch["input_ids"].to(device),) if rt.holds_first else ()
    # every stage rebuilds its mask and positions: a padding mask (concat / none) or bfd's position ids
    kwargs: dict[str, Any] = {k: batch[k].to(device) for k in ("attention_mask", "position_ids") if k in batch}
    if rt.holds_last:
        kwargs["target"] = batch["labels"].to(device)
        kwargs["losses"] = []
    return args, kwargs


def _autocast(rt: PipelineRuntime) -> Any:
    return torch.autocast(rt.topo.device.type, dtype=rt.autocast_dtype, enabled=rt.autocast_dtype is not None)


def forward_backward(rt: PipelineRuntime, batch: dict[str, torch.Tensor], divisor: torch.Tensor) -> torch.Tensor:
    """One batch through the pipeline, gradients accumulated; returns this rank's loss sum (0 off the last stage)."""
    for stage in rt.stages:
        stage.train()
    rt.loss.divisor, rt.loss.training = divisor, True
    args, kwargs = _schedule_inputs(rt, batch)
    with _autocast(rt):
        rt.schedule.step(*args, return_outputs=False, **kwargs)
    for balance in rt.loss.balances[-rt.microbatches:] if rt.loss.balances else []:
        moe.record_balance(rt.loss.model, float(balance))
    rt.loss.balances.clear()
    losses = kwargs.get("losses")
    return torch.stack(losses).sum().detach().float() if losses else torch.zeros((), device=rt.topo.device)


def evaluate_batch(rt: PipelineRuntime, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed token loss of one batch on the last stage (0 elsewhere)."""
    for stage in rt.stages:
        stage.eval()
    rt.loss.divisor, rt.loss.training = 1.0, False
    args, kwargs = _schedule_inputs(rt, batch)
    with torch.no_grad(), _autocast(rt):
        rt.schedule.eval(*args, return_outputs=False, **kwargs)
    losses = kwargs.get("losses")
    return torch.stack(losses).sum().float() if losses else torch.zeros((), device=rt.topo.device)


def trainable(rt: PipelineRuntime) -> list[tuple[str, nn.Parameter]]:
    """This rank's parameters that train (with LoRA only the adapters; the frozen base gets no gradient)."""
    return [(n, p) for n, p in rt.params if p.requires_grad]


def reduce_gradients(rt: PipelineRuntime) -> None:
    """Sum gradients over the replicas of each stage, then the tied embedding over its two stages."""
    params = trainable(rt)
    for _, p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if rt.topo.dp_size > 1:
        all_reduce_flat([p.grad for _, p in params], rt.topo.dp_group)
    if rt.topo.tie_group is not None:
        mine = dict(rt.params)
        for first, last in rt.shared:  # the same order on both stages
            tied = mine[first if rt.holds_first else last]
            if tied.requires_grad:  # a frozen (LoRA) embedding has no gradient on either stage
                dist.all_reduce(tied.grad, group=rt.topo.tie_group)


def shared_parameters(first: DecoderStage, last: DecoderStage) -> list[tuple[str, str]]:
    """(first-stage name, last-stage name) of each parameter both stages hold (stages hold the model's own
    modules, so a shared tensor is one object)."""
    ids = {id(p): first.names[n] for n, p in first.named_parameters()}
    return [(ids[id(p)], last.names[n]) for n, p in last.named_parameters() if id(p) in ids]


def clip_gradients(rt: PipelineRuntime, max_norm: float | None) -> torch.Tensor:
    """Global L2 norm over every stage (a shared weight counted once) and clip like ``clip_grad_norm_``."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    skip = {last for _, last in rt.shared} if rt.holds_last else set()
    params = trainable(rt)
    grads = [p.grad for n, p in params if n not in skip]
    local = get_total_norm(grads, norm_type=2.0) if grads else torch.zeros((), device=rt.topo.device)
    squared = local.float().pow(2).reshape(1)
    dist.all_reduce(squared, group=rt.topo.pp_group)
    total = squared.sqrt()[0]
    if max_norm is not None and max_norm > 0:
        clip_grads_with_norm_([p for _, p in params], max_norm, total)
    return total


# ---------------------------------------------------------------------------------------------
# State: per-stage checkpoints and their consolidation
# ---------------------------------------------------------------------------------------------

def manifest(rt: PipelineRuntime, schedule: str) -> dict[str, Any]:
    return {"pp_size": rt.topo.pp_size, "dp_size": rt.topo.dp_size, "num_stages": rt.num_stages,
            "schedule": schedule, "microbatches": rt.microbatches,
            "stage_ranks": {str(i): i % rt.topo.pp_size for i in range(rt.num_stages)},
            "tied": list(rt.tied_names) if rt.tied_names else None}


def save_state(rt: PipelineRuntime, optimizer: torch.optim.Optimizer | None, folder: Path) -> None:
    """Replica 0 writes its stages' weights and its optimizer state (replicas are identical)."""
    from safetensors.torch import save_file

    if rt.topo.dp_rank != 0:
        return
    for index, stage in zip(rt.stage_indices, rt.stages):
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in stage.full_state_dict().items()}
        save_file(tensors, str(folder / STAGE_FILE.format(index)), metadata={"format": "pt"})
    if optimizer is not None:
        torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE.format(rt.topo.pp_rank))


def load_state(rt: PipelineRuntime, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every replica reads the stage files and optimizer state of its pipeline rank."""
    from safetensors.torch import load_file

    for index, stage in zip(rt.stage_indices, rt.stages):
        stage.load_full_state_dict(load_file(str(folder / STAGE_FILE.format(index))))  # copied onto the device
    state = torch.load(folder / OPTIMIZER_FILE.format(rt.topo.pp_rank), map_location=rt.topo.device, weights_only=True)
    optimizer.load_state_dict(state)


def is_pipeline_checkpoint(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def pipeline_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Merge every stage file of a pipeline checkpoint into one full state dict (export)."""
    from safetensors.torch import load_file

    path = Path(path)
    info = json.loads((path / MANIFEST).read_text())
    state: dict[str, torch.Tensor] = {}
    for index in range(info["num_stages"]):
        file = path / STAGE_FILE.format(index)
        if not file.is_file():
            raise HftkError("CHECKPOINT", f"{path} lacks {file.name} of stage {index}/{info['num_stages']}.",
                            "pass a complete checkpoint (every stage's file is written before trainer_state.json).")
        state.update(load_file(str(file)))
    if info.get("tied"):
        embed, head = info["tied"]
        if not torch.equal(state[embed], state[head]):
            diff = float((state[embed].float() - state[head].float()).abs().max())
            raise HftkError("CHECKPOINT", f"the tied copies {embed} and {head} differ by {diff:.3g}.",
                            "this checkpoint is damaged; export an earlier one.")
        del state[head]
    return state


def microbatch_rows(batch_rows: int, microbatches: int) -> int:
    """Rows a padded batch needs so that it splits into equal micro-batches."""
    return math.ceil(batch_rows / microbatches) * microbatches


# ---------------------------------------------------------------------------------------------
# The step the custom loop drives (hftk.engine.loop's step protocol)
# ---------------------------------------------------------------------------------------------

def _pad_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Append copies of row 0 with every label ignored, so a short batch still splits into equal micro-batches.

    The loss is divided by the count of real labels, so padded rows change nothing.
    """
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}  # bfd's use_cache flag: stages keep none
    extra = rows - batch["input_ids"].shape[0]
    if extra <= 0:
        return batch
    out = {k: torch.cat([v, v[:1].expand(extra, *v.shape[1:])]) for k, v in batch.items()}
    out["labels"][-extra:] = -100
    return out


def _loss_shifts_labels(model: Any) -> bool:
    """The Trainer's own rule for counting ``num_items_in_batch`` (``Trainer._loss_shifts_labels``).

    Only a model whose ``loss_type`` maps to ``ForCausalLMLoss`` gets its labels counted
    shifted by one; others (hftk's built-ins, whose config leaves ``loss_type`` unset) count
    every label. Parity with a Trainer run needs the same divisor, so the rule is mirrored.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    return (LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
            and not getattr(model.config, "is_encoder_decoder", False))


class PipelineStep:
    """This rank's stages as the custom loop drives them: one optimizer step's batches through the
    schedule, gradients summed over replicas and the tied embedding, the global norm over stages."""

    monitored = None  # a stage's micro-batches interleave with its waits: no forward-to-last-gradient compute time

    def __init__(self, model: nn.Module, cfg: RunConfig, args: Any) -> None:
        from transformers import Trainer

        self.topo = topology(cfg.strategy.pp_size, args.device)
        names = set(Trainer.get_decay_parameter_names(None, model))  # uses no Trainer state
        # by identity: a tied LM head on the last stage is the embedding's tensor, in the same group on both stages
        self.decay_ids = {id(p) for n, p in model.named_parameters() if n in names}
        self.count_shifted = _loss_shifts_labels(model)
        self.config = model.config
        self.schedule_name = cfg.strategy.pp_schedule
        self.rt = build_runtime(model, cfg.strategy, self.topo, bf16=bool(args.bf16))
        # every batch padded to these rows: stages keep the shapes they were built for, short batches included
        self.train_rows = microbatch_rows(args.per_device_train_batch_size, self.rt.microbatches)
        self.eval_rows = microbatch_rows(args.per_device_eval_batch_size, self.rt.microbatches)
        self.module = nn.ModuleList(self.rt.stages)
        self.device, self.dp_size, self.dp_rank = self.topo.device, self.topo.dp_size, self.topo.dp_rank
        self.params = self.rt.params
        self.replica_key = self.topo.pp_rank  # replicas of one stage must hold equal weights
        self.describe = {"pp_size": self.topo.pp_size, "dp_size": self.topo.dp_size, "num_stages": self.rt.num_stages,
                         "schedule": self.schedule_name, "microbatches": self.rt.microbatches}

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        trainable_params = [p for _, p in trainable(self.rt)]
        return [{"params": [p for p in trainable_params if id(p) in self.decay_ids], "weight_decay": weight_decay},
                {"params": [p for p in trainable_params if id(p) not in self.decay_ids], "weight_decay": 0.0}]

    def _label_count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"][..., 1:] if self.count_shifted else batch["labels"]
        return labels.ne(-100).sum()

    def forward_backward(self, windows: list[dict[str, torch.Tensor]]) -> float:
        """Every batch of one optimizer step through the schedule, loss over the step's label count (the
        Trainer's ``num_items_in_batch``), gradients reduced; returns the global mean loss."""
        rt = self.rt
        tokens = sum(self._label_count(b) for b in windows).to(self.device).reshape(1)
        if self.dp_size > 1:
            dist.all_reduce(tokens, group=self.topo.dp_group)
        divisor = tokens[0] / 1  # a float tensor, as the Trainer's num_items_in_batch
        loss = torch.zeros((), device=self.device)
        for batch in windows:
            loss = loss + forward_backward(rt, _pad_rows(batch, self.train_rows), divisor)
        reduce_gradients(rt)
        total = loss.reshape(1).clone()
        dist.all_reduce(total)  # only the last stage of each replica holds a loss
        return float(total[0])

    def clip_gradients(self, max_norm: float) -> float:
        return float(clip_gradients(self.rt, max_norm))

    def eval_sums(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """(summed token loss, label count by the Trainer's rule) of one eval batch over every replica."""
        loss = evaluate_batch(self.rt, _pad_rows(rows, self.eval_rows))
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.rt.holds_last:
            total += torch.tensor([float(loss), float(self._label_count(rows))], dtype=torch.float64,
                                  device=self.device)
        dist.all_reduce(total)
        return total

    def save(self, folder: Path, optimizer: torch.optim.Optimizer | None) -> None:
        save_state(self.rt, optimizer, folder)
        if dist.get_rank() == 0:
            manifest_data = manifest(self.rt, self.schedule_name)
            (folder / MANIFEST).write_text(json.dumps(manifest_data, indent=2) + "\n")

    def load(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        load_state(self.rt, optimizer, folder)

    def consolidated_model(self, adapter: Any = None) -> nn.Module | None:
        """Collective: replica 0's stages gathered to rank 0, which gets a one-process HF model of the current
        weights (in host memory: the engine places it; the other ranks get None). Generation samples run on it: a pipeline
        schedule runs fixed-shape micro-batches, not ``generate``'s token-by-token forwards. ``adapter``: the
        run's PEFT config (LoRA): the copy is the base with that adapter, under the names the stages hold."""
        from hftk.checkpoint.hf_folder import model_from

        mine = {k: v.detach().to("cpu") for stage in self.rt.stages for k, v in stage.full_state_dict().items()} \
            if self.topo.dp_rank == 0 else {}
        pieces = gather_objects(mine)
        if dist.get_rank() != 0:
            return None
        state = {k: v for piece in pieces for k, v in piece.items()}
        if self.rt.tied_names:  # the head is the embedding's tensor: the model ties it again
            state.pop(self.rt.tied_names[1], None)
        if adapter is None:
            return model_from(self.config, state, Path("<live model>"), runnable=True)
        return peft_model_from(self.config, adapter, state)

    def save_final(self, folder: Path, tokenizer: Any) -> None:
        """Collective: the stages written once more, then rank 0 consolidates them into one HF folder in ``folder``
        (the engine's final save, :func:`hftk.checkpoint.atomic.staged_folder`)."""
        import shutil

        from hftk.checkpoint.hf_folder import check_complete, model_from, shapes_of

        stages = folder / "stages"  # removed again before the folder is published
        if dist.get_rank() == 0:
            stages.mkdir()
        dist.barrier()
        self.save(stages, None)
        dist.barrier()
        if dist.get_rank() == 0:
            model = model_from(self.config, pipeline_state_dict(stages), folder)
            shutil.rmtree(stages)
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            check_complete(folder, shapes_of(model))


def build_step(model: nn.Module, cfg: RunConfig, args: Any) -> PipelineStep:
    return PipelineStep(model, cfg, args)
