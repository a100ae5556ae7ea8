"""Per-rank worker of ``hftk bench memory`` and of the plan-accuracy test: a short run of one
strategy through hftk's own engine, measuring what each rank holds. Run under a launcher with the
usual finetune options plus ``--memory_out FILE`` (``torchrun --nproc_per_node 2 -m
hftk.bench.memory_worker --strategy zero3 --max_steps 2 ... --memory_out zero3.json``). Two
measurements per rank:

- model state (:func:`hftk.telemetry.memory.model_state_bytes`) counted inside the second optimizer step,
  after each call of the innermost torch optimizer's ``step`` (a post-hook), keeping the largest:
  the one moment every strategy holds the gradients being applied and the optimizer state
  together. Counting later, at the Trainer's ``on_optimizer_step``, would miss DeepSpeed's
  gradients: its engine frees them inside its own step;
- peak memory of the training phase: reset at train begin (VmHWM after ``clear_refs`` on CPU,
  the allocator's peak on GPU), with the lifetime peak before the reset (imports + loading);
- under ``--method dpo``, the bytes of the frozen reference model the rank holds (TRL's ``ref_model``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback

from hftk.comm.collectives import gather_objects
from hftk.core.errors import HftkError
from hftk.telemetry.memory import model_state_bytes
from hftk.telemetry.rank_monitor import peak_memory_bytes, reset_peak_memory

# The first step creates the optimizer state lazily (DeepSpeed one parameter group after another);
# from the second on, every step holds the same.
COUNTED_STEP = 2


class MemoryProbe(TrainerCallback):
    """Counts model state during the second optimizer step; tracks the training-phase peak."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.device = trainer.args.device
        self.counts: dict[str, int] = {}
        self.lifetime_peak = self.peak = self.reference = 0
        self._hook: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.reference = held_reference_bytes(self.trainer)
        self.lifetime_peak = peak_memory_bytes(self.device)
        reset_peak_memory(self.device)
        optimizer = self.trainer.optimizer
        while hasattr(optimizer, "optimizer"):  # the torch optimizer under accelerate's and DeepSpeed's wrappers
            optimizer = optimizer.optimizer
        self._hook = optimizer.register_step_post_hook(self._count)

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.trainer.state.global_step != COUNTED_STEP - 1:
            return
        counts = model_state_bytes(self.trainer.model, self.trainer.optimizer)
        if counts["total"] > self.counts.get("total", -1):
            self.counts = counts

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == COUNTED_STEP - 1 and self._hook is not None:  # later steps hold the same
            self._hook.remove()
            self._hook = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Read before the logging step: hftk's RankMonitor starts a new peak window at every log.
        self.peak = max(self.peak, peak_memory_bytes(self.device))

    def result(self) -> dict[str, int]:
        return {**self.counts, "peak": max(self.peak, peak_memory_bytes(self.device)),
                "lifetime_peak": self.lifetime_peak, "reference": self.reference}


def held_reference_bytes(trainer: Any) -> int:
    """This rank's bytes of DPO's frozen reference model (TRL's ``ref_model``: a module, or the DeepSpeed engine
    around one; its local shard where sharded); 0 without one (supervised runs, LoRA, precomputed log-probs)."""
    ref = getattr(trainer, "ref_model", None)
    return 0 if ref is None else model_state_bytes(getattr(ref, "module", ref))["params"]


def main(argv: list[str] | None = None) -> int:
    from hftk.config import strategy_table
    from hftk.engine.trainer import build_trainer
    from hftk.run.prepare import prepare

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if "--memory_out" not in argv or argv.index("--memory_out") + 1 >= len(argv):
            raise HftkError("--memory_out", "is required.", "pass --memory_out FILE.json.")
        i = argv.index("--memory_out")
        out, prepared = Path(argv[i + 1]), prepare(argv[:i] + argv[i + 2:])
        if prepared.cfg.args.max_steps < COUNTED_STEP:
            raise HftkError("training.max_steps", f"the probe counts optimizer step {COUNTED_STEP} (the first creates "
                            "the optimizer state).", f"pass --max_steps {COUNTED_STEP} or more.")
        if strategy_table.spec(prepared.cfg.strategy.strategy).engine == "loop":
            return loop_memory(prepared, out)
        if prepared.cfg.preference.method == "dpo":
            from hftk.engine.preference import build_dpo_trainer

            trainer, _, _ = build_dpo_trainer(prepared)
        else:
            trainer, _, _ = build_trainer(prepared)
    except HftkError as exc:
        print(f"hftk: error: {exc.one_line()}", file=sys.stderr, flush=True)
        return 2
    measure(trainer, prepared.cfg.strategy.strategy, out)
    trainer.accelerator.end_training()
    return 0


def measure(trainer: Any, strategy: str, out: Path) -> None:
    """Train with the probe and write every rank's record to ``out`` (rank 0); the caller tears the process
    group down."""
    probe = MemoryProbe(trainer)
    trainer.add_callback(probe)
    trainer.train()
    ranks = gather_objects(probe.result())
    if trainer.args.process_index == 0:
        write_record(out, strategy, trainer.args.device.type, ranks)
    if dist.is_initialized():  # leave together: a rank tearing down gloo while its peer still writes aborts
        dist.barrier()


def loop_memory(prepared: Any, out: Path) -> int:
    """Strategies of hftk's custom loop (no Trainer): the loop counts the same bytes itself. It logs every
    rank's params / grads / optimizer bytes after its first optimizer step and the training phase's peak
    (reset before the first step) as one ``memory`` record in metrics.jsonl."""
    from hftk.engine import loop
    from hftk.strategies.mesh import device_type
    from hftk.telemetry.metrics import read_jsonl

    cfg = prepared.cfg
    loop.train(prepared)
    if int(os.environ.get("RANK", "0")) == 0:
        ranks = next(r["memory"] for r in read_jsonl(cfg.output_dir / cfg.tracking.metrics_file) if "memory" in r)
        write_record(out, cfg.strategy.strategy, device_type(cfg), ranks)
    return 0


def write_record(out: Path, strategy: str, device_type: str, ranks: list[dict[str, int]]) -> None:
    """What ``hftk bench memory`` reads: every rank's counts, written by rank 0."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"strategy": strategy, "world_size": len(ranks),
                               "device": "gpu" if device_type == "cuda" else "cpu", "ranks": ranks}, indent=1))


if __name__ == "__main__":
    from hftk.core.teardown import exit_without_teardown

    exit_without_teardown(main())  # skips gloo's teardown abort
