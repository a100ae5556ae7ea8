"""What is this model: the one resolver every part of hftk asks (torchtitan's ``ModelSpec``).

Nothing here lists families. Each answer is read off transformers' own per-model metadata and the
model's module tree, built from its config on the meta device (no weights):

- the decoder's parts, in the order its forward runs them: ``base_model_pp_plan`` (embedding, blocks,
  final norm and what flows between them), else the module tree (the ``ModuleList`` of the blocks the
  model class names in ``_no_split_modules``, the parts registered before and after it);
- the LM head and whether it is tied: ``get_output_embeddings`` / ``get_input_embeddings``;
- the default LoRA targets: every linear projection inside the decoder blocks (PEFT's ``all-linear``);
- the tensor-parallel plan: ``base_model_tp_plan``, whose styles hftk applies with torch's DTensor
  styles (:data:`TP_STYLES`); hand-written only where transformers says nothing usable
  (:data:`TP_PLAN_OVERRIDES`: GPT-2, whose ``Conv1D`` layers no DTensor style shards);
- attention facts: per-layer kinds (``layer_types``, sliding windows), soft-capping, sinks.

A model whose structure cannot be derived gets a spec whose ``structure_problem`` says what is missing;
the strategies that need the structure (pipeline, tp, cp, sp) refuse it by name through
:func:`strategy_refusal`, which also says which strategies still train it.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from hftk.config.strategy_table import STRATEGIES
from hftk.config.support import Refusal
from hftk.core.errors import HftkError
from hftk.models.activations import experts_on_meta

FIELD = "model.model_name_or_path"
# Besides nn.Linear and its subclasses: module types PEFT's LoRA wraps as linear projections (transformers' Conv1D
# is GPT-2's linear layer).
LINEAR_TYPES = ("Conv1D",)
# transformers' tensor-parallel styles hftk applies (strategies/tp_plans.to_parallel_styles), by what they do:
# column- / row-parallel linear layers, the vocabulary-parallel embedding, the gathered / split variants around a
# module that needs the whole width (OLMo 2's q/k norms over the full projection, Phi-3's fused projections), and a
# replicated parameter whose gradient is a per-rank partial sum (Qwen3's per-head q/k norms).
TP_STYLES = ("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", "rowwise_split_input",
             "replicated_with_grad_allreduce")
# Where transformers' own plan is unusable for hftk, by model_type. GPT-2 ships none, and its Conv1D layers
# (weight [in, out]) defeat DTensor's linear styles: strategies/tp_plans converts them to nn.Linear first, the
# fused c_attn split into q / k / v so each is sharded by heads (names after that conversion).
TP_PLAN_OVERRIDES: dict[str, dict[str, str]] = {
    "gpt2": {
        "transformer.h.*.attn.c_attn.q": "colwise",
        "transformer.h.*.attn.c_attn.k": "colwise",
        "transformer.h.*.attn.c_attn.v": "colwise",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
    },
}
# The strategies that take the decoder apart (stages, shards of its layers, its attention, its experts); the
# Trainer's strategies (ddp, fsdp, ZeRO) train any causal LM transformers builds.
STRUCTURE_STRATEGIES = ("pipeline", "tp", "cp", "sp", "ep")


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts model's sparse parts, as paths inside a decoder block (``mlp.experts``), read off the
    modules: the experts (transformers 5 fuses them into 3-D parameters, expert dimension first; or one module
    per expert), the router whose logits transformers records (``_can_record_outputs["router_logits"]``), their
    common parent (the sparse block) and what else it holds (shared experts beside the routed ones)."""

    experts: str
    fused: bool  # one module holding [E, ...] parameters (else a ModuleList of E expert modules)
    expert_params: tuple[str, ...]  # the fused module's parameters (gate_up_proj, down_proj, their biases)
    router: str
    router_logits_index: int  # where the router's output holds its logits
    sparse_block: str
    sparse_block_class: str
    shared: tuple[str, ...]  # the sparse block's other children with weights (shared experts, their gates)
    num_experts: int
    top_k: int
    layers: tuple[int, ...]  # the blocks that have experts (dense layers first, or MoE every k-th layer)
    aux_coef: float | None  # router_aux_loss_coef when the model adds the balancing loss itself, else None
    ep_problem: str | None = None  # why expert parallel cannot split these experts over ranks (None: it can)

    @property
    def lora_target_parameters(self) -> tuple[str, ...]:
        """PEFT ``target_parameters`` for fused experts: their 3-D weights (PEFT matches names by suffix)."""
        return tuple(f"{self.experts}.{p}" for p in self.expert_params if not p.endswith("_bias")) if self.fused \
            else ()


