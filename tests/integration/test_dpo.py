"""DPO through hftk equals a one-process TRL DPOTrainer: 2 gloo ranks under ddp (GPT-2, Llama, Qwen2, GPT-NeoX,
Mistral, Qwen3 and Gemma 3 made from configs), fsdp and ZeRO-1/2/3/3-offload (GPT-2; ZeRO-3: Gemma 3 too), LoRA under ddp
(GPT-2, Qwen3) and ZeRO-2 and QLoRA (4-bit NF4) under ddp
give the same per-step loss, rewards/chosen, rewards/rejected and rewards/margins (fp32, 1e-5) and the same final
weights (or adapter; QLoRA's, which TRL keeps in bf16, within one bf16 step); a short run on a learnable
preference set (the README's DPO recipe, run as written) lifts held-out rewards/accuracies above chance;
conversational pairs (message lists through the run's chat template) equal TRL given that template; a run resumed from checkpoint-3 (ddp, ZeRO-3)
continues exactly; two weighted preference files mix; --push_to_hub sends final/ and a card that says DPO; a
named reference model of other weights (ddp, fsdp, ZeRO-3) and precomputed reference log-probs (ddp, ZeRO-3)
equal TRL. The cells run on shared warm ranks
(``finetune_cells``); the references (one per family and adapter) run in this process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import (TINY_ARGS, doc_block, doc_project, finetune_cells, load_weights, make_family, max_weight_diff,
                           metrics, preference_pairs, run_doc_command, shell_commands)

# fp32 on both sides: DPOConfig's bf16 defaults to on (CPU autocast), under which one process alone differs by
# ~2e-4 between a batch of 8 and 2 accumulated batches of 4; in fp32 those agree within 1.2e-7 (weights, 4 steps).
TOL = 1e-5
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins")
STEPS, BATCH = 4, 8
# (strategy, family, adapter: False, True (LoRA) or "qlora") on 2 ranks, each against the one-process reference
# of its family and adapter.
CELLS = [("ddp", "gpt2", False), ("ddp", "llama", False), ("ddp", "qwen2", False), ("ddp", "gpt_neox", False),
         ("ddp", "mistral", False), ("ddp", "qwen3", False), ("ddp", "gemma3_text", False), ("zero3", "gemma3_text", False),
         ("ddp", "qwen3", True), ("fsdp", "gpt2", False),
         ("zero1", "gpt2", False), ("zero2", "gpt2", False), ("zero3", "gpt2", False), ("zero3_offload", "gpt2", False),
         ("ddp", "gpt2", True), ("zero2", "gpt2", True), ("ddp", "gpt2", "qlora")]
# ChatML as transformers' and TRL's docs write it: the reference's template, owing nothing to hftk's copy.
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
REFERENCE_OPTIONS = ("ddp", "fsdp", "zero3")  # ref_model_name_or_path under each; precompute_ref_log_probs
PRECOMPUTED = ("ddp", "zero3")  # under these (fsdp refuses it by name: tests/unit/config/test_preference.py)
RESUMED = ("ddp", "zero3")  # exact resume: the Trainer's checkpoint, and DeepSpeed's with the reference partitioned
LORA = ["--lora_r", "8"]  # hftk's defaults otherwise: alpha 16, dropout 0, every linear layer of the blocks
QLORA = [*LORA, "--load_in_4bit"]  # hftk's defaults otherwise: NF4, double quantization, fp32 compute
# How each strategy holds the reference (checked by hftk before training): sharded wherever the policy is.
WHOLE = "a whole copy on each rank"
HELD = {"ddp": WHOLE, "zero1": WHOLE, "zero2": WHOLE, "fsdp": "sharded over 2 ranks (FSDP2)",
        "zero3": "partitioned over 2 ranks (ZeRO-3)", "zero3_offload": "partitioned over 2 ranks (ZeRO-3)",
        "lora": "the policy with a frozen copy of its starting adapter (no second model)"}
# Every cell runs on the first test's use of the fixture (DeepSpeed's first start on a machine builds its ops).
pytestmark = pytest.mark.timeout(1800)


def _other_reference(model_dir: Path, folder: Path) -> Path:
    """The starting model with every weight moved by seeded noise: a reference the policy does not start from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return folder


def _conversations(path: Path, rows: int, seed: int) -> Path:
    """The same rule as message lists (TRL's conversational format: a user turn, an assistant turn each side)."""
    with path.open("w") as f:
        for line in preference_pairs(path.with_suffix(".standard.jsonl"), rows, seed).read_text().splitlines():
            row = json.loads(line)
            f.write(json.dumps({"prompt": [{"role": "user", "content": row["prompt"]}],
                                "chosen": [{"role": "assistant", "content": row["chosen"].strip()}],
                                "rejected": [{"role": "assistant", "content": row["rejected"].strip()}]}) + "\n")
    return path


