"""``scripts/finetune.py`` with GRPO's completions pinned by ``tests.grpo_rollouts.seeded_per_row`` (its module
doc says why); test-only, no product code."""

from __future__ import annotations

import sys

from hftk.run.prepare import main
from tests.grpo_rollouts import install

install()

if __name__ == "__main__":
    sys.exit(main())
