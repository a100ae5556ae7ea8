"""hftk/core/teardown.py: a finished rank leaves with its code and its output flushed, importing no stack."""

from __future__ import annotations

import subprocess
import sys

LEAVE = """
import sys
from hftk.core.teardown import exit_without_teardown
print("written, not yet flushed", end="")
print(sorted(m for m in ("torch", "transformers") if m in sys.modules), file=sys.stderr, end="")
exit_without_teardown(7)
print("never")
"""


def test_leaves_with_the_code_and_the_buffered_output_and_imports_no_library():
    done = subprocess.run([sys.executable, "-c", LEAVE], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (7, "written, not yet flushed", "[]")