@dataclass(frozen=True)
class ModelSpec:
    """One causal LM's structure, as names relative to the causal-LM module (``model.layers``...)."""

    family: str  # config.model_type
    name: str  # for tables: the config class's name without "Config"
    layers: int  # decoder blocks
    layer_types: tuple[str, ...]  # each block's attention kind (full_attention, sliding_attention, ...)
    source: str = ""  # where the structure came from: "base_model_pp_plan" or "module tree"
    structure_problem: str | None = None  # why the structure could not be derived (then the names below are empty)
    backbone: str = ""  # the decoder module holding the blocks (``model``, ``transformer``, ``model.decoder``)
    blocks: str = ""  # the backbone's ModuleList of decoder blocks
    block_classes: tuple[str, ...] = ()  # their classes (hybrids have two): FSDP's units
    block_returns: str = "Tensor"  # the type a block's forward returns (pipeline stages pass hidden-state tensors)
    before_blocks: tuple[str, ...] = ()  # backbone children with weights its forward runs before the blocks
    after_blocks: tuple[str, ...] = ()  # ... and after them (the final norm)
    embedding: str = ""  # the token embedding (a backbone child)
    head: str = ""  # the LM head (get_output_embeddings), relative to the causal LM
    tied: bool = False  # head and embedding share one weight
    outside: tuple[str, ...] = ()  # modules with weights outside backbone and head (none in a plain decoder LM)
    lora_targets: tuple[str, ...] = ()  # leaf names of the blocks' linear projections
    tp_plan: dict[str, str] = field(default_factory=dict)  # module pattern (from the causal LM) -> style
    tp_problem: str | None = None  # why tensor parallel cannot run
    sliding_window: int | None = None  # tokens a sliding_attention layer sees
    attention_softcap: float | None = None  # attention scores soft-capped (sdpa and the ring kernel cannot)
    attention_sinks: bool = False  # learned per-head sinks beside the scores (gpt-oss)
    # why DeepSpeed Ulysses (strategy sp) cannot take over the attention: it replaces transformers' registered
    # attention function and needs the position ids there; None when every attention layer calls it with them
    ulysses_problem: str | None = None
    # why examples packed into one row (position ids restarting per example, no attention mask: data.packing bfd)
    # would attend to each other; None when the model's masks keep them apart
    packing_problem: str | None = None
    moe: MoESpec | None = None  # mixture of experts: its sparse parts

    @property
    def has_structure(self) -> bool:
        return self.structure_problem is None


_SPECS: dict[tuple[str, bool], ModelSpec] = {}
# Config fields a loaded model may differ in from its config file (the dtype it was loaded in, the run's switches)
# and that change nothing of its structure: the spec is kept across them.
SPEC_BLIND = frozenset({"dtype", "torch_dtype", "transformers_version", "_name_or_path", "use_cache",
                        "output_router_logits"})


def model_spec(config: Any, trust_remote_code: bool = False) -> ModelSpec:
    """The :class:`ModelSpec` of the causal LM ``config`` describes (kept per config: validation, the plan and
    the strategies ask it several times in a run)."""
    described = {k: v for k, v in config.to_dict().items() if k not in SPEC_BLIND}
    key = (json.dumps(described, sort_keys=True, default=str), trust_remote_code)
    if key not in _SPECS:
        _SPECS[key] = derive(config, trust_remote_code)
    return _SPECS[key]


@contextmanager
def _outside_zero3() -> Any:
    """transformers builds every model under ZeRO-3's partitioned init once a ZeRO-3 ``TrainingArguments`` exists
    in the process (a global it keeps); a meta-device model must not be: its weight init would copy from meta."""
    from transformers.integrations import deepspeed

    saved = deepspeed._hf_deepspeed_config_weak_ref  # no public getter; set / unset are its public API
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = saved


