"""Push a run's model to the Hugging Face Hub: model card, background uploads, retries.

hftk pushes instead of the Trainer (whose own push is switched off, so nothing is pushed
twice), through ``huggingface_hub.HfApi`` (``create_repo`` + ``upload_folder``: one commit per
push). What goes up, by ``training.hub_strategy``:

- ``end``: the consolidated final folder (safetensors, config, tokenizer, or a LoRA adapter; with
  ``hub.hub_push_merged`` the adapter merged into the base model) plus a generated ``README.md``
  model card naming the base model, once training is over.
- ``every_save``: also the model files of each checkpoint as it is saved (checkpoints of
  sharded strategies hold no consolidated weights: those pushes are reported as skipped).
- ``checkpoint``: also the whole newest checkpoint under ``last-checkpoint/`` (resumable).
- ``all_checkpoints``: also every checkpoint under ``checkpoint-N/``.

Uploads run on one background thread from hard-linked snapshots (rotation may delete a
checkpoint while it uploads); a checkpoint push still waiting when a newer one arrives is
dropped. Each push is tried ``hub.hub_upload_retries`` times with exponential backoff; its
outcome goes to the log and ``metrics.jsonl``, and a failure never stops training. The final
push is waited for. The repository is private unless ``training.hub_private_repo`` is false.

The token comes from ``HF_TOKEN`` or the saved login (``hf auth login``), read by
huggingface_hub itself; hftk never takes it as an option, prints it, logs it or writes it.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from huggingface_hub import HfApi, constants, get_token

from hftk.checkpoint.run_record import CARD_FILE, RUN_FILE, find_run_record, run_record, write_run_files
from hftk.core.errors import HftkError

UPLOAD_DIR = ".hub-upload"  # snapshots waiting for upload, under the output dir
MODEL_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json", "adapter_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "*.tiktoken", "chat_template.jinja", "chat_template.json",
    CARD_FILE, RUN_FILE,
)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
NEVER_PUSHED = ("hftk_complete.json", "hftk_complete.json.tmp")

logger = logging.getLogger(__name__)


def redact(text: str) -> str:
    """``text`` with the Hub token (if any is configured) replaced: error messages may quote requests."""
    token = get_token()
    return text.replace(token, "***") if token else text


@dataclass
class PushJob:
    """One commit: ``folder`` is laid out as the repository should receive it."""

    folder: Path
    label: str  # what is pushed, for the report ("final", "checkpoint-40")
    step: int
    message: str
    delete_patterns: list[str] = field(default_factory=list)
    owned: bool = True  # folder is a snapshot: delete it after the push


def push_folder(job: PushJob, repo_id: str, private: bool, retries: int, backoff_s: float) -> dict[str, Any]:
    """``create_repo`` + ``upload_folder`` with retries; returns the outcome, never raises for Hub errors."""
    api = HfApi()
    error = ""
    for attempt in range(1, retries + 1):
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = api.upload_folder(repo_id=repo_id, folder_path=str(job.folder), commit_message=job.message,
                                     delete_patterns=job.delete_patterns or None)
            return {"hub_push": "ok", "hub_target": job.label, "hub_attempts": attempt, "hub_commit": info.oid}
        except Exception as exc:  # any failure of one attempt: network, HTTP, server  # noqa: BLE001
            error = redact(f"{type(exc).__name__}: {exc}")
            logger.warning("hub push of %s to %s, attempt %d/%d failed: %s", job.label, repo_id, attempt, retries,
                           error.splitlines()[0] if error else "")
            if attempt < retries:
                time.sleep(backoff_s * 2 ** (attempt - 1))
    return {"hub_push": "failed", "hub_target": job.label, "hub_attempts": retries, "hub_error": error[:500]}


class HubPusher:
    """One background thread draining a queue of :class:`PushJob`; ``report`` receives each outcome."""

    def __init__(self, repo_id: str, private: bool, retries: int, backoff_s: float,
                 report: Callable[[int, dict[str, Any]], None]) -> None:
        self.repo_id, self.private, self.retries, self.backoff_s = repo_id, private, retries, backoff_s
        self.report = report
        self.outcomes: list[dict[str, Any]] = []
        self._pending: list[PushJob] = []
        self._busy = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hftk-hub-push", daemon=True)
        self._thread.start()

    def submit(self, job: PushJob, supersede: bool = False) -> None:
        """Queue ``job``; with ``supersede`` drop queued jobs of the same kind that have not started."""
        with self._cond:
            if supersede:
                for old in [j for j in self._pending if j.delete_patterns == job.delete_patterns]:
                    self._pending.remove(old)
                    self._finish(old, {"hub_push": "superseded", "hub_target": old.label})
            self._pending.append(job)
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until every queued push has finished (succeeded or failed)."""
        with self._cond:
            while self._pending or self._busy:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                job = self._pending.pop(0)
                self._busy = True
            outcome = push_folder(job, self.repo_id, self.private, self.retries, self.backoff_s)
            with self._cond:
                self._finish(job, outcome)
                self._busy = False
                self._cond.notify_all()

    def _finish(self, job: PushJob, outcome: dict[str, Any]) -> None:
        if job.owned:
            shutil.rmtree(job.folder, ignore_errors=True)
        self.outcomes.append(outcome)
        self.report(job.step, outcome)


