#!/usr/bin/env python
"""Fine-tune a causal LM: `accelerate launch scripts/finetune.py --config run.yaml [--option value ...]`.

All logic lives in hftk; see `hftk train --help` for the options.
"""

import sys

from hftk.run.prepare import main

if __name__ == "__main__":
    sys.exit(main())
