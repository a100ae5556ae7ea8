"""Writes the torch elastic variables a worker sees to the JSON file named by argv[1] (rank 0 only)."""

import json
import os
import sys

if os.environ.get("RANK") == "0":
    with open(sys.argv[1], "w") as f:
        json.dump({k: v for k, v in os.environ.items() if k.startswith("TORCHELASTIC_")}, f)
