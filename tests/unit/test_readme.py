"""The README opens with the setup and test commands and stays short; every command block the README and the site
mark ``<!-- test: NAME -->`` is run by the test named for it (the in-process ones here); the architecture map
names every module."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import ROOT, doc_block, doc_blocks, shell_commands

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


def test_readme_stays_short():
    """At most 200 lines: what hftk is, the commands, the support table, the recipes, links into the site."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


# The marked command blocks and the test file that runs each as written (it calls doc_block(NAME)).
RUN_BY = {
    "chat-lora": "tests/integration/test_readme.py",
    "generate-default": "tests/integration/test_readme.py",
    "dpo-recipe": "tests/integration/test_dpo.py",
    "grpo-recipe": "tests/integration/test_grpo.py",
    "plan-recipe": "tests/unit/test_readme.py",
    "configs": "tests/unit/test_readme.py",
}


def test_every_marked_block_is_run_by_its_test_and_its_copies_agree():
    blocks = doc_blocks()
    assert set(blocks) == set(RUN_BY), "a marked block without a test, or a test whose block is gone"
    for name, copies in blocks.items():
        assert len({text for _, text in copies}) == 1, f"copies of {name} differ: {[page for page, _ in copies]}"
        assert f'doc_block("{name}")' in (ROOT / RUN_BY[name]).read_text(), (name, RUN_BY[name])


# Qwen/Qwen2.5-7B's config.json (its sizes; no weights are read): the plan recipe's model, offline.
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "max_position_embeddings": 131072, "max_window_layers": 28, "rms_norm_eps": 1e-06,
             "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
             "tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0, "bos_token_id": 151643,
             "eos_token_id": 151643, "torch_dtype": "bfloat16"}


def test_the_plan_recipe_says_what_the_readme_says(tmp_path, monkeypatch, capsys):
    """`hftk plan` of the README's 7.6B model, as written; the Hub's config stands in as a local folder of the
    same name (transformers reads a folder that exists before asking the Hub). ddp does not fit an 80 GB GPU,
    the pick is zero1, as the README says."""
    from hftk.cli import main

    ((argv, _),) = shell_commands(doc_block("plan-recipe"))
    model = tmp_path / argv[argv.index("--model") + 1]
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(QWEN25_7B))
    monkeypatch.chdir(tmp_path)
    assert argv[0] == "hftk" and main(argv[1:]) == 0
    out = capsys.readouterr().out
    assert out.startswith("7615.6M parameters"), out
    assert re.search(r"^ddp +[\d,]+ MiB +[\d,]+ MiB +[\d,]+ MiB +113 GiB .* 144 GiB +no", out, re.M), out
    assert "pick: zero1" in out, out


def test_the_configs_command_writes_the_committed_launch_configs(tmp_path, monkeypatch):
    from hftk.cli import main

    ((argv, _),) = shell_commands(doc_block("configs"))
    monkeypatch.chdir(tmp_path)
    assert argv[0] == "hftk" and main(argv[1:]) == 0
    written = {p.relative_to(tmp_path) for p in (tmp_path / "accelerate_configs").rglob("*") if p.is_file()}
    assert written == {p.relative_to(ROOT) for p in (ROOT / "accelerate_configs").rglob("*") if p.is_file()}
    assert all((tmp_path / p).read_text() == (ROOT / p).read_text() for p in written)


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
