"""Generation samples as a run reports them: ``samples.jsonl`` in the output folder, tensorboard text and a wandb
table through the reporters the Trainer (or the custom loop) already holds for ``report_to``.

The reporters' ``on_log`` keeps numbers only (tensorboard) or would log a string series (wandb), so the samples
go straight to the writer each reporter opened; their time reaches every sink as a plain log (``sample_time_s``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hftk.telemetry.metrics import append_jsonl

SAMPLES_FILE = "samples.jsonl"
TABLE_COLUMNS = ["step", "prompt", "completion", "num_tokens", "stop"]


def markdown(rows: list[dict[str, Any]]) -> str:
    """One tensorboard text entry for a step's samples (tensorboard renders markdown)."""
    return "\n\n".join(f"**prompt {i}** ({row['stop']}, {len(row['tokens'])} tokens): `{_text(row['prompt'])}`"
                       f"\n\n{row['completion']}" for i, row in enumerate(rows))


def _text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else " | ".join(f"{t['role']}: {t['content']}" for t in prompt)


def report_samples(rows: list[dict[str, Any]], output_dir: Path, callbacks: list[Any], args: Any, step: int) -> None:
    """Rank 0: append ``rows`` to ``samples.jsonl``, then hand them to tensorboard and wandb where they report."""
    from transformers.integrations import TensorBoardCallback, WandbCallback

    for row in rows:
        append_jsonl(Path(output_dir) / SAMPLES_FILE, row)
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback):
            if callback.tb_writer is None:  # as its own on_log does: it opens the writer lazily
                callback._init_summary_writer(args)
            callback.tb_writer.add_text("samples", markdown(rows), step)
            callback.tb_writer.flush()
        elif isinstance(callback, WandbCallback) and _wandb_run() is not None:
            import wandb

            table = wandb.Table(columns=TABLE_COLUMNS, data=[[row["step"], _text(row["prompt"]), row["completion"],
                                                              len(row["tokens"]), row["stop"]] for row in rows])
            wandb.log({"samples": table, "train/global_step": step})  # the step axis WandbCallback defines


def _wandb_run() -> Any:
    """The run WandbCallback started on rank 0 (None before its setup)."""
    import wandb

    return wandb.run
