"""``scripts/finetune.py`` whose rank 0 is SIGKILLed halfway through writing a checkpoint.

In the first round of an elastic launch (TORCHELASTIC_RESTART_COUNT=0), when the Trainer saves
the checkpoint of step ``HFTK_DIE_AT_STEP``, rank 0 writes a torn ``optimizer.pt`` (what a kill
during the write leaves) and kills itself. Later rounds run untouched.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from transformers import Trainer

from hftk.run.prepare import main

DIE_AT = int(os.environ["HFTK_DIE_AT_STEP"])
save_optimizer_and_scheduler = Trainer._save_optimizer_and_scheduler


def torn_save(self: Trainer, output_dir: str) -> None:
    if self.state.global_step == DIE_AT and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" \
            and self.args.process_index == 0:
        Path(output_dir, "optimizer.pt").write_bytes(b"PK\x03\x04 torn")
        os.kill(os.getpid(), signal.SIGKILL)
    save_optimizer_and_scheduler(self, output_dir)


Trainer._save_optimizer_and_scheduler = torn_save

if __name__ == "__main__":
    sys.exit(main())
