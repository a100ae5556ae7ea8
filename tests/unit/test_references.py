"""The suite's references owe nothing to hftk: tests/reference/plain.py (the plain Trainer and the
plain PyTorch loop the parity tests of ddp, fsdp, ZeRO, pipeline and tp compare with) imports only
the standard library, torch, transformers and datasets, and cuts the same blocks hftk does from the
same text by its own code (run_clm's recipe)."""

from __future__ import annotations

import ast
import importlib.util

import pytest
import torch

from tests.helpers import PLAIN, TINY_ARGS

ALLOWED = {"__future__", "argparse", "json", "sys", "pathlib", "typing", "torch", "transformers", "datasets",
           "peft"}  # peft: the LoRA references, on PEFT's own all-linear targets


def test_the_plain_reference_imports_nothing_from_hftk():
    tree = ast.parse(PLAIN.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import at line {node.lineno}"
            imported.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "__import__", "import_module"):
            raise AssertionError(f"dynamic import at line {node.lineno}")
    assert imported <= ALLOWED, sorted(imported - ALLOWED)
    assert {"torch", "transformers", "datasets"} <= imported


@pytest.mark.parametrize("model", ["builtin:gpt2-tiny", "builtin:llama-tiny"])  # llama's tokenizer adds a BOS
def test_the_plain_reference_cuts_the_blocks_hftk_trains_on(model, tmp_path):
    from hftk.data.builtin import CORPUS, materialize_model
    from hftk.data.dataset import tokenize_and_pack
    from hftk.models.loading import load_tokenizer
    from hftk.run.prepare import prepare

    spec = importlib.util.spec_from_file_location("plain_reference", PLAIN)
    plain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain)
    args = plain.parse(["loop", "--model", str(materialize_model(model)), "--text", str(CORPUS), "--out",
                        str(tmp_path), "--max_steps", "1"])
    train, held_out = plain.blocks(args, plain.load(args)[1])
    prepared = prepare([*TINY_ARGS, "--model_name_or_path", model, "--output_dir", str(tmp_path / "hftk")])
    cfg = prepared.cfg
    assert (args.block_size, args.max_train_samples, args.seed, args.eval_fraction) == (
        cfg.data.block_size, cfg.data.max_train_samples, cfg.training["seed"], cfg.data.eval_fraction)
    ours = tokenize_and_pack(cfg.data, prepared.raw, load_tokenizer(cfg.model), prepared.data_format,
                             cfg.training["seed"])
    for mine, theirs in ((train, ours.train), (held_out, ours.eval)):
        assert len(mine) == len(theirs) > 0
        for column in ("input_ids", "labels"):
            assert torch.equal(mine[:][column], theirs[:][column]), column
