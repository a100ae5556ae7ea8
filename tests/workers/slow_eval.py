"""``scripts/finetune.py`` with slow decoder blocks, for the preemption-during-evaluation tests.

Test-only hooks, no product code: every GPT-2 block forward sleeps ``HFTK_EVAL_SLEEP_S`` in
eval mode (an evaluation longer than a launcher's grace period, at no CPU cost) and
``HFTK_TRAIN_SLEEP_S`` in training mode (a signal sent after step N is logged lands inside step
N + 1). The first eval forward prints :data:`EVAL_MARKER` on stderr, so a test knows when to
signal. Each rank writes the exit code it leaves with into ``HFTK_EXIT_DIR/rank-R``: torchrun
does not report its workers' codes when it is the one that was signalled.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import hftk.run.prepare

EVAL_MARKER = "hftk-test: evaluation running"
EVAL_SLEEP = float(os.environ.get("HFTK_EVAL_SLEEP_S", "0"))
TRAIN_SLEEP = float(os.environ.get("HFTK_TRAIN_SLEEP_S", "0"))
forward = GPT2Block.forward
exit_without_teardown = hftk.run.prepare.exit_without_teardown
announced = False


def slow_forward(self: GPT2Block, *args, **kwargs):
    global announced
    if not self.training and not announced:
        announced = True
        print(EVAL_MARKER, file=sys.stderr, flush=True)
    time.sleep(TRAIN_SLEEP if self.training else EVAL_SLEEP)
    return forward(self, *args, **kwargs)


def record_exit(code: int) -> None:
    folder = Path(os.environ["HFTK_EXIT_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{os.environ['RANK']}").write_text(str(code))
    exit_without_teardown(code)


GPT2Block.forward = slow_forward
hftk.run.prepare.exit_without_teardown = record_exit

if __name__ == "__main__":
    sys.exit(hftk.run.prepare.main())
