"""Context parallel (``strategy cp``): torch's ring attention, each rank holding 1/cp of every sequence.

The ``cp`` mesh dimension lives in :mod:`hftk.strategies.tensor`'s mesh
``(dp_replicate, dp_shard, cp, tp)``; this module holds what is particular to it, applied from
outside the model code:

- **Load-balanced sequence shards.** A causal sequence is cut into ``2 cp`` chunks and rank ``r``
  keeps chunks ``r`` and ``2 cp - 1 - r`` (torch's head-tail balancing, which its ring attention
  assumes), for input ids, position ids and the labels shifted on the WHOLE sequence first.
  Position ids travel with the tokens, so rotary and learned position tables see true positions.
- **Attention without a mask.** Ring attention only knows ``is_causal``: hftk registers its own
  attention implementation with transformers (:data:`ATTENTION`), SDPA that drops the mask and
  is always causal, and for which transformers builds no ``S x S`` mask at all. Models whose
  layers need a stricter mask (sliding windows shorter than the block, other layer kinds), soft-capped
  scores or sinks are refused (:func:`hftk.models.spec.causal_only_problem`): dropping them would change them.
- **Ring attention.** Inside :func:`ring_attention_context` torch redirects
  ``scaled_dot_product_attention`` to its ring implementation on the ``cp`` group (K/V blocks
  passed around the ring, partial results merged by log-sum-exp) for forward and backward.
  torch registers it for the flash, memory-efficient and cuDNN kernels (GPU); hftk adds the
  CPU flash kernel to the same ring (:func:`register_cpu_kernel`), which is how the whole path
  is tested here against one process.

The ranks of one ``cp`` group read the same samples; FSDP2 shards the parameters over
``dp_shard x cp`` (they hold the same model), whose gradient averaging the loop's loss scale undoes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from hftk.config.options import RunConfig
from hftk.config.support import check_packing
from hftk.core.errors import HftkError
from hftk.models.spec import check_strategy, model_spec

ATTENTION = "hftk_ring"  # transformers attention implementation registered by :func:`register_attention`
SEQUENCE_KEYS = ("input_ids", "position_ids", "shift_labels")
RING_INTERNALS = ("_templated_ring_attention", "_templated_ring_attention_backward", "custom_ops", "_cp_options",
                  "_enable_context_parallel_dispatcher_impl", "_disable_context_parallel_dispatcher_impl")
DROPOUT_FIELDS = ("attn_pdrop", "attention_dropout")


def validate(cfg: RunConfig, model_config: Any, cp: int, device: str) -> None:
    """What ring attention needs of the model, the data and torch; before any process group."""
    if cfg.data.packing not in ("auto", "concat"):  # auto: resolved (and refused if not concat) with the data
        check_packing("cp", cfg.data.packing, cfg.model.attn_implementation)
    if cfg.data.block_size % (2 * cp):
        raise HftkError("data.block_size", f"{cfg.data.block_size} tokens do not split into {2 * cp} equal chunks "
                        f"(2 x cp_size, for causal load balancing).", f"choose a block_size divisible by {2 * cp}.")
    if cfg.model.attn_implementation not in (None, "sdpa"):
        raise HftkError("model.attn_implementation", f"'{cfg.model.attn_implementation}' is not supported with "
                        "context parallel (torch's ring attention replaces SDPA).", "use sdpa or leave it unset.")
    check_strategy(model_spec(model_config, cfg.model.trust_remote_code), "cp", cfg.data.block_size)
    try:
        ring = _ring_module()
    except ImportError:
        ring = None
    missing = [name for name in RING_INTERNALS if not hasattr(ring, name)]
    if missing:
        raise HftkError("strategy.cp_size", f"torch {torch.__version__} lacks the ring-attention internals hftk "
                        f"drives ({', '.join(missing)}).", "install torch 2.13 or newer, or use strategy sp.")
    dropout = {name: getattr(model_config, name) for name in DROPOUT_FIELDS if getattr(model_config, name, 0)}
    if device == "cpu" and dropout:
        raise HftkError("model.model_dropout", f"attention dropout {dropout} is not supported by the CPU ring "
                        "attention (its kernel has no dropout).", "pass --model_dropout 0.")


def _ring_module() -> Any:
    """torch's ring-attention module (private: :func:`validate` checks the names hftk uses)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def register_attention() -> None:
    """Make :data:`ATTENTION` a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, causal_sdpa)


def causal_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal SDPA without a mask, the only form ring attention takes; (batch, seq, heads, dim) out.

    transformers builds no mask for an implementation it has no mask function for, so
    ``attention_mask`` is None here; :func:`validate` refuses unpacked (padded) data. Grouped K/V
    heads are repeated here rather than left to SDPA's ``enable_gqa``, which the ring's kernels
    need not support. What would change the scores and cannot go through the ring is refused.
    """
    from transformers.integrations.sdpa_attention import repeat_kv

    changes = {name: kwargs[name] for name in ("softcap", "s_aux", "position_bias", "sliding_window")
               if kwargs.get(name) is not None}
    if attention_mask is not None or changes:
        raise HftkError("strategy.cp_size", f"this model's attention needs {sorted(changes) or ['a mask']}, which "
                        "ring attention cannot apply.", "use strategy tp or sp for this model.")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                                           is_causal=True)
    return out.transpose(1, 2).contiguous(), None


