"""The model resolver (hftk/models/spec.py): what it reads off transformers' metadata and the module tree, the five
families hftk knew before it keep exactly the layout, LoRA targets and TP plans the hand-written table gave them,
and a model whose structure cannot be derived is refused by name by the strategies that need it."""

from __future__ import annotations

import pytest
import torch.nn as nn
from transformers import AutoConfig

from hftk.models.spec import causal_only_problem, model_spec, strategy_refusal

_ATTENTION_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The rows of the hand-written table the resolver replaced (config/family_table.py until 2026-12-06):
# (backbone, blocks, token embedding, position embedding, final norm, LoRA targets).
BEFORE = {
    "gpt2": ("transformer", "h", "wte", "wpe", "ln_f", ("c_attn", "c_proj", "c_fc")),
    "gpt_neox": ("gpt_neox", "layers", "embed_in", None, "final_layer_norm",
                 ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")),
    "llama": ("model", "layers", "embed_tokens", None, "norm", _ATTENTION_MLP),
    "mistral": ("model", "layers", "embed_tokens", None, "norm", _ATTENTION_MLP),
    "qwen2": ("model", "layers", "embed_tokens", None, "norm", _ATTENTION_MLP),
}
GPT2_PLAN = {  # the table's GPT-2 plan (after Conv1D -> nn.Linear, c_attn split into q / k / v)
    "transformer.h.*.attn.c_attn.q": "colwise", "transformer.h.*.attn.c_attn.k": "colwise",
    "transformer.h.*.attn.c_attn.v": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise",
}


@pytest.mark.parametrize("family", sorted(BEFORE))
def test_the_five_old_families_keep_the_tables_layout_lora_targets_and_tp_plan(family):
    backbone, blocks, embedding, position, norm, targets = BEFORE[family]
    config = AutoConfig.for_model(family)
    spec = model_spec(config)
    assert (spec.backbone, spec.blocks, spec.embedding) == (backbone, blocks, embedding)
    assert spec.before_blocks == ((embedding, position) if position else (embedding,))
    assert spec.after_blocks == (norm,) and spec.head == "lm_head"
    assert spec.lora_targets == targets
    # the table took tp plans from the config as they are ("transformers"), GPT-2's from hftk
    want = GPT2_PLAN if family == "gpt2" else {f"{backbone}.{k}": v for k, v in config.base_model_tp_plan.items()}
    assert spec.tp_plan == want and spec.tp_problem is None


def test_structure_comes_from_the_pp_plan_else_the_module_tree_in_call_order():
    """OPT has no pp plan and registers its final norm before its layers: the order is the forward's."""
    qwen3, opt = model_spec(AutoConfig.for_model("qwen3")), model_spec(AutoConfig.for_model("opt"))
    assert qwen3.source == "base_model_pp_plan" and qwen3.block_classes == ("Qwen3DecoderLayer",)
    assert opt.source == "module tree" and opt.backbone == "model.decoder"
    assert opt.before_blocks == ("embed_tokens", "embed_positions") and opt.after_blocks == ("final_layer_norm",)


def test_quirks_are_read_from_the_config():
    gemma = model_spec(AutoConfig.for_model("gemma3_text"))
    assert gemma.tied and {"sliding_attention", "full_attention"} == set(gemma.layer_types)
    assert model_spec(AutoConfig.for_model("phi3")).lora_targets == ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")
    qwen3_plan = model_spec(AutoConfig.for_model("qwen3")).tp_plan
    assert qwen3_plan["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    olmo2_plan = model_spec(AutoConfig.for_model("olmo2")).tp_plan
    assert olmo2_plan["model.layers.*.self_attn.q_proj"] == "colwise_gather_output"
    sinks = model_spec(AutoConfig.for_model("gpt_oss", num_hidden_layers=2, layer_types=["full_attention"] * 2))
    assert sinks.attention_sinks and "sinks" in causal_only_problem(sinks, None, "ring attention")


def test_old_style_blocks_that_return_tuples_are_refused_by_pipeline_only():
    bloom = model_spec(AutoConfig.for_model("bloom"))
    assert bloom.block_returns == "tuple"
    assert "return a tuple" in strategy_refusal(bloom, "pipeline").problem
    assert strategy_refusal(bloom, "ddp") is None and strategy_refusal(bloom, "fsdp") is None


def test_sliding_windows_refuse_causal_only_kernels_unless_the_block_fits_in_the_window():
    mistral = model_spec(AutoConfig.for_model("mistral", sliding_window=16))
    assert "window 16" in strategy_refusal(mistral, "cp", block_size=32).problem
    assert strategy_refusal(mistral, "cp", block_size=16) is None
    assert "window 16" in strategy_refusal(mistral, "sp", block_size=32).problem
    assert strategy_refusal(mistral, "pipeline", block_size=32) is None


def _underivable_config() -> object:
    """A decoder LM class of its own (as remote code brings one): no pp plan, no _no_split_modules."""
    import torch
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class NovelConfig(PretrainedConfig):
        model_type = "hftk_novel"

        def __init__(self, vocab_size: int = 32, hidden_size: int = 8, num_hidden_layers: int = 2, **kwargs):
            super().__init__(**kwargs)
            self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers

    class NovelForCausalLM(PreTrainedModel):
        config_class = NovelConfig

        def __init__(self, config: NovelConfig) -> None:
            super().__init__(config)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.mix = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size)
                                     for _ in range(config.num_hidden_layers))
            self.out = nn.Linear(config.hidden_size, config.vocab_size)
            self.post_init()

        def forward(self, input_ids: torch.Tensor, **kwargs: object) -> CausalLMOutput:
            hidden = self.embed(input_ids)
            for layer in self.mix:
                hidden = hidden + layer(hidden)
            return CausalLMOutput(logits=self.out(hidden))

    AutoConfig.register("hftk_novel", NovelConfig, exist_ok=True)
    AutoModelForCausalLM.register(NovelConfig, NovelForCausalLM, exist_ok=True)
    return NovelConfig()


