"""The memory plan: shapes from the meta device, per-strategy bytes within 5% of what each rank
really holds (2 ranks, every strategy, with what its generated YAML launches), `auto`, and errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hftk import allocator
from hftk.builtin import builtin_model_config
from hftk.plan import GIB, HEADROOM, MIB, PLAN_STRATEGIES, PlanInputs, estimate, model_shape, pick, plan, resolve_auto
from tests.helpers import FINETUNE, ROOT, TINY_ARGS, finetune_cells, free_port, metrics, run, torchrun

ACCELERATE = Path(sys.executable).with_name("accelerate")
MICRO_BATCH = 4
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def tiny_shape():
    return model_shape(builtin_model_config("builtin:gpt2-tiny"))


def test_meta_shape_counts_what_the_real_model_holds(tiny_shape):
    from transformers import AutoModelForCausalLM

    from hftk.builtin import materialize_model

    model = AutoModelForCausalLM.from_pretrained(materialize_model("builtin:gpt2-tiny"))
    params = list(model.parameters())  # GPT-2's tied wte / lm_head once
    assert tiny_shape.params == tiny_shape.trainable == sum(p.numel() for p in params)
    assert tiny_shape.trainable_tensors == len(params)
    assert tiny_shape.largest_block == sum(p.numel() for p in model.transformer.h[0].parameters())
    assert tiny_shape.layers == 2 and tiny_shape.hidden == 64
    llama = model_shape(builtin_model_config("builtin:llama-tiny"))
    assert llama.outside_blocks == 2 * 2048 * 64 + 64  # untied embeddings and LM head, final norm


def test_lora_trains_only_the_adapters(tiny_shape):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from hftk.builtin import materialize_model
    from hftk.config import ModelConfig
    from hftk.lora import lora_config

    lora = model_shape(builtin_model_config("builtin:gpt2-tiny"), lora_r=4)
    real = get_peft_model(AutoModelForCausalLM.from_pretrained(materialize_model("builtin:gpt2-tiny")),
                          lora_config(ModelConfig(lora_r=4), "gpt2"))  # the adapters a run adds
    assert lora.trainable == sum(p.numel() for p in real.parameters() if p.requires_grad) > 0
    assert lora.params == tiny_shape.params + lora.trainable
    inputs = PlanInputs(world_size=2, device_memory_bytes=GIB, device="cpu")
    full, adapted = estimate("ddp", tiny_shape, inputs), estimate("ddp", lora, inputs)
    assert adapted.optimizer < full.optimizer / 20 and adapted.grads < full.grads / 20
    assert adapted.params > full.params  # frozen base weights stay


def test_sharding_order_follows_theory():
    shape = model_shape(builtin_model_config("builtin:gpt2-90m"))
    two = {p.strategy: p for p in plan(shape, PlanInputs(world_size=2, device_memory_bytes=GIB, device="gpu"))}
    four = {p.strategy: p for p in plan(shape, PlanInputs(world_size=4, device_memory_bytes=GIB, device="gpu"))}
    state = {s: two[s].model_state for s in PLAN_STRATEGIES}
    assert state["ddp"] > state["zero1"] >= state["zero2"] > state["zero3"]
    assert state["fsdp"] <= 0.55 * state["ddp"] and state["zero3"] <= 0.55 * state["ddp"]
    assert two["ddp"].device_total > two["zero1"].device_total > two["fsdp"].device_total
    assert two["zero2"].device_total > two["zero3"].device_total
    # ZeRO-1 holds whole gradients until backward ends, ZeRO-2 only its partition: apart from N = 2 on
    assert four["zero1"].device_total > four["zero2"].device_total
    for s in ("fsdp", "zero3", "zero2"):
        assert four[s].model_state < two[s].model_state
    assert four["ddp"].model_state == two["ddp"].model_state
    # offloaded to host memory on a GPU, so its device total is the smallest
    assert two["zero3_offload"].offloaded > 0 and two["zero3_offload"].device_total < two["zero3"].device_total


def test_pick_is_the_least_sharding_that_fits():
    shape = model_shape(builtin_model_config("builtin:gpt2-90m"))
    totals = {p.strategy: p.device_total for p in plan(shape, PlanInputs(world_size=2, device_memory_bytes=GIB))}

    def chosen(budget: float) -> str | None:
        found = pick(plan(shape, PlanInputs(world_size=2, device_memory_bytes=int(budget))))
        return found.strategy if found else None

    assert chosen(100 * GIB) == "ddp"
    between = (totals["zero2"] + totals["fsdp"]) / 2 / (1 - HEADROOM)  # zero3 fits too; fsdp comes first
    assert chosen(between) == "fsdp"
    assert chosen(min(totals.values()) / 2) is None


def _cfg(*argv: str):
    from hftk.config import load_config

    return load_config(["--model_name_or_path", "builtin:gpt2-90m", "--block_size", "64",
                        "--per_device_train_batch_size", "2", *argv])


def test_auto_picks_from_the_plan_and_says_so(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed strategies run only under a launcher
    monkeypatch.setenv("RANK", "0")
    cfg = _cfg("--strategy", "auto")
    shape = model_shape(builtin_model_config("builtin:gpt2-90m"))
    plans = {p.strategy: p for p in plan(shape, PlanInputs(world_size=2, device_memory_bytes=GIB, seq_len=64,
                                                           micro_batch=2, device="cpu"))}
    cfg.strategy.device_memory_gb = plans["fsdp"].device_total / (1 - HEADROOM) / GIB * 1.01
    assert plans["zero2"].device_total > plans["fsdp"].device_total * 1.01  # so ddp, zero1, zero2 do not fit
    assert resolve_auto(cfg, builtin_model_config("builtin:gpt2-90m"), 2) == "fsdp"
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("hftk: strategy auto -> fsdp (") and "ddp" in line


def test_auto_in_one_process_without_launcher_considers_only_ddp(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = _cfg("--strategy", "auto")
    assert resolve_auto(cfg, builtin_model_config("builtin:gpt2-90m"), 1) == "ddp"
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("hftk: strategy auto -> ddp (")
    assert all(name in out.split("not runnable: ")[1] for name in PLAN_STRATEGIES[1:])


def test_auto_with_nothing_fitting_is_one_line_before_anything_starts(tmp_path, capsys):
    from hftk.run import main

    out = tmp_path / "out"
    code = main([*TINY_ARGS, "--output_dir", str(out), "--strategy", "auto", "--device_memory_gb", "0.01"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("hftk: error: strategy.strategy: auto: no strategy fits") and "Fix:" in err[0]
    assert not out.exists()


def _plan_cli(*args: str):
    from hftk.cli import main

    return main(["plan", *args])


def test_plan_command_prints_every_strategy_and_the_pick(capsys):
    assert _plan_cli("--model", "builtin:gpt2-90m", "--world_size", "2", "--device_memory", "2", "--seq_len", "64",
                     "--micro_batch", "2", "--device", "cpu") == 0
    text = capsys.readouterr().out
    assert all(f"\n{s} " in text for s in PLAN_STRATEGIES)
    assert "pick: fsdp" in text.splitlines()[-1]  # ddp and ZeRO-1/2 need more than 2 GiB with headroom
    assert _plan_cli("--model", "builtin:gpt2-90m", "--world_size", "8", "--device_memory", "80", "--json",
                     "--lora_r", "8", "--mixed_precision", "bf16", "--gradient_checkpointing") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pick"] == "ddp" and [p["strategy"] for p in data["plans"]] == list(PLAN_STRATEGIES)
    assert data["shape"]["trainable"] < data["shape"]["params"] / 50


BAD_PLAN = [
    ("no_model", ["--world_size", "2", "--device_memory", "8"], "--model"),
    ("zero_ranks", ["--model", "builtin:gpt2-tiny", "--world_size", "0", "--device_memory", "8"], "--world_size"),
    ("memory_not_a_number", ["--model", "builtin:gpt2-tiny", "--world_size", "2", "--device_memory", "lots"],
     "--device_memory"),
    ("missing_folder", ["--model", "./no/such/model", "--world_size", "2", "--device_memory", "8"],
     "model.model_name_or_path"),
    ("seq_too_long", ["--model", "builtin:gpt2-tiny", "--world_size", "2", "--device_memory", "8", "--seq_len", "4096"],
     "--seq_len"),
    ("negative_lora", ["--model", "builtin:gpt2-tiny", "--world_size", "2", "--device_memory", "8", "--lora_r", "-1"],
     "--lora_r"),
    ("unknown_option", ["--model", "builtin:gpt2-tiny", "--world_size", "2", "--device_memory", "8", "--gpus", "2"],
     "--gpus"),
]


@pytest.mark.parametrize("case,args,field", BAD_PLAN, ids=[c[0] for c in BAD_PLAN])
def test_plan_bad_input_is_one_line(case, args, field, capsys):
    assert _plan_cli(*args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"hftk: error: {field}: ") and "Fix:" in err[0], err


# ---- plan accuracy: every strategy, 2 ranks, launched through its generated YAML ----

@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One short run per strategy (2 optimizer steps, 2 ranks), each with what accelerate_configs/<s>.yaml
    launches; ddp's through `--strategy auto`, which must pick it for the tiny model.

    `accelerate launch` of each YAML starts tests/workers/launch_probe.py (2 real ranks report the strategy
    hftk reads and hand back the ACCELERATE_* / FSDP_* variables the launch set); the six measured runs then
    share one 2-rank launch, each cell with its YAML's variables (``finetune_cells``): a full launch per
    strategy cost 20-60 s of start-up each."""
    root = tmp_path_factory.mktemp("plan")
    probes, options, cells = {}, {}, {}
    for strategy in PLAN_STRATEGIES:
        env_out = root / f"{strategy}.env.json"
        cmd = [str(ACCELERATE), "launch", "--config_file", f"accelerate_configs/{strategy}.yaml",
               "--main_process_port", str(free_port()), str(ROOT / "tests" / "workers" / "launch_probe.py"), str(env_out)]
        launch = run(cmd, timeout=300)
        assert launch.returncode == 0, f"{strategy}:\n{launch.output[-5000:]}"
        probes[strategy] = [json.loads(line[len("PROBE "):]) for line in launch.stdout.splitlines()
                            if line.startswith("PROBE ")]
        options[strategy] = {"env": json.loads(env_out.read_text()), "memory_out": root / f"{strategy}.json"}
        cells[strategy] = ["--max_steps", "2", "--per_device_train_batch_size", str(MICRO_BATCH),
                           "--comm_profile_steps", "0", "--output_dir", str(root / strategy),
                           *(["--strategy", "auto"] if strategy == "ddp" else [])]
    outputs = finetune_cells(2, cells, root, options=options)
    return {s: (json.loads((root / f"{s}.json").read_text()), outputs[s], probes[s]) for s in PLAN_STRATEGIES}


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one launches every strategy
@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_predicts_each_ranks_model_state_within_5_percent(measured, tiny_shape, strategy):
    record, stdout, probes = measured[strategy]
    # the YAML's real launch: 2 ranks, each reading the YAML's strategy (ddp's says none: auto decides)
    assert sorted(p["rank"] for p in probes) == [0, 1] and all(p["world"] == 2 and p["sum"] == 2 for p in probes)
    assert all(p["strategy"] == (None if strategy == "ddp" else strategy) for p in probes), probes
    assert record["strategy"] == strategy and record["world_size"] == 2  # the YAML chose it, 2 real ranks
    expected = "hftk: strategy auto -> ddp" if strategy == "ddp" else f"hftk: strategy {strategy} from the launch"
    assert expected in stdout
    predicted = estimate(strategy, tiny_shape, PlanInputs(world_size=2, device_memory_bytes=GIB, seq_len=64,
                                                          micro_batch=MICRO_BATCH, device="cpu"))
    for rank, counted in enumerate(record["ranks"]):
        error = predicted.model_state / counted["total"] - 1
        assert abs(error) <= TOLERANCE, (strategy, rank, predicted.to_dict(), counted)


