"""LoRA through PEFT under every strategy on 2 gloo ranks: losses equal one process, every
strategy saves the complete adapter (final folder and checkpoints) equal to one process's, the
adapter and the merged export reload at the live eval loss, the Hub gets the adapter or the
merged model with a card naming the base, the plan counts only the adapters (the in-process checks:
tests/unit/models/test_lora.py).

Runs, shared by the module fixture (each on warm ranks: ``tests.helpers.finetune_cells``) (tiny tied GPT-2, dropout off, r=8 on the default
targets c_attn/c_proj/c_fc, 10 steps at global batch 8, clipping 1.0, checkpoints at 5 and 10,
a final evaluation with eval batch 1 so two ranks average exactly what one process does):

- ``single``: 1 process x 8, the reference;
- ``ddp``: 2 x 4 with reentrant gradient checkpointing and ``find_unused_parameters`` (the field's
  "mark a variable ready only once" combination); pushes the merged model (``--hub_push_merged``)
  to a local Hub;
- ``fsdp`` (2 x 4, ``fsdp_state_dict full``: adapter-only model state in its checkpoints) and
  ``zero3`` (2 x 4, pushes the adapter) with gradient checkpointing;
- ``zero2`` and ``zero3_offload`` (2 x 4) without it;
- ``pipeline``: 2 stages x 8 (4 micro-batches of 2, 1F1B) with gradient checkpointing;
- ``fsdp_resume``: ``fsdp``'s checkpoint-5 continued to step 10 (adapter loaded into the shards),
  now writing sharded checkpoints.

AdamW runs with ``adam_epsilon`` 1e-4: with the default 1e-8, Adam's normalisation turns the
last-bit differences of a 2-rank gradient sum (reduction order) into up to 4e-5 on the few
adapter elements whose gradient is near zero (measured under DDP: 48 of 16,384 elements over 1e-6
after 10 steps, losses still equal to 1e-6; with 1e-5 the worst strategy, pipeline, was at 7e-7).
A larger epsilon keeps the update linear there, so the comparison at 1e-6 checks the gathering
and saving, not rounding.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from tests.faults import hub_env
from tests.helpers import finetune, finetune_cells, losses, metrics, tiny_eval_loss

STEPS = 10
LORA = ["--lora_r", "8", "--learning_rate", "5e-3", "--adam_epsilon", "1e-4", "--max_steps", str(STEPS),
        "--max_grad_norm", "1.0", "--save_strategy", "steps", "--save_steps", "5", "--per_device_eval_batch_size", "1"]
GC = ["--gradient_checkpointing", "true"]
MERGED_REPO, ADAPTER_REPO = "hftk-test/lora-merged", "hftk-test/lora-adapter"
PUSH = ["--push_to_hub", "--hub_strategy", "end", "--hub_retry_backoff_s", "0.2"]
RUNS = {  # name -> (processes, options besides LORA)
    "ddp": (2, ["--per_device_train_batch_size", "4", *GC, "--gradient_checkpointing_kwargs", '{"use_reentrant": true}',
                "--ddp_find_unused_parameters", "true", *PUSH, "--hub_model_id", MERGED_REPO, "--hub_push_merged"]),
    "fsdp": (2, ["--strategy", "fsdp", "--fsdp_state_dict", "full", "--per_device_train_batch_size", "4", *GC]),
    "zero2": (2, ["--strategy", "zero2", "--per_device_train_batch_size", "4"]),
    "zero3": (2, ["--strategy", "zero3", "--per_device_train_batch_size", "4", *GC, *PUSH,
                  "--hub_model_id", ADAPTER_REPO]),
    "zero3_offload": (2, ["--strategy", "zero3_offload", "--per_device_train_batch_size", "4"]),
    "pipeline": (2, ["--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "4",
                     "--per_device_train_batch_size", "8", *GC]),
}
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
pytestmark = pytest.mark.timeout(1800)  # the first slow test launches every run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hub):
    """The reference, then every 2-rank run (the Trainer's strategies, the resume, the pipeline loop)."""
    root = tmp_path_factory.mktemp("lora")
    finetune(1, [*LORA, "--per_device_train_batch_size", "8", "--output_dir", str(root / "single")])
    cells = {name: [*LORA, *extra, "--output_dir", str(root / name)] for name, (_, extra) in RUNS.items()}
    cells["fsdp_resume"] = [*LORA, "--strategy", "fsdp", "--per_device_train_batch_size", "4", *GC, "--output_dir",
                            str(root / "fsdp_resume"), "--resume_from_checkpoint", "latest"]
    copy = {"copy": [root / "fsdp" / "checkpoint-5", root / "fsdp_resume" / "checkpoint-5"]}
    logs = finetune_cells(2, cells, root, env=hub_env(hub), options={"fsdp_resume": copy})
    return root, logs, hub


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    assert all((folder / f).is_file() for f in ADAPTER_FILES), sorted(p.name for p in folder.iterdir())
    return load_file(str(folder / "adapter_model.safetensors"))


def expected_adapter_shapes() -> dict[str, tuple[int, ...]]:
    """What PEFT itself saves for this LoRA config on the tiny GPT-2 (independent of hftk's gathering)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from hftk.data.builtin import materialize_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(materialize_model("builtin:gpt2-tiny")))
    config = LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(get_peft_model(model, config)).items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_losses_match_single_process(runs, name):
    root, _, _ = runs
    ref, got = losses(root / "single"), losses(root / name)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-4), (name, step)
    assert ref[STEPS] < ref[1] - 0.05  # the adapters learn


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_saved_adapter_is_complete_and_equals_single_process(runs, name):
    """Final folder and both checkpoints: every LoRA tensor, full shape, values of one process's run."""
    root, _, _ = runs
    shapes = expected_adapter_shapes()
    assert len(shapes) == 2 * 4 * 2  # A and B for c_attn, attn.c_proj, c_fc, mlp.c_proj in 2 blocks
    for folder in ("final", f"checkpoint-{STEPS}", "checkpoint-5"):
        mine, ref = adapter(root / name / folder), adapter(root / "single" / folder)
        assert {k: tuple(v.shape) for k, v in mine.items()} == shapes, (name, folder)
        assert max_diff(mine, ref) < 1e-6, (name, folder)
    final = adapter(root / name / "final")
    assert min(float(v.abs().max()) for k, v in final.items() if "lora_B" in k) > 1e-3  # trained (B starts at 0)
    config = json.loads((root / name / "final" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA" and config["inference_mode"] is True
    assert Path(config["base_model_name_or_path"], "config.json").is_file()


@pytest.mark.slow
def test_fsdp_resumes_from_the_adapter_exactly(runs):
    """A full-format FSDP checkpoint holds the adapter (no base weights); loaded into the shards it
    continues the run exactly, and the sharded checkpoints written after it hold the adapter too."""
    root, _, _ = runs
    saved = root / "fsdp" / "checkpoint-5"
    assert (saved / "fsdp_optimizer_full.pt").is_file() and (saved / "tokenizer.json").is_file()
    assert not (saved / "fsdp_model").exists() and not (saved / "model.safetensors").exists()
    whole, resumed = losses(root / "fsdp"), losses(root / "fsdp_resume")
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole[step], abs=1e-6), step
    sharded = root / "fsdp_resume" / f"checkpoint-{STEPS}"
    assert (sharded / "fsdp_model" / ".metadata").is_file()
    for folder in (sharded, root / "fsdp_resume" / "final"):
        assert max_diff(adapter(folder), adapter(root / "fsdp" / "final")) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["single", *RUNS])
def test_trainable_parameter_count_is_logged(runs, name):
    root, _, _ = runs
    (record,) = [m for m in metrics(root / name) if "lora_trainable_params" in m]
    trainable = sum(v.numel() for v in adapter(root / "single" / "final").values())
    assert record["lora_trainable_params"] == trainable == 16_384
    base = 263_936 - trainable  # tiny GPT-2: 247,552 parameters, tied embedding counted once
    assert record["lora_total_params"] == base + trainable  # ZeRO-3 counts its partitions' full sizes


@pytest.mark.slow
def test_ddp_gradient_checkpointing_lora_trains(runs):
    root, logs, _ = runs
    assert "mark a variable ready only once" not in logs["ddp"]
    training = json.loads((root / "ddp" / "final" / "hftk_run.json").read_text())["config"]["training"]
    assert training["gradient_checkpointing"] is True and training["ddp_find_unused_parameters"] is True
    assert json.loads(training["gradient_checkpointing_kwargs"]) == {"use_reentrant": True}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "pipeline"])