def test_an_underivable_model_is_refused_by_name_saying_what_is_missing_and_what_still_trains():
    spec = model_spec(_underivable_config())
    assert not spec.has_structure and "_no_split_modules" in spec.structure_problem
    for strategy in ("pipeline", "tp", "cp", "sp"):
        refusal = strategy_refusal(spec, strategy)
        assert refusal.field == "model.model_name_or_path"
        assert "Novel" in refusal.problem and "base_model_pp_plan" in refusal.problem
        assert "ddp, fsdp, zero1, zero2, zero3, zero3_offload" in refusal.fix
    assert all(strategy_refusal(spec, s) is None for s in ("ddp", "fsdp", "zero3"))


NOVEL_CONFIG = """from transformers import PretrainedConfig


class NovelConfig(PretrainedConfig):
    model_type = "hftk_remote_novel"

    def __init__(self, vocab_size=2050, hidden_size=16, num_hidden_layers=2, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
"""
NOVEL_MODEL = """import torch.nn as nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_novel import NovelConfig


class NovelForCausalLM(PreTrainedModel):
    config_class = NovelConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.num_hidden_layers))
        self.out = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, labels=None, **kwargs):
        hidden = self.embed(input_ids)
        for layer in self.mix:
            hidden = hidden + layer(hidden)
        return CausalLMOutput(logits=self.out(hidden))
"""


def remote_code_folder(folder):
    """A model folder whose code ships beside its config (``auto_map``), as a Hub repo with remote code does."""
    import json

    from hftk.data.builtin import materialize_model

    folder.mkdir()
    (folder / "configuration_novel.py").write_text(NOVEL_CONFIG)
    (folder / "modeling_novel.py").write_text(NOVEL_MODEL)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "hftk_remote_novel", "architectures": ["NovelForCausalLM"], "vocab_size": 2050,
        "hidden_size": 16, "num_hidden_layers": 2,
        "auto_map": {"AutoConfig": "configuration_novel.NovelConfig",
                     "AutoModelForCausalLM": "modeling_novel.NovelForCausalLM"}}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((materialize_model("builtin:gpt2-tiny") / name).read_bytes())
    return folder


@pytest.mark.parametrize("strategy", ["pipeline", "tp", "sp"])
def test_a_remote_code_model_without_derivable_structure_is_one_line_before_launch(strategy, tmp_path, monkeypatch,
                                                                                    capsys):
    from hftk.run.prepare import main
    from tests.helpers import TWO_RANKS, TINY_ARGS

    for key, value in TWO_RANKS.items():
        monkeypatch.setenv(key, value)
    folder = remote_code_folder(tmp_path / "novel")
    degree = {"pipeline": "--pp_size", "tp": "--tp_size", "sp": "--sp_size"}[strategy]
    out = tmp_path / "out"
    assert main([*TINY_ARGS, "--model_name_or_path", str(folder), "--trust_remote_code", "--strategy", strategy,
                 degree, "2", "--output_dir", str(out)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("hftk: error: model.model_name_or_path: Novel ('hftk_remote_novel') cannot run under "
                               f"strategy {strategy}: hftk cannot derive its decoder structure: its config has no "
                               "base_model_pp_plan and its model class names no block in _no_split_modules."), lines[0]
    assert "Fix: train it with ddp, fsdp, zero1, zero2, zero3, zero3_offload" in lines[0]
    assert not out.exists()


def test_a_mixture_of_experts_is_read_off_its_modules():
    """Experts fused or not, the router transformers records, the shared experts beside them, dense layers first:
    read from the model, for families hftk has never listed."""
    qwen3 = model_spec(AutoConfig.for_model("qwen3_moe", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                            mlp_only_layers=[0])).moe
    assert (qwen3.experts, qwen3.router, qwen3.fused, qwen3.num_experts, qwen3.top_k) == \
        ("mlp.experts", "mlp.gate", True, 4, 2)
    assert qwen3.layers == (1, 2) and qwen3.lora_target_parameters == ("mlp.experts.gate_up_proj",
                                                                         "mlp.experts.down_proj")
    shared = model_spec(AutoConfig.for_model("qwen2_moe", num_hidden_layers=2, num_experts=4)).moe
    assert shared.shared == ("mlp.shared_expert", "mlp.shared_expert_gate")
    oss = model_spec(AutoConfig.for_model("gpt_oss", num_hidden_layers=2, num_local_experts=4,
                                          layer_types=["sliding_attention", "full_attention"]))
    assert oss.moe.router == "mlp.router" and "gate_up_proj_bias" in oss.moe.expert_params
    assert "router" not in oss.lora_targets  # where tokens go is not adapted
    assert "balancing loss" in strategy_refusal(oss, "sp").problem
    aux_free = AutoConfig.for_model("deepseek_v3", num_hidden_layers=2, n_routed_experts=4, first_k_dense_replace=1)
    assert model_spec(aux_free).moe.aux_coef is None  # it balances with a bias, not a loss
    assert model_spec(AutoConfig.for_model("llama")).moe is None
    # expert parallel splits transformers' fused experts by their first dimension; a dense model is refused by name
    assert qwen3.ep_problem is None and shared.ep_problem is None and oss.moe.ep_problem is None
    assert strategy_refusal(oss, "ep") is None
    assert strategy_refusal(model_spec(AutoConfig.for_model("llama")), "ep").problem == (
        "Llama ('llama') cannot run under strategy ep: it has no experts (expert parallel splits a mixture of experts' "
        "experts over ranks).")
