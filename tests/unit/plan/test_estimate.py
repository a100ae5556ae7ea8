"""The memory plan in one process (hftk.plan.estimate): shapes from the meta device, LoRA and quantized bases,
the sharding order, ``auto``'s pick, the ``hftk plan`` command (tp / sp / cp rows included) and its errors."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from hftk.data.builtin import builtin_model_config
from hftk.plan.estimate import (GIB, HEADROOM, PLAN_STRATEGIES, PlanInputs, estimate, model_shape, pick, plan,
                                resolve_auto)
from tests.helpers import TINY_ARGS


def test_meta_shape_counts_what_the_real_model_holds(tiny_shape):
    from transformers import AutoModelForCausalLM

    from hftk.data.builtin import materialize_model

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

    from hftk.config.options import ModelConfig
    from hftk.data.builtin import materialize_model
    from hftk.models.lora import lora_config

    lora = model_shape(builtin_model_config("builtin:gpt2-tiny"), lora_r=4)
    real = get_peft_model(AutoModelForCausalLM.from_pretrained(materialize_model("builtin:gpt2-tiny")),
                          lora_config(ModelConfig(lora_r=4), builtin_model_config("builtin:gpt2-tiny"),
                                      conv1d=True))  # the adapters a run adds
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
    from hftk.config.options import load_config

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
    from hftk.run.prepare import main

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


@pytest.mark.parametrize("model,bits,double_quant", [("builtin:gpt2-tiny", 4, True), ("builtin:llama-tiny", 4, False),
                                                      ("builtin:llama-tiny", 8, False)])
def test_plan_counts_the_quantized_base_as_loaded(model, bits, double_quant):
    """The plan's bytes of a quantized base + r=8 adapters equal what memory.model_state_bytes counts on
    the real model (transformers + bitsandbytes + PEFT), within 3% (per-layer block rounding)."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hftk.config.options import ModelConfig
    from hftk.data.builtin import builtin_model_config, materialize_model
    from hftk.models.lora import lora_config
    from hftk.plan.estimate import PlanInputs, estimate, model_shape
    from hftk.telemetry.memory import model_state_bytes

    config = (BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32))
    base = AutoModelForCausalLM.from_pretrained(materialize_model(model), quantization_config=config,
                                                device_map={"": "cpu"})
    options = ModelConfig(lora_r=8, load_in_4bit=bits == 4, load_in_8bit=bits == 8)
    peft = get_peft_model(prepare_model_for_kbit_training(base, use_gradient_checkpointing=False),
                          lora_config(options, base.config))
    counted = model_state_bytes(peft)["params"]
    inputs = PlanInputs(world_size=1, device_memory_bytes=2**30, device="cpu", quant_bits=bits,
                        double_quant=double_quant)
    planned = estimate("ddp", model_shape(builtin_model_config(model), 8), inputs).params
    assert planned == pytest.approx(counted, rel=0.03)
    unquantized = estimate("ddp", model_shape(builtin_model_config(model), 8), PlanInputs(1, 2**30)).params
    assert planned < 0.8 * unquantized  # embeddings (half of these tiny models) stay fp32


