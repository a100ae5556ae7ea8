"""The ``hftk`` command: ``train`` plus the tools around a run (configs, plan, export, push, bench)."""

from __future__ import annotations

import argparse
import sys

from hftk import __version__
from hftk.errors import HftkError


def _train(rest: list[str]) -> int:
    from hftk.run import main

    return main(rest)


def _configs(rest: list[str]) -> int:
    from hftk.launch import configs_command

    return configs_command(rest)


def _plan(rest: list[str]) -> int:
    from hftk.plan import plan_command

    return plan_command(rest)


def _push(rest: list[str]) -> int:
    from hftk.hub import push_command

    return push_command(rest)


def _export(rest: list[str]) -> int:
    from hftk.export import main

    return main(rest)


def _bench(rest: list[str]) -> int:
    from hftk.bench.cli import bench_command

    return bench_command(rest)


# name -> (help, handler taking the remaining argv). Each handler parses its own options.
COMMANDS = {
    "train": ("Fine-tune in this process, or under a launcher (same options as scripts/finetune.py).", _train),
    "push": ("Push a final folder or a checkpoint to the Hub with a generated model card.", _push),
    "configs": ("Write the accelerate launch configs and DeepSpeed JSON of every strategy.", _configs),
    "plan": ("Per-rank memory of every strategy for a model (config only, no weights); the pick for auto.", _plan),
    "export": ("Turn any strategy's checkpoint into a standard HF folder (safetensors, config, tokenizer).", _export),
    "bench": ("Measure scaling, memory, communication, pipeline, batch size and overhead; one report folder.", _bench),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hftk", description="Fine-tune Hugging Face causal LMs past one GPU.")
    parser.add_argument("--version", action="version", version=f"hftk {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.parse_args(argv[:1])  # prints argparse's "invalid choice" message and exits 2
    try:
        return COMMANDS[argv[0]][1](argv[1:])
    except HftkError as exc:
        print(f"hftk: error: {exc.one_line()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
