"""The README opens with the setup and test commands."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash")
    return lines[start + 1:start + 3]


def test_readme_opens_with_setup_and_test_commands():
    main, tests = readme_commands()
    assert main.startswith("bash scripts/setup.sh && ") and "scripts/finetune.py" in main
    assert tests.startswith("bash scripts/setup.sh && ") and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci, ".ci/run must run the README's test command"


def map_by_package() -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's package bullets: package -> the module files it names."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## The packages", 1)[1].split("\n## ", 1)[0]
    found: dict[str, set[str]] = {}
    for bullet in re.split(r"\n- ", section.split("\n\nOutside", 1)[0])[1:]:
        package = re.match(r"`(\w+)/`", bullet)
        if package:
            found[package.group(1)] = set(re.findall(r"`(\w+\.py)`", bullet))
    return found


def test_the_map_names_every_module_in_its_package_and_nothing_else():
    tree = {p.name: {m.name for m in p.glob("*.py")} - {"__init__.py"} for p in (ROOT / "hftk").iterdir()
            if (p / "__init__.py").exists()}
    assert map_by_package() == tree


def test_the_map_states_the_layer_order_the_import_test_enforces():
    from tests.unit.test_imports import LAYERS

    line = next(line for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines()
                if line.startswith("Layers: "))
    assert line.removeprefix("Layers: ").split(" < ") == list(LAYERS)