def test_adapter_and_merged_export_reload_at_the_live_eval_loss(runs, name, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hftk.publish.export import main as export_main

    root, _, _ = runs
    live = [m["eval_loss"] for m in metrics(root / name) if "eval_loss" in m][-1]
    final = root / name / "final"
    base = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(final))
    assert tiny_eval_loss(with_adapter, tmp_path) == pytest.approx(live, abs=1e-5)

    alone = tmp_path / "adapter"  # without --merge: the checkpoint's adapter as a clean folder
    assert export_main([str(root / name / f"checkpoint-{STEPS}"), str(alone)]) == 0
    assert sorted(p.name for p in alone.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json"]
    assert max_diff(adapter(alone), adapter(final)) == 0.0
    merged = tmp_path / "merged"
    assert export_main([str(root / name / f"checkpoint-{STEPS}"), str(merged), "--merge"]) == 0
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert tiny_eval_loss(model, tmp_path) == pytest.approx(live, abs=1e-5)


@pytest.mark.slow
def test_hub_gets_the_adapter_or_the_merged_model_with_a_card_naming_the_base(runs):
    root, _, hub = runs
    cards = {}
    for repo, name in ((ADAPTER_REPO, "zero3"), (MERGED_REPO, "ddp")):
        files = hub.state.files(repo)
        card = files["README.md"].decode()
        cards[repo] = yaml.safe_load(re.match(r"^---\n(.*?)\n---\n", card, re.S).group(1))
        assert "Fine-tuned from `builtin:gpt2-tiny`" in card and "| lora_r | 8 |" in card, card
        assert f"**{name}** over 2 process(es)" in card
    adapter_files = hub.state.files(ADAPTER_REPO)
    assert set(ADAPTER_FILES) <= set(adapter_files) and "model.safetensors" not in adapter_files
    assert adapter_files["adapter_model.safetensors"] == (root / "zero3/final/adapter_model.safetensors").read_bytes()
    assert cards[ADAPTER_REPO]["library_name"] == "peft"
    merged_files = hub.state.files(MERGED_REPO)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(merged_files)
    assert not set(ADAPTER_FILES) & set(merged_files)
    assert cards[MERGED_REPO]["library_name"] == "transformers"
    assert "merged into the base weights" in merged_files["README.md"].decode()


@pytest.mark.slow
def test_memory_plan_counts_only_the_adapters(runs):
    """The plan's trainable count, gradient and optimizer bytes are what the DDP ranks measured."""
    from hftk.config.options import ModelConfig
    from hftk.models.loading import load_model_config
    from hftk.plan import estimate

    root, _, _ = runs
    shape = estimate.model_shape(load_model_config(ModelConfig(model_name_or_path="builtin:gpt2-tiny")), lora_r=8)
    full = estimate.model_shape(load_model_config(ModelConfig(model_name_or_path="builtin:gpt2-tiny")))
    assert shape.trainable == 16_384 and full.trainable == full.params == shape.params - 16_384
    inputs = estimate.PlanInputs(world_size=2, device_memory_bytes=1 << 34, seq_len=64, micro_batch=4, device="cpu")
    row = estimate.estimate("ddp", shape, inputs)
    (measured,) = [m["model_state"] for m in metrics(root / "ddp") if "model_state" in m]
    for rank in measured:
        assert rank["grads"] == row.grads == 4 * 16_384  # no gradient for the frozen base
        assert 0 <= rank["optimizer"] - row.optimizer <= 16 * 8  # AdamW moments (+ one step counter per tensor)
    assert row.optimizer < estimate.estimate("ddp", full, inputs).optimizer / 10
