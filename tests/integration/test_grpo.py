"""GRPO through hftk equals a one-process TRL GRPOTrainer: on 2 gloo ranks under ddp, fsdp, zero1, zero2, zero3 and
zero3_offload, and LoRA under ddp, fsdp and zero3, the same per-step loss, reward, KL (beta 0.1) and entropy (fp32,
1e-5), the same completions at every step and the same final weights (or adapter) within 1e-5. Completions are
pinned by a test hook (tests/grpo_rollouts.py says why: TRL samples each rank's batch from that rank's generator);
the hook still generates through the model as each strategy holds it, sharded and in lock-step, on a model whose
completions end at EOS at different lengths on the two ranks (checked), so the sharded generation (FSDP2's per-block
gathers, ZeRO-3's gathered weights) is proven equal to one process's. With TRL's own sampling, a learnable reward
climbs under ddp, fsdp and zero3; a run resumed from its checkpoint-10 continues exactly (sampling included: every
rank's generator is restored); a SIGTERM on one rank during the rollouts stops every rank at the next token, saves
and exits 75; a reward function that returns too few rewards on one rank stops both ranks with one line;
completions.jsonl, the tensorboard text and the wandb table hold each logging step's rollouts; the README's GRPO
recipe runs as written. The cells run on shared warm ranks (``finetune_cells``); the references in this process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests import grpo_rollouts
from tests.helpers import (FINETUNE, ROOT, TINY_ARGS, doc_block, doc_project, finetune_cells, load_weights,
                           max_weight_diff, metrics, run_doc_command, shell_commands, torchrun)

pytestmark = pytest.mark.timeout(1800)
TOL = 1e-5
KEYS = ("loss", "reward", "kl", "entropy", "rewards/e_share/mean")
STEPS, BATCH, GENERATIONS, COMPLETION, BETA, LR = 6, 8, 4, 12, 0.1, 1e-3  # BATCH: global, 2 prompts of 4 completions
ROLLOUTS = Path(grpo_rollouts.__file__)
WORKERS = ROOT / "tests" / "workers"
# (strategy, LoRA) on 2 ranks with pinned completions, each against the one-process TRL reference of its adapter.
PARITY = [("ddp", False), ("fsdp", False), ("zero1", False), ("zero2", False), ("zero3", False),
          ("zero3_offload", False), ("ddp", True), ("fsdp", True), ("zero3", True)]
LEARN = ("ddp", "fsdp", "zero3")  # TRL's own sampling, a learnable reward
LEARN_STEPS, LEARN_LR = 20, 2e-2
HELD = {"ddp": "a whole copy on each rank", "zero1": "a whole copy on each rank", "zero2": "a whole copy on each rank",
        "fsdp": "sharded over 2 ranks (FSDP2)", "zero3": "partitioned over 2 ranks (ZeRO-3)",
        "zero3_offload": "partitioned over 2 ranks (ZeRO-3)", "lora": "the policy with its adapter disabled (no second model)"}


def _name(strategy: str, lora: bool) -> str:
    return f"{strategy}_lora" if lora else strategy


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("grpo")
    data = grpo_rollouts.prompt_rows(root / "prompts.jsonl", 64)
    model = grpo_rollouts.eos_prone_model(root / "eos_model")
    common = ["--method", "grpo", "--dataset", str(data), "--reward_funcs", f"{ROLLOUTS}:e_share",
              "--num_generations", str(GENERATIONS), "--per_device_train_batch_size", str(BATCH // 2),
              "--eval_fraction", "0", "--adam_epsilon", "1e-4"]
    cells, options = {}, {}
    for strategy, lora in PARITY:
        name = _name(strategy, lora)
        cells[name] = [*common, "--strategy", strategy, "--model_name_or_path", str(model), "--max_steps", str(STEPS),
                       "--max_completion_length", str(COMPLETION), "--beta", str(BETA), "--output_dir", str(root / name),
                       *(["--lora_r", "8"] if lora else [])]
        options[name] = {"script": WORKERS / "grpo_seeded.py", "env": {"HFTK_TEST_GENERATIONS": str(root / name / "gen")}}
    for strategy in LEARN:  # the built-in model, TRL's sampling; ddp saves at step 10 for the resumed run
        name = f"learn_{strategy}"
        cells[name] = [*common, "--strategy", strategy, "--max_steps", str(LEARN_STEPS), "--learning_rate",
                       str(LEARN_LR), "--max_completion_length", "16", "--logging_steps", "2",
                       "--output_dir", str(root / name),
                       *(["--save_strategy", "steps", "--save_steps", "10"] if strategy == "ddp" else []),
                       *(["--report_to", "tensorboard", "wandb"] if strategy == "fsdp" else [])]
    cells["resumed_ddp"] = [*cells["learn_ddp"][:-4], "--output_dir", str(root / "resumed_ddp"),
                            "--save_strategy", "steps", "--save_steps", "10", "--resume_from_checkpoint", "latest"]
    options["resumed_ddp"] = {"copy": [root / "learn_ddp" / "checkpoint-10", root / "resumed_ddp" / "checkpoint-10"]}
    outputs = finetune_cells(2, cells, root, timeout=900, options=options)
    return {"root": root, "data": data, "model": model, "outputs": outputs}


@pytest.fixture(scope="module")
def references(runs) -> dict:
    """TRL's one-process run with pinned completions, full fine-tuning and LoRA."""
    return {lora: grpo_rollouts.trl_reference(runs["model"], runs["data"], runs["root"] / f"ref_{lora}",
                                              grpo_rollouts.e_share, steps=STEPS, batch=BATCH, generations=GENERATIONS,
                                              completion=COMPLETION, beta=BETA, learning_rate=LR, lora=lora)
            for lora in (False, True)}