def test_plan_command_plans_qlora_for_the_strategies_that_train_it(capsys):
    from hftk.cli import main

    assert main(["plan", "--model", "builtin:gpt2-tiny", "--world_size", "2", "--device_memory", "1", "--lora_r",
                 "8", "--load_in_4bit", "--optim", "adamw_bnb_8bit", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["strategy"] for p in out["plans"]] == ["ddp", "fsdp"] and out["inputs"]["quant_bits"] == 4
    assert out["inputs"]["optim_bits"] == 8
    assert main(["plan", "--model", "builtin:gpt2-tiny", "--world_size", "2", "--device_memory", "1",
                 "--load_in_4bit"]) == 2  # a quantized base trains only adapters


def test_hftk_plan_shows_tp_sp_and_cp_rows(capsys):
    from hftk.core.errors import HftkError
    from hftk.plan.estimate import plan_command

    base = ["--model", "builtin:llama-tiny", "--world_size", "4", "--device_memory", "1", "--seq_len", "64"]
    assert plan_command([*base, "--tp_size", "2", "--sp_size", "4"]) == 0
    rows = {line.split("  ")[0].strip() for line in capsys.readouterr().out.splitlines()}
    assert {"tp2 x fsdp2", "sp4", "ddp"} <= rows
    long = ["--model", "builtin:llama-tiny", "--world_size", "4", "--device_memory", "1", "--seq_len", "256", "--json"]
    assert plan_command([*long, "--cp_size", "4"]) == 0
    plans = {p["strategy"]: p for p in json.loads(capsys.readouterr().out)["plans"]}
    # 1/4 of every sequence per rank: less activation memory than FSDP2 over the same 4 ranks, same model state
    assert plans["cp4"]["activations"] < plans["fsdp"]["activations"] / 3
    assert plans["cp4"]["params"] == plans["fsdp"]["params"]
    with pytest.raises(HftkError, match="--tp_size"):
        plan_command([*base, "--tp_size", "3"])
    with pytest.raises(HftkError, match="--cp_size"):
        plan_command([*base, "--cp_size", "2", "--tp_size", "4"])


def test_dpo_counts_the_reference_as_each_strategy_holds_it():
    """The reference: a whole copy under ddp (loaded dtype), sharded with the policy under fsdp, a whole 16-bit
    copy under ZeRO-1/2 (TRL's DeepSpeed inference engine casts it), partitioned in 16 bits under ZeRO-3; pairs
    double the sequences a micro-batch runs."""
    shape = model_shape(builtin_model_config("builtin:gpt2-90m"))
    p = shape.params
    sft = {x.strategy: x for x in plan(shape, PlanInputs(world_size=2, device_memory_bytes=GIB, mixed_precision="bf16"))}
    dpo = {x.strategy: x for x in plan(shape, PlanInputs(world_size=2, device_memory_bytes=GIB, mixed_precision="bf16",
                                                         pairs=True, reference=True))}
    expected = {"ddp": 4 * p, "fsdp": -(-4 * p // 2), "zero1": 2 * p, "zero2": 2 * p, "zero3": 2 * -(-p // 2),
                "zero3_offload": 2 * -(-p // 2)}
    for strategy in PLAN_STRATEGIES:
        assert sft[strategy].reference == 0
        assert dpo[strategy].reference == expected[strategy], strategy
        assert dpo[strategy].model_state == sft[strategy].model_state  # the reference has no gradients, no optimizer
        assert dpo[strategy].activations == 2 * sft[strategy].activations  # chosen and rejected: 2 x micro_batch
        assert dpo[strategy].device_total == (sft[strategy].device_total + dpo[strategy].reference
                                              + sft[strategy].activations)


@pytest.mark.parametrize("argv, held", [((), True), (("--lora_r", "8"), False), (("--precompute_ref_log_probs",), False),
                                        (("--precompute_ref_log_probs", "--ref_model_name_or_path", "builtin:gpt2-90m"),
                                         True)])
def test_dpo_holds_a_reference_unless_lora_or_precomputed_log_probs(argv, held):
    """As engine/preference.py loads it: LoRA's reference is the base with the adapter off; precomputed log-probs
    leave TRL none, unless a separate reference model is named (hftk loads it and TRL keeps it)."""
    from hftk.plan.estimate import inputs_from_config

    inputs = inputs_from_config(_cfg("--method", "dpo", "--max_length", "96", *argv), 2, GIB)
    assert (inputs.pairs, inputs.reference, inputs.seq_len) == (True, held, 96)
    assert not inputs_from_config(_cfg(*argv), 2, GIB).pairs


def test_a_named_reference_is_counted_at_its_own_size(capsys):
    """gpt2-tiny trained against gpt2-90m as its reference: the reference row is the 90M model's bytes, in the run's
    plan and in `hftk plan`, not the policy's."""
    from hftk.plan.estimate import inputs_from_config, plan_command

    big = model_shape(builtin_model_config("builtin:gpt2-90m")).params
    small = model_shape(builtin_model_config("builtin:gpt2-tiny")).params
    named = ("--ref_model_name_or_path", "builtin:gpt2-90m")
    inputs = inputs_from_config(_cfg("--method", "dpo", *named), 2, GIB)
    assert inputs.reference_params == big and inputs_from_config(_cfg("--method", "dpo"), 2, GIB).reference_params is None
    ddp = {x.strategy: x for x in plan(model_shape(builtin_model_config("builtin:gpt2-tiny")), inputs)}["ddp"]
    assert ddp.reference == 4 * big != 4 * small
    plan_command(["--model", "builtin:gpt2-tiny", "--world_size", "2", "--device_memory", "80", "--method", "dpo",
                  *named, "--json"])
    rows = {p["strategy"]: p for p in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plans"]}
    assert rows["ddp"]["reference"] == 4 * big and rows["zero3"]["reference"] == 4 * -(-big // 2)


def test_auto_for_dpo_shards_where_the_reference_no_longer_fits_beside_the_policy(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    config = builtin_model_config("builtin:gpt2-90m")
    shape = model_shape(config)
    ddp = plan(shape, PlanInputs(world_size=2, device_memory_bytes=GIB, seq_len=64, micro_batch=2, device="cpu"),
               ("ddp",))[0]
    budget_gb = ddp.device_total / (1 - HEADROOM) / GIB * 1.01  # supervised fine-tuning fits ddp
    sft = _cfg("--strategy", "auto", "--device_memory_gb", str(budget_gb))
    assert resolve_auto(sft, config, 2) == "ddp"
    dpo = _cfg("--strategy", "auto", "--device_memory_gb", str(budget_gb), "--method", "dpo")
    assert resolve_auto(dpo, config, 2) != "ddp"
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("hftk: strategy auto -> ") and "ddp" in line.split("predicted peaks: ")[1]
    lora = _cfg("--strategy", "auto", "--device_memory_gb", str(budget_gb), "--method", "dpo", "--lora_r", "8")
    assert resolve_auto(lora, config, 2) == "ddp"  # no second model under LoRA


def test_plan_command_counts_the_dpo_reference(capsys):
    assert _plan_cli("--model", "builtin:gpt2-tiny", "--world_size", "2", "--device_memory", "4", "--method", "dpo",
                     "--json") == 0
    held = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert held["inputs"]["pairs"] and held["inputs"]["reference"]
    assert all(p["reference"] > 0 for p in held["plans"] if p["strategy"] in PLAN_STRATEGIES)
    assert _plan_cli("--model", "builtin:gpt2-tiny", "--world_size", "2", "--device_memory", "4", "--method", "dpo",
                     "--precompute_ref_log_probs", "--json") == 0
    assert all(p["reference"] == 0 for p in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plans"])


def test_grpo_counts_the_rollouts_beside_the_model_state():
    """GRPO's generation: the KV cache of every rank's rollout rows at their longest, the last logits, and the
    weights gathered for generation (the whole model under ZeRO-3, FSDP2's root and two blocks); the peak takes the
    larger of training's activations and the generation, which do not overlap."""
    shape = model_shape(builtin_model_config("builtin:llama-tiny"))
    assert shape.kv_width == 2 * (64 // 4)  # grouped-query attention: 2 key/value heads of 16
    base = dict(world_size=2, device_memory_bytes=GIB, seq_len=96, micro_batch=4, device="cpu")
    sft = {x.strategy: x for x in plan(shape, PlanInputs(**base))}
    grpo = {x.strategy: x for x in plan(shape, PlanInputs(**base, rollout_rows=16, rollout_tokens=96))}
    cache = 2 * shape.layers * shape.kv_width * 96 * 16 * 4
    gathered = {"zero3": 4 * shape.params, "zero3_offload": 4 * shape.params,
                "fsdp": 4 * (shape.outside_blocks + 2 * shape.largest_block)}
    for strategy in PLAN_STRATEGIES:
        g = grpo[strategy]
        assert g.generation == cache + 4 * shape.vocab * 16 + gathered.get(strategy, 0), strategy
        assert g.device_total == sft[strategy].device_total - g.activations + max(g.activations, g.generation)


def test_grpo_kv_cache_term_is_the_cache_transformers_holds():
    """The cache bytes of the formula against the DynamicCache a real ``generate`` leaves (fp32, 3 rows of a 5-token
    prompt plus 7 new tokens: the last token is never cached)."""
    from transformers import AutoModelForCausalLM

    from hftk.data.builtin import materialize_model
    from hftk.plan.estimate import generation_bytes

    model = AutoModelForCausalLM.from_pretrained(materialize_model("builtin:llama-tiny"), dtype=torch.float32)
    ids = torch.randint(1, 100, (3, 5))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    shape = model_shape(model.config)
    inputs = PlanInputs(world_size=1, device_memory_bytes=GIB, rollout_rows=3, rollout_tokens=5 + 8 - 1)
    assert generation_bytes("ddp", shape, inputs) - 4 * shape.vocab * 3 == held


@pytest.mark.parametrize("argv, held", [(("--beta", "0.04"), True), ((), False), (("--beta", "0.04", "--lora_r", "8"),
                                                                                 False)])
def test_grpo_plans_prompt_plus_completion_and_holds_a_reference_only_with_beta(argv, held):
    from hftk.plan.estimate import inputs_from_config

    inputs = inputs_from_config(_cfg("--method", "grpo", "--block_size", "32", "--max_completion_length", "48",
                                     "--gradient_accumulation_steps", "2", *argv), 2, GIB)
    assert (inputs.seq_len, inputs.rollout_tokens, inputs.rollout_rows, inputs.reference) == (80, 80, 2 * 2, held)


@pytest.mark.parametrize("family,refused", [("qwen3", ()), ("gemma3_text", ("cp2", "sp2")), ("phi3", ()),
                                            ("olmo2", ()), ("smollm3", ())])
def test_hftk_plan_gives_every_family_every_row_and_a_reason_where_it_cannot_run(family, refused, tmp_path, capsys):
    """A folder holding only a config.json of the family, 8B-wide (8 of its layers: the plan reads their shapes),
    asking "which strategy fits my model on 8 GPUs?": every data-parallel row, the tp / cp / sp rows asked for, and
    where the family cannot run a layout (Gemma 3's 4096-token sliding window against 8192-token sequences under
    cp and sp) a row saying why."""
    from transformers import AutoConfig

    from hftk.plan.estimate import plan_command

    AutoConfig.for_model(family, hidden_size=4096, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=12288, vocab_size=151936, max_position_embeddings=32768).save_pretrained(tmp_path)
    assert plan_command(["--model", str(tmp_path), "--world_size", "8", "--device_memory", "80", "--seq_len", "8192",
                         "--gradient_checkpointing", "--mixed_precision", "bf16", "--tp_size", "2", "--cp_size", "2",
                         "--sp_size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[3:] if line.strip() and not line.startswith("pick")}
    assert {"ddp", "zero1", "zero2", "fsdp", "zero3", "zero3_offload", "tp2", "cp2", "sp2"} <= set(rows)
    for label, line in rows.items():
        if label in refused:
            assert "refused: " in line and "sliding_attention layers (window" in line, line
        else:
            assert "refused" not in line and line.rstrip().endswith(("yes", "no")), line
    assert any(line.startswith("pick: ") for line in lines)


def test_plan_command_counts_grpo_rollouts_and_refuses_a_completion_past_the_context(capsys):
    from hftk.core.errors import HftkError
    from hftk.plan.estimate import plan_command

    base = ["--model", "builtin:gpt2-90m", "--world_size", "2", "--device_memory", "8", "--method", "grpo",
            "--seq_len", "128", "--micro_batch", "4", "--gradient_accumulation_steps", "2"]
    assert plan_command([*base, "--max_completion_length", "256", "--beta", "0.04", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["inputs"]["rollout_rows"], out["inputs"]["rollout_tokens"], out["inputs"]["reference"]) == (8, 384, True)
    assert all(p["generation"] > 0 and p["reference"] > 0 for p in out["plans"] if p["refused"] is None)
    with pytest.raises(HftkError, match="1152 tokens \\(with --max_completion_length\\) exceed the model's context "
                                        "length 1024"):
        plan_command([*base, "--seq_len", "640", "--max_completion_length", "512"])


def test_hftk_plan_counts_a_mixture_of_experts_total_and_active(tmp_path, capsys):
    """A Qwen3-30B-A3B-shaped config (128 experts, top-8; 6 of its 48 layers: the plan reads their shapes) in bf16:
    every row, no traceback (transformers' grouped_mm met in the activation trace once raised one), the experts
    counted whole in every strategy's model state and the active parameters named."""
    from transformers import AutoConfig

    from hftk.plan.estimate import model_shape, plan_command

    AutoConfig.for_model("qwen3_moe", hidden_size=2048, num_hidden_layers=6, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                         num_experts=128, num_experts_per_tok=8, vocab_size=151936).save_pretrained(tmp_path)
    assert plan_command(["--model", str(tmp_path), "--world_size", "8", "--device_memory", "80", "--seq_len", "4096",
                         "--mixed_precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "in experts" in out and "active per token" in out
    assert all(name in out for name in ("ddp", "zero1", "zero2", "ep", "fsdp", "zero3", "zero3_offload"))
    shape = model_shape(AutoConfig.from_pretrained(tmp_path))
    per_layer = 128 * 3 * 2048 * 768  # gate, up and down of every expert
    assert shape.experts == 6 * per_layer
    assert shape.active == shape.params - shape.experts + 6 * per_layer * 8 // 128
    # expert parallel: fsdp's sharded state, but a block's gather holds 1/8 of its experts; tried before fsdp
    inputs = PlanInputs(world_size=8, device_memory_bytes=36 * GIB, seq_len=4096, micro_batch=1,
                        mixed_precision="bf16", loss="plain")  # the same loss under both: ep's loop has no chunked
    rows = {p.strategy: p for p in plan(shape, inputs)}
    chunked = {p.strategy: p for p in plan(shape, dataclasses.replace(inputs, loss="auto"))}
    assert chunked["fsdp"].activations < rows["fsdp"].activations and chunked["ep"] == rows["ep"]
    assert list(rows) == ["ddp", "zero1", "zero2", "ep", "fsdp", "zero3", "zero3_offload"]
    assert rows["ep"].model_state == rows["fsdp"].model_state and rows["ep"].activations == rows["fsdp"].activations
    gathered = 2 * 2 * (shape.largest_block - shape.largest_block_experts * 7 // 8)  # bf16, in use + prefetched
    assert rows["ep"].transient < rows["fsdp"].transient - gathered // 2
    assert pick(list(rows.values())).strategy == "ep"  # ddp and ZeRO-1/2 hold whole experts: over 80% of 36 GiB
    four = {p.strategy: p for p in plan(shape, dataclasses.replace(inputs, ep_size=3))}
    assert four["ep"].refused == "ep_size 3 must divide the world size 8 and the 128 experts of each MoE layer"


def test_hftk_plan_seq_len_max_finds_each_strategys_longest_fitting_sequence(tmp_path, capsys):
    """At a 151,936-token vocabulary the chunked loss fits longer sequences than the plain one; each length found
    fits the budget and one token more does not (or it is the model's context length)."""
    from transformers import AutoConfig

    from hftk.plan.estimate import longest_fitting, model_shape, plan_command

    AutoConfig.for_model("qwen2", vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32768).save_pretrained(tmp_path)
    found = {}
    for loss in ("plain", "chunked"):
        assert plan_command(["--model", str(tmp_path), "--world_size", "2", "--device_memory", "6", "--seq_len", "max",
                             "--micro_batch", "1", "--loss_implementation", loss]) == 0
        out = capsys.readouterr().out
        found[loss] = int(re.search(r"^ddp +([\d,]+) tokens", out, re.M).group(1).replace(",", ""))
    assert 0 < found["plain"] < found["chunked"] / 2
    shape = model_shape(AutoConfig.from_pretrained(tmp_path))
    inputs = PlanInputs(world_size=2, device_memory_bytes=6 * GIB, micro_batch=1, loss="plain", device="cpu")
    tokens = longest_fitting("ddp", shape, inputs, 32768)
    budget = 6 * GIB * (1 - HEADROOM)
    assert estimate("ddp", shape, dataclasses.replace(inputs, seq_len=tokens)).device_total <= budget
    assert estimate("ddp", shape, dataclasses.replace(inputs, seq_len=tokens + 1)).device_total > budget
