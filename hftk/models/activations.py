"""What autograd keeps for backward, read from the model's own forward on the meta device.

A formula per layer (Korthikanti et al.'s ``34 b s h + 5 a s^2 b``) misses what a family really
saves (GPT-2's tanh GELU keeps four 4h-wide tensors, Llama's RMSNorm an fp32 copy) and assumes
eager attention's score matrices, which SDPA's fused kernels and flash attention never keep. So
hftk runs one forward with labels on the meta device (shapes only, no memory, no compute), counts
the bytes of every distinct storage autograd saves (``saved_tensors_hooks``; parameters excluded)
and fits ``bytes = alpha * s + gamma * s^2`` per sequence from two lengths (two more past a sliding window,
where the sliding layers' masks begin). The attention the run
will use decides the trace: ``eager`` runs as written; every other implementation (``sdpa``,
``flash_attention_2``, ...) is traced through torch's fused flash kernel, which keeps q, k, v, the
output and the log-sum-exp (torch's meta device would otherwise pick SDPA's math path, which keeps
the scores). Not modelled, both CPU-only: SDPA with a padding mask also keeps the mask (``b s^2``
bytes, once), and SDPA with attention dropout runs the math path, which keeps the scores.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

TRACE_LENGTHS = (16, 32)


@contextmanager
def experts_on_meta() -> Any:
    """Mixtures of experts traced as ``grouped_mm`` runs them (the implementation hftk picks), on the meta
    device: torch's grouped GEMM has a meta kernel only for bf16, so transformers' own fallback op, which keeps
    the same tensors for backward (the expert-sorted inputs) in any dtype, stands in for it meanwhile."""
    from unittest import mock

    from transformers.integrations import moe

    with mock.patch.object(moe, "_can_use_grouped_mm", lambda *args: False):
        yield  # two sequence lengths fix alpha and gamma exactly
SCORE_KEEPING = ("eager",)  # attention implementations that keep the (b, a, s, s) probabilities


@dataclass(frozen=True)
class Fit:
    """Bytes per sequence of length s: ``alpha * s + gamma * s^2``; past a sliding window (``window``), where
    the sliding layers' masks come into being (SDPA then keeps what its masked path keeps), the fit ``beyond``."""

    alpha: float
    gamma: float
    window: int | None = None
    beyond: "Fit | None" = None

    def at(self, seq_len: int) -> float:
        if self.beyond is not None and self.window is not None and seq_len > self.window:
            return self.beyond.at(seq_len)
        return self.alpha * seq_len + self.gamma * seq_len**2


@dataclass(frozen=True)
class SavedActivations:
    """One (dtype, attention) trace: what the model keeps, in whole and under activation checkpointing."""

    total: Fit  # everything autograd keeps, the loss's fp32 log-probabilities included
    checkpointed: Fit  # under activation checkpointing: what lies outside the blocks + every block's inputs
    largest_block: Fit  # what one block keeps: recomputed at once in backward under checkpointing
    head_and_loss: Fit  # what the LM head, the logit transform and the loss keep (in total and checkpointed): the
    #                     chunked loss (hftk.models.loss) keeps none of it, its chunks recompute their logits


def trace_key(dtype_is_16bit: bool, attention: str) -> str:
    return f"{'16bit' if dtype_is_16bit else 'float32'}/{'eager' if attention in SCORE_KEEPING else 'fused'}"


def profile(model: torch.nn.Module, blocks: list[torch.nn.Module], window: int | None = None
            ) -> dict[str, SavedActivations]:
    """Every (dtype, attention) trace of a meta-device model (it is cast to bf16 and back: meta holds no data);
    ``blocks``: its decoder blocks (:func:`hftk.models.layout.block_modules`); ``window``: its sliding layers'
    window, past which a second pair of lengths is traced."""
    result = {}
    regimes = [TRACE_LENGTHS] + ([(window + TRACE_LENGTHS[0], window + TRACE_LENGTHS[1])] if window else [])
    for half in (False, True):
        model.to(torch.bfloat16 if half else torch.float32)
        for attention in ("eager", "sdpa"):
            fits = []
            for lengths in regimes:
                points = [_trace(model, blocks, s, attention) for s in lengths]
                fits.append([_fit(lengths, [p[i] for p in points]) for i in range(4)])
            if window:
                fits[0] = [Fit(f.alpha, f.gamma, window, beyond) for f, beyond in zip(*fits)]
            result[trace_key(half, attention)] = SavedActivations(*fits[0])
    model.to(torch.float32)
    return result


def _fit(lengths: tuple[int, int], values: list[int]) -> Fit:
    (s1, s2), (v1, v2) = lengths, values
    gamma = (v2 / s2 - v1 / s1) / (s2 - s1)
    return Fit(alpha=v1 / s1 - gamma * s1, gamma=gamma)


def _trace(model: torch.nn.Module, blocks: list[torch.nn.Module], seq_len: int, attention: str
           ) -> tuple[int, int, int, int]:
    """(total, checkpointed, largest block, head and loss) bytes kept for backward by one sequence of ``seq_len``."""
    # A storage's identity: meta tensors have no data pointer, so the StorageImpl address (``_cdata``) names it.
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    outside: dict[int, int] = {}
    block_inputs: dict[int, int] = {}
    per_block: list[dict[int, int]] = []
    current: list[dict[int, int] | None] = [None]  # the block being run, None outside every block
    head_on: dict[int, int] = {}  # what is kept from the LM head's forward on (the last thing before the loss)
    # Every storage counted stays alive until the trace ends: a block input autograd does not keep would
    # otherwise be freed and its address reused by a later storage, which would then go uncounted.
    counted: list[torch.Tensor] = []

    def keep(into: dict[int, int], tensor: torch.Tensor) -> None:
        counted.append(tensor)
        storage = tensor.untyped_storage()
        if storage._cdata not in params:
            into.setdefault(storage._cdata, storage.nbytes())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        keep(outside if current[0] is None else current[0], tensor)
        return tensor

    def enter(module: Any, args: Any, kwargs: Any) -> None:  # a checkpoint keeps the block's tensor inputs
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                keep(block_inputs, leaf)
        per_block.append({})
        current[0] = per_block[-1]

    def leave(*_: Any) -> None:
        current[0] = None

    def head(*_: Any) -> None:
        current[0] = head_on

    handles = [b.register_forward_pre_hook(enter, with_kwargs=True) for b in blocks]
    handles.append(model.get_output_embeddings().register_forward_pre_hook(head))
    handles += [b.register_forward_hook(leave) for b in blocks]
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager" if attention in SCORE_KEEPING else "sdpa")
        fused = nullcontext() if attention in SCORE_KEEPING else _FlashOnMeta()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fused, experts_on_meta():
            model.train()(input_ids=ids, labels=ids)
    finally:
        model.set_attn_implementation(previous)
        for h in handles:
            h.remove()
    everything = {k: v for part in (outside, head_on, *per_block) for k, v in part.items()}
    return (sum(everything.values()), sum({**outside, **head_on, **block_inputs}.values()),
            max((sum(b.values()) for b in per_block), default=0), sum(v for k, v in head_on.items() if k not in outside))


class _FlashOnMeta(TorchFunctionMode):
    """Route SDPA to torch's flash kernel, which has a meta implementation and keeps what flash keeps
    (grouped key / value heads as given: the meta kernel takes them, as flash and SDPA's GQA do)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        attn_mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
            attn_mask=attn_mask, scale=kwargs.get("scale"))
        return out
