"""``scripts/finetune.py`` whose loss on the last rank is NaN at optimizer step ``HFTK_NAN_AT_STEP``.

Only one rank sees the NaN, as when one shard of data or one device goes bad: the others must
learn of it through hftk's per-step agreement.
"""

from __future__ import annotations

import os
import sys

from transformers import Trainer

from hftk.run.prepare import main

NAN_AT = int(os.environ["HFTK_NAN_AT_STEP"])  # 1-based optimizer step
compute_loss = Trainer.compute_loss


def poisoned_loss(self: Trainer, *args, **kwargs):
    result = compute_loss(self, *args, **kwargs)
    if self.state.global_step + 1 == NAN_AT and self.args.process_index == self.args.world_size - 1:
        if isinstance(result, tuple):
            return (result[0] * float("nan"), *result[1:])
        return result * float("nan")
    return result


Trainer.compute_loss = poisoned_loss

if __name__ == "__main__":
    sys.exit(main())
