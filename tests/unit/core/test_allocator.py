"""glibc told to give freed memory back (hftk.core.allocator): nothing is touched off glibc (what it frees:
tests/integration/test_allocator.py, in fresh processes)."""

from __future__ import annotations

import sys

from hftk.core import allocator


def test_nothing_changes_off_glibc(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator.return_freed_memory() == {}
