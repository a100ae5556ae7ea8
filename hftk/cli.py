"""The ``hftk`` command: ``train`` plus the tools around a run (configs, plan, export, push, bench)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

from hftk import __version__
from hftk.core.errors import HftkError, report

# name -> (help, "module:handler", "module:parser builder" or None). Handlers take the remaining argv and parse
# their own options; they are imported only when their command runs, so `hftk --help` stays fast. The parser
# builders are what the documentation's command reference renders (hftk.reference); None: the command takes the
# typed config's options (hftk.config.options), which the options reference lists.
COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "train": ("Fine-tune in this process, or under a launcher (same options as scripts/finetune.py).",
              "hftk.run.prepare:main", None),
    "preprocess": ("Tokenise, template, mask and pack the run's data once (save_to_disk); train with --tokenized_path.",
                   "hftk.run.prepare:preprocess_command", None),
    "push": ("Push a final folder or a checkpoint to the Hub with a generated model card.", "hftk.publish.hub:push_command",
             "hftk.publish.hub:build_parser"),
    "configs": ("Write the accelerate launch configs and DeepSpeed JSON of every strategy.",
                "hftk.launch.configs:configs_command", "hftk.launch.configs:build_parser"),
    "plan": ("Per-rank memory of every strategy for a model (config only, no weights); the pick for auto.",
             "hftk.plan.estimate:plan_command", "hftk.plan.estimate:build_parser"),
    "export": ("Turn any strategy's checkpoint into a standard HF folder (safetensors, config, tokenizer).",
               "hftk.publish.export:main", "hftk.publish.export:build_parser"),
    "generate": ("Generate from any checkpoint (final, checkpoint-N of any strategy, LoRA / QLoRA adapter); streams tokens.",
                 "hftk.publish.generate:main", "hftk.publish.generate:build_parser"),
    "bench": ("Measure scaling, memory, communication, pipeline, batch size, overhead, packing and start-up; "
              "one report folder.", "hftk.bench.cli:bench_command", "hftk.bench.cli:build_parsers"),
}


def _handler(name: str) -> Callable[[list[str]], int]:
    module, function = COMMANDS[name][1].split(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hftk", description="Fine-tune Hugging Face causal LMs past one GPU.")
    parser.add_argument("--version", action="version", version=f"hftk {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, *_) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.parse_args(argv[:1])  # prints argparse's "invalid choice" message and exits 2
    try:
        return _handler(argv[0])(argv[1:])
    except HftkError as exc:
        return report(exc)


if __name__ == "__main__":
    sys.exit(main())
