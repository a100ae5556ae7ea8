"""Expert parallel (``ep``) for mixtures of experts, composed with FSDP2 on one device mesh (torchtitan's EP + FSDP
layout), run by hftk's custom loop.

Every rank reads its own samples (data parallel over the whole world, ``dp_shard``). The mesh is
``(dp_shard_mod_ep, ep, tp)`` with ``tp`` 1 (the ranks that share a batch: none here) and ``dp_shard`` the first
two flattened. In fixed order, from outside the model code:

1. each MoE layer's experts module (transformers' fused ``[E, ...]`` weights, :class:`hftk.models.spec.MoESpec`)
   keeps the ``E / ep`` experts of its ``ep`` rank: its weights become DTensors ``Shard(0)`` on ``ep`` (full
   shape ``[E, ...]``, so checkpoints and gathers see the whole layer) and its forward becomes transformers'
   ``EpDispatchExpertsParallel`` over ``AllToAllEP``: each (token, expert) pair goes to the expert's rank by
   all-to-all, the rank's experts run on what they received, the outputs come back by a second all-to-all and
   are weighted by the router on the rank that holds the token. No capacity limit and no token dropped: the
   math is the model's own. The router and any shared experts stay in the block;
2. when ``ep_size`` is below the world size, FSDP2 on each experts module over ``dp_shard_mod_ep`` (the ranks
   holding the same experts), its gradients divided by the whole world (torchtitan's divide factor): every
   rank's tokens reach the experts through the all-to-all, so their gradient is already the sum over the ``ep``
   group. At ``ep_size`` = world size each expert has one holder: no FSDP2 unit takes it, and its gradient is
   made the same mean after backward (``reduce_grads``);
3. FSDP2 on every decoder block and the root over ``dp_shard``, the dense parts (attention, router, shared
   experts, embeddings) sharded as under strategy fsdp.

Under LoRA the experts' adapters follow their experts (:func:`shard_experts`) and the attention adapters are
FSDP2-sharded and averaged over the world like the rest of the dense parts.

``ep_size 1`` keeps every expert on every rank's FSDP2 shard (no all-to-all): strategy fsdp's layout on this
loop, which a checkpoint of another ep size resumes from (DCP reshards the experts onto the new split).
Why hftk's own and not transformers' ``DistributedConfig(enable_expert_parallel=True)``: that one resumes from no
checkpoint, and its FSDP2 path leaves PEFT adapters un-averaged; the dispatch and the experts' local matmuls are
transformers' own.
"""

from __future__ import annotations

from typing import Any

from hftk.config.options import RunConfig
from hftk.config.support import check_lora
from hftk.core.errors import HftkError
from hftk.strategies.mesh import LOOP_DEFAULTS as MESH_LOOP_DEFAULTS
from hftk.strategies.mesh import mesh_step
from hftk.strategies.parallel_dims import check_experts, parallel_dims

MESH_DIMS = ("dp_shard_mod_ep", "ep", "tp")  # tp: the ranks sharing one batch (1: each rank reads its own)
DISPATCH = "hftk_all_to_all"  # the name hftk's counted all-to-all has in transformers' EPImplementationInterface
COMM_PREFIX = "ep_all_to_all"  # its metrics: ep_all_to_all_bytes_per_step, ep_all_to_all_per_step


def validate(cfg: RunConfig, world_size: int) -> None:
    """Degree, model and options, before any process group: a mixture of experts whose experts split evenly."""
    from hftk.models.loading import load_model_config
    from hftk.models.spec import check_strategy, model_spec
    from hftk.strategies.mesh import check_training_options

    s = cfg.strategy
    if s.fsdp_cpu_offload:
        raise HftkError("strategy.fsdp_cpu_offload", "is not supported with strategy ep.",
                        "drop it, or use strategy fsdp / zero3_offload for offloading.")
    check_lora("ep", cfg.model.lora_r)
    dims = parallel_dims(s, world_size)
    check_training_options(cfg, "ep")
    spec = model_spec(load_model_config(cfg.model), cfg.model.trust_remote_code)
    check_strategy(spec, "ep", cfg.data.block_size)
    check_experts(dims, spec.moe.num_experts)