def snapshot(files: dict[str, Path], dest: Path) -> Path:
    """Hard-link ``files`` (repository path -> local file) under ``dest`` (copies across filesystems)."""
    for rel, src in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, target)
        except OSError:
            shutil.copy2(src, target)
    return dest


def folder_files(folder: Path, patterns: tuple[str, ...] | None = None, prefix: str = "") -> dict[str, Path]:
    """Files under ``folder`` (top level only when ``patterns`` is given), keyed by repository path."""
    paths = sorted(Path(folder).rglob("*") if patterns is None else Path(folder).iterdir())
    return {prefix + path.relative_to(folder).as_posix(): path for path in paths
            if path.is_file() and path.name not in NEVER_PUSHED
            and (patterns is None or any(fnmatch.fnmatch(path.name, p) for p in patterns))}


def has_weights(folder: Path) -> bool:
    return any(fnmatch.fnmatch(p.name, w) for p in Path(folder).iterdir() if p.is_file() for w in WEIGHT_PATTERNS)


class RunPusher:
    """Pushes one training run: checkpoints as they are published (per hub_strategy), then the final folder."""

    def __init__(self, cfg: Any, args: Any, world_size: int, data_format: str, metrics_path: Path,
                 data_parallel_size: int | None = None) -> None:
        self.cfg, self.args, self.world_size, self.data_format = cfg, args, world_size, data_format
        self.data_parallel_size = data_parallel_size
        self.repo_id: str = args.hub_model_id
        self.strategy = getattr(args.hub_strategy, "value", args.hub_strategy)
        self.uploads = Path(args.output_dir) / UPLOAD_DIR
        self.metrics_path = metrics_path
        private = args.hub_private_repo if args.hub_private_repo is not None else True
        self.pusher = HubPusher(self.repo_id, private, cfg.hub.hub_upload_retries, cfg.hub.hub_retry_backoff_s,
                                self._report)
        self._count = 0

    def _report(self, step: int, outcome: dict[str, Any]) -> None:
        from hftk.telemetry.metrics import append_jsonl

        append_jsonl(self.metrics_path, {"step": step, **outcome})
        text = ", ".join(f"{k}={v}" for k, v in outcome.items() if k != "hub_error")
        if outcome["hub_push"] == "failed":
            logger.warning("hub push FAILED (%s): %s", text, outcome.get("hub_error", ""))
        else:
            logger.info("hub push %s", text)

    def _snapshot_dir(self, label: str) -> Path:
        self._count += 1
        return self.uploads / f"{self._count:05d}-{label}"

    def checkpoint_published(self, checkpoint: Path) -> None:
        """``after_publish`` hook of :func:`hftk.checkpoint.atomic.install_atomic_checkpoints` (publisher only); it runs
        between two barriers of the save, so any failure here is reported, never raised."""
        if self.strategy == "end":
            return
        step = int(checkpoint.name.rsplit("-", 1)[1])
        try:
            self._queue_checkpoint(checkpoint, step)
        except Exception as exc:  # a snapshot that cannot be made (disk full, ...) must not stop training  # noqa: BLE001
            self._report(step, {"hub_push": "failed", "hub_target": checkpoint.name, "hub_attempts": 0,
                                "hub_error": redact(f"{type(exc).__name__}: {exc}")})

    def _queue_checkpoint(self, checkpoint: Path, step: int) -> None:
        weights = has_weights(checkpoint)
        files = folder_files(checkpoint, MODEL_PATTERNS) if weights else {}
        if not weights and self.strategy == "every_save":
            self._report(step, {"hub_push": "skipped", "hub_target": checkpoint.name,
                                "hub_error": "the checkpoint holds no consolidated weights; the final push carries them"})
            return
        delete: list[str] = []
        if self.strategy == "checkpoint":
            files.update(folder_files(checkpoint, prefix="last-checkpoint/"))
            delete = ["last-checkpoint/*"]
        elif self.strategy == "all_checkpoints":
            files.update(folder_files(checkpoint, prefix=f"{checkpoint.name}/"))
        dest = snapshot(files, self._snapshot_dir(checkpoint.name))
        if weights:
            record = run_record(self.cfg, self.args, self.world_size, self.data_format, step,
                                _trainer_state_metrics(checkpoint), self.data_parallel_size)
            write_run_files(dest, record, self.repo_id)
        self.pusher.submit(PushJob(dest, checkpoint.name, step, f"hftk: {checkpoint.name}", delete),
                           supersede=self.strategy != "all_checkpoints")

    def push_final(self, final: Path, step: int) -> dict[str, Any]:
        """Push the final folder (it already holds the card) after any queued checkpoint; wait for it."""
        if self.cfg.hub.hub_push_merged:  # LoRA: the base model with the adapter merged in, not the adapter
            from hftk.models.lora import export_adapter

            dest = self._snapshot_dir("final")
            export_adapter(final, dest, merge=True, repo_id=self.repo_id)  # its model card included
        else:
            dest = snapshot(folder_files(final), self._snapshot_dir("final"))
        self.pusher.submit(PushJob(dest, "final", step, "hftk: final model"))
        self.pusher.wait()
        outcome = self.pusher.outcomes[-1]
        if outcome["hub_push"] == "ok":
            print(f"hftk: pushed {final} to {self.repo_id} (commit {outcome['hub_commit']})", file=sys.stderr, flush=True)
        else:
            print(f"hftk: pushing {final} to {self.repo_id} failed after {outcome['hub_attempts']} attempts "
                  f"({outcome.get('hub_error', '').splitlines()[0] if outcome.get('hub_error') else 'no detail'}); "
                  f"the model is safe on disk: retry with `hftk push {final} {self.repo_id}`", file=sys.stderr, flush=True)
        shutil.rmtree(self.uploads, ignore_errors=True)
        return outcome