def use_ring_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to :data:`ATTENTION` (not saved with the config: exported folders load with the default)."""
    register_attention()
    model.set_attn_implementation(ATTENTION)


def head_tail_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions rank ``rank`` keeps: chunk ``rank`` and chunk ``2 cp - 1 - rank`` of ``2 cp`` equal chunks.

    Early positions attend to few keys and late ones to many; pairing them gives every rank the
    same causal work, and it is the layout torch's ring attention assumes with load balancing on.
    """
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def shard_sequences(batch: dict[str, torch.Tensor], cp: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's tokens of every sequence (packed blocks: the all-ones attention mask is dropped)."""
    index = head_tail_indices(batch["input_ids"].shape[1], cp, rank).to(batch["input_ids"].device)
    return {key: batch[key].index_select(1, index).contiguous() for key in SEQUENCE_KEYS}


@contextlib.contextmanager
def ring_attention_context(cp_mesh: Any) -> Iterator[None]:
    """SDPA calls inside (forward and backward) run torch's ring attention over ``cp_mesh``."""
    ring = _ring_module()
    if cp_mesh.device_type == "cpu":
        register_cpu_kernel()
    balanced = ring._cp_options.enable_load_balance
    ring._cp_options.enable_load_balance = True  # the head-tail layout of :func:`shard_sequences`
    ring._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=cp_mesh)
    try:
        yield
    finally:
        ring._disable_context_parallel_dispatcher_impl()
        ring._cp_options.enable_load_balance = balanced


# ---------------------------------------------------------------- the CPU kernel in torch's ring


def register_cpu_kernel() -> None:
    """Run torch's ring attention with the CPU flash kernel too (torch registers only GPU kernels).

    The ring itself -- K/V rotation, causal skipping, load-balanced chunks, log-sum-exp merging,
    the backward's gradient rotation -- is torch's; hftk only hands it the CPU kernel's forward
    and backward, whose outputs (``out``, ``logsumexp``) have the layout of the flash kernel's.
    """
    aten = torch.ops.aten
    ring = _ring_module()
    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _cpu_ring_forward
    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _cpu_ring_backward


def _cpu_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)


def _cpu_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool,
                            scale: float | None = None) -> tuple[torch.Tensor, ...]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)


def _check_plain(dropout_p: float, attn_mask: Any) -> None:
    if dropout_p or attn_mask is not None:
        raise HftkError("strategy.cp_size", "the CPU ring attention takes neither dropout nor a mask.",
                        "pass --model_dropout 0 and keep packing on.")


def _cpu_ring_forward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)`` on shards."""
    from torch.distributed.tensor import DTensor, Shard

    query, key, value = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    _check_plain(dropout_p, kwargs.get("attn_mask"))
    mesh = query.device_mesh
    out, logsumexp = _ring_module()._templated_ring_attention(
        mesh.get_group(), 2, _cpu_attention, query=query.to_local(), key=key.to_local(), value=value.to_local(),
        is_causal=is_causal, scale=kwargs.get("scale"))
    return (DTensor.from_local(out, mesh, query.placements, run_check=False),
            DTensor.from_local(logsumexp, mesh, [Shard(2)], run_check=False))


def _cpu_ring_backward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``..._for_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)``."""
    from torch.distributed.tensor import DTensor

    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    _check_plain(dropout_p, kwargs.get("attn_mask"))
    mesh = query.device_mesh
    grads = _ring_module()._templated_ring_attention_backward(
        mesh.get_group(), 2, _cpu_attention_backward, grad_out=grad_out.to_local(), grad_out_name="grad_out",
        query=query.to_local(), key=key.to_local(), value=value.to_local(), out=out.to_local(),
        logsumexp=logsumexp.to_local(), is_causal=is_causal, scale=kwargs.get("scale"))
    return tuple(DTensor.from_local(g, mesh, t.placements, run_check=False) for g, t in zip(grads, (query, key, value)))