def experts_modules(model: Any) -> list[Any]:
    """Each MoE layer's experts module of ``model`` (its spec's path inside every MoE block)."""
    from hftk.models.layout import layout as decoder_layout
    from hftk.models.moe import spec_moe

    moe = spec_moe(model)
    blocks = decoder_layout(model).blocks
    return [blocks[i].get_submodule(moe.experts) for i in moe.layers]


def experts_core(experts: Any) -> tuple[Any, list[Any]]:
    """(transformers' experts module, PEFT's ``ParamWrapper`` s around it, outermost first): under LoRA on the
    experts (``target_parameters``) the spec's path holds one wrapper per adapted weight, nested."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = []
    while isinstance(experts, ParamWrapper):
        wrappers.append(experts)
        experts = experts.base_layer
    return experts, wrappers


def shard_experts(experts: Any, ep_mesh: Any) -> tuple[Any, dict[Any, Any]]:
    """Keep this ``ep`` rank's contiguous ``E / ep`` experts, as DTensors of the whole ``[E, ...]`` (``Shard(0)``),
    with their LoRA adapters. PEFT's ``lora_A`` of an ``[E, ...]`` weight stacks ``r`` rows per expert: its rows
    are split the same way. Its ``lora_B`` interleaves the experts in its columns (``r`` blocks of ``E``), which no
    contiguous shard holds (DCP refuses a strided one): it stays whole on every ``ep`` rank (``Replicate``, a few
    KiB), each rank computing with its experts' columns and the gradient summed over the group
    (:func:`sum_over_ep`).

    Returns (transformers' experts module, its ``num_experts`` and its wrappers' now local; the replicated
    adapters as ``{lora_B module: its local view}``, what :func:`run_on_local_tensors` hands the forward)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    core, wrappers = experts_core(experts)
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    total = core.num_experts
    local = total // ep
    mine = slice(rank * local, (rank + 1) * local)

    def replace(module: Any, value: torch.Tensor, placement: Any, name: str = "weight") -> None:
        param = module._parameters[name]
        module._parameters[name] = torch.nn.Parameter(
            DTensor.from_local(value.clone(), ep_mesh, [placement], run_check=False), requires_grad=param.requires_grad)

    for name, param in list(core.named_parameters(recurse=False)):
        replace(core, param.detach()[mine], Shard(0), name)
    views = {}
    for wrapper in wrappers:
        for adapter, r in wrapper.r.items():
            a, b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
            replace(a, a.weight.detach().reshape(total, r, -1)[mine].reshape(local * r, -1), Shard(0))
            replace(b, b.weight.detach(), Replicate())
            views[b] = lambda whole, r=r: whole.reshape(whole.shape[0], r, total)[:, :, mine].reshape(whole.shape[0], -1)
        wrapper.num_experts = local
    core.num_experts = local  # the experts forward indexes local experts (transformers' MoEParamShard does this)
    return core, views


def run_on_local_tensors(experts: Any, views: dict[Any, Any]) -> None:
    """``experts``' forward (with its LoRA wrappers) on the local pieces of its DTensor weights (a replicated
    adapter: its ``views`` slice): the experts' kernels and PEFT's delta weights take plain tensors.
    transformers' own context (``_use_local_dtensor_params``) swaps one module's parameters back by name, which
    PEFT's parametrization has moved meanwhile (it registers the weight as ``parametrizations.<name>.original``
    and leaves a buffer behind when it removes itself): this one swaps the whole subtree and puts each parameter
    back wherever it went."""
    import contextlib

    from torch.distributed.tensor import DTensor

    @contextlib.contextmanager
    def local_tensors() -> Any:
        swapped = [(m, n, p) for m in experts.modules() for n, p in m._parameters.items() if isinstance(p, DTensor)]
        for module, name, param in swapped:
            local = param.to_local()  # differentiable: gradients reach the DTensor parameter
            module._parameters[name] = views[module](local) if module in views else local
        try:
            yield
        finally:
            for module, name, param in swapped:
                module._buffers.pop(name, None)
                module._parameters[name] = param

    forward = experts.forward

    def local_forward(*args: Any, **kwargs: Any) -> Any:
        with local_tensors():
            return forward(*args, **kwargs)

    experts.forward = local_forward


