"""The README's commands as written, from a folder of their own: the main command (the real `accelerate launch`,
2 processes: loss falls, checkpoint + metrics), then the samples guide's `hftk generate` on the model it made;
the chat + LoRA recipe on 4 warm ranks."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.helpers import (ROOT, doc_block, doc_project, make_family, metrics, noise_in, run, run_doc_command,
                           shell_commands)
from tests.unit.test_readme import readme_commands

pytestmark = pytest.mark.slow


def test_readme_main_command_trains_two_ranks(tmp_path):
    main, _ = readme_commands()
    project = doc_project(tmp_path / "project")
    result = run(shlex.split(main.split(" && ", 1)[1]), timeout=600, cwd=project)  # .venv/bin/accelerate launch ...
    assert result.returncode == 0, result.output[-5000:]
    assert not noise_in(result.output), noise_in(result.output)  # nor the libraries' notices (hftk.core.output)
    last = result.stderr.strip().splitlines()[-1]  # what was made, and what a rerun does
    assert re.match(r"hftk: done: step \d+ in \d+ s, eval loss [\d.]+, perplexity [\d.]+; the model is in "
                    r"outputs/default/final \(rerunning this command resumes from checkpoint-\d+\)$", last), last
    out = project / "outputs" / "default"
    logged = metrics(out)
    train_losses = [m["loss"] for m in logged if "loss" in m]
    assert train_losses[-1] < train_losses[0] - 1.0  # it learns the corpus
    assert any("eval_perplexity" in m for m in logged)
    assert sorted(out.glob("checkpoint-*")) and (out / "final" / "model.safetensors").exists()
    # two ranks really split the data: 2 epochs took blocks / (2 ranks x 8) steps each
    from hftk.config.options import load_config
    from hftk.data.dataset import check_raw, load_raw, tokenize_and_pack
    from hftk.models.loading import load_tokenizer
    from hftk.run.validate import resolve_packing

    cfg = load_config([])
    raw = load_raw(cfg.data)
    resolve_packing(cfg, check_raw(cfg.data, raw))
    blocks = len(tokenize_and_pack(cfg.data, raw, load_tokenizer(cfg.model), check_raw(cfg.data, raw), 42).train)
    final_step = max(m["step"] for m in logged)
    assert final_step == 2 * -(-blocks // 16), (final_step, blocks)
    # the samples guide's `hftk generate outputs/default/final ...`, on the model just trained
    ((argv, stdin),) = shell_commands(doc_block("generate-default"))
    said = run_doc_command(argv, stdin, project, timeout=300)
    assert said.returncode == 0 and said.stdout.strip(), said.output  # the completion, streamed


def stand_in_chat_model(folder) -> None:
    """A tiny Qwen2 with what an Instruct model's tokenizer holds: ChatML as its chat template, the template's
    markers as special tokens and <|im_end|> as EOS (hftk adds nothing to it, as with the real model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_family("qwen2", folder, max_position_embeddings=32768)  # the real one's context
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = (ROOT / "hftk" / "data" / "templates" / "chatml.jinja").read_text()
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_chat_lora_recipe_runs_as_written(tmp_path):
    """The README's chat + LoRA recipe: `accelerate launch ... --num_processes 4` with the ranks and environment
    accelerate derives (warm ranks); `Qwen/Qwen2.5-0.5B-Instruct` is a local folder of that name holding a tiny
    Qwen2 (the suite has no Hub), `chat.jsonl` conversations in the format the README shows."""
    project = doc_project(tmp_path / "project")
    ((argv, stdin),) = shell_commands(doc_block("chat-lora"))
    stand_in_chat_model(project / argv[argv.index("--model_name_or_path") + 1])
    words = "light water earth heaven night day sea land".split()
    with (project / "chat.jsonl").open("w") as f:
        for i in range(96):
            word = words[i % len(words)]
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Which word comes after {word}?"},
                                             {"role": "assistant", "content": words[(i + 1) % len(words)]}]}) + "\n")
    result = run_doc_command(argv, stdin, project, timeout=600)
    assert result.returncode == 0, result.output[-6000:]
    final = project / "outputs" / "chat-lora" / "final"
    assert (final / "adapter_model.safetensors").is_file(), sorted(p.name for p in final.iterdir())
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (16, 32)
    logged = metrics(project / "outputs" / "chat-lora")
    assert any("eval_loss" in m for m in logged) and any("train_loss" in m for m in logged), logged
    assert "over 4 data-parallel rank(s)" in result.stdout, result.output[-3000:]  # --num_processes 4 took hold
