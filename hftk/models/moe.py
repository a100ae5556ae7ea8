"""Mixture of experts in a training run: the router's balancing loss on while training, its weight per micro-batch,
the router metrics, and how the experts' matmuls run.

Which modules are experts and routers is the model's spec's (:class:`hftk.models.spec.MoESpec`); this module only
acts on them from outside:

- **The balancing loss is optimized.** transformers adds ``router_aux_loss_coef * load_balancing_loss`` to the loss
  only when ``output_router_logits`` is on; a forward pre-hook turns it on while the model trains (generation and
  evaluation keep it off). Each engine sums some of a step's micro-batch losses (the Trainer: an accumulation
  window's, and the ranks' when it averages tokens across devices; hftk's loop: every rank's and micro-batch's),
  which would weight the balancing term by their number: hftk divides the coefficient by it, so every strategy
  optimizes ``cross-entropy + coef x mean over the step's micro-batches of the balancing loss``, whatever the world
  size.
- **Router metrics** (:class:`RouterCallback`): ``moe_aux_loss`` (the unscaled balancing term, mean over the
  logging window) and ``expert_load_max_mean`` (the largest over MoE layers of the tokens its busiest expert got
  divided by the mean per expert, over the window), counted from the experts each token was really sent to (the
  experts module's ``top_k_index`` argument) and summed over every rank; one warning per window naming the layers
  where an expert got no token at all.
- **Experts implementation**: ``grouped_mm`` where the device runs it (the CPU, CUDA from compute capability
  8.0), else the eager loop (:func:`choose_experts_implementation`); ``model.experts_implementation`` overrides.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import TrainerCallback

from hftk.core.errors import HftkError
from hftk.models.layout import causal_lm
from hftk.models.spec import ModelSpec, model_spec

EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def choose_experts_implementation(asked: str | None, device: torch.device) -> str:
    """The user's choice, else the fastest the device runs: grouped GEMM (CUDA from compute capability 8.0; the CPU
    with torch >= 2.9), else the eager loop over the experts hit. Measured on a 2-core CPU (16 experts, top-4,
    4 x 256 tokens, forward + backward): grouped_mm 0.29 s, eager 0.66 s, batched_mm 20 s, which also holds a
    copy of every routed token's expert weights."""
    if asked:
        return asked
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "eager"
    return "grouped_mm"


def spec_moe(model: nn.Module) -> Any:
    return model_spec(causal_lm(model).config).moe


def check_options(cfg: Any, spec: ModelSpec) -> None:
    """MoE options that cannot work on this model, named before any process group."""
    coef = cfg.model.router_aux_loss_coef
    if spec.moe is None:
        for field, value in (("model.router_aux_loss_coef", coef),
                             ("model.experts_implementation", cfg.model.experts_implementation)):
            if value is not None:
                raise HftkError(field, f"is set, but {spec.name} ('{spec.family}') has no experts.",
                                f"drop --{field.split('.')[1]} for a dense model.")
        return
    if coef is not None and spec.moe.aux_coef is None:
        raise HftkError("model.router_aux_loss_coef", f"{spec.name} ('{spec.family}') adds no balancing loss to its "
                        "training loss (it balances its experts otherwise).", "drop --router_aux_loss_coef.")
    if coef is not None and coef < 0:
        raise HftkError("model.router_aux_loss_coef", f"must be >= 0, got {coef}.", "use e.g. 0.001, or 0 to turn "
                        "the balancing loss off.")


def prepare(model: nn.Module, cfg: Any, micro_batches_per_step: int, device: torch.device) -> bool:
    """Balancing loss on while training at ``coef / micro_batches_per_step`` (the micro-batch losses the engine
    sums: see the module's docstring) and the experts implementation set; one start line (rank 0). Returns whether
    the model has experts."""
    causal = causal_lm(model)
    moe = model_spec(causal.config).moe
    if moe is None:
        return False
    implementation = choose_experts_implementation(cfg.model.experts_implementation, device)
    causal.set_experts_implementation(implementation)
    coef = cfg.model.router_aux_loss_coef if cfg.model.router_aux_loss_coef is not None else moe.aux_coef
    if moe.aux_coef is not None:
        causal.router_aux_loss_coef = coef / micro_batches_per_step
        causal.register_forward_pre_hook(_router_logits_while_training, with_kwargs=True)
    if int(os.environ.get("RANK", "0")) == 0:
        balance = (f"balancing loss x {coef:g} (mean over each step's micro-batches)"
                   if moe.aux_coef is not None else "no balancing loss (the model balances otherwise)")
        dense = causal.config.get_text_config().num_hidden_layers - len(moe.layers)
        print(f"hftk: mixture of experts: {moe.num_experts} experts, top-{moe.top_k}, {len(moe.layers)} MoE layers"
              f"{f' beside {dense} dense' if dense else ''}{', shared experts' if moe.shared else ''}; {balance}; "
              f"experts run {implementation}", flush=True)
    return True


def active_shares(model: nn.Module) -> dict[int, float]:
    """The share of tokens each expert weight serves, by parameter ``id`` (top-k of E), for FLOP counts: a token
    runs its top-k experts, not all E. Empty for a dense model."""
    causal = causal_lm(model)
    spec = model_spec(causal.config)
    if spec.moe is None:
        return {}
    blocks = getattr(causal.get_submodule(spec.backbone) if spec.backbone else causal, spec.blocks)
    share = spec.moe.top_k / spec.moe.num_experts
    return {id(p): share for i in spec.moe.layers for p in blocks[i].get_submodule(spec.moe.experts).parameters()}


