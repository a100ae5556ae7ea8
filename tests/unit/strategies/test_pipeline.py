"""Pipeline stages (hftk/strategies/pipeline.py) in one process: stages cut from the HF model's own
structure give its logits (packed examples kept apart), blocks are split by parameters, and bad configs are named before any
process group (the multi-process proofs: tests/integration/test_pipeline.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_ARGS
from tests.unit.data.test_dataset import ATTENTION, FAMILIES, assert_examples_apart, packed

MODELS = {"gpt2": "builtin:gpt2-tiny4", "llama": "builtin:llama-tiny"}
PIPE = ["--strategy", "pipeline", "--pp_size", "2", "--pp_microbatches", "4"]


SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)
# Each family at 4 layers with what its forward does around the blocks that a hand-rebuilt stage would drop:
# sliding windows beside full layers (one rotary table per layer type in Gemma 3), soft-capped logits, embedding /
# residual / attention multipliers and logit scaling (Granite, Cohere), NoPE layers, parallel attention + MLP (Phi,
# Cohere), a backbone nested one level down with its final norm registered before its layers (OPT).
CHAIN_CONFIGS = {
    "gpt2": dict(vocab_size=128, n_layer=4, n_embd=32, n_head=4, n_positions=64),
    "gpt_neox": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4),
    "llama": SMALL,
    "mistral": {**SMALL, "sliding_window": 8},
    "qwen2": {**SMALL, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    "qwen3": {**SMALL, "head_dim": 8},
    "gemma3_text": {**SMALL, "head_dim": 8, "sliding_window": 6, "final_logit_softcapping": 3.0,
                    "layer_types": ["sliding_attention", "full_attention"] * 2},
    "phi3": SMALL,
    "olmo2": SMALL,
    "smollm3": {**SMALL, "no_rope_layers": [1, 0, 1, 0]},
    "granite": {**SMALL, "embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3,
                "logits_scaling": 4.0},
    "cohere": {**SMALL, "logit_scale": 0.5},
    "gemma2": {**SMALL, "head_dim": 8, "sliding_window": 6, "attn_logit_softcapping": 5.0,
               "final_logit_softcapping": 3.0},
    "opt": dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, ffn_dim=64, num_attention_heads=4),
    "phi": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4),
}


@pytest.mark.parametrize("family", sorted(CHAIN_CONFIGS))
def test_stage_chain_equals_model_forward(family):
    """Stages called one after another give the model's own logits exactly (padding mask, rotary, sliding
    windows, soft-capping, multipliers), and hold every weight once under its own name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hftk.strategies.pipeline import build_stages

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **CHAIN_CONFIGS[family])).eval()
    ids = torch.randint(0, 128, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        for n in (2, 3, 4):
            stages = build_stages(model, n)
            hidden = ids
            for stage in stages:
                hidden = stage(hidden, attention_mask=mask)
            assert torch.equal(hidden, ref), n
            names = [k for s in stages for k in s.full_state_dict()]
            assert sorted(names) == sorted(model.state_dict()) and len(names) == len(set(names))


def test_a_rank_keeps_only_its_stages_and_still_computes_them():
    """What another rank holds is freed (stand-ins), and this rank's stages give the same outputs as before."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from hftk.strategies.pipeline import _Pass, _ShapeOnly, build_stages, keep_only

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **CHAIN_CONFIGS["gpt2"])).eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        hidden = build_stages(copy.deepcopy(model), 2)[0](ids)
        stages = build_stages(model, 2)
        keep_only(model, [stages[1]])
        assert isinstance(model.transformer.wte, _ShapeOnly) and isinstance(model.transformer.wpe, _ShapeOnly)
        assert isinstance(model.transformer.h[0], _Pass) and not isinstance(model.transformer.h[3], _Pass)
        assert model.lm_head.weight.device.type == "cpu"  # the tied head keeps the real weight
        assert stages[1](hidden).shape == (2, 12, 128)


def test_split_balances_parameters():
    from hftk.strategies.pipeline import split_blocks

    assert split_blocks([10] * 4, head=0, tail=0, n_stages=2) == [range(0, 2), range(2, 4)]
    # heavy embeddings: the first stage takes fewer blocks
    assert split_blocks([10] * 8, head=25, tail=0, n_stages=2) == [range(0, 3), range(3, 8)]
    assert split_blocks([10] * 8, head=30, tail=30, n_stages=2) == [range(0, 4), range(4, 8)]
    assert [len(r) for r in split_blocks([1] * 5, head=0, tail=0, n_stages=5)] == [1] * 5
    with pytest.raises(ValueError):
        split_blocks([1] * 3, head=0, tail=0, n_stages=4)


def _bloom_folder(tmp: Path) -> Path:
    from transformers import BloomConfig

    folder = tmp / "bloom"
    BloomConfig(vocab_size=128, hidden_size=32, n_layer=4, n_head=4).save_pretrained(folder)
    return folder


def _resume_folder(tmp: Path) -> Path:
    from hftk.checkpoint.atomic import seal

    ckpt = tmp / "out-resume" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / "pipeline.json").write_text(json.dumps({"pp_size": 2, "dp_size": 1, "num_stages": 2}))
    seal(ckpt, 3)
    return tmp / "out-resume"


ERRORS = [
    # (id, world size, args, field named)
    ("one_stage", 2, ["--pp_size", "1"], "strategy.pp_size"),
    ("pp_size_without_pipeline", 2, ["--strategy", "ddp"], "strategy.pp_size"),
    ("world_not_multiple", 3, [], "strategy.pp_size"),
    ("microbatches_not_dividing", 2, ["--pp_microbatches", "3"], "strategy.pp_microbatches"),
    ("1f1b_too_few_microbatches", 2, ["--pp_microbatches", "1"], "strategy.pp_microbatches"),
    ("interleaved_rounds", 2, ["--pp_schedule", "interleaved_1f1b", "--pp_microbatches", "5",
                               "--per_device_train_batch_size", "10"], "strategy.pp_microbatches"),
    ("more_stages_than_layers", 4, ["--model_name_or_path", "builtin:gpt2-tiny", "--pp_size", "4"], "strategy.pp_size"),
    ("interleaved_too_few_layers", 2, ["--model_name_or_path", "builtin:gpt2-tiny", "--pp_schedule", "interleaved_1f1b"],
     "strategy.pp_virtual_stages"),
    ("interleaved_one_virtual", 2, ["--pp_schedule", "interleaved_1f1b", "--pp_virtual_stages", "1"],
     "strategy.pp_virtual_stages"),
    ("blocks_returning_tuples", 2, ["--model_name_or_path", "{bloom}"], "Bloom ('bloom') cannot run under strategy "
     "pipeline: its blocks return a tuple"),
    ("with_tp", 4, ["--tp_size", "2"], "strategy.tp_size"),
    ("with_fsdp_sharding", 4, ["--dp_shard_size", "2"], "strategy.dp_shard_size"),
    ("with_zero3", 2, ["--deepspeed", "{tmp}/ds.json"], "training.deepspeed"),
    ("with_fsdp", 2, ["--fsdp", "full_shard"], "training.fsdp"),
    ("with_compression", 2, ["--grad_compression", "fp16"], "strategy.grad_compression"),
    ("resume_other_layout", 4, ["--output_dir", "{resume}", "--resume_from_checkpoint", "latest"],
     "training.resume_from_checkpoint"),
]


@pytest.mark.parametrize("case_id,world,args,needle", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_pipeline_config_is_named_before_any_process_group(case_id, world, args, needle, tmp_path, monkeypatch):
    import torch.distributed as dist

    from hftk.core.errors import HftkError
    from hftk.run.prepare import prepare

    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    subs = {"{tmp}": str(tmp_path), "{bloom}": str(_bloom_folder(tmp_path)) if case_id == "blocks_returning_tuples" else "",
            "{resume}": str(_resume_folder(tmp_path)) if case_id == "resume_other_layout" else ""}
    args = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in args]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(HftkError) as err:
        prepare([*TINY_ARGS, "--model_name_or_path", MODELS["gpt2"], *PIPE, "--output_dir", str(tmp_path / "out"),
                 *args])
    assert needle in err.value.one_line() and "Fix:" in err.value.one_line()
    assert not dist.is_initialized()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family,attn", [*((f, ATTENTION.get(f, "sdpa")) for f in FAMILIES), ("gpt2", "eager"),
                                         ("llama", "eager")])
def test_bfd_example_through_pipeline_stages_equals_the_example_alone(family_models, family, attn):
    """The pipeline engine's path, in one process: its collator (rows of block_size), the batch's inputs as
    ``_schedule_inputs`` hands them to every stage, and the stages run one after another. Each stage
    must build the packed mask from the travelling position ids (fails when they restart at 0 per stage)."""
    from transformers import AutoModelForCausalLM

    from hftk.strategies.pipeline import _pad_rows, build_stages

    model = AutoModelForCausalLM.from_pretrained(family_models[family], attn_implementation=attn).eval()
    items, batch = packed(model.config.vocab_size, fixed_length=32)
    batch = _pad_rows(batch, batch["input_ids"].shape[0] + 1)  # as a short batch is filled up to micro-batches
    assert batch["input_ids"].shape[1] == 32 and set(batch) == {"input_ids", "labels", "position_ids"}
    hidden, carried = batch["input_ids"], ()
    with torch.no_grad():
        for stage in build_stages(model, 2):  # a mixture of experts' stages carry its balancing-loss sums too
            out = stage(hidden, *carried, position_ids=batch["position_ids"])
            hidden, *carried = out if isinstance(out, tuple) else (out,)
    assert_examples_apart(model, items, {k: v[:-1] for k, v in batch.items()}, hidden[:-1])


MOE_CONFIGS = {  # 4 experts, top-2, 4 layers: the balancing loss's sums cross the stage boundaries
    "qwen3_moe": {**SMALL, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "mlp_only_layers": [0]},
    "mixtral": {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {**SMALL, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "olmoe": {**SMALL, "num_experts": 4, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("family", sorted(MOE_CONFIGS))
def test_moe_stage_chain_gives_the_models_logits_and_its_whole_balancing_loss(family):
    """Each stage adds its MoE layers' routing to sums carried to the next; the last stage's balancing loss
    equals the one the model computes over all its layers at once (padding mask included), and its gradient
    reaches every stage's routers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hftk.strategies.pipeline import build_stages

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **MOE_CONFIGS[family]))
    model.set_experts_implementation("eager")
    ids = torch.randint(0, 128, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    ref = model.eval()(input_ids=ids, attention_mask=mask, output_router_logits=True)
    (model.router_aux_loss_coef * ref.aux_loss).backward()  # the balancing loss's own gradient, whole model
    want = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for n in (2, 4):
        stages = build_stages(model, n)
        carried, hidden = (), ids
        for stage in stages:
            hidden, *carried = stage.train()(hidden, *carried, attention_mask=mask)
        assert torch.allclose(hidden, ref.logits, atol=1e-6), n
        (aux,) = carried  # the last stage's output: (logits, the balancing loss over every stage's routers)
        assert float(aux) == pytest.approx(float(ref.aux_loss), rel=1e-6), n
        (model.router_aux_loss_coef * aux).backward()  # its gradient crosses the stages through the carried sums
        got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        assert want.keys() == got.keys(), n
        assert all(torch.allclose(got[k], want[k], atol=1e-9, rtol=1e-5) for k in want), n
        model.zero_grad()
