"""``scripts/finetune.py`` whose rank 1 receives SIGTERM in the middle of GRPO's rollouts of optimizer step
``HFTK_SIGTERM_AT_STEP`` (1-based), after ``HFTK_SIGTERM_AFTER`` forwards of its generation: a preemption that lands
during generation. Every rank appends each generation forward it runs (the step and the token position) to
``HFTK_TEST_FORWARDS/rank-R``, so a test sees at which token every rank stopped. Test-only, no product code."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel
from trl import GRPOTrainer

from hftk.run.prepare import main

STEP = int(os.environ["HFTK_SIGTERM_AT_STEP"])
AFTER = int(os.environ["HFTK_SIGTERM_AFTER"])
LOG = Path(os.environ["HFTK_TEST_FORWARDS"])
forward = GPT2LMHeadModel.forward
generate_single_turn = GRPOTrainer._generate_single_turn
state = {"step": 0, "generating": False, "forwards": 0}


def counted_forward(self, *args, **kwargs):
    if state["generating"]:
        state["forwards"] += 1
        rank = int(os.environ["RANK"])
        LOG.mkdir(parents=True, exist_ok=True)
        with open(LOG / f"rank-{rank}", "a") as f:
            f.write(f"{state['step']} {state['forwards']}\n")
        if rank == 1 and state["step"] == STEP and state["forwards"] == AFTER:
            os.kill(os.getpid(), signal.SIGTERM)
    return forward(self, *args, **kwargs)


def watched_generation(self, *args, **kwargs):
    state.update(step=self.state.global_step + 1, generating=True, forwards=0)
    try:
        return generate_single_turn(self, *args, **kwargs)
    finally:
        state["generating"] = False


GPT2LMHeadModel.forward = counted_forward
GRPOTrainer._generate_single_turn = watched_generation

if __name__ == "__main__":
    sys.exit(main())