def counted_all_to_all(stats: Any, ep_mesh: Any) -> Any:
    """A factory for transformers' ``EPImplementationInterface``: its ``AllToAllEP``, whose all-to-all bytes
    ``stats`` (:class:`hftk.comm.accounting.CommStats`) counts. The split sizes are visible only where
    ``AllToAllEP`` combines (its ``_combine_tokens``, handed them): hftk reads them there and changes nothing.
    Per layer and forward: the counts exchange, the tokens out, the results back; backward sends the same
    bytes the other way (a recomputed forward, activation checkpointing's, counts its own)."""
    import torch
    from transformers.distributed.expert_parallel import AllToAllEP

    me, size = ep_mesh.get_local_rank(), ep_mesh.size()

    def build(experts: Any, mesh: Any, tp_mesh: Any) -> Any:
        implementation = AllToAllEP(experts, mesh, tp_mesh)
        combine = implementation._combine_tokens

        def counting(expert_output: torch.Tensor, state: Any) -> torch.Tensor:
            row = expert_output.shape[-1] * expert_output.element_size()
            out = sum(n for r, n in enumerate(state.send_sizes) if r != me) * row
            back = sum(n for r, n in enumerate(state.recv_sizes) if r != me) * row
            in_backward = torch._C._current_graph_task_id() != -1  # a recompute: its backward is counted already
            passes = 2 if torch.is_grad_enabled() and expert_output.requires_grad and not in_backward else 1
            counts = 8 * experts.num_experts * (size - 1)  # int64 per expert, to each other rank
            for _ in range(passes):
                for payload in (out, back):
                    stats.completed(stats.issued("all_to_all", payload, size))
            stats.completed(stats.issued("all_to_all", counts, size))
            return combine(expert_output, state)

        implementation._combine_tokens = counting
        return implementation

    return build


def dispatch_tokens(experts: Any, mesh: Any, stats: Any) -> None:
    """The experts' forward replaced by transformers' expert-parallel dispatch (``ep_dispatch_experts``) over
    hftk's counted ``AllToAllEP``."""
    from transformers.distributed.expert_parallel import EPImplementationInterface, EpDispatchExpertsParallel

    EPImplementationInterface.register(DISPATCH, counted_all_to_all(stats, mesh["ep"]))
    EpDispatchExpertsParallel().install_forward(experts, mesh["ep"], tp_mesh=mesh["tp"], ep_implementation=DISPATCH)


