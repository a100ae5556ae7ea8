"""Mixture of experts in a run (hftk/models/moe.py), in one process: the balancing loss is on while training and
off otherwise, weighted per micro-batch; the router counts come from the experts tokens were really sent to; a
window with an expert that got no token names its layer; bad MoE options are one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hftk.config.options import load_config
from hftk.core.errors import HftkError
from hftk.models import moe
from hftk.models.spec import model_spec

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
             mlp_only_layers=[0])


def tiny_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **SMALL))


def test_the_balancing_loss_is_optimized_while_training_at_its_weight_per_micro_batch():
    model = tiny_moe()
    cfg = load_config([])
    assert moe.prepare(model, cfg, micro_batches_per_step=4, device=torch.device("cpu"))
    assert model.router_aux_loss_coef == pytest.approx(0.001 / 4)  # the config's, over the micro-batches summed
    ids = torch.randint(0, 128, (2, 16))
    trained = model.train()(input_ids=ids, labels=ids)
    assert trained.aux_loss is not None
    plain_ce = model.loss_function(logits=trained.logits, labels=ids, vocab_size=128)
    assert float(trained.loss) == pytest.approx(float(plain_ce + model.router_aux_loss_coef * trained.aux_loss))
    assert model.eval()(input_ids=ids).aux_loss is None  # generation and evaluation: off
    assert model.config.output_router_logits is False  # the saved config is the user's


def test_router_counts_are_the_experts_tokens_went_to_and_a_dead_expert_is_named(capsys):
    model = tiny_moe()
    moe.prepare(model, load_config([]), 1, torch.device("cpu"))
    stats = moe.RouterStats(model)
    with torch.no_grad():  # every router sends every token to experts 0 and 1
        for layer in (1, 2):
            model.model.layers[layer].mlp.gate.weight.zero_()
            model.model.layers[layer].mlp.gate.weight[:2] = 1.0
    ids = torch.randint(0, 128, (2, 8))
    hidden = model.model.embed_tokens(ids)
    hidden.requires_grad_(True)  # a positive input to every router: experts 0 and 1 win
    model.train()(inputs_embeds=hidden.abs() + 0.1, labels=ids).loss.backward()
    found = stats.window()
    assert found["dead_expert_layers"] == [1, 2]
    # 16 tokens x top-2 over 4 experts: 8 each on average; experts 0 and 1 got 16 each
    assert found["expert_load_max_mean"] == pytest.approx(2.0)
    assert found["moe_aux_loss"] > 0
    assert stats.window() == {}  # reset after each window
    with torch.no_grad():
        model.eval()(input_ids=ids)
    assert stats.window() == {}  # evaluation is not training's load


@pytest.mark.parametrize("field,value,words", [
    ("router_aux_loss_coef", 0.01, "has no experts"), ("experts_implementation", "eager", "has no experts")])
def test_moe_options_on_a_dense_model_are_refused_by_name(field, value, words):
    cfg = load_config([])
    setattr(cfg.model, field, value)
    with pytest.raises(HftkError) as err:
        moe.check_options(cfg, model_spec(AutoConfig.for_model("llama")))
    assert err.value.field == f"model.{field}" and words in err.value.problem


def test_a_negative_or_pointless_balancing_weight_is_refused():
    cfg = load_config([])
    cfg.model.router_aux_loss_coef = -1.0
    with pytest.raises(HftkError, match="must be >= 0"):
        moe.check_options(cfg, model_spec(AutoConfig.for_model("qwen3_moe", **SMALL)))
    cfg.model.router_aux_loss_coef = 0.01
    aux_free = AutoConfig.for_model("deepseek_v3", num_hidden_layers=2, n_routed_experts=4, first_k_dense_replace=1)
    with pytest.raises(HftkError, match="adds no balancing loss"):
        moe.check_options(cfg, model_spec(aux_free))


@pytest.mark.parametrize("args,field,words", [
    (["--method", "dpo", "--lora_r", "4"], "model.lora_target_modules", "frozen reference adapter"),
    (["--lora_r", "4", "--lora_dropout", "0.1"], "model.lora_dropout", "take no dropout"),
    (["--strategy", "cp", "--cp_size", "2"], "model.model_name_or_path", "balancing loss"),
])
def test_what_the_experts_cannot_do_is_one_line_before_launch(args, field, words, tmp_path, monkeypatch, capsys):
    import json

    from hftk.data.builtin import materialize_model
    from hftk.run.prepare import main
    from tests.helpers import TINY_ARGS, TWO_RANKS

    for key, value in TWO_RANKS.items():
        monkeypatch.setenv(key, value)
    folder = tmp_path / "qwen3_moe"
    AutoConfig.for_model("qwen3_moe", **{**SMALL, "vocab_size": 2050}).save_pretrained(folder)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": "a", "chosen": " b", "rejected": " c"}) + "\n" for _ in range(20)))
    data = ["--dataset", str(pairs)] if "dpo" in args else []
    out = tmp_path / "out"
    assert main([*TINY_ARGS, "--model_name_or_path", str(folder), "--tokenizer_name_or_path",
                 str(materialize_model("builtin:gpt2-tiny")),
                 *data, *args, "--output_dir", str(out)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"hftk: error: {field}:") and words in lines[0], lines
