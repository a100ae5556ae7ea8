"""The README opens with the setup and test commands."""

from __future__ import annotations

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
