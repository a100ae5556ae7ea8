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
