"""Packing on several processes: bfd under every Trainer engine family, the pipeline and tp gives the
losses of one process and every packing mode resumes exactly.

The in-process exactness checks (an example packed by best-fit decreasing gives the logits of the same
example alone, through the collator, the pipeline stages and the mesh step's batch) are in
tests/unit/data/test_dataset.py, tests/unit/strategies/test_pipeline.py and tests/unit/strategies/test_mesh.py;
where each strategy stands (``hftk.config.support.PACKING_SUPPORT``) in tests/unit/config/test_support.py.
"""

from __future__ import annotations

import pytest


def varied_conversations(path, n: int = 48) -> str:
    """Conversations of 20..~230 tokens (gpt2-tiny's tokenizer): bfd puts several in one block."""
    import json

    rows_ = [{"messages": [{"role": "user", "content": f"Say {i}: " + "and the light " * (i * 7 % 23)},
                           {"role": "assistant", "content": "It was good. " * (1 + i * 5 % 13)}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bfd_trains_on_two_ranks_with_one_process_losses_and_every_packing_resumes_exactly(tmp_path):
    """Every Trainer engine family (DDP, FSDP2, ZeRO-3, LoRA under DDP) under bfd on 2 gloo ranks
    gives the per-step losses of one process (2 x 2 packed rows = 4 rows per step either way, 4 steps
    inside the first epoch: an epoch's short last batch is filled with repeated rows on 2 ranks). For
    each packing mode (bfd and none on conversations, concat on plain text), a run resumed from its
    step-2 checkpoint logs the uninterrupted run's steps 3-4 and ends on its final weights (the packed
    order is part of the data position). One 2-rank launch runs every cell (``finetune_cells``)."""
    from tests.helpers import finetune, finetune_cells, load_weights, losses, max_weight_diff, metrics

    data = varied_conversations(tmp_path / "chat.jsonl", n=64)
    steps = ["--eval_fraction", "0", "--max_steps", "4", "--max_train_samples", "64",
             "--per_device_train_batch_size", "2"]
    chat = ["--chat_template", "chatml", "--dataset", data, "--block_size", "256", *steps]
    common = [*chat, "--packing", "bfd"]
    lora = ["--lora_r", "8", "--adam_epsilon", "1e-4"]
    for name, extra in {"single": [], "lora_single": lora}.items():
        finetune(1, [*common, *extra, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / name)])
    save = ["--save_strategy", "steps", "--save_steps", "2"]
    modes = {"bfd": common, "none": [*chat, "--packing", "none"], "concat": [*steps, "--packing", "concat"]}
    cells = {"fsdp": [*common, "--strategy", "fsdp"], "zero3": [*common, "--strategy", "zero3"],
             "lora_ddp": [*common, *lora]}
    for mode, args in modes.items():  # the uninterrupted run first: its checkpoint-2 is the resumed run's start
        cells[mode] = [*args, *save]
        cells[f"{mode}_resumed"] = [*args, "--resume_from_checkpoint", str(tmp_path / mode / "checkpoint-2")]
    finetune_cells(2, {name: [*args, "--output_dir", str(tmp_path / name)] for name, args in cells.items()},
                   tmp_path, timeout=1100)
    assert max(m["epoch"] for m in metrics(tmp_path / "single") if "loss" in m) <= 1  # 4 steps in one epoch
    single, lora_single = losses(tmp_path / "single"), losses(tmp_path / "lora_single")
    assert len(single) == 4
    for name in ("bfd", "fsdp", "zero3", "lora_ddp"):
        ref = lora_single if name.startswith("lora") else single
        got = losses(tmp_path / name)
        assert got.keys() == ref.keys() and all(abs(got[s] - ref[s]) < 1e-5 for s in ref), (name, got, ref)
    for mode in modes:
        resumed, uninterrupted = losses(tmp_path / f"{mode}_resumed"), losses(tmp_path / mode)
        assert sorted(resumed) == [3, 4], (mode, resumed)
        assert all(resumed[s] == pytest.approx(uninterrupted[s], abs=1e-6) for s in resumed), \
            (mode, resumed, uninterrupted)
        diff = max_weight_diff(load_weights(tmp_path / mode / "final"),
                               load_weights(tmp_path / f"{mode}_resumed" / "final"))
        assert diff < 1e-6, f"{mode}: resumed final weights differ from the uninterrupted run's by {diff}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bfd_under_pipeline_and_tp_trains_like_one_process_and_resumes_exactly(tmp_path):
    """bfd through the engines the Trainer cannot drive, on 2 gloo ranks: a 2-stage pipeline (GPT-2, 2
    micro-batches) logs the per-step losses of a one-process Trainer bfd run (same sampler: the loop's is
    the Trainer's), tp 2 (Llama, the mesh loop) those of the mesh loop on one process; each resumed from
    its step-2 checkpoint logs the uninterrupted steps 3-4. Launches shared per engine (finetune_cells)."""
    from tests.helpers import finetune_cells, losses

    data = varied_conversations(tmp_path / "chat.jsonl", n=64)
    common = ["--chat_template", "chatml", "--dataset", data, "--block_size", "256", "--packing", "bfd",
              "--eval_fraction", "0", "--max_steps", "4", "--max_train_samples", "64",
              "--per_device_train_batch_size", "4"]
    gpt2, llama = ["--model_name_or_path", "builtin:gpt2-tiny4"], ["--model_name_or_path", "builtin:llama-tiny"]
    save = ["--save_strategy", "steps", "--save_steps", "2"]
    out = {name: str(tmp_path / name) for name in ("trainer", "mesh", "pipe", "pipe-resumed", "tp", "tp-resumed")}
    pipe = [*gpt2, *common, "--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "2"]
    tp = [*llama, *common, "--strategy", "tp", "--tp_size", "2"]
    finetune_cells(1, {"trainer": [*gpt2, *common, "--output_dir", out["trainer"]],
                       "mesh": [*llama, *common, "--strategy", "tp", "--output_dir", out["mesh"]]}, tmp_path)
    resumed = ["--resume_from_checkpoint", "latest"]
    finetune_cells(2, {"pipe": [*pipe, *save, "--output_dir", out["pipe"]],
                       "pipe-resumed": [*pipe, *resumed, "--output_dir", out["pipe-resumed"]],
                       "tp": [*tp, *save, "--output_dir", out["tp"]],
                       "tp-resumed": [*tp, *resumed, "--output_dir", out["tp-resumed"]]}, tmp_path,
                   options={f"{n}-resumed": {"copy": [tmp_path / n / "checkpoint-2", tmp_path / f"{n}-resumed" /
                                                      "checkpoint-2"]} for n in ("pipe", "tp")})
    for name, ref in {"pipe": "trainer", "tp": "mesh"}.items():
        expected, got = losses(tmp_path / ref), losses(tmp_path / name)
        assert sorted(expected) == sorted(got) == [1, 2, 3, 4], (name, got, expected)
        assert all(abs(got[s] - expected[s]) < 1e-5 for s in expected), (name, got, expected)
        again = losses(tmp_path / f"{name}-resumed")
        assert sorted(again) == [3, 4] and all(again[s] == pytest.approx(got[s], abs=1e-6) for s in again), name
