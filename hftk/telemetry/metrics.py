"""Run metrics: step time, tokens/s, samples/s, perplexity, written to a JSON-lines file.

The callback works with the Trainer; hftk's own loops call :func:`append_jsonl` directly.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from hftk.core import startup


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


class MetricsCallback(TrainerCallback):
    """Adds throughput (and eval perplexity) to every log and appends it to ``metrics_file`` on rank 0.

    ``flops_per_step`` (all ranks) and ``peak_flops`` (sum of the devices' peaks) add MFU; they
    are None on CPU, where no meaningful peak exists.
    """

    def __init__(self, metrics_path: Path, tokens_per_step: int, samples_per_step: int,
                 flops_per_step: float | None = None, peak_flops: float | None = None, perplexity: bool = True) -> None:
        self.metrics_path = metrics_path
        self.perplexity = perplexity  # False where the loss is not a token cross-entropy (DPO's pairwise loss)
        self.tokens_per_step = tokens_per_step
        self.samples_per_step = samples_per_step
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self._step_start = 0.0
        self._window_time = 0.0
        self._window_steps = 0
        self._started = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._window_time += time.perf_counter() - self._step_start
        self._window_steps += 1
        if not self._started:  # this process's first optimizer step: its start-up is over
            self._started = True
            startup.mark("first_step")
            if state.is_world_process_zero:
                seconds = startup.report()
                print(startup.line(seconds), flush=True)
                append_jsonl(self.metrics_path, {"step": state.global_step, "startup": seconds})

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is None:
            return
        if "loss" in logs and self._window_steps:
            step_time = self._window_time / self._window_steps
            logs.update(step_time_s=step_time, tokens_per_s=self.tokens_per_step / step_time,
                        samples_per_s=self.samples_per_step / step_time)
            if self.flops_per_step and self.peak_flops:
                logs["mfu"] = self.flops_per_step / step_time / self.peak_flops
            self._window_time, self._window_steps = 0.0, 0
        if "eval_loss" in logs and self.perplexity:
            logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 50.0))
        if state.is_world_process_zero:
            append_jsonl(self.metrics_path, {"step": state.global_step, "epoch": state.epoch, **logs})


def parameter_digest(model: Any) -> str:
    """sha256 over every parameter's bytes, in name order: equal digests mean bitwise-equal replicas."""
    digest = hashlib.sha256()
    named = sorted(model.named_parameters(), key=lambda item: item[0])
    with _gathered_zero3([param for _, param in named]):
        for name, param in named:
            tensor = param.detach()
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            digest.update(name.encode())
            digest.update(tensor.to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _gathered_zero3(params: list[Any]) -> Any:
    """ZeRO-3 leaves each rank an empty placeholder per parameter: gather the real values first."""
    if not any(hasattr(p, "ds_id") for p in params):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class SyncCheckCallback(TrainerCallback):
    """Every ``every`` steps, all-gathers each rank's parameter digest; logs ``ranks_in_sync``.

    Replicas must hold bitwise-equal weights: a data-parallel run whose replicas drift apart trains
    garbage without an error. ``replica_key`` groups the ranks that must agree (the custom loop: one
    group per pipeline stage); by default all of them (DDP, DeepSpeed ZeRO after gathering).
    ``module``: what to digest when the engine hands the callbacks no model (pipeline stages).
    """

    def __init__(self, every: int, metrics_path: Path, replica_key: Any = None, module: Any = None) -> None:
        self.every = every
        self.metrics_path = metrics_path
        self.replica_key = replica_key
        self.module = module

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        from hftk.comm.collectives import gather_objects

        if state.global_step % self.every:
            return
        digests = gather_objects((self.replica_key, parameter_digest(self.module if self.module is not None
                                                                      else model)))
        if state.is_world_process_zero:
            groups: dict[Any, set[str]] = {}
            for key, digest in digests:
                groups.setdefault(key, set()).add(digest)
            append_jsonl(self.metrics_path, {"step": state.global_step,
                                             "ranks_in_sync": all(len(g) == 1 for g in groups.values()),
                                             "param_digests": [digest for _, digest in digests]})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def logged_eval(log_history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The evaluation logged at ``step`` (its ``eval_*`` values), empty if there was none: the engines take
    the final weights' evaluation from here instead of evaluating them twice."""
    logged = [h for h in log_history if "eval_loss" in h and h.get("step") == step]
    return {k: v for k, v in logged[-1].items() if k.startswith("eval_")} if logged else {}
