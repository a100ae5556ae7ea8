"""Schema-driven bad input: cases generated from the config dataclasses, plus data fuzzing.

Every numeric option of every section (and the ``TrainingArguments`` fields a fine-tuning run
sets) gets zero, a negative, a huge value and a wrong type (on the command line and in YAML, which
argparse never sees); every choice option an unknown value (both ways); every path option a missing
path, a file and an empty folder; then contradictory pairs across sections and broken data files.
A value hftk legitimately accepts is listed as such (``ACCEPTED``) and must pass validation: the
list is a statement of what each option means, not a filter.

Each case runs in-process through the entry point's own first half (``run.prepare`` then
``errors.report``, exactly what ``run.main`` does before an engine starts): a refusal is exit 2,
one ``hftk: error:`` line naming the option, no other exception, no process group, and the
``output_dir`` (holding a file of the user's) byte for byte as it was. The launcher's case runs torchrun:
tests/integration/test_bad_input.py. Also here: a resume at another world size, checked against the
checkpoint's seal, and fp16 weights with fp16 training.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from hftk.checkpoint.atomic import COMPLETE_MARKER, seal
from hftk.config.options import SECTIONS, YAML_ALIASES, load_config
from hftk.core.errors import HftkError
from hftk.run.validate import check_world_change
from tests.helpers import TINY_ARGS

HUGE = 10**12


@dataclass
class Case:
    id: str
    args: list[str] = field(default_factory=list)
    yaml: dict[str, dict[str, Any]] | None = None
    expect: str = "refuse"  # or "accept"
    names: str = ""  # what the one line must name (the option); default: the case's option
    world: int = 1  # WORLD_SIZE the launcher would set (validation reads it; no group starts)
    files: dict[str, Any] = field(default_factory=dict)  # data files written for the case


# Where an option only means something under a strategy or mode, the case turns that on.
CONTEXT: dict[str, tuple[list[str], int]] = {
    "pp_size": (["--strategy", "pipeline"], 2),
    "pp_microbatches": (["--strategy", "pipeline", "--pp_size", "2"], 2),
    "pp_virtual_stages": (["--strategy", "pipeline", "--pp_size", "2", "--pp_schedule", "interleaved_1f1b"], 2),
    "tp_size": (["--strategy", "tp"], 2),
    "dp_shard_size": (["--strategy", "tp", "--tp_size", "2"], 2),
    "dp_replicate_size": (["--strategy", "tp", "--tp_size", "2"], 2),
    "cp_size": (["--strategy", "cp", "--model_dropout", "0"], 2),
    "sp_size": (["--strategy", "sp"], 2),
    "powersgd_rank": (["--grad_compression", "powersgd"], 2),
    "powersgd_warmup_steps": (["--grad_compression", "powersgd"], 2),
    "topk_ratio": (["--grad_compression", "topk"], 2),
    "topk_warmup_steps": (["--grad_compression", "topk"], 2),
    "lora_alpha": (["--lora_r", "4"], 1),
    "lora_dropout": (["--lora_r", "4"], 1),
}
# GRPO's options on a GRPO run (prompts, a reward file), less the option under test (its YAML case must decide).
GRPO = {"method": "grpo", "dataset": "{tmp}/prompts.jsonl", "reward_funcs": "{tmp}/reward.py:length",
        "num_generations": "4", "max_completion_length": "16", "eval_fraction": "0"}
CONTEXT.update({name: ([arg for key, value in GRPO.items() if key != name for arg in (f"--{key}", value)], 1)
                for name in ("num_generations", "max_completion_length", "epsilon", "epsilon_high", "num_iterations")})
SKIP_NUMERIC = {"device_memory_gb"}  # read by `auto` and `hftk plan` only; any positive value is a budget

TRAINING_NUMERIC = ["per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                    "learning_rate", "num_train_epochs", "max_steps", "warmup_steps", "logging_steps", "eval_steps",
                    "save_steps", "save_total_limit", "weight_decay", "max_grad_norm", "ddp_timeout",
                    "dataloader_num_workers", "seed"]

# (option, kind) pairs hftk accepts on purpose, with the reason.
ACCEPTED = {
    ("model_dropout", "zero"), ("lora_r", "zero"),  # no dropout; full fine-tuning
    ("lora_dropout", "zero"), ("lora_alpha", "huge"),  # no LoRA dropout; a large scale is a choice
    ("eval_fraction", "zero"),  # no held-out evaluation
    ("max_train_samples", "huge"), ("max_eval_samples", "huge"),  # caps larger than the data cap nothing
    ("powersgd_warmup_steps", "zero"), ("topk_warmup_steps", "zero"),  # compress from the first step
    ("powersgd_warmup_steps", "huge"), ("topk_warmup_steps", "huge"),  # never compress
    ("check_sync_steps", "zero"), ("comm_profile_steps", "zero"), ("num_eval_samples", "zero"),  # off
    ("check_sync_steps", "huge"), ("comm_profile_steps", "huge"), ("imbalance_warn_threshold", "huge"),
    ("powersgd_rank", "huge"),  # torch's PowerSGD caps the rank at each matrix's smaller side
    ("hub_retry_backoff_s", "zero"), ("hub_retry_backoff_s", "huge"), ("hub_upload_retries", "huge"),
    ("max_steps", "zero"), ("max_steps", "negative"), ("max_steps", "huge"),  # <= 0: train by epochs (HF)
    ("warmup_steps", "zero"), ("warmup_steps", "huge"), ("weight_decay", "zero"), ("weight_decay", "huge"),
    ("max_grad_norm", "zero"), ("max_grad_norm", "negative"), ("max_grad_norm", "huge"),  # <= 0: no clipping (HF)
    ("save_total_limit", "zero"), ("save_total_limit", "negative"), ("save_total_limit", "huge"),  # keep all
    ("dataloader_num_workers", "zero"), ("seed", "zero"), ("num_train_epochs", "huge"), ("learning_rate", "huge"),
    ("logging_steps", "huge"), ("eval_steps", "huge"), ("save_steps", "huge"), ("ddp_timeout", "huge"),
    ("per_device_train_batch_size", "huge"), ("per_device_eval_batch_size", "huge"),  # one batch of everything
    ("gradient_accumulation_steps", "huge"),
    ("epsilon", "huge"), ("epsilon_high", "huge"),  # GRPO: a clip range wider than any ratio clips nothing
    ("num_iterations", "huge"),  # GRPO: every batch of completions reused that often (as accumulation, a choice)
}


def _numeric_fields() -> list[tuple[str, str, str]]:
    """(section, option, 'int' | 'float') for every numeric option of the hftk sections."""
    out = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            kind = str(f.type).split(" | ")[0]
            if kind in ("int", "float") and f.name not in SKIP_NUMERIC:
                out.append((section, f.name, kind))
    ints = {"learning_rate", "num_train_epochs", "weight_decay", "max_grad_norm"}
    out += [("training", name, "float" if name in ints else "int") for name in TRAINING_NUMERIC]
    return out


def _negative(name: str) -> str:
    return "-2" if name in ("dp_shard_size", "ep_size", "max_steps") else "-1"  # -1 means "the rest" / "unset" there


def numeric_cases() -> list[Case]:
    cases = []
    for section, name, kind in _numeric_fields():
        context, world = CONTEXT.get(name, ([], 1))
        values = {"zero": "0", "negative": _negative(name), "huge": str(HUGE) if kind == "int" else "1e30",
                  "type": "abc"}
        for label, value in values.items():
            expect = "accept" if (name, label) in ACCEPTED else "refuse"
            cases.append(Case(f"{name}-{label}", [*context, f"--{name}", value], expect=expect, names=name,
                              world=world))
        cases.append(Case(f"{name}-yaml-type", context, yaml={YAML_ALIASES.get(section, section): {name: "abc"}}, names=name, world=world))
    return cases


def choice_cases() -> list[Case]:
    cases = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if "choices" in f.metadata:
                cases.append(Case(f"{f.name}-unknown", [f"--{f.name}", "nope"], names=f.name))
                cases.append(Case(f"{f.name}-yaml-unknown", yaml={YAML_ALIASES.get(section, section): {f.name: "nope"}}, names=f.name))
    for name in ("lr_scheduler_type", "optim", "eval_strategy", "save_strategy", "report_to"):
        cases.append(Case(f"{name}-unknown", [f"--{name}", "nope"], names=name))
        cases.append(Case(f"{name}-yaml-unknown", yaml={"training": {name: "nope"}}, names=name))
    return cases


def path_cases() -> list[Case]:
    """Every path option: missing, a file where a folder is needed (or the reverse), an empty folder."""
    cases = []
    paths = {"model_name_or_path": ("missing", "file", "empty"), "tokenizer_name_or_path": ("missing", "file", "empty"),
             "dataset": ("missing", "empty"), "chat_template": ("missing", "empty"),
             "tokenized_path": ("missing", "file", "empty"), "resume_from_checkpoint": ("missing", "file", "empty"),
             "config": ("missing", "empty")}
    where = {"missing": "{tmp}/no/such/thing", "file": "{tmp}/a_file.txt", "empty": "{tmp}/empty_dir"}
    for name, kinds in paths.items():
        for kind in kinds:
            names = "--config" if name == "config" else name
            cases.append(Case(f"{name}-{kind}", [f"--{name}", where[kind]], names=names))
    cases.append(Case("output_dir-file", ["--output_dir", "{tmp}/a_file.txt"], names="output_dir"))
    cases.append(Case("output_dir-under-file", ["--output_dir", "{tmp}/a_file.txt/run"], names="output_dir"))
    cases.append(Case("output_dir-readonly", ["--output_dir", "/proc/hftk-run"], names="output_dir"))
    cases.append(Case("metrics_file-folder", ["--metrics_file", "."], names="metrics_file"))
    cases.append(Case("lora_target_modules-unknown", ["--lora_r", "4", "--lora_target_modules", "nope"],
                      names="lora_target_modules"))
    return cases


def contradiction_cases() -> list[Case]:
    return [
        Case("bf16-fp16", ["--bf16", "--fp16"], names="fp16"),
        Case("tp_size-under-ddp", ["--tp_size", "2"], names="tp_size", world=2),
        Case("pp_size-under-fsdp", ["--strategy", "fsdp", "--pp_size", "2"], names="pp_size", world=2),
        Case("pp_size-vs-world", ["--strategy", "pipeline", "--pp_size", "3"], names="pp_size", world=2),
        Case("tp_size-vs-world", ["--strategy", "tp", "--tp_size", "3"], names="tp_size", world=2),
        Case("microbatches-vs-batch", ["--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "3"],
             names="pp_microbatches", world=2),
        Case("compression-under-zero", ["--strategy", "zero2", "--grad_compression", "powersgd"],
             names="grad_compression", world=2),
        Case("lora-under-tp", ["--strategy", "tp", "--tp_size", "2", "--lora_r", "4"], names="lora", world=2),
        Case("epochs-and-steps-zero", ["--num_train_epochs", "0", "--max_steps", "-1"], names="num_train_epochs"),
        Case("push-without-repo", ["--push_to_hub"], names="hub_model_id"),
        Case("dataset-and-datasets", yaml={"data": {"dataset": "{tmp}/ok.jsonl", "datasets": ["{tmp}/ok.jsonl"]}},
             names="datasets"),
        Case("best-model-without-eval", ["--load_best_model_at_end", "--eval_strategy", "no"],
             names="load_best_model_at_end"),
        Case("cp-with-messages", ["--strategy", "cp", "--cp_size", "2", "--model_dropout", "0", "--dataset", "{tmp}/chat.jsonl",
                                  "--chat_template", "chatml"], names="data_format", world=2),
        Case("fsdp-option-under-ddp", ["--strategy", "ddp", "--fsdp_hybrid", "true"], names="fsdp_hybrid", world=2),
        *grpo_cases(),
    ]


def grpo_cases() -> list[Case]:
    """GRPO's combinations (the options themselves: the numeric and choice cases, with GRPO's context)."""
    grpo = [arg for key, value in GRPO.items() for arg in (f"--{key}", value)]
    return [
        Case("grpo-without-rewards", ["--method", "grpo", "--dataset", "{tmp}/prompts.jsonl"], names="reward_funcs"),
        Case("grpo-group-does-not-divide-the-batch", [*grpo, "--num_generations", "3"], names="num_generations"),
        Case("grpo-group-does-not-divide-the-eval-batch", [*grpo, "--eval_fraction", "0.2",
                                                           "--per_device_eval_batch_size", "3"],
             names="per_device_eval_batch_size"),
        Case("grpo-option-under-sft", ["--num_generations", "4"], names="num_generations"),
        Case("grpo-dpo-loss", [*grpo, "--loss_type", "sigmoid"], names="loss_type"),
        Case("dpo-grpo-loss", ["--method", "dpo", "--loss_type", "dapo"], names="loss_type"),
        Case("grpo-negative-beta", [*grpo, "--beta", "-0.1"], names="beta"),
        Case("grpo-beta-zero", [*grpo, "--beta", "0"], expect="accept"),  # TRL's default: no reference model
        Case("grpo-completion-past-the-context", [*grpo, "--max_completion_length", "200"],
             names="max_completion_length"),
        Case("grpo-truncate", [*grpo, "--truncation", "truncate"], names="truncation"),
        Case("grpo-preprocessed", [*grpo, "--tokenized_path", "{tmp}/empty_dir"], names="tokenized_path"),
        Case("grpo-vllm-without-gpu", [*grpo, "--use_vllm"], names="use_vllm"),
        Case("grpo-on-text", [*grpo, "--dataset", "{tmp}/ok.jsonl"], names="dataset"),
        Case("grpo-reward-needs-a-missing-column", [*grpo, "--reward_funcs", "{tmp}/reward.py:needs_answer"],
             names="reward_funcs"),
        Case("grpo-reward-file-missing", [*grpo, "--reward_funcs", "{tmp}/nowhere.py:f"], names="reward_funcs"),
        Case("grpo-weights-per-function", [*grpo, "--reward_weights", "1", "2"], names="reward_weights"),
        Case("grpo-under-pipeline", [*grpo, "--strategy", "pipeline", "--pp_size", "2"], names="method", world=2),
        Case("grpo-two-ranks", [*grpo, "--per_device_train_batch_size", "2"], expect="accept", world=2),
    ]


def data_cases() -> list[Case]:
    big = "word " * (5 * 1024 * 1024 // 5)
    files: list[tuple[str, str, Any, str, str]] = [
        # (id, file name, content (str or bytes), expect, named)
        ("invalid-utf8-txt", "bad.txt", b"good line\n\xff\xfe\xfa broken\n" * 50, "refuse", "dataset"),
        ("invalid-utf8-jsonl", "bad.jsonl", b'{"text": "ok"}\n{"text": "\xff\xfe"}\n' * 50, "refuse", "dataset"),
        ("mixed-types-column", "mixed.jsonl", "".join(json.dumps({"text": v}) + "\n" for v in ["a b c", 5, "d e"] * 40),
         "refuse", "dataset"),
        ("all-null-text", "nulls.jsonl", '{"text": null}\n' * 50, "refuse", "dataset"),
        ("some-null-text", "somenulls.jsonl", ('{"text": null}\n' + '{"text": "some words here"}\n') * 50, "accept", ""),
        ("5mb-line", "long.txt", big + "\n" + "a short line\n" * 30, "accept", ""),
        ("json-array-file", "array.json", json.dumps([{"text": f"row {i} text"} for i in range(50)]), "accept", ""),
        ("json-scalar-file", "scalar.json", "42", "refuse", "dataset"),
        ("csv-without-header", "noheader.csv", "".join(f"row {i},more words\n" for i in range(50)), "refuse",
         "text_field"),
        ("jsonl-bare-strings", "strings.jsonl", '"just a string"\n' * 50, "refuse", "dataset"),
        ("jsonl-truncated", "cut.jsonl", '{"text": "ok"}\n' * 20 + '{"text": "cut', "refuse", "dataset"),
        ("single-row", "one.jsonl", '{"text": "one short row"}\n', "refuse", "eval_fraction"),
        ("empty-jsonl", "empty.jsonl", "", "refuse", "dataset"),
        ("binary-parquet-named", "fake.parquet", b"\x00\x01not parquet", "refuse", "dataset"),
    ]
    return [Case(f"data-{cid}", ["--dataset", "{tmp}/" + name], expect=expect, names=named, files={name: content})
            for cid, name, content, expect, named in files]


CASES = [*numeric_cases(), *choice_cases(), *path_cases(), *contradiction_cases(), *data_cases()]


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "a_file.txt").write_text("not a folder\n")
    (tmp / "empty_dir").mkdir()
    (tmp / "ok.jsonl").write_text("".join(json.dumps({"text": f"line {i} of plain training text"}) + "\n"
                                          for i in range(200)))
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (tmp / "chat.jsonl").write_text((json.dumps(chat) + "\n") * 50)
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}:"}) + "\n" for i in range(50)))
    (tmp / "reward.py").write_text("def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
                                   "def needs_answer(completions, answer, **kwargs):\n    return [0.0] * len(completions)\n")
    out = tmp / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file\n")
    return tmp


def _fill(value: Any, tmp: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{tmp}", str(tmp))
    if isinstance(value, list):
        return [_fill(v, tmp) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, tmp) for k, v in value.items()}
    return value


def attempt(argv: list[str], tokenize: bool) -> int:
    """What ``run.main`` does before an engine starts: prepare, or report the HftkError (any other
    exception escapes: a traceback is a failure). ``tokenize``: also build the blocks as the engine
    would (accepted data must tokenise, not fail later)."""
    from hftk.core.errors import HftkError, report
    from hftk.data.dataset import tokenize_sources
    from hftk.models.loading import load_tokenizer
    from hftk.run.prepare import prepare

    try:
        prepared = prepare(argv)
        if tokenize:
            cfg = prepared.cfg
            tokenize_sources(prepared.sources, load_tokenizer(cfg.model, cfg.data.chat_template), 0)
    except HftkError as exc:
        return report(exc)
    return 0


def test_bad_input_cases_are_many_and_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    refused = sum(c.expect == "refuse" for c in CASES)
    print(f"\nbad-input cases: {len(CASES)} generated, {refused} refused, {len(CASES) - refused} accepted on purpose")
    assert refused >= 80


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, workdir, capsys, monkeypatch):
    import torch.distributed as dist

    out = workdir / "out"
    before = _snapshot(out)
    for name, content in case.files.items():
        path = workdir / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    argv = ["--model_name_or_path", "builtin:gpt2-tiny", "--dataset", str(workdir / "ok.jsonl"),
            "--output_dir", str(out)]
    if "report_to" not in case.id:
        argv += ["--report_to", "none"]
    if case.yaml is not None:
        config = workdir / f"{case.id}.yaml"
        config.write_text(yaml.safe_dump(_fill(case.yaml, workdir)))
        argv += ["--config", str(config)]
    argv += _fill(case.args, workdir)
    monkeypatch.setenv("WORLD_SIZE", str(case.world))
    code = attempt(argv, tokenize=bool(case.files) and case.expect == "accept")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "Setting accelerator" not in line]
    assert not dist.is_initialized(), "validation must finish before any process group starts"
    assert _snapshot(out) == before, "output_dir changed"
    if case.expect == "accept":
        assert code == 0, f"{case.id} is valid input but was refused: {err}"
        return
    assert code == 2, f"{case.id} was accepted: {argv}"
    assert len(lines) == 1 and lines[0].startswith("hftk: error: "), err
    assert case.names in lines[0] and "Fix:" in lines[0], lines[0]

def test_a_global_batch_num_generations_does_not_divide_names_the_sizes_that_work(tmp_path, monkeypatch):
    from hftk.run.validate import check_grpo

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(["--method", "grpo", "--reward_funcs", "r.py:f", "--num_generations", "4",
                       "--per_device_train_batch_size", "3", "--eval_fraction", "0", "--output_dir", str(tmp_path)])
    with pytest.raises(HftkError) as info:
        check_grpo(cfg)
    assert info.value.one_line() == (
        "training.num_generations: 4 does not divide the global batch of 6 (per_device_train_batch_size 3 x "
        "gradient_accumulation_steps 1 x 2 ranks): every prompt needs its whole group. Fix: use "
        "--per_device_train_batch_size 2 or 4 (a global batch of 4 or 8), or --num_generations 2 or 3 or 6.")


def sealed_by(folder, world: int, global_batch: int | None):
    """A sealed checkpoint folder as ``world`` ranks with ``global_batch`` would have left it."""
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    seal(folder, 5)
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    (folder / COMPLETE_MARKER).write_text(json.dumps({**marker, "world_size": world, "global_batch": global_batch}))
    return folder


@pytest.mark.parametrize("strategy, args, needle", [
    ("zero3_offload", [], "zero3_offload's per-rank checkpoint pieces cannot be split or joined across ranks. "
                          "Fix: resume with 2 ranks, or start a new run from its weights (`hftk export "
                          "CHECKPOINT OUT`"),
    ("zero3", [], "zero3's per-rank checkpoint pieces"),  # see OTHER_WORLD_SIZE_FIX in hftk/strategies/deepspeed.py
    ("zero2", [], "the global batch would be 2 instead of 4"),  # converted to a universal checkpoint: batch kept only
    ("pipeline", ["--pp_size", "2"], "pipeline's per-rank checkpoint pieces cannot be split or joined across ranks. "
                                     "Fix: resume with 2 ranks."),
    ("tp", [], "the global batch would be 2 instead of 4: the data position would not continue "
                               "where it stopped. Fix: keep its global batch of 4: --gradient_accumulation_steps 2"),
    ("sp", [], "the global batch would be 2 instead of 4"),
    ("ddp", ["--grad_compression", "fp16"], "per-rank gradient compression state cannot be split"),
    ("ddp", [], "the global batch would be 2 instead of 4: the data position would not continue where it stopped. "
                "Fix: keep its global batch of 4: --gradient_accumulation_steps 2 with --per_device_train_batch_size 2."),
    ("fsdp", [], "the global batch would be 2 instead of 4"),
])
def test_a_resume_at_another_world_size_that_would_not_be_exact_is_refused_in_one_line(strategy, args, needle,
                                                                                          tmp_path):
    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    cfg = load_config([*TINY_ARGS, "--per_device_train_batch_size", "2", "--strategy", strategy, *args,
                       "--output_dir", str(tmp_path / "run")])
    with pytest.raises(HftkError) as caught:
        check_world_change(cfg, folder, world_size=1)
    line = caught.value.one_line()
    assert line.startswith(f"training.resume_from_checkpoint: {folder} was saved by 2 ranks; this launch has 1"), line
    assert needle in line, line


def test_a_resharding_resume_from_a_seal_without_a_global_batch_is_refused(tmp_path):
    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=None)
    cfg = load_config([*TINY_ARGS, "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "run")])
    with pytest.raises(HftkError, match="its seal records no global batch to continue the data position from. "
                                        "Fix: resume with 2 ranks."):
        check_world_change(cfg, folder, world_size=1)


def test_a_resume_at_another_world_size_with_the_global_batch_kept_passes(tmp_path):
    folder = sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    for strategy in ("ddp", "fsdp", "zero1", "zero2"):
        cfg = load_config([*TINY_ARGS, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                           "--strategy", strategy, "--output_dir", str(tmp_path / "run")])
        check_world_change(cfg, folder, world_size=1)
    for strategy, sizes in (("tp", ["--tp_size", "2", "--dp_shard_size", "-1"]),  # 2 data-parallel ranks x 2
                            ("cp", ["--cp_size", "2", "--dp_replicate_size", "2"]), ("sp", ["--sp_size", "2"])):
        cfg = load_config([*TINY_ARGS, "--per_device_train_batch_size", "2", "--strategy", strategy, *sizes,
                           "--output_dir", str(tmp_path / "run")])
        check_world_change(cfg, folder, world_size=4)
    cfg = load_config([*TINY_ARGS, "--strategy", "zero2", "--output_dir", str(tmp_path / "run")])
    check_world_change(cfg, folder, world_size=2)  # the same world size: nothing to check

def test_the_world_size_check_runs_before_any_process_group(tmp_path, monkeypatch):
    """``latest`` resolved and checked in ``prepare``: the refusal comes before the launch does anything."""
    import torch.distributed as dist

    from hftk.run.prepare import prepare

    sealed_by(tmp_path / "run" / "checkpoint-5", world=2, global_batch=4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(HftkError, match=r"was saved by 2 ranks; this launch has 1, and the global batch would be 2"):
        prepare([*TINY_ARGS, "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "run"),
                 "--resume_from_checkpoint", "latest"])
    assert not dist.is_initialized()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-5"]


def _refusal(args, tmp_path, monkeypatch):
    from hftk.run.prepare import prepare

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        prepare([*TINY_ARGS, "--output_dir", str(tmp_path / "out"), *args])
    except HftkError as exc:
        return exc
    return None


def test_fp16_weights_with_fp16_training_are_refused_before_launch(tmp_path, monkeypatch):
    exc = _refusal(["--fp16", "--model_dtype", "float16"], tmp_path, monkeypatch)
    assert exc is not None and exc.field == "model.model_dtype" and "model_dtype float32" in str(exc), exc


@pytest.mark.parametrize("args", [["--lora_r", "4"], ["--strategy", "zero3"]], ids=["lora", "zero3"])
def test_fp16_weights_are_fine_where_fp32_master_weights_exist(args, tmp_path, monkeypatch):
    """PEFT keeps adapters in fp32; DeepSpeed keeps its own fp32 master copy."""
    exc = _refusal(["--fp16", "--model_dtype", "float16", *args], tmp_path, monkeypatch)
    assert exc is None or exc.field != "model.model_dtype", exc


@pytest.mark.parametrize("rows, extra, field, words", [
    ([{"text": "hello"}], [], "data.dataset", "row 0 has columns ['text']"),
    ([{"prompt": "a", "chosen": "", "rejected": "c"}], [], "data.dataset", "row 0: 'chosen' is empty"),
    ([{"prompt": "a", "chosen": "b", "rejected": "b"}], [], "data.dataset", "'chosen' equals 'rejected'"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--strategy", "zero3_offload", "--lora_r", "8"],
     "model.lora_r", "DPO with LoRA is not supported with strategy zero3_offload"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--strategy", "fsdp", "--lora_r", "8"], "model.lora_r",
     "DPO with LoRA is not supported with strategy fsdp"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--strategy", "pipeline", "--pp_size", "1"],
     "training.method", "no pairwise step"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--beta", "0"], "training.beta", "must be in (0, 100]"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--max_length", "100000"], "training.max_length",
     "exceeds the model's context length"),
])
def test_dpo_bad_input_is_one_line_before_launch(tmp_path, rows, extra, field, words) -> None:
    """--method dpo: refused in prepare (no process group), naming the field; output_dir untouched."""
    import json

    from hftk.run.prepare import prepare

    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    with pytest.raises(HftkError) as info:
        prepare(["--method", "dpo", "--model_name_or_path", "builtin:gpt2-tiny", "--dataset", str(data),
                 "--output_dir", str(out), "--report_to", "none", *extra])
    assert info.value.field == field and words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not out.exists()


CHAT_ROWS = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
             for i in range(40)]
TEXT_ROWS = [{"text": f"line {i} of plain training text"} for i in range(40)]
PROMPT = {"prompt": "In the beginning"}
MESSAGES = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("prompts, data, extra, field, words", [
    ([PROMPT, {"text": "x"}], TEXT_ROWS, [], "samples.eval_prompts", "row 2 of"),
    ([PROMPT, "not json"], TEXT_ROWS, [], "samples.eval_prompts", "row 2 of"),
    ([{"messages": [{"role": "user"}]}], TEXT_ROWS, [], "samples.eval_prompts", "row 1 of"),
    ([{"messages": []}], TEXT_ROWS, [], "samples.eval_prompts", "messages is empty"),
    ([], TEXT_ROWS, [], "samples.eval_prompts", "holds no rows"),
    ([PROMPT, MESSAGES], TEXT_ROWS, [], "samples.eval_prompts", "prompt 2: a messages row needs a chat template"),
    ([{"prompt": "word " * 250}], TEXT_ROWS, [], "samples.eval_prompts", "exceeds the model's context length 256"),
    ([PROMPT], TEXT_ROWS, ["--num_eval_samples", "2"], "samples.num_eval_samples", "together with"),
    ([PROMPT], TEXT_ROWS, ["--temperature", "0.7"], "samples.temperature", "greedy decoding ignores it"),
    ([PROMPT], TEXT_ROWS, ["--do_sample", "--top_p", "1.5"], "samples.top_p", "in (0, 1]"),
    (None, TEXT_ROWS, ["--num_eval_samples", "2"], "samples.num_eval_samples", "plain text"),
    (None, CHAT_ROWS, ["--num_eval_samples", "2", "--chat_template", "chatml", "--eval_fraction", "0"],
     "samples.num_eval_samples", "holds no rows out"),
    (None, TEXT_ROWS, ["--sample_max_new_tokens", "256"], "samples.sample_max_new_tokens", "leaves no room"),
])
def test_samples_bad_input_is_one_line_before_launch(tmp_path, monkeypatch, prompts, data, extra, field, words):
    """The samples options: refused in prepare (no process group), naming the option (and the row); output_dir
    untouched."""
    import torch.distributed as dist

    from hftk.run.prepare import prepare

    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in data))
    argv = ["--model_name_or_path", "builtin:gpt2-tiny", "--dataset", str(tmp_path / "data.jsonl"),
            "--output_dir", str(tmp_path / "out"), "--report_to", "none", *extra]
    if prompts is not None:
        (tmp_path / "prompts.jsonl").write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                                                        for row in prompts))
        argv += ["--eval_prompts", str(tmp_path / "prompts.jsonl")]
    with pytest.raises(HftkError) as info:
        prepare(argv)
    assert info.value.field == field and words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists() and not dist.is_initialized()


def test_samples_options_that_fit_are_accepted(tmp_path):
    """A prompt file of both row kinds under a chat template, and held-out conversations' prompts."""
    from hftk.run.prepare import prepare

    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CHAT_ROWS))
    (tmp_path / "prompts.jsonl").write_text(json.dumps(PROMPT) + "\n\n" + json.dumps(MESSAGES) + "\n")
    base = ["--model_name_or_path", "builtin:gpt2-tiny", "--dataset", str(tmp_path / "chat.jsonl"), "--chat_template",
            "chatml", "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    assert prepare([*base, "--eval_prompts", str(tmp_path / "prompts.jsonl")]).cfg.samples.eval_prompts
    cfg = prepare([*base, "--num_eval_samples", "3", "--do_sample", "--temperature", "0.7", "--top_p", "0.9"]).cfg
    assert (cfg.samples.num_eval_samples, cfg.samples.temperature, cfg.samples.top_p) == (3, 0.7, 0.9)
