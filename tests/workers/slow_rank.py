"""Test worker: hftk's Trainer engine with rank 1 made slower on purpose from step SLOW_FROM on.

The slowing lives here, in the test: a forward pre-hook on rank 1's first decoder block sleeps
SLOW_S seconds, so rank 1 really computes longer (and rank 0 waits for it in the all-reduce).
usage: torchrun --nproc_per_node 2 slow_rank.py SLOW_FROM SLOW_S <hftk train options>
"""

from __future__ import annotations

import sys
import time

from transformers import TrainerCallback

from hftk.engine.trainer import build_trainer
from hftk.run.prepare import prepare


class SlowRankOne(TrainerCallback):
    def __init__(self, slow_from: int, seconds: float) -> None:
        self.slow_from, self.seconds, self.step = slow_from, seconds, 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if args.process_index == 1:
            model.transformer.h[0].register_forward_pre_hook(self._sleep)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def _sleep(self, module, inputs):
        if module.training and self.step >= self.slow_from:
            time.sleep(self.seconds)


def main() -> int:
    slow_from, seconds, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    trainer, _, _ = build_trainer(prepare(argv))
    trainer.add_callback(SlowRankOne(slow_from, seconds))
    trainer.train()
    trainer.accelerator.end_training()
    return 0


if __name__ == "__main__":
    from hftk.core.teardown import exit_without_teardown

    exit_without_teardown(main())  # skips gloo's teardown abort
