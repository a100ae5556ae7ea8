"""``scripts/finetune.py`` whose every rank receives SIGTERM as scancel sends it, inside optimizer step
``HFTK_SIGTERM_AT_STEP`` of a run on hftk's custom loop (tp / cp / sp / ep: ``MeshStep``).

Test-only hooks, no product code: each rank signals itself (a real SIGTERM, handled by hftk's own handler) as
that step's first micro-batch starts, so the signal lands at the same step on every rank without a launcher
forwarding it (warm ranks have none). The run must save at that step and leave with 75.
"""

from __future__ import annotations

import os
import signal
import sys

import hftk.run.prepare
from hftk.strategies.mesh import MeshStep

AT_STEP = int(os.environ["HFTK_SIGTERM_AT_STEP"])
forward_backward = MeshStep.forward_backward
steps = 0


def signalled_forward_backward(self: MeshStep, windows: list) -> float:
    global steps
    steps += 1
    if steps == AT_STEP:
        os.kill(os.getpid(), signal.SIGTERM)
    return forward_backward(self, windows)


MeshStep.forward_backward = signalled_forward_backward

if __name__ == "__main__":
    sys.exit(hftk.run.prepare.main())