def _name(strategy: str, family: str, lora: bool | str) -> str:
    return f"{strategy}_{family}" + ("_qlora" if lora == "qlora" else "_lora" if lora else "")


def _reference(model_dir: Path, data: Path, out: Path, lora: bool | str, chat_template: str | None = None,
               ref_dir: Path | None = None) -> tuple[list[dict], dict]:
    """TRL's own DPOTrainer, one process, batch 8, fp32 (bf16 off: DPOConfig's default is on): its per-step
    logs and final weights (with ``lora``: PEFT's LoRA of the same config and seed; TRL's reference is then the
    base with the adapter disabled; the adapter's weights; ``"qlora"``: the base loaded in 4 bits by
    transformers' BitsAndBytesConfig and prepared by PEFT's prepare_model_for_kbit_training, as QLoRA recipes do;
    ``ref_dir``: that model as TRL's ``ref_model``)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(7)
    if lora == "qlora":
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=quantization,
                                                     device_map={"": "cpu"})
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)  # lora_A's draw
        conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())  # GPT-2's layers store (in, out)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules="all-linear", fan_in_fan_out=conv1d))
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3,
                     lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, seed=7, report_to=[],
                     save_strategy="no", eval_strategy="no", use_cpu=True, beta=0.1, max_length=64,
                     max_grad_norm=1.0, disable_tqdm=True, adam_epsilon=1e-4, bf16=False)
    train = datasets.load_dataset("json", data_files={"train": str(data)})["train"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32) if ref_dir is not None else None
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(str(out / "final"))
    logs = [row for row in trainer.state.log_history if "rewards/chosen" in row]
    return logs, _saved(out / "final", lora)


def _saved(folder: Path, lora: bool) -> dict:
    if not lora:
        return load_weights(folder)
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dpo")
    data = preference_pairs(root / "prefs.jsonl", 64, 0)
    models = {family: make_family(family, root / f"{family}_model") for family in {cell[1] for cell in CELLS}}
    common = ["--method", "dpo", "--dataset", str(data), "--per_device_train_batch_size", str(BATCH // 2),
              "--max_steps", str(STEPS), "--beta", "0.1", "--eval_fraction", "0", "--adam_epsilon", "1e-4"]
    cells = {_name(*cell): [*common, "--strategy", cell[0], "--model_name_or_path", str(models[cell[1]]),
                            *(QLORA if cell[2] == "qlora" else LORA if cell[2] else []),
                            "--output_dir", str(root / _name(*cell))] for cell in CELLS}
    other = _other_reference(models["gpt2"], root / "other_reference")
    for strategy in REFERENCE_OPTIONS:  # a named reference of other weights; precomputed log-probs
        shared = [*common, "--strategy", strategy, "--model_name_or_path", str(models["gpt2"])]
        cells[f"named_ref_{strategy}"] = [*shared, "--ref_model_name_or_path", str(other),
                                          "--output_dir", str(root / f"named_ref_{strategy}")]
        if strategy in PRECOMPUTED:
            cells[f"precomputed_{strategy}"] = [*shared, "--precompute_ref_log_probs",
                                                "--output_dir", str(root / f"precomputed_{strategy}")]
    conversations = _conversations(root / "conversations.jsonl", 64, 0)
    cells["conversations"] = [*[str(conversations) if a == str(data) else a for a in common],
                              "--model_name_or_path", str(models["gpt2"]),
                              "--chat_template", "chatml", "--no_add_chat_tokens",
                              "--output_dir", str(root / "conversations")]
    second = preference_pairs(root / "prefs_b.jsonl", 32, 2)
    mixed = root / "mixed.yaml"
    mixed.write_text(f"data:\n  datasets:\n    - path: {data}\n      weight: 2\n    - path: {second}\n")
    cells["mixed"] = [*[a for a in common if a not in ("--dataset", str(data))], "--config", str(mixed),
                      "--model_name_or_path", str(models["gpt2"]), "--output_dir", str(root / "mixed")]
    options = {}
    for strategy in RESUMED:  # 6 steps saving at 3, then a new folder holding only checkpoint-3 resumed
        args = [*common, "--strategy", strategy, "--model_name_or_path", str(models["gpt2"]), "--max_steps", "6",
                "--save_strategy", "steps", "--save_steps", "3"]
        cells[f"{strategy}_full"] = [*args, "--output_dir", str(root / f"{strategy}_full")]
        cells[f"{strategy}_resumed"] = [*args, "--output_dir", str(root / f"{strategy}_resumed"),
                                        "--resume_from_checkpoint", "latest"]
        options[f"{strategy}_resumed"] = {"copy": [root / f"{strategy}_full" / "checkpoint-3",
                                                   root / f"{strategy}_resumed" / "checkpoint-3"]}
    from hftk.cli import main as hftk  # hftk preprocess once (TRL's tokenisation), then a ddp run reads the folder

    ddp_gpt2 = cells[_name("ddp", "gpt2", False)]
    tokenized = ["--tokenized_path", str(root / "tokenized")]
    assert hftk(["preprocess", *TINY_ARGS, *ddp_gpt2[:-2], *tokenized, "--output_dir", str(root / "unused")]) == 0
    cells["preprocessed"] = [*ddp_gpt2[:-2], *tokenized, "--output_dir", str(root / "preprocessed")]
    cells["truncated"] = [*ddp_gpt2[:-2], "--max_length", "10", "--truncation", "truncate",
                          "--output_dir", str(root / "truncated")]
    outputs = finetune_cells(2, cells, root, timeout=900, options=options)
    learn = doc_project(root / "recipe")  # the README's DPO recipe, as written: its pairs, then 60 steps
    for argv, stdin in shell_commands(doc_block("dpo-recipe")):
        result = run_doc_command(argv, stdin, learn, timeout=900)
        assert result.returncode == 0, f"{argv[:2]} failed ({result.returncode}):\n{result.output[-6000:]}"
    outputs["learn"] = result.output
    return {"root": root, "data": data, "conversations": conversations, "other": other, "outputs": outputs,
            "learn": learn / "outputs" / "dpo", **models}


@pytest.fixture(scope="module")
def references(runs) -> dict[str, tuple[list[dict], dict]]:
    """Each (family, lora)'s one-process TRL run: its logs and weights."""
    return {(family, lora): _reference(runs[family], runs["data"], runs["root"] / _name("ref", family, lora), lora)
            for family, lora in sorted({cell[1:] for cell in CELLS}, key=str)}


