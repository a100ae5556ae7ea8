"""The process every rank of a bench launch runs: ``python -m hftk.bench.worker SPEC.json``, in one of
three modes (``spec["mode"]``):

- ``trainer``: hftk's own engine (``hftk.engine.trainer.build_trainer``, the path ``hftk train``
  takes, monitoring callbacks included) for the given ``hftk train`` argv;
- ``hand``: a hand-written Accelerate loop with the same model, data, batch, optimizer, schedule
  and clipping (the baseline of ``hftk bench overhead``);
- ``batch``: several Trainer runs in one process group, one per (micro-batch, accumulation) trial,
  each with its peak memory (``hftk bench batch``).

Each rank writes ``rank{R}.json`` into ``spec["out"]``: per optimizer step its wall time (end of
the previous step to end of this one), its process CPU time, and the logged loss; ``trainer`` runs
add the tokens this rank's batches computed / held / labelled, the peak memory and the held-out loss.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hftk.comm.collectives import gather_objects


class StepClock(TrainerCallback):
    """Wall and CPU time of each optimizer step, end to end (data loading and waits included). As a
    Trainer callback it restarts at train begin, ticks at each step end and takes losses and peaks from the logs."""

    def __init__(self) -> None:
        self.on_train_begin()

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self.steps: list[dict[str, float]] = []
        self.peak_mem_mb: list[float] = []  # rank 0: the monitor's per-window peak, max over ranks
        self._last = (time.perf_counter(), time.process_time())

    def tick(self, loss: float | None = None) -> None:
        now = (time.perf_counter(), time.process_time())
        self.steps.append({"wall_s": now[0] - self._last[0], "cpu_s": now[1] - self._last[1],
                           "loss": math.nan if loss is None else loss})
        self._last = now

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.tick()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs and self.steps:
            self.steps[-1]["loss"] = float(logs["loss"])
        if logs and "peak_mem_mb_max" in logs:
            self.peak_mem_mb.append(float(logs["peak_mem_mb_max"]))


class TokenCount:
    """Wraps the run's collator: tokens computed (batch shape), real (not padding) and labelled (predicted:
    labels after the first position not -100), over every training batch this rank built."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.counts = {"computed": 0, "real": 0, "labelled": 0}

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collate(examples)
        self.counts["computed"] += batch["input_ids"].numel()
        self.counts["real"] += sum(len(e["input_ids"]) for e in examples)  # the rows as built, before padding
        self.counts["labelled"] += int((batch["labels"][..., 1:] != -100).sum())
        return batch


def run_trainer(argv: list[str]) -> dict[str, Any]:
    """One training run through hftk's engine, timed step by step; its token counts, peak memory and,
    when the run holds data out, the held-out loss after training."""
    from hftk.engine.trainer import build_trainer
    from hftk.run.prepare import prepare

    trainer, _, data = build_trainer(prepare(argv))
    clock = StepClock()
    trainer.add_callback(clock)
    tokens = trainer.data_collator = TokenCount(trainer.data_collator)
    trainer.train()
    trained = dict(tokens.counts)
    eval_loss = trainer.evaluate()["eval_loss"] if data.eval is not None else None
    return {"steps": clock.steps, "tokens": trained, "peak_mem_mb": max(clock.peak_mem_mb, default=None),
            "eval_loss": eval_loss}


