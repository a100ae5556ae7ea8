"""Started by a launcher: all-reduce one tensor over the real process group and report what
this rank saw (world size, sum, the strategy hftk reads from the launch config) as one JSON line.
With an argument FILE, rank 0 also writes there the accelerate variables the launch set
(``ACCELERATE_*``, ``FSDP_*``: how a launch config reaches the run), for a test to replay."""

import json
import os
import sys

import torch
import torch.distributed as dist

from hftk.launch.configs import launcher_strategy
from hftk.core.teardown import exit_without_teardown

if torch.cuda.is_available():  # NCCL reduces device tensors only: each rank on its own GPU
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
one = torch.ones(1, device=device)
dist.all_reduce(one)
found = launcher_strategy(os.environ)
line = "PROBE " + json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": one.item(),
                              "strategy": found[0] if found else None})
# One write per line: print() writes text and newline separately, and two ranks sharing the pipe
# interleaved them into one line. A single write under PIPE_BUF reaches the pipe whole.
os.write(sys.stdout.fileno(), (line + "\n").encode())
if len(sys.argv) > 1 and dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_"))}, f)
dist.destroy_process_group()
exit_without_teardown(0)  # skips gloo's teardown abort
