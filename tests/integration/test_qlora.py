"""QLoRA (a bitsandbytes 4-bit / 8-bit base), DoRA and 8-bit AdamW on 2 gloo ranks: losses equal one
process's run of the same options within the LoRA suite's tolerance (tests/integration/test_lora.py), the
saved adapter loads with ``PeftModel.from_pretrained`` onto the quantized base and gives the run's own
final eval loss (what does not run is refused before launch by name: tests/unit/models/test_lora.py).

Each run is its own warm launch (tests/warm.py): one process x batch 8 (the references), then 2 ranks
x 4 (ddp, fsdp). Tiny GPT-2 (transformers swaps its Conv1D layers for bitsandbytes ``Linear4bit``, so
PEFT's LoRA runs without ``fan_in_fan_out``), tiny Llama, and a Llama made from its config whose MLP width
(160) is not a multiple of 64, evaluated inside each run (4-bit under ddp and fsdp, 8-bit base and
8-bit AdamW under ddp);
dropout off, r=8 on the default targets, 4 steps at lr 5e-3, AdamW epsilon 1e-4 (see
tests/integration/test_lora.py for why), clipping 1.0, eval batch 1 so two ranks average what one process does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import (FINETUNE, TINY_ARGS, greedy_ids, hftk_greedy_ids, losses, make_family, metrics, require_ranks,
                           tiny_eval_loss, torchrun)

STEPS = 4
EVAL_BLOCKS = 16
COMMON = ["--lora_r", "8", "--learning_rate", "5e-3", "--adam_epsilon", "1e-4", "--max_steps", str(STEPS),
          "--save_strategy", "steps", "--save_steps", str(STEPS),  # one Trainer checkpoint-N to export
          "--max_grad_norm", "1.0", "--per_device_eval_batch_size", "1", "--max_eval_samples", str(EVAL_BLOCKS)]
GPT2, LLAMA = ["--model_name_or_path", "builtin:gpt2-tiny"], ["--model_name_or_path", "builtin:llama-tiny"]
Q4 = ["--load_in_4bit"]
# A Llama whose MLP width is not a multiple of 64 (bitsandbytes' quantization block), made in the fixture:
# the shape bitsandbytes' packed CPU eval kernel could not take (hftk.models.loading.evaluate_4bit_as_trained).
ODD_SIZES = {"intermediate_size": 160, "num_hidden_layers": 4}
ODD = ["--model_name_or_path", "<odd-llama>"]
# name -> (options, strategies on 2 ranks); the reference is the same options in one process
CASES = {
    "gpt2-4bit": ([*GPT2, *Q4], ("ddp", "fsdp")),
    "llama-4bit": ([*LLAMA, *Q4, "--bnb_4bit_use_double_quant", "false"], ("ddp", "fsdp")),
    "llama-8bit": ([*LLAMA, "--load_in_8bit"], ("ddp",)),
    "odd-4bit": ([*ODD, *Q4], ("ddp", "fsdp")),
    "odd-8bit": ([*ODD, "--load_in_8bit"], ("ddp",)),
    "odd-adamw8bit": ([*ODD, "--lora_r", "0", "--optim", "adamw_bnb_8bit"], ("ddp",)),
    "gpt2-dora": ([*GPT2, "--use_dora", "--use_rslora"], ("ddp",)),
    "gpt2-adamw8bit": ([*GPT2, "--lora_r", "0", "--optim", "adamw_bnb_8bit"], ("ddp",)),  # full FT: 8-bit state
}
PAIRS = [(case, strategy) for case, (_, strategies) in CASES.items() for strategy in strategies]


def argv(case: str, strategy: str | None, out: Path) -> list[str]:
    options, _ = CASES[case]
    batch = ["--per_device_train_batch_size", "8"] if strategy is None else [
        "--strategy", strategy, "--per_device_train_batch_size", "4"]
    options = [str(out.parent / "odd-llama") if o == ODD[1] else o for o in options]
    return [*TINY_ARGS, *COMMON, *options, *batch, "--output_dir", str(out)]


def launch(nproc: int, argv: list[str], name: str) -> None:
    result = torchrun(nproc, FINETUNE, argv, timeout=900)
    assert result.returncode == 0, f"{name} failed:\n{result.output[-8000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_ranks(2)
    root = tmp_path_factory.mktemp("qlora")
    make_family("llama", root / "odd-llama", **ODD_SIZES)
    for c in CASES:
        launch(1, argv(c, None, root / f"single-{c}"), f"single-{c}")
    for c, s in PAIRS:
        launch(2, argv(c, s, root / f"{s}-{c}"), f"{s}-{c}")
    return root


def final_eval_loss(folder: Path) -> float:
    return [m["eval_loss"] for m in metrics(folder) if "eval_loss" in m][-1]


@pytest.mark.slow
@pytest.mark.parametrize("case,strategy", PAIRS)
def test_losses_match_single_process(runs, case, strategy):
    ref, got = losses(runs / f"single-{case}"), losses(runs / f"{strategy}-{case}")
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-4), (case, strategy, step, got, ref)
    assert ref[STEPS] < ref[1] - 0.02, ref  # it learns
    assert final_eval_loss(runs / f"{strategy}-{case}") == pytest.approx(final_eval_loss(runs / f"single-{case}"),
                                                                         abs=1e-4)


def quantized_base(case: str, runs: Path):
    """The base of ``case`` quantized as the run loaded it (transformers' BitsAndBytesConfig, CPU; 4-bit layers
    evaluated with the kernel they train with, as hftk's ``load_model`` keeps them)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hftk.data.builtin import materialize_model
    from hftk.models.loading import evaluate_4bit_as_trained

    options, _ = CASES[case]
    model = runs / "odd-llama" if options[1] == ODD[1] else materialize_model(options[1])
    if "--load_in_8bit" in options:
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                                    bnb_4bit_use_double_quant="--bnb_4bit_use_double_quant" not in options)
    base = AutoModelForCausalLM.from_pretrained(model, quantization_config=config, device_map={"": "cpu"})
    evaluate_4bit_as_trained(base)
    return base