def _tied_once(weights: dict) -> dict:
    """GPT-2's tied LM head is the token embedding; a save may hold it under both names (ZeRO-1/2's final/) or
    once: compared once (a head that differs from the embedding stays in and fails the key check)."""
    head, embedding = weights.get("lm_head.weight"), weights.get("transformer.wte.weight")
    if head is not None and embedding is not None and (head == embedding).all():
        return {k: v for k, v in weights.items() if k != "lm_head.weight"}
    return weights


@pytest.mark.parametrize("strategy, family, lora", CELLS, ids=[_name(*cell) for cell in CELLS])
def test_equals_one_process_trl(runs, references, strategy, family, lora) -> None:
    """Under LoRA no second model exists: TRL's reference is the policy with a frozen copy of its starting
    adapter (equal to the base: lora_B starts at 0)."""
    ref_logs, ref_weights = references[family, lora]
    out = runs["root"] / _name(strategy, family, lora)
    held = HELD["lora" if lora else strategy]
    assert f"hftk: DPO reference: {held}\n" in runs["outputs"][_name(strategy, family, lora)]
    ours = [row for row in metrics(out) if "rewards/chosen" in row]
    assert [row["step"] for row in ours] == list(range(1, STEPS + 1))
    for step, (mine, theirs) in enumerate(zip(ours, ref_logs, strict=True), start=1):
        for key in KEYS:
            assert mine[key] == pytest.approx(theirs[key], abs=TOL), (step, key, mine[key], theirs[key])
    assert ours[-1]["rewards/margins"] != 0  # the policy moved away from the reference
    if lora == "qlora":
        # TRL trains a quantized model's adapter in bf16 (QLoRA's recipe): each optimizer step rounds the weights
        # to bf16, so a difference of 1e-7 in a gradient can move a weight by one bf16 step (at the tensor's scale:
        # lora_B starts at 0 and holds values near it), once per optimizer step.
        saved = _saved(out / "final", lora)
        assert saved.keys() == ref_weights.keys()
        for key, ref in ref_weights.items():
            assert ref.dtype == saved[key].dtype == torch.bfloat16, key
            diff, scale = (saved[key].float() - ref.float()).abs().max(), ref.float().abs().max()
            assert diff <= STEPS * torch.finfo(torch.bfloat16).eps * scale, (key, diff, scale)
    else:
        assert max_weight_diff(_tied_once(_saved(out / "final", lora)), _tied_once(ref_weights)) < TOL
    if lora:
        assert not (out / "final" / "model.safetensors").exists()  # the adapter alone