def run_hand_loop(argv: list[str]) -> dict[str, Any]:
    """The loop a competent user writes with Accelerate, with the Trainer's settings for the same config:
    fused AdamW (the Trainer's default ``adamw_torch_fused``), its LR schedule, clipping, and DDP without
    ``find_unused_parameters``. The loss is reduced across ranks every ``logging_steps`` steps."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import default_data_collator, get_scheduler

    from hftk.data.dataset import tokenize_and_pack
    from hftk.models.loading import load_model, load_tokenizer
    from hftk.run.prepare import prepare

    prepared = prepare(argv)
    cfg, t = prepared.cfg, prepared.cfg.training
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # without cpu=True each CPU rank trains alone
    torch.manual_seed(t["seed"])
    with accelerator.main_process_first():
        data = tokenize_and_pack(cfg.data, prepared.raw, load_tokenizer(cfg.model), prepared.data_format, t["seed"])
    model = load_model(cfg.model).train()
    loader = DataLoader(data.train, batch_size=t["per_device_train_batch_size"], shuffle=True,
                        collate_fn=default_data_collator, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t["learning_rate"], weight_decay=cfg.args.weight_decay,
                                  fused=True)
    scheduler = get_scheduler(t["lr_scheduler_type"], optimizer, num_warmup_steps=t["warmup_steps"],
                              num_training_steps=t["max_steps"])
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    clock = StepClock()
    batches = (batch for _ in itertools.count() for batch in loader)  # epoch after epoch
    for step, batch in zip(range(1, t["max_steps"] + 1), batches):
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), t["max_grad_norm"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        logged = step % t["logging_steps"] == 0
        clock.tick(accelerator.reduce(loss.detach(), reduction="mean").item() if logged else None)
    return {"steps": clock.steps}


OUT_OF_MEMORY_EXIT = 3  # a batch trial ran out of device memory on this rank (hftk.bench.batch relaunches)


def run_batch_trials(argv: list[str], trials: list[dict[str, Any]], budget_bytes: float | None,
                     progress: Path, largest_fit: int = 0) -> dict[str, Any]:
    """Trainer runs at each (micro_batch, accumulation) in order, in one process group. A trial of kind
    ``search`` whose peak (max over ranks) exceeds the budget ends the search: later ``search`` trials are
    skipped. A ``pair`` trial runs only when its micro-batch is no larger than the largest one that fitted
    (``largest_fit`` when an earlier launch found it). After each trial this rank's records so far are in
    ``progress``. A rank that runs out of device memory records the trial and ends the launch at once: its
    peers may be inside a collective of that step, which it can never join, so no later collective would
    pair up (``hftk.bench.batch`` relaunches)."""
    from hftk.engine.trainer import build_trainer
    from hftk.run.prepare import prepare

    results: list[dict[str, Any]] = []
    search_over = False
    for trial in trials:
        if (trial["kind"] == "search" and search_over) or (trial["kind"] == "pair" and trial["micro_batch"] > largest_fit):
            continue
        trainer, _, _ = build_trainer(prepare([*argv, "--per_device_train_batch_size", str(trial["micro_batch"]),
                                               "--gradient_accumulation_steps", str(trial["accumulation"]),
                                               "--output_dir", trial["output_dir"]]))
        clock = StepClock()
        trainer.add_callback(clock)
        gc.collect()
        try:
            trainer.train()
        except torch.OutOfMemoryError:
            results.append({**trial, "peak_mem_bytes": None, "oom": True, "fits": False, "steps": clock.steps})
            write_json(progress, {"trials": results})
            sys.stdout.flush()
            os._exit(OUT_OF_MEMORY_EXIT)
        # The run's own monitor measured each logging window's peak on every rank (rank 0 holds the
        # max over ranks); every rank takes rank 0's figure so that all decide alike.
        peak = max(gather_objects(max(clock.peak_mem_mb, default=0.0) * 2**20))
        del trainer
        gc.collect()
        torch.cuda.empty_cache()  # a no-op unless CUDA is in use
        fits = budget_bytes is None or peak <= budget_bytes
        if trial["kind"] == "search":
            search_over = not fits
            largest_fit = trial["micro_batch"] if fits else largest_fit
        results.append({**trial, "peak_mem_bytes": peak, "oom": False, "fits": fits, "steps": clock.steps})
        write_json(progress, {"trials": results})
    return {"trials": results}


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Complete or absent: written beside, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}")
    tmp.write_text(json.dumps(payload))
    tmp.rename(path)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    mode, rank = spec["mode"], int(os.environ.get("RANK", "0"))
    if mode == "trainer":
        result = run_trainer(spec["argv"])
    elif mode == "hand":
        result = run_hand_loop(spec["argv"])
    elif mode == "batch":
        result = run_batch_trials(spec["argv"], spec["trials"], spec.get("budget_bytes"),
                                  Path(spec["progress"]) / f"rank{rank}.json", spec.get("largest_fit", 0))
    else:
        raise ValueError(f"unknown bench worker mode {mode!r}")
    write_json(Path(spec["out"]) / f"rank{rank}.json", {"rank": rank, **result})  # the launcher watches for these
    teardown()
    return 0


def teardown() -> None:
    """Leave together, then close the group: gloo aborts at exit with the group still up, and a rank
    destroying it while its peer is still busy has hung a launch (the launcher also bounds this)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    from hftk.core.teardown import exit_without_teardown

    exit_without_teardown(main(sys.argv[1]))  # gloo threads now and then abort the interpreter's own teardown
