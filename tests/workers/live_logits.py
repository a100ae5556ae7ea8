"""``scripts/finetune.py`` that records what the live model computes once training ends, before ``final/`` is saved.

Right after ``Trainer.train`` returns, every rank runs the trained model (sharded or not: FSDP2 and ZeRO-3
forwards are collectives) on fixed tokens; rank 0 writes them and the logits to ``$HFTK_LOGITS_OUT``, for a
test to compare with the saved folder loaded by ``from_pretrained``.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import Trainer

from hftk.run.prepare import main

train = Trainer.train


def train_then_record(self: Trainer, *args, **kwargs):
    result = train(self, *args, **kwargs)
    input_ids = torch.arange(1, 17).unsqueeze(0)
    self.model.eval()
    with torch.no_grad():
        logits = self.model(input_ids=input_ids.to(self.args.device)).logits.float().cpu()
    if self.args.process_index == 0:
        torch.save({"input_ids": input_ids, "logits": logits}, os.environ["HFTK_LOGITS_OUT"])
    return result


Trainer.train = train_then_record

if __name__ == "__main__":
    sys.exit(main())
