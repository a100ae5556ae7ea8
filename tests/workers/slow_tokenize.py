"""``scripts/finetune.py`` whose rank 0 tokenises slowly, for the long-tokenisation test.

Test-only hook, no product code: on rank 0, ``hftk.data.dataset.tokenize_and_pack`` (every run's
tokenisation goes through it) first sleeps ``HFTK_TOKENIZE_SLEEP_S``: a dataset that takes
longer to tokenise than the run's ``ddp_timeout``, at no CPU cost. Each rank prints the timeout its
process group starts with (:data:`TIMEOUT_MARKER`), so the test knows that timeout was in force.
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed

import hftk.data.dataset
import hftk.run.prepare

TIMEOUT_MARKER = "hftk-test: process group timeout"
SLEEP = float(os.environ.get("HFTK_TOKENIZE_SLEEP_S", "0"))
tokenize_and_pack = hftk.data.dataset.tokenize_and_pack
init_process_group = torch.distributed.init_process_group


def slow_tokenize_and_pack(*args, **kwargs):
    if os.environ.get("RANK", "0") == "0":
        time.sleep(SLEEP)
    return tokenize_and_pack(*args, **kwargs)


def announced_init_process_group(*args, **kwargs):
    timeout = kwargs.get("timeout")
    print(f"{TIMEOUT_MARKER} {timeout.total_seconds() if timeout else None} s", file=sys.stderr, flush=True)
    return init_process_group(*args, **kwargs)


hftk.data.dataset.tokenize_and_pack = slow_tokenize_and_pack
torch.distributed.init_process_group = announced_init_process_group

if __name__ == "__main__":
    sys.exit(hftk.run.prepare.main())
