"""A cell that misbehaves, for the warm-rank harness's own tests (tests/integration/test_warm.py).

``misbehave.py pollute HFTK_TRAIN_ARGS...``: leaves behind what a careless cell could -- a process group
it never destroys, a patched torch function (layer norm doubled), a registered attention entry (the
``sdpa`` kernel replaced), an environment variable (``ACCELERATE_MIXED_PRECISION``), a changed working
directory -- and then trains with ``hftk train``'s own entry point under all of it, so its losses show
what a run that inherited them would compute.
``misbehave.py hang``: every rank prints its pid, rank 1 raises nothing and sleeps forever, rank 0 waits
in a collective for it. ``misbehave.py crash``: rank 1 raises, rank 0 waits in a collective.
"""

import os
import sys
import time

import torch
import torch.distributed as dist


def pollute(argv: list[str]) -> int:
    import torch.nn.functional as F
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hftk.run.prepare import main

    dist.init_process_group("gloo")  # never destroyed
    layer_norm = F.layer_norm
    F.layer_norm = lambda x, *a, **k: layer_norm(x, *a, **k) * 2.0
    torch.nn.functional.layer_norm = F.layer_norm

    def shifted_sdpa(module, query, *args, **kwargs):
        return sdpa_attention_forward(module, query * 4.0, *args, **kwargs)

    AttentionInterface.register("sdpa", shifted_sdpa)
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    os.chdir("/")
    print(f"polluted rank {os.environ['RANK']}", flush=True)
    return main(argv)


def hang() -> int:
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} pid {os.getpid()}", flush=True)
    if dist.get_rank() == 1:
        while True:
            time.sleep(1)
    dist.barrier()
    return 0


def crash() -> int:
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} pid {os.getpid()}", flush=True)
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()
    return 0


if __name__ == "__main__":
    mode = sys.argv[1]
    sys.exit(pollute(sys.argv[2:]) if mode == "pollute" else hang() if mode == "hang" else crash())