@pytest.mark.slow
@pytest.mark.parametrize("case,strategy", [("gpt2-4bit", "fsdp"), ("llama-8bit", "ddp"), ("odd-4bit", "fsdp")])
def test_adapter_reloads_on_the_quantized_base_at_the_live_eval_loss(runs, case, strategy, tmp_path):
    from peft import PeftModel

    folder = runs / f"{strategy}-{case}" / "final"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is False and config["r"] == 8
    model = PeftModel.from_pretrained(quantized_base(case, runs), str(folder))
    assert any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules())
    assert tiny_eval_loss(model, tmp_path, EVAL_BLOCKS) == pytest.approx(final_eval_loss(folder.parent), abs=1e-4)


@pytest.mark.slow
def test_dora_adapter_holds_magnitudes_as_peft_saves_them(runs):
    """DoRA's magnitude vectors are saved under PEFT's own keys (get_peft_model_state_dict's), rsLoRA recorded."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hftk.data.builtin import materialize_model

    folder = runs / "ddp-gpt2-dora" / "final"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["use_rslora"] is True
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert any("lora_magnitude_vector" in k for k in saved)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(materialize_model("builtin:gpt2-tiny")),
                                      str(folder))
    loaded = get_peft_model_state_dict(model)
    assert sorted(loaded) == sorted(saved)  # hftk's keys are PEFT's, so every magnitude loads
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.slow
def test_adamw_8bit_keeps_8bit_state(runs):
    """adamw_bnb_8bit really ran: the optimizer state each rank holds (memory.model_state_bytes, read from
    the optimizer itself) is far below torch AdamW's 8 bytes per parameter. Of tiny GPT-2's ~250k
    parameters, the embeddings (~147k) keep 32-bit state (the Trainer's override for bitsandbytes) and
    the blocks' weights (~100k) 2 bytes, so the state is ~0.69 of AdamW's."""
    (line,) = [m["model_state"] for m in metrics(runs / "ddp-gpt2-adamw8bit") if "model_state" in m]
    for rank in line:
        params = rank["param_elements_full"]
        assert 2 * params < rank["optimizer"] < 0.75 * 8 * params, rank


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["fsdp-gpt2-4bit/final", f"ddp-gpt2-4bit/checkpoint-{STEPS}"])
def test_hftk_generate_of_a_qlora_adapter_says_what_peft_on_the_quantized_base_says(runs, folder):
    """The adapter on its base quantized as in training (PEFT, 4-bit layers): the reference for
    ``hftk generate``, which rebuilds that base from the saved quantization record and dequantizes it."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    reference = PeftModel.from_pretrained(quantized_base("gpt2-4bit", runs), str(runs / folder))
    assert greedy_ids(reference, AutoTokenizer.from_pretrained(runs / folder)) == hftk_greedy_ids(runs / folder)


@pytest.mark.slow
def test_merged_export_is_the_dequantized_base_plus_adapter(runs, tmp_path):
    """``hftk export --merge`` of a QLoRA run: a full-precision GPT-2 folder (Conv1D layout back) at the
    live eval loss -- the adapter merged into the base it was trained against -- and a card saying so."""
    from transformers import AutoModelForCausalLM

    from hftk.publish.export import main as export_main

    run, out = runs / "fsdp-gpt2-4bit", tmp_path / "merged"
    assert export_main([str(run / "final"), str(out), "--merge"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not getattr(model, "is_quantized", False) and model.dtype == torch.float32
    assert tiny_eval_loss(model, tmp_path, EVAL_BLOCKS) == pytest.approx(final_eval_loss(run), abs=1e-4)
    card = (out / "README.md").read_text()
    assert "dequantized from its 4-bit (nf4, bitsandbytes)" in card, card
    # The Trainer's own checkpoint-N (ddp) merges into the same dequantized base as final/: equal weights
    # (merged into the full-precision base instead, every quantized weight would differ).
    merged = {}
    for folder in ("final", f"checkpoint-{STEPS}"):
        assert export_main([str(runs / "ddp-gpt2-4bit" / folder), str(tmp_path / folder), "--merge"]) == 0
        merged[folder] = AutoModelForCausalLM.from_pretrained(tmp_path / folder).state_dict()
    assert all(torch.equal(merged["final"][k], merged[f"checkpoint-{STEPS}"][k]) for k in merged["final"])
    checkpoint_model = AutoModelForCausalLM.from_pretrained(tmp_path / f"checkpoint-{STEPS}")  # the training-time model
    assert tiny_eval_loss(checkpoint_model, tmp_path, EVAL_BLOCKS) == pytest.approx(
        final_eval_loss(runs / "ddp-gpt2-4bit"), abs=1e-4)
