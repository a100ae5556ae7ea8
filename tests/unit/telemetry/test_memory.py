"""Byte accounting (hftk.telemetry.memory): a buffer and its views are counted once."""

from __future__ import annotations

import torch


def test_byte_ranges_count_a_buffer_and_its_views_once():
    from hftk.telemetry.memory import ByteRanges

    flat = torch.zeros(100)
    ranges = ByteRanges()
    assert ranges.add([flat[:30], flat[30:100]]) == 400
    assert ranges.add([flat, flat[10:50]]) == 0
    assert ranges.add([torch.zeros(5, dtype=torch.float64)]) == 40
    other = ByteRanges()
    assert other.add([flat[60:80], flat[:10], flat[5:70]]) == 320