def meta_model(config: Any, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of ``config`` on the meta device: its module tree and shapes, no memory. Its experts (MoE)
    run ``grouped_mm``, as training runs them (forwards traced under :func:`experts_on_meta`)."""
    from transformers import AutoModelForCausalLM

    # torch's meta device, not accelerate's init_empty_weights: under the latter transformers 5 leaves tied
    # embeddings untied, and a tied head would count twice.
    with torch.device("meta"), _outside_zero3():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    if any(p.ndim == 3 for p in model.parameters()):  # fused experts (dense models refuse the call)
        model.set_experts_implementation("grouped_mm")
    return model


def derive(config: Any, trust_remote_code: bool = False) -> ModelSpec:
    """Read the spec off ``config`` and the model built from it on the meta device."""
    text = config.get_text_config()
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0) or 0)
    layer_types = tuple(getattr(text, "layer_types", None) or ())
    if not layer_types and getattr(text, "sliding_window", None) is not None and _uses_sliding_window(text):
        layer_types = ("sliding_attention",) * layers
    common = dict(family=config.model_type, name=type(config).__name__.removesuffix("Config"), layers=layers,
                  layer_types=layer_types or ("full_attention",) * layers,
                  sliding_window=getattr(text, "sliding_window", None),
                  attention_softcap=getattr(text, "attn_logit_softcapping", None))
    model = meta_model(config, trust_remote_code)
    found = _structure(model, text)
    if isinstance(found, str):
        return ModelSpec(**common, structure_problem=found)
    source, backbone_name, blocks_name, before, after, returns = found
    backbone = model.get_submodule(backbone_name) if backbone_name else model
    blocks = getattr(backbone, blocks_name)
    names = {id(m): n for n, m in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    embedding_name = next((n for n in before if getattr(backbone, n) is embedding), "")
    head_name = names.get(id(head), "") if head is not None else ""
    inside = {id(p) for p in backbone.parameters()} | ({id(p) for p in head.parameters()} if head is not None else set())
    outside = _top_most({n.rsplit(".", 1)[0] for n, p in model.named_parameters() if id(p) not in inside},
                        backbone_name)
    plan, problem = _tp_plan(config, backbone_name)
    ulysses, packing = _attention_probe(config, trust_remote_code, layers)
    return ModelSpec(
        **common, source=source, backbone=backbone_name, blocks=blocks_name,
        block_classes=tuple(dict.fromkeys(type(b).__name__ for b in blocks)), block_returns=returns,
        before_blocks=before, after_blocks=after, embedding=embedding_name, head=head_name,
        tied=head is not None and embedding is not None and head.weight is embedding.weight, outside=outside,
        lora_targets=_linear_leaves(blocks, {r.target_class} if (r := _router_recorder(model)) else set()),
        tp_plan=plan, tp_problem=problem,
        attention_sinks=any(n.rsplit(".", 1)[-1] == "sinks" for n, _ in blocks.named_parameters()),
        ulysses_problem=ulysses, packing_problem=packing,
        moe=_moe(model, blocks, text),
    )


def _top_most(names: set[str], backbone: str) -> tuple[str, ...]:
    """``names`` cut to the highest module that is not the backbone or one of its ancestors."""
    keep = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if not (backbone == prefix or backbone.startswith(prefix + ".")):
                keep.add(prefix)
                break
    return tuple(sorted(keep))


def _uses_sliding_window(text: Any) -> bool:
    """Families without ``layer_types`` that window every layer when ``sliding_window`` is set (Mistral); some
    (Qwen2 / Qwen3) also need ``use_sliding_window``, and those carry ``layer_types`` in transformers 5."""
    return getattr(text, "use_sliding_window", True) is not False


def _structure(model: nn.Module, text: Any) -> tuple[str, str, str, tuple[str, ...], tuple[str, ...], str] | str:
    """(source, backbone, blocks, before, after, what a block returns), or what is missing."""
    plan = getattr(text, "base_model_pp_plan", None) or {}
    if plan:
        keys = list(plan)
        for name, module in model.named_modules():
            if all(isinstance(getattr(module, k, None), nn.Module) for k in keys):
                lists = [k for k in keys if isinstance(getattr(module, k), nn.ModuleList)]
                if len(lists) == 1:
                    i = keys.index(lists[0])
                    traced = _trace(model, module, lists[0])
                    # transformers 5's layer API, which a pp plan implies, returns the hidden states
                    returns = "Tensor" if isinstance(traced, str) else traced[1]
                    return ("base_model_pp_plan", name, lists[0], _weighted(module, keys[:i]),
                            _weighted(module, keys[i + 1:]), returns)
        return (f"its config's base_model_pp_plan names {keys}, which no module of the model holds with one block "
                "list among them")
    classes = set(getattr(model, "_no_split_modules", None) or [])
    if not classes:
        return "its config has no base_model_pp_plan and its model class names no block in _no_split_modules"
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0) or 0)
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == layers
             and len(m) > 0 and all(type(b).__name__ in classes for b in m)]
    if len(found) != 1:
        return (f"its config has no base_model_pp_plan and {len(found)} module lists (not one) hold its "
                f"{layers} blocks of {sorted(classes)}")
    path, _ = found[0]
    backbone_name, _, blocks_name = path.rpartition(".")
    backbone = model.get_submodule(backbone_name) if backbone_name else model
    traced = _trace(model, backbone, blocks_name)
    if isinstance(traced, str):
        return f"its config has no base_model_pp_plan and {traced}"
    order, returns = traced
    i = order.index(blocks_name)
    return ("module tree", backbone_name, blocks_name, _weighted(backbone, order[:i]), _weighted(backbone, order[i + 1:]),
            returns)


def _trace(model: nn.Module, backbone: nn.Module, blocks: str) -> tuple[list[str], str] | str:
    """(the order the model's forward calls the backbone's children, the type a block returns), read from one
    forward on the meta device (registration order need not be the call order: OPT registers its final norm
    before its layers); or why the forward could not run there."""
    order: list[str] = []
    returned: list[str] = []
    first = getattr(backbone, blocks)[0]
    targets = [(n, c) for n, c in backbone.named_children() if n != blocks] + [(blocks, first)]
    handles = [c.register_forward_pre_hook(lambda *_, n=n: order.append(n) if n not in order else None)
               for n, c in targets]
    handles.append(first.register_forward_hook(lambda _m, _a, out: returned.append(type(out).__name__)))
    try:
        with experts_on_meta():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"))
    except Exception as exc:  # any failure means the order is unknown, which the caller reports
        return f"its forward could not be traced on the meta device ({type(exc).__name__}: {str(exc)[:120]})"
    finally:
        for handle in handles:
            handle.remove()
    return order + [n for n, _ in targets if n not in order], (returned or ["nothing"])[0]


def _weighted(parent: nn.Module, names: list[str]) -> tuple[str, ...]:
    """The children among ``names`` that hold weights (the ones a pipeline stage owns; weightless ones, rotary
    tables and dropouts, run wherever the forward calls them)."""
    return tuple(n for n in names if any(True for _ in getattr(parent, n).parameters()))


PROBE_ATTENTION = "hftk_probe"  # an attention implementation that records how the model calls it


def _attention_probe(config: Any, trust_remote_code: bool, layers: int) -> tuple[str | None, str | None]:
    """(why the model's attention does not go through transformers' attention registry with position ids, why its
    masks do not keep packed examples apart), from one forward on the meta device through a recording attention
    implementation and recording mask makers; None where nothing is wrong."""
    import copy
    import sys
    from unittest import mock

    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls: list[bool] = []
    masks: list[bool] = []

    def record(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
               *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("position_ids") is not None)
        return sdpa_attention_forward(module, query, key, value, mask, *args, **kwargs)

    def recording(maker: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            masks.append(kwargs.get("position_ids") is not None)
            return maker(*args, **kwargs)
        return make

    ALL_ATTENTION_FUNCTIONS.register(PROBE_ATTENTION, record)
    try:
        with torch.device("meta"), _outside_zero3():
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=PROBE_ATTENTION,
                                                     trust_remote_code=trust_remote_code)
        if any(p.ndim == 3 for p in model.parameters()):  # fused experts (dense models refuse the call)
            model.set_experts_implementation("grouped_mm")
        # transformers' mask makers as the modeling module imported them (masking_utils' create_*_mask): packed
        # examples are kept apart only where they are handed the position ids
        module = sys.modules[type(model).__module__]
        makers = [name for name, value in vars(module).items() if name.startswith("create_") and
                  name.endswith("mask") and getattr(value, "__module__", "") == "transformers.masking_utils"]
        with experts_on_meta(), ExitStack() as stack:
            for name in makers:
                stack.enter_context(mock.patch.object(module, name, recording(getattr(module, name))))
            model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"),
                  position_ids=torch.arange(4, device="meta")[None])
    except Exception as exc:  # a model that cannot run this way is refused by sp, saying why
        why = f"its attention could not be traced on the meta device ({type(exc).__name__}: {str(exc)[:120]})"
        return why, why
    packing = None if masks and all(masks) else (
        "its forward builds its attention masks without the position ids, so examples packed into one row would "
        "attend to each other" if masks else "its forward builds no mask with transformers' mask makers")
    if not calls:
        return "its attention does not go through transformers' attention registry", packing
    if not all(calls):
        return "its attention layers do not receive the position ids Ulysses needs", packing
    if len(calls) != layers:
        return f"only {len(calls)} of its {layers} layers run attention through transformers' registry", packing
    return None, packing


def _linear_leaves(blocks: nn.ModuleList, exclude: set[type] = frozenset()) -> tuple[str, ...]:
    """Leaf names of every linear projection in the blocks, in the order the first block that has it lists it
    (a router's, ``exclude``, left out: adapting where tokens go is not what LoRA on a model means)."""
    seen: dict[str, None] = {}
    for block in blocks:
        for name, module in block.named_modules():
            if name and type(module) not in exclude and (isinstance(module, nn.Linear)
                                                       or type(module).__name__ in LINEAR_TYPES):
                seen.setdefault(name.rsplit(".", 1)[-1], None)
    return tuple(seen)


def _router_recorder(model: nn.Module) -> Any:
    """transformers' OutputRecorder of the router logits (its class and where its output holds them), or None."""
    for owner in (model, *model.modules()):
        record = (getattr(owner, "_can_record_outputs", None) or {}).get("router_logits")
        if record is not None and hasattr(record, "target_class"):
            return record
    return None


def _moe(model: nn.Module, blocks: nn.ModuleList, text: Any) -> MoESpec | None:
    """The sparse parts, where the blocks hold experts: fused (a module with ``num_experts`` and [E, ...]
    parameters) or one module per expert (a ModuleList of ``num_experts``)."""
    recorder = _router_recorder(model)
    found: list[tuple[int, str, nn.Module, bool]] = []
    for i, block in enumerate(blocks):
        for name, module in block.named_modules():
            count = getattr(module, "num_experts", None)
            fused = isinstance(count, int) and any(p.ndim == 3 and p.shape[0] == count
                                                   for p in module.parameters(recurse=False))
            listed = isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts" and len(module) > 1
            if fused or listed:
                found.append((i, name, module, fused))
                break
    if not found or recorder is None:
        return None
    _, experts_name, experts, fused = found[0]
    block = blocks[found[0][0]]
    router_name = next((n for n, m in block.named_modules() if isinstance(m, recorder.target_class)), "")
    parent = experts_name.rpartition(".")[0]
    sparse = block.get_submodule(parent) if parent else block
    local = {experts_name.rpartition(".")[2], router_name.rpartition(".")[2]}
    shared = tuple(f"{parent}.{n}" if parent else n for n, child in sparse.named_children()
                   if n not in local and any(True for _ in child.parameters()))
    num = experts.num_experts if fused else len(experts)
    return MoESpec(
        experts=experts_name, fused=fused,
        expert_params=tuple(n for n, _ in experts.named_parameters(recurse=False)) if fused else (),
        router=router_name, router_logits_index=recorder.index, sparse_block=parent,
        sparse_block_class=type(sparse).__name__, shared=shared, num_experts=num,
        top_k=int(getattr(text, "num_experts_per_tok", 0) or getattr(text, "top_k", 0) or 1),
        layers=tuple(i for i, *_ in found),
        aux_coef=getattr(model, "router_aux_loss_coef", None),
        ep_problem=_ep_problem(experts, fused, num),
    )


def _ep_problem(experts: nn.Module, fused: bool, num: int) -> str | None:
    """Why expert parallel cannot split ``experts`` by their first dimension and hand each rank's experts the tokens
    routed to them, or None: it needs transformers' fused experts module (every weight ``[E, ...]``, a forward
    ``(hidden_states, top_k_index, top_k_weights)`` whose experts_implementation transformers dispatches)."""
    if not fused:
        return "its experts are one module each, not transformers' fused experts module"
    if not hasattr(experts, "_is_expert_parallel"):  # set by transformers' use_experts_implementation
        return f"its experts module ({type(experts).__name__}) does not run through transformers' experts interface"
    odd = [n for n, p in experts.named_parameters() if p.ndim < 2 or p.shape[0] != num]
    if odd:
        return f"its experts module holds weights not split by expert ({', '.join(odd)})"
    return None


def _tp_plan(config: Any, backbone: str) -> tuple[dict[str, str], str | None]:
    """The tensor-parallel plan relative to the causal LM, and why tp cannot use it (None when it can)."""
    if config.model_type in TP_PLAN_OVERRIDES:
        return dict(TP_PLAN_OVERRIDES[config.model_type]), None
    raw = getattr(config.get_text_config(), "base_model_tp_plan", None) or {}
    plan = {f"{backbone}.{k}" if backbone else k: v for k, v in raw.items()}
    if not plan:
        return {}, "its config has no base_model_tp_plan"
    unknown = sorted({s for s in plan.values() if s not in TP_STYLES})
    if unknown:
        return plan, f"its base_model_tp_plan uses styles hftk does not apply ({', '.join(unknown)})"
    return plan, None


# ---- what each strategy needs of the model ----

def strategy_refusal(spec: ModelSpec, strategy: str, block_size: int | None = None) -> Refusal | None:
    """Why ``strategy`` cannot train this model, or None. ``block_size``: the run's (None: any, as the README's table
    says it). Options beyond it (the attention implementation, degrees) are the strategies' own validators'."""
    if strategy not in STRUCTURE_STRATEGIES:
        return None
    if not spec.has_structure:
        return _refuse(spec, strategy, f"hftk cannot derive its decoder structure: {spec.structure_problem}")
    if strategy == "pipeline" and spec.block_returns != "Tensor":
        return _refuse(spec, strategy, f"its blocks return a {spec.block_returns}, not the hidden-state tensor of "
                       "transformers 5's layer API that pipeline stages pass on")
    if strategy == "pipeline" and spec.outside:
        return _refuse(spec, strategy, f"it has weights outside the decoder and LM head ({', '.join(spec.outside)}), "
                       "which no pipeline stage would know where to run")
    if strategy == "ep" and spec.moe is None:
        return _refuse(spec, strategy, "it has no experts (expert parallel splits a mixture of experts' experts "
                       "over ranks)")
    if strategy == "ep" and spec.moe.ep_problem:
        return _refuse(spec, strategy, f"expert parallel cannot split its experts: {spec.moe.ep_problem}")
    if strategy == "tp" and spec.tp_problem:
        return _refuse(spec, strategy, f"it has no tensor-parallel plan hftk can apply: {spec.tp_problem}")
    if strategy in ("cp", "sp") and spec.moe is not None and spec.moe.aux_coef is not None:
        return _refuse(spec, strategy, "its router's balancing loss counts the tokens of whole sequences, and "
                       f"under {strategy} each rank routes a slice of them")
    if strategy == "cp" and (why := causal_only_problem(spec, block_size, "ring attention")):
        return _refuse(spec, strategy, why)
    if strategy == "sp":
        if spec.ulysses_problem:
            return _refuse(spec, strategy, f"DeepSpeed Ulysses cannot take over its attention: {spec.ulysses_problem}")
        if why := causal_only_problem(spec, block_size, "Ulysses (causal SDPA over the gathered sequence)"):
            return _refuse(spec, strategy, why)
    return None


def causal_only_problem(spec: ModelSpec, block_size: int | None, kernel: str) -> str | None:
    """What in the attention a plain causal kernel without a mask (``kernel``) would silently change: layers that
    are not causal attention, a sliding window shorter than the sequence, soft-capped scores, sinks."""
    kinds = sorted(set(spec.layer_types) - {"full_attention", "sliding_attention"})
    if kinds:
        return f"its {', '.join(kinds)} layers are not the causal attention {kernel} computes"
    window = spec.sliding_window
    if "sliding_attention" in spec.layer_types and (block_size is None or window is None or window < block_size):
        seen = f"shorter than data.block_size {block_size}" if block_size else "unless data.block_size <= the window"
        return f"its sliding_attention layers (window {window}) need a mask {kernel} cannot apply ({seen})"
    if spec.attention_softcap:
        return f"it soft-caps attention scores ({spec.attention_softcap}), which {kernel} cannot"
    if spec.attention_sinks:
        return f"its attention adds learned sinks, which {kernel} cannot"
    return None


def _refuse(spec: ModelSpec, strategy: str, why: str) -> Refusal:
    others = [s for s in STRATEGIES if s not in STRUCTURE_STRATEGIES]
    return Refusal(FIELD, f"{spec.name} ('{spec.family}') cannot run under strategy {strategy}: {why}.",
                   f"train it with {', '.join(others)}, which need none of its structure.")


def check_strategy(spec: ModelSpec, strategy: str, block_size: int | None = None) -> None:
    """Raise :func:`strategy_refusal`'s one line (a strategy's ``validate`` calls this)."""
    if (refusal := strategy_refusal(spec, strategy, block_size)) is not None:
        raise HftkError(refusal.field, refusal.problem, refusal.fix)
