"""How a finished rank leaves: trackers finished, streams flushed, ``os._exit`` with the run's code.

Standard library only, so a worker that needs nothing else of hftk (a launch probe) imports no stack for it.
"""

from __future__ import annotations

import sys


def exit_without_teardown(code: int) -> None:
    """Leave a finished distributed run without the interpreter's C++ teardown.

    Everything is saved, pushed and flushed by now, and the engine has destroyed the process
    group; yet now and then a rank still aborted at interpreter exit ("terminate called without
    an active exception", a c10d/gloo thread destroyed while joinable), turning a complete run
    into a launcher failure. Finishing trackers and flushing here, then ``os._exit``, skips only
    that teardown. Every multi-process entry point (``hftk train``, the bench and test workers)
    leaves through here; never call it from a process that is not its own launch's worker.
    """
    import logging
    import os

    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
