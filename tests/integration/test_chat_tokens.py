"""A chat template whose markers are not tokens (chatml on the built-in GPT-2) trained on 2 ranks: the markers
become special tokens, ``<|im_end|>`` the EOS of final/'s tokenizer, config and generation config, and final/
loads with ``from_pretrained`` with one embedding row per token, under the Trainer (ddp, zero3) and the mesh
loop (tp); with LoRA (ddp, fsdp, pipeline; GPT-2's tied and Llama's untied head) the new rows train as PEFT's
trainable tokens and the adapter reloads with PEFT on the base grown to the saved tokenizer, as ``hftk export
--merge`` merges it, and resumes exactly; DPO's reference is the grown starting model; ``--no_add_chat_tokens``
leaves the vocabulary as it was. (LoRA with added markers under ZeRO-3 without a GPU is refused before launch:
tests/unit/strategies/test_deepspeed.py.)"""

from __future__ import annotations

import json

import pytest

from tests.helpers import finetune_cells, losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
CHAT = ["--chat_template", "chatml", "--block_size", "128", "--max_steps", "2", "--packing", "none",
        "--eval_fraction", "0", "--per_device_train_batch_size", "2"]
VOCAB = 2048  # the built-in GPT-2's
LORA = ["--lora_r", "4", "--adam_epsilon", "1e-4"]
LLAMA = ["--model_name_or_path", "builtin:llama-tiny"]  # untied LM head: its new rows train as well  # as test_lora.py: near-zero adapter grads stay comparable


def conversations() -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Where is the sun, {i}?"},
                          {"role": "assistant", "content": f"It also ariseth, {i}."}]} for i in range(16)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokens")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    common = [*CHAT, "--dataset", str(data)]
    cells = {
        "ddp": common,
        "zero3": [*common, "--strategy", "zero3"],
        "tp": [*common, "--strategy", "tp", "--tp_size", "2", "--per_device_train_batch_size", "4"],
        "no_add": [*common, "--no_add_chat_tokens"],
        "lora_ddp": [*common, *LORA],
        "lora_fsdp": [*common, *LORA, "--strategy", "fsdp"],
        "lora_pipeline": [*common, *LORA, "--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "2",
                          "--per_device_train_batch_size", "4"],  # the new rows shared by the tied head's stage
        "lora_llama_ddp": [*common, *LORA, *LLAMA],
        "lora_llama_pipeline": [*common, *LORA, *LLAMA, "--strategy", "pipeline", "--pp_size", "2",
                                "--pp_microbatches", "2", "--per_device_train_batch_size", "4"],
    }
    prefs = root / "prefs.jsonl"  # conversational preference rows: TRL renders them with the run's template
    prefs.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Repeat {w}:"}],
                                         "chosen": [{"role": "assistant", "content": f"{w} {w}"}],
                                         "rejected": [{"role": "assistant", "content": "no"}]}) + "\n"
                             for w in ["blue", "cat", "dog", "moon"] * 4))
    cells["dpo"] = [*CHAT, "--dataset", str(prefs), "--method", "dpo"]
    save = [*common, *LORA, "--save_strategy", "steps", "--save_steps", "1"]
    cells["lora_saved"] = save
    cells["lora_resumed"] = [*save, "--resume_from_checkpoint", str(root / "lora_saved" / "checkpoint-1")]
    outputs = finetune_cells(2, {name: [*args, "--output_dir", str(root / name)] for name, args in cells.items()},
                             root)
    return root, outputs


@pytest.mark.parametrize("name", ["ddp", "zero3", "tp", "dpo"])
def test_markers_are_tokens_and_the_end_of_turn_is_the_saved_eos(runs, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    root, outputs = runs
    line = ("hftk: chat template chatml: added <|im_start|>, <|im_end|> as special tokens; EOS is <|im_end|> "
            "(--no_add_chat_tokens keeps them as text)")
    assert outputs[name].count(line) == 1  # rank 0 only
    assert "multivariate normal" not in outputs[name]  # transformers' advisory: the line above says it
    final = root / name / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 1 and len(tokenizer) == VOCAB + 2
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == ids[0]
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.eos_token_id == GenerationConfig.from_pretrained(final).eos_token_id == ids[0]
    assert model.get_input_embeddings().weight.shape[0] == model.config.vocab_size == len(tokenizer)


def test_no_add_chat_tokens_keeps_the_vocabulary(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, outputs = runs
    assert "as special tokens" not in outputs["no_add"]
    final = root / "no_add" / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert len(tokenizer) == VOCAB and tokenizer.eos_token == "<|endoftext|>"
    assert len(tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]) > 1
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.get_input_embeddings().weight.shape[0] == VOCAB
    assert model.config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("name", ["zero3", "tp"])
def test_every_strategy_starts_from_the_same_new_rows_and_trains_them(runs, name):
    """The same global batch of 4 on every strategy: equal losses mean every rank drew the same new rows
    (ZeRO-3 partitions them, tp shards them by vocabulary); the end-of-turn row moved from its start."""
    import torch
    from safetensors.torch import load_file

    from hftk.config.options import ModelConfig
    from hftk.models.loading import fit_to_tokenizer, load_model, load_tokenizer

    root, _ = runs
    ref, got = losses(root / "ddp"), losses(root / name)
    assert sorted(ref) == sorted(got) == [1, 2]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), (name, step)
    cfg = ModelConfig(model_name_or_path="builtin:gpt2-tiny")
    tokenizer = load_tokenizer(cfg, "chatml")
    model = load_model(cfg)
    fit_to_tokenizer(model, tokenizer, seed=7)
    start = model.get_input_embeddings().weight[VOCAB + 1].detach()
    trained = load_file(str(root / name / "final" / "model.safetensors"))["transformer.wte.weight"][VOCAB + 1]
    assert float((trained - start).abs().max()) > 1e-4 and torch.isfinite(trained).all()


