"""``hftk generate`` against plain ``model.generate`` on the same weights, token for token (greedy, fp32)."""

import json
import shutil

import pytest
import torch

from hftk.cli import main
from tests.helpers import make_family

PROMPT = "the cat sat on"


def _reference(model, tokenizer, prompt=PROMPT, max_new_tokens=12):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _hftk(capsys, folder, *extra):
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", PROMPT, "--max_new_tokens", "12", *extra]) == 0
    out = capsys.readouterr().out  # wandb (imported on the way) announces offline mode on stdout once
    return "".join(line for line in out.splitlines(keepends=True) if not line.startswith("[INFO] Running in WANDB"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_family("llama", tmp_path_factory.mktemp("llama") / "final")


def test_full_model_equals_plain_generate(llama, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers import GenerationConfig

    from hftk.publish.generate import generate, load

    plain, tokenizer = AutoModelForCausalLM.from_pretrained(llama).eval(), AutoTokenizer.from_pretrained(llama)
    expected = _reference(plain, tokenizer)
    assert expected.strip()
    assert _hftk(capsys, llama).strip() == expected.strip()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    reference = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
    model, tokenizer = load(llama)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generate(model, tokenizer, PROMPT, config).tolist() == reference.tolist()


def test_lora_adapter_equals_peft_generate(llama, tmp_path, capsys):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(llama),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(llama).save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), tmp_path / "adapter")
    expected = _reference(reference, AutoTokenizer.from_pretrained(llama))
    assert expected != _reference(AutoModelForCausalLM.from_pretrained(llama), AutoTokenizer.from_pretrained(llama))
    assert _hftk(capsys, tmp_path / "adapter").strip() == expected.strip()


def test_fsdp_sharded_checkpoint_without_export(llama, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftk.strategies.fsdp import SHARDED_MODEL_DIR

    model = AutoModelForCausalLM.from_pretrained(llama)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # weights unlike the final folder's, so reading the wrong source fails
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (llama / name).exists():
            shutil.copy(llama / name, checkpoint / name)
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(checkpoint / SHARDED_MODEL_DIR)),
             no_dist=True)
    expected = _reference(model, AutoTokenizer.from_pretrained(llama))
    assert expected != _reference(AutoModelForCausalLM.from_pretrained(llama), AutoTokenizer.from_pretrained(llama))
    assert _hftk(capsys, checkpoint).strip() == expected.strip()


def test_bad_input_is_one_line_exit_2(llama, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": 3}) + "\n")
    for argv, needle in ([str(tmp_path / "nope"), "--prompt", "x"], "does not exist"), \
                        ([str(tmp_path / "empty"), "--prompt", "x"], "holds no weights"), \
                        ([str(llama), "--prompts", str(bad)], "row 2"):
        capsys.readouterr()
        assert main(["generate", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def chat_folder(llama, tmp_path):
    """A copy of the llama checkpoint whose saved tokenizer has a small chat template."""
    from transformers import AutoTokenizer

    folder = tmp_path / "chat"
    shutil.copytree(llama, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer.save_pretrained(folder)
    return folder


def test_messages_rows_use_the_saved_chat_template(llama, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = chat_folder(llama, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "the cat sat on"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(folder).eval().generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
            pad_token_id=tokenizer.eos_token_id)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompts", str(tmp_path / "p.jsonl"), "--max_new_tokens", "12"]) == 0
    got = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[INFO] Running in WANDB")]
    assert "\n".join(got).strip() == expected.strip()


def test_chat_keeps_the_conversation_through_the_saved_template(llama, tmp_path, capsys, monkeypatch):
    """Two typed turns: the second is answered with the first turn and its reply in context, as plain
    ``apply_chat_template`` + ``model.generate`` over the same conversation answers it."""
    import io

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = chat_folder(llama, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()

    def answer(messages):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat on"}]
    conversation.append({"role": "assistant", "content": answer(conversation)})
    conversation.append({"role": "user", "content": "and then"})
    second = answer(conversation)
    assert second != answer([conversation[0], conversation[-1]])  # the context changes the answer: kept or not shows
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat sat on\nand then\n\nnever read\n"))
    capsys.readouterr()
    assert main(["generate", str(folder), "--chat", "--system", "be brief", "--max_new_tokens", "8"]) == 0
    got = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[INFO] Running in WANDB")]
    assert [line.strip() for line in got] == [conversation[2]["content"].strip(), second.strip()]


def test_chat_needs_a_chat_template_and_system_needs_chat(llama, capsys, monkeypatch):
    import io

    from transformers import AutoTokenizer

    assert not AutoTokenizer.from_pretrained(llama).chat_template
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    for argv, needle in (["--chat"], "--chat: this checkpoint's tokenizer has no chat template"), \
                        (["--prompt", "x", "--system", "s"], "--system: is for --chat"):
        capsys.readouterr()
        assert main(["generate", str(llama), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