@pytest.mark.parametrize("strategy", RESUMED)
def test_resume_from_a_checkpoint_continues_exactly(runs, strategy) -> None:
    """The reference is not in a checkpoint (frozen: loaded again from the starting model); the policy, optimizer,
    scheduler, data order and generators are, so steps 4-6 and the final weights equal the uninterrupted run's."""
    full, resumed = runs["root"] / f"{strategy}_full", runs["root"] / f"{strategy}_resumed"
    assert "resuming from" in runs["outputs"][f"{strategy}_resumed"]
    theirs = {row["step"]: row for row in metrics(full) if "rewards/chosen" in row}
    ours = {row["step"]: row for row in metrics(resumed) if "rewards/chosen" in row}
    assert sorted(ours) == [4, 5, 6] and sorted(theirs) == list(range(1, 7))
    for step in ours:
        for key in KEYS:
            assert ours[step][key] == pytest.approx(theirs[step][key], abs=1e-6), (step, key)
    assert max_weight_diff(_tied_once(load_weights(resumed / "final")), _tied_once(load_weights(full / "final"))) < 1e-6


def test_conversational_pairs_equal_one_process_trl_with_the_same_template(runs) -> None:
    """Message-list rows through the run's chat template (chatml, markers left as text): the same per-step figures
    and weights as TRL given that template; final/ carries it."""
    logs, weights = _reference(runs["gpt2"], runs["conversations"], runs["root"] / "ref_conversations", False,
                               chat_template=CHATML)
    out = runs["root"] / "conversations"
    ours = [row for row in metrics(out) if "rewards/chosen" in row]
    assert [row["step"] for row in ours] == list(range(1, STEPS + 1))
    for step, (mine, theirs) in enumerate(zip(ours, logs, strict=True), start=1):
        for key in KEYS:
            assert mine[key] == pytest.approx(theirs[key], abs=TOL), (step, key, mine[key], theirs[key])
    assert max_weight_diff(_tied_once(load_weights(out / "final")), _tied_once(weights)) < TOL
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out / "final").chat_template.strip() == CHATML  # jinja drops a final newline


def test_several_preference_datasets_train_mixed_and_are_recorded(runs) -> None:
    """Two preference files weighted 2:1 (data.datasets, as for supervised data; the mixing itself is checked
    against datasets' interleave_datasets in tests/unit/data/test_preference.py): the run trains and its record
    lists both with their weights."""
    final = runs["root"] / "mixed" / "final"
    assert [row["step"] for row in metrics(runs["root"] / "mixed") if "rewards/chosen" in row] == list(range(1, STEPS + 1))
    recorded = json.loads((final / "hftk_run.json").read_text())["datasets"]
    assert [(Path(d["path"]).name, d["weight"]) for d in recorded] == [("prefs.jsonl", 2.0), ("prefs_b.jsonl", None)]


