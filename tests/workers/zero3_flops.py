"""One process: the tiny GPT-2 built whole and built under ZeRO-3's ``zero.Init`` (every
parameter partitioned, 0 elements left locally); prints both FLOPs-per-token counts as JSON."""

import json
import os

import torch.distributed as dist

os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo")

import deepspeed  # noqa: E402  (after the group: zero.Init partitions over it)

from hftk.config.options import ModelConfig  # noqa: E402
from hftk.models.loading import load_model  # noqa: E402
from hftk.core.teardown import exit_without_teardown  # noqa: E402
from hftk.telemetry.rank_monitor import flops_per_token  # noqa: E402

whole = load_model(ModelConfig(model_name_or_path="builtin:gpt2-tiny", model_dropout=0.0))
with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}):
    partitioned = type(whole)(whole.config)
print("FLOPS " + json.dumps({"whole": flops_per_token(whole, 64), "partitioned": flops_per_token(partitioned, 64),
                             "local_elements": sum(p.numel() for p in partitioned.parameters())}), flush=True)
dist.destroy_process_group()
exit_without_teardown(0)
