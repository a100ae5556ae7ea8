"""Samples during training on 2 gloo ranks: at every evaluation the samples equal, token for token (greedy,
fp32), what one process's plain ``model.generate`` makes on the checkpoint saved at that step, under ddp, zero1, zero2,
zero3, zero3_offload, fsdp, LoRA (ddp, fsdp, zero3) and QLoRA (ddp) on the Trainer, tp, cp, pipeline, LoRA under
pipeline and sp (weights consolidated on rank 0) on hftk's loop, and for held-out conversations' and preference
pairs' (dpo) prompts (``--num_eval_samples``); under zero3 and fsdp a prompt that stops at EOS at once on one
rank and one that runs to the limit on the other (the classic sharded-generation hang) finish under the timeout;
``samples.jsonl``, the tensorboard text and the wandb table hold the rows; the time is its own metric; a
preemption during sampling saves and exits 75.

Runs (each on warm ranks: ``tests.helpers.finetune_cells``): the tiny GPT-2 at a learning rate that changes its
greedy output from step to step, 2 steps, evaluation and a checkpoint at each; prompts dealt one per rank.
``uneven_*``: gpt2-small, whose folder's generation_config says EOS is also the token it first picks for one
prompt; a learning rate of 1e-8 keeps that choice for the one step it trains. Without ``synced_gpus`` both
crash (gloo: "Received data size doesn't match expected size"; checked by hand when this test was written).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from hftk.models.support_table import MATRIX_FAMILIES
from hftk.plan.types import MAX_REUSE_DISTANCE
from tests.helpers import finetune_cells, make_family, metrics, preference_pairs

STEPS, NEW = 2, 8
PROMPTS = ["And God said, Let there be", {"messages": [{"role": "user", "content": "Who made the heaven?"}]},
           "In the beginning"]
COMMON = ["--max_steps", str(STEPS), "--learning_rate", "5e-3", "--per_device_train_batch_size", "2",
          "--eval_strategy", "steps", "--eval_steps", "1", "--save_strategy", "steps", "--save_steps", "1",
          "--max_eval_samples", "2", "--sample_max_new_tokens", str(NEW),
          # the chat markers stay text: no new embedding rows (LoRA under zero3 cannot train them on a CPU), and
          # the tiny model's greedy output still changes from step 1 to step 2 at this learning rate
          "--chat_template", "chatml", "--no_add_chat_tokens"]
LORA = ["--lora_r", "4", "--learning_rate", "0.1"]
PIPELINE = ["--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "2"]
RUNS = {"ddp": ["--report_to", "tensorboard"], "lora": [*LORA, "--report_to", "wandb"],
        "chat_tokens": ["--add_chat_tokens", "true"],  # the markers become tokens, <|im_end|> an EOS
        "qlora": [*LORA, "--load_in_4bit"],
        "qlora_fsdp": [*LORA, "--load_in_4bit", "--strategy", "fsdp", "--fsdp_state_dict", "full"],
        "lora_fsdp": [*LORA, "--strategy", "fsdp", "--fsdp_state_dict", "full"],
        "lora_zero3": [*LORA, "--strategy", "zero3"], "zero3": ["--strategy", "zero3"], "fsdp": ["--strategy", "fsdp"],
        "zero1": ["--strategy", "zero1"], "zero2": ["--strategy", "zero2"], "zero3_offload": ["--strategy", "zero3_offload"],
        # hftk's own loop: generated on the weights consolidated on rank 0
        "tp": ["--strategy", "tp", "--tp_size", "2"], "cp": ["--strategy", "cp", "--cp_size", "2"],
        "pipeline": PIPELINE, "lora_pipeline": [*PIPELINE, *LORA],
        "sp": ["--strategy", "sp", "--sp_size", "2", "--model_name_or_path", "builtin:llama-tiny",
               "--learning_rate", "1e-2"]}
FAMILIES = tuple(f for f in MATRIX_FAMILIES if f != "gpt2")  # ddp on each claimed family beside the built-in GPT-2's runs
UNEVEN = ["zero3", "fsdp"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _row(prompt):
    return prompt if isinstance(prompt, dict) else {"prompt": prompt}


def _ids(tokenizer, prompt):
    if isinstance(prompt, dict):
        return tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    return tokenizer(prompt, return_tensors="pt").input_ids


def _greedy(model, tokenizer, ids, eos=None):
    """Plain greedy ``generate``: the tokenizer's EOS (the run aligns the model's to it) unless ``eos`` is given."""
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                    eos_token_id=eos or tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def _uneven_model(root: Path) -> tuple[Path, str, str, int]:
    """The built-in gpt2-small's folder with EOS = the token it picks first for prompt A; prompt B never meets it.
    gpt2-small (3.7M parameters) because ZeRO-3 keeps a model smaller than its reuse distance (1M parameters)
    gathered from one forward to the next: the tiny one's generation would need no collective at all."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftk.data.builtin import materialize_model

    folder = root / "eos_model"
    shutil.copytree(materialize_model("builtin:gpt2-small"), folder)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert model.num_parameters() > 2 * MAX_REUSE_DISTANCE
    first = _greedy(model, tokenizer, _ids(tokenizer, "And God said"))[0]
    assert first != tokenizer.eos_token_id
    candidates = ["In the beginning", "The earth was", "And the LORD spake", "Blessed are they", "unto Moses"]
    other = next(p for p in candidates if first not in _greedy(model, tokenizer, _ids(tokenizer, p)))
    model.generation_config.eos_token_id = [first, tokenizer.eos_token_id]
    model.generation_config.save_pretrained(folder)
    return folder, "And God said", other, first


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples")
    (root / "prompts.jsonl").write_text("".join(json.dumps(_row(p)) + "\n" for p in PROMPTS))
    folder, stop_now, run_on, eos = _uneven_model(root)
    (root / "uneven.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (stop_now, run_on)))
    cells = {name: [*COMMON, *extra, "--eval_prompts", str(root / "prompts.jsonl"), "--output_dir", str(root / name)]
             for name, extra in RUNS.items()}
    for family in FAMILIES:
        cells[f"ddp_{family}"] = [*COMMON, "--model_name_or_path", str(make_family(family, root / f"{family}_model")),
                                  "--eval_prompts", str(root / "prompts.jsonl"), "--output_dir", str(root / f"ddp_{family}")]
    conversations = [{"messages": [{"role": "user", "content": f"Say verse {i}."},
                                   {"role": "assistant", "content": f"Verse {i}: and God saw that it was good."}]}
                     for i in range(80)]
    (root / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in conversations))
    preference_pairs(root / "prefs.jsonl", 64, 0)
    cells["dpo"] = [*COMMON, "--method", "dpo", "--dataset", str(root / "prefs.jsonl"), "--eval_fraction", "0.2",
                    "--num_eval_samples", "2", "--output_dir", str(root / "dpo")]
    cells["heldout"] = [*COMMON, "--dataset", str(root / "chat.jsonl"), "--num_eval_samples", "2",
                        "--output_dir", str(root / "heldout")]
    for strategy in UNEVEN:
        cells[f"uneven_{strategy}"] = [
            "--strategy", strategy, "--model_name_or_path", str(folder), "--max_steps", "1", "--learning_rate", "1e-8",
            "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "1",
            "--sample_max_new_tokens", str(NEW), "--eval_prompts", str(root / "uneven.jsonl"),
            "--output_dir", str(root / f"uneven_{strategy}")]
    finetune_cells(2, cells, root, timeout=600)
    return root, eos


