"""The causal-LM loss, bounded in memory: no rank holds the logits of all its tokens at once.

A transformers causal LM computes ``lm_head(hidden)`` for every position, then the cross-entropy: at a 152k
vocabulary the logits of 8,192 tokens are 5 GB in fp32, several times over with their float copy, softmax and
gradient. ``chunked`` runs the model's backbone, then the head, the family's logit transform and the loss over
:func:`chunk_tokens` target tokens at a time, each chunk inside a checkpoint: a chunk's logits live only while its
loss (in the backward: its gradient) is computed. The loss is the model's own: summed over the tokens whose label
is not ``-100``, divided by ``num_items_in_batch`` (the Trainer's token count over the accumulation window and, with
``average_tokens_across_devices``, the ranks) or by the batch's own count, plus the experts' balancing loss.

Written here rather than taken from TRL's ``add_fused_lm_head``: that reads ``lm_head.weight`` directly, so an
adapter on the head (LoRA on ``lm_head``, PEFT's trainable tokens) would silently drop out of the loss, and it adds
the balancing loss at the config's coefficient, not the one hftk trains with (:mod:`hftk.models.moe`). Calling the
head module keeps whatever wraps it (PEFT, ZeRO-3's gathering hooks).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hftk.models.layout import causal_lm

IMPLEMENTATIONS = ("auto", "chunked", "plain")
IGNORE_INDEX = -100  # transformers' ignore_index (ForCausalLMLoss)
CHUNK_ELEMENTS = 2**26  # logits per chunk: 256 MB in fp32 whatever the vocabulary
MIN_CHUNK_TOKENS = 16


def chunk_tokens(vocab: int) -> int:
    """Target tokens per chunk: ``CHUNK_ELEMENTS`` logits (441 tokens at a 152k vocabulary)."""
    return max(MIN_CHUNK_TOKENS, CHUNK_ELEMENTS // max(vocab, 1))


def choose(asked: str, engine: str) -> str:
    """What ``--loss_implementation`` resolves to: ``auto`` is ``chunked`` on the Trainer engine (ddp, fsdp, ZeRO);
    the custom loop (pipeline, tp, cp, sp, ep) keeps its own loss on the model's logits."""
    if asked != "auto":
        return asked
    return "chunked" if engine == "trainer" else "plain"


def logit_transform(config: Any) -> tuple[float, float | None]:
    """``(scale, softcap)`` the family applies between its head and its loss, read from its config: Cohere's
    ``logit_scale``, Granite's ``logits_scaling`` (divides), Falcon-H1's ``lm_head_multiplier``, Gemma's
    ``final_logit_softcapping`` (the fields TRL's fused head reads too)."""
    text = config.get_text_config()
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None):
        scale = 1 / text.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(text, "final_logit_softcapping", None)


def _chunk_nll_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, scale: float,
                   softcap: float | None) -> torch.Tensor:
    """Summed next-token NLL of one chunk, its logits transformed in the head's dtype as the model does, then fp32."""
    logits = head(hidden)
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_nll(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, vocab: int, scale: float = 1.0,
                softcap: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """Summed NLL of ``targets`` (``-100``: ignored) under ``head(hidden)``, ``chunk`` tokens at a time.

    Only the positions with a target are projected (a prompt-masked row costs what its answer costs). With no
    target at all the sum is a zero still connected to the head and the hidden states, as the plain loss is, so
    every rank's backward reaches the same parameters (DDP, ZeRO)."""
    flat, goal = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).to(hidden.device)
    keep = goal != IGNORE_INDEX
    picked, goal = flat[keep], goal[keep]
    if picked.shape[0] == 0:
        return _chunk_nll_sum(head, flat[:1], torch.zeros(1, dtype=torch.long, device=flat.device), scale,
                              softcap) * 0.0
    step = chunk or chunk_tokens(vocab)
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    for start in range(0, picked.shape[0], step):
        part, part_goal = picked[start:start + step], goal[start:start + step]
        if torch.is_grad_enabled():
            total = total + torch.utils.checkpoint.checkpoint(_chunk_nll_sum, head, part, part_goal, scale, softcap,
                                                              use_reentrant=False)
        else:
            total = total + _chunk_nll_sum(head, part, part_goal, scale, softcap)
    return total


def vocab_size(model: nn.Module) -> int:
    """The vocabulary of the causal LM inside ``model`` (its config follows a resize to the tokenizer)."""
    return int(causal_lm(model).config.get_text_config().vocab_size)


def install(model: nn.Module, chunk: int | None = None) -> None:
    """Make the causal LM inside ``model`` (under PEFT, DDP, ...) compute its loss chunked whenever it is given
    labels; without labels (generation, DPO's and GRPO's own log-probs) it runs as it was. Call before any sharding
    wrapper: FSDP2 and DeepSpeed call the module, whose ``forward`` this replaces."""
    causal = causal_lm(model)
    original = causal.forward
    scale, softcap = logit_transform(causal.config)
    vocab = vocab_size(causal)
    balancing = getattr(sys.modules[type(causal).__module__], "load_balancing_loss_func", None)

    @functools.wraps(type(causal).forward)  # the signature the Trainer reads (it passes num_items_in_batch)
    def forward(self: nn.Module, *args: Any, labels: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        if labels is None and shift_labels is None:
            return original(*args, **kwargs)
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False
        routed = balancing is not None and kwargs.get(
            "output_router_logits", getattr(self.config.get_text_config(), "output_router_logits", False))
        if routed:
            kwargs["output_router_logits"] = True
        out = self.base_model(*args, **kwargs)
        hidden = out.last_hidden_state
        if shift_labels is None:
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        total = chunked_nll(self.get_output_embeddings(), hidden, targets, vocab, scale, softcap, chunk)
        count = num_items_in_batch if num_items_in_batch is not None else (targets != IGNORE_INDEX).sum().clamp(min=1)
        loss = total / (count.to(total.device) if torch.is_tensor(count) else count)
        aux = None
        if routed:
            aux = balancing(out.router_logits, self.num_experts, self.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux)

    causal.forward = types.MethodType(forward, causal)


def announce(implementation: str, vocab: int, engine: str) -> str:
    """The start line: which loss runs, and what it holds."""
    if implementation == "chunked":
        tokens = chunk_tokens(vocab)
        return (f"hftk: loss chunked: {tokens} target tokens at a time (vocabulary {vocab:,}: "
                f"{tokens * vocab * 4 / 2**20:.0f} MB of fp32 logits per chunk)")
    why = " (the custom loop computes its loss on the model's logits)" if engine == "loop" else ""
    return f"hftk: loss plain: every token's logits at once{why}"
