"""The documentation's reference pages (hftk/reference.py): the committed pages are exactly what the code renders,
a changed option help changes the page, and the pages name every option and every command argument."""

from __future__ import annotations

import copy
import dataclasses
import types

import pytest

from hftk import reference
from tests.helpers import ROOT

PAGES = ROOT / "docs" / "reference"


@pytest.mark.parametrize("name", sorted(reference.PAGES))
def test_the_committed_page_is_the_rendered_one(name):
    committed = (PAGES / name).read_text()
    assert reference.PAGES[name]() == committed, "regenerate it: python -m hftk.reference docs/reference"


def test_a_changed_option_help_fails_the_equality(monkeypatch):
    """The check above can fail: an option whose help changes without the page."""
    from hftk.config.options import ModelConfig

    fields = ModelConfig.__dataclass_fields__
    changed = copy.copy(fields["lora_r"])
    changed.metadata = types.MappingProxyType({**fields["lora_r"].metadata, "help": "LoRA rank, reworded."})
    monkeypatch.setitem(fields, "lora_r", changed)
    rendered = reference.options_page()
    assert rendered != (PAGES / "options.md").read_text()
    assert "| `--lora_r` | `int` | `0` |  | LoRA rank, reworded. |" in rendered.splitlines()


def test_every_option_of_hftk_train_is_on_the_page_or_passes_through():
    """Each of the parser's options is a row of its section, or a TrainingArguments field (explained once,
    not listed), or --config; and a row is an option the parser takes."""
    from transformers import TrainingArguments

    from hftk.config.options import build_parser

    page = (PAGES / "options.md").read_text()
    rows = {line.split(" | ")[0].removeprefix("| `--").removesuffix("`") for line in page.splitlines()
            if line.startswith("| `--")}
    training = {f.name for f in dataclasses.fields(TrainingArguments)}
    taken = {action.dest for action in build_parser()._actions if action.option_strings} - {"help"}
    assert taken - rows - training == {"config"}
    assert rows <= taken


def test_every_command_and_argument_is_on_the_commands_page():
    from hftk.cli import COMMANDS

    page = (PAGES / "commands.md").read_text()
    for name, (_, _, target) in COMMANDS.items():
        assert f"\n## hftk {name}\n" in page
        for parser in reference._parsers(target) if target else []:
            for action in parser._actions:
                if action.option_strings and action.option_strings[0] not in ("-h", "--help"):
                    assert f"| `{', '.join(action.option_strings)}` |" in page, (parser.prog, action.option_strings)


def test_table_cells_keep_pipes_and_brackets_literal():
    assert reference.cell("a | b <|im_end|> *x*\n  y") == "a \\| b &lt;\\|im_end\\|&gt; \\*x\\* y"