def test_push_to_hub_sends_the_dpo_model_and_its_card(runs, hub, tmp_path) -> None:
    """--push_to_hub on a DPO run (the stand-in Hub, driven by the real huggingface_hub client): final/'s weights,
    the run record and a model card that says DPO reach the repository."""
    from safetensors.torch import load

    from tests.faults import hub_env
    from tests.helpers import finetune

    out = tmp_path / "pushed"
    finetune(2, ["--method", "dpo", "--dataset", str(runs["data"]), "--model_name_or_path", str(runs["gpt2"]),
                 "--per_device_train_batch_size", str(BATCH // 2), "--max_steps", "2", "--eval_fraction", "0",
                 "--output_dir", str(out), "--push_to_hub", "--hub_model_id", "hftk-test/tiny-dpo",
                 "--hub_strategy", "end", "--hub_retry_backoff_s", "0.1"], env=hub_env(hub))
    files = hub.state.files("hftk-test/tiny-dpo")
    assert {"model.safetensors", "config.json", "hftk_run.json", "README.md"} <= files.keys()
    assert max_weight_diff(load(files["model.safetensors"]), load_weights(out / "final")) == 0.0
    assert "- method: **DPO** (Direct Preference Optimization, TRL's DPOTrainer), beta 0.1" in \
        files["README.md"].decode()


def _assert_equal_run(out: Path, logs: list[dict], weights: dict) -> None:
    ours = [row for row in metrics(out) if "rewards/chosen" in row]
    assert [row["step"] for row in ours] == list(range(1, STEPS + 1))
    for step, (mine, theirs) in enumerate(zip(ours, logs, strict=True), start=1):
        for key in KEYS:
            assert mine[key] == pytest.approx(theirs[key], abs=TOL), (out.name, step, key, mine[key], theirs[key])
    assert max_weight_diff(_tied_once(load_weights(out / "final")), _tied_once(weights)) < TOL


@pytest.fixture(scope="module")
def named_reference(runs) -> tuple[list[dict], dict]:
    """One-process TRL given the noised model as its ref_model."""
    return _reference(runs["gpt2"], runs["data"], runs["root"] / "ref_named", False, ref_dir=runs["other"])


@pytest.mark.parametrize("strategy", REFERENCE_OPTIONS)
def test_a_named_reference_model_is_the_one_scored(runs, named_reference, strategy) -> None:
    """--ref_model_name_or_path with weights the policy does not start from: the run equals TRL given that model
    as ref_model (a run that scored the starting model instead starts at rewards 0 and fails)."""
    logs, weights = named_reference
    assert logs[0]["rewards/chosen"] != 0  # the reference differs from the policy from the first step
    _assert_equal_run(runs["root"] / f"named_ref_{strategy}", logs, weights)


@pytest.mark.parametrize("strategy", PRECOMPUTED)
def test_precomputed_reference_log_probs_train_as_the_live_reference(runs, references, strategy) -> None:
    """--precompute_ref_log_probs (no reference held while training): the same steps as TRL's live reference."""
    _assert_equal_run(runs["root"] / f"precomputed_{strategy}", *references["gpt2", False])


def test_held_out_preference_accuracy_rises_above_chance(runs) -> None:
    """The README's DPO recipe: held-out rewards/accuracies >= 0.8 after its 60 steps, said on its last line."""
    evals = [row for row in metrics(runs["learn"]) if "eval_rewards/accuracies" in row]
    assert evals and evals[-1]["eval_rewards/accuracies"] >= 0.8, evals
    assert not any("eval_perplexity" in row for row in metrics(runs["learn"]))  # not of a pairwise loss
    accuracy = evals[-1]["eval_rewards/accuracies"]
    assert re.search(rf"^hftk: done: step 60 in \d+ s, eval DPO loss [\d.]+, preference accuracy {accuracy:.3f}; ",
                     runs["outputs"]["learn"], re.M), runs["outputs"]["learn"][-2000:]


def test_run_record_and_model_card_say_dpo(runs) -> None:
    final = runs["learn"] / "final"
    hyper = json.loads((final / "hftk_run.json").read_text())["hyperparameters"]
    assert (hyper["method"], hyper["beta"], hyper["loss_type"]) == ("dpo", 0.1, "sigmoid")
    assert "- method: **DPO** (Direct Preference Optimization, TRL's DPOTrainer), beta 0.1, loss sigmoid" in \
        (final / "README.md").read_text()


def test_pairs_preprocessed_once_train_as_the_raw_pairs(runs) -> None:
    """`hftk preprocess --method dpo` (TRL's tokenisation, once) and a 2-rank run reading the folder: the same
    per-step figures and weights, bit for bit, as the run that tokenised the same pairs itself."""
    raw, folder = runs["root"] / _name("ddp", "gpt2", False), runs["root"] / "preprocessed"
    theirs, ours = ([row for row in metrics(out) if "rewards/chosen" in row] for out in (raw, folder))
    assert [row["step"] for row in ours] == list(range(1, STEPS + 1))
    assert [[row[key] for key in KEYS] for row in ours] == [[row[key] for key in KEYS] for row in theirs]
    assert max_weight_diff(load_weights(folder / "final"), load_weights(raw / "final")) == 0.0


def test_pairs_longer_than_max_length_are_truncated_with_one_summary_line(runs) -> None:
    """--max_length 10 with --truncation truncate: every pair (7 prompt tokens, 12 in all) is longer, TRL's
    collator keeps each one's start; rank 0 says so once and the run trains."""
    output = runs["outputs"]["truncated"]
    lines = [line for line in output.splitlines() if line.startswith("hftk: data: [train]:")]
    assert lines == ["hftk: data: [train]: truncated 64 (their completions cut short, without EOS), dropped 0 (the "
                     "prompt fills max_length: no completion token left) of 64 preference pairs longer than "
                     "max_length 10 (data.truncation=truncate)"], lines
    assert [row["step"] for row in metrics(runs["root"] / "truncated") if "rewards/chosen" in row] == \
        list(range(1, STEPS + 1))
