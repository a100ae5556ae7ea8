"""``hftk train`` as a launch runs it, plus one callback that, at the end of the first optimizer step,
writes every module then in ``sys.modules`` (rank 0) to ``HFTK_MODULES_OUT``: what the run had imported
by then (tests/integration/test_startup.py)."""

import json
import os
import sys

from hftk.engine import trainer as engine
from hftk.run.prepare import main

callbacks = engine.run_callbacks


def with_probe(prepared, trainer, strategy):
    from transformers import TrainerCallback

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1 and args.process_index == 0:
                with open(os.environ["HFTK_MODULES_OUT"], "w") as f:
                    json.dump(sorted(sys.modules), f)

    found = callbacks(prepared, trainer, strategy)
    trainer.add_callback(FirstStep())
    return found


engine.run_callbacks = with_probe
if __name__ == "__main__":
    sys.exit(main())
