"""The data bench's rows (hftk.bench.data): the padded modes take as many optimizer steps as bfd."""

from __future__ import annotations


def test_the_padded_modes_take_as_many_optimizer_steps_as_bfd():
    """hftk bench data compares packing modes at equal tokens and equal steps: 270 examples in 92 bfd rows
    are 12 steps of 2 ranks x 4 rows; one example per row needs 12 rows per rank for 12 steps (11 gave 13,
    the last a short one)."""
    import math

    from hftk.bench.data import padded_rows_per_rank

    for examples, rows, nproc, micro in ((270, 92, 2, 4), (270, 94, 2, 4), (1000, 250, 4, 8), (7, 7, 2, 4)):
        bfd_steps = math.ceil(rows / (nproc * micro))
        padded = padded_rows_per_rank({"train_examples": examples, "train_rows": rows}, nproc, micro)
        assert math.ceil(examples / (nproc * padded)) == bfd_steps
        assert padded == 1 or math.ceil(examples / (nproc * (padded - 1))) > bfd_steps  # the fewest rows