def _completions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy, lora", PARITY, ids=[_name(*cell) for cell in PARITY])
def test_equals_one_process_trl(runs, references, strategy, lora) -> None:
    ref_logs, ref_weights, ref_rows = references[lora]
    name = _name(strategy, lora)
    out = runs["root"] / name
    assert f"hftk: GRPO reference: {HELD['lora' if lora else strategy]}\n" in runs["outputs"][name]
    ours = [row for row in metrics(out) if "reward" in row]
    assert [row["step"] for row in ours] == list(range(1, STEPS + 1))
    for step, (mine, theirs) in enumerate(zip(ours, ref_logs, strict=True), start=1):
        for key in KEYS:
            assert mine[key] == pytest.approx(theirs[key], abs=TOL), (step, key, mine[key], theirs[key])
    assert ours[-1]["kl"] > 0  # the policy moved away from the reference
    rows = [{k: row[k] for k in ("step", "prompt", "completion")} for row in _completions(out)]
    assert rows == ref_rows  # every step's completions, generated from the weights as the strategy holds them
    for mine in ours:  # logged every step: the step's mean reward is its rollouts' (completions.jsonl)
        batch = [row["rewards"]["e_share"] for row in _completions(out) if row["step"] == mine["step"]]
        assert len(batch) == BATCH and mine["reward"] == pytest.approx(sum(batch) / BATCH, abs=1e-6)
    if lora:
        from safetensors.torch import load_file

        saved = load_file(str(out / "final" / "adapter_model.safetensors"))
        assert max_weight_diff(saved, ref_weights) < TOL
        assert not (out / "final" / "model.safetensors").exists()
    else:
        assert max_weight_diff(_tied_once(load_weights(out / "final")), _tied_once(ref_weights)) < TOL


