"""Regions of collectives that no rank's failure can turn into a hang: it reaches every rank as one line.

A rank that raises inside a sequence of collectives (a save: a library's gathers and barriers) skips the
ones after it. The others wait in one of them for the process group's timeout (30 minutes), or for ever;
and a failed rank that meets them in another collective meets a mismatch: gloo hangs or aborts the process,
NCCL may hang or exchange garbage. Torch has no cross-rank error for this (gloo cannot be aborted; NCCL's
async error handling acts on its own timeout). So a :class:`FailureWatch` covers such a region out of band,
through the rendezvous store (``MASTER_ADDR:MASTER_PORT``: torch elastic's agent's, or rank 0's), which
needs no collective:

- a rank that fails in the region posts its failure there as one line (:meth:`FailureWatch.fail`) and then
  either leaves the region raising the line every rank reports, or meets the others at
  :meth:`FailureWatch.settle`: a meeting through the store that ends once every rank has arrived or left,
  so a rank that failed never enters a collective the others are not in;
- every rank's watch thread polls for a posted failure; a rank still inside the region, and not at the
  settle, :data:`GRACE_S` after one appeared is waiting in a collective the failing rank skipped: the watch
  counts it out of the settle, runs ``on_stuck`` (a publisher removes its unfinished folder), reports the
  line the way every hftk error is reported (rank 0 prints it once, :func:`hftk.core.errors.report`) and
  ends the process with that code.

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

GRACE_S = 5.0  # a failure posted this long ago while this rank is inside, not at the settle: it waits in a collective
POLL_S = 0.5  # the watch thread's look for a posted failure: one store request per rank and interval
SETTLE_POLL_S = (0.01, 0.5)  # a rank waiting at the settle asks the store this often, backing off from the first
STORE_TIMEOUT = timedelta(seconds=30)  # reaching the store and each request; no request here waits for a key
_regions = itertools.count()  # every rank enters the same regions in the same order: its n-th is region n

Failures = list[tuple[int, HftkError]]  # (rank, its failure), in the order they were posted
Choose = Callable[[Failures], HftkError]


def first_posted(failures: Failures) -> HftkError:
    """The failure posted first: another rank's failure that follows from it (a collective broke off) comes later."""
    return failures[0][1]


class FailureWatch:
    """One region of collectives on this rank (see the module docstring); without a process group of 2+ ranks
    it only describes. ``choose`` picks the line every rank reports from the failures posted. Leave it with
    :meth:`leave` on every path (:func:`watching` does)."""

    def __init__(self, on_stuck: Callable[[], None] | None = None, choose: Choose = first_posted) -> None:
        self._key = agent_store.run_key(f"failed/{next(_regions)}")
        self._on_stuck, self._choose = on_stuck, choose
        self._lock = threading.RLock()  # held by the watch while it ends the process, by uncut bodies, by leave
        self._left = threading.Event()
        self._settling = False  # at the settle: waiting for ranks that will arrive or leave, in no collective
        self._counted = False  # this rank has arrived at the settle or left the region
        self._posted = False
        self._mine: HftkError | None = None  # this rank's first failure, as described
        grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._rank, self._world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
        # a connection of its own: the group's store client may be blocked in a wait (NCCL's communicator set-up)
        self._store = agent_store.client(STORE_TIMEOUT, agent_only=False) if grouped else None
        if self._store is not None:
            threading.Thread(target=self._watch, name="hftk-failure-watch", daemon=True).start()

    def fail(self, error: BaseException, describe: Callable[[BaseException], HftkError]) -> HftkError:
        """Post this rank's ``error`` as ``describe`` words it, for every rank; return the line to raise (``choose``
        over every failure posted so far: another rank's may explain this one)."""
        failure = describe(error)
        if self._mine is None:
            self._mine = failure
        self._post(failure)
        return self.reported() or failure

    def settle(self, failure: HftkError | None) -> HftkError | None:
        """Collective, but no process-group collective: wait until every rank has arrived here or left the region
        (``failure``: this rank's own, from :meth:`fail`), through the store; then the line every rank raises,
        None when no rank failed."""
        if failure is not None:
            self._post(failure)
        if self._store is None:  # one process, or no store reachable: the group's own gather
            found = [(rank, HftkError(*f)) for rank, f in enumerate(gather_objects(_fields(failure))) if f]
            return self._choose(found) if found else None
        self._settling = True
        self._count_out()
        delay = SETTLE_POLL_S[0]
        while self._store.add(f"{self._key}/settled", 0) < self._world:  # thousands may wait minutes for one write
            time.sleep(delay)
            delay = min(2 * delay, SETTLE_POLL_S[1])
        self._settling = False
        return self.reported()

    def reported(self) -> HftkError | None:
        """The line every rank reports (``choose`` over the failures posted so far), None while none was."""
        if self._store is None:
            return None
        count = self._store.add(f"{self._key}/count", 0)
        keys = [key for key in (f"{self._key}/{order}" for order in range(1, count + 1)) if self._store.check([key])]
        found = [json.loads(value) for value in self._store.multi_get(keys)] if keys else []
        return self._choose([(rank, HftkError(*fields)) for rank, *fields in found]) if found else None

    def own_stack(self, reported: HftkError) -> None:
        """Print the stack of the error this rank's failure was described from (its ``__cause__``: a bug, not an
        hftk error) when ``reported`` is that failure: the line points at it. Only there, and once."""
        if self._mine is not None and self._mine.__cause__ is not None and _fields(self._mine) == _fields(reported):
            traceback.print_exception(self._mine.__cause__, file=sys.stderr)
            sys.stderr.flush()
            self._mine = reported

    def leave(self) -> None:
        """This rank is out of the region (done, or raising its failure itself): counted out of the settle (the
        others stop waiting for it), and the watch ends quietly."""
        with self._lock:
            self._count_out()
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
        self._store.set(f"{self._key}/{order}", json.dumps([self._rank, *_fields(failure)]))

    def _count_out(self) -> None:
        with self._lock:
            if self._store is not None and not self._counted:
                self._counted = True
                self._store.add(f"{self._key}/settled", 1)

    def _watch(self) -> None:
        try:
            while not self._store.check([f"{self._key}/1"]):
                if self._left.wait(POLL_S):
                    return
            deadline = time.monotonic() + GRACE_S
            while not self._left.wait(POLL_S):
                if self._settling:  # waiting for ranks that arrive or leave: not in a collective
                    deadline = time.monotonic() + GRACE_S
                elif time.monotonic() >= deadline:
                    break
            else:
                return
            with self._lock:
                if self._left.is_set():
                    return
                self._count_out()
                failure = self.reported()
                if self._on_stuck is not None:
                    self._on_stuck()
                self.own_stack(failure)
                code = report(failure)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # the main thread waits in a collective that never completes: nothing else ends it
        except RuntimeError:  # the store is gone with the rank that hosted it: the launcher stops this one
            return


def _fields(failure: HftkError | None) -> list[str] | None:
    return None if failure is None else [failure.field, failure.problem, failure.fix]


@contextlib.contextmanager
def watching(describe: Callable[[BaseException], HftkError], on_stuck: Callable[[], None] | None = None,
             choose: Choose = first_posted) -> Iterator[FailureWatch]:
    """A :class:`FailureWatch` over the body: an exception out of it leaves as the one line
    (:meth:`FailureWatch.fail`; ``describe`` returns an error that already is one as it is)."""
    watch = FailureWatch(on_stuck, choose)
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
