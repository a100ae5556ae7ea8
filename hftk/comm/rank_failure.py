"""Regions of collectives that no rank's failure can turn into a hang: it reaches every rank as one line.

A rank that raises inside a sequence of collectives (a save: a library's gathers and barriers) skips the
ones after it. The others wait in one of them for the process group's timeout (30 minutes), or for ever;
and a failed rank that meets them in another collective meets a mismatch: gloo hangs or aborts the process,
NCCL may hang or exchange garbage. Torch has no cross-rank error for this (gloo cannot be aborted; NCCL's
async error handling acts on its own timeout). So a :class:`FailureWatch` covers such a region out of band,
through the rendezvous store (``MASTER_ADDR:MASTER_PORT``: torch elastic's agent's, or rank 0's), which
needs no collective:

- a rank that fails in the region posts its failure there as one line (:meth:`FailureWatch.fail`; the first
  posted is the one every rank reports) and then either leaves the region raising it, or meets the others
  at :meth:`FailureWatch.settle`: a meeting through the store, so a rank that failed never enters a
  collective the others are not in;
- every rank's watch thread polls for a posted failure; a rank still inside the region :data:`GRACE_S`
  after one appeared is waiting in a collective the failing rank skipped: the watch runs ``on_stuck`` (a
  publisher removes its unfinished folder), reports the line the way every hftk error is reported (rank 0
  prints it once, :func:`hftk.core.errors.report`) and ends the process with that code.

A body that must not be cut (a publishing rename) runs under :meth:`FailureWatch.uncut`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable, Iterator

import torch.distributed as dist

from hftk.comm.collectives import gather_objects
from hftk.core import agent_store
from hftk.core.errors import HftkError, report

GRACE_S = 5.0  # a failure posted this long ago while this rank is still inside: it waits in a skipped collective
POLL_S = 0.1  # the watch thread's look for a posted failure
SETTLE_POLL_S = 0.01  # a rank waiting at the settle for the others (torch's store-based barrier polls the same way)
STORE_TIMEOUT = timedelta(seconds=30)  # reaching the store and each request; no request here waits for a key
_regions = itertools.count()  # every rank enters the same regions in the same order: its n-th is region n


class FailureWatch:
    """One region of collectives on this rank (see the module docstring); without a process group of 2+ ranks
    it only describes. Leave it with :meth:`leave` on every path (:func:`watching` does)."""

    def __init__(self, on_stuck: Callable[[], None] | None = None) -> None:
        self._key = agent_store.run_key(f"failed/{next(_regions)}")
        self._on_stuck = on_stuck
        self._lock = threading.Lock()  # held by the watch while it ends the process, and by uncut bodies
        self._left = threading.Event()
        self._posted = False
        self._mine: HftkError | None = None  # this rank's first failure, as described
        grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._world = dist.get_world_size() if grouped else 1
        # a connection of its own: the group's store client may be blocked in a wait (NCCL's communicator set-up)
        self._store = agent_store.client(STORE_TIMEOUT, agent_only=False) if grouped else None
        if self._store is not None:
            threading.Thread(target=self._watch, name="hftk-failure-watch", daemon=True).start()

    def fail(self, error: BaseException, describe: Callable[[BaseException], HftkError]) -> HftkError:
        """Post this rank's ``error`` as ``describe`` words it, for every rank; return the line to raise: the first
        posted, which is another rank's when that came first (this one then most likely follows from it: a
        collective broke off)."""
        failure = describe(error)
        if self._mine is None:
            self._mine = failure
        self._post(failure)
        return self.first_failure() or failure

    def settle(self, failure: HftkError | None) -> list[HftkError]:
        """Collective, but no process-group collective: wait until every rank got here (``failure``: this rank's
        own, from :meth:`fail`), through the store; then every failure posted in the region, in the order
        they were posted ([] when no rank failed)."""
        if failure is not None:
            self._post(failure)
        if self._store is None:  # one process, or no store reachable: the group's own gather
            return [HftkError(*f) for f in gather_objects(_fields(failure)) if f is not None]
        arrived = f"{self._key}/arrived"
        self._store.add(arrived, 1)
        while self._store.add(arrived, 0) < self._world:
            time.sleep(SETTLE_POLL_S)
        count = self._store.add(f"{self._key}/count", 0)
        values = self._store.multi_get([f"{self._key}/{order}" for order in range(1, count + 1)]) if count else []
        return [HftkError(*json.loads(value)) for value in values]

    def first_failure(self) -> HftkError | None:
        """The first failure any rank posted in this region, None while there is none."""
        if self._store is None or not self._store.check([f"{self._key}/1"]):
            return None
        return HftkError(*json.loads(self._store.get(f"{self._key}/1")))

    def own_stack(self, reported: HftkError) -> None:
        """Print the stack of the error this rank's failure was described from (its ``__cause__``: a bug, not an
        hftk error) when ``reported`` is that failure: the line points at it. Only there, and once."""
        if self._mine is not None and self._mine.__cause__ is not None and _fields(self._mine) == _fields(reported):
            traceback.print_exception(self._mine.__cause__, file=sys.stderr)
            sys.stderr.flush()
            self._mine = reported

    def leave(self) -> None:
        """This rank is out of the region (done, or raising its failure itself): the watch ends quietly."""
        with self._lock:
            self._left.set()

    @contextlib.contextmanager
    def uncut(self) -> Iterator[None]:
        """The body runs to its end before the watch may end this process (a rename that publishes a folder)."""
        with self._lock:
            yield

    def _post(self, failure: HftkError) -> None:
        if self._store is None or self._posted:
            return
        self._posted = True
        order = self._store.add(f"{self._key}/count", 1)
        self._store.set(f"{self._key}/{order}", json.dumps(_fields(failure)))

    def _watch(self) -> None:
        try:
            while (failure := self.first_failure()) is None:
                if self._left.wait(POLL_S):
                    return
        except RuntimeError:  # the store is gone with the rank that hosted it: the launcher stops this one
            return
        if self._left.wait(GRACE_S):
            return
        with self._lock:
            if self._left.is_set():
                return
            if self._on_stuck is not None:
                self._on_stuck()
            self.own_stack(failure)
            code = report(failure)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # the main thread waits in a collective that never completes: nothing else ends it


def _fields(failure: HftkError | None) -> list[str] | None:
    return None if failure is None else [failure.field, failure.problem, failure.fix]


@contextlib.contextmanager
def watching(describe: Callable[[BaseException], HftkError],
             on_stuck: Callable[[], None] | None = None) -> Iterator[FailureWatch]:
    """A :class:`FailureWatch` over the body: an exception out of it leaves as the one line
    (:meth:`FailureWatch.fail`; ``describe`` returns an error that already is one as it is)."""
    watch = FailureWatch(on_stuck)
    try:
        yield watch
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        failure = watch.fail(exc, describe)
        watch.own_stack(failure)
        if failure is exc:
            raise
        raise failure from exc
    finally:
        watch.leave()
