"""``scripts/finetune.py`` whose rank 0 runs out of room after its first atomic.

Once rank 0 has published ``checkpoint-<HFTK_FULL_AFTER_STEP>``, it lowers its file size limit
(``RLIMIT_FSIZE``) to ``HFTK_FULL_BYTES``: every later write past that size fails with EFBIG, as on a
full disk (SIGXFSZ, which would kill the process instead, is ignored, as a shell's ``ulimit -f`` user
would find it in most daemons). The other ranks run untouched.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
from pathlib import Path
from typing import Any

from hftk.checkpoint import atomic
from hftk.run.prepare import main

AFTER = f"checkpoint-{os.environ['HFTK_FULL_AFTER_STEP']}"
LIMIT = int(os.environ["HFTK_FULL_BYTES"])
publish = atomic.publish


def publish_then_fill(staged: Path, final: Path, *args: Any, **kwargs: Any) -> None:
    publish(staged, final, *args, **kwargs)
    if Path(final).name == AFTER:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


atomic.publish = publish_then_fill

if __name__ == "__main__":
    sys.exit(main())
