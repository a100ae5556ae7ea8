"""One error type for everything a user can get wrong.

It carries the offending field and the fix so the CLI can print a single line
(``hftk: error: data.block_size: 4096 exceeds ... Fix: ...``) instead of a traceback.
"""

from __future__ import annotations


class HftkError(Exception):
    """A user-facing error: which field is wrong, why, and how to fix it."""

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = f"{self.field}: {self.problem}"
        if self.fix:
            text += f" Fix: {self.fix}"
        return " ".join(text.split())  # always exactly one line


EXIT_USAGE = 2  # argparse's code for bad usage; every HftkError exits with it
_PRINTED = "input_error_printed"  # the agent-store key (hftk.core.agent_store.run_key) rank 0 sets once it printed
RANK_WAIT_S = 30.0  # how long a rank > 0 waits for rank 0's line before printing its own


def report(exc: HftkError) -> int:
    """Print ``exc`` as one line, once per launch, and return the exit code.

    Under a launcher every rank runs the same validation and raises the same error. Rank 0 prints
    it and says so in the launcher's store (torchrun's agent hosts a TCPStore for its workers, no
    process group needed: ``hftk.core.agent_store``); the other ranks wait for that before they exit silently
    with the same code: a rank that exits first makes torchrun SIGTERM the rest, and rank 0 could die
    before its line. A rank > 0 whose error rank 0 never reports (a problem only it sees) prints its own
    line after :data:`RANK_WAIT_S`, so no error is ever lost.
    """
    import os
    import sys
    from datetime import timedelta

    from hftk.core import agent_store

    line = f"hftk: error: {exc.one_line()}"
    rank = int(os.environ.get("RANK", "0"))
    store = agent_store.client(timedelta(seconds=RANK_WAIT_S))
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
        if store is not None:
            store.set(agent_store.run_key(_PRINTED), "1")
    elif not _wait_for_rank0(store):
        print(f"hftk: error (rank {rank}): {exc.one_line()}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _wait_for_rank0(store: object | None) -> bool:
    """True once rank 0 has printed the line (False: no store, or it did not within RANK_WAIT_S)."""
    from hftk.core import agent_store

    if store is None:
        return False
    try:
        store.wait([agent_store.run_key(_PRINTED)])  # the store's own timeout bounds the wait
    except RuntimeError:  # torch raises DistStoreError (a RuntimeError) on timeout
        return False
    return True