# run -> (the run with the same losses, model, the new rows' embedding modules)
LORA_RUNS = {
    "lora_ddp": ("lora_ddp", "builtin:gpt2-tiny", ["transformer.wte"]),  # the tied head follows the embedding
    "lora_fsdp": ("lora_ddp", "builtin:gpt2-tiny", ["transformer.wte"]),
    "lora_pipeline": ("lora_ddp", "builtin:gpt2-tiny", ["transformer.wte"]),
    "lora_llama_ddp": ("lora_llama_ddp", "builtin:llama-tiny", ["model.embed_tokens", "lm_head"]),
    "lora_llama_pipeline": ("lora_llama_ddp", "builtin:llama-tiny", ["model.embed_tokens", "lm_head"]),
}


@pytest.mark.parametrize("name", LORA_RUNS)
def test_lora_trains_the_new_rows_and_its_adapter_reloads_on_the_grown_base_as_merged(runs, name, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftk.config.options import ModelConfig
    from hftk.models.loading import fit_to_tokenizer, load_model, load_tokenizer, resolve_model_path
    from tests.helpers import python

    root, outputs = runs
    reference, model_name, modules = LORA_RUNS[name]
    final = root / name / "final"
    assert "EOS is <|im_end|>" in outputs[name]
    ref, got = losses(root / reference), losses(root / name)
    assert sorted(ref) == sorted(got) == [1, 2]
    for step in ref:  # the same global batch of 4: every rank started from the same new rows
        assert got[step] == pytest.approx(ref[step], abs=1e-5), (name, step)
    indices = json.loads((final / "adapter_config.json").read_text())["trainable_token_indices"]
    assert indices == {module: [VOCAB, VOCAB + 1] for module in modules}
    saved = load_file(str(final / "adapter_model.safetensors"))
    cfg = ModelConfig(model_name_or_path=model_name)
    start = load_model(cfg)
    fit_to_tokenizer(start, load_tokenizer(cfg, "chatml"), seed=7)
    for module in modules:
        delta = saved[f"base_model.model.{module}.token_adapter.trainable_tokens_delta"]
        grown = saved[f"base_model.model.{module}.token_adapter.base_layer.weight"]
        assert delta.shape == (2, 64) and grown.shape == (VOCAB + 2, 64)
        initial = start.get_submodule(module).weight[VOCAB:].detach()
        assert torch.equal(grown[VOCAB:], initial)  # saved as drawn: the same rows on every rank
        assert float((delta - initial).abs().max()) > 1e-4  # trained

    tokenizer = AutoTokenizer.from_pretrained(final)
    assert len(tokenizer) == VOCAB + 2 and tokenizer.eos_token == "<|im_end|>"
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg))
    base.resize_token_embeddings(len(tokenizer))  # PEFT's way: the base grown to the adapter's tokenizer
    reloaded = PeftModel.from_pretrained(base, str(final)).eval()
    merged_dir = tmp_path / "merged"
    result = python(["-m", "hftk.cli", "export", str(final), str(merged_dir), "--merge"])
    assert result.returncode == 0, result.output[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert merged.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert merged.config.eos_token_id == merged.generation_config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer.apply_chat_template(conversations()[0]["messages"], return_tensors="pt", return_dict=True)
    assert tokenizer.eos_token_id in ids["input_ids"][0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(merged(**ids).logits, reloaded(**ids).logits, rtol=0, atol=1e-5)


def test_lora_with_new_rows_resumes_exactly_from_the_trainers_checkpoint(runs):
    """checkpoint-1 (the Trainer's PEFT save: adapter, trainable tokens, grown embeddings) resumed on a base
    grown again: step 2 and the final adapter are the uninterrupted run's."""
    from safetensors.torch import load_file

    root, _ = runs
    resumed, uninterrupted = losses(root / "lora_resumed"), losses(root / "lora_saved")
    assert sorted(resumed) == [2] and resumed[2] == pytest.approx(uninterrupted[2], abs=1e-6)
    want, got = (load_file(str(root / run / "final" / "adapter_model.safetensors")) for run in ("lora_saved",
                                                                                             "lora_resumed"))
    assert want.keys() == got.keys() and any("trainable_tokens_delta" in k for k in got)
    assert max(float((want[k] - got[k]).abs().max()) for k in want) < 1e-6


def test_dpo_reference_is_the_grown_starting_model(runs):
    """TRL would reload the reference from the path, without the new rows; hftk hands it the starting model
    grown with the same seed, so before the first update policy and reference agree: zero rewards at step 1."""
    from tests.helpers import metrics

    root, _ = runs
    first = next(m for m in metrics(root / "dpo") if "rewards/chosen" in m)
    assert first["step"] == 1 and first["rewards/chosen"] == 0 and first["rewards/rejected"] == 0