def add_balance_sums(carried: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``carried`` (``[counts (E) | router probabilities (E) | rows]``) plus one layer's: the running sums of
    transformers' ``load_balancing_loss_func``, taken layer by layer as it takes them, so that stages holding
    different layers can carry them from one to the next (it needs every layer's logits in one place, which no
    pipeline stage has). The probabilities carry their gradient; the counts come from a top-k and carry none."""
    num_experts = router_logits.shape[-1]
    weights = torch.nn.functional.softmax(router_logits, dim=-1)
    _, chosen = torch.topk(weights, top_k, dim=-1)
    if attention_mask is None:
        counts = torch.histc(chosen.reshape(-1).float(), bins=num_experts, min=0, max=num_experts)
        probs, rows = weights.float().sum(dim=0), torch.tensor([float(weights.shape[0])], device=weights.device)
    else:
        mask = attention_mask.reshape(-1).to(weights.device, torch.float32)
        counts = torch.zeros(num_experts, device=weights.device).scatter_add_(0, chosen.reshape(-1),
                                                                          mask.repeat_interleave(top_k))
        probs, rows = (weights.float() * mask.unsqueeze(-1)).sum(dim=0), mask.sum().reshape(1)
    return carried + torch.cat([counts.to(carried.device), probs.to(carried.device), rows.to(carried.device)])


def balance_loss(sums: torch.Tensor) -> torch.Tensor:
    """The balancing loss from :func:`add_balance_sums`' running sums (``load_balancing_loss_func``'s last lines)."""
    num_experts = (sums.shape[0] - 1) // 2
    rows = sums[-1]
    return torch.sum((sums[:num_experts] / rows) * (sums[num_experts:2 * num_experts] / rows)) * num_experts


def record_balance(model: nn.Module, value: float) -> None:
    """Give the run's router metrics (:class:`RouterStats`) a balancing loss computed outside the model's forward
    (a pipeline's last stage)."""
    stats = getattr(causal_lm(model), "_hftk_router_stats", None)
    if stats is not None:
        stats.aux_sum += value
        stats.aux_count += 1


def _router_logits_while_training(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if module.training:
        kwargs.setdefault("output_router_logits", True)
    return args, kwargs


class RouterStats:
    """Per-layer counts of the experts tokens were sent to, and the balancing term, while the model trains."""

    def __init__(self, model: nn.Module) -> None:
        causal = causal_lm(model)
        moe = model_spec(causal.config).moe
        self.num_experts = moe.num_experts
        self.layers = list(moe.layers)
        self.counts = torch.zeros(len(self.layers), moe.num_experts, dtype=torch.float64)
        self.aux_sum, self.aux_count = 0.0, 0
        spec = model_spec(causal.config)
        blocks = getattr(causal.get_submodule(spec.backbone) if spec.backbone else causal, spec.blocks)
        for row, index in enumerate(self.layers):
            try:
                experts = blocks[index].get_submodule(moe.experts)
            except AttributeError:  # a block another pipeline stage holds: its rank counts it
                continue
            experts.register_forward_pre_hook(self._counter(row), with_kwargs=True)
        causal.register_forward_hook(self._aux)
        causal._hftk_router_stats = self  # for balancing losses computed outside the forward (record_balance)

    def _counter(self, row: int) -> Any:
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # evaluation and generation are not training's load; nor is activation checkpointing's recompute,
            # which runs inside backward (torch has no public test for that: its graph task id is set there)
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return
            chosen = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if k != "hidden_states")
            chosen = chosen.reshape(-1)
            chosen = chosen[(chosen >= 0) & (chosen < self.num_experts)]
            self.counts[row] += torch.bincount(chosen.detach().to("cpu", torch.int64),
                                               minlength=self.num_experts).to(torch.float64)
        return count

    def _aux(self, module: nn.Module, args: tuple, output: Any) -> None:
        aux = getattr(output, "aux_loss", None)
        if module.training and isinstance(aux, torch.Tensor):
            self.aux_sum += float(aux.detach().float())
            self.aux_count += 1

    def window(self, group: Any = None) -> dict[str, Any]:
        """The logging window's metrics over every rank of ``group`` (collective), then reset."""
        totals = torch.cat([self.counts.flatten(), torch.tensor([self.aux_sum, float(self.aux_count)],
                                                                 dtype=torch.float64)])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            totals = totals.to(_device(group))
            dist.all_reduce(totals, group=group)
            totals = totals.cpu()
        counts = totals[:-2].reshape(self.counts.shape)
        aux_sum, aux_count = float(totals[-2]), float(totals[-1])
        self.counts.zero_()
        self.aux_sum, self.aux_count = 0.0, 0
        routed = counts.sum(dim=1)
        if not bool((routed > 0).any()):
            return {}
        ratio = counts.max(dim=1).values / (routed / self.num_experts).clamp(min=1e-12)
        dead = [self.layers[r] for r in range(len(self.layers)) if routed[r] > 0 and bool((counts[r] == 0).any())]
        out: dict[str, Any] = {"expert_load_max_mean": float(ratio.max())}
        if aux_count:
            out["moe_aux_loss"] = aux_sum / aux_count
        if dead:
            out["dead_expert_layers"] = dead
        return out


def _device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class RouterCallback(TrainerCallback):
    """Adds the router metrics to every training log (both engines); warns once per window about dead experts."""

    def __init__(self, stats: RouterStats) -> None:
        self.stats = stats

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs:
            return
        found = self.stats.window()
        dead = found.pop("dead_expert_layers", None)
        logs.update(found)
        if dead and state.is_world_process_zero:
            print(f"hftk: warning: dead experts: in MoE layer(s) {', '.join(map(str, dead))} some expert received no "
                  f"token in the {args.logging_steps} step(s) up to step {state.global_step}", flush=True)