def samples(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def _reference_model(run: str, checkpoint: Path):
    """The weights saved at that step, read without the run: transformers / PEFT, or hftk's export reader for
    the sharded formats (ZeRO-3 partitions, FSDP2 DCP shards)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hftk.data.builtin import materialize_model
    from hftk.publish.generate import load

    if run.startswith("lora"):
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(materialize_model("builtin:gpt2-tiny")),
                                         checkpoint)
    if run.startswith("qlora"):  # the base quantized as the run's defaults say (nf4, double quantization, fp32 compute)
        from bitsandbytes.nn import Linear4bit
        from transformers import BitsAndBytesConfig

        quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                       bnb_4bit_compute_dtype=torch.float32)
        base = AutoModelForCausalLM.from_pretrained(materialize_model("builtin:gpt2-tiny"),
                                                    quantization_config=quantized)
        for module in base.modules():  # bitsandbytes' training kernel in eval mode too, as the run evaluates
            if isinstance(module, Linear4bit):
                module.support_avx512bf16_for_cpu = False
        return PeftModel.from_pretrained(base, checkpoint)
    if run.startswith("ddp") or run == "chat_tokens":
        return AutoModelForCausalLM.from_pretrained(checkpoint)
    return load(checkpoint)[0]


@pytest.mark.parametrize("run", [*RUNS, *(f"ddp_{family}" for family in FAMILIES)])
def test_samples_equal_one_process_generate_on_the_checkpoint_of_each_step(runs, run):
    from transformers import AutoTokenizer

    root, _ = runs
    rows = samples(root / run)
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p if isinstance(p, str) else p["messages"])
                                                       for s in range(1, STEPS + 1) for p in PROMPTS]
    for step in range(1, STEPS + 1):
        checkpoint = root / run / f"checkpoint-{step}"
        model, tokenizer = _reference_model(run, checkpoint), AutoTokenizer.from_pretrained(checkpoint)
        for prompt, row in zip(PROMPTS, [r for r in rows if r["step"] == step]):
            expected = _greedy(model, tokenizer, _ids(tokenizer, prompt))
            assert row["tokens"] == expected, (run, step, prompt)
            assert row["completion"] == tokenizer.decode(expected, skip_special_tokens=True)
    first, last = ([r["tokens"] for r in rows if r["step"] == s] for s in (1, STEPS))
    if run != "chat_tokens":  # its greedy output is " the" x 8 at both steps (measured): only equality is checked
        assert first != last, "the samples must follow the weights from step to step"


@pytest.mark.parametrize("strategy", UNEVEN)
def test_one_rank_stopping_at_eos_at_once_and_the_other_running_to_the_limit_finish(runs, strategy):
    """Prompt A (rank 0) stops at its first token, prompt B (rank 1) runs all NEW tokens: with synced_gpus the
    ranks keep pairing their gathers, and the run ends (inside the cell's timeout) with both rows."""
    from transformers import AutoTokenizer

    root, eos = runs
    out = root / f"uneven_{strategy}"
    stop_now, run_on = samples(out)
    assert stop_now["tokens"] == [eos] and stop_now["stop"] == "eos", stop_now
    assert len(run_on["tokens"]) == NEW and run_on["stop"] == "length", run_on
    checkpoint = out / "checkpoint-1"
    model, tokenizer = _reference_model(strategy, checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    expected = _greedy(model, tokenizer, _ids(tokenizer, run_on["prompt"]), [eos, tokenizer.eos_token_id])
    assert run_on["tokens"] == expected


def test_samples_file_rows_and_their_time(runs):
    from transformers import GenerationConfig

    root, _ = runs
    eos = GenerationConfig.from_pretrained(root / "ddp" / "checkpoint-1").eos_token_id  # the run's, chat EOS too
    eos = set(eos if isinstance(eos, list) else [eos])
    for row in samples(root / "ddp"):
        assert set(row) == {"step", "prompt", "completion", "tokens", "stop"}
        assert row["stop"] == ("eos" if row["tokens"][-1] in eos else "length")
        assert len(row["tokens"]) == NEW or row["stop"] == "eos"
    timed = {m["step"]: m["sample_time_s"] for m in metrics(root / "ddp") if "sample_time_s" in m}
    assert set(timed) == set(range(1, STEPS + 1)) and all(t > 0 for t in timed.values()), timed
    trained = [m for m in metrics(root / "ddp") if "loss" in m]
    assert trained and all("sample_time_s" not in m and m["step_time_s"] > 0 for m in trained)


def test_tensorboard_holds_each_steps_samples_as_text(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = runs
    texts = {}
    for events in (root / "ddp" / "runs").iterdir():
        accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
        accumulator.Reload()
        if "samples/text_summary" in accumulator.Tags()["tensors"]:
            logged = accumulator.Tensors("samples/text_summary")
            texts.update({e.step: e.tensor_proto.string_val[0].decode() for e in logged})
    assert set(texts) == set(range(1, STEPS + 1)), texts
    for row in samples(root / "ddp"):
        assert row["completion"] in texts[row["step"]]


def test_wandb_offline_run_holds_a_samples_table_per_step(runs):
    root, _ = runs
    tables = sorted((root / "lora" / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == STEPS, tables
    logged = [json.loads(t.read_text()) for t in tables]
    assert all(t["columns"] == ["step", "prompt", "completion", "num_tokens", "stop"] for t in logged)
    assert sorted((r[0], r[2], r[3], r[4]) for t in logged for r in t["data"]) == sorted(
        (s["step"], s["completion"], len(s["tokens"]), s["stop"]) for s in samples(root / "lora"))


@pytest.mark.parametrize("engine,signalled", [("trainer", "every rank"), ("trainer", "rank 1"), ("tp", "rank 1")])
def test_sigterm_during_sampling_stops_at_the_next_token_saves_and_exits_75(engine, signalled, tmp_path):
    """Sampling at the end of training (no evaluation) with every eval-mode block forward slowed to 1 s: the
    prompts would take minutes, far past torchrun's grace period. A SIGTERM as scancel sends it (to every rank), or
    to rank 1 alone, ends the current ``generate`` at its next token on every rank: the ranks agree at each forward
    (rank 1 alone does not generate under tp: it follows rank 0's forwards), save the step and exit 75, as during an
    evaluation. Merge: the tp cell with a SIGTERM to every rank lives on in tp's rank-1 cell (the same assertions)."""
    from hftk.checkpoint.atomic import is_complete, list_checkpoints
    from tests.faults import start, worker_pid
    from tests.integration.test_resilience import (ENGINES, EVAL_SLEEP_S, GRACE_S, WORKERS, exit_codes,
                                                   sigterm_as_scancel_does, wait_for_output)
    from tests.helpers import TINY_ARGS
    from tests.workers.slow_eval import EVAL_MARKER

    prompts = [{"prompt": f"And God said {i}"} for i in range(4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prompts))
    args = [*TINY_ARGS, "--max_steps", "2", "--per_device_train_batch_size", "4", "--sample_max_new_tokens", "32",
            "--eval_prompts", str(tmp_path / "prompts.jsonl"), *ENGINES[engine]]
    run = start(2, args, tmp_path / "run", script=WORKERS / "slow_eval.py",
                env={"HFTK_EVAL_SLEEP_S": str(EVAL_SLEEP_S), "HFTK_EXIT_DIR": str(tmp_path / "exit")})
    wait_for_output(run, EVAL_MARKER, timeout=300)  # the first eval-mode forward: sampling has started
    if signalled == "every rank":
        stopped, seconds = sigterm_as_scancel_does(run)
    else:
        sent = time.time()
        os.kill(worker_pid(run, rank=1), signal.SIGTERM)
        stopped = run.finish(timeout=sent - run.started + GRACE_S + 60)
        seconds = time.time() - sent
    assert exit_codes(tmp_path / "exit") == {"rank-0": 75, "rank-1": 75}, stopped.output[-5000:]
    name = "SIGTERM" if signalled == "every rank" else "a signal on another rank"  # rank 0 says why it stopped
    assert f"hftk: stopped at step 2: preempted ({name}) during sampling" in stopped.stderr, stopped.stderr[-4000:]
    assert [c.name for c in list_checkpoints(tmp_path / "run")] == ["checkpoint-2"]
    # a prompt's 32 tokens take over a minute: only an agreement at the next token ends within the grace period
    assert is_complete(tmp_path / "run" / "checkpoint-2") and seconds < GRACE_S, seconds
    assert not (tmp_path / "run" / "samples.jsonl").exists() and not (tmp_path / "run" / "final").exists()


def _held_out(data: Path, fraction: float, count: int) -> list:
    """The first ``count`` held-out rows as the run splits them (``train_test_split``, its fraction and seed 7)."""
    import datasets

    rows = datasets.load_dataset("json", data_files=str(data))["train"]
    return list(rows.train_test_split(test_size=fraction, seed=7, shuffle=True)["test"].select(range(count)))


def _equal_to_each_checkpoint(folder: Path, prompts: list) -> None:
    """The run's rows are ``prompts`` at every step, each equal to plain greedy generate on that step's checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = samples(folder)
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in range(1, STEPS + 1) for p in prompts]
    for step in range(1, STEPS + 1):
        checkpoint = folder / f"checkpoint-{step}"
        model, tokenizer = AutoModelForCausalLM.from_pretrained(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
        for prompt, row in zip(prompts, [r for r in rows if r["step"] == step]):
            shown = prompt if isinstance(prompt, str) else {"messages": prompt}
            assert row["tokens"] == _greedy(model, tokenizer, _ids(tokenizer, shown)), (step, prompt)


def test_held_out_prompts_are_the_conversations_before_their_last_answer(runs):
    """--num_eval_samples 2 on conversations: the first two held-out rows (``train_test_split`` with the run's
    fraction and seed, as the Trainer's data), without their assistant turn, through the saved chat template."""
    root, _ = runs
    prompts = [row["messages"][:-1] for row in _held_out(root / "chat.jsonl", 0.05, 2)]
    _equal_to_each_checkpoint(root / "heldout", prompts)


def test_dpo_samples_the_held_out_pairs_prompts_from_the_policy(runs):
    """--method dpo (TRL's DPOTrainer) with --num_eval_samples 2: the first two held-out pairs' prompts (the run's
    fraction and seed), generated by the policy as one process generates on each step's checkpoint."""
    root, _ = runs
    _equal_to_each_checkpoint(root / "dpo", [row["prompt"] for row in _held_out(root / "prefs.jsonl", 0.2, 2)])
