"""The HF Trainer engine's own pieces (hftk/engine/trainer.py), in process."""

from __future__ import annotations

import torch


def test_the_flop_count_taken_once_equals_the_trainers_own(tmp_path):
    """``count_flops_once`` keeps the Trainer's formula (6 x tokens x non-embedding parameters): the same
    number as ``Trainer.floating_point_ops`` for any batch, and 0 without the model's main input."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hftk.data.builtin import materialize_model
    from hftk.engine.trainer import count_flops_once

    model = AutoModelForCausalLM.from_pretrained(materialize_model("builtin:gpt2-tiny"))
    trainer = Trainer(model=model, args=TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))
    count_flops_once(trainer)
    for shape in ((2, 16), (3, 64)):
        inputs = {"input_ids": torch.zeros(shape, dtype=torch.long)}
        assert trainer.floating_point_ops(inputs) == Trainer.floating_point_ops(trainer, inputs) > 0
    assert trainer.floating_point_ops({"labels": torch.zeros(2, 4)}) == 0
