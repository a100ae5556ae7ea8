"""``hftk bench moe``'s rows and option checks (hftk/bench/moe.py), in one process: the launches are
tests/integration/test_bench.py's."""

from __future__ import annotations

import pytest

from hftk.bench.moe import check_options, device_implementations, rows
from hftk.core.errors import HftkError


def test_each_strategy_runs_the_devices_choice_then_ep_runs_the_other_implementations():
    table = rows(("ddp", "fsdp", "ep"), device_implementations())
    assert list(table) == ["ddp", "fsdp", "ep", "ep eager", "ep batched_mm"]  # the CPU's choice: grouped_mm
    assert table["fsdp"] == ["--strategy", "fsdp", "--experts_implementation", "grouped_mm"]
    assert table["ep eager"] == ["--strategy", "ep", "--experts_implementation", "eager"]


@pytest.mark.parametrize("options, field", [
    ({"strategies": ("ddp", "zero9")}, "strategy.strategy"),
    ({"implementations": ("fast_mm",)}, "--implementations"),
    ({"nproc": 1}, "--nproc"),
    ({"steps": 1}, "--steps"),
])
def test_bad_options_are_one_line_before_any_launch(options, field):
    with pytest.raises(HftkError) as caught:
        check_options(**options)
    assert caught.value.field == field
