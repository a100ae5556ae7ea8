"""Generation samples as a run reports them: ``samples.jsonl`` in the output folder, tensorboard text and a wandb
table through the reporters the Trainer (or the custom loop) already holds for ``report_to``; GRPO's rollouts the same
way (``completions.jsonl``).

The reporters' ``on_log`` keeps numbers only (tensorboard) or would log a string series (wandb), so the samples
go straight to the writer each reporter opened; their time reaches every sink as a plain log (``sample_time_s``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hftk.telemetry.metrics import append_jsonl

SAMPLES_FILE = "samples.jsonl"
TABLE_COLUMNS = ["step", "prompt", "completion", "num_tokens", "stop"]
COMPLETIONS_FILE = "completions.jsonl"
TEXT_ROWS = 16  # rollouts per tensorboard text entry (the file and the wandb table hold every one)


def markdown(rows: list[dict[str, Any]]) -> str:
    """One tensorboard text entry for a step's samples (tensorboard renders markdown)."""
    return "\n\n".join(f"**prompt {i}** ({row['stop']}, {len(row['tokens'])} tokens): `{_text(row['prompt'])}`"
                       f"\n\n{row['completion']}" for i, row in enumerate(rows))


def _text(prompt: Any) -> str:
    """A prompt or completion as one string (a message list: role: content, joined)."""
    return prompt if isinstance(prompt, str) else " | ".join(f"{t['role']}: {t['content']}" for t in prompt)


def report_samples(rows: list[dict[str, Any]], output_dir: Path, callbacks: list[Any], args: Any, step: int) -> None:
    """Rank 0: append ``rows`` to ``samples.jsonl``, then hand them to tensorboard and wandb where they report."""
    for row in rows:
        append_jsonl(Path(output_dir) / SAMPLES_FILE, row)
    _report(callbacks, args, step, "samples", markdown(rows), TABLE_COLUMNS,
            [[row["step"], _text(row["prompt"]), row["completion"], len(row["tokens"]), row["stop"]] for row in rows])


def completions_markdown(rows: list[dict[str, Any]]) -> str:
    """One tensorboard text entry for a logging step's rollouts (the first :data:`TEXT_ROWS`)."""
    shown = [f"**{i}** reward {_rewards(row)}, advantage {row['advantage']}: `{_text(row['prompt'])}`\n\n"
             f"{_text(row['completion'])}" for i, row in enumerate(rows[:TEXT_ROWS])]
    more = [f"({len(rows) - TEXT_ROWS} more in {COMPLETIONS_FILE})"] if len(rows) > TEXT_ROWS else []
    return "\n\n".join(shown + more)


def _rewards(row: dict[str, Any]) -> str:
    return ", ".join(f"{name} {value}" for name, value in row["rewards"].items())


def report_completions(rows: list[dict[str, Any]], output_dir: Path, callbacks: list[Any], args: Any,
                       step: int) -> None:
    """Rank 0: append GRPO's rollouts to ``completions.jsonl`` (step, split, prompt, completion, each reward
    function's reward, advantage), then hand them to tensorboard and wandb where they report."""
    for row in rows:
        append_jsonl(Path(output_dir) / COMPLETIONS_FILE, row)
    names = list(rows[0]["rewards"]) if rows else []
    _report(callbacks, args, step, "completions", completions_markdown(rows),
            ["step", "split", "prompt", "completion", *names, "advantage"],
            [[row["step"], row["split"], _text(row["prompt"]), _text(row["completion"]),
              *(row["rewards"][n] for n in names), row["advantage"]] for row in rows])


def _report(callbacks: list[Any], args: Any, step: int, key: str, text: str, columns: list[str],
            data: list[list[Any]]) -> None:
    """``text`` to the tensorboard writer and a ``columns`` x ``data`` table to the wandb run, under ``key``,
    where the run reports to them."""
    from transformers.integrations import TensorBoardCallback, WandbCallback

    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback):
            if callback.tb_writer is None:  # as its own on_log does: it opens the writer lazily
                callback._init_summary_writer(args)
            callback.tb_writer.add_text(key, text, step)
            callback.tb_writer.flush()
        elif isinstance(callback, WandbCallback) and _wandb_run() is not None:
            import wandb

            wandb.log({key: wandb.Table(columns=columns, data=data), "train/global_step": step})  # its step axis


def _wandb_run() -> Any:
    """The run WandbCallback started on rank 0 (None before its setup)."""
    import wandb

    return wandb.run
