"""A conversation set trains on 2 gloo ranks (ddp and fsdp through the Trainer, tp through the mesh loop, pipeline through its loop) with the
losses of one process, and final/ chats as trained: reloaded with from_pretrained, its tokenizer renders
the generation prompt exactly as training rendered the conversations. Preprocessed once
(``hftk preprocess``), it trains twice from the folder with the same losses."""

from __future__ import annotations

import json

import pytest

from tests.helpers import finetune, load_weights, losses, max_weight_diff

pytestmark = pytest.mark.slow
STEPS = 4
TOL = 1e-5
CHAT = ["--chat_template", "chatml", "--block_size", "256", "--truncation", "truncate", "--max_steps", str(STEPS),
        "--eval_fraction", "0"]


def conversations() -> list[dict]:
    """Multi-turn, with and without system prompts, non-ASCII, and one conversation far over block_size."""
    rows = []
    for i in range(40):
        messages = [{"role": "system", "content": "Answer as the Preacher would."}] if i % 3 == 0 else []
        for t in range(1 + i % 3):
            messages += [{"role": "user", "content": f"What is vanity, {i}.{t}? Ça va — ñ"},
                         {"role": "assistant", "content": f"All is vanity {i}; the sun also ariseth. ✓{t}"}]
        rows.append({"messages": messages})
    rows[5]["messages"] += [{"role": "user", "content": "And the rest? " * 40},
                            {"role": "assistant", "content": "The words of the wise are as goads. " * 20}]
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in conversations()))
    common = [*CHAT, "--dataset", str(data)]
    single = finetune(1, [*common, "--output_dir", str(root / "single"), "--per_device_train_batch_size", "8"])
    finetune(2, [*common, "--output_dir", str(root / "ddp"), "--per_device_train_batch_size", "4",
                 "--save_strategy", "steps", "--save_steps", "2"])
    finetune(2, [*common, "--output_dir", str(root / "tp"), "--strategy", "tp", "--tp_size", "2",
                 "--per_device_train_batch_size", "8"], timeout=600)
    finetune(2, [*common, "--output_dir", str(root / "fsdp"), "--strategy", "fsdp", "--per_device_train_batch_size", "4"],
             timeout=600)
    finetune(2, [*common, "--output_dir", str(root / "pipeline"), "--strategy", "pipeline", "--pp_size", "2",
                 "--pp_microbatches", "4", "--per_device_train_batch_size", "8"], timeout=600)
    return root, data, single.output


@pytest.fixture(scope="module")
def from_folder(runs):
    """hftk preprocess once, then two runs (1 process, 2 ddp ranks) read its blocks instead of tokenising."""
    from hftk.cli import main as hftk
    from tests.helpers import TINY_ARGS

    root, data, _ = runs
    common = [*CHAT, "--dataset", str(data), "--tokenized_path", str(root / "tokenized")]
    assert hftk(["preprocess", *TINY_ARGS, *common, "--output_dir", str(root / "unused")]) == 0
    one = finetune(1, [*common, "--output_dir", str(root / "tok_single"), "--per_device_train_batch_size", "8"])
    two = finetune(2, [*common, "--output_dir", str(root / "tok_ddp"), "--per_device_train_batch_size", "4"])
    return root, one.output + two.output


@pytest.mark.parametrize("name", ["tok_single", "tok_ddp"])
def test_training_from_the_preprocessed_folder_gives_the_same_losses(from_folder, name):
    root, output = from_folder
    assert "tokenize:" not in output  # no rank tokenised anything
    ref, got = losses(root / "single"), losses(root / name)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=TOL), (name, step)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp", "pipeline"])
def test_losses_equal_one_process(runs, name):
    root, _, _ = runs
    ref, got = losses(root / "single"), losses(root / name)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=TOL), (name, step)
    assert max_weight_diff(load_weights(root / "single" / "final"), load_weights(root / name / "final")) < TOL


def test_the_long_conversation_is_truncated_and_counted(runs):
    _, _, output = runs
    assert "truncated 1, dropped 0 of 40 conversations longer than block_size 256" in output


@pytest.mark.parametrize("folder", ["single/final", "ddp/final", "ddp/checkpoint-2", "tp/final", "pipeline/final"])
def test_saved_tokenizer_renders_prompts_as_in_training(runs, folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftk.chat import resolve_template
    from hftk.config import ModelConfig
    from hftk.modeling import load_tokenizer

    root, _, _ = runs
    trained = load_tokenizer(ModelConfig(model_name_or_path="builtin:gpt2-tiny"), "chatml")
    saved = AutoTokenizer.from_pretrained(root / folder)
    assert saved.chat_template == resolve_template("chatml")
    prompt = conversations()[3]["messages"][:-1]
    expected = trained.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert saved.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    if folder.endswith("final"):
        model = AutoModelForCausalLM.from_pretrained(root / folder)
        ids = saved.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        assert model(**ids).logits.shape[1] == ids["input_ids"].shape[1]
