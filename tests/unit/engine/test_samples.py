"""Samples during training (hftk/engine/samples.py), in one process: the rows equal plain ``model.generate``
(greedy, fp32; plain text and a conversation rendered with the run's chat template), stop reasons, seeded sampling
that leaves training's RNG alone, and where the prompts come from."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hftk.config.options import load_config
from hftk.engine.samples import is_sharded, prompts, sample, stop_reason
from tests.helpers import TINY_ARGS

MESSAGES = [{"role": "user", "content": "Who made the heaven?"}]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    from hftk.data.builtin import materialize_model
    from hftk.models.loading import fit_to_tokenizer, load_tokenizer

    cfg = load_config([*TINY_ARGS, "--sample_max_new_tokens", "6", "--chat_template", "chatml"])
    model = AutoModelForCausalLM.from_pretrained(materialize_model("builtin:gpt2-tiny"))
    tokenizer = load_tokenizer(cfg.model, "chatml")  # the chat markers become tokens: the model grows as a run's
    fit_to_tokenizer(model, tokenizer, 7)
    return cfg, model, tokenizer


def test_rows_equal_plain_generate_for_text_and_conversations(tiny):
    cfg, model, tokenizer = tiny
    model.train()
    rows = sample(model, tokenizer, ["In the beginning", MESSAGES], cfg, 3, "cpu")
    assert model.training, "the model goes back to training mode"
    text_ids = tokenizer("In the beginning", return_tensors="pt").input_ids
    chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    assert chat_ids[0, -3:].tolist() == tokenizer("<|im_start|>assistant\n").input_ids[-3:]  # the generation prompt
    for row, ids, prompt in zip(rows, (text_ids, chat_ids), ["In the beginning", MESSAGES]):
        with torch.no_grad():
            expected = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                             do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
        assert row == {"step": 3, "prompt": prompt, "tokens": expected.tolist(), "stop": "length",
                       "completion": tokenizer.decode(expected, skip_special_tokens=True)}
    assert not is_sharded(model)


def test_a_sample_that_ends_at_eos_says_so(tiny):
    cfg, model, tokenizer = tiny
    first = sample(model, tokenizer, ["In the beginning"], cfg, 0, "cpu")[0]["tokens"][0]
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [first, *(original if isinstance(original, list) else [original])]
    try:
        row = sample(model, tokenizer, ["In the beginning"], cfg, 0, "cpu")[0]
    finally:
        model.generation_config.eos_token_id = original
    assert row["tokens"] == [first] and row["stop"] == "eos"


def test_a_signal_ends_generation_at_the_next_token_and_raises(tiny):
    """One process (the agreement is its own flag): a signal that arrives during the third forward of the first
    prompt's generate leaves one forward more (the agreement's next round), then the next prompts are skipped and
    EvaluationInterrupted names the signal."""
    import signal

    from hftk.engine.resilience import EvaluationInterrupted, PreemptionSignal
    from hftk.engine.samples import TokenAgreement

    cfg, model, tokenizer = tiny
    preemption = PreemptionSignal()
    forwards = []

    def count(module, args, output):
        forwards.append(preemption.received)
        if len(forwards) == 3:
            preemption.received = signal.SIGTERM

    handle = model.register_forward_hook(count)
    try:
        with pytest.raises(EvaluationInterrupted, match="SIGTERM"):
            sample(model, tokenizer, ["In the beginning", "And God said"], cfg, 0, "cpu",
                   agreement=TokenAgreement(preemption, "cpu"))
    finally:
        handle.remove()
    assert forwards == [None, None, None, signal.SIGTERM], "max_new_tokens is 6: only the signal stopped it"


def test_stop_reason_reads_every_eos_form():
    from transformers import GenerationConfig

    assert stop_reason([5, 7], GenerationConfig(eos_token_id=7)) == "eos"
    assert stop_reason([5, 7], GenerationConfig(eos_token_id=[9, 7])) == "eos"
    assert stop_reason([5, 7], GenerationConfig(eos_token_id=None)) == "length"
    assert stop_reason([], GenerationConfig(eos_token_id=7)) == "length"


def test_sampling_is_seeded_by_step_and_leaves_the_training_rng_alone(tiny):
    _, model, tokenizer = tiny
    cfg = load_config([*TINY_ARGS, "--sample_max_new_tokens", "12", "--do_sample", "--temperature", "5"])
    torch.manual_seed(0)
    first = sample(model, tokenizer, ["In the beginning", "And God said"], cfg, 4, "cpu")
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after), "generation must not draw from training's RNG stream"
    assert sample(model, tokenizer, ["In the beginning", "And God said"], cfg, 4, "cpu") == first
    assert sample(model, tokenizer, ["In the beginning", "And God said"], cfg, 5, "cpu") != first


def test_prompts_come_from_the_file_or_the_held_out_rows(tmp_path):
    from hftk.run.prepare import prepare

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"messages": MESSAGES}) + "\n")
    cfg = load_config([*TINY_ARGS, "--eval_prompts", str(tmp_path / "p.jsonl")])
    assert prompts(cfg, [], 0) == ["a", MESSAGES]
    rows = [{"prompt": f"question {i}", "completion": f" answer {i}"} for i in range(40)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepared = prepare(["--model_name_or_path", "builtin:gpt2-tiny", "--dataset", str(tmp_path / "pairs.jsonl"),
                        "--eval_fraction", "0.25", "--num_eval_samples", "3", "--output_dir", str(tmp_path / "o")])
    held_out = prepared.sources[0].raw["train"].train_test_split(test_size=0.25, seed=42, shuffle=True)["test"]
    assert prompts(prepared.cfg, prepared.sources, 42) == held_out["prompt"][:3]


def test_the_loops_consolidated_copy_samples_on_the_gpu_only_where_it_fits_beside_training(monkeypatch, capsys):
    """A GPU with the copy's bytes and a tenth to spare left (free, plus the allocator's unused cache) samples
    there; with less, rank 0 samples on the CPU and says so in one line; a CPU run stays on the CPU, silently."""
    from hftk.engine.samples import sampling_device

    model = torch.nn.Linear(256, 256)  # 257 KiB of fp32
    copy = sum(t.numel() * 4 for t in model.parameters())
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 300 << 10)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 200 << 10)  # 100 KiB cached, unused
    enough = math.ceil(copy * 1.1) - (100 << 10)
    for free, expected in ((enough, gpu), (enough - 1, torch.device("cpu"))):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 80 << 30))
        assert sampling_device(model, gpu) == expected
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hftk: samples: the consolidated model") and "on the CPU" in lines[0]
    assert sampling_device(model, torch.device("cpu")) == torch.device("cpu") and capsys.readouterr().out == ""
