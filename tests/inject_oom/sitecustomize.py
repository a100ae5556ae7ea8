"""Imported at start-up by every Python process whose path holds this folder (tests/integration/test_bench_batch.py
puts it on PYTHONPATH): rank 1's Trainer step raises CUDA's out-of-memory error from micro-batch
$HFTK_TEST_OOM_MICRO_BATCH on, as one GPU of several does when it runs out first."""

import os

if os.environ.get("RANK") == "1" and os.environ.get("HFTK_TEST_OOM_MICRO_BATCH"):
    import torch
    import transformers

    _training_step = transformers.Trainer.training_step

    def training_step(self, *args, **kwargs):
        if self.args.per_device_train_batch_size >= int(os.environ["HFTK_TEST_OOM_MICRO_BATCH"]):
            raise torch.OutOfMemoryError("CUDA out of memory (raised by tests/inject_oom on rank 1 only)")
        return _training_step(self, *args, **kwargs)

    transformers.Trainer.training_step = training_step
