"""Started by a launcher: all-reduce one tensor over the real process group and report what
this rank saw (world size, sum, the strategy hftk reads from the launch config) as one JSON line."""

import json
import os
import sys

import torch
import torch.distributed as dist

from hftk.launch import launcher_strategy
from hftk.run import exit_without_teardown

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
one = torch.ones(1)
dist.all_reduce(one)
found = launcher_strategy(os.environ)
line = "PROBE " + json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": one.item(),
                              "strategy": found[0] if found else None})
# One write per line: print() writes text and newline separately, and two ranks sharing the pipe
# interleaved them into one line. A single write under PIPE_BUF reaches the pipe whole.
os.write(sys.stdout.fileno(), (line + "\n").encode())
dist.destroy_process_group()
exit_without_teardown(0)  # skips gloo's teardown abort
