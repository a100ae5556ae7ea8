"""A conversation set trains on 2 gloo ranks (ddp, fsdp and zero3 through the Trainer, tp and sp through the mesh
loop, pipeline through its loop, zero1 / zero2 / zero3_offload too, LoRA under ddp, fsdp, zero3 and pipeline) with the losses of one process, and final/ chats as trained:
reloaded with from_pretrained, its tokenizer renders the generation prompt exactly as training rendered the
conversations. Preprocessed once (``hftk preprocess``), it trains twice from the folder with the same losses.

sp (Ulysses) needs a Llama-family model, so it has its own one-process reference on builtin:llama-tiny. It drops
the attention mask and attends causally over the gathered sequence: exact because conversations are
right-padded (no real token sees a pad), and a rank whose slice is all padding adds 0 tokens to the loss sum.
sp also runs with a data-parallel dimension (4 ranks: sp 2 x dp 2), and with evaluation on held-out
conversations compared with one process's.
LoRA compares the saved adapter with adam_epsilon 1e-4, as tests/integration/test_lora.py does (near-zero adapter
gradients would otherwise turn reduction-order bits into visible differences)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import finetune_cells, load_weights, losses, max_weight_diff, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the first test launches every run
STEPS = 4
TOL = 1e-5
CHAT = ["--chat_template", "chatml", "--block_size", "256", "--truncation", "truncate", "--max_steps", str(STEPS),
        "--packing", "none",  # the mode every engine honours (bfd: tests/integration/test_packing.py)
        "--eval_fraction", "0"]
LLAMA = ["--model_name_or_path", "builtin:llama-tiny"]
# Markers kept as text: LoRA with added chat tokens is refused under zero3 on CPU (PEFT's trainable tokens;
# tests/integration/test_chat_tokens.py trains them under ddp, fsdp and pipeline).
LORA = ["--lora_r", "8", "--adam_epsilon", "1e-4", "--no_add_chat_tokens"]
# 8 held-out conversations, evaluated every 2 steps; one process evaluates them in one batch, so its eval loss is
# the token mean the mesh loop computes from summed token losses and counts over its replicas.
EVAL = ["--eval_fraction", "0.2", "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "8"]
LORA_RUNS = ["lora_ddp", "lora_fsdp", "lora_zero3", "lora_pipeline"]
EVAL_RUNS = ["sp_eval", "sp_dp"]  # sp_dp: 4 ranks, sp 2 x data-parallel 2
REFERENCE = {"sp": "llama_single", **{name: "lora_single" for name in LORA_RUNS},
             **{name: "llama_eval_single" for name in EVAL_RUNS}}  # the rest compare with "single"


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
    """Every run, preprocessed ones included (``hftk preprocess`` once, then a 1-process and a 2-rank ddp
    run read its blocks instead of tokenising), each on warm ranks (``tests.helpers.finetune_cells``).
    Returns (root, data, each run's output)."""
    from hftk.cli import main as hftk
    from tests.helpers import TINY_ARGS

    root = tmp_path_factory.mktemp("chat")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in conversations()))
    common = [*CHAT, "--dataset", str(data)]
    tokenized = [*common, "--tokenized_path", str(root / "tokenized")]
    assert hftk(["preprocess", *TINY_ARGS, *tokenized, "--output_dir", str(root / "unused")]) == 0
    single = {  # one process: llama_single writes llama-tiny before the 2-rank runs
        "single": [*common, "--per_device_train_batch_size", "8"],
        "llama_single": [*common, *LLAMA, "--per_device_train_batch_size", "8"],
        "lora_single": [*common, *LORA, "--per_device_train_batch_size", "8"],
        "tok_single": [*tokenized, "--per_device_train_batch_size", "8"],
        "llama_eval_single": [*common, *LLAMA, *EVAL, "--per_device_train_batch_size", "8"],
    }
    two = {
        "ddp": [*common, "--per_device_train_batch_size", "4", "--save_strategy", "steps", "--save_steps", "2"],
        "tp": [*common, "--strategy", "tp", "--tp_size", "2", "--per_device_train_batch_size", "8"],
        "fsdp": [*common, "--strategy", "fsdp", "--per_device_train_batch_size", "4"],
        "zero1": [*common, "--strategy", "zero1", "--per_device_train_batch_size", "4"],
        "zero2": [*common, "--strategy", "zero2", "--per_device_train_batch_size", "4"],
        "zero3": [*common, "--strategy", "zero3", "--per_device_train_batch_size", "4"],
        "zero3_offload": [*common, "--strategy", "zero3_offload", "--per_device_train_batch_size", "4"],
        "pipeline": [*common, "--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "4",
                     "--per_device_train_batch_size", "8"],
        "sp": [*common, *LLAMA, "--strategy", "sp", "--sp_size", "2", "--per_device_train_batch_size", "8"],
        "lora_ddp": [*common, *LORA, "--per_device_train_batch_size", "4"],
        "lora_fsdp": [*common, *LORA, "--strategy", "fsdp", "--per_device_train_batch_size", "4"],
        "lora_zero3": [*common, *LORA, "--strategy", "zero3", "--per_device_train_batch_size", "4"],
        "lora_pipeline": [*common, *LORA, "--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "4",
                          "--per_device_train_batch_size", "8"],
        "tok_ddp": [*tokenized, "--per_device_train_batch_size", "4"],
        "sp_eval": [*common, *LLAMA, *EVAL, "--strategy", "sp", "--sp_size", "2", "--per_device_train_batch_size", "8"],
    }
    four = {"sp_dp": [*common, *LLAMA, *EVAL, "--strategy", "sp", "--sp_size", "2", "--per_device_train_batch_size", "4",
                      "--per_device_eval_batch_size", "4"]}
    outputs = {}
    for nproc, cells in ((1, single), (2, two), (4, four)):
        outputs.update(finetune_cells(nproc, {name: [*args, "--output_dir", str(root / name)]
                                              for name, args in cells.items()}, root))
    return root, data, outputs


