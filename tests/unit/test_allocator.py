"""glibc told to give freed memory back (hftk.allocator): freed blocks really leave the RSS, a
user's own setting wins, and nothing is touched off glibc."""

from __future__ import annotations

import sys

from hftk import allocator


def test_nothing_changes_off_glibc(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator.return_freed_memory() == {}
