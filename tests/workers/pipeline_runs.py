"""Several pipeline runs in one launch (one process group): `COMMON... ::: RUN1... ::: RUN2...`.

Each run gets the common options plus its own, goes through the same validation as
``hftk train`` and trains with :func:`hftk.engine.loop.run`; sharing the launch saves
the start-up of torch, transformers and the process group for every extra schedule.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from hftk.engine.loop import run
from hftk.run import prepare

SEP = ":::"


def main(argv: list[str]) -> int:
    common, *runs = " ".join(argv).split(SEP)
    for extra in runs:
        run(prepare(common.split() + extra.split()))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from hftk.run import exit_without_teardown

    exit_without_teardown(main(sys.argv[1:]))  # skips gloo's teardown abort