@pytest.fixture(scope="module")
def from_folder(runs):
    """The two runs that read the preprocessed folder, and their output."""
    root, _, outputs = runs
    return root, outputs["tok_single"] + outputs["tok_ddp"]


@pytest.mark.parametrize("name", ["tok_single", "tok_ddp"])
def test_training_from_the_preprocessed_folder_gives_the_same_losses(from_folder, name):
    root, output = from_folder
    assert "tokenize:" not in output  # no rank tokenised anything
    ref, got = losses(root / "single"), losses(root / name)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=TOL), (name, step)


def assert_same_losses(name: str, root) -> None:
    ref, got = losses(root / REFERENCE.get(name, "single")), losses(root / name)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=TOL), (name, step)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload", "tp", "pipeline", "sp"])
def test_losses_equal_one_process(runs, name):
    root, _, _ = runs
    assert_same_losses(name, root)
    want, got = load_weights(root / REFERENCE.get(name, "single") / "final"), load_weights(root / name / "final")
    assert max_weight_diff(want, got) < TOL  # same keys too: a tied LM head is written once under every strategy


@pytest.mark.parametrize("name", EVAL_RUNS)
def test_sp_with_and_without_data_parallel_trains_and_evaluates_conversations_as_one_process(runs, name):
    """Ulysses sp on 2 ranks and sp 2 x dp 2 on 4: training losses, eval losses on held-out conversations at
    every evaluation, and final weights equal one process's (whose eval is the Trainer's)."""
    root, _, outputs = runs
    assert_same_losses(name, root)
    ref, got = ({m["step"]: m["eval_loss"] for m in metrics(root / run) if "eval_loss" in m}
                for run in ("llama_eval_single", name))
    assert sorted(ref) == sorted(got) == [2, 4]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=TOL), (name, step)
    if name == "sp_dp":
        assert "over 2 data-parallel rank(s) per evaluation" in outputs[name], outputs[name][-3000:]
    want, got_weights = load_weights(root / "llama_eval_single" / "final"), load_weights(root / name / "final")
    assert max_weight_diff(want, got_weights) < TOL


@pytest.mark.parametrize("name", LORA_RUNS)
def test_lora_adapter_equals_one_process(runs, name):
    from safetensors.torch import load_file

    root, _, _ = runs
    assert_same_losses(name, root)
    ref, got = (load_file(str(root / run / "final" / "adapter_model.safetensors")) for run in ("lora_single", name))
    assert len(ref) == 16 and not (root / name / "final" / "model.safetensors").exists()  # the adapter alone
    assert max_weight_diff(ref, got) < 1e-6
    assert min(float(v.abs().max()) for k, v in got.items() if "lora_B" in k) > 1e-3  # trained (B starts at 0)


def test_the_long_conversation_is_truncated_and_counted(runs):
    output = runs[2]["single"]
    assert "truncated 1, dropped 0 of 40 conversations longer than block_size 256" in output


@pytest.mark.parametrize("folder", ["single/final", "ddp/final", "ddp/checkpoint-2", "tp/final",
                                    "pipeline/final", "zero3/final", "lora_ddp/final"])
def test_saved_tokenizer_renders_prompts_as_in_training(runs, folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftk.config.options import ModelConfig
    from hftk.data.chat import resolve_template
    from hftk.models.loading import load_tokenizer

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
