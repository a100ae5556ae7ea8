"""Packed data whose block count does not divide over ranks x batch, and an eval set of one block
(issue 18, long-run faults): every engine on 2 ranks finishes (under a timeout), every rank takes
part in every optimizer step, every evaluation runs on every rank (the per-batch agreement of
``resilience.check_evaluation`` would hang a rank left out: the timeout fails it),
and the final eval loss is that of the one block, computed in this process by a plain
``transformers.Trainer`` on the run's final weights.

One run per strategy: ddp, fsdp and zero3 (the Trainer), pipeline, tp, cp and sp (hftk's custom loop,
``engine/loop``); one 2-rank launch per engine (``finetune_cells``). Two epochs, so the uneven
remainder meets an epoch boundary. Both engines take the Trainer's rule for the remainder: the sharded
loader fills the last batch with repeated blocks (accelerate's ``even_batches``); the custom loop's
strategies here have one data-parallel replica, so their last batch is short.
"""

from __future__ import annotations

import math

import pytest

from tests.helpers import finetune_cells, metrics, tiny_blocks, tiny_eval_loss

BATCH, RANKS, EPOCHS = 2, 2, 2
# 24 raw rows of the built-in corpus: 9 training blocks of 64 tokens, and the held-out rows make one.
ARGS = ["--model_name_or_path", "builtin:llama-tiny", "--max_train_samples", "24", "--eval_fraction", "0.1",
        "--max_eval_samples", "1", "--eval_strategy", "steps", "--eval_steps", "2", "--num_train_epochs", str(EPOCHS),
        "--per_device_train_batch_size", str(BATCH), "--per_device_eval_batch_size", str(BATCH)]
STRATEGIES = {"ddp": [], "fsdp": ["--strategy", "fsdp"], "zero3": ["--strategy", "zero3"],
              "pipeline": ["--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "2"],
              "tp": ["--strategy", "tp", "--tp_size", "2"], "cp": ["--strategy", "cp", "--cp_size", "2"],
              "sp": ["--strategy", "sp", "--sp_size", "2"]}


def steps_per_epoch(strategy: str, blocks: int) -> int:
    """Optimizer steps of one epoch (module docstring): the custom loop's strategies here have one
    data-parallel replica, the Trainer's two."""
    return math.ceil(blocks / (BATCH * (RANKS if strategy in ("ddp", "fsdp", "zero3") else 1)))


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_uneven_blocks_and_a_one_block_eval_keep_every_rank_in_step(tmp_path):
    from transformers import AutoModelForCausalLM

    data = tiny_blocks(tmp_path, ARGS)
    blocks = len(data.train)
    assert blocks % (BATCH * RANKS) and blocks % BATCH and len(data.eval) == 1, (blocks, len(data.eval))
    outputs = finetune_cells(RANKS, {name: [*ARGS, *extra, "--output_dir", str(tmp_path / name)]
                                     for name, extra in STRATEGIES.items()}, tmp_path, timeout=900)
    for name in STRATEGIES:
        records = metrics(tmp_path / name)
        steps = EPOCHS * steps_per_epoch(name, blocks)
        assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1)), (name, outputs[name][-3000:])
        # one all_gather of every rank's step time per logged step: both ranks were in each one
        ranks = {r["step"]: r["rank_stats"]["step_time_s"] for r in records if "rank_stats" in r}
        assert sorted(ranks) == list(range(1, steps + 1)) and all(
            len(t) == RANKS and None not in t for t in ranks.values()), (name, ranks)
        evals = [r for r in records if "eval_loss" in r]
        assert [r["step"] for r in evals] == sorted({*range(2, steps + 1, 2), steps}), (name, evals)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name / "final")
        want = tiny_eval_loss(model, tmp_path / f"{name}-ref", max_blocks=1, args=ARGS)
        assert evals[-1]["eval_loss"] == pytest.approx(want, abs=1e-5), (name, evals[-1], want)
