"""Per-rank worker of ``hftk bench pipeline`` (``-m hftk.bench.pipeline_worker spec.json`` under torchrun).

One GPT-2-shaped model is cut into stages with :mod:`hftk.strategies.pipeline` once per (schedule,
micro-batch count); the configurations take turns step by step (A B C A B C ...), so that other load
falls on all alike. Per step the rank records its start and end (after a barrier) and, for every
forward, loss and backward it runs, the wall-clock interval and the CPU time of its thread.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hftk.bench.worker import teardown, write_json
from hftk.config.options import StrategyConfig
from hftk.strategies import pipeline

Event = list[Any]  # [kind "F"|"L"|"B", stage index, micro-batch, wall start, wall end, thread CPU seconds]


def invalid(schedule: str, microbatches: int, pp_size: int) -> str | None:
    """Why torch cannot run this combination (the same rules hftk's validation applies)."""
    if schedule == "1f1b" and microbatches < pp_size:
        return f"1F1B needs M >= P (torch's Schedule1F1B); with M={microbatches} it is GPipe"
    rounds = max(1, microbatches // pp_size)
    if schedule == "interleaved_1f1b" and microbatches % rounds:
        return f"interleaved 1F1B needs M to be a multiple of its {rounds} rounds"
    return None


def _timed(fn: Callable[..., Any], kind: str, stage: int, events: list[Event], mb_arg: int) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cpu, start = time.thread_time(), time.perf_counter()
        out = fn(*args, **kwargs)
        events.append([kind, stage, int(args[mb_arg]), start, time.perf_counter(), time.thread_time() - cpu])
        return out

    return wrapper


def instrument(rt: pipeline.PipelineRuntime, events: list[Event]) -> None:
    """Wrap each stage's forward / backward and the schedule's loss (instance attributes, no subclass)."""
    for stage in rt.pipe_stages:
        stage.forward_one_chunk = _timed(stage.forward_one_chunk, "F", stage.stage_index, events, 0)
        stage.backward_one_chunk = _timed(stage.backward_one_chunk, "B", stage.stage_index, events, 0)
    compute_loss = rt.schedule._maybe_compute_loss  # the schedule's own hook: (stage, output, targets, mb, ...)

    def timed_loss(stage: Any, *args: Any, **kwargs: Any) -> Any:
        if not stage.is_last:  # called for every stage; only the last computes a loss
            return compute_loss(stage, *args, **kwargs)
        return _timed(lambda *a, **k: compute_loss(stage, *a, **k), "L", stage.stage_index, events, 2)(*args, **kwargs)

    rt.schedule._maybe_compute_loss = timed_loss


def model_from(spec: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=spec["vocab_size"], n_layer=spec["n_layer"], n_embd=spec["n_embd"],
                        n_head=spec["n_head"], n_positions=spec["block_size"], bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    topo = pipeline.topology(pp, device)
    configs, records = [], []
    for schedule in spec["schedules"]:
        for m in spec["microbatches"]:
            record: dict[str, Any] = {"schedule": schedule, "microbatches": m, "steps": []}
            records.append(record)
            if reason := invalid(schedule, m, pp):
                record["skipped"] = reason
                continue
            scfg = StrategyConfig(strategy="pipeline", pp_size=pp, pp_microbatches=m, pp_schedule=schedule,
                                  pp_virtual_stages=spec["virtual_stages"])
            # a model per configuration: build_runtime drops the other ranks' parts from the model it cuts
            rt = pipeline.build_runtime(model_from(spec).to(device), scfg, topo)
            events: list[Event] = []
            instrument(rt, events)
            ids = torch.randint(0, spec["vocab_size"], (m * spec["rows_per_microbatch"], spec["block_size"]),
                                generator=torch.Generator().manual_seed(m))
            batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
            record["stages"] = rt.num_stages
            configs.append((rt, events, batch, record))
    for step in range(spec["warmup"] + spec["steps"]):
        for rt, events, batch, record in configs:
            events.clear()
            dist.barrier()
            start = time.perf_counter()
            pipeline.forward_backward(rt, batch, torch.tensor(float(batch["labels"].numel()), device=device))
            if use_cuda:
                torch.cuda.synchronize()
            end = time.perf_counter()
            for _, p in rt.params:
                p.grad = None
            if step >= spec["warmup"]:
                record["steps"].append({"start": start, "end": end, "events": list(events)})
    write_json(Path(spec["out"]) / f"rank{rank}.json", {"rank": rank, "records": records})
    teardown()
    return 0


if __name__ == "__main__":
    from hftk.core.teardown import exit_without_teardown

    exit_without_teardown(main(sys.argv[1]))  # skips gloo's teardown abort
