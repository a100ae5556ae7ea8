"""Samples as a run reports them (hftk/telemetry/samples.py): ``samples.jsonl`` rows and tensorboard text,
read back with tensorboard's own reader."""

from __future__ import annotations

import json


def test_rows_go_to_the_file_and_to_tensorboard_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import TrainingArguments
    from transformers.integrations import TensorBoardCallback

    from hftk.telemetry.samples import SAMPLES_FILE, report_samples

    rows = [{"step": 2, "prompt": "In the beginning", "completion": " God created", "tokens": [1, 2], "stop": "length"},
            {"step": 2, "prompt": [{"role": "user", "content": "hi"}], "completion": "hello", "tokens": [3, 0],
             "stop": "eos"}]
    board = TensorBoardCallback()
    board.logging_dir = str(tmp_path / "runs")
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    report_samples(rows, tmp_path, [board], args, 2)
    assert [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()] == rows
    board.tb_writer.close()
    events = EventAccumulator(str(tmp_path / "runs"), size_guidance={"tensors": 0})
    events.Reload()
    [logged] = events.Tensors("samples/text_summary")
    text = logged.tensor_proto.string_val[0].decode()
    assert logged.step == 2 and " God created" in text and "user: hi" in text and "(eos, 2 tokens)" in text


def test_grpo_rollouts_go_to_completions_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import TrainingArguments
    from transformers.integrations import TensorBoardCallback

    from hftk.telemetry.samples import COMPLETIONS_FILE, TEXT_ROWS, report_completions

    rows = [{"step": 5, "split": "train", "prompt": f"{i} + 1 =", "completion": f" {i + 1}",
             "rewards": {"exact": 1.0, "short": None}, "advantage": 0.5} for i in range(TEXT_ROWS + 2)]
    board = TensorBoardCallback()
    board.logging_dir = str(tmp_path / "runs")
    report_completions(rows, tmp_path, [board], TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]), 5)
    assert [json.loads(line) for line in (tmp_path / COMPLETIONS_FILE).read_text().splitlines()] == rows
    board.tb_writer.close()
    events = EventAccumulator(str(tmp_path / "runs"), size_guidance={"tensors": 0})
    events.Reload()
    [logged] = events.Tensors("completions/text_summary")
    text = logged.tensor_proto.string_val[0].decode()
    assert logged.step == 5 and "reward exact 1.0, short None, advantage 0.5: `0 + 1 =`" in text
    assert f"(2 more in {COMPLETIONS_FILE})" in text and f"{TEXT_ROWS + 1} + 1 =" not in text