def layout(model: Any, cfg: RunConfig, device_type: str) -> Any:
    """Build the mesh, split the experts and shard the rest; say how the loop feeds and combines the ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hftk.comm.accounting import CommStats
    from hftk.comm.callback import StepCommCallback
    from hftk.comm.collectives import all_reduce_flat
    from hftk.models.layout import layout as decoder_layout
    from hftk.models.moe import spec_moe
    from hftk.strategies.fsdp import apply_fsdp
    from hftk.strategies.mesh import MeshLayout

    world = dist.get_world_size()
    dims = parallel_dims(cfg.strategy, world)
    moe = spec_moe(model)
    check_experts(dims, moe.num_experts)
    mesh, dp_mesh = _mesh(dims, device_type)
    stats = CommStats(world_size=dims.ep, arrival_timed=device_type == "cpu")
    reshard = cfg.strategy.fsdp_reshard_after_forward
    experts = experts_modules(model)
    replicated = []  # lora_B modules of the experts, whole on every ep rank
    for module in experts:
        if dims.ep > 1:
            core, views = shard_experts(module, mesh["ep"])
            dispatch_tokens(core, mesh, stats)
            run_on_local_tensors(module, views)
            replicated += list(views)
        if dims.dp_shard_mod_ep > 1:
            fully_shard(module, mesh=mesh["dp_shard_mod_ep"], reshard_after_forward=reshard)
            module.set_gradient_divide_factor(float(world))  # all ranks' tokens reached them: mean over the world
            if device_type == "cpu":  # gloo has no PREMUL_SUM: a plain sum, divided after
                module.set_force_sum_reduction_for_comms(True)
    # experts no FSDP2 unit holds (each on one rank, ep_size = world size): their gradient is the sum over every
    # rank's tokens, which the loss scale (world) makes world times the mean
    own = [p for m in experts for p in m.parameters()] if dims.dp_shard_mod_ep == 1 < dims.ep else []
    apply_fsdp(model, list(decoder_layout(model).blocks), dp_mesh, reshard, ignored=set(own) or None)
    own = [p for p in own if p.requires_grad]

    ep_group = mesh["ep"].get_group()

    def reduce_experts() -> None:
        """The replicated adapters' gradients (each rank's experts' columns) summed over the ep group; the experts
        no FSDP2 unit reduces made a mean over the world."""
        summed = [m.weight.grad.to_local() for m in replicated if m.weight.grad is not None]
        if summed:
            all_reduce_flat(summed, ep_group)
        grads = [p.grad.to_local() for p in own if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / world)

    experts_params = {id(p) for m in experts for p in m.parameters()}  # as sharded: the ones the optimizer sees
    if dist.get_rank() == 0:
        print(f"hftk: ep: {moe.num_experts // dims.ep} of {moe.num_experts} experts per rank in each of "
              f"{len(moe.layers)} MoE layers (ep groups of {dims.ep}"
              f"{f', each expert FSDP2-sharded over {dims.dp_shard_mod_ep} ranks' if dims.dp_shard_mod_ep > 1 else ''}"
              f"); tokens reach their experts by all-to-all; router{', shared experts' if moe.shared else ''} and "
              f"the dense parts FSDP2-sharded over all {world} ranks", flush=True)
    return MeshLayout(
        model=model,
        data_rank=dist.get_rank(),
        data_size=world,
        data_groups=[dp_mesh.get_group()],
        grad_scale=float(world),  # FSDP2 averages the dense gradients over the world; the experts' divide by it
        describe={"strategy": "ep", "ep_size": dims.ep, "dp_shard_size": world,
                  "dp_shard_mod_ep_size": dims.dp_shard_mod_ep, "experts_per_rank": moe.num_experts // dims.ep,
                  "num_experts": moe.num_experts, "family": model.config.model_type},
        reduce_grads=reduce_experts,
        # the experts' own groups at every degree (their mesh is ep's or, at ep_size 1, the dense parts')
        param_group=lambda param: "experts" if id(param) in experts_params else "dense",
        callbacks=[StepCommCallback(stats, COMM_PREFIX)] if dims.ep > 1 else [],
    )


def _mesh(dims: Any, device_type: str) -> tuple[Any, Any]:
    """Collective: the ``(dp_shard_mod_ep, ep, tp)`` mesh, and its first two dimensions flattened (``dp_shard``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dims.dp_shard_mod_ep, dims.ep, 1), mesh_dim_names=MESH_DIMS)
    return mesh, mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")


LOOP_DEFAULTS = MESH_LOOP_DEFAULTS  # the custom loop's defaults for options not given (engine/loop.training_overrides)


def build_step(model: Any, cfg: RunConfig, args: Any) -> Any:
    """The custom loop's step: ``model`` laid out by :func:`layout`."""
    return mesh_step(model, cfg, args, layout)