def _trainer_state_metrics(checkpoint: Path) -> dict[str, float]:
    """The newest training loss and evaluation metrics recorded in a checkpoint's trainer_state.json."""
    path = checkpoint / "trainer_state.json"
    history = json.loads(path.read_text()).get("log_history", []) if path.is_file() else []
    return {key: entry[key] for entry in history for key in ("loss", "eval_loss", "eval_perplexity", "train_loss")
            if key in entry}


def run_pusher(prepared: Any, trainer: Any, metrics_path: Path) -> RunPusher | None:
    """The pusher of a Trainer run: on the main process of a run with push_to_hub, else None."""
    if not prepared.cfg.training.get("push_to_hub") or trainer.args.process_index != 0:
        return None
    return RunPusher(prepared.cfg, trainer.args, prepared.world_size, prepared.data_format, metrics_path)


def build_parser() -> argparse.ArgumentParser:
    """``hftk push``'s options (also rendered on the documentation's command reference)."""
    parser = argparse.ArgumentParser(prog="hftk push", description="Push a trained model (final folder or "
                                     "checkpoint) to the Hub with a generated model card. The token comes from "
                                     "HF_TOKEN or `hf auth login`.")
    parser.add_argument("folder", type=Path, help="output_dir/final, or a checkpoint-N folder")
    parser.add_argument("repo_id", help="user/name on the Hub")
    parser.add_argument("--public", action="store_true", help="create the repository public (default: private)")
    parser.add_argument("--retries", type=int, default=5, help="attempts before giving up")
    parser.add_argument("--retry_backoff_s", type=float, default=2.0, help="first wait between attempts (doubles)")
    return parser


def push_command(argv: list[str]) -> int:
    """``hftk push FOLDER REPO_ID``: a final folder or any checkpoint (consolidated first when sharded)."""
    from hftk.checkpoint.atomic import CHECKPOINT_RE  # not at the top: importing hub must not import torch

    args = build_parser().parse_args(argv)
    check_can_push("repo_id")
    folder: Path = args.folder
    if not folder.is_dir():
        raise HftkError("folder", f"{folder} is not a folder.", "pass output_dir/final or a checkpoint-N folder.")
    with tempfile.TemporaryDirectory(prefix="hftk-push-") as tmp:
        dest = Path(tmp) / "repo"
        source = folder
        if not has_weights(folder):
            from hftk.publish.export import export

            source = Path(tmp) / "exported"
            export(folder, source)
        # a checkpoint's optimizer / RNG / trainer state stay home; a final or exported folder goes whole
        is_checkpoint = CHECKPOINT_RE.match(folder.name) is not None
        snapshot(folder_files(source, MODEL_PATTERNS if source is folder and is_checkpoint else None), dest)
        record = find_run_record(folder)
        if not (dest / CARD_FILE).is_file():
            if record is None:
                raise HftkError("folder", f"no {RUN_FILE} in {folder} or its parent to write the model card from.",
                                "push a folder written by an hftk run (output_dir/final or output_dir/checkpoint-N).")
            if is_checkpoint:
                record = {**record, "global_step": int(folder.name.rsplit("-", 1)[1]),
                          "metrics": _trainer_state_metrics(folder)}
            write_run_files(dest, record, args.repo_id)
        step = record["global_step"] if record else 0
        outcome = push_folder(PushJob(dest, folder.name, step, f"hftk push {folder.name}", owned=False),
                              args.repo_id, private=not args.public, retries=args.retries,
                              backoff_s=args.retry_backoff_s)
    if outcome["hub_push"] != "ok":
        print(f"hftk: push failed after {outcome['hub_attempts']} attempts: {outcome.get('hub_error', '')}",
              file=sys.stderr)
        return 1
    print(f"hftk: pushed {folder} to {args.repo_id} (commit {outcome['hub_commit']})")
    return 0


def check_can_push(field_name: str) -> None:
    """Fail before any work when no upload could succeed: offline mode, or no token anywhere."""
    if constants.HF_HUB_OFFLINE:
        raise HftkError(field_name, "HF_HUB_OFFLINE is set, so nothing can be pushed.", "unset HF_HUB_OFFLINE.")
    if not get_token():
        raise HftkError(field_name, "no Hugging Face token is configured.",
                        "export HF_TOKEN (a write token) or run `hf auth login`.")