def _tied_once(weights: dict) -> dict:
    """GPT-2's tied LM head is the token embedding; a save may hold it under both names (ZeRO-1/2's final/)."""
    head, embedding = weights.get("lm_head.weight"), weights.get("transformer.wte.weight")
    if head is not None and embedding is not None and (head == embedding).all():
        return {k: v for k, v in weights.items() if k != "lm_head.weight"}
    return weights


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_ranks_generated_completions_of_different_lengths_in_lock_step(runs, strategy) -> None:
    """The sharded cells' generations: at some call one rank's completion ended at EOS at a different token than
    the other rank's, so one rank ran forwards past its own end (synced_gpus) for the other's gathers to pair up."""
    gen = runs["root"] / strategy / "gen"
    by_rank = [[json.loads(line) for line in (gen / f"rank-{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [row["step"] for row in by_rank[0]] == [row["step"] for row in by_rank[1]] == list(range(STEPS))
    uneven = [(a["step"], i) for a, b in zip(*by_rank) for i, (x, y) in enumerate(zip(a["lengths"], b["lengths"]))
              if x != y]
    assert uneven and any(any(row["eos"]) for rows in by_rank for row in rows), by_rank


def _rewards(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in metrics(out) if "reward" in row}


@pytest.mark.parametrize("strategy", LEARN)
def test_a_learnable_reward_climbs_with_trls_own_sampling(runs, strategy) -> None:
    """The share of 'e' in completions of the random built-in model (TRL's sampling, beta 0): its mean over the last
    three logged steps is well above the first three's."""
    rewards = [row["reward"] for _, row in sorted(_rewards(runs["root"] / f"learn_{strategy}").items())]
    assert len(rewards) == LEARN_STEPS // 2
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards


def test_resume_from_a_checkpoint_continues_exactly_sampling_included(runs) -> None:
    """checkpoint-10 of the ddp learning run, resumed in a new folder: steps 11-20 draw the same completions (every
    rank's generator restored), log the same figures and end on the same weights as the uninterrupted run."""
    full, resumed = runs["root"] / "learn_ddp", runs["root"] / "resumed_ddp"
    assert "resuming from" in runs["outputs"]["resumed_ddp"]
    theirs, ours = _rewards(full), _rewards(resumed)
    assert sorted(ours) == list(range(12, LEARN_STEPS + 1, 2))
    for step in ours:
        for key in ("loss", "reward", "entropy"):
            assert ours[step][key] == pytest.approx(theirs[step][key], abs=1e-6), (step, key)
    assert [row for row in _completions(resumed)] == [row for row in _completions(full) if row["step"] > 10]
    assert max_weight_diff(load_weights(resumed / "final"), load_weights(full / "final")) < 1e-6


def test_completions_reach_the_jsonl_tensorboard_and_wandb_at_each_logging_step(runs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = runs["root"] / "learn_fsdp"
    rows = _completions(out)
    steps = list(range(2, LEARN_STEPS + 1, 2))
    assert sorted({row["step"] for row in rows}) == steps
    assert all(set(row) == {"step", "split", "prompt", "completion", "rewards", "advantage"} for row in rows)
    per_step = {step: [row for row in rows if row["step"] == step] for step in steps}
    assert all(len(batch) == BATCH for batch in per_step.values())  # the whole generation batch, both ranks'
    for step, batch in per_step.items():  # each row's reward is the function's on its completion
        assert [row["rewards"]["e_share"] for row in batch] == pytest.approx(
            grpo_rollouts.e_share([row["completion"] for row in batch]), abs=1e-6)
    texts = {}
    for events in (out / "runs").iterdir():
        accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
        accumulator.Reload()
        if "completions/text_summary" in accumulator.Tags()["tensors"]:
            texts.update({e.step: e.tensor_proto.string_val[0].decode()
                          for e in accumulator.Tensors("completions/text_summary")})
    assert sorted(texts) == steps and all(per_step[s][0]["completion"] in texts[s] for s in steps)
    tables = sorted((out / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json"))
    logged = [json.loads(t.read_text()) for t in tables]
    assert len(logged) == len(steps) and all(t["columns"] == ["step", "split", "prompt", "completion", "e_share",
                                                              "advantage"] for t in logged)
    assert sorted((r[0], r[3]) for t in logged for r in t["data"]) == sorted((r["step"], r["completion"]) for r in rows)


def test_the_closing_line_gives_the_final_mean_reward_and_the_card_says_grpo(runs) -> None:
    out = runs["root"] / "learn_ddp"
    last = _rewards(out)[LEARN_STEPS]["reward"]
    assert re.search(rf"^hftk: done: step {LEARN_STEPS} in \d+ s, final mean reward {last:.4f} \(step {LEARN_STEPS}\); "
                     "the model is in ", runs["outputs"]["learn_ddp"], re.M), runs["outputs"]["learn_ddp"][-2000:]
    hyper = json.loads((out / "final" / "hftk_run.json").read_text())["hyperparameters"]
    assert (hyper["method"], hyper["beta"], hyper["loss_type"], hyper["num_generations"]) == ("grpo", 0.0, "dapo", 4)
    assert f"- method: **GRPO** (Group Relative Policy Optimization, TRL's GRPOTrainer), rewards `{ROLLOUTS}:e_share`" \
        in (out / "final" / "README.md").read_text()


def test_no_rank_prints_trls_deprecation_notice(runs) -> None:
    """TRL reads transformers' deprecated ``is_gradient_checkpointing`` around every generation: quiet at its source
    (hftk.core.output), on every rank and strategy."""
    assert not [name for name, output in runs["outputs"].items() if "is_gradient_checkpointing" in output]


def test_sigterm_during_generation_stops_every_rank_at_the_next_token_saves_and_exits_75(runs) -> None:
    """Rank 1 is sent SIGTERM in its 3rd generation forward of step 2 (fsdp: every forward gathers shards, so a
    rank leaving alone would hang the other): both ranks end that generate after the same forward (one agreement
    per forward), save checkpoint-1 and exit 75; rerunning the command resumes it and finishes."""
    from hftk.checkpoint.atomic import is_complete, list_checkpoints
    from tests.helpers import rank_exit_codes

    root = runs["root"] / "preempted"
    args = [*TINY_ARGS, "--method", "grpo", "--dataset", str(runs["data"]), "--reward_funcs", f"{ROLLOUTS}:e_share",
            "--num_generations", str(GENERATIONS), "--per_device_train_batch_size", str(BATCH // 2), "--eval_fraction",
            "0", "--strategy", "fsdp", "--max_steps", "3", "--max_completion_length", "64", "--output_dir", str(root)]
    env = {"HFTK_SIGTERM_AT_STEP": "2", "HFTK_SIGTERM_AFTER": "3", "HFTK_TEST_FORWARDS": str(root / "forwards")}
    stopped = torchrun(2, WORKERS / "grpo_preempted.py", args, timeout=600, env=env)
    assert rank_exit_codes(stopped) == {0: 75, 1: 75}, stopped.output[-5000:]
    assert "hftk: stopped at step 1: preempted (a signal on another rank) during generation; saved " in stopped.stderr
    assert [c.name for c in list_checkpoints(root)] == ["checkpoint-1"] and is_complete(root / "checkpoint-1")
    assert not (root / "final").exists()
    forwards = {rank: [line.split() for line in (root / "forwards" / f"rank-{rank}").read_text().splitlines()]
                for rank in (0, 1)}
    step_2 = {rank: [int(n) for step, n in lines if step == "2"] for rank, lines in forwards.items()}
    assert step_2[0] == step_2[1] == [1, 2, 3], step_2  # of 64: stopped at the token the signal arrived in
    resumed = torchrun(2, FINETUNE, [*args, "--resume_from_checkpoint", "latest"], timeout=600)
    assert resumed.returncode == 0, resumed.output[-5000:]
    assert [row["step"] for row in metrics(root) if "reward" in row][-2:] == [2, 3]


def test_a_reward_that_fails_on_one_rank_stops_both_with_one_line(runs, tmp_path) -> None:
    """One reward too few, on rank 1 only: both ranks stop at that step (exit 2), and the one line, printed once by
    rank 0, names the function and what is wrong."""
    from tests.helpers import rank_exit_codes

    args = [*TINY_ARGS, "--method", "grpo", "--dataset", str(runs["data"]), "--reward_funcs",
            f"{ROLLOUTS}:short_on_rank_1", "--num_generations", str(GENERATIONS), "--per_device_train_batch_size",
            str(BATCH // 2), "--eval_fraction", "0", "--max_steps", "2", "--max_completion_length", "8",
            "--output_dir", str(tmp_path / "out")]
    result = torchrun(2, FINETUNE, args, timeout=600)
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert rank_exit_codes(result) == {0: 2, 1: 2}, result.output[-4000:]
    assert lines == [f"hftk: error: training.reward_funcs: {ROLLOUTS}:short_on_rank_1 returned 3 rewards for 4 "
                     "completions. Fix: return one float per completion (None for one it does not score), in their "
                     "order."], result.stderr[-4000:]
    assert "Traceback" not in result.output


def test_the_readme_grpo_recipe_runs_as_written(tmp_path) -> None:
    """The README's GRPO recipe, as written, from a folder of its own (tests.helpers.doc_project): the arithmetic
    reward climbs and the last line says the final mean reward."""
    project = doc_project(tmp_path / "recipe")
    [(argv, stdin)] = shell_commands(doc_block("grpo-recipe"))
    result = run_doc_command(argv, stdin, project)
    assert result.returncode == 0, result.output[-5000:]
    out = project / "outputs" / "grpo"
    rewards = [row["reward"] for _, row in sorted(_rewards(out).items())]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert re.search(rf"^hftk: done: step 30 in \d+ s, final mean reward {rewards[-1]:.4f} \(step 30\)",
                     result.stderr, re.M), result.stderr[-2000:]
    assert (out / "completions.jsonl").is_file()
