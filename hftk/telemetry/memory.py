"""Counting what one rank really holds: bytes of parameters, gradients and optimizer state.

RSS hides sharding savings (glibc keeps freed memory, see the field notes), so sharded
strategies are judged by counting tensor bytes. Only the local part of a sharded tensor
counts (a DTensor's local shard, a ZeRO-3 partition), and a tensor reachable under several
names (tied embeddings) counts once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
from transformers import TrainerCallback

from hftk.comm.collectives import gather_objects
from hftk.telemetry.metrics import append_jsonl


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` stored on this rank: a DTensor's local shard, a ZeRO-3 parameter's
    partition (``ds_tensor``), else the tensor itself."""
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct local storage behind ``tensors`` (non-tensors are skipped)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = local_tensor(tensor)
        key = (local.untyped_storage().data_ptr(), local.storage_offset()) if local.numel() else (id(local), 0)
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def model_state_bytes(model: torch.nn.Module, optimizer: Any | None = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, plus their total.

    ``optimizer`` may be a torch optimizer or a wrapper exposing it as ``.optimizer``
    (accelerate's ``AcceleratedOptimizer``); its state tensors (e.g. AdamW's two moments and
    step counters) are counted. Gradients count only where they currently exist.
    """
    zero = zero_optimizer(optimizer)
    if zero is not None:
        return zero_state_bytes(model, zero)
    params = list(model.parameters())
    counts = {
        "params": tensor_bytes([*params, *quantization_constants(model)]),
        "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": 0,
    }
    inner = getattr(optimizer, "optimizer", optimizer)
    if inner is not None:
        counts["optimizer"] = tensor_bytes(v for state in inner.state.values() for v in state.values())
    counts["total"] = counts["params"] + counts["grads"] + counts["optimizer"]
    return counts


def quantization_constants(model: torch.nn.Module) -> Iterable[torch.Tensor]:
    """The tensors bitsandbytes keeps beside its quantized weights, outside ``parameters()``: a 4-bit
    layer's ``quant_state`` (absmax, code, offset, and the double-quantized absmax's own state) and an
    8-bit weight's per-row scales (``SCB``)."""
    for module in model.modules():
        # The registered weight only: PEFT's trainable-tokens wrapper computes a ``.weight`` (on shards, it fails)
        weight = module._parameters.get("weight")
        state = getattr(module, "quant_state", None) or getattr(weight, "quant_state", None)
        while state is not None and not isinstance(state, torch.Tensor):
            yield from (getattr(state, key, None) for key in ("absmax", "code", "offset"))
            state = getattr(state, "state2", None)
        yield getattr(weight, "SCB", None)


# ---- DeepSpeed ZeRO: what a rank holds lies outside model.parameters() ----

def zero_optimizer(optimizer: Any) -> Any:
    """DeepSpeed's ZeRO optimizer under accelerate's wrapper, or None."""
    while optimizer is not None:
        if type(optimizer).__module__.startswith("deepspeed.runtime.zero"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def zero_state_bytes(model: torch.nn.Module, zero: Any) -> dict[str, int]:
    """This rank's bytes under a ZeRO optimizer (stage 1, 2 or 3, offloaded or not).

    - params: ZeRO-3 partitions (``ds_tensor``) plus whatever is gathered or kept whole (small
      parameters under the persistence threshold); ZeRO-1/2 parameters are views into flat buffers.
    - optimizer: the fp32 master partition the inner torch optimizer steps (when it is not the
      parameter partition itself, as in fp32 ZeRO-3) and its state.
    - grads: gradients on parameters and masters, plus every other tensor the ZeRO optimizer
      holds (gradient partitions, reduce buckets).

    DeepSpeed's flat buffers overlap the views into them, so bytes are the union of byte ranges.
    """
    ranges = ByteRanges()
    params = list(model.parameters())
    # local_tensor maps a ZeRO-3 parameter to its partition; .data is what is gathered or kept whole
    counts = {"params": ranges.add([*params, *(p.data for p in params)])}
    inner = zero.optimizer
    # ZeRO-3 empties the inner param groups between sub-group steps; the masters live on the optimizer
    masters = [*(p for group in inner.param_groups for p in group["params"]),
               *getattr(zero, "fp32_partitioned_groups_flat", []), *getattr(zero, "single_partition_of_fp32_groups", [])]
    counts["optimizer"] = ranges.add([*masters, *(v for state in inner.state.values() for v in state.values())])
    counts["grads"] = ranges.add([*(p.grad for p in [*params, *masters] if p.grad is not None),
                                  *_tensors_held(zero)])
    counts["total"] = counts["params"] + counts["grads"] + counts["optimizer"]
    return counts


class ByteRanges:
    """The union of memory ranges covered by tensors: a buffer and its views count once."""

    def __init__(self) -> None:
        self.covered: dict[int, list[tuple[int, int]]] = {}  # storage address -> disjoint [start, end)

    def add(self, tensors: Iterable[Any]) -> int:
        """Bytes of ``tensors`` not covered before (non-tensors and empty tensors are skipped)."""
        new = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            local = local_tensor(tensor)
            if local.numel() == 0:
                continue
            size = local.element_size()
            start = local.storage_offset() * size
            new += self._cover(local.untyped_storage().data_ptr(), start, start + local.numel() * size)
        return new

    def _cover(self, storage: int, start: int, end: int) -> int:
        spans = self.covered.setdefault(storage, [])
        uncovered = end - start - sum(max(0, min(end, e) - max(start, s)) for s, e in spans)
        merged = [(start, end)]
        for s, e in spans:
            if e < merged[0][0] or s > merged[0][1]:
                merged.append((s, e))
            else:
                merged[0] = (min(s, merged[0][0]), max(e, merged[0][1]))
        spans[:] = merged
        return uncovered


def _tensors_held(obj: Any, depth: int = 2) -> Iterable[torch.Tensor]:
    """Tensors in an object's attributes, lists and dicts, ``depth`` levels down (modules skipped)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth < 0:
        return
    if isinstance(obj, dict):
        values: Iterable[Any] = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        values = vars(obj).values()
    else:
        return
    for value in values:
        yield from _tensors_held(value, depth - 1)


def parameter_elements(model: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank stores, elements of the whole model); a tied parameter counts once."""
    params = list(model.parameters())  # parameters() already yields a shared parameter once
    return sum(local_tensor(p).numel() for p in params), sum(getattr(p, "ds_numel", p.numel()) for p in params)


class ModelStateCallback(TrainerCallback):
    """Once, right after the first optimizer step (gradients and optimizer state both exist),
    gathers every rank's :func:`model_state_bytes` and stored parameter elements to rank 0,
    which appends them to the metrics file as ``{"step", "model_state": [per rank]}``.

    The evidence behind "fsdp / ZeRO-3 really shard": counted bytes, not RSS.
    """

    def __init__(self, metrics_path: Path) -> None:
        self.metrics_path = metrics_path
        self.done = False

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                          **kwargs: Any) -> None:
        if self.done or model is None:
            return
        self.done = True
        local, full = parameter_elements(model)
        rows = gather_objects({**model_state_bytes(model, optimizer), "param_elements": local,
                               "param_elements_full": full})
        if state.is_world_process_zero:
            append_jsonl(self.metrics_path, {"step": state.global_step + 1, "model_state": rows})
