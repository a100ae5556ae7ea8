"""The key-value store torch elastic's agent hosts for its workers (torchrun, ``accelerate launch``).

Ranks can wait on it without a process group, so a wait there is no collective: it is not bounded
by ``ddp_timeout``, and it works before the group starts. Leaf module: imports nothing from hftk.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

CONNECT = timedelta(seconds=60)  # reaching the store; waiting for a key is not bounded (node_first)
POLL_S = 0.05  # a waiting rank is at most this late: it started every launch up to 0.5 s behind at 0.5
_rounds = itertools.count()  # every rank runs the same work in the same order: its n-th call names round n


def client(timeout: timedelta, agent_only: bool = True) -> Any | None:
    """A client of the agent's store (None outside such a launch of 2+ ranks, or when unreachable).
    ``timeout`` bounds its connection and each wait. ``agent_only=False``: the store at ``MASTER_ADDR:MASTER_PORT``
    whoever hosts it: the agent, or rank 0 once the process group is up (the agent shares none with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; ``env://`` then starts it there)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if (agent_only and not agent) or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    try:
        from torch.distributed import TCPStore

        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    except (KeyError, ValueError, RuntimeError):
        return None


def run_key(name: str) -> str:
    """``name`` scoped to this launch; the same key on every rank of a round.

    Not scoped by ``TORCHELASTIC_RESTART_COUNT``: that counts failures of one node's own workers, so after
    another node's workers die the survivor re-forms the group as a membership change with count 0 while the
    failed node's ranks have 1; keys differing across nodes left :meth:`FailureWatch.settle` waiting for ever
    (the node-fault hang, issue 50). Rounds never meet each other's keys anyway: ``--max_restarts`` runs only
    with a fresh store per round (:func:`hftk.engine.resilience.check_restartable`), rank 0's at MASTER_PORT."""
    return f"hftk/{name}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"


@contextlib.contextmanager
def node_first(name: str) -> Iterator[None]:
    """Each node's local rank 0 runs the body first (e.g. tokenising into the datasets cache); the node's
    other ranks poll the agent's store for it, for as long as it takes, then run it (reading that cache).

    A barrier on the process group (``TrainingArguments.main_process_first``) fails after ``ddp_timeout``
    when the work takes longer. Polling the store is no collective; if local rank 0 dies,
    the launcher stops them. Rank 0 says "done" also when the body raised, so the others go on to raise
    the same error (``errors.report`` prints it once). Without an agent store (one process, or a launcher
    without one) every rank runs the body at once: there is no wait to time out.
    """
    key = run_key(f"{name}/{next(_rounds)}/node{os.environ.get('GROUP_RANK', '0')}")
    store = client(CONNECT)
    if store is None:
        yield
        return
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            yield
        finally:
            store.set(key, "done")
        return
    # check() never times out (a timed-out wait() also logs c10d warnings); a lost agent raises here
    while not store.check([key]):
        time.sleep(POLL_S)
    yield