# ---- auto's budget holds as a user launches: no allocator variables, default telemetry ----

@pytest.mark.slow
def test_auto_budget_holds_without_any_allocator_setting(tmp_path, monkeypatch):
    """gpt2-90m on 2 gloo ranks under a budget only a sharded strategy fits: every rank's measured
    training-phase peak RSS stays under it. The test sets no MALLOC_* variable (hftk.allocator tunes
    glibc itself; with glibc's defaults FSDP's peak was twice the plan's). The same run shows the
    evaluation line: blocks capped by data.max_eval_samples, batches per rank."""
    for name in [*allocator.SETTINGS, "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name, raising=False)
    shape = model_shape(builtin_model_config("builtin:gpt2-90m"))
    inputs = PlanInputs(world_size=2, device_memory_bytes=GIB, seq_len=32, micro_batch=1, device="cpu")
    plans = {p.strategy: p for p in plan(shape, inputs)}
    budget = plans["fsdp"].device_total / (1 - HEADROOM) * 1.01
    usable = budget * (1 - HEADROOM)
    assert plans["ddp"].device_total > usable and plans["zero2"].device_total > usable  # only sharding fits
    out = tmp_path / "out"
    launch = torchrun(2, FINETUNE, [
        "--model_name_or_path", "builtin:gpt2-90m", "--block_size", "32", "--per_device_train_batch_size", "1",
        "--max_steps", "4", "--max_train_samples", "400", "--eval_fraction", "0.1", "--max_eval_samples", "6",
        "--per_device_eval_batch_size", "2", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none",
        "--logging_steps", "1", "--disable_tqdm", "true", "--strategy", "auto",
        "--device_memory_gb", f"{budget / GIB:.4f}", "--output_dir", str(out)], timeout=900)
    assert launch.returncode == 0, launch.output[-5000:]
    assert "hftk: strategy auto -> fsdp (" in launch.stdout
    assert launch.stdout.count("hftk: evaluation: 6 blocks of 32 tokens, 2 batches of 2 per rank over 2 "
                               "data-parallel rank(s) per evaluation (capped by data.max_eval_samples=6)") == 1
    windows = [m for m in metrics(out) if "rank_stats" in m]
    assert len(windows) == 4 and all(m["peak_mem_kind"] == "rss_hwm" for m in windows)
    peaks = [max(m["rank_stats"]["peak_mem_mb"][rank] for m in windows) * MIB for rank in range(2)]
    assert all(peak < budget for peak in peaks), (f"peak RSS per rank {[round(p / MIB) for p in peaks]} MiB, budget "
                                                 f"{budget / MIB:.0f} MiB, plan {plans['fsdp'].device_total / MIB:.0f}")
