"""Peak RSS above the start of one real CPU forward + backward at 1024 tokens, per (family, attention,
activation checkpointing), beside the plan's activation bytes; one JSON line per case.

A process of its own: hftk's allocator settings (glibc returns freed blocks of 64 KiB and more at
once) make the resident set follow the live tensors, and they must not leak into the test process.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys

import torch
from tests.unit.models.test_activations import BATCH, CONFIGS, SEQ
from transformers import AutoModelForCausalLM

from hftk.core import allocator
from hftk.plan.estimate import GIB, PlanInputs, activation_bytes, model_shape
from hftk.telemetry.rank_monitor import peak_memory_bytes, reset_peak_memory

CPU = torch.device("cpu")


def resident() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(families: list[str]) -> None:
    allocator.return_freed_memory()
    torch.set_num_threads(1)
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for family in families:
        shape = model_shape(CONFIGS[family]())
        for attention in ("eager", "sdpa"):
            for checkpointing in (False, True):
                model = AutoModelForCausalLM.from_config(CONFIGS[family]())
                model.set_attn_implementation(attention)
                if checkpointing:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                model.train()(input_ids=ids[:, :64], labels=ids[:, :64]).loss.backward()  # gradients exist
                gc.collect()
                # free heap pages the previous case left resident would be reused without the resident
                # set growing (once measured 12% under the plan under load): hand them back first
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                start = resident()
                reset_peak_memory(CPU)
                model(input_ids=ids, labels=ids).loss.backward()
                predicted = activation_bytes(shape, PlanInputs(
                    world_size=1, device_memory_bytes=GIB, seq_len=SEQ, micro_batch=BATCH,
                    gradient_checkpointing=checkpointing, attention=attention, device="cpu"))
                print(json.dumps({"family": family, "attention": attention, "checkpointing": checkpointing,
                                  "measured": peak_memory_bytes(CPU) - start, "predicted": predicted}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
